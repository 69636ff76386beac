"""Explain an attention difference by a known alternative convention.

At layers.{i}.attn_ctx the engine holds the oracle's inputs to attention (q_rope, k_rope,
v, all fp64). Recomputing attention from them under the conventions implementations
actually get wrong (no 1/sqrt(head_dim) scale or another one, kv head h % Hkv instead of
h // G, a causal mask off by one either way, no causal mask; for the family's features a
soft-cap missing or another, a sliding window off by one, missing or on a global layer) and
finding the one the candidate matches turns "attention differs" into "attention scale missing".
The reference's own conventions are the layer's as its config says (compare.judge.family.
step_features: scale, soft-cap, window); every alternative changes one of them.

A match must be close in absolute terms (ATOL_MATCH: the candidate computes the same
thing, up to f32 steps kept inside an fp64 run) and explain the difference (its distance
at most MATCH_SHARE of the distance to the reference's conventions).
"""

from __future__ import annotations

import math

import numpy as np

from llamaspec import positions_from_mask

from ..metrics import as64, rel_l2
from .structure import Finding

ATOL_MATCH = 1e-4      # rel L2 to the alternative; an f32 softmax/RoPE in fp64 gives ~1e-7
MATCH_SHARE = 0.01


def attention64(q, k, v, mask=None, scale=None, group="grouped", shift=0, softcap=None, window=None) -> np.ndarray:
    """Causal GQA attention in float64: q [B, T, Hq, D], k, v [B, T, Hkv, D] -> [B, T, Hq*D].

    group "grouped": query head h reads kv head h // G (HF repeat_kv); "tiled": h % Hkv.
    shift: query slot t sees key slots s <= t + shift (0 is causal). A query that sees no
    real key averages all keys uniformly (what a finite "-inf" fill gives). softcap: scores
    -> softcap x tanh(scores / softcap) before the mask (Gemma 2). window: a query sees only
    the last `window` of the keys it may see (itself included; transformers' kv_idx > q_idx -
    window, counted in real keys as torchref.model.sliding_allowed counts them)."""
    q, k, v = as64(q), as64(k), as64(v)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    kv = np.arange(Hq) // G if group == "grouped" else np.arange(Hq) % Hkv
    k, v = k[:, :, kv], v[:, :, kv]
    scale = D ** -0.5 if scale is None else scale
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    m = np.ones((B, T), bool) if mask is None else np.asarray(mask, bool)
    allowed = (np.arange(T)[None, :] <= np.arange(T)[:, None] + shift)[None] & m[:, None, :]
    if window is not None:
        seen = np.cumsum(allowed, -1)
        allowed = allowed & (seen[..., -1:] - seen < window)
    s = np.where(allowed[:, None], s, -1e300)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v).reshape(B, T, Hq * D)


def reference_keywords(conventions: dict | None) -> dict:
    """attention64's keywords for the reference's own conventions (family.step_features at an
    attn_ctx tap: scale, softcap, window); {} (Llama's: 1/sqrt(head_dim), no cap, no window)
    without them."""
    c = conventions or {}
    return {k: c[k] for k in ("scale", "softcap", "window") if c.get(k) is not None}


def _alternatives(D: int, Hq: int, Hkv: int, conventions: dict | None = None):
    """(name, attention64 keywords changed from the reference's); compare.explain.findings says
    each name in words. The family's: the soft-cap left out where the reference caps; the
    window one key wider or narrower, or none, where the reference's layer has one; the
    model's sliding window where the reference's layer is global (a port that windows every
    layer); 1/sqrt(head_dim) where the config scales by another (query_pre_attn_scalar)."""
    c = conventions or {}
    yield "no_scale", dict(scale=1.0)
    yield "scale_1_over_d", dict(scale=1.0 / D)
    if c.get("scale") is not None and not math.isclose(c["scale"], D ** -0.5, rel_tol=1e-12):
        yield "head_dim_scale", dict(scale=D ** -0.5)
    if 1 < Hkv < Hq:
        yield "tiled_gqa", dict(group="tiled")   # query head h reads kv head h % n_kv
    yield "sees_next", dict(shift=1)             # causal mask off by one, either way
    yield "misses_self", dict(shift=-1)
    yield "no_causal_mask", dict(shift=10 ** 9)
    if c.get("softcap") is not None:
        yield "softcap", dict(softcap=None)
    w = c.get("window")
    others = (None, w + 1, w - 1) if w is not None else tuple(c.get("windows", ()))
    for other in others:
        if other is None or other >= 1:
            yield "window", dict(window=other)


# The scale search: a grid over e^-4..e^4 times 1/sqrt(D) (wide enough for 1/D, sqrt(D),
# a forgotten or doubled scale at any head size), then golden-section refinement of the
# best bracket to 1e-8 of its width (0.618^40). The soft-cap search spans the same factors
# around the largest |score|: a cap e^4 = 55x above every score changes each by at most
# (1/55)^2 / 3 ~ 1e-4 of itself (tanh x = x - x^3/3 ...), no more than ATOL_MATCH tells apart,
# and one 55x below it flattens every softmax row.
SCALE_SPAN = 4.0
SCALE_GRID = 33
SCALE_REFINE_STEPS = 40


