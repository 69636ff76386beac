"""jaxmodel computes the policy knobs weight_fp8, act_fp8, kv_cache and per-layer overrides
(llamaspec/policy.py) as torchref does: the same quantized weights bit for bit (and the numpy
reference's), the same cached keys and values (each side's the reference rounding of its own
keys, so where the two sides' keys are the same bits, so are their caches), the same taps to
fp64 rounding at fp64 compute, a float64 twin holding the same q and scales, prefill + decode
equal to a full forward, and the plan saying that the fast backend declines the knobs.

Bitwise claims are about the quantization (a deterministic rounding); products at bf16 / f32
are compared within tolerances, never as one CPU rounds them."""

import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxmodel.model as jm
import torchref.model as tm
from jaxmodel import plan as jplan
from llamaspec import Policy, PolicyError, load_weights
from llamaspec import quant as nq
from llamaspec.checkpoint import numpy_dtype
from llamaspec.plan import declines
from llamaspec.policy import DTYPES
from llamaspec.testing import make_checkpoint
from torchref import plan as tplan
from torchref.dtypes import to_numpy

POLICIES = ["bf16+weight_fp8=e4m3:block16", "fp32+weight_fp8=e5m2:channel:bfloat16", "bf16+act_fp8=e4m3:channel",
            "fp32+act_fp8=e4m3:tensor", "bf16+kv_cache=e4m3:channel", "bf16+kv_cache=float16",
            "bf16+layers[0]=fp32", "bf16+weight_fp8=e4m3:channel+layers[-1:]=bf16"]
F64_POLICIES = ["fp64+weight_fp8=e4m3:block16", "fp64+weight_fp8=e5m2:channel:bfloat16",
                "fp64+act_fp8=e4m3:channel", "fp64+kv_cache=e4m3:channel"]
# 48 = 4 heads x 12: k_proj / v_proj [24, 48] and the MLP's 72 columns cut 16 x 16 blocks short;
# q, k, v carry a bias (fp8_linear's bias path)
SHAPE = dict(hidden_size=48, intermediate_size=72, num_attention_heads=4, num_key_value_heads=2,
             attention_bias=True)
IDS = np.random.default_rng(0).integers(3, 96, (2, 9))
MASK = np.ones_like(IDS)
MASK[1, :3] = 0          # a left-padded row


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return load_weights(make_checkpoint(tmp_path_factory.mktemp("knobs"), **SHAPE))


@pytest.fixture(scope="module")
def models(checkpoint):
    """(jaxmodel, torchref reference) at a policy, loaded once per module."""
    cfg, weights = checkpoint

    @functools.cache
    def get(policy):
        j = jm.from_weights(cfg, weights, policy)
        j.buckets = False        # the prompt at its own slots, as torchref's prefill writes it
        return j, tm.from_weights(cfg, weights, policy, backend="reference", device="cpu")
    return get


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.dtype.itemsize}"))


def _same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def _layer_policy(policy: str, key: str, n: int) -> Policy:
    layer = jm.layer_of_key(key)
    p = Policy.get(policy)
    return p if layer is None else p.for_layer(layer, n)


def kv_reference(x: np.ndarray, p: Policy) -> np.ndarray:
    """A key or value [B, T, Hkv, D] as p's kv_cache keeps it, by the numpy reference."""
    kv = p.kv_cache
    if kv is None:
        return x
    if kv in DTYPES:
        return x.astype(numpy_dtype(kv)).astype(x.dtype)
    q, scales = nq.quantize(x.reshape(-1, x.shape[-1]), kv)
    return nq.dequantize(q, scales, kv, x.dtype.name).reshape(x.shape)


# ----- quantized weights ----------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_quantized_weights_are_the_same_bits_in_both_and_the_numpy_reference(policy, models, checkpoint):
    """quantized() in both frameworks holds, for exactly the projections of the layers whose
    policy has weight_fp8, llamaspec.quant.quantize of the param_dtype-rounded checkpoint weight;
    jaxmodel computes with its dequantization in the fp8 product dtype."""
    cfg, weights = checkpoint
    j, t = models(policy)
    n = cfg.num_hidden_layers
    want = {k for k in weights if jm.is_projection(k) and _layer_policy(policy, k, n).weight_fp8}
    assert want == {k for k in weights if tm.is_projection(k) and _layer_policy(policy, k, n).weight_fp8}
    got_j, got_t = j.quantized(), t.quantized()
    assert set(got_j) == set(got_t) == want
    module = j.model
    for key in want:
        p = _layer_policy(policy, key, n)
        q, scales = nq.quantize(weights[key].astype(numpy_dtype(p.param_dtype)), p.weight_fp8)
        for side in (got_j[key], got_t[key]):
            assert _same_bits(side[0], q) and _same_bits(side[1], scales), key
        held = module.layers[jm.layer_of_key(key)]
        for name in key.split(".")[3:-1]:
            held = getattr(held, name)
        assert _same_bits(np.asarray(held.weight[...]), nq.dequantize(q, scales, p.weight_fp8, "float32")), key


