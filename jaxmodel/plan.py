"""jaxmodel's plan: the only module of the package that reads environment variables, CPU flags,
XLA_FLAGS and the fixed-order kernels' build state. Computed once at load (from_pretrained,
from_weights, LayerRunner); the model holds it as `model.plan` and computes with the namespace
`load` builds from the same decisions (ops.py, fast.Fast, invariant.py or portable.Portable).

    plan = make_plan("bf16", "cpu", "fast")
    plan.op("attention")     # e.g. "fused kernel (attention.h) for prompts; XLA for decode steps"

Settings read (llamaspec.plan.read_settings records the ones set):
    LLAMA_PARITY_ATTENTION = auto | fused | reference   (kernel: torchref's only, an error here)
    LLAMA_PARITY_PRODUCTS  = auto | kernel | reference   (one-row 16-bit products on the kernel)
    LLAMA_PARITY_BF16_DOTS = auto | native | widened     (bf16 products in hardware; llamaspec.cpuinfo)
    LLAMA_PARITY_LOGITS    = the lm_head is a product as the others here: read, only recorded
    LLAMA_PARITY_INVARIANT = auto | kernels | portable   (the invariant backend's implementation:
                             llamaspec.plan.INVARIANT_ENV; auto: kernels on an x86 CPU where they build)
    XLA_FLAGS' --xla_cpu_max_isa (YNNPACK's bf16 products do not follow it; the plan does)
"""

from __future__ import annotations

import dataclasses
import os
import platform

import jax

from llamaspec import Policy, cpuinfo
from llamaspec import fixed_order as fo
from llamaspec.errors import InvarianceError, PolicyError
from llamaspec.plan import (
    DECLINABLE_FUNCTIONS,
    INVARIANT_ENV,
    INVARIANT_PATHS,
    ISA_FLAGS,
    OPS,
    Plan,
    backend_name,
    check_family,
    check_xla_flags,
    declines,
    describe_family,
    family_declines,
    family_ops,
    read_settings,
    setting,
)

from . import fast, invariant, ops, portable

ATTENTION_ENV = "LLAMA_PARITY_ATTENTION"
PRODUCTS_ENV = "LLAMA_PARITY_PRODUCTS"
LOGITS_ENV = "LLAMA_PARITY_LOGITS"
BF16_DOTS_ENV = cpuinfo.BF16_DOTS_ENV
KERNEL_ISA_ENV = "LLAMA_PARITY_KERNEL_ISA"
SETTINGS = (ATTENTION_ENV, PRODUCTS_ENV, LOGITS_ENV, BF16_DOTS_ENV, KERNEL_ISA_ENV, "XLA_FLAGS")
# The least kernel code path on which auto takes the kernels: AVX2 (the scalar path is the
# programs' definition, not a fast one).
KERNEL_MIN_ISA = "avx2"
# XLA's --xla_cpu_max_isa values that keep bf16 products in hardware (a prefix: AMX_FP16 too)
_BF16_ISAS = ("AVX512_BF16", "AMX")
# The portable invariant path's rows per product chunk, by device (others: PORTABLE_ROWS_OTHER): a
# CPU's products run near full speed at 16 rows; a GPU's need more rows to fill the device.
PORTABLE_ROWS = {"cpu": 16}
PORTABLE_ROWS_OTHER = 128


def make_plan(policy, device: str = "cpu", backend: str = "fast", cfg=None) -> Plan:
    """The plan for `policy` (a preset name or a Policy) on `device` ("cpu", "gpu", ...) with
    `backend` (one of llamaspec.plan.BACKENDS), for a model of config `cfg` (None: Llama's features)."""
    check_xla_flags()
    backend = backend_name(backend, False)
    check_family(cfg, backend)
    return _for_family(*_decide(Policy.get(policy), device, backend), backend, cfg)[0]


def load(policy, device: str | None, backend: str, layout=None, cfg=None):
    """(plan, op namespace) for a model being loaded (device None: JAX's default backend; layout:
    its sharding.MeshLayout or None; cfg: its config, None for Llama's features)."""
    check_xla_flags()
    backend = backend_name(backend, False)
    check_family(cfg, backend)
    plan, namespace = _decide(Policy.get(policy), device or jax.default_backend(), backend)
    return _for_family(plan, _with_layout(namespace, layout), backend, cfg)


