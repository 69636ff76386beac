"""What a report records about where it ran, so two reports can be told apart later.

The CPU and its instruction sets (and the caps put on the libraries), framework
versions, devices, the XLA flags and jaxmodel's compiler options, and torch's
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


# The instruction-set extensions that change which kernels the libraries pick.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")
# Variables that cap the libraries' instruction sets (docs/invariance.md: one machine, many CPUs).
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
            "MKL_CBWR", "LLAMA_PARITY_KERNEL_ISA")


def cpu() -> dict:
    """The CPU (model name, its ISA extensions that matter), the caps set on the libraries,
    and the code paths they report using; the GPU when there is one."""
    from llamaspec.cpuinfo import name_and_flags, vendor
    name, flags = name_and_flags()
    caps = [f"{k}={os.environ[k]}" for k in ISA_CAPS if k in os.environ]
    # XLA's cap is one flag among XLA_FLAGS (recorded whole elsewhere in the environment)
    caps += [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu_max_isa=")]
    out = {"cpu": name, "cpu vendor": vendor() or "unknown",
           "cpu isa": " ".join(f for f in ISA_FLAGS if f in flags) or "unknown",
           "isa caps": ", ".join(caps) or "none"}
    try:
        import torch
        out["torch cpu capability"] = torch.backends.cpu.get_cpu_capability()
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        pass
    from llamaspec import fixed_order
    out["fixed-order kernels"] = fixed_order.state()
    return out


def _torch_settings(policy) -> dict:
    import torch

    from torchref import ops
    from torchref.dtypes import dt, matmul_settings
    out = {"torch threads": torch.get_num_threads(),
           "torch cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
    compute = dt(policy.compute_dtype)
    if compute in (torch.bfloat16, torch.float16) and policy.accum_dtype != policy.compute_dtype:
        out[f"torchref CPU products at {policy.name}"] = (
            f"torch's {policy.compute_dtype} kernels (in hardware here)"
            + (f"; 2 to {ops.FEW_ROWS} rows on the fixed-order kernels" if ops.kernel_products(
                compute, dt(policy.accum_dtype), compute, 2, torch.device("cpu")) else "")
            if ops.hardware_products(compute)
            else f"widened to {policy.accum_dtype} from {ops.WIDE_MIN_ROWS} rows (no {policy.compute_dtype} "
                 f"products in hardware, or capped), torch's {policy.compute_dtype} kernels below")
    out[f"torchref {ops.ATTENTION_ENV}"] = os.environ.get(ops.ATTENTION_ENV, "(unset)")
    out[f"torchref {ops.PRODUCTS_ENV}"] = os.environ.get(ops.PRODUCTS_ENV, "(unset)")
    out["torchref CPU f32 products of many rows"] = (
        "fixed-order kernels where they build (torch's BLAS is MKL, the CPU not Intel's)" if ops.mkl_off_intel()
        else "torch's BLAS")
    attention = "separate products, mask and softmax"
    if ops.fused_attention_applies(policy, torch.device("cpu")):
        attention = "torch's fused kernel (scaled_dot_product_attention)"
    elif ops.kernel_attention_applies(policy, torch.device("cpu")):
        attention = "fixed-order kernels' causal attention (prompts and decode steps)"
    out[f"torchref CPU attention at {policy.name}"] = attention
    with matmul_settings(policy):  # the settings every torchref call of this run used
        mm, cpu = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
        out["torch cuda matmul fp32_precision"] = mm.fp32_precision
        out["torch cpu matmul fp32_precision"] = cpu.fp32_precision
        out["torch bf16 reduced-precision reduction"] = mm.allow_bf16_reduced_precision_reduction
        out["torch fp16 reduced-precision reduction"] = mm.allow_fp16_reduced_precision_reduction
    return out


def _jax_settings(policy) -> dict:
    import jax

    from jaxmodel import kernels, ops
    from jaxmodel.dtypes import compiler_options
    bf16 = ("native bf16 for 2+ rows (AMX or AVX-512-BF16), widened f32 for one row" if ops.native_dots(policy)
            else "widened to f32" if ops.widened_dtype(policy) is not None else "as the policy's dtypes")
    return {"jax backend": jax.default_backend(),
            "jax devices": ", ".join(str(d) for d in jax.devices()),
            "jax_enable_x64": bool(jax.config.jax_enable_x64),
            "jaxmodel compiler options": ", ".join(f"{k}={v}" for k, v in compiler_options().items()),
            "jaxmodel batch-invariant extra options": ", ".join(
                f"{k}={v}" for k, v in compiler_options(True).items() if k not in compiler_options()) or "none",
            "jaxmodel batch-invariant kernels": kernels.state(),
            f"jaxmodel {ops.BF16_DOTS_ENV}": os.environ.get(ops.BF16_DOTS_ENV, "(unset)"),
            f"jaxmodel products at {policy.name}": bf16,
            f"jaxmodel {ops.ATTENTION_ENV}": os.environ.get(ops.ATTENTION_ENV, "(unset)"),
            f"jaxmodel {ops.MATVEC_ENV}": os.environ.get(ops.MATVEC_ENV, "(unset)"),
            f"jaxmodel one-row products at {policy.name}": (
                "fixed-order kernel on 16-bit packed weights" if ops.kernel_matvecs(policy) else "XLA"),
            f"jaxmodel causal attention at {policy.name}": (
                "fused CPU kernel (jaxmodel/attention.h; per shard on a mesh)" if ops.fused_attention_applies(policy)
                else "XLA")}


def environment(policy, uses_jax: bool = True) -> dict:
    """Flat {name: value} for the report (JSON-safe); policy: a llamaspec.Policy or a preset name."""
    from llamaspec import Policy
    policy = Policy.get(policy)
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "cpu count": os.cpu_count(), **cpu()}
    env.update({pkg: _version(pkg) for pkg in PACKAGES})
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "(unset)")
    env.update(_torch_settings(policy))
    if uses_jax:
        env.update(_jax_settings(policy))
    return env
