"""Invariance probes on tiny random checkpoints: sane numbers for both models, planted
padding/mask/causality bugs classified semantic with the right hint (positive
controls), a pure position offset not flagged (negative control), fresh-process
determinism, the CLI end to end, and bitwise invariance in batch-invariant mode."""

import json
import math

import numpy as np
import pytest

from compare.probes import (
    Case,
    ProbeResult,
    compare_completion,
    divergence_plan,
    probe_batch,
    probe_cross_greedy,
    probe_determinism,
    probe_divergence,
    probe_padding,
)
from compare.probes.models import ProbeModel, fp64_twin, load_model
from compare.report.probes import format_table, render_html, to_document
from llama_parity.cli import main

IMPLS = ("torchref", "jaxmodel")


def invariant_available(impl: str, folder) -> bool:
    try:
        load_model(impl, folder, "fp32", batch_invariant=True)
        return True
    except NotImplementedError:
        return False


@pytest.fixture(scope="module")
def ck(tiny_dir):
    return tiny_dir("gqa")


@pytest.fixture(scope="module")
def models(ck):
    return {impl: load_model(impl, ck, "fp32") for impl in IMPLS}


def _sane(r: ProbeResult, probe: str):
    assert r.probe == probe and r.verdict in ("exact", "drift"), r.summary()
    assert 0.0 <= r.bitwise_equal_frac <= 1.0 and r.nonfinite == 0
    assert 0 < r.rounding_error < 1e-4 and r.threshold > r.rounding_error   # fp32 on a tiny model
    assert all(c.kind in ("exact", "drift") for c in r.cases)
    assert all(c.max_abs <= r.threshold for c in r.cases)
    json.dumps(r.to_dict())     # plain JSON
    assert r.hint and r.assert_no_semantic() is r


# ---------------------------------------------------------------- both models, clean

@pytest.mark.parametrize("impl", IMPLS)
def test_batch_probe(models, impl):
    r = probe_batch(models[impl], batch_sizes=(3,), length=12)
    _sane(r, "batch")
    # three target copies (rows 0, 1, 2) among equal-length and mixed-length companions
    assert len(r.cases) == 6 and {c.group for c in r.cases} == {"equal", "mixed"}
    assert r.model == f"{impl} fp32 default" and r.mode == "default"


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_probe(models, impl):
    r = probe_padding(models[impl], length=12, pad=3)
    _sane(r, "padding")
    assert {c.group for c in r.cases} == {"right", "left", "append", "cls-left", "cls-right", "full-pad"}
    assert r.details["pad_content_leaks"] is False


@pytest.mark.parametrize("impl", IMPLS)
def test_divergence_probe(models, impl):
    r = probe_divergence(models[impl], completions=3, new_tokens=5, batch_sizes=(4,), length=10)
    _sane(r, "divergence")
    assert r.details["completions"] == 3 and r.details["distinct_completions"] >= 1
    assert len(r.details["reference_tokens"]) >= 1


def test_cross_framework_greedy(models):
    r = probe_cross_greedy(models["jaxmodel"], models["torchref"], new_tokens=5, prompts=3, length=10)
    assert r.verdict in ("exact", "drift"), r.summary()
    assert r.model == "jaxmodel fp32 default vs torchref" and len(r.cases) == 3
    assert r.details["same_completions"] + sum(c.first_diff_step is not None for c in r.cases) == 3


def test_determinism_in_process_and_fresh_process(models):
    r = probe_determinism(models["torchref"], repeats=2, processes=1, batch=3, length=10)
    _sane(r, "determinism")
    assert [c.group for c in r.cases] == ["repeat", "repeat", "fresh"]
    assert r.details["processes"] == 1 and r.details["fresh_skipped"] is None


def test_determinism_without_spec_skips_fresh_runs(ck):
    import torchref
    r = probe_determinism(torchref.from_pretrained(ck, "fp32"), repeats=1, processes=1, length=8)
    assert [c.group for c in r.cases] == ["repeat"] and "ModelSpec" in r.details["fresh_skipped"]