@pytest.mark.parametrize("policy", [p for p in POLICIES if "weight_fp8" in p])
def test_the_float64_twin_keeps_the_quantized_weights(policy, models, checkpoint):
    """weights() + quantized() rebuild the model's float64 twin (policy.weight_twin()) with the same q
    and scales, dequantized exactly in float64, in both frameworks; the two twins' logits agree to
    fp64 rounding. weights() alone would quantize the dequantized weights again (not idempotent)."""
    cfg, _ = checkpoint
    j, t = models(policy)
    twin_policy = Policy.get(policy).weight_twin()
    jt = jm.from_weights(cfg, j.weights(), twin_policy, quantized=j.quantized())
    tt = tm.from_weights(cfg, t.weights(), twin_policy, backend="reference", device="cpu", quantized=t.quantized())
    q = j.quantized()
    for side in (jt.quantized(), tt.quantized()):
        assert set(side) == set(q)
        for key, (qq, ss) in side.items():
            assert _same_bits(qq, q[key][0]) and _same_bits(ss, q[key][1]), key
    key = next(iter(q))
    spec = _layer_policy(policy, key, cfg.num_hidden_layers).weight_fp8
    layer = jt.model.layers[jm.layer_of_key(key)]
    for name in key.split(".")[3:-1]:
        layer = getattr(layer, name)
    assert _same_bits(np.asarray(layer.weight[...]), nq.dequantize(*q[key], spec, "float64"))
    lj, lt = np.asarray(jt(IDS, MASK)), to_numpy(tt(IDS, MASK))
    assert np.abs(lj - lt).max() <= 1e-12 * np.abs(lt).max()
    with pytest.raises(KeyError, match="not projections this policy quantizes"):
        jm.from_weights(cfg, j.weights(), "fp64", quantized=q)


# ----- the KV cache ---------------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_cached_keys_and_values_are_the_kv_rounding_of_the_taps(policy, models, checkpoint):
    """After a prefill each side's cache holds, at the real slots, its own k_rope and v taps
    rounded as the layer's kv_cache says (the numpy reference), in the layer's compute dtype
    (jaxmodel's one array: the widest of the layers', read back exactly); where the two sides'
    taps are the same bits in a whole (token, kv head) group, so are their cached values."""
    cfg, _ = checkpoint
    j, t = models(policy)
    taps = ("layers.*.k_rope", "layers.*.v")
    _, cj, aj = j.prefill_capture(IDS, MASK, 16, taps)
    _, ct, at = t.prefill_capture(IDS, MASK, 16, taps)
    real = MASK.astype(bool)
    for i in range(cfg.num_hidden_layers):
        p = Policy.get(policy).for_layer(i, cfg.num_hidden_layers)
        compute = numpy_dtype(p.compute_dtype)
        for name, tap in (("k", "k_rope"), ("v", "v")):
            held_j = np.asarray(cj[name][i])                                   # [B, S, Hkv, D]
            held_t = to_numpy(ct[name][i]).transpose(0, 2, 1, 3)               # [B, Hkv, S, D] -> [B, S, Hkv, D]
            T = IDS.shape[1]
            for held, acts in ((held_j, aj), (held_t, at)):
                x = acts[f"layers.{i}.{tap}"]
                assert x.dtype == compute
                assert np.array_equal(held[:, :T].astype(np.float64), held[:, :T].astype(compute).astype(np.float64))
                assert _same_bits(held[:, :T].astype(compute)[real], kv_reference(x, p)[real]), (i, name)
            xj, xt = aj[f"layers.{i}.{tap}"], at[f"layers.{i}.{tap}"]
            same = (_bits(xj) == _bits(xt)).all(-1) & real[:, :, None]          # whole groups, real slots
            assert _same_bits(held_j[:, :T].astype(compute)[same], held_t[:, :T].astype(compute)[same])


# ----- fp64 compute: the two frameworks agree -------------------------------------------------

