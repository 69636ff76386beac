"""compare.ladder.capture_check: capturing every tap leaves a side's logits as a plain run
gives them (torchref: the same kernels, the hooks only copy), and a capture that changes
the run (a hook that rounds a step to bf16 in capture mode only) is caught, with its size;
every ladder Report carries the check per side (Report.capture), and the summary, the JSON
and the HTML show it."""

import json

import numpy as np
import pytest

from compare import Dump, capture, compare_models
from compare.adapters import OurModel, Side
from compare.evidence import NO_FORWARD, NO_LOGITS, NOT_NEEDED, REPLAYED, WHOLE_MODEL
from compare.explain import ladder as explain
from compare.ladder.capture_check import FORWARD, FORWARD_AGAIN, LOGITS_ONLY, STREAMED_LOGITS, capture_check
from compare.ladder.engine import run_ladder
from compare.ladder.stream import checkpoint_side
from compare.report.ladder import render_html
from llamaspec import Policy

IDS = np.random.default_rng(0).integers(3, 96, (2, 24))
MASK = np.ones_like(IDS)
MASK[1, :5] = 0     # left padding: only real positions count


@pytest.fixture(scope="module")
def folder(tiny_dir):
    return tiny_dir("gqa")


class _Port:
    """torchref under the Implementation protocol, with what its capture does to the run
    changed by `during_capture(model)` (returns the hook handles to remove)."""

    def __init__(self, folder, during_capture=None, forward_noise=0.0):
        self.inner = OurModel.load("torchref", folder, "fp32")
        self.name, self.taps = "planted", self.inner.taps
        self.during_capture, self.forward_noise = during_capture, forward_noise
        self.rng = np.random.default_rng(1)

    def capture(self, tokens, attention_mask, taps, inject=None):
        hooks = self.during_capture(self.inner.model) if self.during_capture and set(taps) != {"logits"} else []
        try:
            return self.inner.capture(tokens, attention_mask, taps, inject)
        finally:
            for h in hooks:
                h.remove()

    def __call__(self, tokens, attention_mask=None):
        out = self.inner(tokens, attention_mask)
        return out * (1 + self.forward_noise * self.rng.standard_normal(out.shape)).astype(out.dtype)


def _mlp_output_in_bf16(model):
    import torch
    mlp = model.model.layers[0].mlp
    return [mlp.register_forward_hook(lambda mod, args, out: out.to(torch.bfloat16).to(out.dtype))]


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp64"])
def test_torchref_capture_is_bitwise_a_plain_run(folder, policy):
    model = OurModel.load("torchref", folder, policy)
    check = capture_check(model, IDS, MASK)
    assert [a.baseline for a in check.against] == [LOGITS_ONLY, FORWARD]
    assert check.bitwise and check.repeats is None and not check.changes_numbers
    assert check.not_run == {FORWARD_AGAIN: NOT_NEEDED}     # bitwise already: the repeat cannot matter
    assert check.floor == 0.0 and check.taps == len(model.taps)


def test_a_capture_that_rounds_a_step_to_bf16_is_caught(folder):
    check = capture_check(_Port(folder, _mlp_output_in_bf16), IDS, MASK)
    assert not check.bitwise and check.repeats and check.changes_numbers
    for a in check.against:
        # bf16 rounding of one MLP output, carried to the logits: far more than an f32 ulp,
        # far less than a different model
        assert not a.bitwise and a.max_ulp >= 1 and 0 < a.rel_l2 < 0.1 and a.max_abs > 0
    assert check.floor == max(a.rel_l2 for a in check.against)
    assert check.dtype == "float32"


def test_a_side_that_does_not_repeat_is_not_blamed_on_capturing(folder):
    check = capture_check(_Port(folder, forward_noise=1e-3), IDS, MASK)
    assert check.repeats is False and not check.bitwise and not check.changes_numbers
    assert check.against[0].bitwise       # the two captures agree; only the noisy forward does not


