"""The portable invariant path's element programs, defined once in numpy.

The invariant backend has two implementations, chosen by the plan (llamaspec.plan.INVARIANT_ENV):
the fixed-order kernels (llamaspec/fixed_order.h, CPU code) and the portable path, which runs
wherever torch or XLA runs (GPU included) because it uses no kernel of its own: every
reduction whose order a library could choose is written out as elementwise operations, whose
result per element IEEE 754 fixes (+, -, *, / and sqrt are correctly rounded), and every
matrix product runs at one fixed shape (docs/invariance.md says why that is enough).

This module is the definition both frameworks mirror op for op (torchref/portable.py,
jaxmodel/portable.py), and the numpy reference their tests compare with:

    tree_sum(x, axis)   the sum as a halving tree: zero-pad the axis to a power of two, then
                        x[:h] + x[h:] until one element is left
    exp(x)              ExpF32 / ExpF64 of fixed_order.h with a multiply and an add in place of
                        each fma: range reduction by ln 2 (split in two), a Taylor polynomial,
                        two exact scalings by powers of two
"""

from __future__ import annotations

import numpy as np

# exp's constants (fixed_order.h's ExpF32 / ExpF64)
LOG2E = 1.44269504088896341
LN2_HI_F32, LN2_LO_F32 = 0.693145751953125, 1.428606765330187045e-06   # hi has 16 bits: n * hi exact
LN2_HI_F64, LN2_LO_F64 = 0.693147180369123816490, 1.90821492927058770002e-10
EXP_MAX = {np.dtype(np.float32): 88.72283935546875, np.dtype(np.float64): 709.782712893383973096}
EXP_MIN = {np.dtype(np.float32): -103.972084045410156, np.dtype(np.float64): -745.133219101941108420}
TAYLOR = {np.dtype(np.float32): 8, np.dtype(np.float64): 13}     # Taylor to r^TAYLOR


def taylor(dtype) -> list[float]:
    """The polynomial's coefficients, highest first: 1/n!, ..., 1/2, 1, 1 (Horner's order)."""
    n = TAYLOR[np.dtype(dtype)]
    return [1.0 / float(np.prod(np.arange(1, k + 1, dtype=np.float64))) for k in range(n, -1, -1)]


def exp(x: np.ndarray) -> np.ndarray:
    """exp of an f32 or f64 array by the portable program (numpy: the definition)."""
    x = np.asarray(x)
    dt = x.dtype
    if dt not in EXP_MAX:
        raise TypeError(f"portable exp: float32 or float64, got {dt}")
    hi, lo = (LN2_HI_F32, LN2_LO_F32) if dt == np.float32 else (LN2_HI_F64, LN2_LO_F64)
    c = lambda v: dt.type(v)  # noqa: E731 (a constant in x's dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        n = np.rint(x * c(LOG2E))
        r = x - n * c(hi)
        r = r - n * c(lo)
        coef = taylor(dt)
        p = np.full_like(x, coef[0])
        for ci in coef[1:]:
            p = p * r + c(ci)
        e = np.clip(n, -2000, 2000).astype(np.int64)     # finite where it is used (see the masks)
        e1 = e >> 1
        y = p * _pow2(e1, dt) * _pow2(e - e1, dt)
    y = np.where(x < c(EXP_MIN[dt]), c(0), y)
    y = np.where(x > c(EXP_MAX[dt]), c(np.inf), y)
    return np.where(np.isnan(x), x, y)


def _pow2(e: np.ndarray, dt) -> np.ndarray:
    """2.0**e as the bits (e + bias) << mantissa bits (e within the normal range where used)."""
    if dt == np.float32:
        return ((np.clip(e, -126, 127) + 127).astype(np.uint32) << 23).view(np.float32)
    return ((np.clip(e, -1022, 1023) + 1023).astype(np.uint64) << 52).view(np.float64)


def tree_sum(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """The sum over `axis` as a halving tree (zero-padded to a power of two)."""
    x = np.moveaxis(np.asarray(x), axis, -1)
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], width - n), x.dtype)], -1)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]
