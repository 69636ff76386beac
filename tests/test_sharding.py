"""jaxmodel on a mesh (jaxmodel/sharding.py): sharded runs against the unsharded one on forced
host devices, in worker processes (tests/sharded_worker.py), two of them under
jax.distributed; the size rules in this process."""

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from repro_checks import first_difference, run_case

from compare.metrics import rel_l2
from llamaspec import LlamaConfig
from llamaspec.errors import InputError
from llamaspec.files import atomic_write
from llamaspec.testing import make_checkpoint

WORKER = Path(__file__).with_name("sharded_worker.py")
# eight query heads, so that tensor = 2, 4 and 8 all divide them; KV heads 8, 2, 1
SHARDED = dict(num_attention_heads=8, hidden_size=32, intermediate_size=64, vocab_size=96)
KINDS = {"mha": 8, "gqa": 2, "mqa": 1}
MESHES = [None, {"tensor": 2}, {"tensor": 4}, {"tensor": 8}, {"data": 2}, {"data": 2, "tensor": 4},
          {"data": 2, "tensor": 4, "sums": "all-reduce"}]     # the last: XLA's psum for the cross-shard sums


def mesh_name(mesh) -> str:
    """The worker's name for a mesh (its "sums" key included)."""
    return "none" if mesh is None else ",".join(f"{k}={v}" for k, v in sorted(mesh.items()))


def run_workers(jobs: list[dict], folder: Path, timeout=600) -> list[dict]:
    """Runs each job in its own worker process (in parallel) and returns each one's results;
    a job with "process": [i, n, port] is one of n processes of a jax.distributed run."""
    def one(i, job):
        spec, out = folder / f"job{i}.json", folder / f"out{i}.npz"
        atomic_write(spec, json.dumps(job), "worker job")
        done = subprocess.run([sys.executable, str(WORKER), str(spec), str(out)], capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "PYTHONHASHSEED": "0"})
        assert done.returncode == 0, f"worker {i} failed:\n{done.stderr[-4000:]}"
        return dict(np.load(out)) if out.exists() else {}
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, range(len(jobs)), jobs))


