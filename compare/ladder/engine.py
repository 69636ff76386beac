"""The ladder end to end: four captures, a verdict per tap, teacher forcing, a Report.

compare_models / assert_parity are the public API; run_ladder takes two prepared Sides
(compare.adapters). verdicts.py judges one tap (its rungs return compare.evidence records,
compare.explain writes the sentences), teacher.py localises; compare.controls holds the
planted bugs and clean runs that calibrate both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import numpy as np

from llamaspec import InputError, Policy
from llamaspec import taps as tapnames
from llamaspec.tokenizer import Tokenizer

from ..adapters import (
    PACKAGES,
    Checked,
    InjectUnsupported,
    OurModel,
    PortError,
    Side,
    config_differences,
    inject_support,
    resolve_side,
)
from ..adapters.dump import bind_dumps
from ..environment import environment, sides_of
from ..explain import ladder as explain
from ..judge.verdicts import (
    Divergence,
    TapVerdict,
    classify,
    context_for,
    first_divergence,
    nonfinite_origin,
    settle_conventions,
)
from ..metrics import logits_agreement, pair_metrics
from ..report.ladder import write_html
from ..results import NONE, NONE_AT_FP64, RETURNED, TAP, Coverage, JsonResult, coverage, inputs_record
from ..vocabulary import KINDS
from .capture_check import CaptureCheck, capture_check, has_forward, not_checked, reason_not_to_check, streamed_check
from .stream import checkpoint_side, streamable, streamed_ladder
from .teacher import FINDINGS, ForcedRuns, amplification, inherit, local_errors, local_verdicts
from .twins import NO_TWIN, TwinCheck, check_side


@dataclasses.dataclass
class Report(JsonResult):
    reference: str
    candidate: str
    policy: dict
    verdict: str
    first_divergence: Divergence | None
    taps: list[TapVerdict]
    local: list[dict]       # per layer: local error of each side with oracle inputs forced
    logits: dict = dataclasses.field(default_factory=dict)        # metrics.logits_agreement
    environment: dict = dataclasses.field(default_factory=dict)   # compare.environment
    config_differences: list = dataclasses.field(default_factory=list)  # adapters.config_differences
    teacher_forcing: str = "run"    # "run" | "off" | "not run: <why>"
    # "run" | "not run: <why>": without the candidate's float64 twin the taps are judged by
    # structure alone (verdicts.classify_without_twin), which the summary says
    semantic_rung: str = "run"
    # how the ladder ran: {"path": "streamed" | "full", "seconds": {run or step: wall s}}
    # (streamed: layer by layer over the checkpoint, compare.ladder.stream)
    run: dict = dataclasses.field(default_factory=dict)
    # {"reference", "candidate": compare.evidence.CaptureCheck}: does capturing the taps change
    # that side's logits at the policy? The verdict does not read it (capture_checks)
    capture: dict = dataclasses.field(default_factory=dict)
    # where NaN/Inf first appears ({} when nowhere): {"tap", "reference", "candidate",
    # "candidate_fp64": counts, "cause", "why" where the config explains it (verdicts.nonfinite_origin),
    # "note": the sentence}
    nonfinite: dict = dataclasses.field(default_factory=dict)
    # the candidate's float64 twin as checked before it was trusted (twins.check_twin): its
    # weights, its arithmetic, and what the ladder did (accepted, keeps_f32 inferred, refused)
    twin: TwinCheck | None = None
    # what was judged (compare.results.Coverage): how each side's logits were judged (a port without
    # a "logits" tap: the logits its capture returns), the lm_head not judged, the reference's taps
    # the candidate does not return; its note is the summary's line
    coverage: Coverage | None = None
    # the inputs' shape and digest (results.inputs_record): what `repro` checks the inputs given again by
    inputs: dict = dataclasses.field(default_factory=dict)

    def to_html(self, path) -> Path:
        return write_html(self, path)

    def summary(self) -> str:
        return explain.report_summary(self)


def run_ladder(ref: Side, cand: Side, ids, mask, policy: Policy, teacher_forcing=True,
               progress=lambda msg: None, stream: bool | None = None, check_determinism: bool = True) -> Report:
    """The ladder for two prepared Sides. stream: None streams when both sides can
    (stream.streamable: torchref / jaxmodel named by string, over checkpoint folders),
    True insists, False captures whole runs. check_determinism: a user's port (adapters.Checked)
    captures its first tap set twice before anything is judged (check_repeats; one more capture
    per port); False skips that."""
    ref.needs_twin("reference", "the ladder (its float64 run is the oracle)")
    differences = config_differences(ref.at_policy, cand.at_policy)
    if stream or (stream is None and streamable(ref, cand)):
        return _run_streamed(ref, cand, ids, mask, policy, teacher_forcing, progress, differences)
    taps = tuple(t for t in ref.taps if t in set(cand.taps))
    real = np.asarray(mask, bool)
    progress(f"reference {ref.name} at {policy.name}")
    seconds, t0 = {}, time.perf_counter()
    r_logits, r = ref.at_policy.capture(ids, mask, taps)
    t0 = _lap(seconds, f"r ({ref.name} at {policy.name})", t0)
    progress(f"candidate {cand.name} at {policy.name}")
    c_logits, c = cand.at_policy.capture(ids, mask, taps)
    t0 = _lap(seconds, f"c ({cand.name} at {policy.name})", t0)
    if check_determinism:
        for side, first in ((ref, (r_logits, r)), (cand, (c_logits, c))):
            check_repeats(side.at_policy, ids, mask, taps, first, progress)
        t0 = _lap(seconds, "determinism check", t0)
    capture = capture_checks(ref, cand, ids, mask, taps, (r_logits, c_logits), progress)
    t0 = _lap(seconds, "capture check", t0)
    progress("oracle: reference at fp64")
    o_logits, o = ref.at_fp64.capture(ids, mask, ref.taps)   # all of them: context for the hints
    t0 = _lap(seconds, f"o ({ref.name} at fp64)", t0)
    has_twin = cand.at_fp64 is not None
    c64, twin, cand, c64_logits = _twin(cand, ids, mask, taps, o, real, policy, progress)
    if has_twin:
        t0 = _lap(seconds, f"c64 ({cand.name} at fp64)", t0)
    judged, cover, (fref, fcand) = _returned_logits(ref, cand, taps, {"r": (r_logits, r), "c": (c_logits, c),
                                                                      "o": (o_logits, o), "c64": (c64_logits, c64)})
    keeps_f32 = ref.keeps_f32 or cand.keeps_f32
    verdicts = judge_taps(judged, r, c, o, c64, real, policy, keeps_f32,
                          getattr(ref.at_policy, "weight_sources", None), _config_of(ref, cand))
    settle_conventions(verdicts)     # before inherit picks the first finding
    logits = (logits_agreement(r["logits"], c["logits"], o["logits"], real)
              if "logits" in judged else {})
    t0 = _lap(seconds, "judging", t0)
    forced = ForcedRuns(fref, fcand, ids, mask, o) if teacher_forcing else None
    if teacher_forcing and _inherit(forced, fref, fcand, o, real, verdicts, policy, keeps_f32, progress):
        t0 = _lap(seconds, "inherited taps (teacher forcing)", t0)
    worst, divergence = first_divergence(verdicts)
    local, forcing = [], "off"
    if teacher_forcing:
        local, forcing = _teacher_forcing(fref, fcand, ids, mask, o, real, divergence, policy, keeps_f32, progress,
                                          forced)
        if forcing == "run":
            _lap(seconds, "teacher forcing", t0)
            amplification(local, verdicts)
    uses_jax = any(getattr(side.at_policy, "package", None) == "jaxmodel" for side in (ref, cand))
    rung = ("run" if c64 is not None else f"not run: {twin.note}" if twin.refused else
            f"not run: {cand.name} has no float64() (the same implementation at float64)")
    return Report(ref.name, cand.name, policy.to_dict(), worst, divergence, verdicts, local,
                  logits, environment(policy, uses_jax, sides_of(ref, cand)), differences, forcing, rung,
                  run={"path": "full", "seconds": seconds}, capture=capture,
                  nonfinite=_nonfinite(verdicts, ref, cand, policy, mask), twin=twin, coverage=cover,
                  inputs=inputs_record(ids, mask))


def _twin(cand: Side, ids, mask, taps, o, real, policy: Policy, progress):
    """(c64, TwinCheck, cand as the ladder runs it, the logits the twin's capture returned): the
    candidate's float64 twin captured and checked before it is trusted (twins.check_twin); c64
    None without a twin or when refused (judged by structure alone,
    verdicts.classify_without_twin); TwinCheck None for a twin this project builds (not a
    user's port: adapters.Checked)."""
    if cand.at_fp64 is None:
        progress(f"candidate at fp64: not run ({cand.name} has no float64())")
        return None, TwinCheck(NO_TWIN), cand, None
    progress("candidate at fp64 (semantic rung)")
    c64_logits, c64 = cand.at_fp64.capture(ids, mask, taps)
    if not isinstance(cand.at_fp64, Checked):
        # ours, transformers' and a CheckpointModel's twins are built here from the checkpoint's
        # weights at float64 (the streamed ladder's too, which has no whole-run taps to check)
        return c64, None, cand, c64_logits
    twin, cand = check_side(cand, c64, o, taps, real, policy.param_dtype, progress)
    return (None if twin.refused else c64), twin, cand, c64_logits


def _returned_logits(ref: Side, cand: Side, taps, runs: dict):
    """(the taps to judge, Report.coverage, (ref, cand) Sides for teacher forcing). A tap is
    judged where both sides have it; the logits also where a side lacks the "logits" tap but its
    capture returns logits (the protocol's pair, element 0: generic.TorchModule returns its
    forward's output whatever its map): they are added to the runs (runs: {"r", "c", "o", "c64":
    (returned logits, taps)}, c64's taps None without a twin) as the "logits" tap and judged as
    one, against the oracle's logits, and such a side's implementations return them as the tap in
    the forced runs too (_ReturnedLogitsTap). A side with neither leaves the lm_head unjudged,
    which the coverage says."""
    (r_logits, _), (c_logits, _), (o_logits, _), (c64_logits, c64) = (runs[k] for k in ("r", "c", "o", "c64"))
    how = {"reference": TAP if "logits" in ref.taps else
           NONE if r_logits is None else NONE_AT_FP64 if o_logits is None else RETURNED,
           "candidate": TAP if "logits" in cand.taps else
           NONE if c_logits is None else NONE_AT_FP64 if c64 is not None and c64_logits is None else RETURNED}
    judged, sides = tuple(taps), (ref, cand)
    if "logits" not in judged and all(h in (TAP, RETURNED) for h in how.values()):
        judged += ("logits",)
        for k, (returned, acts) in runs.items():
            if acts is not None and "logits" not in acts:
                acts["logits"] = np.asarray(returned)
        sides = tuple(side if h == TAP else _with_logits_tap(side) for side, h in zip((ref, cand), how.values()))
    cover = coverage(ref.name, cand.name, ref.taps, cand.taps, judged, how,
                     getattr(cand.at_policy, "not_comparable", None))
    cover.note = explain.coverage_line(cover)
    return judged, cover, sides


def _with_logits_tap(side: Side) -> Side:
    return dataclasses.replace(side, at_policy=_ReturnedLogitsTap(side.at_policy), taps=(*side.taps, "logits"),
                               at_fp64=None if side.at_fp64 is None else _ReturnedLogitsTap(side.at_fp64))


class _ReturnedLogitsTap:
    """A side's implementation (a port without a "logits" tap) whose capture returns the logits
    it returns (element 0 of its pair) as its "logits" tap too: teacher forcing asks for the tap
    by name. Everything else is the implementation's own (its name, inject support, its port)."""

    def __init__(self, impl):
        self.impl, self.name, self.taps = impl, impl.name, (*impl.taps, "logits")

    def __getattr__(self, key):
        if key == "impl":
            raise AttributeError(key)
        return getattr(self.impl, key)

    def capture(self, tokens, attention_mask, taps, inject=None):
        own = [t for t in taps if t != "logits"]
        logits, acts = (self.impl.capture(tokens, attention_mask, own) if inject is None else
                        self.impl.capture(tokens, attention_mask, own, inject=inject))
        if "logits" in taps:
            if logits is None:
                raise PortError(f"{self.name}: capture returned no logits (with inject), where its capture without "
                                "inject did; the ladder judges them as its 'logits' tap")
            acts = {**acts, "logits": np.asarray(logits)}
        return logits, acts


def _nonfinite(verdicts, ref: Side, cand: Side, policy: Policy, mask) -> dict:
    """Report.nonfinite: verdicts.nonfinite_origin with its sentence (explain.nonfinite_line) as "note"."""
    n = nonfinite_origin(verdicts, _config_of(ref, cand), policy, mask)
    return {**n, "note": explain.nonfinite_line(n)} if n else n


def _config_of(ref: Side, cand: Side):
    """The llamaspec config one side computes by (ours and CheckpointModels have one; a port may not)."""
    for side in (ref, cand):
        cfg = getattr(side.at_policy, "cfg", None)
        if cfg is not None and hasattr(cfg, "rope"):
            return cfg
    return None


class NotDeterministic(PortError):
    """A port whose capture, made again on the same inputs, returns other bits (or changes what
    it returned before): its differences from the reference cannot be judged, since a rounding
    and a bug would both hide in its own noise."""


def check_repeats(impl, ids, mask, taps, first, progress=lambda msg: None) -> None:
    """NotDeterministic unless a user's port (adapters.Checked; ours, transformers' and dumps are
    not checked here) captures `taps` on (ids, mask) again bitwise as `first` (its (logits, taps)
    of the same call), at the real positions (padding slots may hold anything), and leaves the
    arrays it returned first untouched (a port that reuses its output buffers). The tap named
    is the first in execution order that differs; the returned logits come last."""
    if not isinstance(impl, Checked):
        return
    progress(f"determinism: {impl.name} captured again on the same inputs")
    real = np.asarray(mask, bool)
    before = _digests(first, taps, real)
    again = impl.capture(ids, mask, taps)
    after = _digests(first, taps, real)
    again_digests = _digests(again, taps, real)      # once: not once per tap
    reused = next((t for t in before if before[t] != after[t]), None)
    differs = next((t for t in before if before[t] != again_digests.get(t)), None)
    if reused is None and differs is None:
        return
    what = (f"changed the arrays it returned the first time when called again, first at tap '{reused}' (it "
            "reuses its output buffers: return copies)" if reused is not None else
            f"returned other numbers the second time, first at tap '{differs}'"
            + _how_much(first, again, taps, differs, real))
    raise NotDeterministic(f"{impl.name}: not deterministic: the same capture on the same inputs "
                           f"({' x '.join(map(str, np.shape(ids)))} tokens) {what}; its differences from the "
                           "reference cannot be judged against its own noise. Make it repeat itself (seeds, a fixed "
                           "order of reductions), or pass check_determinism=False to judge it anyway")


def _arrays(out, taps) -> dict:
    logits, acts = out
    return {**{t: acts[t] for t in taps}, **({} if logits is None else {"logits (returned)": logits})}


def _digests(out, taps, real) -> dict:
    """{tap: sha256 of its dtype, shape and bytes at the real positions}."""
    digests = {}
    for t, a in _arrays(out, taps).items():
        a = np.asarray(a)
        part = np.ascontiguousarray(a[real] if a.shape[:2] == real.shape else a)
        digests[t] = hashlib.sha256(f"{part.dtype} {part.shape}".encode() + part.tobytes()).hexdigest()
    return digests


def _how_much(first, again, taps, tap, real) -> str:
    a, b = (np.asarray(_arrays(x, taps)[tap]) for x in (first, again))
    if a.shape != b.shape or a.shape[:2] != real.shape:
        return f" (shape {list(a.shape)}, then {list(b.shape)})"
    a, b = np.asarray(a[real], np.float64), np.asarray(b[real], np.float64)
    differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    with np.errstate(invalid="ignore"):
        big = float(np.nanmax(np.abs(a - b)[differ])) if differ.any() else 0.0
    return f" ({int(differ.sum())} of {a.size} values differ, by up to {big:.3g})"


def capture_checks(ref: Side, cand: Side, ids, mask, taps, captured, progress=lambda msg: None) -> dict:
    """Report.capture: each side at the policy held to its plain runs (capture_check.capture_check),
    with the logits of the ladder's own capturing runs (`captured`: reference's, candidate's), so
    nothing is captured twice. The float64 runs are not checked: they measure the policy runs'
    rounding, and what a capture could change in them (the order of f64 sums) is ~1e-16
    relative, far below the fp64 rung's floor and any working policy's rounding.

    The verdict is the same whatever this finds: the taps are judged as captured; the summary
    leads with a capture that changes the numbers and names its floor (explain.capture_note)."""
    out = {}
    for role, side, logits in (("reference", ref, captured[0]), ("candidate", cand, captured[1])):
        impl = side.at_policy
        why = reason_not_to_check(impl, logits)
        if why is None:
            progress(f"capture check: {side.name} at the policy, its logits alone"
                     + (" and its plain forward" if has_forward(impl) else ""))
        check = (not_checked(impl, taps, why) if why else
                 capture_check(impl, ids, mask, taps, logits, forward=has_forward(impl)))
        out[role] = _noted(check)
    return out


def _noted(check: CaptureCheck) -> CaptureCheck:
    check.note = explain.capture_note(check)
    return check


def judge_taps(taps, r, c, o, c64, real, policy: Policy, keeps_f32: bool, weights=None, cfg=None) -> list[TapVerdict]:
    """classify every tap in execution order (dtype noise found at one tap is carried to the
    next), with the pair metrics of candidate vs reference. c64 None: no float64 twin. weights:
    the reference's weight_sources (OurModel), for the stored-weights test, or None. cfg: the
    reference's llamaspec config (its family's steps as the hints read them), or None."""
    hidden = np.shape(o["embed"])[-1] if "embed" in o else None
    verdicts, noise_from = [], None
    for t in taps:
        v = classify(t, r[t], c[t], o[t], None if c64 is None else c64[t], real, policy, keeps_f32,
                     context_for(t, c if c64 is None else c64, o, weights, cfg), hidden, noise_from)
        if v.noise_dtype and noise_from is None:
            noise_from = v
        v.metrics = pair_metrics(c[t][real], r[t][real], tapnames.dtype_of(t, policy))
        verdicts.append(v)
    return verdicts


def _inherit(forced: ForcedRuns, ref: Side, cand: Side, o, real, verdicts, policy, keeps_f32, progress) -> bool:
    """Teacher forcing's word on the findings after the first (teacher.inherit): True when the
    forced runs were made. Without inject on a side nothing is relabelled (the report says
    teacher forcing did not run)."""
    if not any(v.kind in FINDINGS for v in verdicts):
        return False
    if any(map(inject_support, (ref.at_policy, cand.at_policy))):
        return False
    progress("teacher forcing: are the later findings the first one's, inherited?")
    try:
        local = local_verdicts(forced, o, real, verdicts, policy, keeps_f32, _config_of(ref, cand))
    except InjectUnsupported:
        return False
    inherit(verdicts, local)
    return bool(local)


def _teacher_forcing(ref: Side, cand: Side, ids, mask, o, real, divergence, policy, keeps_f32, progress,
                     forced: ForcedRuns | None = None):
    """(local errors per layer, Report.teacher_forcing): "run", or "not run: <why>" when a
    side takes no inject. forced: the forced runs _inherit already made, reused."""
    no_inject = [why for why in map(inject_support, (ref.at_policy, cand.at_policy)) if why]
    if no_inject:
        return [], f"not run: {'; '.join(no_inject)} (teacher forcing needs it)"
    progress("teacher forcing: every layer fed the oracle's input")
    try:
        return local_errors(ref, cand, ids, mask, o, real, divergence, policy, keeps_f32, forced), "run"
    except InjectUnsupported as e:     # the port said so at the call (NotImplementedError)
        return [], f"not run: {e} (teacher forcing needs it)"


def _lap(seconds: dict, what: str, t0: float) -> float:
    now = time.perf_counter()
    seconds[what] = round(seconds.get(what, 0.0) + now - t0, 3)
    return now


def _run_streamed(ref: Side, cand: Side, ids, mask, policy: Policy, teacher_forcing, progress, differences) -> Report:
    if not streamable(ref, cand):
        raise ValueError(f"stream=True: {ref.name} vs {cand.name} cannot stream; only torchref and jaxmodel named "
                         "by string (read from the checkpoint folder layer by layer) can")
    progress(f"{cand.name} vs {ref.name} at {policy.name}, layer by layer (streamed): four runs and the "
             "teacher-forced ones per layer")
    s = streamed_ladder(ref, cand, ids, mask, policy, teacher_forcing, progress)
    t0 = time.perf_counter()
    taps = tuple(t for t in ref.taps if t in set(cand.taps))
    capture = {}
    for role, side, k in (("reference", ref, "r"), ("candidate", cand, "c")):
        progress(f"capture check: {side.name} at the policy walked again for its logits alone (streamed)")
        capture[role] = _noted(streamed_check(side.at_policy, ids, mask, s.captured.pop(k), taps))
    _lap(s.seconds, "capture check", t0)
    uses_jax = "jaxmodel" in (ref.at_policy.package, cand.at_policy.package)
    # both sides are ours (streamable): every tap of theirs, the logits as a tap; what they do not
    # share (another family's steps) is said as the whole-run path says it
    cover = coverage(ref.name, cand.name, ref.taps, cand.taps, [v.tap for v in s.verdicts],
                     {"reference": TAP if "logits" in ref.taps else NONE,
                      "candidate": TAP if "logits" in cand.taps else NONE})
    cover.note = explain.coverage_line(cover)
    return Report(ref.name, cand.name, policy.to_dict(), s.worst, s.divergence, s.verdicts, s.local, s.logits,
                  environment(policy, uses_jax, sides_of(ref, cand)), differences, "run" if teacher_forcing else "off",
                  run={"path": "streamed", "seconds": s.seconds}, capture=capture,
                  nonfinite=_nonfinite(s.verdicts, ref, cand, policy, mask), coverage=cover,
                  inputs=inputs_record(ids, mask))


# The default input: one chat prompt of 258 tokens with SmolLM2's tokenizer, long enough for position-
# dependent bugs (RoPE, masks) to show a
# trend and for softmaxes over many keys, short enough for the fp64 rung to stay cheap.
BUILTIN_PROMPTS = [
    "Read the following notes and answer the question at the end.\n\n"
    "Floating-point addition is not associative: (a + b) + c can differ from a + (b + c) in the "
    "last bits, because every operation rounds its exact result to the nearest number the format "
    "can hold. A float32 number keeps 24 bits of significand, a bfloat16 number only 8, so the "
    "same sum computed in a different order lands on a neighbouring value. Inside a language "
    "model these tiny differences pass through dozens of layers of matrix products. Most of the "
    "time they stay at the level of the rounding itself. A real bug looks different: a rotary "
    "embedding applied to the wrong pairs of dimensions, a normalisation with the wrong epsilon, "
    "or a mask that lets a token see its future changes the numbers even when every step is "
    "computed in double precision, and it changes them in a pattern that follows positions, "
    "heads or rows rather than looking like noise.\n\n"
    "Question: why can two correct implementations of the same model give different answers, "
    "and how would you tell that apart from a bug?",
]


def parse_inputs(inputs, checkpoint):
    """None -> built-in prompts; a str or list[str] -> chat-encoded prompts; an int array
    [B, T], or (ids, mask). Checked here so that a bad argument is named as `inputs`.

    Text batches are right-padded: transformers' eager float64 attention turns a
    left-padded row into NaN (adapters.transformers.EAGER_F64_LEFT_PADDING), and positions
    come from the mask in every implementation, so the padding side does not change the math.
    """
    if isinstance(inputs, str):
        inputs = [inputs]
    if inputs is None or (isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, str) for x in inputs)):
        tok = Tokenizer.from_pretrained(checkpoint)
        return tok.batch_encode(list(inputs or BUILTIN_PROMPTS), chat=True, padding_side="right")
    if isinstance(inputs, tuple) and len(inputs) == 2:
        ids, mask = _int_array(inputs[0], "inputs[0] (token ids)"), _int_array(inputs[1], "inputs[1] (mask)")
    else:
        ids = _int_array(inputs, "inputs")
        mask = np.ones(ids.shape, np.int64)
    if ids.ndim != 2 or 0 in ids.shape:
        raise InputError(f"inputs: token ids must be a non-empty [batch, tokens] array, got shape {ids.shape}")
    if mask.shape != ids.shape:
        raise InputError(f"inputs: the mask's shape {mask.shape} is not the ids' {ids.shape}")
    empty = np.flatnonzero(~np.asarray(mask, bool).any(1))
    if len(empty):
        raise InputError(f"inputs: row(s) {empty.tolist()} have no real token (their mask is all 0)")
    return ids, mask


