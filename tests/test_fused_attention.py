"""The fast backend's fused attention (jaxmodel/attention.h): the function the reference's
ops.attention computes, with the policy's rounding points, in bits that depend on neither the
batch nor the instruction set; used for prompts where the plan's fused_attention says so."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmodel  # noqa: F401  (x64 on, the persistent cache)
from compare.metrics import rel_l2
from jaxmodel import fast, kernels, ops, plan
from llamaspec import Policy
from llamaspec import fixed_order as fo

PATHS = fo.code_paths(kernels.library())


def inputs(B, T, S, Hq, Hkv, D, dtype, seed=0, scale=2.0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, Hq, D)) * scale, dtype)
    k = jnp.asarray(rng.normal(size=(B, S, Hkv, D)) * scale, dtype)
    v = jnp.asarray(rng.normal(size=(B, S, Hkv, D)), dtype)
    return q, k, v


def masks(B, T, S, seed=0):
    """Causal (queries at the end of S slots), left-padded (the first queries of row 0 see no
    key: they average every value), a leak (each query also sees the next key), a dead query,
    and random noise."""
    rng = np.random.default_rng(seed)
    causal = np.tril(np.ones((T, S), bool), S - T)[None].repeat(B, 0)
    padded = causal.copy()
    padded[0, :, :5] = False
    leak = causal.copy()
    leak[:, :, 1:] |= causal[:, :, :-1]
    dead = causal.copy()
    dead[-1, T // 2] = False
    noise = rng.random((B, T, S)) < 0.3
    return {"causal": causal, "padded": padded, "leak": leak, "dead": dead, "noise": noise}


def fused(q, k, v, allowed, policy):
    return np.asarray(jax.jit(lambda *a: fast.fused(*a, policy))(q, k, v, jnp.asarray(allowed)))


@pytest.mark.parametrize("shape", [(2, 37, 37, 6, 2, 64), (1, 70, 100, 4, 4, 32), (2, 5, 130, 3, 1, 48)])
def test_fused_attention_is_attention_at_fp64(shape):
    """At fp64 every rounding is 1e-16: the kernel and ops.attention agree to 1e-13 on every
    mask, so they compute one function (keys picked, masked, scaled, softmax, the blind
    queries' average, GQA's head mapping). head_dim 48 scales the scores after their product
    (its scale 48^-0.5 is no power of two); 64 and 32 scale the queries first."""
    B, T, S, Hq, Hkv, D = shape
    fp64 = Policy.get("fp64")
    q, k, v = inputs(B, T, S, Hq, Hkv, D, jnp.float64)
    for name, allowed in masks(B, T, S).items():
        want = np.asarray(ops.attention(q, k, v, jnp.asarray(allowed), fp64))
        got = fused(q, k, v, allowed, fp64)
        assert rel_l2(got, want) <= 1e-13, name
        for b in range(B):   # row by row too: a mix-up of rows or heads is not an average
            assert rel_l2(got[b], want[b]) <= 1e-13, (name, b)


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_fused_attention_keeps_the_policys_rounding_points(policy):
    """At fp32 and bf16 the kernel and ops.attention keep the same roundings (scores and
    probabilities in compute_dtype, softmax in f32) and sum in other orders: fp32 results
    within f32 drift, and at bf16 all but a few elements bitwise ops.attention's (a sum-order
    difference of ~1e-7 seldom crosses a bf16 rounding boundary; rounding anywhere else, e.g.
    a softmax left in f32, changes most of them: 30% stay equal, measured). Both are as far
    from the fp64 result of the same inputs as each other, within a factor of 1.5."""
    pol, fp64 = Policy.get(policy), Policy.get("fp64")
    dtype = jnp.float32 if policy == "fp32" else jnp.bfloat16
    B, T, S = 2, 300, 300
    q, k, v = inputs(B, T, S, 6, 2, 64, dtype, seed=1)
    wide = [x.astype(jnp.float64) for x in (q, k, v)]
    for name, allowed in masks(B, T, S, seed=1).items():
        want = np.asarray(ops.attention(q, k, v, jnp.asarray(allowed), pol).astype(jnp.float64))
        got = fused(q, k, v, allowed, pol).astype(np.float64)
        exact = np.asarray(ops.attention(*wide, jnp.asarray(allowed), fp64))
        if policy == "fp32":
            assert rel_l2(got, want) <= 1e-5, name
        else:
            assert (got == want).mean() >= 0.99, name
        assert rel_l2(got, exact) <= 1.5 * rel_l2(want, exact) + 1e-7, name


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(90, 9, 3, 64), (85, 4, 2, 48)])
def test_fused_attention_bits_depend_on_neither_batch_nor_instruction_set(policy, shape):
    """The same bits on every code path this CPU has (AVX-512, AVX2, scalar: the vector code
    computes the scalar program lane by lane), for a row alone and in a batch, and for the
    first queries alone and as part of a longer prompt (other queries share their blocks).
    SmolLM2's heads, and 2 query heads a KV head with head_dim 48, whose tasks' rows (16 queries'
    32, the last 5 queries' 10) end in the score tiles' 3-row and 1-row forms."""
    pol = Policy.get(policy)
    dtype = jnp.float32 if policy == "fp32" else jnp.bfloat16
    T, Hq, Hkv, D = shape
    B, S = 3, T
    q, k, v = inputs(B, T, S, Hq, Hkv, D, dtype, seed=2)
    allowed = masks(B, T, S)["padded"]
    results = {}
    for name in PATHS:
        with fo.code_path(kernels.library(), name):
            results[name] = fused(q, k, v, allowed, pol)
            alone = fused(q[1:2], k[1:2], v[1:2], allowed[1:2], pol)
            first = fused(q[:, :23], k, v, allowed[:, :23], pol)
        assert np.array_equal(alone.view(np.uint8), results[name][1:2].view(np.uint8)), name
        assert np.array_equal(first.view(np.uint8), results[name][:, :23].view(np.uint8)), name
    for name in PATHS:
        assert np.array_equal(results[name].view(np.uint8), results[PATHS[0]].view(np.uint8)), name


def test_fused_attention_reports_nan_and_inf():
    """A NaN in one query makes that query's output NaN (its scores are NaN, so their max);
    an inf in a value reaches every query that sees it; the other rows of the batch and the
    other KV head's queries keep their bits. (A query that does not see that value but shares
    a block of keys with one that does may get NaN too, from 0 * inf: as in ops.attention,
    where every query multiplies every value, its probability 0 included.)"""
    pol = Policy.get("fp32")
    B, T, S = 2, 40, 40
    q, k, v = inputs(B, T, S, 6, 2, 64, jnp.float32, seed=3)
    allowed = masks(B, T, S)["causal"]
    clean = fused(q, k, v, allowed, pol)
    got = fused(q.at[0, 7, 2, 0].set(jnp.nan), k, v.at[1, 30, 0, 5].set(jnp.inf), allowed, pol)
    assert np.isnan(got[0, 7, 2]).all()
    assert not np.isfinite(got[1, 30:, :3, 5]).any()
    untouched = np.ones(got.shape, bool)
    untouched[0, 7, 2], untouched[1, :, :3, 5] = False, False
    assert np.array_equal(got[untouched], clean[untouched])


def test_fused_attention_choice(monkeypatch):
    """$LLAMA_PARITY_ATTENTION, read by the plan: auto takes the kernel for fp32 and bf16 on this
    x86-64 CPU (not fp16, whose scores it does not round, nor fp64, whose exp is scalar code
    there), on each code path from AVX2 up (plan.KERNEL_MIN_ISA), not on the scalar one; fused
    adds fp64 (and runs any code path); reference never; kernel (torchref's) and anything else
    are an error naming the variable. The plan says which attention runs."""
    from llamaspec.errors import PolicyError
    lib = kernels.library()
    for path in PATHS:
        with fo.code_path(lib, path):
            fast_path = path != "scalar"
            on, record = {}, {}
            for choice in ("auto", "fused", "reference"):
                monkeypatch.setenv(plan.ATTENTION_ENV, choice)
                made, namespace = plan.load("fp32", "cpu", "fast")
                on[choice] = {p: namespace.fused_attention(Policy.get(p)) for p in ("fp32", "bf16", "fp16", "fp64")}
                record[choice] = made.op("attention")
            assert on["auto"] == {"fp32": fast_path, "bf16": fast_path, "fp16": False, "fp64": False}, path
            assert on["fused"] == {"fp32": True, "bf16": True, "fp16": False, "fp64": True}, path
            assert not any(on["reference"].values()), path
            assert record["reference"].startswith("XLA") and record["fused"].startswith("fused kernel"), path
            assert record["auto"] == record["fused" if fast_path else "reference"], path
    for bad in ("fast", "kernel"):
        monkeypatch.setenv(plan.ATTENTION_ENV, bad)
        with pytest.raises(PolicyError, match=plan.ATTENTION_ENV):
            plan.make_plan("fp32")


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_jaxmodel_runs_the_fused_attention(tiny_dir, monkeypatch, request, policy):
    """A prefill's program calls the kernel once per layer (and XLA's attention with
    LLAMA_PARITY_ATTENTION=reference); logits and the prompt's cache agree with XLA's attention to
    drift (fp32) / bf16 rounding of a few elements, and at fp32 greedy decoding after it gives
    the same tokens. B=2 with a left-padded row."""
    import jaxmodel.model as jm
    from llamaspec import load_weights
    request.addfinalizer(jm.clear_programs)
    cfg, weights = load_weights(tiny_dir("gqa"))
    rng = np.random.default_rng(4)
    ids = rng.integers(3, cfg.vocab_size, (2, 40))
    mask = np.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0
    out = {}
    for choice in ("reference", "auto"):
        monkeypatch.setenv(plan.ATTENTION_ENV, choice)
        jm.clear_programs()
        m = jaxmodel.from_weights(cfg, weights, policy)
        text = m.prefill_program_text(ids, mask, 48)
        logits, _ = m.prefill(ids, mask, 48)
        new = m.generate(ids, attention_mask=mask, max_new_tokens=6)
        out[choice] = (text.count(kernels.PREFIX + "attention"), np.asarray(logits, np.float64), np.asarray(new))
    out["xla"] = out["reference"]
    assert out["xla"][0] == 0
    # not taken on a kernel path below AVX2 (the baseline cap)
    if not plan.load(policy, "cpu", "fast")[1].fused_attention(Policy.get(policy)):
        assert out["auto"][0] == 0 and kernels.library().fo_isa() < fo.ISAS["avx2"]
        return
    assert out["auto"][0] >= cfg.num_hidden_layers
    tolerance = 1e-5 if policy == "fp32" else 2e-2
    assert rel_l2(out["auto"][1], out["xla"][1]) <= tolerance
    assert out["auto"][2].shape == out["xla"][2].shape == (2, 6)
    if policy == "fp32":      # bf16's other roundings may flip a near tie: its logits are checked above
        assert np.array_equal(out["auto"][2], out["xla"][2])
