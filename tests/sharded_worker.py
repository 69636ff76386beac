"""Runs jaxmodel on forced host devices for tests/test_sharding.py, in a process of its own
(the device count is fixed when JAX starts, and pytest's process has one device).

    python tests/sharded_worker.py JOB.json OUT.npz

JOB: {"checkpoint": folder, "devices": 8, "policies": [...], "meshes": [null or {"data": 2, ...}] (a mesh's
"sums" key: shard_sums),
"invariant": bool, "process": [id, count, port] (optional: jax.distributed on localhost),
"controls": bool (compare/controls/sharding.py's controls through the ladder), "repro": a folder (each
control's report also written as a repro case there, tests/test_repro_more.py),
"where": bool (probe where --circumstance sharding), "port": bool (a user's sharded JaxFunction)}.
OUT holds, per policy and mesh, the raw results (logits, taps, greedy tokens, decode logits,
per-device parameter bytes, the cache's shard shape); the test compares them. Only process 0
writes (to a temporary name, renamed).
"""

import json
import os
import sys
from pathlib import Path

job = json.loads(Path(sys.argv[1]).read_text())
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={job['devices']}")

import jax  # noqa: E402
import numpy as np  # noqa: E402

if job.get("process"):
    pid, count, port = job["process"]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid)
else:
    pid = 0

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jaxmodel  # noqa: E402
from jaxmodel.sharding import per_device_bytes  # noqa: E402
from llamaspec import load_weights  # noqa: E402

cfg, weights = load_weights(job["checkpoint"])
rng = np.random.default_rng(job.get("seed", 0))
B, T = 4, 11
ids = rng.integers(3, cfg.vocab_size, (B, T))
mask = np.ones_like(ids)
mask[1, :3] = 0           # a left-padded row
mask[3, :1] = 0
taps = ["embed", "layers.*.q_rope", "layers.*.k_rope", "layers.*.v", "layers.*.attn_ctx", "layers.*.attn_out",
        "layers.*.act", "layers.*.out", "final_norm", "logits"]
out = {"mask": mask}
if job.get("controls"):       # the planted sharding bugs and the clean sharded run, through the ladder
    from compare.controls import check, run_control
    from compare.controls.sharding import SHARDING_CONTROLS
    for name, control in SHARDING_CONTROLS.items():
        report = run_control(control, job["checkpoint"], ids[:2], mask[:2])
        d = report.first_divergence
        out[name] = np.asarray([report.verdict, d.tap if d else "", str(d.layer) if d else "",
                                d.component if d else "", "; ".join(check(control, report)), report.candidate])
        if job.get("repro"):      # the report's first divergent unit as a case, the sides made again
            from compare.repro import write_repro
            write_repro(report, "torchref", control.side(job["checkpoint"]), job["checkpoint"],
                        Path(job["repro"]) / name, inputs=(ids[:2], mask[:2]))
if job.get("where"):          # probe where --circumstance sharding, default and batch-invariant mode
    from compare.probes import load_model
    from compare.probes.where import probe_where
    for mode in ("default", "invariant"):
        model = "jaxmodel" if mode == "default" else load_model("jaxmodel", job["checkpoint"], "fp32",
                                                                batch_invariant=True)
        r = probe_where(model, "sharding", checkpoint=job["checkpoint"], policy="fp32", length=12)
        for c in r.comparisons:
            fd = c.first_difference
            out[f"where|{mode}|{c.b_run}"] = np.asarray([c.verdict, fd.tap if fd else "",
                                                         str(sum(d.bitwise_equal for d in c.taps)), str(len(c.taps))])
if job.get("attention"):      # the fused attention kernel per shard (sharding.per_shard_attention) and on one device
    import functools

    import jax.numpy as jnp

    from jaxmodel import fast, plan, sharding
    from jaxmodel.model import causal_allowed
    from llamaspec import Policy
    allowed = causal_allowed(mask, T)
    for policy, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
        pol = Policy.get(policy)
        q = jnp.asarray(rng.normal(size=(B, T, cfg.num_attention_heads, cfg.head_dim)), dtype)
        k, v = (jnp.asarray(rng.normal(size=(B, T, cfg.num_key_value_heads, cfg.head_dim)), dtype) for _ in "kv")
        kernel = functools.partial(fast.fused, policy=pol)
        one = jax.jit(kernel)(q, k, v, allowed)
        out[f"attention|{policy}|none"] = np.asarray(one.astype(jnp.float32))
        for mesh in job["attention"]:
            lay = sharding.layout_for(cfg, mesh)
            got = jax.jit(functools.partial(sharding.per_shard_attention, lay, kernel))(q, k, v, allowed)
            out[f"attention|{policy}|" + ",".join(f"{a}={n}" for a, n in sorted(mesh.items()))] = np.asarray(
                got.astype(jnp.float32))
        # the model on a mesh calls the kernel (per shard) in its prefill
        from jaxmodel import kernels
        sharded = jaxmodel.from_weights(cfg, weights, policy, mesh={"tensor": 2})
        text = sharded.prefill_program_text(ids, mask, T + 4)
        out[f"attention|{policy}|calls"] = np.asarray(text.count(kernels.PREFIX + "attention"))
        out[f"attention|{policy}|prefill"] = sharded.prefill(ids, mask, T + 4)[0].astype(np.float64)
        alone = jaxmodel.from_weights(cfg, weights, policy)
        out[f"attention|{policy}|prefill one device"] = alone.prefill(ids, mask, T + 4)[0].astype(np.float64)
        out[f"attention|{policy}|applies"] = np.asarray(plan.load(pol, "cpu", "fast")[1].fused_attention(pol))
