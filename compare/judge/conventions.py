"""Explain an attention difference by a known alternative convention.

At layers.{i}.attn_ctx the engine holds the oracle's inputs to attention (q_rope, k_rope,
v, all fp64). Recomputing attention from them under the conventions implementations
actually get wrong (no 1/sqrt(head_dim) scale or another one, kv head h % Hkv instead of
h // G, a causal mask off by one either way, no causal mask) and finding the one the
candidate matches turns "attention differs" into "attention scale missing".

A match must be close in absolute terms (ATOL_MATCH: the candidate computes the same
thing, up to f32 steps kept inside an fp64 run) and explain the difference (its distance
at most MATCH_SHARE of the distance to the reference's conventions).
"""

from __future__ import annotations

import math

import numpy as np

from ..metrics import as64, rel_l2
from .structure import Finding

ATOL_MATCH = 1e-4      # rel L2 to the alternative; an f32 softmax/RoPE in fp64 gives ~1e-7
MATCH_SHARE = 0.01


def attention64(q, k, v, mask=None, scale=None, group="grouped", shift=0) -> np.ndarray:
    """Causal GQA attention in float64: q [B, T, Hq, D], k, v [B, T, Hkv, D] -> [B, T, Hq*D].

    group "grouped": query head h reads kv head h // G (HF repeat_kv); "tiled": h % Hkv.
    shift: query slot t sees key slots s <= t + shift (0 is causal). A query that sees no
    real key averages all keys uniformly (what a finite "-inf" fill gives)."""
    q, k, v = as64(q), as64(k), as64(v)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    kv = np.arange(Hq) // G if group == "grouped" else np.arange(Hq) % Hkv
    k, v = k[:, :, kv], v[:, :, kv]
    scale = D ** -0.5 if scale is None else scale
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    m = np.ones((B, T), bool) if mask is None else np.asarray(mask, bool)
    allowed = (np.arange(T)[None, :] <= np.arange(T)[:, None] + shift)[None] & m[:, None, :]
    s = np.where(allowed[:, None], s, -1e300)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v).reshape(B, T, Hq * D)


def _alternatives(D: int, Hq: int, Hkv: int):
    """(name, attention64 keywords); compare.explain.findings says each name in words."""
    yield "no_scale", dict(scale=1.0)
    yield "scale_1_over_d", dict(scale=1.0 / D)
    if 1 < Hkv < Hq:
        yield "tiled_gqa", dict(group="tiled")   # query head h reads kv head h % n_kv
    yield "sees_next", dict(shift=1)             # causal mask off by one, either way
    yield "misses_self", dict(shift=-1)
    yield "no_causal_mask", dict(shift=10 ** 9)


# The scale search: a grid over e^-4..e^4 times 1/sqrt(D) (wide enough for 1/D, sqrt(D),
# a forgotten or doubled scale at any head size), then golden-section refinement of the
# best bracket to 1e-8 of its width (0.618^40).
SCALE_SPAN = 4.0
SCALE_GRID = 33
SCALE_REFINE_STEPS = 40


def _fit_scale(cand, q, k, v, mask, D) -> tuple[float, float]:
    """The softmax scale that brings the candidate closest (log-grid, then refined)."""
    def err(log_s):
        return rel_l2(cand, attention64(q, k, v, mask, scale=math.exp(log_s)))
    centre = math.log(D ** -0.5)
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


def explain_attention(cand, q, k, v, mask=None) -> Finding | None:
    """cand: the candidate's attn_ctx (fp64 rung); q, k, v: the oracle's q_rope, k_rope, v."""
    c = as64(cand)
    B, T, Hq, D = as64(q).shape
    Hkv = as64(k).shape[2]
    base = rel_l2(c, attention64(q, k, v, mask))
    if not base > 0 or not math.isfinite(base):
        return None
    ok = lambda e: e <= ATOL_MATCH and e <= MATCH_SHARE * base  # noqa: E731
    for name, kw in _alternatives(D, Hq, Hkv):
        e = rel_l2(c, attention64(q, k, v, mask, **kw))
        if ok(e):
            return Finding("attention_convention", 1.0 - e / base, base,
                           dict(convention=name, rel_l2=e, base=base))
    scale, e = _fit_scale(c, q, k, v, mask, D)
    if ok(e):
        return Finding("attention_convention", 1.0 - e / base, base,
                       dict(convention="scale", scale=scale, rel_l2=e, base=base, head_dim=int(D)))
    return None