# ---------------------------------------------------------------- planted bugs

class MaskIgnored:
    """Positive control: runs every batch as if it had no padding (pads are attended)."""

    def __init__(self, m):
        self.m, self.cfg, self.policy = m, m.cfg, m.policy

    def __call__(self, tokens, attention_mask=None):
        return self.m(tokens)


class NaNOnEmptyRows(MaskIgnored):
    """Positive control: a fully padded row comes out as NaN (softmax over nothing)."""

    def __call__(self, tokens, attention_mask=None):
        out = np.asarray(self.m(tokens, attention_mask)).copy()
        if attention_mask is not None:
            out[np.asarray(attention_mask).sum(1) == 0] = np.nan
        return out


def _non_causal(mask, n_queries, first_query_slot=0):
    return mask.bool()[:, None, :].expand(-1, n_queries, -1)


@pytest.fixture(scope="module")
def torch_fp32(ck):
    import torchref
    m = torchref.from_pretrained(ck, "fp32")
    return m, fp64_twin(m)


def test_planted_mask_leak_is_semantic_with_hint(torch_fp32):
    m, twin = torch_fp32
    r = probe_padding(ProbeModel(MaskIgnored(m), oracle=twin), length=12, pad=3)
    assert r.verdict == "semantic" and r.details["pad_content_leaks"] is True
    assert "attention mask is not applied" in r.hint and "left padding" in r.hint
    kinds = {c.group: c.kind for c in r.cases}
    assert kinds["left"] == "semantic" and kinds["append"] == "exact"   # causal part still right
    with pytest.raises(AssertionError, match="semantic"):
        r.assert_no_semantic()


def test_planted_non_causal_mask_is_semantic_with_hint(ck, monkeypatch):
    import torchref
    import torchref.model
    monkeypatch.setattr(torchref.model, "causal_allowed", _non_causal)   # the twin shares the bug
    m = torchref.from_pretrained(ck, "fp32")
    twin = fp64_twin(m)
    r = probe_padding(m, oracle=twin, length=12, pad=3)
    assert r.verdict == "semantic"
    assert "appended" in r.hint and "causal-mask" in r.hint, r.hint
    assert r.rounding_error < 1e-4          # the twin is the same math, so the scale is rounding


def test_fully_padded_row_nan_is_semantic(torch_fp32):
    m, twin = torch_fp32
    r = probe_padding(ProbeModel(NaNOnEmptyRows(m), oracle=twin), length=10, pad=2)
    assert r.verdict == "semantic" and r.nonfinite > 0
    assert "fully padded row gives NaN" in r.hint


def test_position_offset_is_not_flagged(ck, monkeypatch):
    """Negative control: positions counted from the first slot (ignoring the mask) shift a
    left-padded row's positions by the pad count. RoPE attention sees only position
    differences, so the math is unchanged and the probe must not call it a bug."""
    import torchref
    import torchref.model as tm
    monkeypatch.setattr(tm, "positions_from_mask", lambda mask: np.broadcast_to(
        np.arange(mask.shape[1], dtype=np.int32), mask.shape).copy())
    r = probe_padding(torchref.from_pretrained(ck, "fp32"), length=12, pad=3)
    assert r.verdict in ("exact", "drift"), r.summary()


def test_nondeterministic_model_is_semantic(torch_fp32):
    m, twin = torch_fp32

    class Stateful(MaskIgnored):
        """Positive control: state left over from the previous call (a cache not reset)."""
        calls = 0

        def __call__(self, tokens, attention_mask=None):
            out = np.asarray(self.m(tokens, attention_mask)).copy()
            self.calls += 1
            # call 1 is the judge's; the leftover differs per vocabulary entry (a constant added to
            # every logit would change no probability: test_a_constant_logit_shift_changes_no_probability)
            stale = np.float32(1e-2) * np.cos(np.arange(out.shape[-1], dtype=np.float32))
            return out if self.calls <= 2 else out + stale

    r = probe_determinism(ProbeModel(Stateful(m), oracle=twin), repeats=2, processes=0, length=8)
    assert r.verdict == "semantic" and "between calls" in r.hint


