"""What the ladder judged (Report.coverage): a tap is judged where both sides return it, so a
port's tap map decides what is looked at. A port without a "logits" tap still returns logits
from capture (the pair's first element): those are judged as the "logits" tap, so a bug in the
lm_head is found there; a port that returns neither gets "lm_head not judged" in the summary,
the JSON and the page; the reference's other taps the candidate lacks are listed by step.

Real parts only: tiny random checkpoints, transformers' LlamaForCausalLM behind
generic.TorchModule, torchref and jaxmodel, the ladder itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import compare  # noqa: E402
from compare.adapters import HF_LLAMA_TAPS, TorchModule  # noqa: E402
from compare.results import NONE, NONE_AT_FP64, RETURNED, TAP  # noqa: E402

NO_LOGITS_TAP = {t: p for t, p in HF_LLAMA_TAPS.items() if t != "logits"}
LAYERS = 2      # the tiny "gqa" checkpoint's


def _inputs(B=2, T=10, seed=0):
    ids = np.random.default_rng(seed).integers(3, 96, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, T - 3:] = 0         # a right-padded row: the judged positions are the real ones
    return ids, mask


def _hf(folder, lm_head_scale=None, layer0_scale=None):
    """transformers' Llama at float32; lm_head_scale multiplies lm_head.weight (its own copy, the
    embedding untouched), layer0_scale layer 0's attention output (a forward hook): planted bugs
    in the module itself, so its float64 twin (a deep copy) carries them."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    if lm_head_scale is not None:
        with torch.no_grad():
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * lm_head_scale)
    if layer0_scale is not None:
        model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda mod, args, out: out * layer0_scale)
    return model


def _port(model, name="hf without a logits tap"):
    return TorchModule(model, NO_LOGITS_TAP, name=name, keeps_f32=True)


class ReturnsNoLogits:
    """A port that follows the protocol but returns None for the logits (a capture of the
    activations alone) and has no "logits" tap."""

    def __init__(self, port):
        self.port, self.name, self.taps = port, port.name, tuple(port.taps)

    def capture(self, tokens, attention_mask, taps, inject=None):
        _, acts = self.port.capture(tokens, attention_mask, taps, inject=inject)
        return None, acts

    def float64(self):
        return ReturnsNoLogits(self.port.float64())


class TwinReturnsNoLogits(ReturnsNoLogits):
    """Logits at the policy, none from its float64 twin: the fp64 rung has nothing to judge them by."""

    def capture(self, tokens, attention_mask, taps, inject=None):
        return self.port.capture(tokens, attention_mask, taps, inject=inject)


def _kinds(report) -> dict:
    return {v.tap: v.kind for v in report.taps}


def _rope_unjudged() -> dict:
    """HF_LLAMA_TAPS has no q_rope / k_rope (RoPE is a function inside transformers' attention)."""
    return {k: [f"layers.{i}.{k}" for i in range(LAYERS)] for k in ("q_rope", "k_rope")}


def test_a_lm_head_bug_is_found_through_the_returned_logits(tiny_dir, tmp_path):
    """lm_head.weight x1.01 in the candidate and its twin, the map without "logits": before, no
    tap judged the lm_head and every judged tap is exact or drift (asserted below), so the report
    said drift; now the returned logits are judged at "logits" and the bug is semantic there."""
    folder = tiny_dir("gqa")
    port = _port(_hf(folder, lm_head_scale=1.01))
    assert "logits" not in port.taps
    report = compare.compare_models("torchref", port, folder, inputs=_inputs(), policy="fp32")
    kinds = _kinds(report)
    assert all(k in ("exact", "drift") for t, k in kinds.items() if t != "logits"), report.summary()
    assert report.verdict == "semantic", report.summary()
    d = report.first_divergence
    assert (d.tap, d.component) == ("logits", "lm_head"), report.summary()
    assert report.teacher_forcing == "run" and d.confirmed, report.summary()
    c = report.coverage
    assert c.logits == {"reference": TAP, "candidate": RETURNED} and c.logits_judged
    assert c.unjudged == _rope_unjudged() and c.candidate_only == []
    assert report.logits["pairs"], "the logits agreement is measured on the returned logits"
    summary = report.summary()
    assert "logits judged from what hf without a logits tap returns" in summary, summary
    assert "q_rope (layers 0-1), k_rope (layers 0-1)" in summary, summary
    saved = json.loads(report.to_json(tmp_path / "r.json").read_text())
    assert saved["coverage"]["logits"]["candidate"] == RETURNED
    assert saved["coverage"]["unjudged"] == _rope_unjudged()
    page = report.to_html(tmp_path / "r.html").read_text()
    assert "Not judged" in page and "layers.1.k_rope" in page and "returned logits" in page


def test_the_same_port_without_the_bug_is_drift_with_the_returned_logits_judged(tiny_dir):
    folder = tiny_dir("gqa")
    report = compare.compare_models("torchref", _port(_hf(folder)), folder, inputs=_inputs(), policy="fp32")
    assert report.verdict in ("exact", "drift"), report.summary()
    assert _kinds(report)["logits"] in ("exact", "drift"), report.summary()
    assert report.coverage.logits["candidate"] == RETURNED


