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

# Options for every program jaxmodel compiles (per executable: nothing else in the
# process is affected).
#
# xla_allow_excess_precision=False: by default XLA may keep bf16/f16 intermediates in
# f32 and drop the rounding between fused elementwise ops (and a bf16 -> f32 convert
# after an f32 -> bf16 one). The policy promises that every cast rounds
# ("probabilities are rounded to compute_dtype"), and PyTorch rounds after every op.
#
# xla_cpu_use_fusion_emitters=False: XLA:CPU contracts a*b + c into an FMA, and with
# its newer fusion emitters whether it does so depends on how ops are fused, which
# depends on which activations the program returns. Without this option a capture()
# of layers.*.q_rope changed the f32 logits by an ulp against a plain call; with the
# classic emitters the code for an op does not depend on its consumers, so observing
# an activation never changes the numbers (tests/test_models.py checks this). It
# also ran the SmolLM2 forward and decode 10-20% faster here, but compiles slower.
# Other backends ignore it.
_WANTED_OPTIONS = {"xla_allow_excess_precision": False, "xla_cpu_use_fusion_emitters": False}

# Batch-invariant programs only: XLA:CPU hands some fusions to the YNNPACK library, and
# whether it does depends on their size (a softmax's exp and elementwise neighbours of a
# dot once went there, and YNNPACK's exp differs from XLA's in the last bit). The invariant
# ops run their products, sums and exp on fixed-order FFI kernels; this keeps whatever
# elementwise work remains in XLA's own code at every batch size (docs/invariance.md).
_INVARIANT_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@functools.cache
def compiler_options(batch_invariant: bool = False) -> dict:
    """_WANTED_OPTIONS (plus _INVARIANT_OPTIONS for batch-invariant programs) less any this
    jaxlib does not know (an unknown option is a compile error, and XLA renames its debug
    options now and then): probed once, on a toy program."""
    options = {}
    wanted = {**_WANTED_OPTIONS, **(_INVARIANT_OPTIONS if batch_invariant else {})}
    for key, value in wanted.items():
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
