"""The JSON form of every result the package returns (the ladder's Report, the probes'
ProbeResult): dataclasses written as plain JSON, non-finite floats as strings; and what a
comparison judged (Coverage: the reference's taps the candidate does not return, and how each
side's logits were judged)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from llamaspec import taps as tapnames
from llamaspec.files import atomic_write, json_safe, json_text


def jsonable(x):
    """JSON-safe copy: non-finite floats as strings, numpy scalars as Python numbers
    (llamaspec.files.json_safe, the rule of every JSON the tool writes)."""
    return json_safe(x)


class JsonResult:
    """to_dict / to_json for the result dataclasses."""

    def to_dict(self) -> dict:
        return jsonable(dataclasses.asdict(self))

    def to_json(self, path) -> Path:
        return atomic_write(Path(path), json_text(self.to_dict(), indent=1), "JSON report")


def inputs_record(ids, mask) -> dict:
    """What a report records of the token ids it was computed on (Report.inputs, DecodeReport.inputs):
    their shape and a SHA-256 of the real tokens and the mask (a padding slot's id is not part of
    the math, so not of the digest), so that a later step given the inputs again (compare.repro)
    can tell whether they are the same."""
    ids, mask = np.asarray(ids, np.int64), np.asarray(mask, np.int64)
    real = np.where(mask != 0, ids, -1)
    digest = hashlib.sha256(f"{ids.shape}".encode() + real.tobytes() + (mask != 0).astype(np.int8).tobytes())
    return {"rows": int(ids.shape[0]), "tokens": int(ids.shape[1]), "real_tokens": int((mask != 0).sum()),
            "sha256": digest.hexdigest()}


# ----- what the ladder judged (Report.coverage) -------------------------------------------------

# How one side's logits reached the judge (Coverage.logits): its "logits" tap; the logits its
# capture returns (the protocol's pair, element 0) standing in for a tap it lacks; neither (its
# capture returned None and it has no "logits" tap); or none from its float64 run where it
# returns them at the policy (the reference's is the oracle; the candidate's, the fp64 rung).
TAP, RETURNED, NONE, NONE_AT_FP64 = "tap", "returned", "none", "none at float64"
ROLES = ("reference", "candidate")


@dataclasses.dataclass
class Coverage:
    """What of the reference the ladder judged in the candidate (Report.coverage): a tap is
    judged only where both sides return it, so a port's tap map decides what is looked at.
    logits: {"reference", "candidate": TAP | RETURNED | NONE | NONE_AT_FP64}, how each side's
    logits were judged; logits_judged: whether the "logits" tap (the lm_head) was judged at all.
    unjudged: {step: [tap, ...]}, the reference's taps that were not judged (the candidate
    returns no such tap), grouped by step (the tap's kind within its layer, "q", "k_rope", or
    "embed", "final_norm", "logits" outside the layers), in execution order; candidate_only:
    the candidate's taps the reference has no oracle for (not judged either). withheld: {tap:
    why} for unjudged taps the candidate computes but declares another quantity than the
    reference's (its optional `not_comparable`, e.g. a norm whose weight was folded away),
    display only. note: the report's sentence (compare.explain.ladder.coverage_line), "" when
    everything was judged."""
    reference: str
    candidate: str
    logits: dict
    logits_judged: bool
    judged: int                 # how many taps were judged
    reference_taps: int         # how many taps the reference returns
    unjudged: dict = dataclasses.field(default_factory=dict)
    candidate_only: list = dataclasses.field(default_factory=list)
    note: str = ""
    withheld: dict = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every tap of the reference judged, with the logits as a tap on both sides."""
        return not self.unjudged and not self.candidate_only and all(s == TAP for s in self.logits.values())


def coverage(reference: str, candidate: str, ref_taps, cand_taps, judged, logits: dict,
             not_comparable: dict | None = None) -> Coverage:
    """The Coverage of a comparison: the sides' names and tap names, the taps judged (in
    order), each side's logits source ({role: TAP | RETURNED | NONE | NONE_AT_FP64}), and the
    candidate's not_comparable {tap: why} (its reasons for the unjudged taps it withholds)."""
    judged = tuple(judged)
    done, theirs = set(judged), set(ref_taps)
    unjudged: dict = {}
    for t in ref_taps:
        if t not in done:
            unjudged.setdefault(tapnames.parse(t)[1], []).append(t)
    why = {t: str(r) for t, r in (not_comparable or {}).items() if t in theirs and t not in done}
    return Coverage(reference, candidate, {r: logits[r] for r in ROLES}, "logits" in done, len(judged),
                    len(theirs), unjudged, [t for t in cand_taps if t not in theirs and t not in done],
                    withheld=why)
