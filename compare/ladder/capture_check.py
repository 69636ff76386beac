"""Does capturing change the numbers? (issue 21, part 4)

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
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..metrics import max_abs, max_ulp, rel_l2

LOGITS_ONLY = "capture(logits)"   # the protocol's capture, asked for the logits alone
FORWARD = "forward"               # the object's plain __call__(tokens, attention_mask)
FORWARD_AGAIN = "forward, again"  # the plain run against itself: does the side repeat?


@dataclasses.dataclass
class LogitsAgreement:
    """The capturing run's logits against one plain run's (real positions only)."""
    baseline: str           # LOGITS_ONLY | FORWARD | FORWARD_AGAIN
    bitwise: bool
    rel_l2: float           # ||capturing - plain|| / ||plain|| (0.0 when bitwise)
    max_ulp: float          # in the logits' own dtype
    max_abs: float


@dataclasses.dataclass
class CaptureCheck:
    """One side: does recording its taps change its logits?"""
    side: str               # the implementation's name
    dtype: str              # the logits' dtype (ULPs are counted in it)
    taps: int               # how many taps the capturing run recorded
    against: list[LogitsAgreement]
    # False when the plain forward, run twice, differs from itself: then a difference
    # above is the side's own run-to-run noise as much as capturing's; None: no forward
    repeats: bool | None = None

    @property
    def bitwise(self) -> bool:
        """The capturing run's logits equal every plain run's, bit for bit."""
        return all(a.bitwise for a in self.against)

    @property
    def floor(self) -> float:
        """The largest relative L2 difference capturing makes: what the taps cannot resolve."""
        return max((a.rel_l2 for a in self.against), default=0.0)

    @property
    def changes_numbers(self) -> bool:
        """Capturing itself changes the logits: they differ from a plain run that repeats."""
        return not self.bitwise and self.repeats is not False


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


def capture_check(impl, ids, mask=None, taps=None) -> CaptureCheck:
    """Capture every tap of `impl` (or `taps`) on (ids, mask) and compare its logits, bit for
    bit, with a logits-only capture and, where impl is callable, its plain forward (run
    twice: `repeats`). Only real positions (mask 1) count: padding slots may hold anything."""
    ids = np.asarray(ids)
    mask = np.ones(ids.shape, np.int64) if mask is None else np.asarray(mask)
    taps = tuple(impl.taps if taps is None else taps)
    logits, acts = impl.capture(ids, mask, taps=taps)
    captured = _real(logits, mask)
    plain_logits, _ = impl.capture(ids, mask, taps=("logits",))
    against = [_agreement(LOGITS_ONLY, captured, _real(plain_logits, mask))]
    repeats = None
    if callable(impl):
        first = _real(impl(ids, mask), mask)
        again = _agreement(FORWARD_AGAIN, first, _real(impl(ids, mask), mask))
        against.append(_agreement(FORWARD, captured, first))
        repeats = again.bitwise
    return CaptureCheck(str(getattr(impl, "name", type(impl).__name__)), str(captured.dtype), len(acts), against,
                        repeats)