def test_returned_logits_stand_in_for_the_tap_in_the_forced_runs(tiny_dir):
    """A bug in layer 0 (its attention output x1.01): the logits carry it, and teacher forcing
    judges them on the forced runs' returned logits (each layer fed the oracle's input): within
    drift there, so inherited, not a finding of their own."""
    folder = tiny_dir("gqa")
    report = compare.compare_models("torchref", _port(_hf(folder, layer0_scale=1.01)), folder, inputs=_inputs(),
                                    policy="fp32")
    assert report.first_divergence.tap == "layers.0.attn_out", report.summary()
    logits = next(v for v in report.taps if v.tap == "logits")
    assert logits.kind == "inherited" and logits.inherited.how == "forced", report.summary()
    assert logits.local is not None      # judged on the forced runs, not by its place alone


def test_a_port_that_returns_no_logits_says_the_lm_head_was_not_judged(tiny_dir, tmp_path):
    """The same lm_head bug behind a port whose capture returns None and which has no "logits"
    tap: nothing can judge it, and the verdict (drift) says so in every form of the report."""
    folder = tiny_dir("gqa")
    port = ReturnsNoLogits(_port(_hf(folder, lm_head_scale=1.01), name="activations only"))
    report = compare.compare_models("torchref", port, folder, inputs=_inputs(), policy="fp32")
    assert report.verdict in ("exact", "drift") and "logits" not in _kinds(report), report.summary()
    c = report.coverage
    assert c.logits == {"reference": TAP, "candidate": NONE} and not c.logits_judged
    assert c.unjudged == {**_rope_unjudged(), "logits": ["logits"]}
    line = "lm_head not judged: activations only returns no logits and has no 'logits' tap"
    assert line in report.summary() and line in c.note, report.summary()
    saved = json.loads(report.to_json(tmp_path / "r.json").read_text())
    assert saved["coverage"]["logits_judged"] is False and saved["coverage"]["unjudged"]["logits"] == ["logits"]
    page = report.to_html(tmp_path / "r.html").read_text()
    assert "lm_head not judged" in page and "layers.0.q_rope" in page


@pytest.mark.parametrize("stream", [None, False], ids=["streamed", "whole"])
def test_a_full_port_leaves_nothing_unjudged(tiny_dir, tmp_path, stream):
    folder = tiny_dir("gqa")
    report = compare.compare_models("torchref", "jaxmodel", folder, inputs=_inputs(), policy="fp32",
                                    teacher_forcing=False, stream=stream)
    c = report.coverage
    assert c.complete and c.unjudged == {} and c.note == "", c
    assert c.judged == c.reference_taps == len(report.taps)
    assert "not judged" not in report.summary()
    assert "Not judged" not in report.to_html(tmp_path / "r.html").read_text()


def test_a_reference_without_a_logits_tap_is_judged_by_its_returned_logits(tiny_dir):
    """The roles swapped: the port without a "logits" tap is the reference (its float64 twin the
    oracle); the oracle's logits are the twin's returned ones, and torchref's taps the port lacks
    are listed as the candidate's that have no oracle."""
    folder = tiny_dir("gqa")
    report = compare.compare_models(_port(_hf(folder)), "torchref", folder, inputs=_inputs(), policy="fp32")
    assert report.verdict in ("exact", "drift"), report.summary()
    assert "logits" in _kinds(report), report.summary()
    c = report.coverage
    assert c.logits == {"reference": RETURNED, "candidate": TAP} and c.unjudged == {}
    assert sorted(c.candidate_only) == sorted(t for ts in _rope_unjudged().values() for t in ts)
    assert "torchref's taps the reference has no oracle for, not judged: q_rope" in report.summary()


def test_a_twin_that_returns_no_logits_leaves_the_lm_head_unjudged_and_says_why(tiny_dir):
    folder = tiny_dir("gqa")
    port = TwinReturnsNoLogits(_port(_hf(folder), name="half a port"))
    report = compare.compare_models("torchref", port, folder, inputs=_inputs(), policy="fp32", teacher_forcing=False)
    c = report.coverage
    assert c.logits["candidate"] == NONE_AT_FP64 and not c.logits_judged and "logits" not in _kinds(report)
    assert ("lm_head not judged: half a port's float64 run returns no logits and half a port has no 'logits' tap"
            in report.summary()), report.summary()


def test_a_port_that_withholds_taps_says_why(tiny_dir):
    """A port whose norms hold another quantity (TransformerLens' folded norms) leaves them out
    of its map and states why (`not_comparable`): the report lists them with its reason, apart
    from the taps it simply does not return."""
    folder = tiny_dir("gqa")
    taps = {t: p for t, p in HF_LLAMA_TAPS.items() if t != "layers.{i}.attn_norm"}
    port = TorchModule(_hf(folder), taps, name="folded", keeps_f32=True)
    port.not_comparable = {f"layers.{i}.attn_norm": "fold_ln: its norm weight is folded into q/k/v" for i in range(2)}
    report = compare.compare_models("torchref", port, folder, inputs=_inputs(), policy="fp32")
    assert report.verdict in ("exact", "drift"), report.summary()
    cover = report.coverage
    assert set(cover.withheld) == {"layers.0.attn_norm", "layers.1.attn_norm"}
    assert "withheld by folded, not judged: attn_norm (layers 0-1) (fold_ln: its norm weight is folded" in cover.note
    assert "not judged, 4 of the reference's" in cover.note          # q_rope and k_rope: not returned, no reason
    assert json.loads(json.dumps(report.to_dict(), default=str))["coverage"]["withheld"] == cover.withheld