def test_a_port_without_a_forward_is_checked_against_its_logits_capture(folder):
    inner = _Port(folder, _mlp_output_in_bf16)

    class NoForward:
        name, taps = "no-forward", inner.taps
        capture = inner.capture

    check = capture_check(NoForward(), IDS, MASK, taps=("layers.0.mlp_out", "logits"))
    assert check.repeats is None and [a.baseline for a in check.against] == [LOGITS_ONLY]
    assert check.changes_numbers and check.taps == 2


def test_a_check_given_the_capturing_runs_logits_captures_nothing_again(folder):
    model = OurModel.load("torchref", folder, "fp32")
    logits, _ = model.capture(IDS, MASK, model.taps)
    calls = []
    model.capture = lambda *a, **k: calls.append(k.get("taps", a[2:3])) or OurModel.capture(model, *a, **k)
    check = capture_check(model, IDS, MASK, model.taps, captured=logits)
    assert calls == [("logits",)] and check.bitwise and check.taps == len(model.taps)


# ----- in the ladder's Report, and its three renderings

def _ladder(folder, candidate: Side):
    return run_ladder(checkpoint_side("torchref", folder, "fp32"), candidate, IDS, MASK, Policy.get("fp32"),
                      stream=False)


def _planted_side(folder) -> Side:
    port = _Port(folder, _mlp_output_in_bf16)
    return Side(port.name, port, OurModel.load("torchref", folder, "fp64"), False, port.taps)


def test_a_clean_torchref_vs_torchref_report_is_bitwise_on_both_sides(folder):
    report = compare_models("torchref", "torchref", folder, inputs=(IDS, MASK), policy="fp32", stream=False)
    assert set(report.capture) == {"reference", "candidate"}
    for check in report.capture.values():
        assert check.bitwise and check.repeats is None and not check.changes_numbers and check.floor == 0.0
        assert [a.baseline for a in check.against] == [LOGITS_ONLY, FORWARD]
    assert report.run["seconds"]["capture check"] >= 0
    lines = report.summary().splitlines()
    assert not any(line.startswith("WARNING") for line in lines) and lines[0].endswith(": exact")
    assert lines[-1].startswith("capture check, candidate torchref: logits with")
    d = json.loads(json.dumps(report.to_dict()))
    assert d["capture"]["reference"]["bitwise"] is True and d["capture"]["candidate"]["floor"] == 0.0
    page = render_html(d)
    assert "<h2>Capture check</h2>" in page and "Capture changes the numbers" not in page


def test_a_planted_capture_that_changes_the_run_is_flagged_in_every_rendering(folder):
    report = _ladder(folder, _planted_side(folder))
    ref, cand = report.capture["reference"], report.capture["candidate"]
    assert ref.bitwise and cand.changes_numbers and cand.repeats is True
    assert cand.floor == max(a.rel_l2 for a in cand.against) > 0
    assert all(a.max_ulp >= 1 for a in cand.against)
    # the summary leads with the warning, its numbers and the floor; the verdict line follows
    lines = report.summary().splitlines()
    assert lines[0].startswith("WARNING (candidate): capturing changes planted's numbers")
    assert f"rel L2 {cand.floor:.1e}" in lines[0] and "cannot resolve" in lines[0] and "ULP in float32" in lines[0]
    assert lines[1].startswith(f"planted vs torchref at fp32: {report.verdict}")
    d = json.loads(json.dumps(report.to_dict()))["capture"]["candidate"]
    assert (d["bitwise"], d["changes_numbers"], d["repeats"], d["floor"]) == (False, True, True, cand.floor)
    assert [a["baseline"] for a in d["against"]] == [LOGITS_ONLY, FORWARD] and d["again"]["bitwise"] is True
    page = render_html(report.to_dict())
    assert "Capture changes the numbers" in page and page.index("Capture changes") < page.index("<h2>")
    assert page.count("<b>no</b>") == 2       # the candidate's two plain runs