def _int_array(x, what: str) -> np.ndarray:
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], (list, tuple)) and len({len(r) for r in x}) > 1:
        raise InputError(f"{what}: rows of different lengths ({', '.join(str(len(r)) for r in x)}); pad them to "
                         "one length and pass (ids, mask)")
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.integer):
        raise InputError(f"{what}: expected integer token ids (or prompts as strings), got {a.dtype} "
                         f"of shape {a.shape}")
    return a


def prepare(reference, candidate, checkpoint, inputs, policy, progress=lambda msg: None, mesh=None):
    """(ref Side, cand Side, ids, mask, Policy) from what compare_models takes; shared with
    the decode comparison. A Dump on either side fixes the inputs and the policy (None takes
    the dump's) and supplies its recorded checkpoint, whose fingerprint must match. mesh: a
    side named "jaxmodel" is loaded whole on it (jaxmodel/sharding.py), not streamed."""
    checkpoint, inputs, policy = bind_dumps(reference, candidate, checkpoint, inputs, policy)
    policy = "fp32" if policy is None else policy
    if checkpoint is None:
        raise ValueError("checkpoint is required (a Hugging Face Llama folder; "
                         "`llama-parity fetch-smollm2` prints the default one)")
    policy = Policy.get(policy)
    ids, mask = parse_inputs(inputs, checkpoint)
    progress(f"loading {reference if isinstance(reference, str) else type(reference).__name__} "
             f"and {candidate if isinstance(candidate, str) else type(candidate).__name__}")
    if mesh is not None and "jaxmodel" not in (reference, candidate):
        raise ValueError("mesh: neither side is jaxmodel named by string (a model object brings its own mesh)")
    return (_side(reference, checkpoint, policy, mesh), _side(candidate, checkpoint, policy, mesh), ids, mask,
            policy)


