"""Policy dtype names -> torch dtypes, and numpy <-> torch without a detour through float32."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

TORCH = {"float64": torch.float64, "float32": torch.float32,
         "bfloat16": torch.bfloat16, "float16": torch.float16}


def dt(name: str) -> torch.dtype:
    return TORCH[name]


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t.to(dtype), without torch's dispatch when t already is (t itself, as .to gives): a
    decode step makes hundreds of calls that change nothing."""
    return t if t.dtype == dtype else t.to(dtype)


# the dtypes numpy holds through ml_dtypes, moved bit for bit through an integer of their width
_ML = {torch.bfloat16: (ml_dtypes.bfloat16, np.uint16, torch.int16),
       torch.float8_e4m3fn: (ml_dtypes.float8_e4m3fn, np.uint8, torch.uint8),
       torch.float8_e5m2: (ml_dtypes.float8_e5m2, np.uint8, torch.uint8)}
_BY_NUMPY = {np.dtype(ml): (torch_dtype, bits) for torch_dtype, (ml, bits, _) in _ML.items()}


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """numpy (bf16 and fp8 via ml_dtypes) -> torch, without going through float32: a copy, in
    memory torch allocated (aligned to 64 bytes, as its own tensors are). A numpy copy is aligned
    to 16 bytes only, and MKL's f32 products run measurably slower with such a weight."""
    a = np.asarray(a)
    target, bits = _BY_NUMPY.get(a.dtype, (None, None))
    src = a.view(bits) if target is not None else a
    t = torch.empty(src.shape, dtype=torch.from_numpy(np.empty(0, src.dtype)).dtype)
    t.numpy()[...] = src
    return t.view(target) if target is not None else t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """torch -> numpy, keeping bf16 and fp8 as ml_dtypes' types (no silent upcast)."""
    t = t.detach().cpu().contiguous()
    if t.dtype in _ML:
        ml, _, bits = _ML[t.dtype]
        return t.view(bits).numpy().view(ml)
    return t.numpy()
