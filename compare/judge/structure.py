"""Is a difference structured (semantic) or noise-like (rounding)?

Rounding noise is unbiased and uncorrelated with the values; a semantic difference is
systematic. Each detector here looks for one kind of system in d = cand - ref at one
tap and returns a Finding (data: kind, score, size and the numbers behind it) or None;
`analyse` runs them all. compare.explain.findings says them in words (`hint`: one line).

Shapes: cand/ref are [B, T, ...] (per-head taps [B, T, H, D]); a [B, T] mask selects
the real positions. Rows are positions, features are the trailing axes flattened.

Thresholds are chosen so that unbiased noise cannot reach them, whatever its size:
all criteria are scale-free (fractions of error energy, rank correlations, z-scores),
and each comment says what noise would give. `Finding.size` keeps the magnitude of
the pattern so a caller can still ask "is this systematic part as small as rounding
in some dtype?" (e.g. RoPE angles computed in f32 inside an f64 run also grow with
position, at ~1e-7 instead of ~1).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from llamaspec import taps as tapnames
from llamaspec.inputs import positions_from_mask

from ..explain import findings as explain_findings
from ..metrics import as64, rel_l2

# --- thresholds ------------------------------------------------------------------------

# A fitted pattern must account for 90% of the error energy. A least-squares fit with
# k free numbers to n noise values explains about k/n of the noise energy on average
# (1/F per row, 1/N per feature, 1/(N F) for one global factor); with n >= MIN_VALUES
# that is <= 1/8, and the spread around it is small, so 0.9 is out of noise's reach.
EXPLAINED = 0.9
MIN_VALUES = 8
# A finer model (one factor per row / per feature) is only reported when it explains
# 10% of the error energy more than one global factor; else the global factor is the
# simpler, truer description (a global scale fits every row equally well).
EXTRA_EXPLAINED = 0.1
# Per-row scale: a row's factor counts as non-zero at |t| > 4 (noise: p ~ 6e-5 per row),
# and at least half of the rows must have one: one odd row is not "per-row scaling".
ROW_T = 4.0
ROW_SHARE = 0.5
# Offset: the reference itself must vary across rows (>= 10% of its energy outside its
# mean); if ref is (nearly) the same row repeated, d is too, and a "constant offset" is
# then just deterministic rounding of identical inputs.
REF_VARIES = 0.1
# Position trend: Spearman rho >= 0.9 over >= 16 distinct positions (noise: rho is
# ~N(0, 1/sqrt(P-1)), so 0.9 is > 3.5 sigma at P = 16) AND the error of the last
# quarter of positions differs from the first quarter's by >= 4x (noise: ~1x). The
# ratio gate keeps natural accumulation out: error growing like sqrt(t) changes ~2.6x
# between quarters, while RoPE and mask bugs start from 0 at position 0.
# Attention rounding itself grows with the number of keys over the first positions,
# strongly when the softmax is peaked (measured with f32/bf16/f16 softmax, score std
# up to ~16: rho reaches 0.8-0.92 with a 4x ratio in ~0.5% of cases at T = 16..32, and
# more often below 16). So: no trend below 16 positions, rho >= 0.95 below 32. A RoPE
# angle error gives rho ~0.99-1.0 until its angles wrap around.
# The absolute error per position (see "measured twice" below) must agree, more
# loosely: rho >= 0.5 and a 2x ratio, since row norms that differ by position scatter
# it; a flat absolute error means the relative one only follows shrinking rows.
ERROR_POSITION_RHO = 0.9          # (vocabulary.TREND_RHO is another test: of precision ratios)
ERROR_POSITION_RHO_SHORT = 0.95
TREND_POSITIONS = 16
TREND_LONG = 32
TREND_RATIO = 4.0
TREND_ABS_RHO = 0.5
TREND_ABS_RATIO = 2.0
# Head / half confinement: >= 99% of the error energy in <= half the heads (or in one
# half of head_dim). A real confinement leaves the other heads as they were, with only
# the noise floor as error, so its share is ~1. Noise spreads over all heads, but heads
# differ in how much rounding they collect (a head whose softmax puts p ~ 1 on one key
# is nearly exact): measured, the top half of 4-8 heads holds up to ~96% of softmax
# rounding error with few positions. Heads also need >= 32 positions and >= 4 heads
# (with 2 heads, "one head" is just the noisier one).
CONFINED = 0.99
CONFINE_ROWS = 32
CONFINE_HEADS = 4
# Heads / positions with less than 10% of the mean reference energy are measured
# against that floor instead: rounding error there has the size of its inputs, not of
# the tiny output, and a relative error would inflate it into a false "confinement".
ENERGY_FLOOR = 0.1
# Permutation: column j of cand matches column k of ref when their cosine is > 0.999
# (noise at 1e-2 relative keeps a column's cosine with itself at ~1 - 5e-5; two
# different activation columns are far from 0.999). The mapping must explain 90% of
# the error energy. Only run when the error is >= 1e-3 relative: moving whole columns
# gives an O(1) error unless the moved columns are near-copies of each other.
PERM_COS = 0.999
PERM_MIN_ERR = 1e-3
PERM_MAX_COLS = 1024   # cost is S * D^2; beyond head_dim/hidden sizes it is not worth it
PERM_MAX_SAMPLES = 1024
# Sign bias: binomial z > 6 over all non-zero d (noise: p ~ 2e-9) AND a one-sample
# t > 6 over >= 16 rows of per-row imbalance (rounding of one per-row scalar, e.g. an
# rsqrt, gives a whole row one sign: elements are not independent, rows are), AND an
# effect size |2p - 1| >= 0.1: rounding has tiny legitimate asymmetries (binade edges,
# ties-to-even) that a huge n would make "significant".
SIGN_Z = 6.0
SIGN_ROWS = 16
SIGN_EFFECT = 0.1

# RoPE (q_rope / k_rope taps, with the pre-RoPE q / k given): a side "rotates" a pair
# layout when every pair keeps its norm to 1e-4 relative (a rotation in f64 keeps it to
# ~1e-15, RoPE tables rounded in f32 to ~1e-7; the wrong layout breaks it at O(1)).
# Frequencies are read from the rows at position 1 (angle = omega, no wrap: omega <= 1).
ROPE_NORM_TOL = 1e-4
ROPE_FREQ_TOL = 1e-6    # relative difference of frequencies that counts (f32 tables: ~1e-7)
# A frequency difference explains the angles when the angle error is position x that
# difference to 1e-3 of its typical size, and is one "linear scaling" when every pair's
# frequency ratio is the same to 1e-3 (rounded tables move ratios by ~1e-7).
ROPE_LINEAR_TOL = 1e-3
ROPE_CONST_RATIO = 1e-3
# A side whose rotated values are all float32 numbers (a port that applies RoPE in float32
# inside its float64 run, as torchtune's x.float()) reads each angle only to float32's
# resolution: a pair's output rounded to one roundoff u moves its angle by up to ~u radians,
# whatever the angle. At position 1 the angle is the frequency, so the low-frequency pairs
# (1e-5 rad) read with relative errors of 1e-3 there while the table is right. Frequencies that
# differ by at most ROPE_ANGLE_READS such roundoffs (absolute, radians) are not another schedule.
ROPE_ANGLE_READS = 4
# Positions shifted in a row (padding counted into the positions, position_ids not passed):
# every pair of every token of the row turns by delta x omega_k more than the reference's, one
# whole number delta per row. delta is read from the lowest frequency (no wrap there for any
# shift a sequence can have) and holds when every pair's angle difference is delta x omega_k to
# ROPE_LINEAR_TOL of its typical size (as the linear test of a frequency change). A changed
# frequency gives a delta that grows with position instead; a shift of zero in every row is none.
# Causal edge: the last real position of every sequence is (nearly) untouched, every
# other position is not: a query that sees one token ahead changes all but the last.
# "Nearly": 1e-3 of the median relative error of the other positions (rounding noise
# gives every position the same order of error; a ratio of 1e-3 is out of its reach).
EDGE_RATIO = 1e-3
EDGE_MIN_POSITIONS = 4
EDGE_OTHERS = 0.9   # share of the other positions that must differ (a few may agree by chance)
# RMSNorm epsilon (norm taps, with the norm's input given): per-row factors k = cand/ref
# that an epsilon difference explains satisfy ms * (1/k^2 - 1) = eps_c - eps_r, one number
# for every row (ms = mean square of the row's input). It must fit 99% of the error and
# the per-row estimates must agree to 10% (median absolute deviation): a global scale or
# any other per-row factor gives estimates proportional to ms instead. (f32 norms inside
# an fp64 run scatter a 1e-5 epsilon difference by ~1e-2 of itself.)
EPS_EXPLAINED = 0.99
EPS_SPREAD = 0.1
# The fitted norm-weight offset a is named "(1 + w) instead of w" (a = 1) or the reverse
# (a = -1) within this distance; a fit in an fp64 run lands ~1e-6 from the true value.
OFFSET_NAMED = 1e-2

# Tie-break when scores are equal (to 1e-3): the more specific description first.
PRIORITY = ("nonfinite", "partial_rotary", "activation", "transposed_projection", "residual",
            "swapped_projection", "rope_layout", "rope_position", "rope_frequency", "attention_convention",
            "causal_edge", "norm_weight_offset", "norm_epsilon", "permutation", "global_scale", "head_confinement",
            "per_feature_scale", "per_row_scale", "offset", "half_confinement",
            "position_trend", "sign_bias")
# Findings that model d itself (d = fitted part + small rest); a one-sided sign of d is
# then a consequence, not a separate finding.
_MODELS = ("permutation", "global_scale", "per_feature_scale", "per_row_scale", "offset",
           "rope_layout", "rope_position", "rope_frequency", "causal_edge", "attention_convention", "norm_epsilon",
           "norm_weight_offset", "partial_rotary", "activation", "transposed_projection", "residual",
           "swapped_projection")


@dataclasses.dataclass
class Finding:
    """One systematic pattern in d = cand - ref, as data (dataclasses.asdict gives its JSON;
    compare.explain.findings its sentences: detail, cause, hint)."""
    kind: str
    score: float          # 0..1: share of the error the pattern explains, or its strength
    # ||d|| / ||ref|| where the pattern lives (whole tap; confined heads / half; the worse
    # quarter of positions): compare it with a dtype's unit roundoff.
    size: float = float("nan")
    # the numbers, indices and names behind it, plain values (per kind: see the detector)
    data: dict = dataclasses.field(default_factory=dict)


# --- the selected rows of one tap --------------------------------------------------------

@dataclasses.dataclass
class _Tap:
    c: np.ndarray    # [N, ...] candidate rows (real positions, exact duplicates removed)
    r: np.ndarray    # [N, ...] reference rows
    pos: np.ndarray  # [N] position id of each row (real tokens before it)
    d: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self):
        with np.errstate(invalid="ignore", over="ignore"):
            self.d = self.c - self.r

    def flat(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(len(x), -1)


def _tap(cand, ref, mask=None) -> _Tap:
    c, r = as64(cand), as64(ref)
    if c.shape != r.shape:
        raise ValueError(f"shape mismatch: cand {c.shape} vs ref {r.shape}")
    if c.ndim < 3:   # [B, T] -> [B, T, 1]; [F] -> [1, 1, F]
        c, r = (x[..., None] if x.ndim == 2 else x.reshape(1, 1, -1) for x in (c, r))
    B, T = c.shape[:2]
    m = np.ones((B, T), bool) if mask is None else np.asarray(mask, bool)
    if m.shape != (B, T):
        raise ValueError(f"mask shape {m.shape} does not match [B, T] = {(B, T)}")
    pos = positions_from_mask(m)[m]
    c, r = c[m], r[m]
    # Identical inputs give identical rounding: a repeated token's rows are exact copies
    # and would count as many independent witnesses of the same error. Keep one.
    first: dict[bytes, int] = {}
    for i in range(len(c)):
        first.setdefault(c[i].tobytes() + r[i].tobytes(), i)
    keep = np.fromiter(first.values(), int, len(first))
    return _Tap(c[keep], r[keep], pos[keep])


def _rel(t: _Tap) -> float:
    return rel_l2(t.c, t.r)


# --- scale factors ----------------------------------------------------------------------

def _scale_fits(t: _Tap) -> dict:
    """Explained shares of d by c*ref with c global, per row, per feature."""
    d, r = t.flat(t.d), t.flat(t.r)
    dd = float((d * d).sum())
    rr_row, dr_row = (r * r).sum(1), (d * r).sum(1)
    rr_col, dr_col = (r * r).sum(0), (d * r).sum(0)
    c_row = np.divide(dr_row, rr_row, out=np.zeros_like(rr_row), where=rr_row > 0)
    c_col = np.divide(dr_col, rr_col, out=np.zeros_like(rr_col), where=rr_col > 0)
    rr = float(rr_row.sum())
    c_all = float(dr_row.sum()) / rr if rr else 0.0
    return dict(dd=dd, c_all=c_all, c_row=c_row, c_col=c_col, rr_row=rr_row,
                dd_row=(d * d).sum(1),
                G=c_all * c_all * rr / dd if dd else 0.0,
                R=float((c_row ** 2 * rr_row).sum()) / dd if dd else 0.0,
                S=float((c_col ** 2 * rr_col).sum()) / dd if dd else 0.0)


def _global_scale(t: _Tap, fits: dict) -> Finding | None:
    if fits["dd"] == 0 or fits["G"] < EXPLAINED:
        return None
    return Finding("global_scale", fits["G"], _rel(t),
                   dict(factor=1 + fits["c_all"], explained=fits["G"]))


def _per_row_scale(t: _Tap, fits: dict) -> Finding | None:
    R, G = fits["R"], fits["G"]
    n_rows, F = t.flat(t.r).shape
    if F < MIN_VALUES or R < EXPLAINED or R - G < EXTRA_EXPLAINED:
        return None
    c, rr = fits["c_row"], fits["rr_row"]
    resid = np.maximum(fits["dd_row"] - c * c * rr, 0.0)
    se = np.sqrt(np.divide(resid / (F - 1), rr, out=np.zeros_like(rr), where=rr > 0))
    with np.errstate(divide="ignore", invalid="ignore"):
        tstat = np.where(se > 0, np.abs(c) / se, np.where(c != 0, np.inf, 0.0))
    share = float((tstat > ROW_T).mean())
    if share < ROW_SHARE:
        return None
    return Finding("per_row_scale", R, _rel(t),
                   dict(explained=R, global_explained=G, min=float(c.min()), max=float(c.max()),
                        share=share, rows=int(n_rows)))


def _per_feature_scale(t: _Tap, fits: dict) -> Finding | None:
    S, G = fits["S"], fits["G"]
    if len(t.r) < MIN_VALUES or S < EXPLAINED or S - G < EXTRA_EXPLAINED:
        return None
    c = fits["c_col"]
    return Finding("per_feature_scale", S, _rel(t),
                   dict(explained=S, global_explained=G, min=float(c.min()), max=float(c.max())))


def _offset(t: _Tap) -> Finding | None:
    d, r = t.flat(t.d), t.flat(t.r)
    N = len(d)
    dd, rr = float((d * d).sum()), float((r * r).sum())
    if N < MIN_VALUES or dd == 0 or rr == 0:
        return None
    m, mr = d.mean(0), r.mean(0)
    E = N * float((m * m).sum()) / dd
    ref_const = N * float((mr * mr).sum()) / rr
    if E < EXPLAINED or 1 - ref_const < REF_VARIES:
        return None
    return Finding("offset", E, _rel(t),
                   dict(explained=E, mean_over_rms=float(np.linalg.norm(m) / math.sqrt(rr / N))))


# --- where the error sits -------------------------------------------------------------

def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (Spearman needs them)."""
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return (starts + (counts - 1) / 2)[inv]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (ties averaged); 0 when either side is constant."""
    rx, ry = _ranks(x) - (len(x) - 1) / 2, _ranks(y) - (len(y) - 1) / 2
    den = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / den) if den else 0.0


def _floored(ref_energy: np.ndarray) -> np.ndarray:
    return np.maximum(ref_energy, ENERGY_FLOOR * ref_energy.mean())


# Where the error sits is measured twice: as relative error (d energy / ref energy of
# the group) and as absolute error energy. Rounding noise is proportional to the values
# in one model (then the relative measure is even) and to the inputs' scale in another
# (then the absolute measure is even); real noise is in between. A pattern counts only
# when it shows in both, so groups of very different size (a small head, a shrinking
# row norm) cannot fake one.

def _trend(positions: np.ndarray, err: np.ndarray) -> tuple[float, float, float]:
    """Spearman rho and the median error of the first and last quarter of positions."""
    q = max(1, len(positions) // 4)
    return (spearman(positions.astype(float), err),
            float(np.median(err[:q])), float(np.median(err[-q:])))


def _trending(rho: float, early: float, late: float, min_rho: float, min_ratio: float) -> bool:
    ratio = late / early if early else math.inf
    return (rho >= min_rho and ratio >= min_ratio
            or rho <= -min_rho and ratio <= 1 / min_ratio)


def _position_trend(t: _Tap) -> Finding | None:
    d, r = t.flat(t.d), t.flat(t.r)
    positions = np.unique(t.pos)
    if len(positions) < TREND_POSITIONS:
        return None
    idx = np.searchsorted(positions, t.pos)
    dd = np.bincount(idx, weights=(d * d).sum(1), minlength=len(positions))
    rr = np.bincount(idx, weights=(r * r).sum(1), minlength=len(positions))
    count = np.bincount(idx, minlength=len(positions))
    if not dd.any() or not rr.any():
        return None
    err = np.sqrt(dd / _floored(rr))
    rel = _trend(positions, err)
    absolute = _trend(positions, np.sqrt(dd / count))
    min_rho = ERROR_POSITION_RHO if len(positions) >= TREND_LONG else ERROR_POSITION_RHO_SHORT
    if not (_trending(*rel, min_rho, TREND_RATIO)
            and _trending(*absolute, TREND_ABS_RHO, TREND_ABS_RATIO)
            and rel[0] * absolute[0] > 0):
        return None
    rho, early, late = rel
    return Finding("position_trend", abs(rho), max(early, late),
                   dict(rho=rho, early=early, late=late, positions=len(positions)))


def _confined(dE: np.ndarray, rE: np.ndarray) -> tuple[int, np.ndarray, float]:
    """Smallest set of groups holding >= CONFINED of the error energy in both measures:
    (its size, the groups, the smaller of the two shares)."""
    rel = dE / _floored(rE)
    s_rel, s_abs = rel / rel.sum(), dE / dE.sum()
    order = np.argsort(-(s_rel + s_abs), kind="stable")
    held = np.minimum(np.cumsum(s_rel[order]), np.cumsum(s_abs[order]))
    k = int(np.searchsorted(held, CONFINED - 1e-12)) + 1
    k = min(k, len(order))
    return k, np.sort(order[:k]), float(held[k - 1])


def _head_confinement(t: _Tap) -> Finding | None:
    if t.d.ndim != 3 or t.d.shape[1] < CONFINE_HEADS or len(t.d) < CONFINE_ROWS:
        return None   # (per-head rows are [N, H, D])
    d, r = t.d, t.r
    H = d.shape[1]
    dE, rE = (d * d).sum((0, 2)), (r * r).sum((0, 2))
    if not dE.any() or not rE.any():
        return None
    k, heads, share = _confined(dE, rE)
    if k > H // 2:
        return None
    size = math.sqrt(dE[heads].sum() / rE[heads].sum()) if rE[heads].sum() else math.inf
    return Finding("head_confinement", share, size,
                   dict(share=share, heads=[int(h) for h in heads], of=int(H)))


def _half_confinement(t: _Tap) -> Finding | None:
    if t.d.ndim != 3 or t.d.shape[2] < 4 or t.d.shape[2] % 2 or len(t.d) < CONFINE_ROWS:
        return None
    d, r = t.d, t.r
    D = d.shape[2]
    dE, rE = (d * d).sum((0, 1)), (r * r).sum((0, 1))
    if not dE.any() or not rE.any():
        return None
    best = None
    for names, part in ((("first half", "second half"), np.arange(D) < D // 2),
                        (("even dims", "odd dims"), np.arange(D) % 2 == 0)):
        halves = [part, ~part]
        two = lambda e: np.array([e[h].sum() for h in halves])  # noqa: E731
        k, side, share = _confined(two(dE), two(rE))
        if k == 1 and (best is None or share > best[0]):
            best = (share, names[int(side[0])], halves[int(side[0])])
    if best is None or best[0] < CONFINED:
        return None
    share, label, half = best
    return Finding("half_confinement", share, rel_l2(t.c[..., half], r[..., half]),
                   dict(share=share, half=label, head_dim=int(D)))


# --- permutation ------------------------------------------------------------------------

def _match_columns(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """perm[j] = k where cand column j is ref column k (cos > PERM_COS), j itself when it
    still matches itself, -1 when it matches nothing."""
    if len(X) > PERM_MAX_SAMPLES:   # a deterministic spread of rows is plenty for cos > 0.999
        rows = np.linspace(0, len(X) - 1, PERM_MAX_SAMPLES).astype(int)
        X, Y = X[rows], Y[rows]
    nx, ny = np.linalg.norm(X, axis=0), np.linalg.norm(Y, axis=0)
    Xn, Yn = X / np.where(nx > 0, nx, 1), Y / np.where(ny > 0, ny, 1)
    cos = Xn.T @ Yn                                   # [D, D]
    self_cos = np.where((nx == 0) & (ny == 0), 1.0, np.diagonal(cos))
    best = cos.argmax(axis=1)
    perm = np.where(cos[np.arange(len(best)), best] > PERM_COS, best, -1)
    return np.where(self_cos > PERM_COS, np.arange(len(perm)), perm)


# Named permutations, in the order they are tried; the two RoPE layout conversions are
# what a q/k weight permutation on conversion gives.
ROPE_PERMUTATIONS = ("to_interleaved", "to_half_split")


def _named_perm(perm: np.ndarray) -> str | None:
    D = len(perm)
    i = np.arange(D)
    named = {"reversed": i[::-1]}
    if D % 2 == 0:
        h = D // 2
        to_interleaved = np.empty(D, int)
        to_interleaved[0::2], to_interleaved[1::2] = i[:h], i[h:]
        named.update({"to_interleaved": to_interleaved, "to_half_split": np.argsort(to_interleaved),
                      "swap_halves": (i + h) % D, "swap_pairs": i ^ 1})
    for name, p in named.items():
        if np.array_equal(perm, p):
            return name
    return None


def _perm_pattern(perm: np.ndarray) -> tuple[str | None, int | None]:
    """(named pattern, block size): on the whole axis (block None) or repeated in equal
    blocks (heads); (None, None) when it has no name."""
    D = len(perm)
    name = _named_perm(perm)
    if name:
        return name, None
    for b in range(2, D // 2 + 1):
        if D % b:
            continue
        blocks = perm.reshape(-1, b) - np.arange(0, D, b)[:, None]
        if (blocks == blocks[0]).all() and _named_perm(blocks[0]):
            return _named_perm(blocks[0]), b
    return None, None


def _perm_on(X: np.ndarray, Y: np.ndarray, what: str) -> Finding | None:
    """X, Y: [samples, columns]; is X ≈ Y[:, perm] for a non-identity perm?"""
    if X.shape[1] < 2 or X.shape[1] > PERM_MAX_COLS:
        return None
    perm = _match_columns(X, Y)
    ident = np.arange(len(perm))
    moved = (perm >= 0) & (perm != ident)
    matched = perm[perm >= 0]
    if not moved.any() or len(np.unique(matched)) != len(matched):
        return None
    full = np.where(perm >= 0, perm, ident)
    dd = float(((X - Y) ** 2).sum())
    explained = 1 - float(((X - Y[:, full]) ** 2).sum()) / dd
    if explained < EXPLAINED:
        return None
    pattern, block = _perm_pattern(full)
    return Finding("permutation", explained, rel_l2(X, Y),
                   dict(axis=what, perm=[int(k) for k in full], explained=explained, moved=int(moved.sum()),
                        pattern=pattern, block=block, rope_layout=pattern in ROPE_PERMUTATIONS))


def _permutation(t: _Tap) -> Finding | None:
    d, r = t.flat(t.d), t.flat(t.r)
    rr = float((r * r).sum())
    if not rr or float((d * d).sum()) < (PERM_MIN_ERR ** 2) * rr:
        return None
    last = t.c.shape[-1]
    found = [_perm_on(t.c.reshape(-1, last), t.r.reshape(-1, last),
                      "head_dim" if t.c.ndim == 3 else "features")]
    if t.c.ndim == 3:   # per-head rows [N, H, D]: also try moving whole heads
        H = t.c.shape[1]
        heads = lambda x: np.moveaxis(x, 1, 0).reshape(H, -1).T  # noqa: E731 [samples, H]
        found.append(_perm_on(heads(t.c), heads(t.r), "heads"))
    found = [f for f in found if f]
    return max(found, key=lambda f: f.score) if found else None


def head_permutation(cand, ref, mask=None) -> tuple[np.ndarray, str | None] | None:
    """At a per-head tap ([B, T, H, D]: q, k, q_rope, k_rope): the one permutation of the
    head_dim features, the same in every head, with cand[..., j] ≈ ref[..., perm[j]], found by
    matching columns (cos > PERM_COS over every row and head, explaining EXPLAINED of the
    difference: _perm_on), and its name (to_interleaved: half-split pairs (i, i + D/2) written
    as interleaved ones (2i, 2i + 1), as a q/k weight permutation for interleaved RoPE makes);
    None when no such permutation exists. Whether cand with its features put back is within
    rounding of ref is the caller's to judge (verdicts._convention)."""
    c, r = as64(cand), as64(ref)
    if c.ndim != 4 or c.shape != r.shape:
        return None
    m = np.ones(c.shape[:2], bool) if mask is None else np.asarray(mask, bool)
    D = c.shape[-1]
    X, Y = c[m].reshape(-1, D), r[m].reshape(-1, D)
    rr = float((Y * Y).sum())
    if not rr or not np.isfinite(X).all() or float(((X - Y) ** 2).sum()) < PERM_MIN_ERR ** 2 * rr:
        return None
    found = _perm_on(X, Y, "head_dim")
    if found is None:
        return None
    perm = np.asarray(found.data["perm"])
    if not np.array_equal(np.sort(perm), np.arange(D)):
        return None     # two columns matched to one: not a permutation
    return perm, found.data["pattern"]


