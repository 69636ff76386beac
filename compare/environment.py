"""What a report records about where it ran, so two reports can be told apart later.

The CPU and its instruction sets (and the caps put on the libraries), framework versions,
devices, the XLA flags, torch's matmul settings, and each side's plan: the record its model
made once at load of how it computes (llamaspec.plan: the backend, the fixed-order kernels'
code path, the settings read, a choice per op). The models decide; this module only reads
their plans, so a dispatch rule lives in one place. A number that differs between two
machines is often explained by one of these lines (JAX's TF32 default on GPU, XLA_FLAGS set
in a shell profile, another backend, a different MKL thread count).

determinism_settings() is the part of it that decides a GPU's numbers: whether they repeat run
to run and which kernels make them (XLA:GPU's flags, cuBLAS' workspace, TF32, torch's
deterministic algorithms, cuDNN's choices, the 16-bit reductions, JAX's default matmul
precision). It is one record, recorded by environment() (so in every report) and by the
run-to-run checks themselves; on a machine without a GPU its values are recorded as they are
and its "gpu settings" line says they decide nothing there.
"""

from __future__ import annotations

import os
import platform
import re
from importlib.metadata import PackageNotFoundError, version

from llamaspec import Policy, fixed_order
from llamaspec.cpuinfo import name_and_flags, vendor
from llamaspec.plan import ISA_FLAGS, check_xla_flags

PACKAGES = ("numpy", "torch", "jax", "jaxlib", "flax", "ml_dtypes", "transformers")
# Variables that cap the libraries' instruction sets (docs/invariance.md: one machine, many CPUs).
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
            "MKL_CBWR", "LLAMA_PARITY_KERNEL_ISA")


def _version(pkg: str) -> str:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"