def _side(spec, checkpoint, policy, mesh=None) -> Side:
    """"torchref" / "jaxmodel" as CheckpointModels (streamed by the ladder, loaded whole only
    for what needs the whole model), "jaxmodel" on a mesh loaded whole and sharded, anything
    else as adapters.resolve_side makes it."""
    if spec == "jaxmodel" and mesh is not None:
        return Side.of(OurModel.load("jaxmodel", checkpoint, policy, mesh=mesh))
    if isinstance(spec, str) and spec in PACKAGES:
        return checkpoint_side(spec, checkpoint, policy)
    return resolve_side(spec, checkpoint, policy)


def compare_models(reference="torchref", candidate="jaxmodel", checkpoint=None, inputs=None,
                   policy=None, teacher_forcing=True, progress=lambda msg: None,
                   stream: bool | None = None, mesh=None, check_determinism: bool = True) -> Report:
    """Runs the ladder for `candidate` against `reference` on one checkpoint (the public API).
    stream: None (default) walks the checkpoint layer by layer when both sides are torchref /
    jaxmodel named by string, True insists on it, False runs whole captures (run_ladder).
    mesh: the side named "jaxmodel" runs sharded on this jax mesh ({"tensor": 4}, a Mesh;
    jaxmodel/sharding.py), loaded whole. check_determinism: a user's port captures twice on the
    same inputs before it is judged, and one that does not repeat itself bitwise is refused
    (NotDeterministic, naming the first tap that differs); False skips that one extra capture."""
    ref, cand, ids, mask, policy = prepare(reference, candidate, checkpoint, inputs, policy, progress, mesh)
    return run_ladder(ref, cand, ids, mask, policy, teacher_forcing, progress, stream, check_determinism)


