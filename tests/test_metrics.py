"""compare.metrics (exact cases) and compare.judge.structure (noise never fires; each planted
pattern fires its own detector first). Pure numpy, fast."""

import json
import math

import ml_dtypes
import numpy as np
import pytest

from compare import metrics as M
from compare.explain import findings as E
from compare.judge import structure as S

DTYPES = [np.float64, np.float32, ml_dtypes.bfloat16, np.float16]
UINT = {8: np.uint64, 4: np.uint32, 2: np.uint16}


def next_up(x, dt):
    """The next representable value above positive x in dt (one bit-pattern step)."""
    a = np.array(x, dt)
    return (a.view(UINT[a.itemsize]) + 1).view(dt)


# ----- metrics ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,u", [("float64", 2.0 ** -53), ("fp32", 2.0 ** -24),
                                    ("bf16", 2.0 ** -8), ("float16", 2.0 ** -11)])
def test_unit_roundoff(name, u):
    assert M.unit_roundoff(name) == u


def test_unit_roundoff_accepts_dtype_objects_and_rejects_others():
    assert M.unit_roundoff(ml_dtypes.bfloat16) == 2.0 ** -8
    assert M.unit_roundoff(np.dtype("float32")) == 2.0 ** -24
    with pytest.raises(ValueError, match="unsupported dtype"):
        M.unit_roundoff("int8")


@pytest.mark.parametrize("dt", DTYPES)
def test_max_ulp_known_cases(dt):
    one_up = next_up(1.0, dt).astype(np.float64)
    assert M.max_ulp(1.0, one_up, dt) == 1
    assert M.max_ulp([1.0, 2.0], [one_up, 2.0], dt) == 1       # the max over elements
    assert M.max_ulp(-0.0, 0.0, dt) == 0
    tiny = next_up(0.0, dt).astype(np.float64)                 # smallest subnormal
    assert M.max_ulp(-tiny, tiny, dt) == 2                     # across zero
    assert M.max_ulp(-tiny, 0.0, dt) == 1
    assert M.max_ulp(-1.0, -float(one_up), dt) == 1            # negative side is ordered too
    assert M.max_ulp(3.0, 3.0, dt) == 0


def test_max_ulp_rounds_to_the_dtype_first_and_counts_overflow():
    assert M.max_ulp(1.0, 1.0 + 1e-10, np.float32) == 0         # both round to 1.0f
    assert M.max_ulp(1.0, 1.0 + 1e-10, np.float64) > 0
    assert M.max_ulp(65504.0, 1e6, np.float16) == 1            # inf is one above the max
    assert M.max_ulp(1.0, -1.0, np.float32) == 2 * 0x3F800000


def test_cosine_and_frac_beyond():
    a = np.array([1.0, 2.0, 3.0])
    assert M.cosine(a, 2 * a) == pytest.approx(1.0)
    assert M.cosine(a, -a) == pytest.approx(-1.0)
    assert M.cosine(np.zeros(3), np.zeros(3)) == 1.0
    assert M.cosine(np.zeros(3), a) == 0.0
    ref = np.array([1.0, 1.0, 100.0, 0.0])
    cand = np.array([1.0, 1.2, 100.5, 0.05])
    assert M.frac_beyond(cand, ref, atol=0.1, rtol=0.01) == 0.25   # only 1.2 vs 1.0
    assert M.frac_beyond(cand, ref) == 0.75
    assert M.frac_beyond([np.nan, 1.0], [np.nan, 1.0]) == 0.5      # NaN always beyond
    assert M.frac_beyond([np.inf, 1.0], [np.inf, 1.0]) == 0.0      # equal infinities are equal
    assert M.frac_beyond([1.0], [np.inf], rtol=1.0) == 1.0         # one-sided inf is beyond