def cpu() -> dict:
    """The CPU (model name, its ISA extensions that matter), the caps set on the libraries,
    and the code paths they report using; the GPU when there is one."""
    name, flags = name_and_flags()
    caps = [f"{k}={os.environ[k]}" for k in ISA_CAPS if k in os.environ]
    # XLA's cap is one flag among XLA_FLAGS (recorded whole elsewhere in the environment)
    caps += [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu_max_isa=")]
    out = {"cpu": name, "cpu vendor": vendor() or "unknown",
           "cpu isa": " ".join(f for f in ISA_FLAGS if f in flags) or "unknown",
           "isa caps": ", ".join(caps) or "none"}
    try:
        import torch  # torch: slow import, and optional here (`import compare` must not load it)
        out["torch cpu capability"] = torch.backends.cpu.get_cpu_capability()
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        pass
    out["fixed-order kernels"] = fixed_order.state()
    return out


def _torch_settings() -> dict:
    """torch's threads and the CPU's matmul setting (the CUDA ones are determinism_settings')."""
    import torch  # torch: slow import; `import compare` must not load it
    return {"torch threads": torch.get_num_threads(),
            "torch cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "torch cpu matmul fp32_precision": torch.backends.mkldnn.matmul.fp32_precision}


# XLA:GPU's flags that decide whether a program's numbers repeat and which kernels make them:
# deterministic ops (no atomics; scatter and reductions in a fixed order), excluding the ops that
# have no deterministic form, autotuning (kernels chosen by timing), Triton's GEMMs (its own tiles
# and split-K) in place of cuBLAS'.
XLA_DETERMINISM_FLAGS = ("--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops",
                         "--xla_gpu_autotune_level", "--xla_gpu_enable_triton_gemm")
# Any other XLA:GPU flag that names a library or a kernel choice is called out as well.
_XLA_KERNEL_FLAG = re.compile(r"xla_gpu_\w*(cublas|cudnn|triton|autotun|determin|split_k|tf32)")
# Variables the CUDA libraries (and torch, TensorFlow's XLA heritage) read themselves: cuBLAS'
# workspace (":4096:8" or ":16:8": reproducible cuBLAS), NVIDIA's global TF32 switch.
CUDA_DETERMINISM_ENV = ("CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
                        "TF_CUDNN_DETERMINISTIC", "TF_DETERMINISTIC_OPS")
UNSET = "(unset)"
# the key of a determinism record that says JAX was asked (its backend); absent: torch only
JAX_BACKEND = "jax backend"
NO_GPU = ("no GPU: the CUDA, cuBLAS, cuDNN and XLA:GPU settings here are recorded as set and decide "
          "nothing on this machine")


def xla_flags(flags: str | None = None) -> dict[str, str]:
    """$XLA_FLAGS (or `flags`) as {--name: value} (a bare --name is "true"; the last one given wins)."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    out = {}
    for word in flags.split():
        name, _, value = word.partition("=")
        if name.startswith("--"):
            out[name] = value if "=" in word else "true"
    return out


def _torch_determinism() -> dict:
    """torch's process-wide settings that choose CUDA kernels and their rounding (read, never set)."""
    import torch  # torch: slow import; `import compare` must not load it
    mm, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    out = {"torch cuda matmul fp32_precision": mm.fp32_precision,
           # the legacy flag is readable only while the new API is left at "none" (torch refuses a mix)
           "torch cuda matmul allow_tf32": (mm.allow_tf32 if mm.fp32_precision == "none"
                                            else "(set through fp32_precision)"),
           "torch cudnn fp32_precision": cudnn.fp32_precision,
           "torch cudnn allow_tf32": cudnn.allow_tf32 if cudnn.fp32_precision == "none" else
           "(set through fp32_precision)",
           "torch bf16 reduced-precision reduction": mm.allow_bf16_reduced_precision_reduction,
           "torch fp16 reduced-precision reduction": mm.allow_fp16_reduced_precision_reduction}
    if hasattr(mm, "allow_fp16_accumulation"):
        out["torch fp16 accumulation"] = mm.allow_fp16_accumulation
    enabled = torch.are_deterministic_algorithms_enabled()
    out["torch deterministic algorithms"] = (("on, warn only" if torch.is_deterministic_algorithms_warn_only_enabled()
                                              else "on") if enabled else "off")
    out.update({"torch cudnn enabled": cudnn.enabled, "torch cudnn deterministic": cudnn.deterministic,
                "torch cudnn benchmark": cudnn.benchmark,
                "torch preferred blas library": torch.backends.cuda.preferred_blas_library().name})
    sdpa = {"flash": torch.backends.cuda.flash_sdp_enabled(), "mem_efficient":
            torch.backends.cuda.mem_efficient_sdp_enabled(), "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled()}
    out["torch sdpa backends enabled"] = ", ".join(k for k, on in sdpa.items() if on) or "none"
    return out


def _jax_determinism() -> dict:
    check_xla_flags()       # before JAX starts: XLA ends the process on a flag it does not know
    import jax  # slow import, and only after the flags are checked
    precision = jax.config.jax_default_matmul_precision
    return {JAX_BACKEND: jax.default_backend(),
            "jax_default_matmul_precision": str(precision) if precision is not None else
            "unset (XLA's DEFAULT for a product that states none: TF32-class f32 products on a GPU)"}


def _gpu(uses_jax: bool) -> str | None:
    """The GPU torch or (uses_jax) JAX computes on here, or None."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    if uses_jax:
        check_xla_flags()
        import jax
        if jax.default_backend() not in ("cpu", "tpu"):
            return str(jax.devices()[0].device_kind)
    return None


def determinism_settings(uses_jax: bool = True) -> dict:
    """Flat {name: value} (JSON-safe) of what decides a GPU's numbers here, as set in this process
    (read only: nothing is changed): XLA_FLAGS whole and its determinism flags by name, the
    variables CUDA's libraries read (CUBLAS_WORKSPACE_CONFIG, ...), torch's TF32 state, its
    deterministic-algorithms flag (and warn-only), cuDNN's deterministic / benchmark, the 16-bit
    reduced-precision reductions, torch's BLAS and attention kernels, JAX's default matmul precision
    (uses_jax). The backend plan is each model's (environment records it). Without a GPU the values
    are recorded as they are, and "gpu settings" says so."""
    gpu = _gpu(uses_jax)
    flags = xla_flags()
    out = {"gpu settings": f"apply: {gpu}" if gpu else NO_GPU,
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", UNSET)}
    out.update({f"XLA_FLAGS {name}": flags.get(name, "unset (XLA's default)") for name in XLA_DETERMINISM_FLAGS})
    others = [f"{k}={v}" for k, v in flags.items() if k not in XLA_DETERMINISM_FLAGS and _XLA_KERNEL_FLAG.search(k)]
    out["XLA_FLAGS other GPU kernel flags"] = ", ".join(others) or "none"
    out.update({name: os.environ.get(name, UNSET) for name in CUDA_DETERMINISM_ENV})
    try:
        out.update(_torch_determinism())
    except ImportError:
        out["torch"] = "not installed"
    if uses_jax:
        out.update(_jax_determinism())
    return out


def _jax_settings() -> dict:
    check_xla_flags()       # before JAX starts: XLA ends the process on a flag it does not know
    # jax, jaxmodel: slow imports, and only after the flags are checked
    import jax

    from jaxmodel.dtypes import compiler_options
    return {"jax devices": ", ".join(str(d) for d in jax.devices()),
            "jax_enable_x64": bool(jax.config.jax_enable_x64),
            "jaxmodel compiler options": ", ".join(f"{k}={v}" for k, v in compiler_options().items())}


def plan_of(impl):
    """The plan an implementation's model holds (a torchref or jaxmodel model, or an adapter around
    one), or None for another implementation (transformers, a port, a dump)."""
    plan = getattr(impl, "plan", None)
    if plan is None:   # an adapter around a model; asked only then: a streamed side loads its model when asked
        plan = getattr(getattr(impl, "model", None), "plan", None)
    return plan if plan is not None and hasattr(plan, "record") else None


def default_plans(policy, uses_jax: bool) -> dict:
    """{framework: plan} of the default backend at `policy` on the CPU, for a record made without
    the models at hand (the demo, the benchmarks): what from_pretrained would choose here."""
    from torchref.plan import make_plan  # torchref imports torch, jaxmodel jax: slow, and only for these plans
    plans = {"torchref": make_plan(policy, "cpu", "fast")}
    if uses_jax:
        from jaxmodel.plan import make_plan as make_jax_plan
        plans["jaxmodel"] = make_jax_plan(policy, "cpu", "fast")
    return plans


def environment(policy, uses_jax: bool = True, sides: dict | None = None) -> dict:
    """Flat {name: value} for the report (JSON-safe); policy: a llamaspec.Policy or a preset name.
    sides: {role ("reference", "candidate", ...): implementation}; each one's plan is recorded
    under "<role> plan ..." (implementations without a plan, as transformers, record none).
    Without sides, the plans from_pretrained would make here by default."""
    policy = Policy.get(policy)
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "cpu count": os.cpu_count(), **cpu()}
    env.update({pkg: _version(pkg) for pkg in PACKAGES})
    env.update(_torch_settings())
    env.update(determinism_settings(uses_jax))
    if uses_jax:
        env.update(_jax_settings())
    plans = default_plans(policy, uses_jax) if sides is None else {
        role: plan for role, plan in ((r, plan_of(impl)) for r, impl in sides.items()) if plan is not None}
    for role, plan in plans.items():
        env.update({f"{role} plan {k}": v for k, v in plan.record().items()})
    return env


def sides_of(ref, cand) -> dict:
    """environment's sides for a comparison of two ladder Sides: their models at the policy."""
    return {"reference": ref.at_policy, "candidate": cand.at_policy}
