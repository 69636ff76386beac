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

from ..metrics import nonfinite, unit_roundoff
from ..vocabulary import (
    F32_STEPS_FLOOR,
    FLOOR_ULPS,
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
from .conventions import explain_attention
from .structure import analyse, spearman
from .structure import hint as structure_hint

_F32_STEP_KINDS = ("position_trend", "head_confinement", "half_confinement", "sign_bias")
# Where a precision deviation first shows, the step that most likely lost it.
_PRECISION_STEP = {
    "q_rope": "RoPE tables (angles, cos/sin) computed in lower precision",
    "k_rope": "RoPE tables (angles, cos/sin) computed in lower precision",
    "attn_ctx": "attention (scores, softmax or P@V) computed in lower precision",
    "attn_norm": "RMSNorm (mean of squares, rsqrt) computed in lower precision",
    "mlp_norm": "RMSNorm (mean of squares, rsqrt) computed in lower precision",
    "final_norm": "RMSNorm (mean of squares, rsqrt) computed in lower precision",
    "logits": "lm_head output kept in lower precision",
}
# Where a semantic difference with no simple structure first shows: what sits there.
_COMPONENT_HINT = {
    "embed": "the embedding table or token ids",
    "attn_norm": "the input RMSNorm (epsilon, weight convention, normalisation)",
    "mlp_norm": "the post-attention RMSNorm (epsilon, weight convention, normalisation)",
    "final_norm": "the final RMSNorm",
    "lm_head": "the lm_head matrix: everything before the logits agrees (tied vs untied "
               "embeddings, a transposed or another matrix)",
}


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
    hint: str
    # err(cand) / (M * err(ref) + floor), the worse of the whole tap and its quarters of
    # positions: > 1 is a precision deviation (when fp64 agrees)
    precision_ratio: float = float("nan")
    # candidate vs reference at the policy: max abs, max ULP (compute dtype), cosine,
    # fraction of elements beyond 16 unit roundoffs (metrics.pair_metrics)
    metrics: dict = dataclasses.field(default_factory=dict)
    # the dtype whose rounding the fp64-rung difference looks like (dtype_noise), if any
    noise_dtype: str | None = None


@dataclasses.dataclass
class Divergence:
    tap: str
    layer: int | None
    component: str
    kind: str
    hint: str
    # Teacher forcing's word on the layer: True when the layer that adds the error on its
    # own (oracle input forced) is this one, False when it is another, None when not run.
    confirmed: bool | None = None
    evidence: str = ""


def _findings(tap, cand64, oracle, mask, keeps_f32, context) -> list:
    """Structure of the fp64-rung difference at one tap (structure.analyse, RoPE pairs with
    the pre-RoPE inputs, attention conventions with the oracle's q/k/v)."""
    kind = tapnames.tap(tap).kind
    per_head = kind in ("q", "k", "v", "q_rope", "k_rope")
    c64, o = np.asarray(cand64, np.float64), np.asarray(oracle, np.float64)
    found = analyse(c64, o, mask, per_head=per_head, pre=context.get("pre"),
                    norm_input=context.get("norm_input"))
    if kind == "attn_ctx" and context.get("qkv") is not None:
        conv = explain_attention(c64, *context["qkv"], mask)
        found = ([conv] if conv else []) + found
    if keeps_f32:
        found = [f for f in found
                 if f.size > (F32_STEPS_FLOOR if f.kind in _F32_STEP_KINDS else STRUCT_F32_FLOOR)]
    return found


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
        e, n = float(np.sum(sq[rows])), float(np.sum(self.norm[rows]))
        return math.sqrt(e / n) if n else math.sqrt(e)

    def effective_values(self, rows=slice(None)) -> float:
        """n_eff = (sum o^2)^2 / sum o^4 over `rows`: how many values the relative error of
        these rows effectively averages (SUBSET_MIN_VALUES)."""
        n4 = float(np.sum(self.norm4[rows]))
        return float(np.sum(self.norm[rows])) ** 2 / n4 if n4 else 0.0


def precision_ratio(r, c, o, pos, floor, m=M, rows: _RowErrors | None = None
                    ) -> tuple[float, str]:
    """err(c) / (M err(r) + floor) over the whole tap and over each quarter of positions
    (when there are >= QUARTER_POSITIONS): the worst, and where. A step whose rounding
    grows with position (RoPE angles in low precision) hides in a whole-tap average. A
    quarter whose values are carried by a few huge ones (fewer than SUBSET_MIN_VALUES
    effective values) is skipped. r, c may be given as per-row squared errors with `rows` (the oracle's _RowErrors)."""
    if rows is None:
        rows = _RowErrors(o)
        r, c = rows.sq(r), rows.sq(c)

    def ratio(sel):
        return rows.rel(c, sel) / (m * rows.rel(r, sel) + floor)
    best, where = ratio(slice(None)), "whole tap"
    distinct = np.unique(pos)
    if len(distinct) >= QUARTER_POSITIONS:
        edges = distinct[np.linspace(0, len(distinct), 5).astype(int)[1:-1]]
        quarter = np.searchsorted(edges, pos, side="right")
        for q in range(4):
            if rows.effective_values(quarter == q) < SUBSET_MIN_VALUES:
                continue    # a few huge values carry this quarter: their error is no statistic
            x = ratio(quarter == q)
            if x > best:
                lo, hi = pos[quarter == q].min(), pos[quarter == q].max()
                best, where = x, f"positions {lo}-{hi}"
    return best, where


def rope_band_ratio(r, c, o, floor, m=M) -> tuple[float, str]:
    """At a q_rope / k_rope tap ([N, heads, head_dim], real positions only, Hugging Face
    half-split layout: pair i is dims i and i + D/2, its frequency theta^(-2i/D) falling
    with i): the precision ratio err(c) / (M err(r) + floor) over each quarter of the
    pairs, from the highest frequencies down; the worst, and where. A RoPE angle rounded
    to a narrower dtype has an error proportional to the angle (position x frequency), so
    it sits in the high-frequency pairs, where a whole-tap average dilutes it: on SmolLM2
    at bf16, angles in bf16, 128 tokens: 3.6x the bound in the top quarter, 2.4x over the
    tap (docs/method.md, "Position and frequency structure")."""
    r, c, o = (np.asarray(a, np.float64) for a in (r, c, o))
    D = o.shape[-1]
    if o.ndim != 3 or D % 8:
        return float("nan"), ""
    half = D // 2

    def band(x, q):
        lo, hi = q * half // 4, (q + 1) * half // 4
        return np.concatenate([x[..., lo:hi], x[..., half + lo:half + hi]], -1)
    best, where = float("nan"), ""
    for q in range(4):
        ob = band(o, q)
        n = float(np.sum(ob * ob))
        if not n or n * n / float(np.sum(ob ** 4)) < SUBSET_MIN_VALUES:
            continue
        er, ec = (math.sqrt(float(np.sum((band(x, q) - ob) ** 2)) / n) if n else 0.0 for x in (r, c))
        x = ec / (m * er + floor)
        if not x <= best:
            lo, hi = q * half // 4, (q + 1) * half // 4 - 1
            best, where = x, (f"RoPE pairs {lo}-{hi} of {half} (the {('highest', 'second', 'third', 'lowest')[q]} "
                              "quarter of frequencies)")
    return best, where


def dtype_noise(c64, o, err64: float, keeps_f32: bool) -> tuple[str, float] | None:
    """(dtype, err64 in its unit roundoffs) when the fp64-rung difference c64 - o looks like
    one dtype's rounding noise: unbiased, uncorrelated with the values, and sized like
    one rounding (ONE_ROUNDING u) within NOISE_BAND; the dtype whose size fits best. f32
    is not a candidate for a side that keeps f32 steps (that noise is its normal)."""
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
    fits = [(abs(math.log(err64 / unit_roundoff(dt) / ONE_ROUNDING)), dt, err64 / unit_roundoff(dt))
            for dt in NOISE_DTYPES if not (keeps_f32 and dt == "float32")]
    fits = [f for f in fits if NOISE_BAND[0] <= f[2] <= NOISE_BAND[1]]
    return min(fits)[1:] if fits else None


def _where(t) -> str:
    part = {"attn": "attention", "mlp": "MLP", "attn_norm": "input RMSNorm", "mlp_norm": "post-attention RMSNorm",
            "embed": "embedding", "final_norm": "final RMSNorm", "lm_head": "lm_head"}[t.component]
    return f"layer {t.layer}'s {part}" if t.layer is not None else f"the {part}"


def position_trend(sq_r, sq_c, pos) -> tuple[float, float, float, str] | None:
    """(rho, first, last, where): the candidate's error over the reference's (per-row
    squared errors sq_c, sq_r) in TREND_BUCKETS equal runs of the distinct positions, its
    rank correlation with position, and the first and last runs' ratios; None with fewer
    than 4 positions per run or no reference error to compare with."""
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
    return spearman(np.arange(TREND_BUCKETS), ratio), float(ratio[0]), float(ratio[-1]), \
        f"positions {last.min()}-{last.max()}"


# Structure that rounding itself can have (a step in a narrower dtype concentrates its
# error in some positions, heads or one sign): not evidence of different math at P.
_ROUNDING_PATTERNS = _F32_STEP_KINDS + ("per_row_scale",)


def classify_without_twin(tap, ref, cand, oracle, mask, policy: Policy, context=None,
                          hidden: int | None = None) -> TapVerdict:
    """The ladder for one tap when the candidate has no float64 twin (a port without
    float64(), a dump from another engine): judged at the policy alone, by size and
    structure (docs/method.md, "Without a float64 twin"). context: context_for(tap,
    cand at P, oracle), the candidate's own pre-RoPE q/k standing in for its twin's.

    exact / drift as usual (cand against the oracle, bounded by the reference's own
    error). Beyond the bound: semantic when the candidate's difference from the oracle has
    a structure rounding does not make (a RoPE layout or frequency, a causal edge, an
    epsilon, a permutation, a scale...), or when it is larger than a bf16 step could make
    (NOISE_BAND[1] bf16 roundings, relative); precision otherwise. Both say that the fp64
    rung was not run: a small change in the math and a lower-precision step can look
    alike at P, which only the twin tells apart."""
    t = tapnames.tap(tap)
    r, c, o = (_real(a, mask) for a in (ref, cand, oracle))
    bad = nonfinite(r) + nonfinite(c)
    rows = _RowErrors(o)
    sq_r, sq_c = rows.sq(r), rows.sq(c)
    err_ref, err_cand = rows.rel(sq_r), rows.rel(sq_c)
    nan = float("nan")
    if bad or not math.isfinite(err_ref) or not math.isfinite(err_cand):
        return TapVerdict(tap, t.layer, t.component, "semantic" if nonfinite(c) and not nonfinite(r) else "precision",
                          err_ref, err_cand, nan, bad, f"NaN/Inf: {nonfinite(r)} in the reference, {nonfinite(c)} "
                          "in the candidate (no float64 twin to tell math from overflow)")
    if np.array_equal(r, c):
        return TapVerdict(tap, t.layer, t.component, "exact", err_ref, err_cand, nan, 0, "bitwise equal")
    pos = positions_from_mask(np.asarray(mask))[np.asarray(mask, bool)]
    m, floor = drift_factor(policy), precision_floor(policy, hidden)
    ratio, where = precision_ratio(sq_r, sq_c, None, pos, floor, m, rows)
    if t.kind in ("q_rope", "k_rope"):
        band, in_band = rope_band_ratio(r, c, o, floor, m)
        if band > ratio:
            ratio, where = band, in_band
    if ratio <= 1:
        return TapVerdict(tap, t.layer, t.component, "drift", err_ref, err_cand, nan, 0,
                          f"rounding: {err_cand:.1e} vs the reference's own {err_ref:.1e} (within {m:g}x + "
                          f"{FLOOR_ULPS} ulp; no float64 twin: judged at {policy.name} only)", ratio)
    # RoPE pair analysis needs rotations exact to ~1e-4 (structure.ROPE_NORM_TOL): the
    # twin's, not the policy's (at fp32 it reads frequency noise as a scaling).
    found = [f for f in _findings(tap, cand, oracle, mask, False,
                                  {k: v for k, v in (context or {}).items() if k != "pre"})
             if f.kind not in _ROUNDING_PATTERNS]
    # A rounded RoPE angle is the one step whose rounding is not bounded by a few roundings
    # of the values: its error is position x frequency x u, largest in the top pairs.
    angle = "highest quarter of frequencies" in where
    big = err_cand > NOISE_BAND[1] * unit_roundoff("bfloat16") and not angle
    base = (f"the candidate's error is {err_cand:.1e} against the reference's {err_ref:.1e} ({ratio:.1f}x the drift "
            f"bound over the {where}); no float64 twin, so judged at {policy.name} by structure alone")
    if found or big:
        why = (structure_hint(found) if found else
               f"larger than rounding in bf16 or any wider dtype makes ({err_cand:.1e} > {NOISE_BAND[1]:g} bf16 "
               "unit roundoffs)")
        return TapVerdict(tap, t.layer, t.component, "semantic", err_ref, err_cand, nan, 0,
                          f"{base}: most likely a difference in the math: {why}", ratio)
    step = _PRECISION_STEP.get(t.kind, "a step computed in lower precision")
    if angle:
        step += ("; the excess sits in the highest-frequency pairs, where the angle (position x frequency) is "
                 "largest")
    return TapVerdict(tap, t.layer, t.component, "precision", err_ref, err_cand, nan, 0,
                      f"{base}: no structure of different math{'' if angle else ' and rounding-sized'}, most likely "
                      f"precision: {step} (a small "
                      "change in the math can look the same without the twin)", ratio)


def classify(tap, ref, cand, oracle, cand64, mask, policy: Policy, keeps_f32: bool,
             context=None, hidden: int | None = None, noise_from: TapVerdict | None = None) -> TapVerdict:
    """The ladder for one tap; arrays are [B, T, ...], mask [B, T] selects real positions.
    cand64=None (no float64 twin): classify_without_twin.

    context (optional): {"pre": (cand64_pre, oracle_pre)} at q_rope/k_rope taps (the q/k
    before RoPE), {"qkv": (q_rope, k_rope, v)} of the oracle at attn_ctx: they let the
    structure analysis name RoPE and attention-convention differences. noise_from: the
    earlier tap where dtype noise entered the fp64 run (run_ladder passes it on): an
    unstructured fp64 difference after it is that noise, carried along."""
    if cand64 is None:
        return classify_without_twin(tap, ref, cand, oracle, mask, policy, context, hidden)
    t = tapnames.tap(tap)
    layer, component = t.layer, t.component
    r, c, o, c64 = (_real(a, mask) for a in (ref, cand, oracle, cand64))
    bad = nonfinite(r) + nonfinite(c)
    rows = _RowErrors(o)
    sq_r, sq_c = rows.sq(r), rows.sq(c)
    err_ref, err_cand, err64 = rows.rel(sq_r), rows.rel(sq_c), rows.rel(rows.sq(c64))
    if bad or not all(math.isfinite(e) for e in (err_ref, err_cand, err64)):
        kind = "semantic" if nonfinite(c64) else "precision"
        return TapVerdict(tap, layer, component, kind, err_ref, err_cand, err64, bad,
                          f"NaN/Inf: {nonfinite(r)} in the reference, {nonfinite(c)} in the "
                          f"candidate ({nonfinite(c64)} at fp64)")
    equal = np.array_equal(r, c)
    floor64 = F32_STEPS_FLOOR if keeps_f32 else FP64_FLOOR
    gate = STRUCT_F32_FLOOR if keeps_f32 else FP64_FLOOR
    noise = None
    # The fp64 rung comes first even where the policy's values are bitwise equal: a
    # difference in the math that the policy rounds away here is localised where it starts.
    if err64 > gate:
        found = _findings(tap, cand64, oracle, mask, keeps_f32, context or {})
        if not found and err64 > floor64:
            if noise_from is not None:
                noise = (noise_from.noise_dtype, None)
            else:
                noise = dtype_noise(c64, o, err64, keeps_f32)
        if noise is not None and equal:
            pass    # rounding noise the policy does not see here: exact, below
        elif noise is not None:
            dtype, size = noise
            if unit_roundoff(dtype) > unit_roundoff(policy.compute_dtype):
                step = _PRECISION_STEP.get(t.kind, "a step rounded to a narrower dtype")
                why = (f"it carries the {dtype} rounding that enters at {noise_from.tap}" if noise_from else
                       f"{_where(t)} computes at about {dtype} precision even in the float64 run (rel error "
                       f"{err64:.1e} = {size:.2f} {dtype} unit roundoffs; one rounding gives {ONE_ROUNDING:.2f}; "
                       f"unbiased and uncorrelated with the values): {step}")
                return TapVerdict(tap, layer, component, "precision", err_ref, err_cand, err64, 0, why,
                                  noise_dtype=dtype)
            # noise at or below the working precision: judged at the policy, below
        elif err64 > floor64 or found:
            why = structure_hint(found) if found else "no simple structure"
            hidden_here = (f" (bitwise equal at {policy.name} here: the policy rounds it away, it shows "
                           "further on)" if equal else "")
            return TapVerdict(tap, layer, component, "semantic", err_ref, err_cand, err64, 0,
                              f"differs at fp64 (rel L2 {err64:.1e}"
                              + (f" > {floor64:.0e}" if err64 > floor64 else
                                 f", structured above {gate:.0e}")
                              + f"){hidden_here}: a difference in the math, not rounding; {why}")
    if equal:
        return TapVerdict(tap, layer, component, "exact", err_ref, err_cand, err64, 0, "bitwise equal",
                          noise_dtype=noise[0] if noise else None)
    pos = positions_from_mask(np.asarray(mask))[np.asarray(mask, bool)]
    m = drift_factor(policy)
    floor = precision_floor(policy, hidden)
    ratio, where = precision_ratio(sq_r, sq_c, None, pos, floor, m, rows)
    if t.kind in ("q_rope", "k_rope"):
        band, in_band = rope_band_ratio(r, c, o, floor, m)
        if band > ratio:
            ratio, where = band, in_band
    noise_dtype = noise[0] if noise else None
    # The shape of a precision finding's excess over positions names its likely step; on its
    # own (under the drift bound) it is not a finding: a reference that is unusually exact
    # at the first positions makes a clean candidate's ratio rise too (SmolLM2, jaxmodel at
    # fp32, 64 tokens: 0.09x to 1.71x, rank correlation 0.90).
    trend = position_trend(sq_r, sq_c, pos) if ratio > 1 else None
    rising = trend is not None and trend[0] >= TREND_RHO and trend[2] >= TREND_GROWTH * trend[1]
    grows = (f"the candidate's error over the reference's grows with position, steadily (rank correlation "
             f"{trend[0]:.2f}), from {trend[1]:.2f}x in the first {TREND_BUCKETS}th of the positions to "
             f"{trend[2]:.2f}x at {trend[3]}" if rising else "")
    rope_step = ("a step whose rounding grows with position, most often RoPE angles (position x frequency) "
                 "or tables computed in lower precision")
    if ratio > 1:
        step = _PRECISION_STEP.get(t.kind, "a step computed in lower precision "
                                   "(matmul accumulation, norm, softmax, RoPE tables)")
        if rising:
            step = f"{step}; {grows}: {rope_step}"
        if "highest quarter of frequencies" in where:
            step += ("; the excess sits in the highest-frequency pairs, where the angle (position x "
                     "frequency) is largest: angles or their inputs rounded to a narrower dtype")
        times = f"{err_cand / err_ref:.1f}x" if err_ref else "more than"
        return TapVerdict(tap, layer, component, "precision", err_ref, err_cand, err64, 0,
                          f"the candidate loses {times} the reference's precision here "
                          f"({err_cand:.1e} vs {err_ref:.1e}; {ratio:.1f}x the drift bound "
                          f"{m:g}x + {FLOOR_ULPS} ulp over the {where}) while fp64 agrees: {step}",
                          ratio, noise_dtype=noise_dtype)
    return TapVerdict(tap, layer, component, "drift", err_ref, err_cand, err64, 0,
                      f"rounding: {err_cand:.1e} vs the reference's own {err_ref:.1e} "
                      f"(within {m:g}x + {FLOOR_ULPS} ulp)", ratio, noise_dtype=noise_dtype)


def context_for(tap, c64, o) -> dict:
    """What classify's structure analysis needs besides the tap itself (see classify)."""
    t = tapnames.tap(tap)
    layer, kind = t.layer, t.kind
    p = f"layers.{layer}."
    norm_in = {"attn_norm": "embed" if not layer else f"layers.{layer - 1}.out",
               "mlp_norm": p + "resid_mid",
               "final_norm": max((t for t in o if t.endswith(".out")), default=None,
                                 key=lambda t: tapnames.tap(t).layer)}.get(kind)
    if norm_in in o:
        return {"norm_input": o[norm_in]}
    if kind in ("q_rope", "k_rope") and p + kind[0] in c64 and p + kind[0] in o:
        return {"pre": (c64[p + kind[0]], o[p + kind[0]])}
    if kind == "attn_ctx" and all(p + t in o for t in ("q_rope", "k_rope", "v")):
        return {"qkv": (o[p + "q_rope"], o[p + "k_rope"], o[p + "v"])}
    return {}


def first_divergence(verdicts: list[TapVerdict]) -> tuple[str, Divergence | None]:
    """The overall verdict (the worst tap's kind) and, for precision or semantic, the
    earliest tap of that kind as a Divergence."""
    worst = max(verdicts, key=lambda v: KINDS.index(v.kind)).kind
    if worst in ("exact", "drift"):
        return worst, None
    first = next(v for v in verdicts if v.kind == worst)
    hint = first.hint
    # Where a difference starts says what sits there; for the embedding and the lm_head
    # (a table and one matrix) that is the best hint whatever pattern the values show.
    if first.component in _COMPONENT_HINT and (
            "no simple structure" in hint or first.component in ("embed", "lm_head")):
        hint += f"; it starts in {_COMPONENT_HINT[first.component]}"
    return worst, Divergence(first.tap, first.layer, first.component, first.kind, hint)