# --- sign bias --------------------------------------------------------------------------

def _sign_bias(t: _Tap) -> Finding | None:
    # Only the sign of d itself. A "magnitudes shrink/grow" variant (|cand| vs |ref|,
    # which would catch truncation) was tried and dropped: second-order effects of
    # legitimate rounding trip it (noise on attention scores sharpens the softmax on
    # average, so bf16 scores make |attn_ctx| grow in 60-80% of the elements).
    d = t.flat(t.d)
    if len(d) < SIGN_ROWS:
        return None
    pos, neg = (d > 0).sum(1), (d < 0).sum(1)
    n = int((pos + neg).sum())
    if n == 0:
        return None
    z = float((pos - neg).sum()) / math.sqrt(n)   # binomial z, elements independent
    rows = (pos - neg)[(pos + neg) > 0].astype(float)
    sd = rows.std(ddof=1) if len(rows) > 1 else 0.0
    tstat = abs(rows.mean()) * math.sqrt(len(rows)) / sd if sd else math.inf  # rows independent
    effect = float((pos - neg).sum()) / n         # 2p - 1
    if abs(z) <= SIGN_Z or tstat <= SIGN_Z or abs(effect) < SIGN_EFFECT:
        return None
    return Finding("sign_bias", abs(effect), _rel(t), dict(effect=effect, z=z, t=float(tstat)))


