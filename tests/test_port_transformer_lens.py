"""compare.adapters.ports.transformer_lens: TransformerLens' TransformerBridge booted from a
folder and compared with torchref by the ladder, with and without its weight processing.

Skipped when transformer-lens is not installed. On a tiny random checkpoint (GQA, RoPE base
100000, a right-padded batch of 2): the bridge as booted is exact or drift; its float64 twin
keeps float32 steps (transformers' RMSNorm and RoPE tables, the bridge's softmax) and agrees
with torchref at fp64 to float32 rounding; processed (enable_compatibility_mode), the taps it
keeps comparable are the same math, the folded norms differ by their weight and are withheld,
the centred logits are a per-position shift the ladder names as a convention; a planted
epsilon is found at its layer. On SmolLM2 (marked smollm2): as booted, fp32, drift or exact.
"""

import numpy as np
import pytest

import compare
import torchref
from compare.adapters import Side
from compare.metrics import rel_l2

pytest.importorskip("transformer_lens", reason="transformer-lens not installed (docs/ports.md)")

from compare.adapters.ports.transformer_lens import TransformerLensLlama  # noqa: E402

ROPE_THETA = 100000.0
TWIN_BOUND = 1e-6       # float32 steps inside the float64 twin (measured 1.3e-7 here); litgpt's bound


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from llamaspec.testing import TINY_CONFIGS, make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("tl"), **{**TINY_CONFIGS["gqa"], "rope_theta": ROPE_THETA})


@pytest.fixture(scope="module")
def batch(right_padded_pair):
    return right_padded_pair


@pytest.fixture(scope="module")
def oracle(folder):
    return torchref.from_pretrained(folder, policy="fp64")


def compared(port, folder, batch, policy="fp32", twin=None):
    cand = port if twin is None else Side(port.name, port, twin, bool(port.keeps_f32), tuple(port.taps))
    return compare.compare_models("torchref", cand, folder, inputs=batch, policy=policy)


def assert_found(report, tap, component):
    d = report.first_divergence
    assert report.verdict == "semantic" and d is not None, report.summary()
    assert (d.tap, d.layer, d.component) == (tap, int(tap.split(".")[1]), component), report.summary()
    return d


def f64(x, mask):
    return np.asarray(x, np.float64)[mask.astype(bool)]


def test_as_booted_is_exact_or_drift_with_its_config(folder, batch):
    port = TransformerLensLlama(folder, "fp32")
    assert port.steps == {} and port.not_comparable == {} and port.withheld == ()
    assert port.config.rope_theta == ROPE_THETA and port.config.rms_norm_eps == 1e-5
    assert len(port.taps) == 2 * 15 + 3
    report = compared(port, folder, batch)
    assert report.verdict in ("exact", "drift"), report.summary()
    assert report.teacher_forcing == "run" and report.semantic_rung == "run"
    assert report.config_differences == []
    assert report.twin.status == "accepted", report.summary()


def test_float64_twin_agrees_with_torchref_to_float32_rounding(folder, batch, oracle):
    """The twin runs the checkpoint's weights at float64 but keeps float32 steps (it says
    keeps_f32): within TWIN_BOUND of torchref at fp64 on every tap, and not at 1e-12."""
    ids, mask = batch
    twin = TransformerLensLlama(folder, "fp32").float64()
    assert twin.keeps_f32 and twin.dtype == "float64"
    logits, mine = twin.capture(ids, mask, twin.taps)
    _, ref = oracle.capture(ids, mask, twin.taps)
    assert logits.dtype == np.float64 and all(mine[t].dtype == np.float64 for t in twin.taps)
    errs = {t: rel_l2(f64(mine[t], mask), f64(ref[t], mask)) for t in twin.taps}
    assert errs["embed"] == 0.0
    assert max(errs.values()) <= TWIN_BOUND, max(errs.items(), key=lambda kv: kv[1])
    assert max(errs.values()) > 1e-12       # the float32 steps are real: keeps_f32 is not a formality