def test_a_constant_logit_shift_changes_no_probability(torch_fp32):
    """The one judge's convention rung reaches the invariance probes: a circumstance that adds a
    constant to each position's logits (here: every call after the second) changes no probability,
    so it is drift with the reason that says so, not a bug; the same leftover varying over the
    vocabulary is semantic (test_nondeterministic_model_is_semantic)."""
    m, twin = torch_fp32

    class Shifted(MaskIgnored):
        calls = 0

        def __call__(self, tokens, attention_mask=None):
            out = np.asarray(self.m(tokens, attention_mask)).copy()
            self.calls += 1
            return out if self.calls <= 2 else out + np.float32(3.0) * np.arange(out.shape[-2])[:, None]

    r = probe_determinism(ProbeModel(Shifted(m), oracle=twin), repeats=2, processes=0, length=8)
    shifted = [c for c in r.cases if not c.bitwise_equal]
    assert r.verdict == "drift" and shifted, r.summary()
    assert {c.reason for c in shifted} == {"shift_invariant"} and all(c.max_abs > 1 for c in shifted)


def test_greedy_flip_at_near_tie_is_drift_and_at_large_margin_semantic():
    ref = (np.array([5, 6, 7]), np.array([3.0, 2.0, 1.0]), np.array([1.0, 1.999, 0.0]))
    near = (np.array([5, 9, 7]), np.array([3.0, 2.0005, 1.0]), np.array([1.0, 2.0, 0.0]))
    case = compare_completion("near", "g", 2, near, ref, eos=(), threshold=1e-3)
    assert (case.kind, case.first_diff_step, case.margin) == ("drift", 1, pytest.approx(1e-3))
    sure = (np.array([9, 6, 7]), np.array([3.0, 2.0, 1.0]), np.array([1.0, 1.999, 0.0]))
    case = compare_completion("sure", "g", 2, sure, ref, eos=(), threshold=1e-3)
    assert (case.kind, case.first_diff_step, case.margin) == ("semantic", 0, 2.0)
    same = compare_completion("same", "g", 2, ref, ref, eos=(), threshold=1e-3)
    assert same.kind == "exact" and same.bitwise_equal
    # tokens after EOS do not count
    tail = (np.array([5, 2, 1]), ref[1], ref[2])
    ended = (np.array([5, 2, 8]), ref[1], ref[2])
    assert compare_completion("eos", "g", 2, ended, tail, eos=(2,), threshold=1e-3).kind == "exact"


def test_divergence_plan_covers_the_completions():
    plan = divergence_plan(100, (8, 16, 32, 48))
    assert plan[0] == (1, [0], 0) and sum(len(rows) for _, rows, _ in plan) == 100
    assert len(plan) <= 10 and all(max(rows) < B for B, rows, _ in plan)


# ---------------------------------------------------------------- transformers

def test_transformers_runner_probes(ck):
    pytest.importorskip("transformers")
    r = probe_padding(load_model("transformers", ck, "fp32"), length=10, pad=3)
    assert r.verdict in ("exact", "drift") and r.impl == "transformers", r.summary()
    # transformers' own default positions (arange, mask ignored) only shift a left-padded
    # row's positions: RoPE is relative, so that is no semantic difference either
    r = probe_padding(load_model("transformers", ck, "fp32", positions="default"), length=10, pad=3)
    assert r.verdict in ("exact", "drift"), r.summary()
    r = probe_divergence(load_model("transformers", ck, "fp32"), completions=3, new_tokens=4,
                         batch_sizes=(2,), length=8)
    assert r.verdict in ("exact", "drift") and r.details["completions"] == 3


# ---------------------------------------------------------------- reports and CLI

