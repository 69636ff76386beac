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


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """numpy (bf16 via ml_dtypes) -> torch, without going through float32: a copy, in memory
    torch allocated (aligned to 64 bytes, as its own tensors are). A numpy copy is aligned to 16
    bytes only, and MKL's f32 products run measurably slower with such a weight."""
    a = np.asarray(a)
    bf16 = a.dtype == ml_dtypes.bfloat16
    src = a.view(np.uint16) if bf16 else a
    t = torch.empty(src.shape, dtype=torch.from_numpy(np.empty(0, src.dtype)).dtype)
    t.numpy()[...] = src
    return t.view(torch.bfloat16) if bf16 else t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """torch -> numpy, keeping bf16 as ml_dtypes.bfloat16 (no silent upcast)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