# --- public API ---------------------------------------------------------------------------

def per_row_scale(cand, ref, mask=None) -> Finding | None:
    t = _tap(cand, ref, mask)
    return _per_row_scale(t, _scale_fits(t))


def global_scale(cand, ref, mask=None) -> Finding | None:
    t = _tap(cand, ref, mask)
    return _global_scale(t, _scale_fits(t))


def per_feature_scale(cand, ref, mask=None) -> Finding | None:
    t = _tap(cand, ref, mask)
    return _per_feature_scale(t, _scale_fits(t))


def error_position_trend(cand, ref, mask=None) -> Finding | None:
    """Does the relative error of cand grow (or shrink) steadily with position?"""
    return _position_trend(_tap(cand, ref, mask))


def head_confinement(cand, ref, mask=None) -> Finding | None:
    return _head_confinement(_tap(cand, ref, mask))


def half_confinement(cand, ref, mask=None) -> Finding | None:
    return _half_confinement(_tap(cand, ref, mask))


def permutation(cand, ref, mask=None) -> Finding | None:
    return _permutation(_tap(cand, ref, mask))


def offset(cand, ref, mask=None) -> Finding | None:
    return _offset(_tap(cand, ref, mask))


def sign_bias(cand, ref, mask=None) -> Finding | None:
    return _sign_bias(_tap(cand, ref, mask))


