"""Policy dtype names -> torch dtypes, and the torch matmul settings a policy implies."""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import torch

TORCH = {"float64": torch.float64, "float32": torch.float32,
         "bfloat16": torch.bfloat16, "float16": torch.float16}


def dt(name: str) -> torch.dtype:
    return TORCH[name]


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t.to(dtype), without torch's dispatch when t already is (t itself, as .to gives): about
    1 us a call, and a batch-1 decode step of SmolLM2 makes some 400 calls that change
    nothing (docs/measurements.md)."""
    return t if t.dtype == dtype else t.to(dtype)


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """numpy (bf16 via ml_dtypes) -> torch, without going through float32: a copy, in memory
    torch allocated (aligned to 64 bytes, as its own tensors are). A numpy copy is aligned to 16
    bytes only, and MKL's f32 products ran up to 18% slower with such a weight (a 128-row
    SmolLM2 gate_proj on a Zen 4: 1.75 against 1.44 ms; docs/measurements.md)."""
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


@contextlib.contextmanager
def matmul_settings(policy):
    """Pins torch's global fp32 matmul mode to the policy for the duration of a call.

    PyTorch's default on CUDA is IEEE f32 and JAX's is TF32: a parity run must not
    depend on either default, so the policy says which one, explicitly. The reduced-
    precision reduction flags would let cuBLAS accumulate bf16/fp16 in low precision
    (split-K); the policy's f32 accumulation forbids that.
    """
    mm, cpu = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    saved = (mm.fp32_precision, mm.allow_bf16_reduced_precision_reduction,
             mm.allow_fp16_reduced_precision_reduction, cpu.fp32_precision)
    mm.fp32_precision = "tf32" if policy.matmul == "tf32" else "ieee"
    cpu.fp32_precision = "ieee"  # CPUs have no TF32: tf32 is ieee there, by design
    low_accum = policy.accum_dtype in ("bfloat16", "float16")
    mm.allow_bf16_reduced_precision_reduction = low_accum
    mm.allow_fp16_reduced_precision_reduction = low_accum
    try:
        yield
    finally:
        (mm.fp32_precision, mm.allow_bf16_reduced_precision_reduction,
         mm.allow_fp16_reduced_precision_reduction, cpu.fp32_precision) = saved
