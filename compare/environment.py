"""What a report records about where it ran, so two reports can be told apart later.

Framework versions, devices, the XLA flags and jaxmodel's compiler options, and torch's
matmul settings as a policy pins them (llamaspec.policy). A number that differs between
two machines is often explained by one of these lines (JAX's TF32 default on GPU,
XLA_FLAGS set in a shell profile, a different MKL thread count).
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("numpy", "torch", "jax", "jaxlib", "flax", "ml_dtypes", "transformers")


def _version(pkg: str) -> str:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"


def _torch_settings(policy) -> dict:
    import torch

    from torchref import invariant
    from torchref.dtypes import matmul_settings
    out = {"torch threads": torch.get_num_threads(),
           "torchref batch-invariant f32 linears": "oneDNN, weights packed once" if invariant._ONEDNN
           else "MKL, rows padded to 4",
           "torch cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
    with matmul_settings(policy):  # the settings every torchref call of this run used
        mm, cpu = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
        out["torch cuda matmul fp32_precision"] = mm.fp32_precision
        out["torch cpu matmul fp32_precision"] = cpu.fp32_precision
        out["torch bf16 reduced-precision reduction"] = mm.allow_bf16_reduced_precision_reduction
        out["torch fp16 reduced-precision reduction"] = mm.allow_fp16_reduced_precision_reduction
    return out


def _jax_settings() -> dict:
    import jax

    from jaxmodel import rowdot
    from jaxmodel.dtypes import compiler_options
    return {"jax backend": jax.default_backend(),
            "jax devices": ", ".join(str(d) for d in jax.devices()),
            "jax_enable_x64": bool(jax.config.jax_enable_x64),
            "jaxmodel compiler options": ", ".join(f"{k}={v}" for k, v in compiler_options().items()),
            "jaxmodel batch-invariant extra options": ", ".join(
                f"{k}={v}" for k, v in compiler_options(True).items() if k not in compiler_options()) or "none",
            "jaxmodel batch-invariant f32 decode": rowdot.state()}


def environment(policy, uses_jax: bool = True) -> dict:
    """Flat {name: value} for the report (JSON-safe)."""
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "cpu count": os.cpu_count()}
    env.update({pkg: _version(pkg) for pkg in PACKAGES})
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "(unset)")
    env.update(_torch_settings(policy))
    if uses_jax:
        env.update(_jax_settings())
    return env
