"""torchref's plan: how a loaded model computes, decided once at load (llamaspec.plan.Plan).

The only module of torchref that reads environment variables, the CPU's flags and torch's
library states. It turns them into the fast backend's typed choices (fast.Choices) and a
Plan record for reports; model.py holds both (model.plan, the network's ops namespace).

    LLAMA_PARITY_PRODUCTS  = auto | kernel | reference    the fixed-order gemm for few-row / off-Intel products
    LLAMA_PARITY_LOGITS    = auto | kernel | reference    the fixed-order gemm for a bf16 policy's f32 logits
    LLAMA_PARITY_ATTENTION = auto | fused | kernel | reference   torch's sdpa / the fixed-order attention
    LLAMA_PARITY_BF16_DOTS = auto | native | widened      16-bit products in hardware or widened to f32
    LLAMA_PARITY_INVARIANT = auto | kernels | portable     the invariant backend's implementation
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform

import torch

from llamaspec import Policy, cpuinfo
from llamaspec.errors import InvarianceError, PolicyError
from llamaspec.fixed_order import KernelSettingError, kernels_unavailable
from llamaspec.plan import (
    DECLINABLE_FUNCTIONS,
    INVARIANT_ENV,
    INVARIANT_PATHS,
    ISA_FLAGS,
    OPS,
    Plan,
    backend_name,
    check_family,
    declines,
    describe_family,
    family_declines,
    family_ops,
    read_settings,
    setting,
)

from . import fast, invariant, ops, portable

PRODUCTS_ENV = "LLAMA_PARITY_PRODUCTS"
LOGITS_ENV = "LLAMA_PARITY_LOGITS"
ATTENTION_ENV = "LLAMA_PARITY_ATTENTION"
SETTINGS = (PRODUCTS_ENV, LOGITS_ENV, ATTENTION_ENV, cpuinfo.BF16_DOTS_ENV, INVARIANT_ENV, "LLAMA_PARITY_KERNEL_ISA",
            "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
_CHOICES = {PRODUCTS_ENV: ("auto", "kernel", "reference"), LOGITS_ENV: ("auto", "kernel", "reference"),
            ATTENTION_ENV: ("auto", "fused", "kernel", "reference")}

# oneDNN's instruction-set caps (ONEDNN_MAX_CPU_ISA) that keep bf16 / fp16 products in hardware,
# as prefixes: AVX512_CORE_BF16 and above for bf16, AVX512_CORE_FP16 and above for fp16.
_HARDWARE_CAPS = {"bfloat16": ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT"),
                  "float16": ("AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT")}
# The portable invariant path's rows per product call, per device type (any other device: the
# accelerator's): a CPU's decode step pads its rows to this, a GPU's products want tiles of rows.
PORTABLE_ROWS = {"cpu": 16}
PORTABLE_ROWS_ACCELERATOR = 128
# ... and the elements of one product tensor in its attention on an accelerator (a CPU's:
# portable.PIECE, within its caches): a GPU wants few large elementwise kernels.
PORTABLE_PIECE_ACCELERATOR = 1 << 26
# the CPU flags of bf16 / fp16 products in hardware, the AMX one first
_HARDWARE_FLAGS = {"bfloat16": ("amx_bf16", "avx512_bf16"), "float16": ("amx_fp16", "avx512_fp16")}


def _choice(env: dict, name: str) -> str:
    return setting(name, _CHOICES[name], env.get(name, ""))


def hardware_products(dtype: str, flags: frozenset, dots: str, cap: str, mkldnn: bool) -> bool:
    """Whether torch multiplies `dtype` (bf16 / fp16) matrices of many rows in hardware here: oneDNN
    on AMX tiles or AVX-512 pair products, enabled and not capped below them; elsewhere torch runs
    them in software, several times slower than its f32 product, so the fast backend widens them.
    $LLAMA_PARITY_BF16_DOTS overrides (native: torch's 16-bit kernels anywhere; widened)."""
    if dots != "auto":
        return dots == "native"
    return any(f in flags for f in _HARDWARE_FLAGS[dtype]) and cap.startswith(_HARDWARE_CAPS[dtype]) and mkldnn


def _kernel_isa(needed: bool, strict: bool) -> tuple[int | None, str | None]:
    """(the fixed-order kernels' code path, why they could not be built): (None, None) when not needed."""
    if not needed:
        return None, None
    try:
        return fast.fixed_order_kernels().fo_isa(), None
    except InvarianceError as e:
        if strict or isinstance(e, KernelSettingError):    # a bad $LLAMA_PARITY_KERNEL_ISA is refused
            raise
        kernels_unavailable(str(e))
        return None, str(e)


def choices(policy: Policy, device: torch.device, env: dict) -> fast.Choices:
    """The fast backend's choices for `policy` on `device` from these settings and this machine."""
    flags = cpuinfo.name_and_flags()[1]
    dots = cpuinfo.dots_choice(env.get(cpuinfo.BF16_DOTS_ENV))
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "ALL").strip().upper()
    mkldnn = torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled)
    hardware = {d: hardware_products(d, flags, dots, cap, mkldnn) for d in _HARDWARE_FLAGS}
    amx = {d: hardware[d] and _HARDWARE_FLAGS[d][0] in flags
           and cap.startswith(("AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT")) for d in _HARDWARE_FLAGS}
    products, logits, attention = (_choice(env, n) for n in (PRODUCTS_ENV, LOGITS_ENV, ATTENTION_ENV))
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    cpu = device.type == "cpu"
    strict = "kernel" in (products, logits, attention)
    isa, error = _kernel_isa(cpu and x86 and (policy.compute_dtype in ("float32", "bfloat16", "float16")
                                              or strict), strict)
    return fast.Choices(
        products=products, logits=logits, attention=attention, x86=x86, kernel_isa=isa, kernel_error=error,
        hardware_bf16=hardware["bfloat16"], hardware_fp16=hardware["float16"], amx_bf16=amx["bfloat16"],
        amx_fp16=amx["float16"], dots_auto=dots == "auto",
        mkl_off_intel=torch.backends.mkl.is_available() and cpuinfo.vendor() not in ("", "GenuineIntel"),
        one_row_order=one_row_order() if isa is not None and policy.compute_dtype in ("bfloat16", "float16")
        else None)