def test_the_capture_check_is_typed_rewording_it_changes_nothing(folder, monkeypatch):
    before = _ladder(folder, _planted_side(folder))
    monkeypatch.setattr(explain, "capture_note", lambda c: "reworded")
    after = _ladder(folder, _planted_side(folder))
    assert after.capture["candidate"].note == "reworded"
    assert after.summary().splitlines()[0] == "WARNING (candidate): reworded"
    assert (after.verdict, [v.kind for v in after.taps]) == (before.verdict, [v.kind for v in before.taps])
    assert [(c.bitwise, c.changes_numbers, c.floor) for c in after.capture.values()] == \
        [(c.bitwise, c.changes_numbers, c.floor) for c in before.capture.values()]


def test_the_streamed_ladder_checks_against_a_logits_only_walk_and_says_the_forward_is_not_run(folder):
    report = compare_models("torchref", "jaxmodel", folder, inputs=(IDS, MASK), policy="fp32")
    assert report.run["path"] == "streamed" and "capture check" in report.run["seconds"]
    for role, check in report.capture.items():
        assert check.bitwise and [a.baseline for a in check.against] == [STREAMED_LOGITS], role
        assert check.repeats is None and check.not_run == {FORWARD: WHOLE_MODEL}
    assert "forward not run (streamed: it loads the whole model)" in report.summary()
    assert json.loads(json.dumps(report.to_dict()))["capture"]["candidate"]["not_run"] == {"forward": "whole_model"}


def test_a_users_port_is_held_to_its_logits_capture_and_its___call___is_never_called(folder):
    """The Implementation protocol defines capture, not a plain forward: a port's __call__
    may be anything (an nn.Module's forward of other arguments), so the engine calls none."""
    inner = OurModel.load("torchref", folder, "fp32")

    class UserPort:
        name, taps = "user-port", inner.taps
        capture = inner.capture

        def __call__(self, *args, **kwargs):
            raise AssertionError("the engine called a port's __call__")

    report = compare_models("torchref", UserPort(), folder, inputs=(IDS, MASK), policy="fp32", stream=False)
    check = report.capture["candidate"]
    assert check.bitwise and [a.baseline for a in check.against] == [LOGITS_ONLY] and check.repeats is None
    assert check.not_run == {FORWARD: NO_FORWARD}
    assert "forward not run (not part of the protocol)" in report.summary()


def test_a_port_that_returns_no_logits_is_not_checked_and_the_report_says_so(folder):
    inner = OurModel.load("torchref", folder, "fp32")

    class NoLogits:      # the protocol allows logits None
        name, taps = "no-logits", tuple(t for t in inner.taps if t != "logits")

        def capture(self, tokens, attention_mask, taps, inject=None):
            return None, inner.capture(tokens, attention_mask, taps, inject)[1]

    report = compare_models("torchref", NoLogits(), folder, inputs=(IDS, MASK), policy="fp32", stream=False)
    check = report.capture["candidate"]
    assert not check.ran and not check.changes_numbers and check.not_run == {"check": NO_LOGITS}
    assert "capture check, candidate no-logits: not run (no logits)" in report.summary()


def test_a_dump_is_not_checked_and_the_report_says_why(folder, tmp_path):
    out = capture(folder, "jaxmodel", "fp32", inputs=(IDS, MASK), out=tmp_path / "dump")
    report = compare_models("torchref", Dump(out), folder, inputs=(IDS, MASK), policy="fp32", teacher_forcing=False)
    cand = report.capture["candidate"]
    assert not cand.ran and not cand.bitwise and not cand.changes_numbers and cand.not_run == {"check": REPLAYED}
    assert report.capture["reference"].bitwise
    assert "capture check, candidate jaxmodel (dump): not run (a dump replays stored arrays)" in report.summary()
    assert "not run" in render_html(report.to_dict())