@pytest.mark.parametrize("policy", F64_POLICIES)
def test_taps_at_fp64_compute_agree_between_the_frameworks(policy, models):
    """Every tap of a float64-compute quantizing policy agrees between jaxmodel and torchref to
    fp64 rounding (1e-12 relative): the same quantized values, products exact in float64."""
    j, t = models(policy)
    lj, aj = j.capture(IDS, MASK, "*")
    lt, at = t.capture(IDS, MASK, "*")
    assert set(aj) == set(at)
    for tap in aj:
        want = at[tap].astype(np.float64)
        err = np.abs(aj[tap].astype(np.float64) - want)[MASK.astype(bool)].max()
        assert err <= 1e-12 * max(1.0, np.abs(want).max()), (tap, err)


# ----- prefill + decode ------------------------------------------------------------------------

DECODE = {  # policy: relative L2 tolerance of prefill + decode vs the full forward's logits
    **{p: 2e-2 for p in POLICIES if p.startswith("bf16")},
    "fp32+weight_fp8=e5m2:channel:bfloat16": 1e-5,
    **{p: 1e-12 for p in F64_POLICIES},
    "fp64+layers[0]=fp32+layers[1]=bf16w-f32": 1e-5,
}


@pytest.mark.parametrize("policy", list(DECODE))
def test_prefill_and_decode_equal_the_full_forward(policy, models):
    """Greedy steps through the cache give the logits of a full forward over the sequence, to
    the policy's rounding (fp64 compute: 1e-12): keys and values are rounded by kv_cache in
    every call, an act_fp8 "channel" scale is per token. (act_fp8 "tensor" is not here: its one
    scale per call depends on the whole call, so a decode step's is its own by definition.)"""
    j, _ = models(policy)
    logits, cache = j.prefill(IDS, MASK, 16)
    steps, seq, seq_mask = [logits], IDS, MASK
    for _ in range(4):
        nxt = np.asarray(logits).argmax(-1)
        seq, seq_mask = np.concatenate([seq, nxt[:, None]], 1), np.concatenate([seq_mask, np.ones((2, 1), int)], 1)
        logits, cache = j.decode(cache, nxt)
        steps.append(logits)
    full = np.asarray(j(seq, seq_mask)).astype(np.float64)
    T = IDS.shape[1]
    for s, step in enumerate(steps):
        want = full[:, T - 1 + s]
        err = np.linalg.norm(np.asarray(step, np.float64) - want) / np.linalg.norm(want)
        assert err <= DECODE[policy], (s, err)


@pytest.mark.parametrize("policy", ["fp32+layers[:]=fp64", "fp64+layers[0]=fp32"])
def test_per_layer_policies_against_torchref(policy, models):
    """Blocks of one policy other than the base's still run under one scan (the carry in their
    residual dtype), blocks of different policies one after the other; either way each layer
    computes by its policy and the taps keep its dtype, as torchref's (to f32 rounding: every
    layer or the base computes in f32 here), teacher forcing included."""
    j, t = models(policy)
    assert j.model.same_blocks() == (policy == "fp32+layers[:]=fp64")
    h = np.random.default_rng(1).standard_normal((*IDS.shape, SHAPE["hidden_size"]))
    lj, aj = j.capture(IDS, MASK, ("layers.*.out", "layers.*.q_rope", "final_norm"), inject={1: h})
    lt, at = t.capture(IDS, MASK, ("layers.*.out", "layers.*.q_rope", "final_norm"), inject={1: h})
    for tap in (*aj, "logits"):
        a, b = (aj[tap], at[tap]) if tap != "logits" else (lj, lt)
        assert a.dtype == b.dtype, tap
        a, b = a.astype(np.float64)[MASK.astype(bool)], b.astype(np.float64)[MASK.astype(bool)]
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), tap


# ----- the plan, the mesh, the streamed layers -------------------------------------------------

@pytest.mark.parametrize("policy", ["bf16+kv_cache=e4m3:channel", "bf16+weight_fp8=e4m3:channel+layers[-1:]=bf16",
                                    "fp32+layers[1]=bf16"])
def test_the_fast_backend_declines_the_knobs_as_torchref_does(policy):
    """The fast backend runs the whole model on the reference and its plan says why, in the words
    of torchref's plan; the invariant backend refuses (PolicyError)."""
    p = Policy.get(policy)
    assert declines(p) is not None
    plan = jplan.make_plan(p, "cpu", "fast")
    assert plan.backend == "fast"
    assert dict(plan.ops) == dict(tplan.make_plan(p, "cpu", "fast").ops)
    assert all(v == f"reference (the fast backend declines {declines(p)})" for _, v in plan.ops)
    with pytest.raises(PolicyError, match="invariant backend does not take"):
        jplan.make_plan(p, "cpu", "invariant")
    assert declines(Policy.get("bf16")) is None


