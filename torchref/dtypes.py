"""Policy dtype names -> torch dtypes, and the torch matmul settings a policy implies."""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import torch

from llamaspec.errors import PolicyError

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


@contextlib.contextmanager
def check_matmul_settings(policy, device):
    """Runs a call after checking that torch's process-wide matmul settings realise the policy on
    `device` (read at every call, never changed here: they belong to the user's process). A setting
    that contradicts the policy is an error naming it and the value the policy needs.

    CPUs have no TF32 (a tf32 policy is IEEE f32 there), and oneDNN's fp32_precision must leave
    f32 products in f32 ("none" or "ieee"). On CUDA, PyTorch's default is IEEE f32 and JAX's TF32,
    so the policy says which one; and cuBLAS' reduced-precision reductions (bf16/fp16 partial sums)
    contradict a policy that sums 16-bit products in f32."""
    device = torch.device(device)
    wrong = []
    cpu = torch.backends.mkldnn.matmul.fp32_precision
    if cpu not in ("none", "ieee"):
        wrong.append(("torch.backends.mkldnn.matmul.fp32_precision", cpu, "'ieee' (or 'none')"))
    if device.type == "cuda":
        mm = torch.backends.cuda.matmul
        tf32 = mm.fp32_precision == "tf32" or (mm.fp32_precision == "none" and torch.backends.cuda.matmul.allow_tf32)
        if tf32 != (policy.matmul == "tf32"):
            wrong.append(("torch.backends.cuda.matmul.fp32_precision", mm.fp32_precision,
                          "'tf32'" if policy.matmul == "tf32" else "'ieee'"))
        low_accum = policy.accum_dtype in ("bfloat16", "float16")
        for flag in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
            if getattr(mm, flag) and not low_accum:
                wrong.append((f"torch.backends.cuda.matmul.{flag}", True, "False"))
    if wrong:
        raise PolicyError(f"policy {policy.name!r} on {device}: " + "; ".join(
            f"{name} is {value!r}, the policy needs {need}" for name, value, need in wrong))
    yield