def test_nan_is_never_masked():
    ref = np.ones((2, 3, 4))
    cand = ref.copy()
    cand[1, 2, 3] = np.nan
    cand[0, 1, 0] = np.inf
    for f in (M.rel_l2, M.max_abs, M.cosine):
        assert math.isnan(f(cand, ref))
    assert math.isnan(M.max_ulp(cand, ref, np.float32))
    rep = M.nonfinite_report(cand, ref)
    assert rep["cand_nan"] == 1 and rep["cand_first_nan"] == [1, 2, 3]
    assert rep["cand_inf"] == 1 and rep["cand_first_inf"] == [0, 1, 0]
    assert rep["ref_nan"] == rep["ref_inf"] == 0 and rep["ref_first_nan"] is None


def test_kl_top1_topk_margin():
    x = np.random.default_rng(0).standard_normal((2, 3, 11))
    assert np.array_equal(M.kl_per_position(x, x), np.zeros((2, 3)))
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
    assert M.kl_per_position([0.0, 0.0], [0.0, math.log(3)]) == pytest.approx(0.5 * math.log(4 / 3),
                                                                             rel=1e-14)
    # A token that p rules out (-inf) contributes nothing, even where q rules it out too.
    assert M.kl_per_position([0.0, -np.inf], [0.0, -np.inf]) == 0.0
    assert math.isnan(M.kl_per_position([0.0, np.nan], [0.0, 0.0]))
    a = np.array([[5.0, 4, 3, 0, 0, 0], [0, 0, 0, 1, 2, 3]])
    b = np.array([[4.0, 5, 0, 0, 0, 3.5], [0, 0, 0, 1, 2, 3]])
    assert M.top1_agreement(a, b) == 0.5
    assert M.topk_overlap(a, b, k=3) == pytest.approx((2 / 3 + 1) / 2)
    assert M.topk_overlap(a, b, k=100) == 1.0                      # k capped at the vocab
    assert np.array_equal(M.top_margin(a), [1.0, 1.0])


def test_tap_metrics_mask_selects_real_positions():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((2, 4, 8))
    cand = ref.copy()
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], bool)
    cand[0, 0] = 1e6                       # garbage on the padding slot
    cand[0, 0, 0] = np.nan
    m = M.tap_metrics(cand, ref, "bfloat16", mask=mask)
    assert m["rel_l2"] == 0.0 and m["max_ulp"] == 0 and m["cosine"] == pytest.approx(1.0)
    assert m["cand_nan"] == 0 and m["padding_nonfinite"] == 1
    assert m["n"] == 7 * 8 and m["unit_roundoff"] == 2.0 ** -8
    unmasked = M.tap_metrics(cand, ref, "bfloat16")
    assert math.isnan(unmasked["rel_l2"]) and unmasked["cand_first_nan"] == [0, 0, 0]
    json.dumps(m), json.dumps(unmasked)    # plain Python numbers


def test_tap_metrics_logits():
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((2, 5, 17))
    cand = ref + 1e-3 * rng.standard_normal(ref.shape)
    cand[1, 4] = ref[1, 4][::-1]           # one position flips its argmax (most likely)
    m = M.tap_metrics(cand, ref, np.float32, logits=True)
    assert 0 < m["kl_mean"] <= m["kl_max"]
    assert m["top1_disagree"] == int((cand.argmax(-1) != ref.argmax(-1)).sum()) >= 1
    assert m["top1_agreement"] == 1 - m["top1_disagree"] / 10
    assert m["disagree_ref_margin_max"] > 0 and m["ref_margin_min"] >= 0
    same = M.tap_metrics(ref, ref, np.float32, logits=True)
    assert same["kl_max"] == 0 and same["top1_agreement"] == 1 and same["top5_overlap"] == 1
    assert same["disagree_ref_margin_max"] == 0.0
    json.dumps(m)


# ----- structure: negative controls ----------------------------------------------------

