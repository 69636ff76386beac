"""What a report records about where it ran, so two reports can be told apart later.

The CPU and its instruction sets (and the caps put on the libraries), framework versions,
devices, the XLA flags, torch's matmul settings, and each side's plan: the record its model
made once at load of how it computes (llamaspec.plan: the backend, the fixed-order kernels'
code path, the settings read, a choice per op). The models decide; this module only reads
their plans, so a dispatch rule lives in one place. A number that differs between two
machines is often explained by one of these lines (JAX's TF32 default on GPU, XLA_FLAGS set
in a shell profile, another backend, a different MKL thread count).
"""

from __future__ import annotations

import os
import platform
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
    """torch's threads and the process's matmul settings (torchref checks them against the policy
    at each call and never changes them)."""
    import torch  # torch: slow import; `import compare` must not load it
    mm, cpu_mm = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    return {"torch threads": torch.get_num_threads(),
            "torch cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "torch cuda matmul fp32_precision": mm.fp32_precision,
            "torch cpu matmul fp32_precision": cpu_mm.fp32_precision,
            "torch bf16 reduced-precision reduction": mm.allow_bf16_reduced_precision_reduction,
            "torch fp16 reduced-precision reduction": mm.allow_fp16_reduced_precision_reduction}


def _jax_settings() -> dict:
    check_xla_flags()       # before JAX starts: XLA ends the process on a flag it does not know
    # jax, jaxmodel: slow imports, and only after the flags are checked
    import jax

    from jaxmodel.dtypes import compiler_options
    return {"jax backend": jax.default_backend(),
            "jax devices": ", ".join(str(d) for d in jax.devices()),
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
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "(unset)")
    env.update(_torch_settings())
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