def test_a_mesh_refuses_fp8_projections_by_name(checkpoint):
    """A sharded model does not take weight_fp8 or act_fp8 (a PolicyError naming the knob and
    the layers' selector)."""
    cfg, weights = checkpoint
    with pytest.raises(PolicyError, match="weight_fp8 is not taken on a mesh"):
        jm.from_weights(cfg, weights, "bf16+weight_fp8=e4m3:channel", mesh={"data": 1, "tensor": 1})
    layered = Policy.get("fp32", layers=[("1", Policy.get("fp32", act_fp8="e4m3:tensor"))])
    with pytest.raises(PolicyError, match=r"act_fp8 \(layers\[1\]\) is not taken on a mesh"):
        jm.from_weights(cfg, weights, layered, mesh={"data": 1, "tensor": 1})


@pytest.mark.parametrize("policy", ["bf16+weight_fp8=e4m3:channel+layers[-1:]=bf16", "fp64+layers[0]=fp32"])
def test_the_streamed_layers_follow_the_per_layer_policies(policy, models, checkpoint):
    """LayerRunner builds each layer by its own policy (its weights quantized, its RoPE tables, its
    residual dtype): each layer on the forward's input to it gives the forward's output."""
    cfg, weights = checkpoint
    j, _ = models(policy)
    _, acts = j.capture(IDS, MASK, ("embed", "layers.*.out"))
    runner = jm.LayerRunner(cfg, policy, backend="reference")
    runner.start(IDS, MASK)
    h = acts["embed"]
    for i in range(cfg.num_hidden_layers):
        layer = {k: v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")}
        out = runner.block(i, layer, h)[f"layers.{i}.out"]
        want = acts[f"layers.{i}.out"]
        assert out.dtype == want.dtype == numpy_dtype(Policy.get(policy).for_layer(i, 2).residual_dtype)
        err = np.abs(out.astype(np.float64) - want)[MASK.astype(bool)].max()
        assert err <= 1e-2 * np.abs(want.astype(np.float64)).max(), (i, err)
        h = want


_MESH_RUN = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import numpy as np
import jaxmodel.model as jm
from llamaspec import load_weights
folder, policy, out = sys.argv[1:]
cfg, weights = load_weights(folder)
ids, mask = np.load(out + ".in.npy")
saved = {}
for name, mesh in (("tensor", {"tensor": 2}), ("data", {"data": 2})):
    m = jm.from_weights(cfg, weights, policy, mesh=mesh)
    m.buckets = False
    _, cache, acts = m.prefill_capture(ids, mask, 16, ("layers.*.k_rope", "layers.*.v"))
    saved.update({f"{name}/{k}": np.asarray(v).astype(np.float32) for k, v in acts.items()})  # npz: no bf16
    saved.update({f"{name}/cache.{k}": np.asarray(cache[k]).astype(np.float64) for k in ("k", "v")})
    saved[f"{name}/logits"] = np.asarray(m(ids, mask))
np.savez(out, **saved)
"""


def test_kv_cache_and_per_layer_policies_on_a_mesh(tmp_path):
    """On a mesh (tensor=2, data=2 forced host devices, a process of its own) kv_cache and
    per-layer overrides are taken: the cache holds the kv rounding of the model's own taps, at
    each layer's compute dtype, and the logits are the one-device model's to rounding."""
    policy = "bf16+kv_cache=e4m3:channel+layers[0]=fp32"
    folder = make_checkpoint(tmp_path / "ckpt", **SHAPE)
    out = str(tmp_path / "mesh.npz")
    np.save(out + ".in.npy", np.stack([IDS, MASK]))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _MESH_RUN, str(folder), policy, out], capture_output=True,
                          text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(out)
    cfg, weights = load_weights(folder)
    one = np.asarray(jm.from_weights(cfg, weights, policy)(IDS, MASK)).astype(np.float64)
    real, T = MASK.astype(bool), IDS.shape[1]
    for mesh in ("tensor", "data"):
        for i in range(cfg.num_hidden_layers):
            p = Policy.get(policy).for_layer(i, cfg.num_hidden_layers)
            for name, tap in (("k", "k_rope"), ("v", "v")):
                x = got[f"{mesh}/layers.{i}.{tap}"].astype(numpy_dtype(p.compute_dtype))     # exact
                held = got[f"{mesh}/cache.{name}"][i][:, :T].astype(numpy_dtype(p.compute_dtype))
                assert _same_bits(held[real], kv_reference(x, p)[real]), (mesh, i, name)
        err = np.linalg.norm(got[f"{mesh}/logits"] - one) / np.linalg.norm(one)
        assert err <= 2e-2, (mesh, err)