def test_processed_keeps_the_math_of_the_taps_it_calls_comparable(folder, batch, oracle):
    """At float64 (TransformerLens' processing itself works in float32: TWIN_BOUND): every
    comparable tap is torchref's; each folded norm tap times its checkpoint weight is
    torchref's; the logits are torchref's minus their mean over the vocabulary."""
    from llamaspec import load_weights
    ids, mask = batch
    port = TransformerLensLlama(folder, "fp64", process_weights=True, withhold=False)
    assert set(port.not_comparable) == {"layers.0.attn_norm", "layers.0.mlp_norm", "layers.1.attn_norm",
                                        "layers.1.mlp_norm", "final_norm", "logits"}
    assert "fold_ln" in port.not_comparable["final_norm"] and "center_unembed" in port.not_comparable["logits"]
    logits, mine = port.capture(ids, mask, port.taps)
    ref_logits, ref = oracle.capture(ids, mask, port.taps)
    for t in port.comparable:
        assert rel_l2(f64(mine[t], mask), f64(ref[t], mask)) <= TWIN_BOUND, t
    _, weights = load_weights(folder)
    norms = {"layers.1.attn_norm": "model.layers.1.input_layernorm.weight",
             "layers.0.mlp_norm": "model.layers.0.post_attention_layernorm.weight", "final_norm": "model.norm.weight"}
    for t, key in norms.items():
        assert rel_l2(f64(mine[t], mask), f64(ref[t], mask)) > 0.1, t
        w = np.asarray(weights[key], np.float64)
        assert rel_l2(f64(mine[t], mask) * w, f64(ref[t], mask)) <= TWIN_BOUND, t
    ref_logits = f64(ref_logits, mask)
    assert rel_l2(f64(logits, mask), ref_logits) > 0.01
    centred = ref_logits - ref_logits.mean(-1, keepdims=True)
    assert np.abs(f64(logits, mask) - centred).max() <= TWIN_BOUND * np.abs(centred).max()


def test_processed_withholds_the_folded_norms_and_is_drift(folder, batch):
    port = TransformerLensLlama(folder, "fp32", process_weights=True)
    assert port.withheld == ("layers.0.attn_norm", "layers.0.mlp_norm", "layers.1.attn_norm", "layers.1.mlp_norm",
                             "final_norm")
    assert "logits" in port.taps and "logits" in port.not_comparable     # returned: the ladder names the shift
    assert not set(port.withheld) & set(port.taps) and set(port.comparable) <= set(port.taps)
    report = compared(port, folder, batch)
    assert report.verdict == "drift", report.summary()
    assert report.teacher_forcing == "run" and report.semantic_rung == "run"
    conventions = [v for v in report.taps if v.kind == "convention"]
    assert [(v.tap, v.record.convention.what) for v in conventions] == [("logits", "logit_shift")], report.summary()


def test_processed_with_every_tap_the_ladder_names_the_fold(folder, batch):
    report = compared(TransformerLensLlama(folder, "fp32", process_weights=True, withhold=False), folder, batch)
    d = assert_found(report, "layers.0.attn_norm", "attn_norm")
    assert "per-feature scale" in d.hint, d.hint


def test_value_biases_folded_withhold_v_and_the_context(tmp_path):
    from llamaspec.testing import TINY_CONFIGS, make_checkpoint
    folder = make_checkpoint(tmp_path, **{**TINY_CONFIGS["bias"], "rope_theta": ROPE_THETA})
    ids = np.random.default_rng(3).integers(3, 96, (1, 12))
    mask = np.ones_like(ids)
    port = TransformerLensLlama(folder, "fp64", process_weights=True)
    assert {"layers.0.v", "layers.1.attn_ctx"} <= set(port.withheld)
    assert "layers.0.attn_out" in port.comparable and "layers.0.k" in port.comparable
    _, mine = port.capture(ids, mask, ("layers.1.attn_out", "layers.1.out"))
    _, ref = torchref.from_pretrained(folder, policy="fp64").capture(ids, mask, ("layers.1.attn_out", "layers.1.out"))
    for t in mine:
        assert rel_l2(f64(mine[t], mask), f64(ref[t], mask)) <= TWIN_BOUND, t
    # without the value biases' step the value tap is torchref's again
    plain = TransformerLensLlama(folder, "fp64", process_weights={"fold_value_biases": False})
    assert "layers.0.v" in plain.comparable


@pytest.mark.parametrize("process_weights, tap, component", [(False, "layers.1.mlp_norm", "mlp_norm"),
                                                             (True, "layers.1.gate", "mlp")])