def _for_family(plan: Plan, namespace, backend: str, cfg):
    """(plan, namespace) for a model of config `cfg`: the ops its family's features change run the
    reference's functions (llamaspec.plan.family_declines), and the plan says so (the final
    soft-cap: a reference step after the backend's logits, final_cap_note) and names the family;
    the functions a backend lacks (a family's own steps) come from the reference too
    (WithReference)."""
    if cfg is None:
        return plan, namespace
    described = family_ops(dict(plan.ops), backend, cfg, namespace is ops)
    if cfg.features() and namespace is not ops:
        namespace = WithReference(namespace, frozenset(family_declines(cfg)))
    return dataclasses.replace(plan, ops=tuple((op, described[op]) for op in OPS),
                               model=describe_family(cfg)), namespace


@dataclasses.dataclass(frozen=True)
class WithReference:
    """A backend's op namespace where the functions of `declined` ops, and any function the backend
    does not define (a family's own steps: gelu_tanh, soft_cap, scale_embedding), are the
    reference's (ops.py). Hashable, as the namespaces it wraps: part of a model's graphdef."""
    backend: object
    declined: frozenset

    def __getattr__(self, name):
        if name.startswith("__") or name in ("backend", "declined"):
            raise AttributeError(name)
        if any(name in DECLINABLE_FUNCTIONS[op] for op in self.declined) or not hasattr(self.backend, name):
            return getattr(ops, name)
        return getattr(self.backend, name)

    def __repr__(self) -> str:
        return f"WithReference({self.backend!r}, declined={sorted(self.declined)})"


def _with_layout(namespace, layout):
    if isinstance(namespace, (fast.Fast, portable.Portable)):
        return dataclasses.replace(namespace, layout=layout)
    return namespace


def _choice(name: str, allowed: tuple[str, ...]) -> str:
    note = (" (kernel is torchref's fixed-order attention; jaxmodel's kernel is fused)"
            if name == ATTENTION_ENV else "")
    return setting(name, allowed, note=note)


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _xla_caps() -> list[str]:
    return [a.split("=", 1)[1] for a in os.environ.get("XLA_FLAGS", "").split() if a.startswith("--xla_cpu_max_isa=")]


class _Kernels:
    """The fixed-order kernels' state as this plan found it: built (and their code path) or why not."""

    def __init__(self):
        self.isa: str | None = None
        self.error: str | None = None

    def build(self, required: bool, warn: bool = True) -> bool:
        """Whether the kernels build; required: an error if not, else one warning (warn)."""
        from . import kernels
        try:
            lib = kernels.library()
        except InvarianceError as e:
            if required or isinstance(e, fo.KernelSettingError):    # a bad $LLAMA_PARITY_KERNEL_ISA is refused
                raise
            self.error = str(e)
            if warn:
                fo.kernels_unavailable(str(e))
            return False
        self.isa = fo.ISA_NAMES[lib.fo_isa()]
        return True

    def reach(self, isa: str) -> bool:
        """Whether they build and their code path is `isa` or better."""
        return self.build(False) and fo.ISAS[self.isa] >= fo.ISAS[isa]


def _namespace(device: str, backend: str, kern: "_Kernels"):
    """The backend's op namespace for this machine (the kernels' state noted in kern)."""
    if backend == "reference":
        return ops
    if backend == "invariant":
        return _invariant(device, kern)
    return _fast(device, kern)


def _invariant(device: str, kern: "_Kernels"):
    """The invariant backend's implementation ($LLAMA_PARITY_INVARIANT): the fixed-order kernels
    (invariant.py: CPU code) or the portable path (portable.Portable, any device)."""
    path = setting(INVARIANT_ENV, INVARIANT_PATHS)
    if path == "kernels" and device != "cpu":
        raise InvarianceError(f"{INVARIANT_ENV}=kernels: the invariant backend's fixed-order kernels are CPU code "
                              f"and JAX's backend is {device}; {INVARIANT_ENV}=portable (or auto) runs the portable "
                              "path there")
    if path == "kernels":
        kern.build(True)
        return invariant
    if path == "auto" and device == "cpu" and _x86():
        if kern.build(False, warn=False):
            return invariant
        fo.kernels_unavailable(kern.error)
    return portable.Portable(rows=PORTABLE_ROWS.get(device, PORTABLE_ROWS_OTHER), widen=device == "cpu")


def _invariant_ops(namespace) -> dict:
    """What each op of the invariant backend does, in words (the kernels or the portable path)."""
    if not isinstance(namespace, portable.Portable):
        return {"products": "fixed-order kernel (packed weights)", "logits": "fixed-order kernel (packed weights)",
                "attention": f"fixed-order kernel, {invariant.KEY_BLOCK}-key blocks added in order",
                "rope": "reference (bf16: fast's form, the same bits)", "norm": "fixed-order row sums",
                "mlp": "fixed-order exp (silu)", "cache": "block write where the slots are known"}
    operands = ("16-bit operands widened to f32, f32 dots" if namespace.widen
                else "16-bit operands native, f32 accumulation")
    products = f"portable: one shape, rows in chunks of {namespace.rows} ({operands})"
    return {"products": products, "logits": products,
            "attention": f"portable: elementwise products, halving-tree sums, {portable.KEY_BLOCK}-key blocks "
                         "added in order, portable exp",
            "rope": "portable: the reference's tables and rotation, no product contracted into an fma (bf16: "
                    "fast's form, the same bits)",
            "norm": "portable: halving-tree sum of squares, 1/sqrt",
            "mlp": "portable: exp by llamaspec.portable's program (silu)",
            "cache": "block write where the slots are known"}



