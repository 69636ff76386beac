"""The oracle ladder's verdict for one tap (docs/method.md).

Four captures of the same inputs, all numpy:
    ref  = reference at the working policy P      cand   = candidate at P
    oracle = reference at fp64                    cand64 = candidate at fp64
Per tap, in this order:
    exact      cand is bitwise equal to ref;
    semantic   cand64 differs from oracle beyond fp64 rounding (or the floor of a side
               that keeps f32 steps inside its fp64 run), or the difference is
               structured (structure.analyse, RoPE pairs, attention conventions): a
               difference in the math, with a hint that names the structure;
    precision  err(cand) > M * err(ref) + floor at P, errors measured against the
               oracle, over the whole tap, any quarter of its positions, or (at
               q_rope/k_rope) any quarter of the RoPE frequencies: the candidate
               loses more precision than the reference;
    drift      anything else: rounding, as much as the reference's own.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from llamaspec import Policy, positions_from_mask
from llamaspec import taps as tapnames
from llamaspec.checkpoint import numpy_dtype

from ..evidence import (
    DRIFT,
    EXACT,
    FP64_MATH,
    FP64_NOISE,
    LAYOUT_CONVENTION,
    NO_TWIN_DRIFT,
    NO_TWIN_NONFINITE,
    NO_TWIN_PRECISION,
    NO_TWIN_SEMANTIC,
    NO_TWIN_UNDECIDED,
    NONFINITE,
    PRECISION,
    SHIFT_INVARIANT,
    WHOLE_TAP,
    Convention,
    Declared,
    DecodePath,
    Evidence,
    Forcing,
    Inherited,
    Noise,
    Span,
    Trend,
)
from ..explain import ladder as explain
from ..metrics import (
    kl_per_position,
    log_softmax,
    narrowest_holding,
    nonfinite,
    rel_from_squares,
    rel_l2,
    unit_roundoff,
)
from ..vocabulary import (
    F32_STEPS_FLOOR,
    FP64_FLOOR,
    KINDS,
    NOISE_BAND,
    NOISE_DTYPES,
    NOISE_SHAPE,
    ONE_ROUNDING,
    QUARTER_POSITIONS,
    STRUCT_F32_FLOOR,
    SUBSET_MIN_VALUES,
    TREND_BUCKETS,
    TREND_GROWTH,
    TREND_RHO,
    M,
    drift_factor,
    precision_floor,
)
from . import family
from .conventions import ATOL_MATCH, MATCH_SHARE, explain_attention
from .storage import kv_storage, kv_storage_dtype, weight_storage, weight_storage_dtype
from .structure import analyse, head_permutation, spearman, tap_inputs

_F32_STEP_KINDS = ("position_trend", "head_confinement", "half_confinement", "sign_bias")


@dataclasses.dataclass
class TapVerdict:
    tap: str
    layer: int | None
    component: str
    kind: str
    err_ref: float      # ref at P vs oracle
    err_cand: float     # cand at P vs oracle
    err_fp64: float     # cand at fp64 vs oracle
    nonfinite: int
    hint: str           # explain.tap_hint(record): the record in one sentence
    # err(cand) / (M * err(ref) + floor), the worse of the whole tap and its quarters of
    # positions: > 1 is a precision deviation (when fp64 agrees)
    precision_ratio: float = float("nan")
    # candidate vs reference at the policy: max abs, max ULP (compute dtype), cosine,
    # fraction of elements beyond 16 unit roundoffs (metrics.pair_metrics)
    metrics: dict = dataclasses.field(default_factory=dict)
    # the dtype whose rounding the fp64-rung difference looks like (dtype_noise), if any
    noise_dtype: str | None = None
    record: Evidence | None = None      # what the deciding rung saw (compare.evidence)
    # kind "inherited": the difference is the first divergence's, carried here (teacher.inherit)
    inherited: Inherited | None = None
    # a finding after the first divergence, fed the oracle's input to its layer: teacher
    # forcing's record of its own error (teacher.inherit; None where it was not measured)
    local: Evidence | None = None

    @classmethod
    def of(cls, tap: str, ev: Evidence) -> "TapVerdict":
        t = tapnames.tap(tap)
        noise = ev.noise.dtype if ev.noise is not None else None
        return cls(tap, t.layer, t.component, ev.kind, ev.err_ref, ev.err_cand, ev.err_fp64, sum(ev.nonfinite[:2]),
                   explain.tap_hint(tap, ev), ev.ratio, noise_dtype=noise, record=ev)

    def judged(self, ev: Evidence) -> "TapVerdict":
        """This tap with another rung's record (decode pools steps), metrics kept."""
        return dataclasses.replace(TapVerdict.of(self.tap, ev), metrics=self.metrics)


@dataclasses.dataclass
class Divergence:
    tap: str
    layer: int | None
    component: str
    kind: str
    hint: str           # explain.divergence_hint: the tap's record, where it starts, the decode path
    # Teacher forcing's word on the layer: True when the layer that adds the error on its
    # own (oracle input forced) is this one, False when it is another, None when not run.
    confirmed: bool | None = None
    evidence: str = ""  # explain.forcing_sentence(forcing)
    record: Evidence | None = None      # the first divergent tap's record
    forcing: Forcing | None = None      # teacher forcing's measurement (teacher.py)
    path: DecodePath | None = None      # decode: which path is wrong (decode.py)

    def explain(self) -> "Divergence":
        """(Re)renders hint and evidence from the records."""
        if self.record is not None:
            self.hint = explain.divergence_hint(self)
        if self.forcing is not None:
            self.evidence = explain.forcing_sentence(self.forcing)
        return self


def _findings(tap, cand64, oracle, mask, keeps_f32, context) -> list:
    """Structure of the fp64-rung difference at one tap (structure.analyse, RoPE pairs with
    the pre-RoPE inputs, attention conventions with the oracle's q/k/v and the layer's own
    conventions, the family's slips: family.findings)."""
    kind = tapnames.tap(tap).kind
    per_head = kind in tapnames.PER_HEAD
    c64, o = np.asarray(cand64, np.float64), np.asarray(oracle, np.float64)
    found = analyse(c64, o, mask, per_head=per_head, pre=context.get("pre"),
                    norm_input=context.get("norm_input"), inputs=context.get("inputs"))
    found = family.findings(tap, c64, o, mask, context, found)
    if kind == "attn_ctx" and context.get("qkv") is not None and _same_attention_inputs(context, mask):
        conv = explain_attention(c64, *context["qkv"], mask, context.get("step"))
        found = ([conv] if conv else []) + found
    if keeps_f32:
        found = [f for f in found
                 if f.size > (F32_STEPS_FLOOR if f.kind in _F32_STEP_KINDS else STRUCT_F32_FLOOR)]
    return found