def assert_parity(reference, candidate, checkpoint=None, policy=None, inputs=None, allow=("exact", "drift"),
                  **kw) -> Report:
    """For users' own pytest suites: fails with the report's summary unless the verdict is
    in `allow` (by default: exact or drift, i.e. no precision or semantic difference)."""
    _check_parity_args(checkpoint, allow)     # named before any model loads
    report = compare_models(reference, candidate, checkpoint, inputs=inputs, policy=policy, **kw)
    if report.verdict not in allow:
        raise AssertionError(explain.parity_failure(report))
    return report


def _check_parity_args(checkpoint, allow) -> None:
    """assert_parity's own arguments, named: a checkpoint folder path, and `allow` a
    collection of verdict kinds."""
    if checkpoint is not None and not isinstance(checkpoint, (str, Path)):
        raise TypeError(f"assert_parity: checkpoint must be a folder path (str or Path), got "
                        f"{type(checkpoint).__name__} {checkpoint!r}")
    if isinstance(allow, str) or not isinstance(allow, (tuple, list, set, frozenset)):
        raise TypeError(f"assert_parity: allow must be a tuple of verdict kinds ({', '.join(KINDS)}), got {allow!r}")
    unknown = [k for k in allow if k not in KINDS]
    if unknown:
        raise ValueError(f"assert_parity: allow holds {unknown!r}, not verdict kinds ({', '.join(KINDS)})")
