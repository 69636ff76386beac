"""Policy dtype names -> jnp dtypes, matmul precision, and the XLA options that make a
policy mean exactly what llamaspec.policy says it means."""

from __future__ import annotations

import functools
import warnings

import jax
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

# Options for every program jaxmodel compiles (per executable, nothing else in the process):
# - xla_allow_excess_precision=False: every cast rounds, as the policy says and PyTorch
#   does (by default XLA may keep bf16/f16 intermediates in f32 between fused ops);
# - xla_cpu_use_fusion_emitters=False: the classic emitters compile an op the same way
#   whatever its consumers, so capturing an activation never changes the logits (with the
#   newer ones FMA contraction follows the fusion, docs/performance.md). XLA:CPU's only:
#   not asked for on other backends (XLA:GPU rejects it as unknown).
_WANTED_OPTIONS = {"xla_allow_excess_precision": False, "xla_cpu_use_fusion_emitters": False}

# Batch-invariant programs only: XLA:CPU may hand a fusion to the YNNPACK library depending
# on its size, and YNNPACK's elementwise code (exp) rounds differently from XLA's; this keeps
# the elementwise work left in XLA on XLA's own code at every batch size (docs/invariance.md).
_INVARIANT_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@functools.cache
def compiler_options(batch_invariant: bool = False) -> dict:
    """_WANTED_OPTIONS (plus _INVARIANT_OPTIONS for batch-invariant programs) less any this
    jaxlib does not know (an unknown option is a compile error, and XLA renames its debug
    options now and then): probed once, on a toy program."""
    options = {}
    wanted = {**_WANTED_OPTIONS, **(_INVARIANT_OPTIONS if batch_invariant else {})}
    for key, value in wanted.items():
        if key.startswith("xla_cpu_") and jax.default_backend() != "cpu":
            continue
        try:
            jax.jit(lambda x: x + 1, compiler_options={key: value}).lower(1.0).compile()
            options[key] = value
        except Exception as e:  # noqa: BLE001 - jaxlib raises XlaRuntimeError or ValueError
            warnings.warn(f"jaxmodel: XLA option {key}={value} is not available ({e}); "
                          "results may differ in the last bit from other jaxlib versions")
    return options


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