def _same_attention_inputs(context, mask) -> bool:
    """Whether the candidate's own q_rope, k_rope and v ("qkv_cand") are the oracle's ("qkv") to
    ATOL_MATCH: only then can its attention output be another convention over the oracle's
    inputs (explain_attention's test; attention moves its output about as much as its inputs
    move). Past a first divergence upstream they differ, and the search (fitted scale and cap,
    dozens of attentions each) is skipped. True where the candidate's inputs are not given."""
    if context.get("qkv_cand") is None:
        return True
    pairs = zip(context["qkv_cand"], context["qkv"])
    return all(rel_l2(_real(c, mask), _real(o, mask)) <= ATOL_MATCH for c, o in pairs)


def _real(a, mask) -> np.ndarray:
    """a[mask] ([B, T, ...] -> [real positions, ...]); a view, not a copy, when every
    position is real (a logits tap is positions x vocabulary)."""
    a, mask = np.asarray(a), np.asarray(mask, bool)
    return a.reshape(-1, *a.shape[mask.ndim:]) if mask.all() else a[mask]


class _RowErrors:
    """Squared norms per row (position) against one yardstick, so that the relative L2
    error of any set of rows is two sums: one pass over each array instead of one per
    subset (a report asks for the whole tap and four quarters of it, for ~450 taps).
    rel(x, rows) equals metrics.rel_l2(x[rows], yardstick[rows]), NaN/Inf included."""

    def __init__(self, yardstick):
        self.o = self._rows(yardstick)
        self.norm = np.einsum("ij,ij->i", self.o, self.o)
        self.norm4 = np.einsum("ij,ij,ij,ij->i", self.o, self.o, self.o, self.o)   # no [rows, width] temporary

    @staticmethod
    def _rows(x) -> np.ndarray:
        x = np.asarray(x, np.float64)
        return x.reshape(len(x), -1)

    def sq(self, x) -> np.ndarray:
        """Per-row squared error, in blocks of rows (no full-size temporary: a logits tap is
        positions x vocabulary)."""
        x = np.asarray(x)
        x = x.reshape(len(x), -1)
        out = np.empty(len(x))
        rows_at_once = max(1, 2 ** 20 // max(1, x.shape[1]))
        with np.errstate(invalid="ignore", over="ignore"):
            for a in range(0, len(x), rows_at_once):
                d = np.asarray(x[a:a + rows_at_once], np.float64) - self.o[a:a + rows_at_once]
                out[a:a + rows_at_once] = np.einsum("ij,ij->i", d, d)
        return out

    def rel(self, sq, rows=slice(None)) -> float:
        return rel_from_squares(float(np.sum(sq[rows])), float(np.sum(self.norm[rows])))

    def effective_values(self, rows=slice(None)) -> float:
        """n_eff = (sum o^2)^2 / sum o^4 over `rows`: how many values the relative error of
        these rows effectively averages (SUBSET_MIN_VALUES)."""
        n4 = float(np.sum(self.norm4[rows]))
        return float(np.sum(self.norm[rows])) ** 2 / n4 if n4 else 0.0


def precision_ratio(r, c, o, pos, floor, m=M, rows: _RowErrors | None = None) -> tuple[float, Span]:
    """err(c) / (M err(r) + floor) over the whole tap and over each quarter of positions
    (when there are >= QUARTER_POSITIONS): the worst, and where. A step whose rounding
    grows with position (RoPE angles in low precision) hides in a whole-tap average. A
    quarter whose values are carried by a few huge ones (fewer than SUBSET_MIN_VALUES
    effective values) is skipped. r, c may be given as per-row squared errors with `rows`
    (the oracle's _RowErrors)."""
    if rows is None:
        rows = _RowErrors(o)
        r, c = rows.sq(r), rows.sq(c)

    def ratio(sel):
        return rows.rel(c, sel) / (m * rows.rel(r, sel) + floor)
    best, where = ratio(slice(None)), WHOLE_TAP
    distinct = np.unique(pos)
    if len(distinct) >= QUARTER_POSITIONS:
        edges = distinct[np.linspace(0, len(distinct), 5).astype(int)[1:-1]]
        quarter = np.searchsorted(edges, pos, side="right")
        for q in range(4):
            if rows.effective_values(quarter == q) < SUBSET_MIN_VALUES:
                continue    # a few huge values carry this quarter: their error is no statistic
            x = ratio(quarter == q)
            if x > best:
                best, where = x, Span("positions", int(pos[quarter == q].min()), int(pos[quarter == q].max()))
    return best, where


def rope_band_ratio(r, c, o, floor, m=M) -> tuple[float, Span | None]:
    """At a q_rope / k_rope tap ([N, heads, head_dim], real positions only, Hugging Face
    half-split layout: pair i is dims i and i + D/2, its frequency theta^(-2i/D) falling
    with i): the precision ratio err(c) / (M err(r) + floor) over each quarter of the
    pairs, from the highest frequencies down; the worst, and where. A RoPE angle rounded
    to a narrower dtype has an error proportional to the angle (position x frequency), so
    it sits in the high-frequency pairs, where a whole-tap average dilutes it
    (docs/method.md, "Position and frequency structure")."""
    r, c, o = (np.asarray(a, np.float64) for a in (r, c, o))
    D = o.shape[-1]
    if o.ndim != 3 or D % 8:
        return float("nan"), None
    half = D // 2

    def band(x, q):
        lo, hi = q * half // 4, (q + 1) * half // 4
        return np.concatenate([x[..., lo:hi], x[..., half + lo:half + hi]], -1)
    best, where = float("nan"), None
    for q in range(4):
        ob = band(o, q)
        n = float(np.sum(ob * ob))
        if not n or n * n / float(np.sum(ob ** 4)) < SUBSET_MIN_VALUES:
            continue
        er, ec = (math.sqrt(float(np.sum((band(x, q) - ob) ** 2)) / n) if n else 0.0 for x in (r, c))
        x = ec / (m * er + floor)
        if not x <= best:
            best, where = x, Span("rope_pairs", q * half // 4, (q + 1) * half // 4 - 1, half, q)
    return best, where


def _fitted_noise(err: float, keeps_f32: bool, shape: str) -> Noise | None:
    """The dtype one rounding of which (ONE_ROUNDING u) a relative error `err` fits best,
    within NOISE_BAND; f32 is not a candidate for a side that keeps f32 steps (that noise
    is its normal). No error (err 0: the angles agree exactly) is no dtype's noise."""
    if not err > 0:
        return None
    fits = [(abs(math.log(err / unit_roundoff(dt) / ONE_ROUNDING)), dt, err / unit_roundoff(dt))
            for dt in NOISE_DTYPES if not (keeps_f32 and dt == "float32")]
    fits = [f for f in fits if NOISE_BAND[0] <= f[2] <= NOISE_BAND[1]]
    return Noise(*min(fits)[1:], shape=shape) if fits else None


def dtype_noise(c64, o, err64: float, keeps_f32: bool) -> Noise | None:
    """The dtype whose rounding the fp64-rung difference c64 - o looks like: unbiased,
    uncorrelated with the values, and sized like one rounding (ONE_ROUNDING u) within
    NOISE_BAND; the dtype whose size fits best, with err64 in its unit roundoffs. f32 is
    not a candidate for a side that keeps f32 steps (that noise is its normal)."""
    d = np.asarray(c64, np.float64) - np.asarray(o, np.float64)
    o = np.asarray(o, np.float64).ravel()
    d = d.ravel()
    dd, oo = float(d @ d), float(o @ o)
    if not dd or not oo:
        return None
    rms = math.sqrt(dd / d.size)
    scale_share = float(d @ o) ** 2 / (oo * dd)     # the error energy a global scale explains
    if abs(float(d.mean())) > NOISE_SHAPE * rms or scale_share > NOISE_SHAPE:
        return None
    return _fitted_noise(err64, keeps_f32, "values")


def row_noise(c64, o, err64: float, keeps_f32: bool) -> Noise | None:
    """A per-row factor (c64 = a_row x o, which structure's per_row_scale found) that is
    rounding, not math: the factors' deviations from 1 take both signs (|mean| within
    NOISE_SHAPE of their RMS) and their size is one rounding of a dtype (NOISE_BAND). A norm
    whose mean(x^2) is rounded makes exactly that: each row's rsqrt off by its own rounding,
    either way. An epsilon or a normalisation bug moves every row the same way (all factors
    below or above 1), a weight bug is per feature: neither passes."""
    c, oo = (np.asarray(x, np.float64) for x in (c64, o))
    c, oo = c.reshape(len(c), -1), oo.reshape(len(oo), -1)
    rr = np.einsum("ij,ij->i", oo, oo)
    ok = rr > 0
    a = np.einsum("ij,ij->i", c - oo, oo)[ok] / rr[ok]
    if len(a) < 2 or not a.any():
        return None
    rms = math.sqrt(float(np.mean(a * a)))
    if abs(float(a.mean())) > NOISE_SHAPE * rms:
        return None
    return _fitted_noise(err64, keeps_f32, "rows")


def rope_angle_noise(c64, o, c64_pre, o_pre, mask, keeps_f32: bool) -> Noise | None:
    """At q_rope / k_rope ([B, T, H, D], Hugging Face half-split pairs (i, i + D/2)) with both
    sides' input before RoPE: are the rotation angles the oracle's, rounded? The angle each
    side rotates pair i by at one position (summed over heads: they share it) and its error
    against the oracle's, relative to the oracle's angle position x frequency (the frequency
    read from consecutive positions): rounding the angle to a dtype leaves a relative error
    of one rounding of it, unbiased. A rounded angle grows with position, so the values'
    error is many roundings where the angle's is one; a wrong theta or layout is biased or
    far larger (structure.rope_finding names those). Each side's angle is read against its own
    input, so the inputs need not be equal."""
    c, r, cp, rp = (np.asarray(x, np.float64) for x in (c64, o, c64_pre, o_pre))
    if c.ndim != 4 or c.shape[-1] % 2 or c.shape != cp.shape or cp.shape != rp.shape:
        return None
    m = np.asarray(mask, bool)
    pos = positions_from_mask(m)
    half = c.shape[-1] // 2

    def angle(out, pre):
        a, b = slice(0, half), slice(half, None)
        cross = (pre[..., a] * out[..., b] - pre[..., b] * out[..., a]).sum(-2)
        dot = (pre[..., a] * out[..., a] + pre[..., b] * out[..., b]).sum(-2)
        return np.arctan2(cross, dot)                       # [B, T, D/2]
    phi_c, phi_o = angle(c, cp), angle(r, rp)
    wrap = lambda x: (x + np.pi) % (2 * np.pi) - np.pi      # noqa: E731
    step = wrap(phi_o[:, 1:] - phi_o[:, :-1])[m[:, 1:] & m[:, :-1]]
    if len(step) < 1:
        return None
    theta = pos[..., None] * np.median(step, axis=0)        # the oracle's angle, unwrapped
    err, theta = wrap(phi_c - phi_o)[m], theta[m]
    tt = float(np.sum(theta * theta))
    if not tt or not np.isfinite(err).all():
        return None
    rel = math.sqrt(float(np.sum(err * err)) / tt)
    weighted_mean = float(np.sum(err * theta)) / tt        # the relative error's mean, weighted as rel is
    if abs(weighted_mean) > NOISE_SHAPE * rel:
        return None
    return _fitted_noise(rel, keeps_f32, "angles")


def ratio_trend(sq_r, sq_c, pos) -> Trend | None:
    """The candidate's error over the reference's (per-row squared errors sq_c, sq_r) in
    TREND_BUCKETS equal runs of the distinct positions: its rank correlation with position
    and the first and last runs' ratios; None with fewer than 4 positions per run or no
    reference error to compare with. Rising: rho >= TREND_RHO and last >= TREND_GROWTH x first."""
    distinct = np.unique(pos)
    if len(distinct) < 4 * TREND_BUCKETS:
        return None
    edges = distinct[np.linspace(0, len(distinct), TREND_BUCKETS + 1).astype(int)[1:-1]]
    run = np.searchsorted(edges, pos, side="right")
    er = np.array([sq_r[run == k].sum() for k in range(TREND_BUCKETS)])
    ec = np.array([sq_c[run == k].sum() for k in range(TREND_BUCKETS)])
    if not (er > 0).all():
        return None
    ratio = np.sqrt(ec / er)
    last = pos[run == TREND_BUCKETS - 1]
    rho, first, final = spearman(np.arange(TREND_BUCKETS), ratio), float(ratio[0]), float(ratio[-1])
    return Trend(rho, first, final, Span("positions", int(last.min()), int(last.max())),
                 rho >= TREND_RHO and final >= TREND_GROWTH * first)


# Structure that rounding itself can have (a step in a narrower dtype concentrates its
# error in some positions, heads or one sign): not evidence of different math at P.
ROUNDING_PATTERNS = _F32_STEP_KINDS + ("per_row_scale",)


@dataclasses.dataclass
class _Tap:
    """One tap's real rows on every side and their errors against the oracle: what every rung reads."""
    name: str
    kind: str
    r: np.ndarray
    c: np.ndarray
    o: np.ndarray
    c64: np.ndarray | None
    mask: np.ndarray
    policy: Policy
    full: dict          # the [B, T, ...] arrays as given ("c", "o", "c64"): the structure detectors' input
    given_mask: object
    rows: _RowErrors = None
    sq_r: np.ndarray = None
    sq_c: np.ndarray = None
    errors: tuple = ()          # rel L2 against the oracle: ref, cand, cand at fp64 (NaN without a twin)
    nonfinite: tuple = ()       # NaN/Inf counts: ref, cand, cand at fp64

    @classmethod
    def of(cls, tap, ref, cand, oracle, cand64, mask, policy) -> "_Tap":
        r, c, o = (_real(a, mask) for a in (ref, cand, oracle))
        c64 = None if cand64 is None else _real(cand64, mask)
        t = cls(tap, tapnames.tap(tap).kind, r, c, o, c64, np.asarray(mask, bool), policy,
                {"c": cand, "o": oracle, "c64": cand64}, mask)
        t.rows = _RowErrors(o)
        t.sq_r, t.sq_c = t.rows.sq(r), t.rows.sq(c)
        err64 = t.rows.rel(t.rows.sq(c64)) if c64 is not None else float("nan")
        t.errors = (t.rows.rel(t.sq_r), t.rows.rel(t.sq_c), err64)
        t.nonfinite = (nonfinite(r), nonfinite(c), nonfinite(c64) if c64 is not None else 0)
        return t

    def evidence(self, kind: str, reason: str, **kw) -> Evidence:
        return Evidence(kind, reason, self.policy.name, *self.errors, m=drift_factor(self.policy),
                        nonfinite=self.nonfinite, **kw)

    def working_ratio(self, hidden) -> tuple[float, Span]:
        """The precision rung's ratio: the worst of the whole tap, its quarters of positions
        and (q_rope / k_rope) its quarters of RoPE frequencies."""
        pos = positions_from_mask(self.mask)[self.mask]
        floor, m = precision_floor(self.policy, hidden), drift_factor(self.policy)
        ratio, where = precision_ratio(self.sq_r, self.sq_c, None, pos, floor, m, self.rows)
        if self.kind in ("q_rope", "k_rope"):
            band, in_band = rope_band_ratio(self.r, self.c, self.o, floor, m)
            if band > ratio:
                ratio, where = band, in_band
        return ratio, where


def _nonfinite_rung(t: _Tap, twin: bool) -> Evidence | None:
    e = t.evidence("", "")
    finite = all(math.isfinite(x) for x in (e.err_ref, e.err_cand, e.err_fp64 if twin else 0.0))
    if not (sum(e.nonfinite[:2]) or not finite):
        return None
    r, c, c64 = e.nonfinite
    if twin:
        return dataclasses.replace(e, kind="semantic" if c64 else "precision", reason=NONFINITE)
    return dataclasses.replace(e, kind="semantic" if c and not r else "precision", reason=NO_TWIN_NONFINITE)


def _fp64_rung(t: _Tap, keeps_f32: bool, context, noise_from: TapVerdict | None, equal: bool):
    """The semantic check on the fp64 rung: (a decided record or None, the dtype noise the
    fp64 difference carries, for the rungs below)."""
    floor64, gate = (F32_STEPS_FLOOR, STRUCT_F32_FLOOR) if keeps_f32 else (FP64_FLOOR, FP64_FLOOR)
    e = t.evidence("", "", floor64=floor64, gate=gate)
    if not e.err_fp64 > gate:
        return None, None
    found = _findings(t.name, t.full["c64"], t.full["o"], t.given_mask, keeps_f32, context)
    noise = None
    if e.err_fp64 > floor64:
        noise, found = _noise_of(t, e.err_fp64, found, keeps_f32, context, noise_from)
    if noise is not None:
        noise = judged_noise(t.name, t.policy, noise)
        # Carried noise decides nothing here: where it entered is the finding (or it was not
        # one); what it costs at P downstream is the working rung's to say.
        if noise.inherited_from is None and not equal and unit_roundoff(noise.dtype) > unit_roundoff(noise.prescribed):
            return dataclasses.replace(e, kind="precision", reason=FP64_NOISE, noise=noise), noise
        return None, noise      # rounding the policy does not see here, or at/below its precision
    if e.err_fp64 > floor64 or found:
        return dataclasses.replace(e, kind="semantic", reason=FP64_MATH, findings=found, hidden_by_policy=equal), None
    return None, None


def _noise_of(t: _Tap, err64, found, keeps_f32, context, noise_from) -> tuple[Noise | None, list]:
    """(the dtype noise the fp64 difference is, the findings left): a per-row factor that
    rounding made (a norm's statistics) is noise, not a finding; with no finding, the noise
    carried from an earlier tap, or this tap's own (values, or RoPE angles)."""
    if t.kind == "attn_ctx" and context.get("qkv") is not None and noise_from is None:
        kv = kv_storage(t.full["c64"], *context["qkv"], t.given_mask, context.get("step"))
        if kv is not None:      # attention over narrower keys and values, exactly: that explains it all
            return kv, []
    if context.get("projection") is not None and noise_from is None:
        stored = _weight_noise(t, err64, *context["projection"])
        if stored is not None:  # the product over narrower weights, exactly: that explains it all
            return stored, []
    if found and {f.kind for f in found} == {"per_row_scale"}:
        rows = row_noise(t.c64, t.o, err64, keeps_f32)
        return (rows, []) if rows is not None else (None, found)
    if found:
        return None, found
    if noise_from is not None:
        return Noise(noise_from.noise_dtype, None, noise_from.tap), found
    noise = dtype_noise(t.c64, t.o, err64, keeps_f32)
    if noise is None and t.kind in ("q_rope", "k_rope") and context.get("pre") is not None:
        noise = rope_angle_noise(t.full["c64"], t.full["o"], *context["pre"], t.given_mask, keeps_f32)
    return noise, found


def _weight_noise(t: "_Tap", err64: float, x64, x_oracle, weights) -> Noise | None:
    """storage.weight_storage at a projection whose difference starts here (its input agrees with
    the oracle's to MATCH_SHARE of its own fp64 error: a difference carried from upstream is not
    tried), with the reference's weights (weights() -> (arrays, bias), or None)."""
    real = np.asarray(t.given_mask, bool)

    def flat(a):
        return _real(a, real).reshape(int(real.sum()), -1)     # [real positions, features]
    x = flat(x64)
    if not rel_l2(x, flat(x_oracle)) <= MATCH_SHARE * err64:
        return None
    found = weights()
    return None if found is None else weight_storage(flat(t.full["c64"]), x, *found)


# Tap kinds a matmul makes: its sums run in accum_dtype, its output is rounded once to the tap's dtype.
_MATMUL_TAPS = ("q", "k", "v", "attn_out", "gate", "up", "mlp_out", "logits")
_NORM_TAPS = ("attn_norm", "mlp_norm", "final_norm")


def judged_noise(tap: str, policy: Policy, noise: Noise) -> Noise:
    """noise with the step it belongs to and the dtype `policy` prescribes for that step:
    a norm's statistics (a per-row factor) norm_dtype; the softmax (attn_ctx) softmax_dtype;
    RoPE (q_rope, k_rope) rope_dtype; a matmul's sums accum_dtype when the noise is more than
    the one rounding of its output (ONE_ROUNDING unit roundoffs: one round-to-nearest leaves a
    relative error of at most u/sqrt(3) in RMS, whatever the values), else the tap's own dtype
    (the output's rounding, which the policy makes too); carried noise: the tap's dtype.
    The step is below the policy where the noise's dtype is narrower than the prescribed one
    (docs/method.md, "Dtype noise")."""
    kind, own = tapnames.tap(tap).kind, tapnames.dtype_of(tap, policy)
    if noise.inherited_from is not None:
        step, dtype = "carried", own
    elif noise.shape == "kv_cache":
        step, dtype = "kv_cache", kv_storage_dtype(policy)
    elif noise.shape == "weights":
        step, dtype = "weights", weight_storage_dtype(policy)
    elif kind in _NORM_TAPS:
        step, dtype = ("norm_stats", policy.norm_dtype) if noise.shape == "rows" else ("output", own)
    elif kind == "attn_ctx":
        step, dtype = "softmax", policy.softmax_dtype
    elif kind in ("q_rope", "k_rope"):
        step, dtype = "rope", policy.rope_dtype
    elif kind in _MATMUL_TAPS and noise.size is not None and noise.size > ONE_ROUNDING:
        step, dtype = "sums", policy.accum_dtype
    else:
        step, dtype = "output", own
    return dataclasses.replace(noise, prescribed=dtype, step=step)


def _working_rung(t: _Tap, hidden, noise: Noise | None) -> Evidence:
    """The precision check at the policy: precision beyond the drift bound, else drift."""
    ratio, where = t.working_ratio(hidden)
    if ratio > 1:
        pos = positions_from_mask(t.mask)[t.mask]
        return t.evidence("precision", PRECISION, ratio=ratio, span=where, noise=noise,
                          trend=ratio_trend(t.sq_r, t.sq_c, pos))
    return t.evidence("drift", DRIFT, ratio=ratio, span=where, noise=noise)


def declared_dtype(policy: Policy) -> str:
    """The coarsest dtype `policy` names for any step (params, compute, accumulation, norm,
    softmax, RoPE, residual, logits): the largest rounding the declared policy itself makes."""
    dtypes = [getattr(policy, f.name) for f in dataclasses.fields(policy) if f.name.endswith("_dtype")]
    return max(dtypes, key=unit_roundoff)


# A tap "held in" a narrower dtype: every nonzero finite value of the candidate's tap is exact in
# it, over at least HELD_DISTINCT distinct values. A float32 value that is not a rounded bf16 or
# fp16 one fits them by chance with probability 2**-16 or 2**-13, so 16 distinct values that all
# fit are no accident (2**-200 at most): the step that made the tap rounded its output to it.
HELD_DISTINCT = 16


def held_in(values, wider_than: str) -> str | None:
    """The narrowest of NOISE_DTYPES, narrower than `wider_than`, that holds every nonzero finite
    value of `values` exactly (HELD_DISTINCT distinct ones at least); None when none does."""
    v = np.asarray(values)
    v = v[np.isfinite(v) & (v != 0)].astype(np.float64)
    if np.unique(v).size < HELD_DISTINCT:
        return None
    narrower = [dt for dt in sorted(NOISE_DTYPES, key=unit_roundoff, reverse=True)
                if unit_roundoff(dt) > unit_roundoff(wider_than)]
    return narrowest_holding(v, narrower)


def _declared(err: float, policy: Policy, cand) -> Declared:
    """err against the declared policy's rounding (evidence.Declared): in units of its coarsest
    dtype, the narrower dtypes whose one rounding (NOISE_BAND) fits its size, and the narrower
    dtype the candidate's own values at this tap are held in (held_in), if any."""
    coarse = declared_dtype(policy)
    u = unit_roundoff(coarse)
    narrower = tuple(dt for dt in NOISE_DTYPES if unit_roundoff(dt) > u
                     and NOISE_BAND[0] <= err / unit_roundoff(dt) <= NOISE_BAND[1])
    return Declared(coarse, err / u, narrower, held_in(cand, coarse))


def _no_twin_rung(t: _Tap, hidden, context, noise_from: TapVerdict | None = None) -> Evidence:
    """Beyond the bound without a twin: semantic when the difference has a structure rounding
    does not make, or is larger than a bf16 step could make; precision when its size is the
    rounding of the dtypes the candidate's policy declares (or a rounded RoPE angle's, in the
    highest frequencies); otherwise undecided, counted semantic: larger than any rounding of
    the declared dtypes, a step in a narrower dtype and a change in the math both fit, and
    without a twin or finer taps nothing here tells them apart (docs/method.md)."""
    ratio, where = t.working_ratio(hidden)
    if ratio <= 1:
        return t.evidence("drift", NO_TWIN_DRIFT, ratio=ratio, span=where)
    # RoPE pair analysis needs rotations exact to ~1e-4 (structure.ROPE_NORM_TOL): the
    # twin's, not the policy's (at fp32 it reads frequency noise as a scaling).
    found = [f for f in _findings(t.name, t.full["c"], t.full["o"], t.given_mask, False,
                                  {k: v for k, v in (context or {}).items() if k != "pre"})
             if f.kind not in ROUNDING_PATTERNS]
    e = t.evidence("", "", ratio=ratio, span=where, findings=found)
    declared = _declared(e.err_cand, t.policy, t.c)
    e = dataclasses.replace(e, declared=declared)
    # A rounded RoPE angle is the one step whose rounding is not bounded by a few roundings
    # of the values: its error is position x frequency x u, largest in the top pairs.
    angle = where.highest_frequencies
    big = e.err_cand > NOISE_BAND[1] * unit_roundoff("bfloat16") and not angle
    if found or big:
        return dataclasses.replace(e, kind="semantic", reason=NO_TWIN_SEMANTIC, too_big_for_rounding=big)
    # Rounding-sized: for a dtype the policy declares, or for a named narrower dtype: the one that
    # holds the candidate's values here (this step rounded its output to it), or, carried, the one
    # an earlier tap was held in (noise_from: its rounding reaches the taps after it).
    if declared.held is not None and e.err_cand <= NOISE_BAND[1] * unit_roundoff(declared.held):
        noise = Noise(declared.held, e.err_cand / unit_roundoff(declared.held), step="output")
        return dataclasses.replace(e, kind="precision", reason=NO_TWIN_PRECISION, noise=noise)
    carried = noise_from is not None and e.err_cand <= NOISE_BAND[1] * unit_roundoff(noise_from.noise_dtype)
    if carried:
        return dataclasses.replace(e, kind="precision", reason=NO_TWIN_PRECISION,
                                   noise=Noise(noise_from.noise_dtype, None, noise_from.tap, step="carried"))
    if declared.units <= NOISE_BAND[1] or angle:
        return dataclasses.replace(e, kind="precision", reason=NO_TWIN_PRECISION)
    return dataclasses.replace(e, kind="semantic", reason=NO_TWIN_UNDECIDED)


def classify_without_twin(tap, ref, cand, oracle, mask, policy: Policy, context=None,
                          hidden: int | None = None, noise_from: TapVerdict | None = None) -> TapVerdict:
    """The ladder for one tap when the candidate has no float64 twin (a port without
    float64(), a dump from another engine): judged at the policy alone, by size and
    structure (docs/method.md, "Without a float64 twin"). context: context_for(tap,
    cand at P, oracle), the candidate's own pre-RoPE q/k standing in for its twin's.
    noise_from: the earlier tap whose values were held in a narrower dtype (its record's noise),
    whose rounding the later taps carry."""
    ev = _without_twin(tap, ref, cand, oracle, mask, policy, context, hidden, noise_from)
    return TapVerdict.of(tap, _convention(tap, ref, cand, oracle, None, mask, policy, False, hidden, ev) or ev)


def _without_twin(tap, ref, cand, oracle, mask, policy, context, hidden, noise_from=None) -> Evidence:
    t = _Tap.of(tap, ref, cand, oracle, None, mask, policy)
    return (_nonfinite_rung(t, twin=False)
            or (t.evidence("exact", EXACT) if np.array_equal(t.r, t.c) else None)
            or _no_twin_rung(t, hidden, context, noise_from))


def classify(tap, ref, cand, oracle, cand64, mask, policy: Policy, keeps_f32: bool,
             context=None, hidden: int | None = None, noise_from: TapVerdict | None = None) -> TapVerdict:
    """The ladder for one tap; arrays are [B, T, ...], mask [B, T] selects real positions.
    cand64=None (no float64 twin): classify_without_twin.

    context (optional): {"pre": (cand64_pre, oracle_pre)} at q_rope/k_rope taps (the q/k
    before RoPE), {"qkv": (q_rope, k_rope, v)} of the oracle at attn_ctx: they let the
    structure analysis name RoPE and attention-convention differences. noise_from: the
    earlier tap where dtype noise entered the fp64 run (run_ladder passes it on): an
    unstructured fp64 difference after it is that noise, carried along.

    The rungs, in order: NaN/Inf; the fp64 rung (first even where the policy's values are
    bitwise equal: a difference in the math that the policy rounds away here is localised
    where it starts); exact; the working rung (precision or drift). A finding that a
    convention explains (the logits shifted by a constant per position; q/k features permuted
    within each head) is kind "convention" (_convention)."""
    if cand64 is None:
        return classify_without_twin(tap, ref, cand, oracle, mask, policy, context, hidden, noise_from)
    ev = _with_twin(tap, ref, cand, oracle, cand64, mask, policy, keeps_f32, context, hidden, noise_from)
    return TapVerdict.of(tap, _convention(tap, ref, cand, oracle, cand64, mask, policy, keeps_f32, hidden, ev)
                         or ev)


def _with_twin(tap, ref, cand, oracle, cand64, mask, policy, keeps_f32, context, hidden, noise_from) -> Evidence:
    t = _Tap.of(tap, ref, cand, oracle, cand64, mask, policy)
    ev = _nonfinite_rung(t, twin=True)
    if ev is None:
        equal = np.array_equal(t.r, t.c)
        ev, noise = _fp64_rung(t, keeps_f32, context or {}, noise_from, equal)
        if ev is None:
            ev = t.evidence("exact", EXACT, noise=noise) if equal else _working_rung(t, hidden, noise)
    return ev


# ----- differences a convention explains: they change no prediction ------------------------------

FINDINGS = ("precision", "semantic")
# Taps whose values depend on the order of each head's features (the RoPE pair layout): a port
# may permute q/k's head_dim features (torchtune: interleaved pairs) where its attention undoes it.
LAYOUT_TAPS = ("q", "k", "q_rope", "k_rope")
# The taps of a layer that the attention has already consumed q and k for: a permutation that
# the attention undoes leaves them within rounding.
AFTER_ATTENTION = ("attn_ctx", "attn_out", "resid_mid", "mlp_norm", "gate", "up", "act", "mlp_out", "out")


def _convention(tap, ref, cand, oracle, cand64, mask, policy, keeps_f32, hidden, raw: Evidence) -> Evidence | None:
    """A finding (raw) that a convention explains, as a "convention" record; else None. The same
    rungs judge the tap again with the convention removed from every side, and it is a convention
    only when that judgement is exact or drift:
    - logits: each position's logits minus their mean (a constant shift per position changes no
      probability: softmax is invariant to it);
    - q, k, q_rope, k_rope: the candidate's head_dim features put back in the reference's order by
      the one permutation, the same in every head, that matches its columns to the oracle's
      (structure.head_permutation); whether the attention undoes it is settled across taps
      (settle_conventions: the next tap of the layer that does not depend on the layout)."""
    if raw.kind not in FINDINGS or raw.reason in (NONFINITE, NO_TWIN_NONFINITE):
        return None
    kind = tapnames.tap(tap).kind
    twin = cand64 is not None

    def judged(r, c, o, c64):
        return (_with_twin(tap, r, c, o, c64, mask, policy, keeps_f32, None, hidden, None) if twin
                else _without_twin(tap, r, c, o, mask, policy, None, hidden))
    if kind == "logits":
        removed = judged(*(None if a is None else _centred(a) for a in (ref, cand, oracle, cand64)))
        if removed.kind not in ("exact", "drift"):
            return None
        conv = Convention("logit_shift", raw, removed, _shift_numbers(ref, cand, mask))
        return dataclasses.replace(removed, kind="convention", reason=SHIFT_INVARIANT, convention=conv)
    if kind in LAYOUT_TAPS:
        perm = head_permutation(cand64 if twin else cand, oracle, mask)
        if perm is None:
            return None
        back = np.argsort(perm[0])
        removed = judged(ref, np.asarray(cand)[..., back], oracle, None if not twin else np.asarray(cand64)[..., back])
        if removed.kind not in ("exact", "drift"):
            return None
        conv = Convention("feature_permutation", raw, removed,
                          {"perm": [int(k) for k in perm[0]], "pattern": perm[1], "head_dim": len(perm[0])})
        return dataclasses.replace(removed, kind="convention", reason=LAYOUT_CONVENTION, convention=conv)
    return None


def _centred(a) -> np.ndarray:
    """Each position's values minus their mean, in float64 (the logits' per-position shift removed)."""
    a = np.asarray(a, np.float64)
    return a - a.mean(-1, keepdims=True)


def _shift_numbers(ref, cand, mask) -> dict:
    """What proves a shift changes no probability, between the two sides at the policy (real
    positions, float64): the mean KL(reference || candidate) of the next-token distributions,
    the largest |log-softmax difference|, and the per-position shift's range."""
    r, c = (np.asarray(_real(a, mask), np.float64) for a in (ref, cand))
    r, c = r.reshape(len(r), -1), c.reshape(len(c), -1)
    shift = (c - r).mean(-1)
    return {"kl": float(np.mean(kl_per_position(r, c))),
            "max_logprob_diff": float(np.max(np.abs(log_softmax(c) - log_softmax(r)))),
            "shift_min": float(shift.min()), "shift_max": float(shift.max())}


def _refresh(v: TapVerdict, ev: Evidence) -> None:
    """v judged by another record (its metrics, inherited and local kept)."""
    fresh = TapVerdict.of(v.tap, ev)
    for f in ("kind", "err_ref", "err_cand", "err_fp64", "nonfinite", "hint", "precision_ratio", "noise_dtype",
              "record"):
        setattr(v, f, getattr(fresh, f))


def settle_conventions(verdicts: list[TapVerdict]) -> None:
    """A q/k feature permutation is a layout convention only where the attention undoes it: the
    first tap of its layer after the attention (attn_ctx, or the first later one the port exposes:
    AFTER_ATTENTION) is exact or drift. Confirmed, its record says by which tap; otherwise (that tap
    is a finding, inherited, or the layer has none) the tap gets its own record back (the
    permutation finding stays in it). Before teacher.inherit, which picks the first finding as the
    origin (the engine and the streamed ladder call it there); idempotent: first_divergence calls
    it too."""
    for i, v in enumerate(verdicts):
        conv = v.record.convention if v.kind == "convention" and v.record is not None else None
        if conv is None or conv.what != "feature_permutation" or conv.confirmed is not None:
            continue
        after = next((w for w in verdicts[i + 1:] if w.layer == v.layer
                      and tapnames.tap(w.tap).kind in AFTER_ATTENTION), None)
        if after is not None and after.kind in ("exact", "drift"):
            _refresh(v, dataclasses.replace(v.record, convention=dataclasses.replace(
                conv, confirmed=True, confirmed_by=after.tap)))
        else:
            _refresh(v, conv.raw)


# A projection's output tap: (its input tap, the weight's checkpoint key after "model.layers.{i}.").
PROJECTION_OF = {"q": ("attn_norm", "self_attn.q_proj"), "k": ("attn_norm", "self_attn.k_proj"),
                 "v": ("attn_norm", "self_attn.v_proj"), "attn_out": ("attn_ctx", "self_attn.o_proj"),
                 "gate": ("mlp_norm", "mlp.gate_proj"), "up": ("mlp_norm", "mlp.up_proj"),
                 "mlp_out": ("act", "mlp.down_proj")}


def context_for(tap, c64, o, weights=None, cfg=None) -> dict:
    """What classify's structure analysis needs besides the tap itself (see classify), and
    the step's own inputs on both sides (structure.tap_inputs: the activation, transposed-
    projection, residual and swapped-projection tests). weights(key) -> (the reference's weights
    as a port may have quantized them from: [out, in] arrays, bias or None), or None: at a
    projection's output, "projection" holds the candidate's own input and those (storage.py).
    cfg: the reference's llamaspec config, or None: "step" holds what it says about this tap's
    step (family.step_features: the attention's conventions, a cap, a scale, a norm's epsilon
    and axis, a projection's bias); at a norm, "norm_inputs" holds both sides' input to it."""
    t = tapnames.tap(tap)
    layer, kind = t.layer, t.kind
    p = f"layers.{layer}."
    inputs = tap_inputs(tap, c64, o)
    out = {"inputs": inputs} if inputs else {}
    step = family.step_features(tap, cfg)
    if step:
        out["step"] = step
    source, key = PROJECTION_OF.get(kind, (None, None))
    if weights is not None and source and p + source in c64 and p + source in o:
        out["projection"] = (c64[p + source], o[p + source], lambda: weights(f"model.layers.{layer}.{key}"))
    norm_in = _norm_input(tap, o)
    if norm_in in o and norm_in in c64:
        out["norm_inputs"] = (c64[norm_in], o[norm_in])
    if norm_in in o and kind not in family.QK_NORMS:
        return {**out, "norm_input": o[norm_in]}
    if norm_in in o and step.get("axis") is not None:   # a q/k norm runs over head_dim, or the whole projection
        x = np.asarray(o[norm_in])
        return {**out, "norm_input": x if step["axis"] == "head" else x.reshape(x.shape[:2] + (-1,))}
    if kind in ("q_rope", "k_rope") and p + kind[0] in c64 and p + kind[0] in o:
        return {**out, "pre": (c64[p + kind[0]], o[p + kind[0]])}
    if kind == "attn_ctx" and all(p + t in o for t in ("q_rope", "k_rope", "v")):
        names = [p + t for t in ("q_rope", "k_rope", "v")]
        mine = tuple(c64[t] for t in names) if all(t in c64 for t in names) else None
        return {**out, "qkv": (o[p + "q_rope"], o[p + "k_rope"], o[p + "v"]), "qkv_cand": mine}
    return out


def _norm_input(tap, o) -> str | None:
    """The tap a norm tap's norm reads (the layer's input, resid_mid, a sublayer's output, q or k,
    the last layer's output); None for another tap."""
    t = tapnames.tap(tap)
    p = f"layers.{t.layer}."
    if t.kind == "final_norm":
        return max((name for name in o if name.endswith(".out")), default=None, key=lambda n: tapnames.tap(n).layer)
    return {"attn_norm": tapnames.input_tap(t.layer) if t.layer is not None else None, "mlp_norm": p + "resid_mid",
            "post_attn_norm": p + "attn_out", "post_mlp_norm": p + "mlp_out", "q_norm": p + "q",
            "k_norm": p + "k"}.get(t.kind)


def standing(v: TapVerdict) -> str:
    """What a tap counts for in the overall verdict: its kind (one of KINDS), except for an
    inherited tap (what teacher forcing says it adds on its own, drift or exact, or, inside the
    origin's layer, drift unless bitwise equal) and a convention (the kind of its judgement with
    the convention removed)."""
    if v.kind != "convention" and v.inherited is None:
        return v.kind
    if v.kind == "convention":
        return v.record.convention.removed.kind
    if v.local is not None:
        return v.local.kind
    return "exact" if v.metrics.get("max_ulp") == 0 else "drift"


def first_divergence(verdicts: list[TapVerdict]) -> tuple[str, Divergence | None]:
    """The overall verdict and, for precision or semantic, the first departure as a Divergence.

    The first departure is the earliest tap, in execution order, whose error leaves the drift
    envelope (a precision or semantic finding of its own: not inherited, not a convention),
    whatever its class; its class is the one decided there (a no-twin tap whose evidence cannot
    tell rounding from math says so: evidence.NO_TWIN_UNDECIDED). The overall verdict is the
    worst kind over the taps (inherited and convention taps by their standing): a
    later semantic finding that teacher forcing does not attribute to the first keeps the
    verdict semantic, while the report points at where the numbers first part. Conventions are
    settled first (settle_conventions)."""
    settle_conventions(verdicts)
    own = [v for v in verdicts if v.inherited is None and v.kind != "convention"]
    worst = max((standing(v) for v in verdicts), key=KINDS.index)
    if worst in ("exact", "drift"):
        return worst, None
    first = next(v for v in own if v.kind in FINDINGS)
    return worst, Divergence(first.tap, first.layer, first.component, first.kind, "", record=first.record).explain()


# ----- where NaN/Inf starts, and the config field that explains it ---------------------------

_NORM_KINDS = ("attn_norm", "mlp_norm", "final_norm")


def nonfinite_origin(verdicts: list[TapVerdict], cfg, policy: Policy, mask) -> dict:
    """Report.nonfinite: {} when no tap holds NaN/Inf; else the first tap in execution order
    that does, its counts per run, and (cause, why) where the config and the policy explain it
    (nonfinite_cause). The nonfinite rung calls the tap precision or semantic, which alone
    reads as the candidate's fault even where both sides compute the same NaN from the config."""
    first = next((v for v in verdicts if v.record is not None and any(v.record.nonfinite)), None)
    if first is None:
        return {}
    r, c, c64 = first.record.nonfinite
    out = {"tap": first.tap, "reference": int(r), "candidate": int(c), "candidate_fp64": int(c64)}
    cause = nonfinite_cause(first.tap, cfg, policy, int(positions_from_mask(np.asarray(mask)).max(initial=0)))
    if cause is not None:
        out["cause"], out["why"] = cause
    return out


def nonfinite_cause(tap: str, cfg, policy: Policy, max_position: int) -> tuple[str, str] | None:
    """(what, why) when the tap's NaN/Inf follows from a config field (or the input's positions)
    at the policy's dtypes: an rms_norm_eps that is 0 in the norm_dtype (a zero row divided by
    0), a RoPE base or factor that is 0 or Inf in the rope_dtype, positions past the rope_dtype's
    range (the angles, position x frequency, overflow); else None. cfg: a llamaspec LlamaConfig
    (anything else: nothing to say)."""
    if cfg is None or not hasattr(cfg, "rope"):
        return None
    kind = tapnames.tap(tap).kind
    if kind in _NORM_KINDS and float(numpy_dtype(policy.norm_dtype).type(cfg.rms_norm_eps)) == 0.0:
        return "config field 'rms_norm_eps'", (f"rms_norm_eps = {cfg.rms_norm_eps:g} is 0 in {policy.norm_dtype} "
                                               "(the policy's norm_dtype), so a row of zeros is divided by 0")
    if kind in ("q_rope", "k_rope"):
        dt = numpy_dtype(policy.rope_dtype)
        with np.errstate(all="ignore"):
            for field, value in (("rope_theta", cfg.rope.theta), ("rope factor", cfg.rope.factor)):
                v = float(dt.type(value))
                if v == 0.0 or not math.isfinite(v):
                    return f"config field '{field}'", (f"{field} = {value:g} is {v:g} in {policy.rope_dtype} (the "
                                                       "policy's rope_dtype), where the RoPE frequencies are computed")
            if not math.isfinite(float(dt.type(max_position))):
                return "the input's positions", (f"positions up to {max_position} are past {policy.rope_dtype}'s range "
                                                 "(the policy's rope_dtype), where the RoPE angles are computed")
    return None