# --- RoPE: which pairs are rotated, and at which frequencies ----------------------------

def _rope_pairs(D: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(D // 2)
    return (i, i + D // 2) if layout == "half-split" else (2 * i, 2 * i + 1)


def _rotates(out: np.ndarray, pre: np.ndarray, layout: str) -> bool:
    """Does out keep the norm of every pair of pre (out is pre rotated pairwise)?"""
    a, b = _rope_pairs(out.shape[-1], layout)
    n_out, n_pre = np.hypot(out[..., a], out[..., b]), np.hypot(pre[..., a], pre[..., b])
    den = float(np.linalg.norm(n_pre))
    return den > 0 and float(np.linalg.norm(n_out - n_pre)) <= ROPE_NORM_TOL * den


def _pair_angles(out: np.ndarray, pre: np.ndarray, layout: str) -> np.ndarray:
    """Angle of the rotation taking each pair of pre to the same pair of out: [..., D/2]."""
    a, b = _rope_pairs(out.shape[-1], layout)
    cross = pre[..., a] * out[..., b] - pre[..., b] * out[..., a]
    dot = pre[..., a] * out[..., a] + pre[..., b] * out[..., b]
    return np.arctan2(cross, dot)


def _frequencies(out, pre, pos, layout) -> np.ndarray | None:
    """Per-pair angle per position, read at position 1 (median over rows and heads)."""
    at1 = pos == 1
    if not at1.any():
        return None
    ang = _pair_angles(out[at1], pre[at1], layout)          # [n, H, D/2]
    return np.median(ang.reshape(-1, ang.shape[-1]), axis=0)


def _angle_resolution(out: np.ndarray) -> float:
    """The unit roundoff of the values a side's rotated pairs are carried in: float32's where every
    value is a float32 number, else 0 (float64's, negligible against ROPE_FREQ_TOL)."""
    return 2.0 ** -24 if np.array_equal(out.astype(np.float32).astype(np.float64), out) else 0.0


def _wrap(x):
    """Angles to [-pi, pi)."""
    return (x + np.pi) % (2 * np.pi) - np.pi


def _position_shifts(dphi, rows, fr) -> dict[int, int] | None:
    """{row: delta} when the candidate rotates every real token of every row at its position +
    delta (one whole number per row, some not 0) and the reference at its own; else None.
    dphi: the wrapped angle differences [N, H, D/2] of the real tokens, rows: each one's row."""
    d = np.median(dphi, axis=1)     # [N, D/2]
    if fr[-1] <= 0 or not np.isfinite(d).all():
        return None
    read = d[:, -1] / fr[-1]
    delta = np.rint(read)
    if not delta.any():
        return None
    pred = _wrap(delta[:, None] * fr[None, :])
    typical = max(float(np.median(np.abs(pred[delta != 0]))), 1e-300)
    if float(np.max(np.abs(_wrap(d - pred)))) > ROPE_LINEAR_TOL * typical:
        return None
    shifts = {}
    for row in np.unique(rows):
        own = delta[rows == row]
        if not np.all(own == own[0]):
            return None
        shifts[int(row)] = int(own[0])
    return shifts


def _implied_theta(freq: np.ndarray) -> float:
    """theta of the default schedule omega_k = theta^(-2k/D) that fits these best."""
    D = 2 * len(freq)
    k = np.arange(1, len(freq))
    ok = freq[1:] > 0
    if not ok.any():
        return float("nan")
    return float(np.exp(np.median(-np.log(freq[1:][ok]) * D / (2 * k[ok]))))


# Frequencies that differ by their rounding: each pair's relative deviation at most this (4
# bf16 unit roundoffs, the widest dtype the noise test knows at NOISE_BAND's top) and of both
# signs (|mean| <= ROPE_ROUNDED_BIAS x RMS). A theta or scaling change moves every pair the
# same way, by a growing factor; a rounded angle (position x frequency in bf16) moves each
# its own way, by a rounding.
ROPE_ROUNDED_MAX = 4 * 2.0 ** -8
ROPE_ROUNDED_BIAS = 0.25


def _rounded_frequencies(ratio: np.ndarray) -> bool:
    dev = np.asarray(ratio[1:], np.float64) - 1.0      # pair 0 turns at 1 rad per position in any schedule
    if not len(dev) or not dev.any():
        return False
    rms = float(np.sqrt(np.mean(dev * dev)))
    return float(np.abs(dev).max()) <= ROPE_ROUNDED_MAX and abs(float(dev.mean())) <= ROPE_ROUNDED_BIAS * rms


def rope_finding(cand, ref, cand_pre, ref_pre, mask=None) -> Finding | None:
    """At a q_rope / k_rope tap ([B, T, H, D]) with both sides' pre-RoPE input: which pair
    layout does each side rotate, and at which frequencies? Names RoPE layout (interleaved
    vs half-split) and theta / scaling differences directly."""
    c, r, cp, rp = (as64(x) for x in (cand, ref, cand_pre, ref_pre))
    if c.ndim != 4 or c.shape[-1] % 2 or c.shape != cp.shape:
        return None
    m = np.ones(c.shape[:2], bool) if mask is None else np.asarray(mask, bool)
    pos, rows = positions_from_mask(m)[m], np.nonzero(m)[0]
    c, r, cp, rp = c[m], r[m], cp[m], rp[m]
    if not np.all(np.isfinite(c)) or not np.all(np.isfinite(r)):
        return None
    size = rel_l2(c, r)
    partial = _partial_rotary(c, cp, r, rp, pos, size)
    if partial is not None:
        return partial
    layouts = ("half-split", "interleaved")
    c_lay = [lay for lay in layouts if _rotates(c, cp, lay)]
    r_lay = [lay for lay in layouts if _rotates(r, rp, lay)]
    if not c_lay or not r_lay:
        return None
    if c_lay[0] != r_lay[0] and len(c_lay) == 1 and len(r_lay) == 1:
        return Finding("rope_layout", 1.0, size, dict(cand=c_lay[0], ref=r_lay[0]))
    lay = r_lay[0] if r_lay[0] in c_lay else c_lay[0]
    fc, fr = _frequencies(c, cp, pos, lay), _frequencies(r, rp, pos, lay)
    if fc is None or fr is None:
        return None
    dphi = _wrap(_pair_angles(c, cp, lay) - _pair_angles(r, rp, lay))     # read once: the shift and the linear test
    shifts = _position_shifts(dphi, rows, fr)
    if shifts is not None:
        return Finding("rope_position", 1.0, size, dict(layout=lay, shifts=shifts))
    ratio = fc / np.where(fr != 0, fr, 1.0)
    resolution = ROPE_ANGLE_READS * max(_angle_resolution(c), _angle_resolution(r))
    if np.all(np.abs(fc - fr) <= ROPE_FREQ_TOL * np.maximum(np.abs(fr), 1e-300) + resolution):
        return None
    if _rounded_frequencies(ratio):
        return None     # the frequencies rounded, not another schedule (verdicts.rope_angle_noise)
    # The angle difference should then grow linearly with position: phi_c - phi_r = p * d_omega.
    pred = pos[:, None, None] * (fc - fr)
    typical = max(float(np.median(np.abs(_wrap(pred)))), 1e-300)
    linear = float(np.median(np.abs(_wrap(dphi - pred)))) <= ROPE_LINEAR_TOL * typical
    tc, tr = _implied_theta(fc), _implied_theta(fr)
    const = bool(np.allclose(ratio, ratio[0], rtol=ROPE_CONST_RATIO))
    # One theta for the other: log ratio_k = -(2k/D) log(theta_c/theta_r), a line through 0 in k
    # (to ROPE_CONST_RATIO); a schedule that keeps some bands and scales others (llama3) is not.
    k = np.arange(len(ratio), dtype=np.float64)
    logr = np.log(np.where(ratio > 0, ratio, np.nan))
    slope = float(np.nansum(k * logr) / np.sum(k * k)) if len(k) > 1 else 0.0
    one_theta = bool(np.all(np.isfinite(logr))) and float(np.max(np.abs(logr - slope * k))) <= ROPE_CONST_RATIO
    return Finding("rope_frequency", 1.0, size,
                   dict(layout=lay, ratio_min=float(ratio.min()), ratio_max=float(ratio.max()), linear=linear,
                        constant_ratio=const, ratio_first=float(ratio[0]), ratio_last=float(ratio[-1]),
                        one_theta=one_theta, theta_cand=tc, theta_ref=tr))


# --- RMSNorm epsilon ------------------------------------------------------------------------

def norm_epsilon(cand, ref, norm_input, mask=None) -> Finding | None:
    """At a norm tap with the norm's input x: is cand/ref a per-row factor that one epsilon
    difference explains, k^2 = (ms + eps_r) / (ms + eps_c)?"""
    c, r, x = as64(cand), as64(ref), as64(norm_input)
    m = np.ones(c.shape[:2], bool) if mask is None else np.asarray(mask, bool)
    c, r, x = c[m], r[m], x[m]
    if len(c) < MIN_VALUES or not (np.isfinite(c).all() and np.isfinite(r).all()):
        return None
    rr = (r * r).sum(-1)
    ok = rr > 0
    k = np.where(ok, (c * r).sum(-1) / np.where(ok, rr, 1), 1.0)
    d = c - r
    dd = float((d * d).sum())
    if not dd:
        return None
    explained = 1 - float(((c - k[:, None] * r) ** 2).sum()) / dd
    ms = (x * x).mean(-1)
    est = (ms * (1 / k ** 2 - 1))[ok]
    mid = float(np.median(est))
    spread = float(np.median(np.abs(est - mid))) / abs(mid) if mid else math.inf
    if explained < EPS_EXPLAINED or spread > EPS_SPREAD:
        return None
    return Finding("norm_epsilon", explained, rel_l2(c, r),
                   dict(eps_diff=mid, spread=spread, explained=explained))


def norm_weight_offset(cand, ref, norm_input, mask=None) -> Finding | None:
    """At a norm tap: is cand - ref the normalised input itself times one constant a? Then
    the weight is applied with an offset: (1 + w) instead of w is a = 1 (Gemma's
    convention on a Llama checkpoint), w instead of (1 + w) a = -1."""
    c, r, x = as64(cand), as64(ref), as64(norm_input)
    m = np.ones(c.shape[:2], bool) if mask is None else np.asarray(mask, bool)
    d, x = (c - r)[m], x[m]
    if len(d) < MIN_VALUES or not np.isfinite(d).all():
        return None
    xhat = x / np.sqrt(np.maximum((x * x).mean(-1, keepdims=True), 1e-300))
    xx = float((xhat * xhat).sum())
    dd = float((d * d).sum())
    if not xx or not dd:
        return None
    a = float((d * xhat).sum()) / xx
    explained = 1 - float(((d - a * xhat) ** 2).sum()) / dd
    if explained < EPS_EXPLAINED:
        return None
    named = "one_plus_w" if abs(a - 1) < OFFSET_NAMED else "w" if abs(a + 1) < OFFSET_NAMED else None
    return Finding("norm_weight_offset", explained, rel_l2(c[m], r[m]),
                   dict(a=a, explained=explained, convention=named))


# --- causal edge ------------------------------------------------------------------------

def causal_edge(cand, ref, mask=None) -> Finding | None:
    """Every position differs except the last real one of each sequence: the queries see
    one token ahead (a causal mask off by one leaks the next token)."""
    c, r = as64(cand), as64(ref)
    if c.ndim < 3:
        return None
    m = np.ones(c.shape[:2], bool) if mask is None else np.asarray(mask, bool)
    d = (c - r).reshape(c.shape[0], c.shape[1], -1)
    rr = (r.reshape(d.shape) ** 2).sum(-1)
    err = np.sqrt((d * d).sum(-1) / np.maximum(rr, 1e-300))
    last, others = [], []
    for b in range(len(m)):
        real = np.flatnonzero(m[b])
        if len(real) < EDGE_MIN_POSITIONS:
            continue
        last.append(err[b, real[-1]])
        others.append(err[b, real[:-1]])
    if not last:
        return None
    others = np.concatenate(others)
    typical = float(np.median(others))
    differ = float((others > EDGE_RATIO * typical).mean())
    if not typical > 0 or max(last) > EDGE_RATIO * typical or differ < EDGE_OTHERS:
        return None
    return Finding("causal_edge", 1.0, rel_l2(c.reshape(d.shape)[m], r.reshape(d.shape)[m]),
                   dict(last_max=float(max(last)), typical=typical))


def _nonfinite(c: np.ndarray, r: np.ndarray) -> Finding | None:
    bad_c, bad_r = int((~np.isfinite(c)).sum()), int((~np.isfinite(r)).sum())
    if not (bad_c or bad_r):
        return None
    return Finding("nonfinite", 1.0, math.inf, dict(cand=bad_c, ref=bad_r))


def analyse(cand, ref, mask=None, per_head=False, floor: float = 0.0, pre=None,
            norm_input=None, inputs=None) -> list[Finding]:
    """All findings for one tap, best first; [] means noise-like.

    per_head=True: the tap is [B, T, H, D]; an int H reshapes a [B, T, H*D] tap (attn_ctx)
    to heads first. NaN/Inf is reported alone: structure is meaningless around it.
    floor: drop findings whose `size` is below it. Rounding can have structure too (RoPE
    angles rounded in f32 grow with position; a softmax rounded in f32 concentrates in
    the flat-attention heads), so where one side keeps f32 steps inside an f64 run, a
    floor of a few hundred f32 unit roundoffs separates those from math differences.
    pre=(cand_pre, ref_pre): at a q_rope / k_rope tap, both sides' q / k before RoPE, so
    rope_finding can say which pairs each side rotates and at which frequencies.
    norm_input: at a norm tap, the norm's input (so norm_epsilon can test an epsilon); at a q/k
    norm, [B, T, H, D] for one over head_dim, [B, T, H x D] for one over the projection.
    inputs: {name: (cand's, ref's)} of the step that made the tap (tap_inputs): the
    activation, transposed-projection, residual and swapped-projection tests.
    """
    c, r = as64(cand), as64(ref)
    if per_head and not isinstance(per_head, bool) and c.ndim == 3:
        H = int(per_head)
        c, r = (x.reshape(x.shape[:2] + (H, x.shape[2] // H)) for x in (c, r))
    elif per_head and c.ndim != 4:
        raise ValueError(f"per_head=True needs a [B, T, H, D] tap, got shape {c.shape}")
    t = _tap(c, r, mask)
    bad = _nonfinite(t.c, t.r)
    if bad or not t.d.any():
        return [bad] if bad else []
    fits = _scale_fits(t)
    rows = _norm_rows(c, r, norm_input, mask) if norm_input is not None else None
    found = [f for f in (rope_finding(c, r, *pre, mask) if pre is not None else None,
                         norm_epsilon(*rows) if rows is not None else None,
                         norm_weight_offset(*rows) if rows is not None else None,
                         causal_edge(c, r, mask),
                         _permutation(t), _global_scale(t, fits), _per_row_scale(t, fits),
                         _per_feature_scale(t, fits), _offset(t), _position_trend(t),
                         _head_confinement(t) if per_head else None,
                         _half_confinement(t) if per_head else None) if f]
    found = _input_findings(c, r, mask, inputs or {}) + found
    if not any(f.kind in _MODELS for f in found):
        found += [f for f in (_sign_bias(t),) if f]
    found = [f for f in found if not f.size < floor]
    return sorted(found, key=lambda f: (-round(f.score, 3), PRIORITY.index(f.kind)))


def _norm_rows(c, r, x, mask) -> tuple:
    """(c, r, x, mask) as the norm tests read them, one row per normalised vector: a per-head
    norm's tap and input ([B, T, H, D]: q_norm over head_dim) as [B, T x H, D]; a per-head tap
    whose norm ran over the whole projection (OLMo 2's q_norm: input [B, T, H x D]) in its
    input's shape; any other tap as it is."""
    x = as64(x)
    if x.shape != c.shape and x.size == c.size:
        return c.reshape(x.shape), r.reshape(x.shape), x, mask
    if c.ndim == 4 and x.shape == c.shape:
        B, T, H, D = c.shape
        m = None if mask is None else np.repeat(np.asarray(mask, bool), H, axis=1)
        return c.reshape(B, T * H, D), r.reshape(B, T * H, D), x.reshape(B, T * H, D), m
    return c, r, x, mask


def hint(findings: list[Finding]) -> str:
    """compare.explain.findings.hint, for callers that still import it from here."""
    return explain_findings.hint(findings)


# --- structure named from the step's own inputs ------------------------------------------
# Each test below asks whether the candidate computes, exactly, a known wrong variant of the
# step from its own inputs (tap_inputs: each side's taps that feed this one). "Exactly" is
# at fp64-rung rounding: a side that keeps f32 steps lands ~1e-7 from its own variant, and
# every listed variant sits >= 1e-4 from the others on real inputs, so a match to ATOL_VARIANT
# cannot happen by rounding, and the reference's own step must not match the same variant.
ATOL_VARIANT = 1e-6
# The closest pair of activations below, GELU exact vs tanh, differs by 2e-4 rel L2 on
# standard-normal inputs (200x ATOL_VARIANT); on tiny inputs they agree to O(x^4) and both
# match: then both are named.
ACTIVATIONS = {
    "silu": lambda x: x / (1 + np.exp(-x)),
    "gelu": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x)),
    "relu": lambda x: np.maximum(x, 0.0),
}
# A transposed square projection: with y = x A (reference) and y' = x A^T, the [N, N] Gram
# products satisfy y' x^T = (y x^T)^T whatever A is, so no weight is needed. A correct
# candidate gives y' x^T = y x^T instead, which differs from its transpose by O(1) unless A
# is symmetric (then transposing changes nothing). At most TRANSPOSE_ROWS rows (a
# deterministic spread) keep the products small; the identity holds for any subset.
TRANSPOSE_ROWS = 512
# Residual: cand = alpha x residual + beta x branch, fitted by least squares; it names
# (alpha, beta) != (1, 1) when the fit leaves <= ATOL_VARIANT of the tap (rounding of the
# add is 1e-16, f32 steps 1e-7) and a coefficient moved by > RESIDUAL_MOVED (noise moves
# them by ~1e-7). A pair of inputs whose Gram matrix has condition > 1e8 tells nothing.
RESIDUAL_MOVED = 1e-3
RESIDUAL_COND = 1e8
# Partial rotary (at q_rope / k_rope): a dim one side leaves exactly as it was (relative
# change <= ROPE_IDENTITY: an identity moves nothing, while a rotation at position >= 1 by
# omega >= 1e-7, theta up to 1e7, moves a dim by ~omega) where the other side rotates it
# visibly (> ROPE_ROTATED: 100 f32 table roundings). No theta or scaling difference brings a
# rotated dim to an exact identity.
ROPE_IDENTITY = 1e-9
ROPE_ROTATED = 1e-5


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[float])(x)


def _flat_rows(x, mask) -> np.ndarray:
    x = as64(x)
    m = np.ones(x.shape[:2], bool) if mask is None else np.asarray(mask, bool)
    return x[m].reshape(int(m.sum()), -1)


def _matching_variants(out: np.ndarray, variants: dict) -> list[str]:
    return [name for name, pred in variants.items() if rel_l2(out, pred) <= ATOL_VARIANT]


def activation_fit(cand, ref, gate, up, mask=None) -> Finding | None:
    """At the act tap (act = f(gate) * up) with each side's gate and up: which activation
    f does each side apply? A finding when the candidate's is another one."""
    c, r = _flat_rows(cand, mask), _flat_rows(ref, mask)
    (gc, gr), (uc, ur) = ((_flat_rows(a, mask), _flat_rows(b, mask)) for a, b in (gate, up))
    if c.shape != gc.shape or c.shape != uc.shape or not np.isfinite(c).all():
        return None
    mine = _matching_variants(c, {n: f(gc) * uc for n, f in ACTIVATIONS.items()})
    theirs = _matching_variants(r, {n: f(gr) * ur for n, f in ACTIVATIONS.items()})
    if not mine or set(mine) & set(theirs):
        return None
    return Finding("activation", 1.0, rel_l2(c, r), dict(cand=mine, ref=theirs))


def transposed_projection(cand, ref, x_cand, x_ref, mask=None) -> Finding | None:
    """At a square projection's output (q from attn_norm, attn_out from attn_ctx) with each
    side's input: is the candidate's weight the transpose of the reference's?"""
    yc, yr, xc, xr = (_flat_rows(a, mask) for a in (cand, ref, x_cand, x_ref))
    if not (yc.shape == yr.shape == xc.shape == xr.shape) or not np.isfinite(yc).all():
        return None
    if len(yc) > TRANSPOSE_ROWS:
        rows = np.linspace(0, len(yc) - 1, TRANSPOSE_ROWS).astype(int)
        yc, yr, xc, xr = yc[rows], yr[rows], xc[rows], xr[rows]
    p_ref, p_cand = yr @ xr.T, yc @ xc.T
    as_transposed, as_is = rel_l2(p_cand, p_ref.T), rel_l2(p_cand, p_ref)
    if not as_transposed <= ATOL_VARIANT or as_is <= ATOL_VARIANT:
        return None
    return Finding("transposed_projection", 1.0, rel_l2(yc, yr),
                   dict(rel_l2=as_transposed, as_is=as_is, width=int(yc.shape[1])))


def _residual_coefficients(out, res, branch) -> tuple[float, float, float] | None:
    """(alpha, beta, rel L2 of the rest) of out ≈ alpha res + beta branch."""
    a = np.stack([res.ravel(), branch.ravel()], 1)
    gram = a.T @ a
    if not np.isfinite(gram).all() or np.linalg.cond(gram) > RESIDUAL_COND:
        return None
    alpha, beta = np.linalg.solve(gram, a.T @ out.ravel())
    return float(alpha), float(beta), rel_l2(out.ravel(), a @ np.array([alpha, beta]))


def residual_fit(cand, ref, residual, branch, mask=None) -> Finding | None:
    """At resid_mid (layer input + attn_out) or out (resid_mid + mlp_out) with each side's
    residual and branch: is the residual or the branch missing, doubled or scaled?"""
    c, r = _flat_rows(cand, mask), _flat_rows(ref, mask)
    (xc, xr), (bc, br) = ((_flat_rows(a, mask), _flat_rows(b, mask)) for a, b in (residual, branch))
    if not (c.shape == xc.shape == bc.shape) or not np.isfinite(c).all():
        return None
    mine, theirs = _residual_coefficients(c, xc, bc), _residual_coefficients(r, xr, br)
    if mine is None or theirs is None or mine[2] > ATOL_VARIANT or theirs[2] > ATOL_VARIANT:
        return None
    if max(abs(mine[0] - theirs[0]), abs(mine[1] - theirs[1])) <= RESIDUAL_MOVED:
        return None
    return Finding("residual", 1.0, rel_l2(c, r),
                   dict(cand=[mine[0], mine[1]], ref=[theirs[0], theirs[1]],
                        residual=_how(mine[0], theirs[0]), branch=_how(mine[1], theirs[1])))


def _how(coefficient: float, reference: float) -> str:
    """A coefficient against the reference's (1 in a Llama): kept, missing, doubled, scaled."""
    for name, value in (("kept", reference), ("missing", 0.0), ("doubled", 2 * reference)):
        if abs(coefficient - value) <= RESIDUAL_MOVED:
            return name
    return "scaled"


def swapped_projection(cand, ref, other_ref, mask=None, other="k") -> Finding | None:
    """At q (or k) with the reference's other projection of the same shape (MHA): is the
    candidate's q the reference's k (q_proj and k_proj swapped)?"""
    c, r, o = (_flat_rows(a, mask) for a in (cand, ref, other_ref))
    if not (c.shape == r.shape == o.shape) or not np.isfinite(c).all():
        return None
    if not rel_l2(c, o) <= ATOL_VARIANT or rel_l2(r, o) <= ATOL_VARIANT:
        return None
    return Finding("swapped_projection", 1.0, rel_l2(c, r), dict(other=other))


def _rotation_per_dim(out: np.ndarray, pre: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Relative change of each head dim between pre and out over rows at position >= 1."""
    moved = pos > 0
    o, p = out[moved].reshape(-1, out.shape[-1]), pre[moved].reshape(-1, pre.shape[-1])
    den = np.sqrt((p * p).sum(0))
    return np.sqrt(((o - p) ** 2).sum(0)) / np.where(den > 0, den, np.inf)


def _partial_rotary(c, cp, r, rp, pos, size) -> Finding | None:
    """Dims one side leaves exactly as they were while the other rotates them."""
    if not (pos > 0).any():
        return None
    ch_c, ch_r = _rotation_per_dim(c, cp, pos), _rotation_per_dim(r, rp, pos)
    lost = (ch_c <= ROPE_IDENTITY) & (ch_r > ROPE_ROTATED)
    gained = (ch_r <= ROPE_IDENTITY) & (ch_c > ROPE_ROTATED)
    if not (lost.any() or gained.any()):
        return None
    still = lambda ch: [int(j) for j in np.flatnonzero(ch <= ROPE_IDENTITY)]  # noqa: E731
    return Finding("partial_rotary", 1.0, size,
                   dict(cand_identity=still(ch_c), ref_identity=still(ch_r), head_dim=int(c.shape[-1])))


def tap_inputs(tap: str, cand_taps, ref_taps) -> dict:
    """{name: (cand's, ref's)} of the taps feeding `tap` that analyse(inputs=...) tests
    against: gate/up at act, the projection input at q and attn_out, residual/branch at
    resid_mid and out, the other projection at q / k. Taps either side lacks are left out."""
    t = tapnames.tap(tap)
    if t.layer is None:
        return {}
    p = f"layers.{t.layer}."
    before = "embed" if t.layer == 0 else f"layers.{t.layer - 1}.out"
    wanted = {"act": {"gate": p + "gate", "up": p + "up"},
              "q": {"x": p + "attn_norm", "other_k": p + "k"},
              "k": {"other_q": p + "q"},
              "attn_out": {"x": p + "attn_ctx"},
              "resid_mid": {"residual": before, "branch": p + "attn_out"},
              "out": {"residual": p + "resid_mid", "branch": p + "mlp_out"}}.get(t.kind, {})
    return {name: (cand_taps[src], ref_taps[src]) for name, src in wanted.items()
            if src in cand_taps and src in ref_taps}


def _input_findings(c, r, mask, inputs: dict) -> list[Finding]:
    """The tests above that `inputs` (tap_inputs) makes possible."""
    found = []
    if "gate" in inputs and "up" in inputs:
        found.append(activation_fit(c, r, inputs["gate"], inputs["up"], mask))
    if "x" in inputs:
        found.append(transposed_projection(c, r, *inputs["x"], mask))
    if "residual" in inputs and "branch" in inputs:
        found.append(residual_fit(c, r, inputs["residual"], inputs["branch"], mask))
    for other in ("q", "k"):
        if f"other_{other}" in inputs:
            found.append(swapped_projection(c, r, inputs[f"other_{other}"][1], mask, other))
    return [f for f in found if f is not None]