def activations(rng, shape):
    """Random activations with uneven scales per position and per head."""
    x = rng.standard_normal(shape)
    x *= np.exp(0.5 * rng.standard_normal(shape[:2] + (1,) * (len(shape) - 2)))
    if len(shape) == 4:
        x *= np.exp(0.5 * rng.standard_normal((1, 1, shape[2], 1)))
    return x


@pytest.mark.parametrize("eps", [1e-15, 1e-7, 1e-3])
@pytest.mark.parametrize("shape,per_head", [((2, 32, 64), False), ((2, 32, 8, 16), True)])
def test_rounding_noise_gives_no_finding(eps, shape, per_head):
    for seed in range(12):
        rng = np.random.default_rng(seed)
        ref = activations(rng, shape)
        noise = rng.standard_normal(shape)
        relative = ref + ref * eps * noise                     # noise proportional to values
        absolute = ref + eps * np.sqrt(np.mean(ref ** 2)) * noise   # noise of the input scale
        for cand in (relative, absolute):
            found = S.analyse(cand, ref, per_head=per_head)
            assert found == [], (seed, found)
            assert E.hint(found).startswith("noise-like")


@pytest.mark.parametrize("dt", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_real_rounding_gives_no_finding(dt):
    for seed in range(5):
        ref = activations(np.random.default_rng(seed), (2, 32, 8, 16))
        assert S.analyse(ref.astype(dt).astype(np.float64), ref, per_head=True) == []


def test_repeated_rows_are_not_an_offset():
    """The same token at every position rounds the same way: identical rows of d."""
    row = np.random.default_rng(3).standard_normal(64)
    ref = np.broadcast_to(row, (2, 32, 64)).copy()
    ref[:, ::2] *= -1.0                    # two distinct rows, each repeated 32 times
    assert S.analyse(ref.astype(ml_dtypes.bfloat16).astype(np.float64), ref) == []


# ----- structure: positive controls ----------------------------------------------------

def top(cand, ref, **kw):
    found = S.analyse(cand, ref, **kw)
    assert found, "nothing found"
    return found[0]


def rms_norm(x, eps, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_rmsnorm_epsilon_is_a_per_row_scale():
    rng = np.random.default_rng(4)
    scales = np.logspace(-4, 1, 64).reshape(2, 32, 1)     # includes rows with tiny variance
    x = rng.standard_normal((2, 32, 64)) * rng.permutation(scales.ravel()).reshape(scales.shape)
    w = 1 + 0.1 * rng.standard_normal(64)
    f = top(rms_norm(x, 1e-5, w), rms_norm(x, 1e-6, w))
    assert f.kind == "per_row_scale" and f.score > 0.99
    assert "RMSNorm epsilon" in E.cause(f)


def test_global_scale():
    ref = activations(np.random.default_rng(5), (2, 32, 64))
    f = top(ref * 1.02, ref)
    assert f.kind == "global_scale" and "1.02" in E.cause(f)
    assert f.size == pytest.approx(0.02)


def test_per_feature_scale():
    rng = np.random.default_rng(6)
    ref = activations(rng, (2, 32, 64))
    assert top(ref * (1 + 0.1 * rng.standard_normal(64)), ref).kind == "per_feature_scale"


def rotate_pairs(x, angle):
    """Rotates half-split pairs (i, i + D/2) of the last axis by `angle` [T] radians."""
    h = x.shape[-1] // 2
    a = angle.reshape(1, -1, *([1] * (x.ndim - 2)))
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], -1)


def test_position_dependent_rotation_is_a_position_trend():
    rng = np.random.default_rng(7)
    ref = activations(rng, (2, 32, 8, 16))
    cand = rotate_pairs(ref, 0.01 * np.arange(32))
    cand += 1e-7 * ref * rng.standard_normal(ref.shape)       # plus some rounding
    f = top(cand, ref, per_head=True)
    assert f.kind == "position_trend" and "grows" in E.cause(f) and "RoPE" in E.cause(f)


