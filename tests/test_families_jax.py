"""jaxmodel on Llama's relatives beyond tests/test_families.py (which runs both models): the family
ops against torchref's bit for bit where the two frameworks' arithmetic allows, the streamed path
(LayerRunner) giving the whole model's taps, the plan's namespace, and the families on a mesh
(forced host devices, a process of its own) against one device."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxmodel
import jaxmodel.model as jm
from jaxmodel import ops as jops
from jaxmodel import plan as jplan
from jaxmodel.sharding import ShardingError, check_sizes
from llamaspec import LlamaConfig, Policy, load_weights
from llamaspec import taps as tapnames
from llamaspec.testing import TINY, TINY_FAMILIES, make_checkpoint

FAMILY_NAMES = tuple(TINY_FAMILIES)
IDS = np.random.default_rng(0).integers(3, TINY["vocab_size"], (2, 10))
MASK = np.ones_like(IDS)
MASK[1, :3] = 0          # a left-padded row


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = make_checkpoint(tmp_path_factory.mktemp(f"famjax_{name}"), **TINY_FAMILIES[name])
        return made[name]
    return get


def cfg_of(family) -> LlamaConfig:
    return LlamaConfig.from_dict({**TINY, **TINY_FAMILIES[family]})


# ----- the family's ops against torchref's ---------------------------------------------------------

def _pair(dtype_name, shape=(64, 1000), scale=4.0, seed=0):
    """The same values as a torch tensor and a jax array in dtype `dtype_name`."""
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    t = torch.from_numpy(x).to(getattr(torch, dtype_name))
    return t, jnp.asarray(t.to(torch.float64).numpy()).astype(getattr(jnp, dtype_name))


def _bits(t, j) -> np.ndarray:
    """Where a torch result and a jax one differ (as float64, exact for every dtype here)."""
    import torch
    return t.to(torch.float64).numpy() != np.asarray(j.astype("float64"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_embedding_scale_and_offset_norm_weights_are_torchrefs_bits(dtype):
    """scale_embedding (sqrt(hidden) rounded to the rows' dtype as torch rounds it) and the norm's
    weight step with Gemma's offset, in both conventions (the family's: Llama's rounding first,
    Gemma's weight in norm_dtype), give torchref's bits; the whole norm (whose mean sums in each
    framework's order) agrees to rounding."""
    import jax
    import torch

    from torchref import ops as tops
    t, j = _pair(dtype)
    for hidden in (32, 2304, 3584):
        got = jax.jit(jops.scale_embedding, static_argnums=1)(j, hidden)
        assert not _bits(tops.scale_embedding(t, hidden), got).any(), hidden
    wt, wj = _pair(dtype, (1000,), 0.2, seed=1)
    name = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    for in_norm_dtype in (False, True):
        policy = Policy.get(name).for_family(in_norm_dtype)
        assert policy.norm_cast_before_weight is not in_norm_dtype
        ht, hj = _pair(policy.norm_dtype, seed=2)
        ours = jax.jit(lambda h, x, w: jops.norm_weight(h, x, w, policy, offset=1.0))(hj, j, wj)
        assert not _bits(tops.norm_weight(ht, t, wt, policy, offset=1.0), ours).any(), in_norm_dtype
        ours = np.asarray(jax.jit(lambda x, w: jops.rms_norm(x, w, 1e-6, policy, offset=1.0))(j, wj), np.float64)
        theirs = tops.rms_norm(t, wt, 1e-6, policy, offset=1.0).to(torch.float64).numpy()
        ulp = {"float64": 1e-15, "float32": 1e-6, "bfloat16": 1e-2, "float16": 1e-3}[dtype]
        np.testing.assert_allclose(ours, theirs, rtol=ulp, atol=ulp)


# One unit roundoff of each dtype (half an ulp at 1).
_EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_soft_cap_and_gelu_agree_with_torchref_to_rounding(dtype):
    """soft_cap and gelu_tanh: torch's formula, order and constants, each step in opmath, rounded
    once to the dtype. Both frameworks' tanh are within an ulp or two of the exact value (XLA's
    float32 tanh is not: jaxmodel takes it through float64), but which values they round the other
    way depends on the CPU's code path (torch's vector and scalar tanh differ), so the bound is one
    any CPU meets: |jax - torch| <= 4 unit roundoffs of the dtype times the value's scale (|x| for
    GELU, whose 1 + tanh cancels where x is very negative; the result for the cap)."""
    import jax
    import torch

    from torchref import ops as tops
    t, j = _pair(dtype)
    x = t.to(torch.float64).numpy()
    cap_of = jax.jit(jops.soft_cap, static_argnums=1)
    pairs = [(f"soft_cap {cap}", tops.soft_cap(t, cap), cap_of(j, cap)) for cap in (1.5, 30.0, 50.0)]
    for name, theirs, ours in pairs + [("gelu_tanh", tops.gelu_tanh(t), jax.jit(jops.gelu_tanh)(j))]:
        a, b = theirs.to(torch.float64).numpy(), np.asarray(ours.astype("float64"))
        scale = np.maximum(np.abs(x), np.abs(a)) if name == "gelu_tanh" else np.abs(a)
        worst = float((np.abs(a - b) / (_EPS[dtype] * np.maximum(scale, np.finfo(np.float64).tiny))).max())
        assert worst <= 4, (name, dtype, worst)


def test_attention_scale_and_softcap_follow_the_reference_order():
    """The scale and soft-cap arguments of attention are torchref's: scores scaled, capped in
    compute_dtype, then masked; at fp64 the two frameworks agree to rounding, and each argument
    changes the result."""
    torch = pytest.importorskip("torch")
    from torchref import ops as tops
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 7, h, 8)) for h in (4, 2, 2))
    allowed = np.tril(np.ones((7, 7), bool))[None].repeat(2, 0)
    policy = Policy.get("fp64")
    outs = []
    for kw in ({}, {"scale": 12 ** -0.5}, {"softcap": 1.5}, {"scale": 12 ** -0.5, "softcap": 1.5}):
        ours = np.asarray(jops.attention(q, k, v, allowed, policy, **kw))
        theirs = tops.attention(*(torch.from_numpy(x) for x in (q, k, v, allowed)), policy, **kw).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-13, atol=1e-13)
        outs.append(ours)
    assert all(not np.allclose(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_jaxmodel_matches_torchref_at_bf16(family, family_dir):
    """At bf16 the two references agree on every tap as they do on Llama's (the same roundings;
    products may sum in another order): the logits within bf16 rounding."""
    torchref = pytest.importorskip("torchref")
    folder = family_dir(family)
    t = torchref.from_pretrained(folder, "bf16", backend="reference")
    j = jaxmodel.from_pretrained(folder, "bf16", backend="reference")
    (_, a), (_, b) = t.capture(IDS, MASK, taps="*"), j.capture(IDS, MASK, taps="*")
    real = MASK.astype(bool)
    assert list(a) == list(b) == tapnames.all_taps(j.cfg)
    for name in a:
        x, y = (np.asarray(s[name], np.float64)[real] for s in (a, b))
        assert np.linalg.norm(x - y) <= 2e-2 * np.linalg.norm(x), name


# ----- the streamed path, the plan ---------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "fast"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_layer_runner_gives_the_whole_models_taps(family, backend, family_dir):
    """LayerRunner (the streamed ladder's path) on a family: its embedding (scaled), every layer's
    taps from the forward's input to it (each layer's RoPE and window), the final norm (offset) and
    the logits (soft-capped) are the whole model's bit for bit."""
    folder = family_dir(family)
    cfg, weights = load_weights(folder)
    m = jaxmodel.from_weights(cfg, weights, "fp32", backend=backend)
    _, acts = m.capture(IDS, MASK, taps="*")
    runner = jm.LayerRunner(cfg, "fp32", backend=backend)
    assert runner.plan.ops == m.plan.ops and runner.policy == m.policy
    runner.start(IDS, MASK)
    real = MASK.astype(bool)      # a pad slot's values are the caller's to ignore

    def same(x, name):
        np.testing.assert_array_equal(np.asarray(x)[real], np.asarray(acts[name])[real], err_msg=name)
    same(runner.embed(weights["model.embed_tokens.weight"][IDS]), "embed")
    steps = [f"layers.{{}}.{s}" for s in cfg.layer_steps]
    for i in range(cfg.num_hidden_layers):
        layer = {k: v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")}
        h = acts["embed"] if i == 0 else acts[f"layers.{i - 1}.out"]
        got = runner.block(i, layer, h, [s.format(i) for s in steps])
        for name in steps:
            same(got[name.format(i)], name.format(i))
    x = runner.final_norm(weights["model.norm.weight"], acts[f"layers.{cfg.num_hidden_layers - 1}.out"])
    same(x, "final_norm")
    head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    same(runner.logits(acts["final_norm"], head), "logits")


def test_one_scan_runs_the_blocks_of_every_family(family_dir):
    """One lax.scan runs the blocks where the layers differ in RoPE and window too (Gemma's sliding
    and global layers, Qwen2's windows from max_window_layers on): each layer reads its context by
    index; the forward agrees with prefill (the blocks unrolled) to fp64 rounding."""
    for family in ("mistral", "qwen2", "gemma2", "gemma3_text"):
        m = jaxmodel.from_pretrained(family_dir(family), "fp64", backend="reference")
        assert m.model.same_blocks(), family      # so the forward scans them (_scan_layers)
        logits, _ = m.prefill(IDS, MASK, 12)
        np.testing.assert_allclose(logits, np.asarray(m(IDS, MASK))[:, -1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["gemma2", "olmo2", "qwen2"])
def test_teacher_forcing_and_the_cache_paths_capture_the_family_steps(family, family_dir):
    """inject (a layer's input forced to the forward's own) changes no bit; prefill_capture and
    decode_capture give every family step, equal to a full capture of the longer prompt to fp64
    rounding (decode: the one new position, the window counted over the cache)."""
    m = jaxmodel.from_pretrained(family_dir(family), "fp64", backend="reference")
    _, acts = m.capture(IDS, MASK, taps="*")
    _, forced = m.capture(IDS, MASK, taps="*", inject={1: acts["layers.0.out"]})
    real = MASK.astype(bool)
    for name in acts:
        np.testing.assert_array_equal(np.asarray(forced[name])[real], np.asarray(acts[name])[real], err_msg=name)
    steps = [n for n in tapnames.all_taps(m.cfg) if n.startswith("layers.")]
    T = 7
    logits, cache, pre = m.prefill_capture(IDS[:, :T], MASK[:, :T], 12, steps)
    for name in steps:
        np.testing.assert_allclose(pre[name][real[:, :T]], np.asarray(acts[name])[:, :T][real[:, :T]],
                                   rtol=1e-12, atol=1e-12, err_msg=name)
    _, _, step = m.decode_capture(cache, IDS[:, T], steps)
    _, longer = m.capture(IDS[:, :T + 1], MASK[:, :T + 1], taps=steps)
    for name in steps:
        np.testing.assert_allclose(step[name][:, 0], np.asarray(longer[name])[:, T], rtol=1e-12, atol=1e-12,
                                   err_msg=name)


def test_plan_namespace_takes_declined_ops_and_missing_functions_from_the_reference(family_dir):
    """The fast backend's namespace on Gemma 2: attention, the norms and the activation are the
    reference's (the plan says why), the products and RoPE the backend's; soft_cap and
    scale_embedding (which no backend defines) the reference's. It is hashable (part of the
    graphdef: one compiled program per structure) and equal for equal choices."""
    cfg = cfg_of("gemma2")
    policy = Policy.get("fp32").for_family(cfg.norm_weight_in_norm_dtype)
    plan, ns = jplan.load(policy, "cpu", "fast", cfg=cfg)
    assert isinstance(ns, jplan.WithReference) and ns.declined == {"norm", "attention", "mlp"}
    for name in ("attention", "rms_norm", "norm_weight", "gelu_tanh", "silu", "soft_cap", "scale_embedding"):
        assert getattr(ns, name) is getattr(jops, name), name
    assert ns.linear == ns.backend.linear and ns.apply_rope == ns.backend.apply_rope
    assert hash(ns) == hash(jplan.load(policy, "cpu", "fast", cfg=cfg)[1])
    for op in ("attention", "norm", "mlp"):
        assert plan.op(op).startswith("reference (the fast backend declines"), op
    assert plan.op("logits").endswith("then final logit soft-capping (2) by the reference")
    assert plan.model.startswith("gemma2; ") and jplan.make_plan(policy, "cpu", "fast", cfg) == plan
    # a Llama keeps the backend's namespace itself; Mistral's windows are a mask every backend reads
    assert not isinstance(jplan.load(policy, "cpu", "fast")[1], jplan.WithReference)
    plan, ns = jplan.load(policy, "cpu", "fast", cfg=cfg_of("mistral"))
    assert ns.declined == frozenset() and "declines" not in " ".join(w for _, w in plan.ops)


# ----- a mesh ----------------------------------------------------------------------------------

_MESH_RUN = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import numpy as np
import jaxmodel
from llamaspec import load_weights
folder, meshes, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
ids, mask = np.load(out + ".in.npy")
cfg, weights = load_weights(folder)
saved = {}
for mesh in meshes:
    name = "none" if mesh is None else ",".join(f"{k}={v}" for k, v in sorted(mesh.items()))
    m = jaxmodel.from_weights(cfg, weights, "fp64", mesh=mesh)
    logits, acts = m.capture(ids, mask, taps="*")
    saved.update({f"{name}|{k}": np.asarray(v) for k, v in acts.items()})
    step, cache = m.prefill(ids, mask, 14)
    steps = [step]
    for t in range(2):
        step, cache = m.decode(cache, np.argmax(step, -1))
        steps.append(step)
    saved[f"{name}|steps"] = np.stack(steps, 1)
    saved[f"{name}|greedy"] = np.asarray(m.generate(ids, mask, max_new_tokens=4, eos_token_ids=[]))
    saved[f"{name}|weights"] = np.asarray(all(np.array_equal(w, weights[k]) for k, w in m.weights().items()))
np.savez(out, **saved)
"""
# each family on the meshes its sizes take (4 heads, 2 KV heads: tensor=4 keeps each KV head twice);
# OLMo 2's q/k norm over the whole projection takes no tensor axis
MESHES = {"qwen3": [{"tensor": 2}, {"tensor": 4}], "gemma2": [{"tensor": 4}, {"data": 2, "tensor": 2}],
          "gemma3_text": [{"tensor": 2}], "qwen2": [{"data": 2, "tensor": 2}], "mistral": [{"tensor": 2}],
          "olmo2": [{"data": 2}]}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_families_on_a_mesh_agree_with_one_device(family, family_dir, tmp_path):
    """Every tap, prefill + decode and greedy tokens of a family on a mesh (tensor shards of heads,
    KV heads repeated, data shards of rows) within fp64 rounding of the one-device model, its
    weights given back as loaded."""
    import json
    folder = family_dir(family)
    out = str(tmp_path / "mesh.npz")
    np.save(out + ".in.npy", np.stack([IDS, MASK]))
    meshes = [None, *MESHES[family]]
    done = subprocess.run([sys.executable, "-c", _MESH_RUN, str(folder), json.dumps(meshes), out],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(out)
    base = {k.split("|", 1)[1]: v for k, v in got.items() if k.startswith("none|")}
    assert set(tapnames.all_taps(cfg_of(family))) <= set(base)
    for mesh in MESHES[family]:
        name = ",".join(f"{k}={v}" for k, v in sorted(mesh.items()))
        for what, ref in base.items():
            x = got[f"{name}|{what}"]
            if what in ("greedy", "weights"):
                np.testing.assert_array_equal(x, ref, err_msg=f"{family} {name} {what}")
                continue
            assert x.shape == ref.shape, (family, name, what)
            err = float(np.max(np.abs(x - ref)))
            assert err <= 1e-12, f"{family} {name} {what}: max |sharded - unsharded| = {err:.3g}"
        assert bool(got[f"{name}|weights"])


def test_projection_qk_norm_refuses_a_tensor_axis_by_name():
    """OLMo 2's q/k norm sums over every head at once: a tensor axis would split that sum over
    shards in XLA's order, so the mesh is refused naming qk_norm (a data axis is taken)."""
    cfg = cfg_of("olmo2")
    with pytest.raises(ShardingError, match="qk_norm 'projection'.*tensor=2"):
        check_sizes(cfg, 2)
    check_sizes(cfg, 1)
    check_sizes(cfg_of("qwen3"), 2)      # per-head q/k norms split with their heads