def _decide(policy: Policy, device: str, backend: str):
    kern = _Kernels()
    libraries = (("xla max isa", " ".join(_xla_caps()) or "none"),)
    declined = declines(policy)
    if declined and backend == "invariant":
        raise PolicyError(f"policy {policy.name!r}: the invariant backend does not take {declined}")
    if declined and backend == "fast":      # the whole model runs on the reference, and the plan says so
        chosen = {op: f"reference (the fast backend declines {declined})" for op in OPS}
        return _plan(policy, device, backend, kern, read_settings(SETTINGS), libraries, chosen), ops
    namespace = _namespace(device, backend, kern)
    if backend == "reference":
        return _plan(policy, device, backend, kern, (), libraries, {op: "reference" for op in OPS}), namespace
    if backend == "invariant":
        return (_plan(policy, device, backend, kern, read_settings((KERNEL_ISA_ENV, INVARIANT_ENV)), libraries,
                      _invariant_ops(namespace)), namespace)
    return _plan(policy, device, backend, kern, read_settings(SETTINGS), libraries,
                 _fast_ops(namespace, policy)), namespace


def _fast(device: str, kern: _Kernels) -> fast.Fast:
    """The machine's choices for the fast backend, read once."""
    attention = _choice(ATTENTION_ENV, ("auto", "fused", "reference"))
    products = _choice(PRODUCTS_ENV, ("auto", "kernel", "reference"))
    _choice(LOGITS_ENV, ("auto", "kernel", "reference"))
    dots = cpuinfo.dots_choice()
    cpu = device == "cpu"
    on_x86 = cpu and _x86()
    bf16 = dots == "native" or (dots == "auto" and (cpuinfo.has("amx_bf16") or cpuinfo.has("avx512_bf16"))
                                and all(cap.strip().upper().startswith(_BF16_ISAS) for cap in _xla_caps()))

    def kernel(choice: str, name: str) -> bool:
        if choice == "reference" or not on_x86:
            return False
        return kern.build(True) if choice == name else kern.reach(KERNEL_MIN_ISA)

    matvec = kernel(products, "kernel")
    fused = kernel(attention, "fused")
    return fast.Fast(cpu=cpu, bf16_products=cpu and bf16, matvec_kernel=matvec, attention_kernel=fused,
                     attention_f64=fused and attention == "fused")


def _fast_ops(f: fast.Fast, policy: Policy) -> dict:
    """What each op of the fast backend does at this policy, in words."""
    wide = f.widened(policy) is not None
    products = "reference"
    if wide:
        products = "f32 dots on widened 16-bit values"
        if f.native_products(policy):
            products += f"; bf16 products in hardware from {fast.NATIVE_MIN_ROWS} rows"
        if f.kernel_matvecs(policy):
            products += "; one-row products on the fixed-order kernel"
    attention = "fused kernel (attention.h) for prompts, XLA for decode steps" if f.fused_attention(policy) else (
        f"XLA, causal prompts in blocks of {fast.QUERY_BLOCK} queries")
    if wide:
        attention += ("; bf16 products in hardware" if f.native_products(policy) else "; f32 dots on widened values")
    return {"products": products, "logits": products,
            "attention": attention,
            "rope": "bf16 per op in f32, rotate_half as a reversal" if policy.compute_dtype == "bfloat16"
            else "reference",
            "norm": "reference", "mlp": "reference",
            "cache": ("f32 copies of the compute values; " if wide else "") + "block write where the slots are known"}


def _plan(policy: Policy, device: str, backend: str, kern: _Kernels, settings, libraries, chosen: dict) -> Plan:
    name, flags = cpuinfo.name_and_flags()
    return Plan(backend=backend, framework="jax", device=device, policy=policy.name, cpu=name,
                cpu_vendor=cpuinfo.vendor(), cpu_flags=tuple(f for f in ISA_FLAGS if f in flags),
                kernel_isa=kern.isa, kernel_error=kern.error, settings=tuple(settings),
                libraries=tuple(libraries), ops=tuple((op, chosen[op]) for op in OPS))