def test_planted_epsilon_found_at_its_layer(folder, batch, process_weights, tap, component):
    """1e-2 as layer 1's feed-forward norm epsilon, in the port and its twin: found at that
    norm; processed, the norm tap is withheld and it shows at the first comparable tap after it."""
    port = TransformerLensLlama(folder, "fp32", process_weights=process_weights)
    twin = port.float64()
    for p in (port, twin):
        p.bridge.blocks[1].ln2.original_component.variance_epsilon = 1e-2
    assert_found(compared(port, folder, batch, twin=twin), tap, component)


def test_inject_replaces_the_block_input(folder, batch):
    ids, mask = batch
    port = TransformerLensLlama(folder, "fp32", process_weights=True)
    h = np.random.default_rng(2).standard_normal((*ids.shape, 32)).astype(np.float32)
    _, mine = port.capture(ids, mask, ("layers.0.out", "layers.1.out"), inject={1: h})
    _, ref = torchref.from_pretrained(folder, policy="fp32").capture(ids, mask, ("layers.0.out", "layers.1.out"),
                                                                      inject={1: h})
    assert rel_l2(f64(mine["layers.1.out"], mask), f64(ref["layers.1.out"], mask)) < 1e-5
    assert rel_l2(f64(mine["layers.0.out"], mask), f64(ref["layers.0.out"], mask)) < 1e-5


def test_left_padding_with_the_mask_and_positions(folder, oracle):
    """Left-padded rows, the mask and positions handed to the bridge. At float64 without
    compatibility mode the bridge itself turns the leading pads into NaN that reaches the
    row's real positions a layer later (its float32 softmax of float64's mask minimum), so the
    adapter runs that case row by row; processed (-inf masks, fully masked rows zeroed) and at
    float32 it runs as one batch."""
    import torch
    ids = np.random.default_rng(4).integers(3, 96, (2, 12))
    mask = np.ones_like(ids)
    mask[0, :5] = 0
    for process_weights in (False, True):
        port = TransformerLensLlama(folder, "fp64", process_weights=process_weights)
        _, mine = port.capture(ids, mask, ("layers.1.q_rope", "layers.1.out"))
        _, ref = oracle.capture(ids, mask, ("layers.1.q_rope", "layers.1.out"))
        for t in mine:
            assert rel_l2(f64(mine[t], mask), f64(ref[t], mask)) <= TWIN_BOUND, (process_weights, t)
        with torch.no_grad():
            raw = port.bridge(torch.tensor(ids), attention_mask=torch.tensor(mask)).numpy()
        assert np.isnan(raw[0, 5:]).any() == (not process_weights)
    port = TransformerLensLlama(folder, "fp32")
    _, mine = port.capture(ids, mask, ("layers.1.out",))
    _, ref = oracle.capture(ids, mask, ("layers.1.out",))
    assert rel_l2(f64(mine["layers.1.out"], mask), f64(ref["layers.1.out"], mask)) <= 1e-5


def test_refuses_what_it_cannot_load(tmp_path, folder):
    with pytest.raises(ValueError, match="not a local Hugging Face folder"):
        TransformerLensLlama(tmp_path / "HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(ValueError, match="refactor_factored_attn_matrices"):
        TransformerLensLlama(folder, process_weights={"refactor_factored_attn_matrices": True})
    with pytest.raises(ValueError, match="one dtype"):
        TransformerLensLlama(folder, "bf16w-f32")


@pytest.mark.smollm2
def test_smollm2_processed_short_prompt(smollm2):
    """SmolLM2 through enable_compatibility_mode's processing on one short prompt (fp32): drift,
    the centred logits named as a convention, the folded norms withheld."""
    from llamaspec.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(smollm2)
    ids, mask = tok.batch_encode(["Why do two correct implementations of one model disagree?"], chat=True,
                                 padding_side="right")
    port = TransformerLensLlama(smollm2, "fp32", process_weights=True)
    assert len(port.withheld) == 2 * 30 + 1
    report = compare.compare_models("torchref", port, smollm2, inputs=(ids, mask), policy="fp32")
    print("\nMEASURED transformer-lens processed, short prompt:", report.summary())
    assert report.verdict == "drift", report.summary()
    assert [v.tap for v in report.taps if v.kind == "convention"] == ["logits"], report.summary()


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_as_booted_is_drift(smollm2):
    report = compare.compare_models("torchref", TransformerLensLlama(smollm2, "fp32"), smollm2, policy="fp32")
    print("\nMEASURED transformer-lens as booted:", report.summary())
    assert report.verdict in ("exact", "drift"), report.summary()
    assert report.teacher_forcing == "run" and report.config_differences == []