if job.get("port"):           # a user's own JAX port with sharded params, through JaxFunction
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from test_generic_adapters import llama_forward

    import compare
    from compare.adapters.generic import JaxFunction
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    params = {k: jax.device_put(np.asarray(v, np.float32), NamedSharding(mesh, P("model", *(None,) * (v.ndim - 1))))
              for k, v in weights.items()}

    def forward(params, ids, mask, positions, inject=None):
        return llama_forward(jnp, params, cfg, jnp.asarray(ids), mask, positions, inject)
    port = JaxFunction(forward, params, name="sharded jax llama", taps="*", num_layers=cfg.num_hidden_layers)
    report = compare.compare_models("torchref", port, job["checkpoint"], inputs=(ids, mask))
    twin = port.float64()
    out["port|verdict"] = np.asarray(report.verdict)
    out["port|twin_devices"] = np.asarray(sorted(len(v.sharding.device_set) for v in twin.params.values()))
    out["port|twin_logits"] = twin.capture(ids, mask, ["logits"])[0].astype(np.float64)
    import torchref
    out["port|ref_logits"] = torchref.from_pretrained(job["checkpoint"], policy="fp64").capture(
        ids, mask, ["logits"])[0]
    # an NNX module with a sharded state (jaxmodel's own Llama on a mesh, as a user's module), NnxModule
    from compare.adapters.generic import NnxModule
    from jaxmodel.model import Llama, causal_allowed
    from jaxmodel.sharding import layout_for
    from llamaspec import Policy
    module = Llama(cfg, Policy.get("fp32"), weights, False, layout_for(cfg, {"data": 2, "tensor": 2}))

    def nnx_forward(module, ids, mask, positions):
        return module(jnp.asarray(ids), jnp.asarray(positions), causal_allowed(jnp.asarray(mask), ids.shape[1]))[0]
    nnx_port = NnxModule(module, {"layers.{i}.out": "layers.{i}"}, name="sharded nnx llama", forward=nnx_forward,
                         num_layers=cfg.num_hidden_layers)
    report = compare.compare_models("torchref", nnx_port, job["checkpoint"], inputs=(ids, mask),
                                    teacher_forcing=False)
    out["nnx|verdict"] = np.asarray(report.verdict)
    twin = nnx_port.float64()
    out["nnx|twin_devices"] = np.asarray(sorted({len(x.sharding.device_set) for x in jax.tree.leaves(
        twin.module.layers[0].mlp.up_proj.weight[...])}))
for policy in job.get("policies", ()):
    for mesh in job["meshes"]:
        name = f"{policy}|{'none' if mesh is None else ','.join(f'{k}={v}' for k, v in sorted(mesh.items()))}"
        axes = None if mesh is None else {k: v for k, v in mesh.items() if k != "sums"}
        m = jaxmodel.from_weights(cfg, weights, policy, batch_invariant=job.get("invariant", False), mesh=axes,
                                  shard_sums=(mesh or {}).get("sums", "ordered"))
        if job.get("invariant"):
            out[name + "|logits"] = np.asarray(m(ids, mask)).astype(np.float64)
        else:
            logits, acts = m.capture(ids, mask, taps=taps)
            out[name + "|logits"] = logits.astype(np.float64)
            for tap, a in acts.items():
                out[name + "|tap|" + tap] = a.astype(np.float64)
            first, cache = m.prefill(ids, mask, T + 4)
            step, cache = m.decode(cache, first.argmax(-1))
            out[name + "|prefill"] = first.astype(np.float64)
            out[name + "|decode"] = step.astype(np.float64)
            out[name + "|cache_shard"] = np.asarray(cache["k"].addressable_shards[0].data.shape)
            # teacher forcing on the decode path: layer 1's input replaced in the prompt and at the step
            forced = np.random.default_rng(1).standard_normal((B, T + 1, cfg.hidden_size))
            first, cache, _ = m.prefill_capture(ids, mask, T + 4, taps=["layers.1.out"], inject={1: forced[:, :T]})
            step, _, acts = m.decode_capture(cache, first.argmax(-1), taps=["layers.1.k_rope", "logits"],
                                             inject={1: forced[:, T:]})
            out[name + "|forced_prefill"] = first.astype(np.float64)
            out[name + "|forced_decode"] = step.astype(np.float64)
            out[name + "|forced_k_rope"] = acts["layers.1.k_rope"].astype(np.float64)
            w = m.weights()
            out[name + "|k_proj"] = np.asarray(w["model.layers.0.self_attn.k_proj.weight"]).astype(np.float64)
        out[name + "|greedy"] = m.generate(ids, mask, max_new_tokens=6)
        out[name + "|bytes"] = np.asarray(sorted(per_device_bytes(m.state).values()))
if pid == 0:
    target = Path(sys.argv[2])
    tmp = target.with_name(target.name + ".partial.npz")
    np.savez(tmp, **out)
    os.replace(tmp, target)