def test_position_trend_follows_rope_positions_under_left_padding():
    rng = np.random.default_rng(8)
    ref = activations(rng, (2, 40, 64))
    mask = np.ones((2, 40), bool)
    mask[1, :8] = False                                        # left padding
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    cand = np.stack([rotate_pairs(ref[b:b + 1], 0.01 * pos[b])[0] for b in range(2)])
    cand[~mask] = np.nan                                       # garbage on padding: ignored
    f = top(cand, ref, mask=mask)
    assert f.kind == "position_trend"


def test_two_perturbed_heads_are_head_confinement():
    rng = np.random.default_rng(9)
    ref = activations(rng, (2, 32, 8, 16))
    cand = ref * (1 + 1e-7 * rng.standard_normal(ref.shape))
    cand[:, :, [2, 5]] += 1e-2 * rng.standard_normal((2, 32, 2, 16))
    f = top(cand, ref, per_head=True)
    assert f.kind == "head_confinement" and "heads 2, 5 of 8" in E.cause(f)


def test_wrong_gqa_grouping_is_head_confinement():
    rng = np.random.default_rng(10)
    B, T, H, KV, D = 1, 32, 8, 2, 16
    q = rng.standard_normal((B, T, H, D))
    k, v = rng.standard_normal((2, B, T, KV, D))
    causal = np.triu(np.full((T, T), -np.inf), 1)

    def attention(kv_of_head):
        s = np.einsum("bthd,bshd->bhts", q, k[:, :, kv_of_head]) / np.sqrt(D) + causal
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v[:, :, kv_of_head])

    f = top(attention(np.arange(H) % KV), attention(np.arange(H) // (H // KV)), per_head=True)
    assert f.kind == "head_confinement" and "GQA" in E.cause(f)


def test_interleaved_vs_half_split_is_a_permutation():
    ref = activations(np.random.default_rng(11), (2, 32, 4, 16))
    to_interleaved = np.stack([np.arange(8), np.arange(8, 16)], -1).ravel()  # 0, 8, 1, 9, ...
    f = top(ref[..., to_interleaved], ref, per_head=True)
    assert f.kind == "permutation" and "half-split -> interleaved" in E.detail(f)
    assert "RoPE layout" in E.cause(f)
    back = top(ref[..., np.argsort(to_interleaved)], ref, per_head=True)
    assert "interleaved -> half-split" in E.detail(back)
    flat = top(ref[..., to_interleaved].reshape(2, 32, 64), ref.reshape(2, 32, 64))
    assert flat.kind == "permutation" and "in each block of 16" in E.detail(flat)


def test_swapped_heads_are_a_permutation():
    ref = activations(np.random.default_rng(12), (2, 32, 8, 16))
    f = top(ref[:, :, [0, 5, 2, 3, 4, 1, 6, 7]], ref, per_head=True)
    assert f.kind == "permutation" and "heads permuted" in E.cause(f) and "1<-5" in E.detail(f)


def test_constant_offset():
    rng = np.random.default_rng(13)
    ref = activations(rng, (2, 32, 64))
    f = top(ref + 0.1 * rng.standard_normal(64), ref)
    assert f.kind == "offset" and "bias" in E.cause(f)


def test_one_sided_error_is_a_sign_bias():
    rng = np.random.default_rng(14)
    ref = activations(rng, (2, 32, 64))
    f = top(ref + np.abs(ref) * 1e-3 * (rng.standard_normal(ref.shape) + 0.5), ref)
    assert f.kind == "sign_bias" and "above" in E.cause(f)


def test_half_confinement():
    rng = np.random.default_rng(15)
    ref = activations(rng, (2, 32, 4, 16))
    cand = ref * (1 + 1e-9 * rng.standard_normal(ref.shape))
    cand[..., 8:] += 1e-3 * rng.standard_normal((2, 32, 4, 8))   # e.g. partial rotary
    f = top(cand, ref, per_head=True)
    assert f.kind == "half_confinement" and "second half" in E.cause(f)


# ----- structure: plumbing --------------------------------------------------------------

def test_nonfinite_is_its_own_finding_and_padding_is_ignored():
    ref = activations(np.random.default_rng(16), (2, 32, 64))
    cand = ref.copy()
    cand[1, 3, 5] = np.nan
    found = S.analyse(cand, ref)
    assert [f.kind for f in found] == ["nonfinite"]
    mask = np.ones((2, 32), bool)
    mask[1, :4] = False
    assert S.analyse(cand, ref, mask=mask) == []


def test_floor_drops_patterns_as_small_as_rounding():
    """RoPE angles rounded to f32 inside an f64 run: a real trend, of rounding size."""
    ref = activations(np.random.default_rng(17), (1, 64, 4, 64))
    inv = 10000.0 ** (-np.arange(32) * 2 / 64)
    pos = np.arange(64)[:, None]

    def rope(angles):
        c, s = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
        x1, x2 = ref[..., :32], ref[..., 32:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    f32 = (pos.astype(np.float32) * inv.astype(np.float32)).astype(np.float64)
    cand, oracle = rope(f32), rope(pos * inv)
    for f in S.analyse(cand, oracle, per_head=True):
        assert f.size < 1e-5
    assert S.analyse(cand, oracle, per_head=True, floor=1e-5) == []
    bug = rope(pos * 11000.0 ** (-np.arange(32) * 2 / 64))
    assert top(bug, oracle, per_head=True, floor=1e-5).kind == "position_trend"


def test_public_detectors_and_hint():
    ref = activations(np.random.default_rng(18), (2, 32, 64))
    assert S.global_scale(ref * 1.5, ref).kind == "global_scale"
    assert S.per_row_scale(ref * 1.5, ref) is None          # a global factor is not per-row
    assert S.per_feature_scale(ref * 1.5, ref) is None
    assert S.offset(ref, ref) is None and S.analyse(ref, ref) == []
    found = [S.Finding("position_trend", 0.99, 0.5, dict(rho=0.99, early=0.01, late=0.5, positions=32)),
             S.Finding("sign_bias", 0.2, 0.5, dict(effect=0.2, z=7.0, t=7.0))]
    assert E.hint(found) == "error grows with position: RoPE (theta, layout, scaling) or mask (also: sign_bias)"
    assert S.hint(found) == E.hint(found)


def test_ulps_are_counted_in_the_taps_own_dtype():
    """Under a 16-bit policy the logits are f32: a one-f32-ulp difference is 1 ULP, not
    the 0 it would round to in bf16."""
    from compare.metrics import pair_metrics
    from llamaspec import Policy, taps
    bf16 = Policy.get("bf16")
    assert taps.dtype_of("logits", bf16) == "float32"
    assert taps.dtype_of("layers.3.out", bf16) == bf16.residual_dtype
    assert taps.dtype_of("layers.3.q", bf16) == "bfloat16"
    r = np.linspace(1, 2, 64, dtype=np.float32)
    c = r.copy()
    c[7] = np.nextafter(c[7], np.float32(3))
    assert pair_metrics(c, r, taps.dtype_of("logits", bf16))["max_ulp"] == 1
    # arrays that hold the same dtype are counted in it, whatever the policy says
    assert pair_metrics(c, r, "bfloat16")["max_ulp"] == 1


def test_an_exact_agreement_is_no_dtype_noise():
    """A relative error of 0 (the RoPE angles of two runs agree exactly while the values do not)
    fits no dtype's rounding; it used to raise a math domain error inside the ladder."""
    from compare.judge.verdicts import _fitted_noise
    assert _fitted_noise(0.0, False, "angles") is None
    assert _fitted_noise(2.0 ** -24, False, "angles").dtype == "float32"
