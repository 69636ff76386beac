"""compare.judge.structure's tests on a step's own inputs (partial rotary,
the activation, a transposed square projection, a missing or doubled residual, q/k swapped),
each with rounding that must not fire it, and the findings' sentences (compare.explain)."""

import ml_dtypes
import numpy as np
import pytest

from compare.explain import findings as E
from compare.judge import structure as S

RNG = np.random.default_rng(21)


def _rounded(x, dt=np.float32):
    return np.asarray(x).astype(dt).astype(np.float64)


# ----- activation ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(S.ACTIVATIONS))
def test_each_activation_is_named_against_silu(name):
    gate, up = RNG.standard_normal((2, 16, 64)), RNG.standard_normal((2, 16, 64))
    ref = S.ACTIVATIONS["silu"](gate) * up
    cand = S.ACTIVATIONS[name](gate) * up
    found = S.analyse(cand, ref, inputs={"gate": (gate, gate), "up": (up, up)})
    if name == "silu":
        assert found == []
        return
    assert found[0].kind == "activation" and found[0].data["cand"] == [name] and found[0].data["ref"] == ["silu"]
    assert E.ACTIVATION_NAMES[name] in E.hint(found) and "instead of SiLU" in E.hint(found)


def test_activation_rounded_in_f32_is_still_the_same_activation():
    """Rounding of the step (f32 inside an fp64 run: ~1e-7) never reads as another function."""
    gate, up = RNG.standard_normal((2, 16, 64)), RNG.standard_normal((2, 16, 64))
    ref = S.ACTIVATIONS["silu"](gate) * up
    assert S.activation_fit(_rounded(ref), ref, (gate, gate), (up, up)) is None
    gelu = _rounded(S.ACTIVATIONS["gelu"](gate) * up)
    assert S.activation_fit(gelu, ref, (gate, gate), (up, up)).data["cand"] == ["gelu"]


# ----- transposed square projection -----------------------------------------------------------

def test_a_transposed_square_projection_is_named():
    x = RNG.standard_normal((2, 24, 32))
    w = RNG.standard_normal((32, 32))
    ref, cand = x @ w.T, x @ w
    f = S.analyse(cand, ref, inputs={"x": (x, x)})[0]
    assert f.kind == "transposed_projection" and "transposed" in E.cause(f)
    # rounding of the inputs and outputs: no finding either way
    assert S.transposed_projection(_rounded(ref), ref, _rounded(x), x) is None
    assert S.transposed_projection(_rounded(cand), ref, _rounded(x), x) is not None


def test_a_non_square_projection_is_not_tested():
    x = RNG.standard_normal((1, 16, 32))
    w = RNG.standard_normal((64, 32))
    assert S.transposed_projection(x @ w.T * 1.1, x @ w.T, x, x) is None


# ----- residual -------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha,beta,how", [(0, 1, "residual (skip connection) is missing"),
                                            (2, 1, "residual (skip connection) is added twice"),
                                            (1, 2, "branch output is added twice"),
                                            (1, 0, "branch output is missing")])
def test_a_missing_or_doubled_residual_is_named(alpha, beta, how):
    x, a = RNG.standard_normal((2, 24, 32)), 0.3 * RNG.standard_normal((2, 24, 32))
    found = S.analyse(alpha * x + beta * a, x + a, inputs={"residual": (x, x), "branch": (a, a)})
    assert found[0].kind == "residual" and how in E.hint(found)


def test_residual_rounding_is_not_a_residual_finding():
    x, a = RNG.standard_normal((2, 24, 32)), 0.3 * RNG.standard_normal((2, 24, 32))
    for dt in (np.float32, ml_dtypes.bfloat16):
        assert S.residual_fit(_rounded(x + a, dt), x + a, (x, x), (a, a)) is None


# ----- q/k swapped -----------------------------------------------------------------------------

def test_swapped_q_and_k_are_named():
    q, k = RNG.standard_normal((2, 24, 4, 8)), RNG.standard_normal((2, 24, 4, 8))
    found = S.analyse(k, q, per_head=True, inputs={"other_k": (k, k)})
    assert found[0].kind == "swapped_projection" and "q_proj and k_proj swapped" in E.hint(found)
    assert S.swapped_projection(_rounded(q), q, k) is None


# ----- partial rotary ----------------------------------------------------------------------------

