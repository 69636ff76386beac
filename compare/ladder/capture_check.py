"""Does capturing change the numbers?

Hooks, `sow`, forced outputs and host copies can change what a framework compiles or
which kernels it picks, and so the numbers it produces: a capture that records every tap
is then not the run a user ships. Per side, the logits of the capturing run (every tap)
are compared with the same inputs run plainly: a capture of the logits alone (the
Implementation protocol) and, where the object has one, its plain forward (`__call__`:
our models, transformers). Bitwise equal is the expected answer; otherwise the record
says by how much (relative L2, max ULP in the logits' dtype), and that difference is the
floor of what the taps of that side can show.

A plain run repeated tells a capture effect from a side that does not repeat itself
(threaded reductions): a difference counts against capturing only when the plain run
repeats bitwise.

    check = capture_check(side.at_policy, ids, mask)
    check.bitwise, check.floor, check.against[0].max_ulp

The ladder (engine.run_ladder) checks both sides at the policy with the logits of its own
capturing runs (`captured=`); the streamed ladder with streamed_check, against a streamed
walk that asks for the logits alone. The records are compare.evidence's.
"""

from __future__ import annotations

import numpy as np

from .. import evidence as ev
from ..adapters import Checked
from ..adapters.dump import Dump
from ..metrics import max_abs, max_ulp, rel_l2
from .stream import stream_capture

# the records and the plain runs' names live in compare.evidence (compare.explain renders them)
CaptureCheck, LogitsAgreement = ev.CaptureCheck, ev.LogitsAgreement
LOGITS_ONLY, FORWARD, FORWARD_AGAIN, STREAMED_LOGITS = ev.LOGITS_ONLY, ev.FORWARD, ev.FORWARD_AGAIN, ev.STREAMED_LOGITS


def _real(logits, mask) -> np.ndarray:
    x = np.asarray(logits)
    return x if mask is None else x[np.asarray(mask, bool)]


def _agreement(baseline: str, captured: np.ndarray, plain: np.ndarray) -> LogitsAgreement:
    if captured.shape != plain.shape:
        raise ValueError(f"capture check, {baseline}: logits shape {captured.shape} (capturing every tap) vs "
                         f"{plain.shape} (plain run)")
    same = captured.dtype == plain.dtype and np.array_equal(captured.view(np.uint8), plain.view(np.uint8))
    if same:
        return LogitsAgreement(baseline, True, 0.0, 0.0, 0.0)
    return LogitsAgreement(baseline, False, rel_l2(captured, plain), max_ulp(captured, plain, captured.dtype),
                           max_abs(captured, plain))


def _name(impl) -> str:
    return str(getattr(impl, "name", type(impl).__name__))


def _inputs(ids, mask):
    ids = np.asarray(ids)
    return ids, np.ones(ids.shape, np.int64) if mask is None else np.asarray(mask)


def capture_check(impl, ids, mask=None, taps=None, captured=None, forward: bool | None = None) -> CaptureCheck:
    """Capture every tap of `impl` (or `taps`) on (ids, mask) and compare its logits, bit for
    bit, with a logits-only capture and, where impl is callable (or `forward`), its plain
    forward, run twice (`repeats`) only where the capture is not bitwise that forward. Only
    real positions (mask 1) count: padding slots may hold anything. captured: the logits of a
    capturing run of `taps` already made (the ladder's), not redone."""
    ids, mask = _inputs(ids, mask)
    taps = tuple(impl.taps if taps is None else taps)
    if captured is None:
        captured, _ = impl.capture(ids, mask, taps=taps)
    # the logits alone: as a tap where it has one, else no tap at all (capture returns the logits)
    plain_logits, _ = impl.capture(ids, mask, taps=("logits",) if "logits" in taps else ())
    if captured is None or plain_logits is None:
        return not_checked(impl, taps, ev.NO_LOGITS)
    captured = _real(captured, mask)
    against = [_agreement(LOGITS_ONLY, captured, _real(plain_logits, mask))]
    repeats = again = None
    not_run = {FORWARD: ev.NO_FORWARD}
    if callable(impl) if forward is None else forward:
        first = _real(impl(ids, mask), mask)
        against.append(_agreement(FORWARD, captured, first))
        # The forward run again tells capturing from a side that does not repeat itself; where
        # the capture is bitwise the plain runs already, nothing is left for it to tell.
        if all(a.bitwise for a in against):
            not_run = {FORWARD_AGAIN: ev.NOT_NEEDED}
        else:
            again = _agreement(FORWARD_AGAIN, first, _real(impl(ids, mask), mask))
            repeats, not_run = again.bitwise, {}
    return CaptureCheck(_name(impl), str(captured.dtype), len(taps), against, repeats, again, not_run)


def streamed_check(impl, ids, mask, captured, taps) -> CaptureCheck:
    """The streamed ladder's capturing walk (every tap of every layer; `captured`: its logits
    at the real positions) against a streamed walk of `impl` (a CheckpointModel) that asks for
    the logits alone: another program per layer where the framework compiles one per tap set
    (jaxmodel's LayerRunner). The plain forward is not run: it loads the whole model, which
    the streamed ladder exists to avoid (the full ladder runs it; tests/test_stream.py holds
    the streamed walk bitwise to the loaded model's capture)."""
    ids, mask = _inputs(ids, mask)
    plain, _ = stream_capture(impl, ids, mask, ("logits",))
    captured = np.asarray(captured)
    return CaptureCheck(_name(impl), str(captured.dtype), len(taps),
                        [_agreement(STREAMED_LOGITS, captured, _real(plain, mask))], not_run={FORWARD: ev.WHOLE_MODEL})


def not_checked(impl, taps, why: str) -> CaptureCheck:
    """The record of a side whose capture is not checked: `why` REPLAYED (a dump) or NO_LOGITS."""
    return CaptureCheck(_name(impl), "", len(taps), [], not_run={"check": why})


def has_forward(impl) -> bool:
    """impl's __call__(tokens, attention_mask) is its plain forward: ours, transformers', a
    prepared Side's object (the controls'); not a user's port (wrapped by adapters.Checked),
    whose __call__ the Implementation protocol does not define, so the engine never calls it."""
    return callable(impl) and not isinstance(impl, Checked)


def reason_not_to_check(impl, captured) -> str | None:
    """REPLAYED for a dump (its logits-only capture reads the same stored bytes: a check of it
    would be bitwise by construction, and say nothing), NO_LOGITS when the capturing run gave
    none; None: check it."""
    if isinstance(getattr(impl, "wrapped", impl), Dump):
        return ev.REPLAYED
    return ev.NO_LOGITS if captured is None else None