@pytest.fixture(scope="module")
def fp64_runs(tmp_path_factory):
    """{kind: results} for MHA, GQA and MQA at fp64 on every mesh of MESHES."""
    root = tmp_path_factory.mktemp("sharded")
    jobs = [{"checkpoint": str(make_checkpoint(root / kind, num_key_value_heads=kv, **SHARDED)),
             "devices": 8, "policies": ["fp64"], "meshes": MESHES} for kind, kv in KINDS.items()]
    return dict(zip(KINDS, run_workers(jobs, root)))


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_fp64_agrees_with_unsharded(fp64_runs, kind):
    """Every tap, the logits, prefill and decode logits (also teacher-forced: prefill_capture and
    decode_capture with inject) within 1e-12 of the unsharded model, at TP 2/4/8, DP 2 and DP 2 x
    TP 4 (shard-order sums and XLA's all-reduce), with the same greedy tokens and the same
    weights back."""
    r = fp64_runs[kind]
    base = {k.split("|", 2)[2]: v for k, v in r.items() if k.startswith("fp64|none|")}
    assert any(k.startswith("tap|layers.") for k in base) and {"decode", "forced_decode"} <= set(base)
    for mesh in MESHES[1:]:
        name = mesh_name(mesh)
        for what, ref in base.items():
            got = r[f"fp64|{name}|{what}"]
            if what in ("bytes", "cache_shard"):
                continue
            if what == "greedy":
                np.testing.assert_array_equal(got, ref, err_msg=f"{kind} {name}: greedy tokens")
                continue
            assert got.shape == ref.shape, (kind, name, what)
            err = float(np.max(np.abs(got - ref)))
            assert err <= 1e-12, f"{kind} {name} {what}: max |sharded - unsharded| = {err:.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_per_device_memory_falls_with_tensor_size(fp64_runs, kind):
    """Parameter bytes per device: the sharded weights divided by TP, only the norms' vectors
    (and KV heads kept twice or more where there are fewer than TP) on top; DP alone halves
    nothing. The cache's shard holds its tensor share of the KV heads."""
    r = fp64_runs[kind]
    total = int(r["fp64|none|bytes"].sum())
    kv = KINDS[kind]
    L, d, hd = 2, SHARDED["hidden_size"], SHARDED["hidden_size"] // SHARDED["num_attention_heads"]
    norms = (2 * L + 1) * d * 8
    kv_bytes = 2 * L * kv * hd * d * 8            # k_proj and v_proj of every layer
    for mesh in MESHES[1:]:
        t = mesh.get("tensor", 1)
        per = r[f"fp64|{mesh_name(mesh)}|bytes"]
        assert len(per) == t * mesh.get("data", 1) and len(set(per.tolist())) == 1, (kind, mesh, per)
        copies = max(1, t // kv)                  # each KV head kept t / kv times when kv < t
        want = (total - norms - kv_bytes) // t + norms + kv_bytes * copies // t
        assert int(per[0]) == want, f"{kind} {mesh}: {int(per[0])} bytes per device, expected {want}"
        shard = r[f"fp64|{mesh_name(mesh)}|cache_shard"]
        assert shard[3] == max(kv, t) // t and shard[1] == 4 // mesh.get("data", 1), (kind, mesh, shard)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process_bitwise(tmp_path):
    """jax.distributed on localhost, two processes of four host devices each, against one process
    of eight, on the same meshes: logits, taps, greedy tokens and decode logits bitwise equal,
    at fp32 (the cross-shard sums are added in shard order, not by the all-reduce of
    the runtime, which differs between one process and two)."""
    ckpt = make_checkpoint(tmp_path / "gqa", num_key_value_heads=2, **SHARDED)
    meshes = [{"data": 2, "tensor": 4}, {"tensor": 8}]
    common = {"checkpoint": str(ckpt), "policies": ["fp32"], "meshes": meshes}
    port = _free_port()
    one, two, _ = run_workers([{**common, "devices": 8},
                               {**common, "devices": 4, "process": [0, 2, port]},
                               {**common, "devices": 4, "process": [1, 2, port]}], tmp_path)
    assert set(one) == set(two) and any("|tap|layers." in k for k in one)
    for key in one:
        if key.endswith("|bytes") or key == "mask":
            continue
        np.testing.assert_array_equal(two[key], one[key], err_msg=key)


def test_fused_attention_on_a_mesh_is_bitwise_the_one_device_one(tmp_path):
    """jaxmodel's fused CPU attention on a mesh runs on each device's rows and heads
    (sharding.per_shard_attention, a shard_map of the custom call, which XLA cannot partition); its
    result for a row and a KV head depends on nothing else, so TP 2, DP 2 and DP 2 x TP 2 give
    the one-device bits, at fp32 and bf16 (GQA: 8 query heads on 2 KV heads). The model's
    prefill on a mesh calls it in every layer where the plan's fused_attention says so (an AVX2 or better
    kernel path), else not at all."""
    ckpt = make_checkpoint(tmp_path / "gqa", num_key_value_heads=2, **SHARDED)
    meshes = [{"tensor": 2}, {"data": 2}, {"data": 2, "tensor": 2}]
    (r,) = run_workers([{"checkpoint": str(ckpt), "devices": 8, "attention": meshes}], tmp_path)
    for policy in ("fp32", "bf16"):
        one = r[f"attention|{policy}|none"]
        assert np.isfinite(one).all() and np.abs(one).max() > 0
        for mesh in meshes:
            got = r[f"attention|{policy}|" + mesh_name(mesh)]
            np.testing.assert_array_equal(got, one, err_msg=f"{policy} {mesh}")
        calls, layers = int(r[f"attention|{policy}|calls"]), LlamaConfig.from_file(ckpt).num_hidden_layers
        assert calls >= layers if r[f"attention|{policy}|applies"] else calls == 0
        # the prefill on a mesh (bf16: through its widened cache) is the one-device prefill, up to the
        # order of the tensor-parallel sums
        # (measured 1.1e-7 fp32, 3e-8 bf16; the bounds are test_fused_attention's for a change of sums)
        got, alone = r[f"attention|{policy}|prefill"], r[f"attention|{policy}|prefill one device"]
        assert np.isfinite(got).all() and rel_l2(got, alone) <= (1e-5 if policy == "fp32" else 2e-2)


@pytest.mark.slow     # on demand (make test-all): the default suite keeps the fp64, process and control tests
def test_invariant_mode_on_a_mesh_is_bitwise_the_unsharded_one(tmp_path):
    """The batch-invariant mode on a mesh: the same logits and greedy tokens, bit for bit, as
    without one (its fixed-order products run whole on each device: docs/sharding.md)."""
    ckpt = make_checkpoint(tmp_path / "gqa", num_key_value_heads=2, **SHARDED)
    meshes = [None, {"data": 2, "tensor": 4}, {"tensor": 8}]
    (r,) = run_workers([{"checkpoint": str(ckpt), "devices": 8, "policies": ["bf16"], "meshes": meshes,
                         "invariant": True}], tmp_path)
    for mesh in meshes[1:]:
        for what in ("logits", "greedy"):
            np.testing.assert_array_equal(r[f"bf16|{mesh_name(mesh)}|{what}"], r[f"bf16|none|{what}"],
                                          err_msg=f"{mesh} {what}")


# ---- the size rules, in this process (no devices needed) ----

def _cfg(**kw) -> LlamaConfig:
    from llamaspec.testing import TINY
    return LlamaConfig.from_dict({**TINY, **SHARDED, **kw})


def test_sizes_that_do_not_divide_are_named():
    from jaxmodel.sharding import ShardingError, check_sizes
    with pytest.raises(ShardingError, match=r"num_attention_heads 8 does not divide over tensor=3 "
                                            r"\(tensor sizes that do: 1, 2, 4, 8\)"):
        check_sizes(_cfg(num_key_value_heads=8), 3)
    with pytest.raises(ShardingError, match="num_key_value_heads 3 neither divides over tensor=2"):
        check_sizes(_cfg(num_attention_heads=6, num_key_value_heads=3, hidden_size=36), 2)
    with pytest.raises(ShardingError, match="intermediate_size 60 does not divide over tensor=8"):
        check_sizes(_cfg(num_key_value_heads=8, intermediate_size=60), 8)


def test_kv_heads_fewer_than_shards_are_repeated_and_vocab_replicated():
    from jaxmodel.sharding import check_sizes, repeat_heads
    rules, repeat = check_sizes(_cfg(num_key_value_heads=2, vocab_size=99), 8)
    assert repeat == 4 and rules["vocab"] is None and rules["heads"] == "tensor"
    assert check_sizes(_cfg(num_key_value_heads=8), 4) == ({**rules, "vocab": "tensor"}, 1)
    # 8 query heads: before, query head h reads KV head h // 4 (2 KV heads); after the repeat there
    # are 8 stored heads, one per query head, and stored head h must be a copy of KV head h // 4
    w = np.arange(2 * 4 * 3).reshape(2 * 4, 3)          # 2 KV heads of head_dim 4, hidden 3
    rep = repeat_heads(w, 4, 4).reshape(8, 4, 3)
    for h in range(8):
        np.testing.assert_array_equal(rep[h], w.reshape(2, 4, 3)[h // 4])


def test_mesh_arguments_are_checked():
    from jaxmodel.sharding import ShardingError, make_mesh, parse_mesh
    assert parse_mesh("data=2, tensor=4") == {"data": 2, "tensor": 4}
    with pytest.raises(ShardingError, match="each part is axis=size"):
        parse_mesh("data:2")
    with pytest.raises(ShardingError, match=r"unknown axis \['model'\]"):
        make_mesh({"model": 2})
    with pytest.raises(ShardingError, match="needs 64 devices; JAX has"):
        make_mesh({"data": 8, "tensor": 8})


def test_batch_that_does_not_divide_over_data_is_an_error():
    from jaxmodel.sharding import check_batch
    check_batch(4, 2)
    with pytest.raises(InputError, match="batch of 3 rows does not divide over the mesh's data axis"):
        check_batch(3, 2)


def test_planted_sharding_bugs_are_found_at_their_layer_and_component(tmp_path):
    """compare/controls/sharding.py through the ladder, tensor-parallel jaxmodel (tensor=2, GQA 8
    heads / 2 KV heads) against torchref at fp32: the clean sharded run is drift; a missing
    cross-shard sum of o_proj, query heads reading the next shard's KV heads and RoPE applied
    per head_dim shard are each semantic, first at layer 1's attn_out, attn_ctx and q_rope.
    Each report's repro case (written in the worker, the sharded side made again there) shows the
    bug at that tap when run without the project (tests/repro_checks.py), the clean one none."""
    from compare.controls.sharding import SHARDING_CONTROLS
    ckpt = make_checkpoint(tmp_path / "gqa", num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=3)
    cases = tmp_path / "cases"
    (r,) = run_workers([{"checkpoint": str(ckpt), "devices": 8, "controls": True, "repro": str(cases)}], tmp_path)
    assert set(r) - {"mask"} == set(SHARDING_CONTROLS)
    for name, control in SHARDING_CONTROLS.items():
        verdict, tap, layer, component, problems, candidate = r[name].tolist()
        assert candidate.startswith("jaxmodel (mesh data=1, tensor=2)"), candidate
        assert problems == "", f"{name}: {problems} (verdict {verdict}, first at {tap} {component})"
        assert verdict == control.verdict and tap == (control.expected_tap or "")
        done = run_case(cases / name, tmp_path)
        want = (0, None) if control.expected_tap is None else (1, control.expected_tap)
        assert (done.returncode, first_difference(done.stdout)) == want, f"{name}:\n{done.stdout}{done.stderr}"
        assert "mesh data=1, tensor=2" in (cases / name / "README.txt").read_text()


@pytest.mark.slow     # on demand (make test-all): the default suite keeps the fp64, process and control tests
def test_probe_where_sharding_circumstance(tmp_path):
    """probe where --circumstance sharding on the tiny GQA model (8 heads, 2 KV heads): one device
    against tensor 2, 4, 8 and data 2. The default mode parts from the one-device run only by
    rounding (exact or drift, as this CPU's kernels split the products); the batch-invariant
    mode is bitwise the same on every mesh (its products run whole on each device)."""
    ckpt = make_checkpoint(tmp_path / "gqa", num_key_value_heads=2, **SHARDED)
    (r,) = run_workers([{"checkpoint": str(ckpt), "devices": 8, "where": True}], tmp_path)
    meshes = ["mesh tensor=2", "mesh tensor=4", "mesh tensor=8", "mesh data=2"]
    want = {f"where|{mode}|{m}" for mode in ("default", "invariant") for m in meshes}
    assert set(r) - {"mask"} == want
    for m in meshes:
        verdict, first, equal, taps = r[f"where|default|{m}"].tolist()
        assert verdict in ("exact", "drift"), (m, verdict, first)
        verdict, first, equal, taps = r[f"where|invariant|{m}"].tolist()
        assert verdict == "exact" and equal == taps, (m, verdict, first, f"{equal}/{taps}")


@pytest.mark.slow     # on demand (make test-all): the default suite keeps the fp64, process and control tests
def test_a_users_sharded_jax_port(tmp_path):
    """A user's own JAX port (a plain function, JaxFunction) whose params are sharded over a 2 x 2
    mesh of their own: compared with torchref as it is (its taps gathered to numpy), drift at
    fp32; its float64 twin keeps the params sharded and agrees with torchref at fp64. An NNX module
    with a sharded state (jaxmodel's own Llama on a 2 x 2 mesh, through NnxModule): drift at fp32,
    its twin's state still sharded (its logits are not checked: that module computes at its
    policy whatever its state's dtype, unlike a user's)."""
    ckpt = make_checkpoint(tmp_path / "gqa", num_key_value_heads=2, **SHARDED)
    (r,) = run_workers([{"checkpoint": str(ckpt), "devices": 4, "port": True}], tmp_path)
    assert str(r["port|verdict"]) in ("exact", "drift")
    assert set(r["port|twin_devices"].tolist()) == {4}
    real = r["mask"].astype(bool)
    assert np.abs(r["port|twin_logits"][real] - r["port|ref_logits"][real]).max() < 1e-10
    assert str(r["nnx|verdict"]) in ("exact", "drift")
    assert set(r["nnx|twin_devices"].tolist()) == {4}
