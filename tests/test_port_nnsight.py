"""compare.adapters.ports.NnsightLlama: nnsight 0.8.1's traced transformers Llama, compared with torchref.

Skipped when nnsight is not installed. On a tiny random checkpoint (RoPE base 100000, GQA, a right-padded batch
of 2): loaded through nnsight.TransformersModel (the folder is given a tiny tokenizer, as its pipeline needs one)
it is exact or drift with teacher forcing run through nnsight's own intervention; taps asked in reverse order
come back equal to taps asked in order (nnsight itself raises OutOfOrderError for that order); the traced logits
equal the plain forward bit for bit, and an nnsight edit that changes a traced run (but not the plain forward)
is refused at load and at capture; the float64 twin agrees with torchref at fp64 within 1e-6 (transformers'
RMSNorm and RoPE compute in float32 inside its float64 model: float32 rounding, not 1e-12); a planted epsilon
(layer 1's MLP norm, in the port and in its twin) is found at layers.1.mlp_norm; a user's own bf16 nnsight model
wrapped with its checkpoint gets the checkpoint's weights in its twin. SmolLM2 (marked smollm2 and slow): fp32 drift.
"""

import numpy as np
import pytest

import compare
import torchref
from compare.adapters import Side
from compare.metrics import rel_l2

nnsight = pytest.importorskip("nnsight", reason="nnsight not installed (docs/ports.md)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from compare.adapters.ports import NnsightLlama  # noqa: E402
from compare.adapters.ports.nnsight import TracingChangedNumbers  # noqa: E402

ROPE_THETA = 100000.0


def _tokenizer(folder):
    """A 96-token word-level tokenizer saved into the folder: nnsight.TransformersModel's pipeline loads one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1",
                                         eos_token="t2").save_pretrained(folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny checkpoint without a tokenizer (loaded through nnsight.NNsight)."""
    from llamaspec.testing import TINY_CONFIGS, make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("nnsight"), **{**TINY_CONFIGS["gqa"], "rope_theta": ROPE_THETA})


@pytest.fixture(scope="module")
def tok_folder(tmp_path_factory):
    """The same tiny checkpoint with a tokenizer (loaded through nnsight.TransformersModel)."""
    from llamaspec.testing import TINY_CONFIGS, make_checkpoint
    f = make_checkpoint(tmp_path_factory.mktemp("nnsight_tok"), **{**TINY_CONFIGS["gqa"], "rope_theta": ROPE_THETA})
    _tokenizer(f)
    return f


@pytest.fixture(scope="module")
def port(tok_folder):
    return NnsightLlama(tok_folder, "fp32")


@pytest.fixture(scope="module")
def batch(right_padded_pair):
    return right_padded_pair


def test_transformers_model_is_exact_or_drift_with_teacher_forcing(port, tok_folder, batch):
    assert port.name == "nnsight.TransformersModel[float32, sdpa]" and port.keeps_f32
    assert port.config.rope_theta == ROPE_THETA and port.config.rms_norm_eps == 1e-5
    assert len(port.taps) == 2 + 2 * 15 + 1        # every tap, q_rope/k_rope through .source
    report = compare.compare_models("torchref", port, tok_folder, inputs=batch, policy="fp32")
    assert report.verdict in ("exact", "drift"), report.summary()
    assert report.teacher_forcing == "run" and report.semantic_rung == "run"
    assert [row["layer"] for row in report.local] == [0, 1] and report.config_differences == []


def test_inject_is_nnsights_layer_input(port, tok_folder, batch):
    ids, mask = batch
    h = np.random.default_rng(2).standard_normal((*ids.shape, 32)).astype(np.float32)
    _, mine = port.capture(ids, mask, ("layers.1.out", "layers.0.out"), inject={1: h})
    _, ref = torchref.from_pretrained(tok_folder, policy="fp32").capture(ids, mask, ("layers.1.out",), inject={1: h})
    _, free = port.capture(ids, mask, ("layers.1.out",))
    real = mask.astype(bool)
    assert rel_l2(mine["layers.1.out"][real], ref["layers.1.out"][real]) < 1e-6
    assert rel_l2(free["layers.1.out"][real], ref["layers.1.out"][real]) > 0.1     # the forcing did something


def test_taps_asked_in_reverse_order_come_back_right(port, batch):
    ids, mask = batch
    logits, forward = port.capture(ids, mask, port.taps)
    logits_r, backward = port.capture(ids, mask, tuple(reversed(port.taps)))
    assert np.array_equal(logits, logits_r)
    for t in port.taps:
        assert np.array_equal(forward[t], backward[t]), t
    assert backward["layers.1.q_rope"].shape == (2, 16, 4, 8) and backward["layers.1.k_rope"].shape == (2, 16, 2, 8)
    model = port.model      # what the adapter spares its caller: nnsight itself refuses that order
    with pytest.raises(Exception, match="already ran past") as raised:
        with torch.no_grad():
            with model.trace(input_ids=torch.from_numpy(ids)):
                model.model.layers[1].output.save()
                model.model.layers[0].output.save()
    assert type(raised.value).__name__ == "OutOfOrderError"


