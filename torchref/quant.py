"""fp8 quantization on torch tensors: llamaspec.quant's definition (its docstring says each step),
the same bits as its numpy reference and as jaxmodel/quant.py, with the same names.

    q, scales = quantize(w, "e4m3:block128")      # q torch.float8_e4m3fn, scales float32
    w8 = dequantize(q, scales, "e4m3:block128", "float32")
"""

from __future__ import annotations

import torch

from llamaspec.quant import TINY32, Fp8Format, Scaling, fp8_format

from .dtypes import dt

FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantize(x: torch.Tensor, scaling: "str | Scaling") -> tuple[torch.Tensor, torch.Tensor]:
    """x (float64/32, bfloat16, float16) -> (q in scaling's fp8 dtype, scales in its scale_dtype,
    shape scaling.scale_shape(x.shape))."""
    scaling = Scaling.get(scaling)
    scaling.check_input(_name(x.dtype), x.shape)
    fmt, group = scaling.fmt, scaling.group_shape(x.shape)
    x = x.to(torch.float32)
    x = torch.where(x.abs() < TINY32, x * 0, x)                     # float32 subnormals: +-0
    amax = _group_amax(x, group, scaling.scale_shape(x.shape))
    scale = (amax / fmt.max).to(dt(scaling.scale_dtype)).to(torch.float32)
    scale = torch.where(amax == 0, 1.0, torch.clamp(scale, min=fmt.min_scale))
    q = round_to_fp8(x / _expand(scale, group, x.shape), fmt)
    return q, scale.to(dt(scaling.scale_dtype))


def dequantize(q: torch.Tensor, scales: torch.Tensor, scaling: "str | Scaling",
               dtype: str = "float32") -> torch.Tensor:
    """q x scale per value: in float64 for dtype "float64" (exact), else in float32, rounded to dtype."""
    scaling = Scaling.get(scaling)
    scaling.check_quantized(_name(q.dtype), q.shape, _name(scales.dtype), scales.shape, dtype)
    wide = torch.float64 if dtype == "float64" else torch.float32
    w = q.to(wide) * _expand(scales.to(wide), scaling.group_shape(q.shape), q.shape)
    return w.to(dt(dtype))


def round_to_fp8(y: torch.Tensor, fmt: "str | Fp8Format") -> torch.Tensor:
    """float32 y -> fmt: clipped to +-fmt.max (saturation), rounded to nearest even; NaN -> fmt's NaN
    (torch's own cast writes e5m2's NaN as 0x7F, ml_dtypes and XLA as 0x7E: fmt.nan_bits)."""
    fmt = fp8_format(fmt)
    q = torch.clamp(y, -fmt.max, fmt.max).to(FP8[fmt.name])
    nan = torch.tensor(fmt.nan_bits, dtype=torch.uint8).view(FP8[fmt.name])
    return torch.where(torch.isnan(y), nan, q)


def _group_amax(a: torch.Tensor, group, grid) -> torch.Tensor:
    """max |a| over each group, shape grid: a is zero-padded to whole groups (a zero never raises
    a maximum; a NaN still wins) and reshaped so that each group spans its own axes."""
    pad = [p for n, b, g in reversed(list(zip(a.shape, group, grid))) for p in (0, g * b - n)]  # last axis first
    tiles = torch.nn.functional.pad(a.abs(), pad).reshape([d for g, b in zip(grid, group) for d in (g, b)])
    return tiles.amax(dim=tuple(range(1, tiles.ndim, 2)))


def _expand(scale: torch.Tensor, group, shape) -> torch.Tensor:
    """Each group's scale repeated over its group, cut to `shape`."""
    for axis, b in enumerate(group):
        scale = scale.repeat_interleave(b, dim=axis)
    return scale[tuple(slice(0, n) for n in shape)]