def _fake(probe, verdict, cases, **details) -> ProbeResult:
    return ProbeResult(probe, "torchref bf16 default", "torchref", "bf16", "default", verdict, "hint",
                       0.5, 3.0, 0.1, 0, 0.05, 0.2, 0.01, 0.05, cases, details)


def test_report_table_and_html_have_the_plots():
    batch = _fake("batch", "drift", [Case(f"B={b}", "equal", b, "drift", b < 4, 0.1, 3.0, 0)
                                     for b in (1, 2, 4, 8)])
    div = _fake("divergence", "drift", [Case("B=4 row 1", "batching", 4, "drift", False, 0.1, 2.0, 0,
                                             first_diff_step=7, margin=0.05)],
                completions=10, distinct_completions=2)
    table = format_table([batch, div])
    assert "2 distinct / 10" in table and "drift" in table
    page = render_html(to_document([batch, div], {"checkpoint": "x"}))
    assert page.count("data:image/png;base64,") == 3
    assert "Bitwise-equal fraction vs batch size" in page


def test_cli_end_to_end_writes_reports_and_exits_zero(ck, tmp_path, capsys):
    out, page = tmp_path / "p.json", tmp_path / "p.html"
    rc = main(["probe", "all", "--checkpoint", str(ck), "--impl", "torchref", "--batch-sizes", "2,3",
               "--completions", "3", "--new-tokens", "4", "--divergence-batch-sizes", "3",
               "--repeats", "1", "--processes", "0", "--length", "10",
               "--json", str(out), "--html", str(page), "--no-colour"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    doc = json.loads(out.read_text())
    assert [r["probe"] for r in doc["results"]] == ["batch", "padding", "determinism", "divergence"]
    assert doc["verdict"] in ("exact", "drift") and doc["meta"]["impls"] == ["torchref"]
    assert "data:image/png;base64," in page.read_text()
    assert "probe" in captured.out and "[" in captured.err     # table on stdout, progress on stderr


def test_probes_take_torchref_outputs_that_numpy_refuses(ck, tmp_path, monkeypatch, capsys):
    """On a GPU, torchref's logits are a CUDA tensor and np.asarray(tensor) raises (the lent
    H200 on 2026-12-04: `probe batch --impl torchref` stopped with an internal error). Here every
    np.asarray of a torch tensor raises the same way, so each probe must bring torchref's
    outputs to the host as torch tensors (to_numpy), never through numpy's array protocol."""
    import torch

    def refuse(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy (as on a GPU)")

    monkeypatch.setattr(torch.Tensor, "__array__", refuse)
    with pytest.raises(TypeError):      # the simulation holds
        np.asarray(torch.zeros(2))
    rc = main(["probe", "all", "--checkpoint", str(ck), "--impl", "torchref", "--policy", "fp32,bf16",
               "--batch-sizes", "2", "--completions", "2", "--new-tokens", "2", "--divergence-batch-sizes", "2",
               "--repeats", "1", "--processes", "0", "--length", "8", "--json", str(tmp_path / "p.json"),
               "--no-colour"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    doc = json.loads((tmp_path / "p.json").read_text())
    assert len(doc["results"]) == 8 and doc["verdict"] in ("exact", "drift")


def test_cli_exit_code_is_one_on_a_semantic_finding(ck, tmp_path, monkeypatch, capsys):
    import llama_parity.probe_cli as cli  # it imports load_model at its top: patch it there
    real = cli.load_model

    def leaky(impl, folder, policy="fp32", batch_invariant=False, **kw):
        pm = real(impl, folder, policy, batch_invariant, **kw)
        return ProbeModel(MaskIgnored(pm.model), name="leaky torchref", oracle=fp64_twin(pm.model))

    monkeypatch.setattr(cli, "load_model", leaky)
    rc = main(["probe", "padding", str(ck), "--impl", "torchref", "--length", "10", "--no-colour"])
    captured = capsys.readouterr()
    assert rc == 1 and "semantic" in captured.out and "attention mask is not applied" in captured.out


def test_cli_lists_and_unknown_impl(ck, capsys):
    assert main(["probe", "batch", str(ck), "--impl", "torchref,flax"]) == 2
    assert "unknown implementation 'flax'" in capsys.readouterr().err


# ---------------------------------------------------------------- batch-invariant mode

@pytest.mark.parametrize("impl", IMPLS)
def test_invariant_mode_is_bitwise_batch_invariant(ck, impl):
    if not invariant_available(impl, ck):
        pytest.skip(f"{impl}: batch_invariant=True is not implemented yet")
    pm = load_model(impl, ck, "fp32", batch_invariant=True)
    assert pm.mode == "invariant"
    r = probe_batch(pm, batch_sizes=(2, 5), kinds=("mixed",), length=12)
    assert r.bitwise_equal_frac == 1.0 and r.verdict == "exact", r.summary()
    r.assert_bitwise()
    # the mode's claim covers padding too (canonical layout: real tokens at slots [0, n))
    probe_padding(pm, length=12, pad=3).assert_bitwise()
    probe_determinism(pm, repeats=1, processes=0, batch=3, length=8).assert_bitwise()
    r = probe_divergence(pm, completions=5, new_tokens=4, batch_sizes=(4,), length=8)
    assert r.details["distinct_completions"] == 1 and r.bitwise_equal_frac == 1.0, r.summary()


def test_invariant_mode_cli_skips_or_runs(ck, capsys):
    rc = main(["probe", "batch", str(ck), "--impl", "torchref", "--batch-invariant", "--batch-sizes",
               "2", "--length", "8", "--no-colour"])
    out = capsys.readouterr().out
    if invariant_available("torchref", ck):
        assert rc == 0 and "torchref fp32 invariant" in out
    else:
        assert rc == 2 and "skipped torchref fp32 invariant" in out


# ---------------------------------------------------------------- real weights

@pytest.mark.smollm2
@pytest.mark.slow       # about 2 minutes on 2 cores: SmolLM2 at bf16 and its fp64 twin
def test_smollm2_bf16_padding_probe_tells_a_mask_leak_from_drift(smollm2):
    """On real weights at bf16 (the model's own rounding error is large), a clean model is
    not flagged and the mask leak still is."""
    import torchref
    m = torchref.from_pretrained(smollm2, "bf16")
    twin = fp64_twin(m)
    ids = np.arange(100, 124)
    clean = probe_padding(ProbeModel(m, oracle=twin), ids, pad=4)
    assert clean.verdict in ("exact", "drift"), clean.summary()
    leak = probe_padding(ProbeModel(MaskIgnored(m), oracle=twin), ids, pad=4)
    assert leak.verdict == "semantic" and leak.details["pad_content_leaks"], leak.summary()
    assert not math.isnan(leak.rounding_rel)


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_trace_stops_once_every_row_has_answered(models, impl):
    """With eos, greedy_trace stops after the step where the last row produced one: every row's
    answer up to its EOS, and its top logits there, are the full trace's; the rest holds EOS."""
    from compare.probes import greedy_trace
    from llamaspec.generate import until_eos
    pm = models[impl]
    ids = np.random.default_rng(5).integers(3, 96, (3, 9))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    full = greedy_trace(pm, ids, mask, 12)
    # the token each row emits at its third step serves as an "EOS": every row ends by step 3
    eos = tuple(int(t) for t in full.tokens[:, 2])
    short = greedy_trace(pm, ids, mask, 12, eos)
    ends = [len(until_eos(full.tokens[b], eos)) for b in range(3)]
    assert short.steps_run == max(ends) < 12 and full.steps_run == 12
    for b, n in enumerate(ends):
        for got, want in zip(short.row(b), full.row(b)):
            np.testing.assert_array_equal(got[:n], want[:n])
        assert until_eos(short.tokens[b], eos) == until_eos(full.tokens[b], eos)
    assert (short.tokens[:, max(ends):] == eos[0]).all()
