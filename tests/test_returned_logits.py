"""The logits tap is what a model returns: a change applied after the lm_head's product (a
Gemma-style final soft-cap, a scaling) is judged, for the transformers adapter and for a user's
port whose logits tap a module path would read before it (issue: judged drift, because the tap
was the lm_head module's output)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import compare  # noqa: E402
from compare.adapters import HF_LLAMA_TAPS, TorchModule  # noqa: E402
from compare.adapters.transformers import TransformersModel  # noqa: E402

TAPS = ("embed", "layers.*.out", "final_norm", "logits")


def _ids(B=2, T=10, seed=0):
    return np.random.default_rng(seed).integers(3, 96, (B, T)), np.ones((B, T), np.int64)


def _soft_cap(monkeypatch, folder, what: str):
    """LlamaForCausalLM.forward followed by a change to the returned logits, in every instance
    (the port's working model and its float64 twin alike, as a real model's code would be)."""
    probe = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        peak = float(probe(torch.as_tensor(_ids()[0])).logits.abs().max())
    cap = peak / 2          # the cap bends the largest logits well away from x: no rounding does that
    forward = transformers.LlamaForCausalLM.forward

    def capped(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = cap * torch.tanh(out.logits / cap) if what == "soft-cap" else out.logits * 1.01
        return out
    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", capped)


def _transformers(folder):
    return TransformersModel.from_pretrained(folder, "fp32")


def _torch_module(folder):
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return TorchModule(model, HF_LLAMA_TAPS, name="hf via paths", keeps_f32=True)


PORTS = {"transformers": _transformers, "torch-module-lm_head-path": _torch_module}


@pytest.mark.parametrize("what", ["soft-cap", "scale"])
@pytest.mark.parametrize("port", list(PORTS))
def test_a_change_after_the_lm_head_is_judged_at_the_logits(port, what, tiny_dir, monkeypatch):
    folder = tiny_dir("gqa")
    _soft_cap(monkeypatch, folder, what)
    report = compare.compare_models("torchref", PORTS[port](folder), folder, inputs=_ids(), policy="fp32",
                                    teacher_forcing=False)
    kinds = {v.tap: v.kind for v in report.taps}
    assert all(k in ("exact", "drift") for t, k in kinds.items() if t != "logits"), report.summary()
    assert kinds["logits"] in ("precision", "semantic"), report.summary()
    assert report.first_divergence.tap == "logits", report.summary()


@pytest.mark.parametrize("port", list(PORTS))
def test_the_same_ports_without_the_change_are_drift(port, tiny_dir):
    folder = tiny_dir("gqa")
    report = compare.compare_models("torchref", PORTS[port](folder), folder, inputs=_ids(), policy="fp32",
                                    teacher_forcing=False)
    assert report.verdict in ("exact", "drift"), report.summary()
