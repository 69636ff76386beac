"""fp8 quantization on jax arrays: llamaspec.quant's definition (its docstring says each step),
the same bits as its numpy reference and as torchref/quant.py, with the same names.

    q, scales = quantize(w, "e4m3:block128")      # q jnp.float8_e4m3fn, scales float32
    w8 = dequantize(q, scales, "e4m3:block128", "float32")

Eager or under jit (default options or the models' dtypes.compiler_options()): the same bits, as
every division goes through _divide.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from llamaspec.quant import TINY32, Fp8Format, Scaling, fp8_format

from .dtypes import of


def quantize(x, scaling: "str | Scaling"):
    """x (float64/32, bfloat16, float16) -> (q in scaling's fp8 dtype, scales in its scale_dtype,
    shape scaling.scale_shape(x.shape))."""
    scaling, x = Scaling.get(scaling), jnp.asarray(x)
    scaling.check_input(x.dtype.name, x.shape)
    fmt, group = scaling.fmt, scaling.group_shape(x.shape)
    x = x.astype(jnp.float32)
    x = jnp.where(jnp.abs(x) < TINY32, x * 0, x)                    # float32 subnormals: +-0
    amax = _group_amax(x, group, scaling.scale_shape(x.shape))
    scale = _divide(amax, jnp.float32(fmt.max)).astype(of(scaling.scale_dtype)).astype(jnp.float32)
    scale = jnp.where(amax == 0, jnp.float32(1), jnp.maximum(scale, jnp.float32(fmt.min_scale)))
    q = round_to_fp8(_divide(x, _expand(scale, group, x.shape)), fmt)
    return q, scale.astype(of(scaling.scale_dtype))


def dequantize(q, scales, scaling: "str | Scaling", dtype: str = "float32"):
    """q x scale per value: in float64 for dtype "float64" (exact), else in float32, rounded to dtype."""
    scaling, q, scales = Scaling.get(scaling), jnp.asarray(q), jnp.asarray(scales)
    scaling.check_quantized(q.dtype.name, q.shape, scales.dtype.name, scales.shape, dtype)
    wide = jnp.float64 if dtype == "float64" else jnp.float32
    w = q.astype(wide) * _expand(scales.astype(wide), scaling.group_shape(q.shape), q.shape)
    return w.astype(of(dtype))


def round_to_fp8(y, fmt: "str | Fp8Format"):
    """float32 y -> fmt: clipped to +-fmt.max (saturation), rounded to nearest even; NaN -> fmt.nan.
    The NaN is chosen on the bytes: XLA:CPU computes a select of fp8 values in a wider type and
    writes e5m2's NaN back as 0x7F, not fmt.nan_bits."""
    fmt = fp8_format(fmt)
    q = jnp.clip(y, -fmt.max, fmt.max).astype(fmt.dtype)
    code = jnp.where(jnp.isnan(y), jnp.uint8(fmt.nan_bits), lax.bitcast_convert_type(q, jnp.uint8))
    return lax.bitcast_convert_type(code, fmt.dtype)


def _divide(a, b):
    """a / b, one IEEE division per value as numpy and torch compute it. XLA rewrites a division
    by a broadcast (a scale per group, a constant) into a product with the rounded reciprocal,
    which differs in the last bit for about a quarter of the values; the barrier hides b's shape."""
    return a / lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def _group_amax(a, group, grid):
    """max |a| over each group, shape grid: a is zero-padded to whole groups (a zero never raises
    a maximum; a NaN still wins) and reshaped so that each group spans its own axes."""
    a = jnp.pad(jnp.abs(a), [(0, g * b - n) for n, b, g in zip(a.shape, group, grid)])
    tiles = a.reshape([d for g, b in zip(grid, group) for d in (g, b)])
    return tiles.max(axis=tuple(range(1, tiles.ndim, 2)))


def _expand(scale, group, shape):
    """Each group's scale repeated over its group, cut to `shape`."""
    for axis, b in enumerate(group):
        scale = jnp.repeat(scale, b, axis=axis)
    return scale[tuple(slice(0, n) for n in shape)]
