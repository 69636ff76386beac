"""Policy dtype names -> jnp dtypes, matmul precision, and the XLA options that make a
policy mean exactly what llamaspec.policy says it means."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from llamaspec import Policy

_DTYPES = {
    "float64": jnp.dtype(jnp.float64),
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float16": jnp.dtype(jnp.float16),
}

# By default XLA may keep bf16/f16 intermediates in f32 and drop the rounding between
# fused elementwise ops (and a bf16 -> f32 convert after an f32 -> bf16 one). The
# policy promises that every cast rounds ("probabilities are rounded to
# compute_dtype"), and PyTorch rounds after every op, so we turn that licence off.
# It is a per-executable option: nothing else in the process is affected.
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def of(name: str) -> jnp.dtype:
    """'bfloat16' -> jnp.bfloat16 (policy fields hold names, not dtypes)."""
    return _DTYPES[name]


def numpy_dtype(name: str) -> np.dtype:
    """Same, as a numpy dtype (bf16 via ml_dtypes), for host-side weight conversion."""
    return np.dtype(_DTYPES[name])


def opmath(dtype) -> jnp.dtype:
    """The dtype a scalar op on `dtype` runs in, as in PyTorch: bf16/f16 elementwise ops
    compute in f32 and round once (`x * 0.125`, silu), wider types compute in themselves."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def matmul_precision(policy: Policy) -> lax.Precision:
    """"ieee" -> HIGHEST (full f32 products everywhere); "tf32" -> DEFAULT, which is TF32
    on NVIDIA GPUs from Ampere on and plain f32 on CPU (a CPU has no TF32, so the tf32
    preset equals fp32 there)."""
    return lax.Precision.HIGHEST if policy.matmul == "ieee" else lax.Precision.DEFAULT