def _rope(x, theta=10000.0, rotated=None):
    """Half-split RoPE over the first `rotated` dims (all by default); the rest left as is."""
    B, T, H, D = x.shape
    R = D if rotated is None else rotated
    inv = theta ** (-np.arange(R // 2) * 2 / R)
    ang = np.arange(T)[:, None] * inv[None]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    x1, x2 = x[..., : R // 2], x[..., R // 2: R]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., R:]], -1)


def test_rope_on_half_of_each_heads_dims_is_partial_rotary():
    pre = RNG.standard_normal((2, 40, 4, 32))
    ref, cand = _rope(pre), _rope(pre, rotated=16)
    f = S.analyse(cand, ref, per_head=True, pre=(pre, pre))[0]
    assert f.kind == "partial_rotary" and f.data["cand_identity"] == list(range(16, 32))
    assert "RoPE applied to 16 of 32 dims" in E.cause(f) and "16-31" in E.detail(f)


def test_rope_with_another_theta_or_f32_tables_is_not_partial_rotary():
    pre = RNG.standard_normal((2, 40, 4, 32))
    ref = _rope(pre)
    assert S.analyse(_rounded(ref), ref, per_head=True, pre=(pre, pre), floor=1e-5) == []
    f = S.analyse(_rope(pre, theta=1e7), ref, per_head=True, pre=(pre, pre))[0]
    assert f.kind == "rope_frequency"


# ----- inputs from the taps, and sentences ------------------------------------------------------

def test_tap_inputs_names_each_steps_inputs():
    taps = {t: np.zeros(1) for t in ("embed", "layers.0.attn_out", "layers.0.gate", "layers.0.up",
                                     "layers.0.attn_norm", "layers.0.k", "layers.0.attn_ctx",
                                     "layers.0.resid_mid", "layers.0.mlp_out")}
    assert set(S.tap_inputs("layers.0.act", taps, taps)) == {"gate", "up"}
    assert set(S.tap_inputs("layers.0.resid_mid", taps, taps)) == {"residual", "branch"}
    assert set(S.tap_inputs("layers.0.q", taps, taps)) == {"x", "other_k"}
    assert S.tap_inputs("layers.1.resid_mid", taps, taps) == {}       # layers.0.out missing
    assert S.tap_inputs("logits", taps, taps) == {}


def test_sentences_are_made_from_the_data():
    f = S.Finding("residual", 1.0, 0.5, dict(cand=[0.0, 1.0], ref=[1.0, 1.0], residual="missing", branch="kept"))
    assert E.cause(f) == "residual connection: the residual (skip connection) is missing"
    assert E.detail(f).startswith("cand = 0 x residual + 1 x branch")
    assert E.hint([f, S.Finding("sign_bias", 0.2, 0.1, dict(effect=0.2, z=7.0, t=7.0))]).endswith("(also: sign_bias)")
    assert E.hint([]) == E.NOISE_LIKE
    assert E.ranges([0, 1, 2, 5, 6, 9]) == "0-2, 5-6, 9" and E.ranges([]) == "none"
    with pytest.raises(ValueError, match="no sentence for finding kind 'mystery'"):
        E.detail(S.Finding("mystery", 1.0))


# ----- the planted controls (compare/controls/prefill.py), on their own taps -------------------

SHORT = np.random.default_rng(0).integers(3, 96, (2, 48))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_transposed_o_proj_control_on_a_square_checkpoint(tiny_dir):
    """hidden 32 = 4 heads x head_dim 8: o_proj is square. Found at attn_out, layer 1,
    confirmed by teacher forcing; its hint names the transposition from attn_ctx (check)."""
    from compare.controls import check, run_control
    from compare.controls.prefill import SQUARE_CONTROLS
    pytest.importorskip("transformers")
    folder = tiny_dir("gqa")
    control = SQUARE_CONTROLS["hf_o_proj_transposed"]
    report = run_control(control, folder, SHORT)
    assert check(control, report) == [] and report.first_divergence.confirmed, report.summary()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["hf_qk_swapped", "hf_q_bias_dropped"])
def test_porting_slips_on_their_own_checkpoints(name, tiny_dir):
    """q_proj/k_proj swapped (an MHA checkpoint) and q_proj's bias dropped (a checkpoint with
    attention biases): found at layer 1's q, confirmed, the hint naming the slip."""
    from compare.controls import check, run_control
    from compare.controls.prefill import OWN_CHECKPOINT_CONTROLS
    pytest.importorskip("transformers")
    config, control = OWN_CHECKPOINT_CONTROLS[name]
    report = run_control(control, tiny_dir(config), SHORT)
    assert check(control, report) == [] and report.first_divergence.confirmed, report.summary()