def fit_positive(err, centre) -> tuple[float, float]:
    """The x = exp(log_x) that brings err(log_x) lowest (log-grid around `centre`, then refined),
    and that error."""
    grid = np.linspace(centre - SCALE_SPAN, centre + SCALE_SPAN, SCALE_GRID)
    errs = [err(g) for g in grid]
    i = int(np.argmin(errs))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    g = 0.5 * (math.sqrt(5) - 1)
    for _ in range(SCALE_REFINE_STEPS):   # golden section on the bracket
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if err(a) < err(b):
            hi = b
        else:
            lo = a
    best = 0.5 * (lo + hi)
    return math.exp(best), err(best)


def _fit_scale(cand, q, k, v, mask, D, ref) -> tuple[float, float]:
    """The softmax scale that brings the candidate closest (the reference's other conventions kept)."""
    kw = {k_: v_ for k_, v_ in ref.items() if k_ != "scale"}
    return fit_positive(lambda log_s: rel_l2(cand, attention64(q, k, v, mask, scale=math.exp(log_s), **kw)),
                        math.log(D ** -0.5))


def _max_score(q, k, mask, ref) -> float:
    """The largest |score| (scale x q.k, before any cap) over the pairs the causal mask allows."""
    q, k = as64(q), as64(k)
    G = q.shape[2] // k.shape[2]
    s = np.abs(np.einsum("bthd,bshd->bhts", q, np.repeat(k, G, axis=2))) * ref.get("scale", q.shape[-1] ** -0.5)
    T = q.shape[1]
    m = np.ones(q.shape[:2], bool) if mask is None else np.asarray(mask, bool)
    allowed = np.tril(np.ones((T, T), bool))[None] & m[:, None, :] & m[:, :, None]
    return float(s[np.broadcast_to(allowed[:, None], s.shape)].max(initial=0.0))


def _fit_softcap(cand, q, k, v, mask, ref) -> tuple[float, float]:
    """The soft-cap that brings the candidate closest (the reference's other conventions kept),
    searched around the largest score: a cap far above every score changes nothing, far below
    it flattens every softmax."""
    kw = {k_: v_ for k_, v_ in ref.items() if k_ != "softcap"}
    top = _max_score(q, k, mask, ref)
    if not top > 0:
        return math.nan, math.inf
    return fit_positive(lambda log_c: rel_l2(cand, attention64(q, k, v, mask, softcap=math.exp(log_c), **kw)),
                        math.log(top))


def _first_departure(cand, own, mask) -> int | None:
    """The first position (real tokens before it) whose attention output differs from the
    reference's conventions' by more than ATOL_MATCH of its size; None where none does. A window
    of w keys where the reference's is wider (or where it has none) leaves positions 0..w-1
    as they were (they see at most w keys either way) and changes position w: the window to try."""
    m = np.ones(cand.shape[:2], bool) if mask is None else np.asarray(mask, bool)
    d = np.sqrt(((cand - own) ** 2).sum(-1))[m]
    size = np.sqrt((own ** 2).sum(-1))[m]
    differ = d > ATOL_MATCH * np.maximum(size, np.finfo(float).tiny)
    return int(positions_from_mask(m)[m][differ].min()) if differ.any() else None


def _found(name, e, base, **data) -> Finding:
    return Finding("attention_convention", 1.0 - e / base, base, dict(convention=name, rel_l2=e, base=base, **data))


def explain_attention(cand, q, k, v, mask=None, conventions: dict | None = None) -> Finding | None:
    """cand: the candidate's attn_ctx (fp64 rung); q, k, v: the oracle's q_rope, k_rope, v;
    conventions: the reference's (family.step_features at the tap: scale, softcap, window,
    windows; None: Llama's). The named alternatives first, then a window read off the first
    position that departs (_first_departure), then a fitted scale, then a fitted soft-cap (a cap
    where the reference has none, or another value)."""
    c = as64(cand)
    B, T, Hq, D = as64(q).shape
    Hkv = as64(k).shape[2]
    ref = reference_keywords(conventions)
    base = rel_l2(c, attention64(q, k, v, mask, **ref))
    if not base > 0 or not math.isfinite(base):
        return None
    ok = lambda e: e <= ATOL_MATCH and e <= MATCH_SHARE * base  # noqa: E731
    theirs = dict(ref_scale=ref.get("scale", D ** -0.5), ref_softcap=ref.get("softcap"), ref_window=ref.get("window"))
    for name, kw in _alternatives(D, Hq, Hkv, conventions):
        e = rel_l2(c, attention64(q, k, v, mask, **{**ref, **kw}))
        if ok(e):
            extra = dict(kw, **theirs, max_score=_max_score(q, k, mask, ref)) if name in ("softcap", "window") else {}
            return _found(name, e, base, **extra)
    window = _first_departure(c, attention64(q, k, v, mask, **ref), mask)
    if window is not None and window >= 1 and window < (ref.get("window") or math.inf):
        e = rel_l2(c, attention64(q, k, v, mask, **{**ref, "window": window}))
        if ok(e):
            return _found("window", e, base, window=window, **theirs, max_score=_max_score(q, k, mask, ref))
    scale, e = _fit_scale(c, q, k, v, mask, D, ref)
    if ok(e):
        return _found("scale", e, base, scale=scale, head_dim=int(D), ref_scale=theirs["ref_scale"])
    cap, e = _fit_softcap(c, q, k, v, mask, ref)
    if ok(e):
        return _found("softcap", e, base, softcap=cap, **theirs, max_score=_max_score(q, k, mask, ref))
    return None