@functools.cache
def one_row_order() -> str | None:
    """How this torch sums one row of 16-bit operands (fast.ONE_ROW_ORDERS, by its CPU capability),
    confirmed once against torch.dot, which runs the same kernel for up to 4096 elements, on rows
    built so that any other order of the sums gives other bits (a large value and its negative
    among small ones: what the small ones lose to rounding depends on when each is added). None
    where the capability is not in ONE_ROW_ORDERS or torch's dot gives other bits (another
    torch's kernel): the fast backend then leaves one-row products to torch."""
    order = fast.ONE_ROW_ORDERS.get(torch.backends.cpu.get_cpu_capability())
    if order is None:
        return None
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        x, w = order_probe(64 * 3 + 16 + 5, 64, dtype, g)    # the 64-element blocks, a 16-element tail, 5 more
        torch_bits = torch.stack([torch.dot(row, x) for row in w])
        if not torch.equal(fast.one_row_linear(x[None], w, None, order == "sequential")[0], torch_bits):
            return None
    return order


def order_probe(K: int, rows: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x [K] and w [rows, K] of `dtype` whose dots' bits depend on the order of their sums: each row
    holds a large value and its negative (2^20 in bf16, 2^10 in fp16) at two places where x is 1,
    among values near 1, which round against the large partial sums or not by when each is added."""
    big = 2.0 ** 20 if dtype == torch.bfloat16 else 2.0 ** 10
    x, w = torch.randn(K, generator=g), torch.randn(rows, K, generator=g)
    if K >= 4:
        ones = torch.randperm(K, generator=g)[:max(2, K // 4)]
        x[ones] = 1.0
        for n in range(rows):
            i, j = ones[torch.randperm(len(ones), generator=g)[:2]].tolist()
            w[n, i], w[n, j] = big, -big
    return x.to(dtype), w.to(dtype)


class WithReference:
    """A backend's op namespace where the functions of `declined` ops, and any function the backend
    does not define (a family's own steps: gelu_tanh, soft_cap, scale_embedding), are the
    reference's (ops.py)."""

    def __init__(self, backend, declined):
        self.backend, self.declined = backend, frozenset(declined)
        self._reference = {f for op in self.declined for f in DECLINABLE_FUNCTIONS[op]}

    def __getattr__(self, name):
        if name.startswith("__") or name in ("backend", "declined", "_reference"):
            raise AttributeError(name)
        if name in self._reference or not hasattr(self.backend, name):
            return getattr(ops, name)
        return getattr(self.backend, name)

    def __repr__(self) -> str:
        return f"WithReference({self.backend!r}, declined={sorted(self.declined)})"


def make_backend(policy: str | Policy, device="cpu", backend: str | None = "fast", cfg=None):
    """(Plan, the ops namespace every module calls) for `backend` at `policy` on `device`, for a
    model of config `cfg` (None: Llama's features)."""
    policy, device = Policy.get(policy), torch.device(device)
    backend = backend_name(backend, False)
    check_family(cfg, backend)
    env = {n: os.environ[n] for n in SETTINGS if n in os.environ}
    name, flags = cpuinfo.name_and_flags()
    isa, error = None, None
    declined = declines(policy)
    if declined and backend == "invariant":
        raise PolicyError(f"policy {policy.name!r}: the invariant backend does not take {declined}")
    if declined and backend == "fast":      # the whole model runs on the reference, and the plan says so
        namespace, described = ops, {op: f"reference (the fast backend declines {declined})" for op in OPS}
    elif backend == "fast":
        c = choices(policy, device, env)
        namespace, described = fast.namespace(c), fast.describe(c, policy, device)
        isa, error = c.kernel_isa, c.kernel_error
    elif backend == "invariant":
        path, isa, error = invariant_path(device, env)
        if path == "kernels":
            namespace = invariant
            described = {op: "fixed-order kernels (batch-invariant)"
                         for op in ("products", "logits", "attention", "norm", "mlp")}
        else:
            namespace = portable.Portable(PORTABLE_ROWS.get(device.type, PORTABLE_ROWS_ACCELERATOR),
                                          native_half=device.type == "cuda",
                                          piece=None if device.type == "cpu" else PORTABLE_PIECE_ACCELERATOR)
            described = describe_portable(namespace)
    else:
        namespace, described = ops, {}
    described = family_ops(described, backend, cfg, namespace is ops)
    if cfg is not None and cfg.features() and namespace is not ops:
        namespace = WithReference(namespace, family_declines(cfg))
    plan = Plan(backend=backend, framework="torch", device=str(device), policy=policy.name, cpu=name,
                cpu_vendor=cpuinfo.vendor(), cpu_flags=tuple(f for f in ISA_FLAGS if f in flags),
                kernel_isa=None if isa is None else _isa_name(isa), kernel_error=error,
                settings=read_settings(SETTINGS), libraries=_libraries(),
                ops=tuple((op, described.get(op, "reference")) for op in OPS),
                model="" if cfg is None else describe_family(cfg))
    return plan, namespace


def invariant_path(device: torch.device, env: dict) -> tuple[str, int | None, str | None]:
    """(the invariant backend's implementation, the fixed-order kernels' code path, why they could
    not be built) from $LLAMA_PARITY_INVARIANT: auto = the kernels on an x86-64 CPU where they
    build, portable elsewhere; kernels asked for on another device or where they do not build is
    an error naming the setting."""
    choice = setting(INVARIANT_ENV, INVARIANT_PATHS, env.get(INVARIANT_ENV, ""))
    if choice == "portable":
        return "portable", None, None
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if choice == "kernels" and (device.type != "cpu" or not x86):
        where = f"the model is on {device}" if device.type != "cpu" else f"this CPU is {platform.machine()}"
        raise PolicyError(f"{INVARIANT_ENV}=kernels: the fixed-order kernels are x86-64 CPU code and {where}; "
                          f"set {INVARIANT_ENV}=portable (or auto) for the portable invariant path")
    if device.type != "cpu" or not x86:
        return "portable", None, None
    try:
        return "kernels", fast.fixed_order_kernels().fo_isa(), None
    except InvarianceError as e:
        if isinstance(e, KernelSettingError):     # a bad $LLAMA_PARITY_KERNEL_ISA is refused
            raise
        if choice == "kernels":
            raise InvarianceError(f"{INVARIANT_ENV}=kernels: the fixed-order kernels do not build here ({e})") from e
        kernels_unavailable(str(e))
        return "portable", None, str(e)


def describe_portable(namespace: portable.Portable) -> dict[str, str]:
    """The plan's words for the portable invariant path's ops."""
    rows, kb = namespace.rows, portable.KEY_BLOCK
    half = "16-bit operands as they are, f32 sums" if namespace.native_half else "16-bit operands widened to f32"
    products = f"portable: products in fixed [{rows}, K] calls of torch's matmul (the last rows zero-padded; {half})"
    return {"products": products, "logits": products.replace("products in", "lm_head in"),
            "attention": f"portable: {kb}-key blocks, q.k and p.v as elementwise products summed by a halving "
                         f"tree (pieces of {namespace.piece or portable.PIECE} elements), blocks added in order, "
                         "llamaspec.portable's exp",
            "norm": "portable: sum of squares by a halving tree, 1/sqrt",
            "mlp": "portable: silu with llamaspec.portable's exp",
            "rope": f"portable: tables in chunks of {portable.ROPE_CHUNK} positions, gathered"}


def make_plan(policy: str | Policy, device="cpu", backend: str | None = "fast") -> Plan:
    """The Plan from_pretrained(..., backend=backend) would hold for `policy` on `device` here."""
    return make_backend(policy, device, backend)[0]


def _isa_name(isa: int) -> str:
    from llamaspec import fixed_order as fo
    return fo.ISA_NAMES[isa]


def _libraries() -> tuple[tuple[str, str], ...]:
    """The torch library states a plan depends on."""
    return (("torch", torch.__version__), ("torch cpu capability", torch.backends.cpu.get_cpu_capability()),
            ("torch blas", "mkl" if torch.backends.mkl.is_available() else "other"),
            ("onednn", "enabled" if torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
             else "off"),
            ("onednn fp32 precision", str(torch.backends.mkldnn.matmul.fp32_precision)))


@contextlib.contextmanager
def check_matmul_settings(policy, device):
    """Runs a call after checking that torch's process-wide matmul settings realise the policy on
    `device` (read at every call, never changed here: they belong to the user's process). A setting
    that contradicts the policy is an error naming it and the value the policy needs.

    CPUs have no TF32 (a tf32 policy is IEEE f32 there), and oneDNN's fp32_precision must leave
    f32 products in f32 ("none" or "ieee"). On CUDA, PyTorch's default is IEEE f32 and JAX's TF32,
    so the policy says which one; and cuBLAS' reduced-precision reductions (bf16/fp16 partial sums)
    contradict a policy that sums 16-bit products in f32 (torch's default allows them: a bf16
    policy on CUDA needs torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False,
    set by the caller; an f32 or f64 policy is not concerned)."""
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
        # each flag governs the products of its own 16-bit dtype only (torch's default: True)
        flag = {"bfloat16": "allow_bf16_reduced_precision_reduction",
                "float16": "allow_fp16_reduced_precision_reduction"}.get(policy.compute_dtype)
        low_accum = policy.accum_dtype in ("bfloat16", "float16")
        if flag and getattr(mm, flag) and not low_accum:
            wrong.append((f"torch.backends.cuda.matmul.{flag}", True, "False"))
    if wrong:
        raise PolicyError(f"policy {policy.name!r} on {device}: " + "; ".join(
            f"{name} is {value!r}, the policy needs {need}" for name, value, need in wrong))
    yield
