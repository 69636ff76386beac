"""Error metrics on numpy arrays (float64 arithmetic, NaN/Inf never masked)."""

from __future__ import annotations

import numpy as np


def as64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def rel_l2(cand, ref) -> float:
    """||cand - ref|| / ||ref||; NaN when either side has NaN/Inf (reported, not hidden)."""
    c, r = as64(cand), as64(ref)
    if not (np.isfinite(c).all() and np.isfinite(r).all()):
        return float("nan")
    denom = np.linalg.norm(r)
    return float(np.linalg.norm(c - r) / denom) if denom else float(np.linalg.norm(c - r))


def max_abs(cand, ref) -> float:
    c, r = as64(cand), as64(ref)
    if not (np.isfinite(c).all() and np.isfinite(r).all()):
        return float("nan")
    return float(np.abs(c - r).max())


def nonfinite(x) -> int:
    """Number of NaN/Inf elements."""
    return int(np.size(x) - np.isfinite(as64(x)).sum())