def test_trace_equals_the_plain_forward_and_a_changed_trace_is_refused(folder, batch):
    ids, mask = batch
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    pos = torch.from_numpy(np.maximum(np.cumsum(mask, 1) - 1, 0))
    padded_as_checked = torch.from_numpy(np.where(mask == 1, ids, 0))     # the protocol's input check zeroes them
    with torch.no_grad():
        plain = hf(input_ids=padded_as_checked, attention_mask=torch.from_numpy(mask), position_ids=pos).logits
    model = nnsight.NNsight(hf)
    port = NnsightLlama.wrap(model, checkpoint=folder)
    logits, _ = port.capture(ids, mask, port.taps)
    assert np.array_equal(logits.view(np.uint32), plain.numpy().view(np.uint32))
    with model.edit(inplace=True):      # a stored edit: every later trace scales layer 1's MLP, the plain forward not
        model.model.layers[1].mlp.output[:] = model.model.layers[1].mlp.output * 1.001
    with pytest.raises(TracingChangedNumbers, match=r"this capture's inputs: .* values differ, by up to"):
        port.capture(ids, mask, ("layers.0.out",))
    with pytest.raises(TracingChangedNumbers, match="load-time probe"):
        NnsightLlama.wrap(model, checkpoint=folder)


def test_float64_twin_agrees_with_torchref_at_fp64(port, tok_folder, batch):
    ids, mask = batch
    twin = port.float64()
    assert twin.dtype == "float64" and twin.name.startswith("nnsight.TransformersModel")
    _, mine = twin.capture(ids, mask, port.taps)
    _, ref = torchref.from_pretrained(tok_folder, policy="fp64").capture(ids, mask, port.taps)
    real = mask.astype(bool)
    assert all(mine[t].dtype == np.float64 for t in port.taps)
    assert np.array_equal(mine["embed"][real], ref["embed"][real])      # the checkpoint's weights at float64
    worst = max(rel_l2(mine[t][real], ref[t][real]) for t in port.taps)
    assert 1e-12 < worst <= 1e-6        # float32 steps inside transformers' float64 Llama: not float64 throughout


def test_eager_float64_twin_takes_left_padding_row_by_row(folder):
    """transformers' eager attention at float64 turns left padding into NaN; the twin captures row by row."""
    ids = np.random.default_rng(3).integers(3, 96, (2, 12))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    twin = NnsightLlama(folder, "fp32", attn_implementation="eager").float64()
    assert twin.name == "nnsight.NNsight[float64, eager]"
    logits, mine = twin.capture(ids, mask, ("layers.1.out",))
    _, ref = torchref.from_pretrained(folder, policy="fp64").capture(ids, mask, ("layers.1.out",))
    real = mask.astype(bool)
    assert np.isfinite(logits[real]).all()
    assert rel_l2(mine["layers.1.out"][real], ref["layers.1.out"][real]) <= 1e-6


def test_planted_epsilon_found_at_its_layer(folder, batch):
    port = NnsightLlama(folder, "fp32")
    assert port.name == "nnsight.NNsight[float32, sdpa]"        # no tokenizer: NNsight over AutoModelForCausalLM
    twin = port.float64()
    for p in (port, twin):
        p.module.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-2
    side = Side(port.name, port, twin, True, tuple(port.taps))
    report = compare.compare_models("torchref", side, folder, inputs=batch, policy="fp32")
    d = report.first_divergence
    assert report.verdict == "semantic" and d is not None, report.summary()
    assert (d.tap, d.layer, d.component) == ("layers.1.mlp_norm", 1, "mlp_norm"), report.summary()


def test_wrapped_bf16_model_twin_gets_the_checkpoint_weights(folder, batch):
    ids, mask = batch
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    port = NnsightLlama.wrap(nnsight.NNsight(hf), checkpoint=folder)
    assert port.dtype == "bfloat16"
    twin = port.float64()
    _, mine = twin.capture(ids, mask, ("embed",))
    _, ref = torchref.from_pretrained(folder, policy="fp64").capture(ids, mask, ("embed",))
    real = mask.astype(bool)
    assert np.array_equal(mine["embed"][real], ref["embed"][real])
    assert hf.dtype == torch.bfloat16       # the user's model is left as it was


# ----- SmolLM2 -----------------------------------------------------------------------------------------------------

@pytest.mark.smollm2
@pytest.mark.slow     # the default suite's heaviest test (41 s of its 922 s on 2026-12-07): on demand, `make test-all`
def test_smollm2_nnsight_fp32_is_drift(smollm2):
    # check_determinism off: the tiny tests above run the determinism check on this adapter
    report = compare.compare_models("torchref", NnsightLlama(smollm2, "fp32"), smollm2, policy="fp32",
                                    check_determinism=False)
    print("\nMEASURED nnsight fp32:", report.summary())
    assert report.verdict in ("exact", "drift"), report.summary()
    assert report.teacher_forcing == "run"
