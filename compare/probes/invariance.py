"""Invariance probes: does a row's result depend on what else is in the batch, on
padding, on the run, on the framework? (docs/guide.md, "Invariance lab".)

    from compare.probes import probe_batch, probe_padding, probe_determinism, \
        probe_divergence, probe_cross_greedy
    r = probe_batch(model)                    # torchref / jaxmodel / transformers / ProbeModel
    r.verdict, r.bitwise_equal_frac, r.hint   # "exact" | "drift" | "precision" | "semantic"
    r.assert_no_semantic(); r.assert_bitwise()

Every probe compares outputs of one target sequence in different circumstances
against the same model's output for the target alone, and reports per case: bitwise
equality, max ULP (in the output's dtype), max abs difference, NaN/Inf. A case is judged by
the project's one judge (compare.judge.verdicts.classify) at the logits, the circumstance's
output as the candidate, the output alone as the reference, the float64 twin's alone (the
same implementation with the same rounded weights computing in float64, models.fp64_twin) as
the oracle, by the rungs for a candidate without a twin of its own:
    exact      bitwise equal;
    drift      different, but within M x the model's own error + the floor (the whole output
               and each quarter of its positions): what another summation order gives; or a
               constant added to each position's logits, which changes no probability
               (reason "shift_invariant");
    precision  beyond that, but rounding-sized for the policy's dtypes: the circumstance
               changes how the model rounds, not its math;
    semantic   beyond that with a structure rounding does not make, or larger than any
               rounding of the declared dtypes, or NaN/Inf: a difference in the math (mask,
               positions, cache).
The probe's verdict is its worst case; its hint says which case and why.

Greedy probes compare token sequences: a completion that leaves the reference at a
step where the reference's top-1 logit led the top-2 by less than the two runs' logits
can differ by (2 x the threshold above) flipped at a near tie: drift. A flip where the
model was sure is semantic.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tempfile
from pathlib import Path

import numpy as np

from llamaspec import Policy
from llamaspec.errors import PolicyError
from llamaspec.generate import until_eos
from llamaspec.inputs import left_align

from ..environment import determinism_settings
from ..judge.verdicts import classify, standing
from ..metrics import max_ulp, nonfinite, rel_l2, unit_roundoff
from ..results import JsonResult
from ..vocabulary import F32_STEPS_FLOOR, FLOOR_ULPS, FP64_FLOOR, KINDS, M
from .models import ProbeModel, as_probe_model, logits_of
from .where_text import rerun_settings
from .worker import run_job

PROBES = ("batch", "padding", "determinism", "divergence", "cross_greedy")
DEFAULT_LENGTH = 24
# A model's relative error against its own fp64 twin above this many unit roundoffs of
# its compute dtype is suspicious: the twin is likely not the same math (docs/method.md).
TWIN_SUSPECT_UNITS = 256


# ----------------------------------------------------------------- results

@dataclasses.dataclass
class Case:
    """One output compared with its reference."""
    name: str                   # e.g. "B=8 equal lengths, row 4"
    group: str                  # series: equal, mixed, right, left, append, cls-left, ...
    batch_size: int | None
    kind: str                   # exact | drift | precision | semantic (compare_case: the one judge's)
    bitwise_equal: bool
    max_abs: float
    max_ulp: float
    nonfinite: int
    rel_l2: float = 0.0         # ||out - ref|| / ||ref||
    first_diff_step: int | None = None  # greedy: first step whose token differs
    margin: float | None = None         # greedy: reference top-1 minus top-2 logit there
    note: str = ""
    reason: str = ""                    # the judge's reason code (compare.evidence)
    ratio: float | None = None          # the judge's err / bound (the worst of the whole and its quarters)


@dataclasses.dataclass
class ProbeResult(JsonResult):
    probe: str
    model: str                  # label: "jaxmodel bf16 invariant"
    impl: str
    policy: str
    mode: str                   # default | invariant
    verdict: str                # exact | drift | precision | semantic
    hint: str
    bitwise_equal_frac: float   # fraction of cases bitwise equal to their reference
    max_ulp: float
    max_abs: float
    nonfinite: int
    rounding_error: float       # the model's own: max |model - fp64 twin| on the target
    threshold: float            # M * rounding_error + floor (absolute, in logits)
    rounding_rel: float         # the model's own relative L2 error vs its fp64 twin
    threshold_rel: float        # M * rounding_rel + floor
    cases: list[Case]
    details: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.verdict != "semantic"

    def summary(self) -> str:
        return (f"{self.probe} [{self.model}]: {self.verdict}, {self.bitwise_equal_frac:.0%} bitwise "
                f"equal, max {_g(self.max_ulp)} ulp, max abs {_g(self.max_abs)}: {self.hint}")

    def assert_no_semantic(self) -> "ProbeResult":
        if self.verdict == "semantic":
            raise AssertionError(self.summary())
        return self

    def assert_bitwise(self) -> "ProbeResult":
        if self.bitwise_equal_frac != 1.0:
            bad = [c.name for c in self.cases if not c.bitwise_equal][:5]
            raise AssertionError(f"{self.summary()}\n  not bitwise equal: {bad}")
        return self

    def assert_verdict(self, *allowed: str) -> "ProbeResult":
        if self.verdict not in allowed:
            raise AssertionError(f"verdict {self.verdict} not in {allowed}: {self.summary()}")
        return self


def _g(x) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


# ----------------------------------------------------------------- judging

@dataclasses.dataclass
class Judge:
    """One model on one target: what the one judge (compare.judge.verdicts.classify) needs to
    decide a case (the policy, the model's float64 twin's logits), and the model's own rounding
    error that the hints and the greedy margins quote.

    A case (the target's logits in a circumstance, the candidate) is judged against the same
    logits alone (the reference) and the twin's (the oracle), by the ladder's rungs for a
    candidate without a twin of its own (the circumstance's twin run is not made): drift within
    M x the model's own error + the floor (the whole tap and each quarter of its positions);
    beyond it, semantic when the difference has a structure rounding does not make or is
    larger than any rounding of the declared dtypes, precision when it is rounding-sized."""
    rounding_error: float       # max |model - twin| on the target alone
    rounding_rel: float         # ||model - twin|| / ||twin||
    rel_floor: float            # FLOOR_ULPS unit roundoffs (fp64: the engine's floors)
    scale: float                # max |logit|, turns the relative floor into an absolute one
    note: str = ""
    policy: Policy | None = None
    keeps_f32: bool = False
    hidden: int | None = None
    oracle: np.ndarray | None = None    # the twin's logits on the target alone [T, V] (None: no twin)

    @property
    def threshold(self) -> float:
        return M * self.rounding_error + self.rel_floor * self.scale

    @property
    def threshold_rel(self) -> float:
        return M * self.rounding_rel + self.rel_floor

    def ratio(self, case: "Case") -> float:
        """How far beyond drift a case is (> 1: beyond): the judge's ratio where it measured
        one, else the max-abs and relative thresholds'."""
        if case.ratio is not None and math.isfinite(case.ratio):
            return case.ratio

        def r(x, t):
            return 0.0 if x == 0 else (x / t if t > 0 else math.inf)
        return max(r(case.max_abs, self.threshold), r(case.rel_l2, self.threshold_rel))


def make_judge(pm: ProbeModel, ids, ref_logits) -> Judge:
    """The model's error against its fp64 twin on the target alone (ids [1, T],
    ref_logits [T, V] the model's own output for it), and the floor."""
    ref = np.asarray(ref_logits, np.float64)
    top = float(np.nanmax(np.abs(ref))) if ref.size else 0.0
    top = top if math.isfinite(top) else 0.0
    rel = FLOOR_ULPS * unit_roundoff(pm.compute_dtype)
    if pm.compute_dtype == "float64":
        rel = max(rel, F32_STEPS_FLOOR if pm.keeps_f32 else FP64_FLOOR)
    hidden = getattr(pm.cfg, "hidden_size", None)
    known = {"policy": Policy.get(pm.policy), "keeps_f32": pm.keeps_f32,
             "hidden": None if hidden is None else int(hidden)}
    twin = pm.oracle()
    if twin is None:
        return Judge(0.0, 0.0, rel, top, "no fp64 twin: the thresholds are the floor only", **known)
    o = np.asarray(logits_of(twin, ids, np.ones(ids.shape, np.int64)), np.float64).reshape(ref.shape)
    err = np.abs(ref - o)
    if not np.isfinite(err).all():
        return Judge(math.nan, math.nan, rel, top, "NaN/Inf in the model or its fp64 twin", **known, oracle=o)
    judge = Judge(float(err.max()), rel_l2(ref, o), rel, top, **known, oracle=o)
    if judge.rounding_rel > TWIN_SUSPECT_UNITS * unit_roundoff(pm.compute_dtype):
        judge.note = (f"the model differs from its fp64 twin by {judge.rounding_rel:.1e} relative, "
                      f"more than {TWIN_SUSPECT_UNITS} unit roundoffs: if the twin is not the same "
                      "math (a patched model), the thresholds are too loose")
    return judge


def compare_case(name, group, batch_size, out, ref, judge: Judge, note="", oracle=None) -> Case:
    """out vs ref (same shape, real positions only): exact, drift, precision or semantic, by the
    one judge (Judge). oracle: the twin's logits at ref's positions (default: the target alone's,
    judge.oracle; without a twin the reference itself, so that the bound is the floor alone)."""
    out, ref = np.asarray(out), np.asarray(ref)
    bad = nonfinite(out)
    equal = bool(np.array_equal(out, ref)) and not bad
    if bad or nonfinite(ref):
        return Case(name, group, batch_size, "semantic", False, math.nan, math.nan,
                    bad + nonfinite(ref), note=note or "NaN/Inf")
    diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
    d = float(diff.max()) if diff.size else 0.0
    ulp = max_ulp(out, ref, out.dtype) if out.dtype.kind == "f" and out.dtype.itemsize in (2, 4, 8) \
        else math.nan
    case = Case(name, group, batch_size, "exact", equal, d, ulp, 0, rel_l2(out, ref), note=note)
    if not equal:
        o = judge.oracle if oracle is None else oracle
        o = ref if o is None or not np.isfinite(o).all() else np.asarray(o)
        if o.shape != ref.shape:
            raise ValueError(f"compare_case '{name}': the twin's logits {o.shape} are not at the reference's "
                             f"positions {ref.shape}: pass oracle= for them")
        v = classify("logits", ref[None], out[None], o[None], None, np.ones((1, len(ref)), bool), judge.policy,
                     judge.keeps_f32, hidden=judge.hidden)
        case.kind, case.reason, case.ratio = standing(v), v.record.reason, v.record.ratio
    return case


def _result(probe, pm: ProbeModel, cases: list[Case], judge: Judge, hint_fn, details=None) -> ProbeResult:
    if not cases:
        raise ValueError(f"{probe} probe: nothing to compare (check batch_sizes / kinds)")
    worst = max(cases, key=lambda c: (KINDS.index(c.kind), c.max_abs if not math.isnan(c.max_abs) else math.inf))
    verdict = worst.kind
    ulps = [c.max_ulp for c in cases if c.max_ulp is not None and not math.isnan(c.max_ulp)]
    diffs = [c.max_abs for c in cases if not math.isnan(c.max_abs)]
    res = ProbeResult(
        probe=probe, model=pm.name, impl=pm.impl, policy=pm.policy, mode=pm.mode, verdict=verdict,
        hint="", bitwise_equal_frac=sum(c.bitwise_equal for c in cases) / len(cases),
        max_ulp=max(ulps, default=0.0), max_abs=max(diffs, default=0.0),
        nonfinite=sum(c.nonfinite for c in cases), rounding_error=judge.rounding_error,
        threshold=judge.threshold, rounding_rel=judge.rounding_rel, threshold_rel=judge.threshold_rel,
        cases=cases, details=dict(details or {}))
    res.hint = _precision_hint(worst, judge) if verdict == "precision" else hint_fn(worst, judge, res)
    if judge.note:
        res.hint += f" ({judge.note})"
    per_call = _per_call_scales(pm.policy)
    if per_call and verdict != "exact":
        res.hint += (f"; the policy scales fp8 activations per call ({per_call}): each row's rounding depends on "
                     "the whole call (batch, padding, prompt or decode step) by design; per token ('channel') does not")
    if verdict != "exact" and probe in WHERE_CIRCUMSTANCE:
        res.details["where"] = (f"llama-parity probe where CHECKPOINT --impl {pm.impl} --policy {pm.policy} "
                                f"--circumstance {WHERE_CIRCUMSTANCE[probe]}")
        res.hint += f"; which layer and op: {res.details['where']}"
    return res


def _per_call_scales(policy_name) -> str | None:
    """The act_fp8 spec of a policy that scales activations per call (granularity "tensor"), else None."""
    try:
        policy = Policy.get(policy_name)
    except PolicyError:
        return None
    return next((p.act_fp8 for p in (policy, *(p for _, p in policy.layers))
                 if p.act_fp8 and p.act_fp8.split(":")[1] == "tensor"), None)


# The probe where circumstance that looks at a probe's question layer by layer.
WHERE_CIRCUMSTANCE = {"batch": "batch", "padding": "padding", "determinism": "rerun", "divergence": "batch"}


def _drift_hint(res: ProbeResult, judge: Judge, what: str) -> str:
    n = len(res.cases)
    eq = sum(c.bitwise_equal for c in res.cases)
    if res.verdict == "exact":
        return f"bitwise equal in all {n} cases: {what}"
    rel = max((c.rel_l2 for c in res.cases), default=0.0)
    return (f"{eq}/{n} cases bitwise equal; the rest differ by up to {res.max_abs:.1e} max abs, "
            f"{rel:.1e} relative ({_g(res.max_ulp)} ulp), within {M:g}x the model's own rounding "
            f"error ({judge.rounding_error:.1e} max abs, {judge.rounding_rel:.1e} relative) + floor: "
            "summation order (kernels sum in another order for other shapes or companions), "
            "not a bug")


def _precision_hint(case: Case, judge: Judge) -> str:
    if case.nonfinite:
        return f"NaN/Inf at the policy where the float64 twin has none ({case.name}): an overflow of the policy's dtype"
    return (f"{case.name}: {case.max_abs:.1e} max abs, {case.rel_l2:.1e} relative, {judge.ratio(case):.1f}x the "
            f"drift bound (the model's own rounding error: {judge.rounding_rel:.1e} relative) but rounding-sized "
            "for the policy's dtypes: the circumstance changes how the model rounds (a kernel that sums in another "
            "order or a narrower dtype for this shape), not its math")


def _semantic_lead(case: Case, judge: Judge, what: str) -> str:
    if case.nonfinite or math.isnan(case.max_abs):
        return f"{what}: NaN/Inf in {case.nonfinite} value(s) ({case.name})"
    return (f"{what} by {case.max_abs:.1e} max abs, {case.rel_l2:.1e} relative ({case.name}): "
            f"{judge.ratio(case):.0e}x the drift threshold (the model's own rounding error: "
            f"{judge.rounding_error:.1e} max abs, {judge.rounding_rel:.1e} relative)")


# ----------------------------------------------------------------- inputs

def _target(pm: ProbeModel, ids, length: int, seed: int) -> np.ndarray:
    """The target sequence as [1, T] int64 (random tokens when none is given)."""
    if ids is None:
        rng = np.random.default_rng(seed)
        return rng.integers(0, pm.vocab_size, (1, length)).astype(np.int64)
    a = np.asarray(ids, np.int64)
    return a[None] if a.ndim == 1 else a[:1]


def _random_tokens(rng, pm: ProbeModel, n: int) -> np.ndarray:
    return rng.integers(0, pm.vocab_size, n).astype(np.int64)


def _pack(rows: list[np.ndarray], side: str, width: int | None = None, pad_id: int = 0):
    """Rows of different lengths -> ids, mask [B, width], padded on `side`."""
    width = width or max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for b, r in enumerate(rows):
        n = len(r)
        sl = slice(0, n) if side == "right" else slice(width - n, width)
        ids[b, sl], mask[b, sl] = r, 1
    return ids, mask


def _target_rows(B: int) -> list[int]:
    return sorted({0, B // 2, B - 1})


def _say(progress, msg):
    if progress:
        progress(msg)


# ----------------------------------------------------------------- batch invariance

def probe_batch(model, ids=None, *, batch_sizes=(2, 3, 4, 8, 16, 32), kinds=("equal", "mixed"),
                padding_side="right", length=DEFAULT_LENGTH, seed=0, oracle=None,
                progress=None) -> ProbeResult:
    """The target alone vs inside batches with random companions.

    kinds: "equal" (companions of the target's length, no padding) and "mixed" (random
    lengths from T/4 to 2T, padded on padding_side). The target sits at rows 0, B//2
    and B-1 of each batch (one forward, up to three samples). B=1 in batch_sizes runs
    the target alone again (a repeat).
    """
    pm = as_probe_model(model, oracle)
    target = _target(pm, ids, length, seed)
    T = target.shape[1]
    rng = np.random.default_rng(seed + 1)
    _say(progress, f"batch [{pm.name}]: target alone ({T} tokens)")
    ref = pm.logits(target, np.ones_like(target))
    judge = make_judge(pm, target, ref[0])
    cases = []
    for kind in kinds:
        for B in batch_sizes:
            if B == 1 and kind != "equal":
                continue
            rows = _target_rows(B)
            seqs = []
            for b in range(B):
                if b in rows:
                    seqs.append(target[0])
                elif kind == "equal":
                    seqs.append(_random_tokens(rng, pm, T))
                else:
                    seqs.append(_random_tokens(rng, pm, int(rng.integers(max(1, T // 4), 2 * T + 1))))
            b_ids, b_mask = _pack(seqs, padding_side, pad_id=pm.pad_id)
            _say(progress, f"batch [{pm.name}]: B={B} {kind} lengths ({b_ids.shape[1]} slots)")
            out = pm.logits(b_ids, b_mask)
            for r in rows:
                real = b_mask[r].astype(bool)
                cases.append(compare_case(f"B={B} {kind} lengths, row {r}", kind, B, out[r][real],
                                          ref[0], judge))

    def hint(worst, judge, res):
        if res.verdict != "semantic":
            return _drift_hint(res, judge, "the batch does not change the target's logits")
        why = ("rows leak into each other or padding is not masked (only mixed-length batches "
               "differ)" if worst.group == "mixed" and not any(
                   c.kind == "semantic" for c in res.cases if c.group == "equal")
               else "rows leak into each other (a mask, cache or reduction shared across the batch)")
        return _semantic_lead(worst, judge, "the batch changed the target's logits") + ": " + why

    return _result("batch", pm, cases, judge, hint, {"length": T, "batch_sizes": list(batch_sizes),
                                                     "kinds": list(kinds), "padding_side": padding_side})


# ----------------------------------------------------------------- padding invariance

FULL_PAD_SELF = "fully padded row itself"   # the case of the padded row's own output


def probe_padding(model, ids=None, *, pad=5, length=DEFAULT_LENGTH, seed=0, oracle=None,
                  progress=None) -> ProbeResult:
    """No padding vs right / left padding, one appended token, a last-token (CLS-style)
    readout under left and right padding, and a fully padded row next to the target.

    Left padding runs twice, with the pad id and with random tokens in the pad slots: if
    the two differ, pad content reaches real positions (the attention mask is not
    applied). A pure position offset (positions counted from the first slot) does not
    change a RoPE model's math for contiguous padding: attention sees only position
    differences, so that shows up as drift (rounding of larger angles) at most.
    """
    pm = as_probe_model(model, oracle)
    target = _target(pm, ids, length, seed)
    T = target.shape[1]
    rng = np.random.default_rng(seed + 2)
    ones = np.ones_like(target)
    _say(progress, f"padding [{pm.name}]: target alone ({T} tokens)")
    ref = pm.logits(target, ones)[0]
    judge = make_judge(pm, target, ref)
    cases = []

    def run(group, name, b_ids, b_mask, row=0, sl=None, want=slice(None), B=1, note=""):
        """want: the target alone's positions the case compares (and the twin's there)."""
        _say(progress, f"padding [{pm.name}]: {name}")
        out = pm.logits(b_ids, b_mask)
        got = out[row][b_mask[row].astype(bool)] if sl is None else out[row][sl]
        cases.append(compare_case(name, group, B, got, ref[want], judge, note,
                                  None if judge.oracle is None else judge.oracle[want]))
        return out

    noise = _random_tokens(rng, pm, pad)
    r_ids, r_mask = _pack([target[0]], "right", T + pad, pm.pad_id)
    r_ids[0, T:] = noise   # pad content must not matter wherever the mask says pad
    run("right", f"right padding (+{pad}, random pad tokens)", r_ids, r_mask)
    l_ids, l_mask = _pack([target[0]], "left", T + pad, pm.pad_id)
    left = run("left", f"left padding (+{pad}, pad id)", l_ids, l_mask)
    l2_ids = l_ids.copy()
    l2_ids[0, :pad] = noise
    left2 = run("left", f"left padding (+{pad}, random pad tokens)", l2_ids, l_mask)
    # pad content alone: the pad-id run is the yardstick (no twin of a padded run: the bound is the floor)
    leak = compare_case("", "", 1, left2[0, pad:], left[0, pad:], judge, oracle=left[0, pad:]).kind == "semantic"

    extra = _random_tokens(rng, pm, 1)
    a_ids = np.concatenate([target, extra[None]], axis=1)
    run("append", "one token appended: earlier positions", a_ids, np.ones_like(a_ids), sl=slice(0, T))

    other = _random_tokens(rng, pm, T + pad)
    for side in ("left", "right"):
        c_ids, c_mask = _pack([target[0], other], side, pad_id=pm.pad_id)
        last = (T + pad - 1) if side == "left" else T - 1
        run(f"cls-{side}", f"last-token readout, {side} padding (B=2, +{pad})", c_ids, c_mask,
            sl=slice(last, last + 1), want=slice(T - 1, T), B=2)

    f_ids = np.concatenate([target, np.full_like(target, pm.pad_id)])
    f_mask = np.concatenate([ones, np.zeros_like(target)])
    out = run("full-pad", "fully padded row next to the target (B=2): target row", f_ids, f_mask, B=2)
    bad = nonfinite(out[1])
    if bad:
        cases.append(Case(FULL_PAD_SELF, "full-pad", 2, "semantic", False, math.nan,
                          math.nan, bad, note="NaN/Inf in a row with no real token"))

    return _result("padding", pm, cases, judge, functools.partial(_padding_hint, leak=leak),
                   {"length": T, "pad": pad, "pad_content_leaks": bool(leak)})


# Why real positions change, by the padding case that changed them first.
_PADDING_WHY = {
    "append": "a causal-mask or position error (a later token is visible to earlier ones)",
    "right": "padding after the real tokens reaches them: the mask is not causal, or pad "
             "content is read",
    "cls-left": "the last-token readout changed under left padding: padding is attended "
                "or the readout slot is wrong",
    "cls-right": "the last-token readout changed under right padding: it reads slot -1 "
                 "(a pad) instead of the last real token, or padding is attended",
    "full-pad": "a fully padded row changed the other row: rows leak into each other",
}


def _padding_hint(worst, judge, res, leak: bool) -> str:
    if res.verdict != "semantic":
        return _drift_hint(res, judge, "padding and appending do not change real positions")
    g = worst.group
    if worst.name == FULL_PAD_SELF:
        return (f"a fully padded row gives NaN/Inf ({worst.nonfinite} values): softmax over no "
                "allowed key (0/0); mask with a finite minimum, or a NaN row poisons anything "
                "that reads across rows")
    if g == "left":
        why = ("pad tokens are attended: the attention mask is not applied (the output "
               "changes with the pad content)" if leak else
               "real positions change under left padding without reading the pads: "
               "positions or mask offsets that RoPE cannot absorb")
    else:
        why = _PADDING_WHY.get(g, "padding changes real positions")
    what = "earlier positions changed when a token was appended" if g == "append" else f"real positions changed ({g})"
    return _semantic_lead(worst, judge, what) + ": " + why


# ----------------------------------------------------------------- run-to-run determinism

def _probe_batch_inputs(pm, target, batch, seed):
    rng = np.random.default_rng(seed + 3)
    T = target.shape[1]
    seqs = [target[0]] + [_random_tokens(rng, pm, int(rng.integers(max(1, T // 2), 2 * T)))
                          for _ in range(batch - 1)]
    return _pack(seqs, "right", pad_id=pm.pad_id)


def probe_determinism(model, ids=None, *, repeats=3, processes=2, batch=4, length=DEFAULT_LENGTH,
                      seed=0, oracle=None, spec=None, timeout=600, progress=None) -> ProbeResult:
    """The same batch (target + random companions of mixed lengths) run `repeats` more
    times in this process and once in each of `processes` fresh Python processes
    (python -m compare.probes.worker, which loads the model from its ModelSpec and writes
    the logits to an .npy). Fresh runs need a spec: from load_model(...) or spec=. details
    records this process's "determinism settings" (compare.environment.determinism_settings);
    where a run differs, the hint names those that decide a rerun's bits on this device."""
    pm = as_probe_model(model, oracle)
    spec = spec or pm.spec
    target = _target(pm, ids, length, seed)
    b_ids, b_mask = _probe_batch_inputs(pm, target, batch, seed)
    real = b_mask.astype(bool)
    _say(progress, f"determinism [{pm.name}]: first run (B={batch})")
    first = pm.logits(b_ids, b_mask)
    judge = make_judge(pm, target, first[0][real[0]])
    # the cases compare every real position of the batch: the twin's logits there
    twin = pm.oracle() if judge.oracle is not None else None
    o_batch = None if twin is None else np.asarray(logits_of(twin, b_ids, b_mask), np.float64)[real]
    cases = []
    for i in range(repeats):
        _say(progress, f"determinism [{pm.name}]: repeat {i + 1}/{repeats}")
        cases.append(compare_case(f"repeat {i + 1} in this process", "repeat", batch,
                                  pm.logits(b_ids, b_mask)[real], first[real], judge, oracle=o_batch))
    skipped = None
    if processes and spec is None:
        skipped = "no ModelSpec (load the model with load_model to run fresh processes)"
    elif processes:
        for i, out in enumerate(run_fresh(spec, b_ids, b_mask, processes, timeout, progress)):
            # the worker saves 16-bit logits widened to float32 (lossless): narrow them back
            cases.append(compare_case(f"fresh process {i + 1}", "fresh", batch,
                                      np.asarray(out).astype(first.dtype)[real], first[real], judge, oracle=o_batch))

    settings = determinism_settings(uses_jax=pm.impl == "jaxmodel")

    def hint(worst, judge, res):
        if res.verdict != "semantic":
            text = _drift_hint(res, judge, "the same input gives the same logits every run")
        else:
            why = ("results vary between processes far beyond rounding: a setting that differs by "
                   "process (threads, matmul precision flags, XLA flags) or randomness in the model"
                   if worst.group == "fresh" else
                   "results vary between calls far beyond rounding: state kept between calls (a "
                   "cache not reset), uninitialised memory, or randomness (dropout)")
            text = _semantic_lead(worst, judge, "a repeat run changed the logits") + ": " + why
        return text if res.verdict == "exact" else f"{text}; {rerun_settings(settings)}"

    return _result("determinism", pm, cases, judge, hint,
                   {"batch": batch, "repeats": repeats, "processes": processes if not skipped else 0,
                    "fresh_skipped": skipped, "determinism settings": settings})


def run_fresh(spec, ids, mask, processes=1, timeout=600, progress=None) -> list[np.ndarray]:
    """Logits of `spec`'s model on (ids, mask), from `processes` fresh Python processes."""
    outs = []
    with tempfile.TemporaryDirectory(prefix="llama-parity-probe-") as tmp:
        tmp = Path(tmp)
        np.save(tmp / "ids.npy", ids)
        np.save(tmp / "mask.npy", mask)
        for i in range(processes):
            _say(progress, f"determinism [{spec.impl} {spec.policy} {spec.mode}]: fresh process "
                           f"{i + 1}/{processes}")
            job = {"spec": spec.to_dict(), "ids": str(tmp / "ids.npy"), "mask": str(tmp / "mask.npy"),
                   "out": str(tmp / f"logits{i}.npy")}
            run_job("compare.probes.worker", job, tmp, timeout, f"fresh process {i + 1}")
            outs.append(np.load(tmp / f"logits{i}.npy"))
    return outs


# ----------------------------------------------------------------- greedy traces

@dataclasses.dataclass
class Trace:
    """A greedy run of a batch: tokens and the two largest logits at every step."""
    tokens: np.ndarray      # [B, N]
    top1: np.ndarray        # [B, N] float64 (exact copies of the logits' values)
    top2: np.ndarray        # [B, N]
    dtype: np.dtype         # the logits' own dtype (for ULPs)
    # steps decoded: N, or fewer when greedy_trace stopped at EOS in every row (the steps
    # after hold the row's EOS and top logits 0; every reader stops at a row's first EOS)
    steps_run: int | None = None

    def row(self, r):
        return self.tokens[r], self.top1[r], self.top2[r]


def greedy_trace(pm: ProbeModel, ids, mask, steps: int, eos=()) -> Trace:
    """Greedy decoding for `steps` tokens, recording top-1/top-2 logits. Ties go to the
    lowest id (argmax), as in llamaspec.generate. eos (token ids): stop once every row has
    produced one (what follows a row's EOS is not part of its answer; the rest of the
    trace then holds EOS); empty: always `steps` tokens."""
    ids, mask = left_align(np.asarray(ids, np.int64), np.asarray(mask, np.int64))
    B = ids.shape[0]
    toks, t1, t2 = (np.zeros((B, steps), np.int64), np.zeros((B, steps)), np.zeros((B, steps)))
    logits, cache = pm.prefill(ids, mask, ids.shape[1] + steps)
    dtype = np.asarray(logits).dtype
    ended, eos = np.zeros(B, bool), np.asarray(tuple(eos), np.int64)
    for s in range(steps):
        x = np.asarray(logits, np.float64)
        nxt = x.argmax(-1)
        top2 = np.partition(x, -2, axis=-1)[:, -2:]
        toks[:, s], t1[:, s], t2[:, s] = nxt, top2[:, 1], top2[:, 0]
        ended |= np.isin(nxt, eos)
        if eos.size and ended.all():
            toks[:, s + 1:] = eos[0]
            return Trace(toks, t1, t2, dtype, s + 1)
        if s + 1 < steps:
            logits, cache = pm.decode(cache, nxt)
    return Trace(toks, t1, t2, dtype, steps)


def _until_eos(tokens, eos) -> int:
    """Number of meaningful steps: up to and including the first EOS."""
    return len(until_eos(tokens, eos))


def compare_completion(name, group, batch_size, cand, ref, eos, threshold, dtype=np.float32) -> Case:
    """A greedy completion (tokens, top1, top2) vs the reference's: first differing step,
    the reference's top-1/top-2 margin there, and the top-1 logit drift before it."""
    (ct, c1, c2), (rt, r1, r2) = cand, ref
    n = min(_until_eos(ct, eos), _until_eos(rt, eos))
    differ = np.flatnonzero(ct[:n] != rt[:n])
    s = int(differ[0]) if differ.size else None
    upto = n if s is None else s + 1     # same context up to and including step s
    vals_c = np.stack([c1[:upto], c2[:upto]])
    vals_r = np.stack([r1[:upto], r2[:upto]])
    bad = nonfinite(vals_c)
    equal = s is None and np.array_equal(vals_c, vals_r) and not bad
    d = float(np.abs(vals_c - vals_r).max()) if upto else 0.0
    ulp = max_ulp(vals_c, vals_r, dtype) if upto else 0.0
    margin = None if s is None else float(r1[s] - r2[s])
    if bad or nonfinite(vals_r):
        kind = "semantic"
    elif equal:
        kind = "exact"
    elif s is not None:
        kind = "drift" if margin <= 2 * threshold else "semantic"
    else:
        kind = "drift" if d <= threshold else "semantic"
    return Case(name, group, batch_size, kind, bool(equal), d, ulp, bad, first_diff_step=s, margin=margin)


def _eos(pm: ProbeModel):
    return tuple(getattr(pm.cfg, "eos_token_ids", ()) or ())


def divergence_plan(completions: int, batch_sizes=(4, 8, 16, 32), seed=0, extra_pads=(0, 3, 7)):
    """Batches that together hold `completions` copies of the target: the target alone
    first (the reference), then batches of each size in turn, about half of each batch
    target copies at random rows, the rest companions of random lengths, with a varying
    amount of extra left padding. Returns [(B, target_rows, extra_pad)]."""
    rng = np.random.default_rng(seed + 4)
    plan, have, k = [(1, [0], 0)], 1, 0
    sizes = [b for b in batch_sizes if b > 1] or [2]
    while have < completions:
        B = sizes[k % len(sizes)]
        copies = min(max(1, B // 2), completions - have)
        rows = sorted(rng.choice(B, copies, replace=False).tolist())
        plan.append((B, rows, extra_pads[(k // len(sizes) + k) % len(extra_pads)]))
        have += copies
        k += 1
    return plan


def probe_divergence(model, ids=None, *, completions=24, new_tokens=16, batch_sizes=(4, 8, 16),
                     length=DEFAULT_LENGTH, seed=0, oracle=None, progress=None) -> ProbeResult:
    """N greedy completions of one prompt under varied batchings (divergence_plan): how
    many distinct completions, where each leaves the reference (the prompt alone) and
    the reference's top-1/top-2 logit margin at that step."""
    pm = as_probe_model(model, oracle)
    target = _target(pm, ids, length, seed)
    T = target.shape[1]
    rng = np.random.default_rng(seed + 5)
    judge = make_judge(pm, target, pm.logits(target, np.ones_like(target))[0])
    eos = _eos(pm)
    plan = divergence_plan(completions, batch_sizes, seed)
    runs, dtype = [], np.float32   # runs: (B, row, left pad, trace row)
    for i, (B, rows, extra) in enumerate(plan):
        seqs = [target[0] if b in rows else
                _random_tokens(rng, pm, int(rng.integers(max(1, T // 2), 2 * T))) for b in range(B)]
        width = max(len(s) for s in seqs) + extra
        b_ids, b_mask = _pack(seqs, "left", width, pm.pad_id)
        _say(progress, f"divergence [{pm.name}]: batch {i + 1}/{len(plan)} B={B}, {len(rows)} "
                       f"copies, {width} slots, {new_tokens} tokens")
        tr = greedy_trace(pm, b_ids, b_mask, new_tokens)
        dtype = tr.dtype
        runs += [(B, r, width - T, tr.row(r)) for r in rows]
    ref = runs[0][3]
    cases = [compare_completion(f"B={B} row {r}, {pad} pad", "batching", B, row, ref, eos,
                                judge.threshold, dtype)
             for B, r, pad, row in runs[1:]]
    seqs = {tuple(row[0][:_until_eos(row[0], eos)].tolist()) for *_, row in runs}
    details = {"completions": len(runs), "distinct_completions": len(seqs), "new_tokens": new_tokens,
               "reference_tokens": ref[0][:_until_eos(ref[0], eos)].tolist(),
               "batches": [[B, len(rows), extra] for B, rows, extra in plan],
               "reference_min_margin": float(np.min(ref[1] - ref[2]))}

    def hint(worst, judge, res):
        return _greedy_hint(worst, judge, res, f"{len(seqs)} distinct completion(s) of {len(runs)}")

    if not cases:
        cases = [Case("reference only", "batching", 1, "exact", True, 0.0, 0.0, 0)]
    return _result("divergence", pm, cases, judge, hint, details)


def _greedy_hint(worst: Case, judge: Judge, res: ProbeResult, head: str) -> str:
    flips = [c for c in res.cases if c.first_diff_step is not None]
    if res.verdict == "exact":
        return f"{head}; all bitwise equal (top-1/top-2 logits at every step)"
    if res.verdict == "drift":
        if not flips:
            return (f"{head}; same tokens, top logits differ by up to {res.max_abs:.1e} (within "
                    f"{M:g}x rounding error {judge.rounding_error:.1e})")
        steps = sorted(c.first_diff_step for c in flips)
        return (f"{head}; {len(flips)} left the reference (first at step {steps[0]}), each at a near "
                f"tie: reference margin <= {max(c.margin for c in flips):.1e} (2x drift threshold "
                f"{2 * judge.threshold:.1e}): rounding decides ties, not a bug")
    if worst.nonfinite:
        return f"{head}; NaN/Inf in the logits ({worst.name})"
    if worst.first_diff_step is None:
        return (f"{head}; same tokens but top logits differ by {worst.max_abs:.1e} ({worst.name}), "
                f"{worst.max_abs / judge.threshold:.0e}x the drift threshold: inputs differ "
                "(padding, positions, cache)")
    return (f"{head}; {worst.name} left the reference at step {worst.first_diff_step} where the "
            f"reference was sure (margin {worst.margin:.2e}, {worst.margin / (2 * judge.threshold):.0e}x "
            "what rounding can flip): a real difference (padding, positions, cache), not a near tie")


def probe_cross_greedy(model_a, model_b, ids=None, mask=None, *, new_tokens=16, prompts=4,
                       length=DEFAULT_LENGTH, seed=0, oracle_a=None, oracle_b=None,
                       progress=None) -> ProbeResult:
    """Greedy completions of the same prompts by two implementations (e.g. jaxmodel vs
    torchref at one policy): per prompt the first differing step and the top-1/top-2
    margin there (b's margin: b is the reference). ids/mask: a batch of prompts; by
    default the target plus `prompts - 1` random prompts. A flip is drift when the
    margin is within both models' thresholds together (each can move a logit that far)."""
    a, b = as_probe_model(model_a, oracle_a), as_probe_model(model_b, oracle_b)
    if ids is None:
        target = _target(b, None, length, seed)
        rng = np.random.default_rng(seed + 6)
        seqs = [target[0]] + [_random_tokens(rng, b, int(rng.integers(max(1, length // 2), length + 1)))
                              for _ in range(prompts - 1)]
        ids, mask = _pack(seqs, "left", pad_id=b.pad_id)
    ids = np.asarray(ids, np.int64)
    mask = np.ones_like(ids) if mask is None else np.asarray(mask, np.int64)
    first = ids[:1][:, mask[0].astype(bool)]
    ja = make_judge(a, first, a.logits(first, np.ones_like(first))[0])
    jb = make_judge(b, first, b.logits(first, np.ones_like(first))[0])
    judge = Judge(ja.rounding_error + jb.rounding_error, ja.rounding_rel + jb.rounding_rel,
                  max(ja.rel_floor, jb.rel_floor), max(ja.scale, jb.scale), ja.note or jb.note, jb.policy)
    _say(progress, f"cross-framework greedy: {a.name} ({ids.shape[0]} prompts, {new_tokens} tokens)")
    ta = greedy_trace(a, ids, mask, new_tokens)
    _say(progress, f"cross-framework greedy: {b.name}")
    tb = greedy_trace(b, ids, mask, new_tokens)
    eos = _eos(b)
    dtype = ta.dtype if ta.dtype.itemsize >= tb.dtype.itemsize else tb.dtype
    cases = [compare_completion(f"prompt {r}", "prompts", ids.shape[0], ta.row(r), tb.row(r), eos,
                                judge.threshold, dtype) for r in range(ids.shape[0])]
    same = sum(c.first_diff_step is None for c in cases)

    def hint(worst, judge, res):
        return _greedy_hint(worst, judge, res, f"{same}/{len(cases)} prompts give the same tokens")

    res = _result("cross_greedy", a, cases, judge, hint,
                  {"reference": b.name, "new_tokens": new_tokens, "prompts": int(ids.shape[0]),
                   "same_completions": same})
    res.model = f"{a.name} vs {b.impl}"
    return res


def run_probe(name: str, model, **kw) -> ProbeResult:
    """By name: batch, padding, determinism, divergence."""
    fn = {"batch": probe_batch, "padding": probe_padding, "determinism": probe_determinism,
          "divergence": probe_divergence}.get(name)
    if fn is None:
        raise ValueError(f"unknown probe '{name}' (batch, padding, determinism, divergence)")
    return fn(model, **kw)
