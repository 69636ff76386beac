"""The fast backend: ops.py's ops under the same names and signatures, each a drop-in for the
reference op of its name, run on the paths this machine does fastest (torch's fused attention,
the fixed-order kernels of llamaspec/fixed_order.h, products widened where torch's 16-bit ones run
in software). The same products and roundings as the reference, summed in other orders (drift,
judged against the reference by the ladder: tests/test_backends.py).

Every choice comes from `Choices`, made once by plan.py from the policy, the CPU and the settings;
nothing here reads the environment. Ops it has nothing faster for are the reference's
(Fast.__getattr__). docs/performance.md says how to choose and what each path gains.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from llamaspec import Policy
from llamaspec import fixed_order as fo
from llamaspec.forward import scale_queries

from . import ops
from .dtypes import cast, dt, from_numpy, to_numpy

_HALF = (torch.bfloat16, torch.float16)   # the 16-bit compute dtypes, whose products f32 holds exactly
# A product of at most this many rows (a decode step of a small batch) is "few rows": the
# fixed-order gemm where it applies, else torch's f32 product in blocks of ROW_BLOCK weight rows.
FEW_ROWS = 16
ROW_BLOCK = 64
# A 16-bit product of this many rows or more widens its operands to f32 on a CPU without hardware
# 16-bit products; fewer rows keep torch's own kernel, which reads the weight's 16-bit bytes.
WIDE_MIN_ROWS = 8
# Queries per attention block: a long prompt's scores are computed QUERY_BLOCK queries at a time.
QUERY_BLOCK = 128


class Choices(NamedTuple):
    """What plan.py decided for the fast backend (the settings' values, this CPU's facts)."""
    products: str            # LLAMA_PARITY_PRODUCTS: auto | kernel | reference
    logits: str              # LLAMA_PARITY_LOGITS: auto | kernel | reference
    attention: str           # LLAMA_PARITY_ATTENTION: auto | fused | kernel | reference
    x86: bool                # an x86-64 CPU (the fixed-order kernels build there only)
    kernel_isa: int | None   # the fixed-order kernels' code path (fixed_order.ISAS), None: not built
    kernel_error: str | None  # why they could not be built
    hardware_bf16: bool      # torch multiplies bf16 matrices in hardware (oneDNN, not capped below it)
    hardware_fp16: bool
    amx_bf16: bool           # ... on AMX tiles
    amx_fp16: bool
    dots_auto: bool          # LLAMA_PARITY_BF16_DOTS is auto
    mkl_off_intel: bool      # torch's BLAS is MKL on a CPU known not to be Intel's
    one_row_order: str | None = None   # torch's order for one 16-bit row (ONE_ROW_ORDERS), None: unknown

    def hardware(self, dtype: torch.dtype) -> bool:
        return self.hardware_bf16 if dtype == torch.bfloat16 else self.hardware_fp16

    def amx(self, dtype: torch.dtype) -> bool:
        return self.amx_bf16 if dtype == torch.bfloat16 else self.amx_fp16


def namespace(c: Choices):
    """The ops every module of a fast model calls: Fast, with the reference's ops where a
    setting asks for them (products, attention = reference)."""
    return Fast(c)


# ----- the rules (pure functions of the choices, the dtypes and the shape) ------------------

def _isa_at_least(c: Choices, name: str) -> bool:
    return c.kernel_isa is not None and c.kernel_isa >= fo.ISAS[name]


def _native(compute: torch.dtype, accum: torch.dtype, out: torch.dtype) -> bool:
    """Whether torch's own kernel for `compute` operands realises this accumulation: the same
    dtype, or bf16/fp16 operands summed in f32 and rounded back to their dtype (torch's CPU and
    CUDA kernels). Elsewhere the operands are widened: their products are exact in the wider type."""
    return accum == compute or (compute in _HALF and accum == torch.float32 and out == compute)


def _widens(c: Choices, compute, accum, out, rows: int, device: torch.device) -> bool:
    """Whether a product of `rows` rows goes to torch widened to accum."""
    if not _native(compute, accum, out):
        return True
    return (compute in _HALF and accum != compute and device.type == "cpu" and rows >= WIDE_MIN_ROWS
            and not c.hardware(compute))


def _pairs_of_few_rows(c: Choices, compute: torch.dtype, rows: int) -> bool:
    """2 to FEW_ROWS rows of 16-bit operands that torch would multiply with oneDNN's AVX-512 pair
    products (slow for so few rows) on a CPU without AMX tiles. One row is torch's own order
    (one_row_in_torch_order)."""
    return 1 < rows <= FEW_ROWS and compute in _HALF and c.dots_auto and c.hardware(compute) and not c.amx(compute)


# torch's CPU capability -> how its one-row 16-bit product sums its 8 lanes (fixed_order.h, AtenDots)
ONE_ROW_ORDERS = {"AVX512": "butterfly", "AVX2": "butterfly", "DEFAULT": "sequential"}


def one_row_in_torch_order(c: Choices, dtype: torch.dtype, rows: int, device: torch.device) -> bool:
    """Whether a product of one row of 16-bit operands runs on the kernels' copy of torch's own
    one-row kernel (one_row_linear): on the CPU where the kernels build and torch's order is known
    (plan.py confirms it against torch.dot once). torch itself sends such a product to oneDNN where
    oneDNN multiplies 16-bit numbers in hardware (slower for one row: bench/results, 2026-12-08)
    and to this kernel elsewhere; here it is this kernel on every CPU: torch's bits at its capability."""
    return (rows == 1 and dtype in _HALF and device.type == "cpu" and c.products == "auto"
            and c.kernel_isa is not None and c.one_row_order is not None)


def kernel_products(c: Choices, compute, accum, out, rows: int, device: torch.device) -> bool:
    """Whether a product runs on the fixed-order gemm: f32 sums of f32 operands (or of 16-bit ones
    torch would widen, or of 2..FEW_ROWS rows torch would pair), on an x86-64 CPU whose kernel code
    path is AVX2 or better, of at most FEW_ROWS rows (memory-bound: the kernel reads each packed
    weight byte once on all threads) or, more rows, where MKL runs off Intel. kernel: any rows."""
    if not (device.type == "cpu" and accum == torch.float32 and compute in (torch.float32, *_HALF)):
        return False
    if c.products == "reference" or not c.x86 or c.kernel_isa is None:
        return False
    if c.products == "auto" and (
            (compute in _HALF and not _widens(c, compute, accum, out, rows, device)
             and not _pairs_of_few_rows(c, compute, rows))
            or (rows > FEW_ROWS and not c.mkl_off_intel)):
        return False
    return c.products == "kernel" or _isa_at_least(c, "avx2")


def kernel_logits(c: Choices, compute, accum, out, rows: int, device: torch.device) -> bool:
    """Whether a bf16 policy's f32 logits of a few rows run on the fixed-order gemm (the weight
    packed once in bf16, read at 2 bytes a value) instead of torch's f32 product over a widened
    copy: one row on AVX2 or better, up to FEW_ROWS on AVX-512-BF16; kernel: any few rows."""
    if not (compute == torch.bfloat16 and accum == torch.float32 and out == torch.float32
            and rows <= FEW_ROWS and device.type == "cpu"):
        return False
    if c.logits == "reference" or not c.x86 or c.kernel_isa is None:
        return False
    return c.logits == "kernel" or _isa_at_least(c, "avx2" if rows == 1 else "avx512_bf16")


def kernel_attention_applies(c: Choices, policy: Policy, device: torch.device) -> bool:
    """Whether attention runs on the fixed-order attention kernel: a bf16 policy (bf16 operands,
    f32 sums and softmax) on an x86-64 CPU, prompts and decode steps alike; not where torch's
    bf16 products run on AMX tiles (unmeasured there) unless asked for (kernel)."""
    if not (policy.compute_dtype == "bfloat16" and policy.accum_dtype == "float32"
            and policy.softmax_dtype == "float32" and device.type == "cpu" and c.x86):
        return False
    if c.attention in ("fused", "reference") or (c.attention == "auto" and c.amx_bf16):
        return False
    return c.kernel_isa is not None


def fused_attention_applies(c: Choices, policy: Policy, device: torch.device) -> bool:
    """Whether a long prompt's attention (2 * QUERY_BLOCK queries or more) runs on torch's fused
    kernel (sdpa): auto, on the CPU, for a policy whose attention is f32 throughout with IEEE
    products (a 16-bit policy rounds its probabilities, the kernel its unnormalised exps);
    fused: also f64, on any device."""
    kinds = {policy.compute_dtype, policy.accum_dtype, policy.softmax_dtype}
    if c.attention == "fused":
        return kinds in ({"float32"}, {"float64"})
    return c.attention == "auto" and kinds == {"float32"} and policy.matmul == "ieee" and device.type == "cpu"


class _ProductsPlan(NamedTuple):
    on_kernel: bool     # on the fixed-order gemm; the rest is then unused
    dtype: torch.dtype  # torch's operands: compute_dtype, or accum_dtype where the product widens
    product: Callable   # torch.nn.functional.linear, or _linear_by_row_blocks for a few f32 rows


@functools.lru_cache(maxsize=256)
def _products_plan(c: Choices, compute, accum, out, rows: int, device: torch.device) -> _ProductsPlan:
    if kernel_products(c, compute, accum, out, rows, device):
        return _ProductsPlan(True, compute, torch.nn.functional.linear)
    dtype = accum if _widens(c, compute, accum, out, rows, device) else compute
    if one_row_in_torch_order(c, dtype, rows, device):
        order = functools.partial(one_row_linear, sequential=c.one_row_order == "sequential")
        return _ProductsPlan(False, dtype, order)
    few_f32 = dtype == torch.float32 and rows <= FEW_ROWS and device.type == "cpu"
    return _ProductsPlan(False, dtype, _linear_by_row_blocks if few_f32 else torch.nn.functional.linear)


# ----- the backend ------------------------------------------------------------------------

class Fast:
    """The fast backend's op namespace (plan.py builds it): ops.py's names and signatures."""

    def __init__(self, choices: Choices):
        self.choices = choices

    def __getattr__(self, name):
        return getattr(ops, name)   # the reference's op where the backend has nothing faster

    def linear(self, x, w, b, policy: Policy, out_dtype: str | None = None) -> torch.Tensor:
        """ops.linear; a bf16 policy's f32 logits of a few rows on the fixed-order gemm
        (kernel_logits), the rest as linears."""
        c, compute, accum = self.choices, dt(policy.compute_dtype), dt(policy.accum_dtype)
        out = dt(out_dtype or policy.compute_dtype)
        if out != compute and c.logits == "reference":
            return ops.linear(x, w, b, policy, out_dtype)
        if kernel_logits(c, compute, accum, out, x.numel() // max(x.shape[-1], 1), x.device):
            return packed_linears(x, (w,), (b,), policy, out_dtype)[0]
        return self.linears(x, (w,), (b,), policy, out_dtype)[0]

    def linears(self, x, ws, bs, policy: Policy, out_dtype: str | None = None) -> list[torch.Tensor]:
        """ops.linears: the fixed-order gemm (kernel_products: one product for the weights that read
        x), or torch's product on operands rounded to compute_dtype and widened where the product
        widens (exact: the same operands), a few f32 rows in blocks of weight rows."""
        c = self.choices
        if c.products == "reference":
            return ops.linears(x, ws, bs, policy, out_dtype)
        compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
        out = dt(out_dtype or policy.compute_dtype)
        on_kernel, dtype, product = _products_plan(c, compute, accum, out, x.numel() // max(x.shape[-1], 1),
                                                   x.device)
        if on_kernel:
            return _kernel_linears(x, ws, bs, compute, out)
        x = cast(cast(x, compute), dtype)
        return [cast(product(x, _widened(cast(w, compute), dtype), _bias(b, compute, dtype)), out)
                for w, b in zip(ws, bs)]

    def apply_rope(self, x, cos, sin) -> torch.Tensor:
        """ops.apply_rope; a bf16 prompt's on the fixed-order kernels (rope_kernel: the same bits)."""
        if (x.shape[1] >= 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[-1] % 2 == 0
                and self.choices.kernel_isa is not None):
            return rope_kernel(x, cos, sin)
        return ops.apply_rope(x, cos, sin)

    def attention(self, q, k, v, allowed, policy: Policy) -> torch.Tensor:
        """ops.attention: the fixed-order kernel (a bf16 policy), or in blocks of QUERY_BLOCK
        queries, a long f32 prompt's on torch's fused kernel (attention)."""
        if self.choices.attention == "reference":
            return ops.attention(q, k, v, allowed, policy)
        return attention(self.choices, q, k, v, allowed, policy)

    def write_cache(self, cache, slots, x) -> None:
        """ops.write_cache; where every row's slots are one block of the cache (a prompt from slot 0,
        a decode step at one slot), one copy of that block instead of the scatter: the same values."""
        start = one_block(slots, cache.shape[2]) if cache.device.type == "cpu" else None
        if start is None:
            return ops.write_cache(cache, slots, x)
        cache.narrow(2, start, x.shape[1]).copy_(x.transpose(1, 2))

    def times(self, a, b, *made_from) -> torch.Tensor:
        """ops.times, written into a where that is safe (times_in_place): the same bits, one
        [tokens, intermediate] tensor fewer per layer (less heap churn on long prompts)."""
        return times_in_place(a, b, *made_from)

    def cache_dtype(self, policy: Policy, device) -> torch.dtype:
        """The KV cache's dtype: accum_dtype where attention's products widen (the same values;
        no step widens the whole cache again), compute_dtype where the fixed-order attention reads
        bf16 keys as they are."""
        c, device = self.choices, torch.device(device)
        compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
        if c.attention == "reference" or kernel_attention_applies(c, policy, device):
            return compute
        return accum if _widens(c, compute, accum, compute, WIDE_MIN_ROWS, device) else compute


def one_block(slots: torch.Tensor, S: int) -> int | None:
    """The first slot where slots [B, T] are, in every row, start .. start + T - 1 within S slots."""
    s = slots.numpy()
    start = int(s[0, 0])
    if not (0 <= start and start + s.shape[1] <= S) or (s[:, 0] != start).any():
        return None
    if s.shape[1] > 1 and (s[:, 1:] - s[:, :-1] != 1).any():
        return None
    return start


def times_in_place(a: torch.Tensor, b: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """a * b, written into a where that is the same tensor: a of b's shape and dtype, sharing
    memory with neither b nor `inputs` (the tensors a was made from, which a control's op may
    return as they are or as a view), no gradient being taken. The same multiplications."""
    if a.shape != b.shape or a.dtype != b.dtype or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return a * b
    memory = a.untyped_storage().data_ptr()
    for t in (b, *inputs):
        if t.untyped_storage().data_ptr() == memory:
            return a * b
    return a.mul_(b)


# ----- products ---------------------------------------------------------------------------

def _bias(b: torch.Tensor | None, compute: torch.dtype, dtype: torch.dtype) -> torch.Tensor | None:
    """A bias as linears adds it: rounded to compute_dtype, then in the product's dtype."""
    return None if b is None else cast(cast(b, compute), dtype)


def _widened(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in `dtype`: a 16-bit weight widened once per tensor and kept while it lives (kept)."""
    if w.dtype == dtype:
        return w
    if w.dtype not in _HALF:
        return w.to(dtype)
    return kept((w,), dtype, lambda: w.detach().to(dtype))


def kept(tensors: tuple, what, make):
    """make()'s result for these tensors (what: a key telling results of the same tensors
    apart), made once and kept while every one of them lives, made again when one changes in
    place (its version counter moves): a widened or packed copy of weights. Inference tensors
    keep no version counter: for them make() runs every call."""
    if any(t.is_inference() for t in tensors):
        return make()
    key = (tuple(map(id, tensors)), what)
    versions = tuple(t._version for t in tensors)
    entry = _KEPT.get(key)
    if entry is None or any(ref() is not t for ref, t in zip(entry[0], tensors)) or entry[1] != versions:
        with torch.inference_mode(False):
            made = make()
        # the weak references drop the entry when a tensor dies, before its id can be reused
        drop = lambda _, key=key: _KEPT.pop(key, None)  # noqa: E731
        entry = _KEPT[key] = (tuple(weakref.ref(t, drop) for t in tensors), versions, made)
    return entry[2]


# (ids of weights, what) -> (weak refs, versions, their widened or packed copy)
_KEPT: dict[tuple, tuple] = {}


def _linear_by_row_blocks(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + b for f32 x of a few rows: w's rows in blocks of ROW_BLOCK as one batched product
    (the last N mod ROW_BLOCK rows a product of their own), so that torch's threads share the
    weight's bytes (MKL multiplies a few rows on one core). The same products, grouped otherwise."""
    K, N = x.shape[-1], w.shape[0]
    rows = x.reshape(-1, K)
    n_blocks = N // ROW_BLOCK
    parts = []
    if n_blocks:
        blocks = w[:n_blocks * ROW_BLOCK].reshape(n_blocks, ROW_BLOCK, K)
        by_block = torch.bmm(blocks, rows.t().expand(n_blocks, K, rows.shape[0]))     # [blocks, ROW_BLOCK, M]
        parts.append(by_block.permute(2, 0, 1).reshape(rows.shape[0], n_blocks * ROW_BLOCK))
    if N % ROW_BLOCK:
        parts.append(rows @ w[n_blocks * ROW_BLOCK:].t())
    y = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], N)


def one_row_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, sequential: bool) -> torch.Tensor:
    """torch.nn.functional.linear(x, w, b) for one row x of bf16 or fp16 and w, b of its dtype, as
    torch computes it where oneDNN does not take it (ATen's dot kernel, copied in fixed_order.h:
    AtenDots; its lanes summed in order at torch's DEFAULT capability): each output's f32 dot, the
    bias added in f32, rounded once to x's dtype. The same bits as torch's (tests/test_aten_order.py)."""
    K, N = x.shape[-1], w.shape[0]
    row, w = x.reshape(K).contiguous(), w.contiguous()
    y = torch.empty(N, dtype=torch.float32)
    fixed_order_kernels().fo_aten_dots(N, K, row.data_ptr(), w.data_ptr(), K, int(x.dtype == torch.float16),
                                       int(sequential), y.data_ptr(), torch.get_num_threads())
    if b is not None:
        y += b.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def _kernel_linears(x: torch.Tensor, ws, bs, compute: torch.dtype, out: torch.dtype) -> list[torch.Tensor]:
    """linears on the fixed-order gemm: the weights rounded to compute_dtype, stacked and packed
    once (_panels), x's rows in f32, one f32 multiply-add chain per output, each bias added in f32,
    the result rounded once to `out`."""
    K = x.shape[-1]
    rows = cast(cast(x, compute), torch.float32).reshape(-1, K).contiguous()
    packed, wtype = _panels(tuple(ws), compute)
    sizes = [w.shape[0] for w in ws]
    n = sum(sizes)
    y = fixed_order_gemm(rows, packed, wtype, n)
    for part, b in zip(y.split(sizes, dim=-1), bs):
        if b is not None:
            part += _bias(b, compute, torch.float32)
    y = cast(y, out).reshape(*x.shape[:-1], n)
    return list(y.split(sizes, dim=-1)) if len(ws) > 1 else [y]


def _panels(ws: tuple, compute: torch.dtype) -> tuple[torch.Tensor, int]:
    """The weights stacked and packed in the kernels' panel layout, with the kernel's weight
    type: made once per set of tensors and kept while they live (kept)."""
    wtype = fo.WTYPES[str(compute).removeprefix("torch.")]

    def make():
        w = torch.cat([cast(w.detach(), compute) for w in ws]).contiguous()
        N, K = w.shape
        packed = torch.empty(fo.PANEL * -(-N // fo.PANEL) * K, dtype=compute)
        fixed_order_kernels().fo_pack(w.data_ptr(), wtype, N, K, K, 1, packed.data_ptr())
        return packed
    return kept(ws, ("panels", compute), make), wtype


class Packed(NamedTuple):
    """Weights stacked and packed for the fixed-order gemm as llamaspec.fixed_order.pack_for decides
    (bf16 weights of a bf16 policy with f32 sums: the kernel's bf16 pair program)."""
    data: torch.Tensor   # the weights stacked, in fixed_order's panel layout
    wtype: int
    n: int               # rows of the stacked weights (outputs)
    bias: torch.Tensor | None
    x_dtype: torch.dtype  # what the kernel takes x in


def pack(ws, bs, policy: Policy) -> Packed:
    """The weights stacked and packed once per set of tensors, kept while they live (kept), again
    when one is replaced or changed in place (its version counter moves)."""
    def make():
        acc = torch.float64 if dt(policy.accum_dtype) == torch.float64 else torch.float32
        w = torch.cat([w.detach().cpu() for w in ws])
        packed, wtype, x_dtype, _ = fo.pack_for(to_numpy(w), policy.compute_dtype, policy.accum_dtype)
        bias = (torch.cat([b.detach().to(dt(policy.compute_dtype)).to(acc) for b in bs])
                if all(b is not None for b in bs) else None)
        return Packed(from_numpy(packed), wtype, w.shape[0], bias, dt(x_dtype))
    tensors = tuple(ws) + tuple(b for b in bs if b is not None)
    return kept(tensors, ("fixed-order", policy.compute_dtype, policy.accum_dtype), make)


def packed_linears(x: torch.Tensor, ws, bs, policy: Policy, out_dtype: str | None = None, gemm=None
                   ) -> list[torch.Tensor]:
    """linears as one fixed-order product against the weights packed once (pack): operands rounded
    to compute_dtype, products summed in the accumulator in the kernel's order, bias added, rounded
    once to out_dtype; the same bits for a row whatever the rows beside it (invariant.linears'
    product, and the fast backend's bf16 logits of a few rows). gemm(rows, packed): the product."""
    if any(b is not None for b in bs) and not all(b is not None for b in bs):
        return [packed_linears(x, (w,), (b,), policy, out_dtype, gemm)[0] for w, b in zip(ws, bs)]
    packed = pack(ws, bs, policy)
    rows = x.reshape(-1, x.shape[-1]).to(dt(policy.compute_dtype)).to(packed.x_dtype).contiguous()
    y = (gemm or _packed_gemm)(rows, packed)
    if packed.bias is not None:
        y = y + packed.bias
    y = y.to(dt(out_dtype or policy.compute_dtype)).reshape(*x.shape[:-1], packed.n)
    return list(y.split([w.shape[0] for w in ws], dim=-1)) if len(ws) > 1 else [y]


def _packed_gemm(rows: torch.Tensor, packed: Packed) -> torch.Tensor:
    return fixed_order_gemm(rows, packed.data, packed.wtype, packed.n)


def fixed_order_gemm(rows: torch.Tensor, packed: torch.Tensor, wtype: int, n: int) -> torch.Tensor:
    """rows [M, K] (contiguous: f32, f64 for f64 weights, bf16 for the bf16 pair program) @ w^T
    for the n rows of w packed in `packed`: [M, n] in f32 (f64 for f64 rows), on torch's threads."""
    M, K = rows.shape
    y = torch.empty((M, n), dtype=torch.float32 if rows.dtype == torch.bfloat16 else rows.dtype)
    fixed_order_kernels().fo_gemm(M, n, K, rows.data_ptr(), K, packed.data_ptr(), wtype, y.data_ptr(), n,
                                  torch.get_num_threads())
    return y


@functools.cache
def fixed_order_kernels():
    """fixed_order's library, its parallel work on torch's OpenMP threads where torch has GNU
    OpenMP (a pool of its own would compete with torch's spinning threads for the cores)."""
    lib = fo.library()
    fo.use_openmp(_torch_openmp())
    return lib


def _torch_openmp() -> str | None:
    """The GNU OpenMP runtime this torch loaded (a path), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libgomp" in path.rsplit("/", 1)[-1]:
                    return path
    except OSError:
        pass
    return None


# ----- RoPE ---------------------------------------------------------------------------------

def rope_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ops.apply_rope for bf16 x [B, T, H, D] in one call of the fixed-order kernels (RopeJob):
    each of apply_rope's bf16 ops in f32 rounded to bf16 as torch's bf16 ops round, so the same
    bits (a NaN stays NaN, its sign may differ), without apply_rope's temporaries. The tables
    [B, T, D] (or broadcast to it) are rounded to bf16 first, as apply_rope rounds them."""
    B, T, H, D = x.shape
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    c, s = (cast(t, torch.bfloat16).expand(B, T, D) for t in (cos, sin))
    if c.stride(-1) != 1 or c.stride() != s.stride():   # one set of strides for both tables
        c, s = c.contiguous(), s.contiguous()
    part = [x.data_ptr(), *x.stride()[:3], c.data_ptr(), s.data_ptr(), *c.stride()[:2]]
    # the kernel's second part (keys) empty: no heads
    fixed_order_kernels().fo_rope_bf16(B, T, D, H, *part, y.data_ptr(), 0, *part, y.data_ptr(),
                                       torch.get_num_threads())
    return y


# ----- attention ----------------------------------------------------------------------------

def attention(c: Choices, q, k, v, allowed, policy: Policy) -> torch.Tensor:
    """Causal GQA attention (ops.attention's arithmetic). q [B, T, Hq, D]; k, v [B, S, Hkv, D];
    allowed [B, T, S]. A bf16 policy: kernel_attention, every call. Else QUERY_BLOCK queries at a
    time, a block reading only the keys up to the last one its mask allows (the keys left out have
    probability exactly 0: only the grouping of the sums changes); a block with a query that may
    see nothing reads every key. Where fused_attention_applies, a long prompt's blocks run as
    fused_block, a prompt from slot 0 without padding as one fused_causal call."""
    T = q.shape[1]
    if kernel_attention_applies(c, policy, q.device):
        return kernel_attention(q, k, v, allowed, policy)
    if T < 2 * QUERY_BLOCK:
        return block_attention(c, q, k, v, allowed, policy)
    fused = fused_attention_applies(c, policy, q.device)
    if fused and k.shape[1] >= T and plain_causal(allowed):
        return fused_causal(q, k[:, :T], v[:, :T], policy)
    hiddens = itertools.repeat(0) if fused else first_hidden(allowed)
    if not fused:
        # the blocks' products widen their keys and values: widened once here (the same operands)
        B, _, Hq, _ = q.shape
        k, v = (_widened_operand(c, t, policy, B * Hq * QUERY_BLOCK) for t in (k, v))
        scratch = Scratch(q.shape[0] * q.shape[2] * QUERY_BLOCK * k.shape[1])
    out = []
    for a, n, hidden in zip(range(0, T, QUERY_BLOCK), keys_read(allowed), hiddens):
        block = q[:, a:a + QUERY_BLOCK], k[:, :n], v[:, :n], allowed[:, a:a + QUERY_BLOCK, :n], policy
        out.append(fused_block(*block) if fused else
                   block_attention(c, *block, fill_from=min(hidden, n), scratch=scratch))
    return torch.cat(out, dim=1)


class Scratch:
    """Memory the blocks of one attention call take their scores and probabilities from, instead
    of fresh tensors per block (the allocator would return a block's megabytes to the system and
    fault them in again for the next). A buffer per (name, dtype) of `numel` elements."""

    def __init__(self, numel: int):
        self.numel = numel
        self._flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def empty(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        if n > self.numel:
            return torch.empty(shape, dtype=dtype, device=device)
        flat = self._flat.get((name, dtype))
        if flat is None:
            flat = self._flat[(name, dtype)] = torch.empty(self.numel, dtype=dtype, device=device)
        return flat[:n].view(shape)


def keys_read(allowed: torch.Tensor) -> list[int]:
    """How many keys each block of QUERY_BLOCK queries reads: one past the last key any query of
    the block, in any row, may see; every key (S) when some query of the block may see none."""
    T, S = allowed.shape[1:]
    pad = -T % QUERY_BLOCK
    seen = allowed.bool().view(torch.uint8)   # torch reduces uint8 with vector code, bool not
    by_query = seen.amax(0)                                                # [T, S]
    sees_some = torch.nn.functional.pad(seen.amax(-1).amin(0), (0, pad), value=1)
    by_block = torch.nn.functional.pad(by_query, (0, 0, 0, pad)).view(-1, QUERY_BLOCK, S).amax(1)
    last = S - by_block.flip(-1).argmax(-1)                               # one past the last 1
    everything = (sees_some.view(-1, QUERY_BLOCK).amin(-1) == 0) | (by_block.amax(-1) == 0)
    return torch.where(everything, S, last).tolist()


def first_hidden(allowed: torch.Tensor) -> list[int]:
    """For each block of QUERY_BLOCK queries, the first key some query of the block, in any row,
    may not see (S when they all see every key): block_attention fills masked scores from there."""
    T, S = allowed.shape[1:]
    pad = -T % QUERY_BLOCK
    hides = (~allowed.bool()).view(torch.uint8).amax(0)                             # [T, S]
    by_block = torch.nn.functional.pad(hides, (0, 0, 0, pad)).view(-1, QUERY_BLOCK, S).amax(1)
    return torch.where(by_block.amax(-1) == 1, by_block.argmax(-1), S).tolist()   # argmax: the first 1


def block_attention(c: Choices, q, k, v, allowed, policy: Policy, fill_from: int = 0,
                    scratch: Scratch | None = None) -> torch.Tensor:
    """ops.attention's arithmetic over the keys given, GQA's G query heads of a kv head folded into
    the rows ([B, Hkv, G*T, D] @ [B, Hkv, D, S], one bmm), the fill of masked scores from fill_from
    (every query sees every key before it), scores and probabilities in scratch's memory. Where the
    products widen (_widens) their operands go in accum_dtype and the scores and probabilities,
    rounded to compute_dtype in place, stay in it (the same values)."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    compute, accum, soft = dt(policy.compute_dtype), dt(policy.accum_dtype), dt(policy.softmax_dtype)
    wide = accum if _widens(c, compute, accum, compute, B * Hq * T, q.device) else compute
    scale = D ** -0.5
    early = scale_queries(scale, policy.compute_dtype)
    qg = _query_rows(cast(q, compute) * scale if early else cast(q, compute), Hkv)
    keys = cast(k.permute(0, 2, 3, 1), wide).reshape(B * Hkv, D, S)
    scores = torch.bmm(cast(qg, wide), keys, **_into(scratch, "scores", (B * Hkv, G * T, S), wide, q.device))
    scores = _rounded(scores, compute, scratch)
    if not early:
        scores = cast(scores, compute) * scale
    scores = cast(scores.view(B, Hkv, G, T, S), soft)
    hidden, lowest = _hidden(allowed), torch.finfo(soft).min
    if fill_from:
        scores[..., fill_from:].masked_fill_(hidden[..., fill_from:], lowest)
    else:
        scores.masked_fill_(hidden, lowest)
    probs = _softmax_into(scores, **_into(scratch, "probs", scores.shape, soft, q.device)).view(B * Hkv, G * T, S)
    probs = _rounded(probs, compute, scratch) if probs.dtype == wide else cast(probs, compute)
    ctx = torch.bmm(cast(probs, wide), cast(v.permute(0, 2, 1, 3), wide).reshape(B * Hkv, S, D))
    return _from_query_rows(cast(ctx, compute), B, T)


def _softmax_into(s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """ops.softmax into `out`."""
    if s.dtype in _HALF:
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return torch.div(e, e.sum(-1, keepdim=True), out=out)
    return torch.softmax(s, dim=-1, out=out)


def _query_rows(q: torch.Tensor, Hkv: int) -> torch.Tensor:
    """q [B, T, Hq, D] as rows [B * Hkv, G * T, D] (one query a row: one reshape)."""
    B, T, Hq, D = q.shape
    if T == 1:
        return q.reshape(B * Hkv, Hq // Hkv, D)
    return q.reshape(B, T, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4).reshape(B * Hkv, Hq // Hkv * T, D)


def _from_query_rows(x: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """_query_rows undone: x [B * Hkv, G * T, D] as [B, T, Hq, D]."""
    D = x.shape[-1]
    if T == 1:
        return x.view(B, 1, -1, D)
    Hkv = x.shape[0] // B
    return x.view(B, Hkv, -1, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, -1, D)


def _into(scratch: Scratch | None, name: str, shape, dtype: torch.dtype, device: torch.device) -> dict:
    return {} if scratch is None else {"out": scratch.empty(name, shape, dtype, device)}


def _rounded(x: torch.Tensor, dtype: torch.dtype, scratch: Scratch | None) -> torch.Tensor:
    """x's values rounded to `dtype`, in x's dtype (through scratch's buffer, in place, with scratch)."""
    if x.dtype == dtype:
        return x
    if scratch is None:
        return x.to(dtype).to(x.dtype)
    return x.copy_(scratch.empty("rounded", x.shape, dtype, x.device).copy_(x))


def _hidden(allowed: torch.Tensor) -> torch.Tensor:
    """~allowed [B, 1, 1, T, S], inverted once per call's mask (last_answer)."""
    return last_answer(_HIDDEN, allowed, lambda a: torch.bitwise_not(a)[:, None, None])


def _widened_operand(c: Choices, t: torch.Tensor, policy: Policy, rows: int) -> torch.Tensor:
    compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
    return t.to(accum) if _widens(c, compute, accum, compute, rows, t.device) else t


def plain_causal(allowed: torch.Tensor) -> bool:
    """Whether allowed [B, T, S] is a prompt's causal mask from slot 0 without padding, read from
    the mask (never taken on trust: a mask a control changed never runs as is_causal)."""
    return last_answer(_PLAIN, allowed, _is_plain_causal)


def _is_plain_causal(allowed: torch.Tensor) -> bool:
    B, T, S = allowed.shape
    return S >= T and torch.equal(allowed.bool().view(torch.uint8),
                                  torch.ones(T, S, dtype=torch.uint8, device=allowed.device).tril().expand(B, T, S))


def last_answer(memo: list, obj, of):
    """of(obj), kept in memo (a one-element list) for the last object asked about while it lives:
    the layers of one call share their mask (masks are never changed in place)."""
    last = memo[0]
    if last is not None and last[0]() is obj:
        return last[1]
    answer = of(obj)
    memo[0] = (weakref.ref(obj), answer)
    return answer


_PLAIN: list = [None]     # (weak ref to the last mask plain_causal read, its answer)
_HIDDEN: list = [None]    # (weak ref to the last mask _hidden inverted, its inverse)


def fused_block(q, k, v, allowed, policy: Policy) -> torch.Tensor:
    """block_attention's function through torch's fused kernel (sdpa): the same scores,
    exponentials and products, summed in another order. The mask as an additive one (0, or the
    dtype's lowest finite value: a query that may see nothing averages every value, as the
    reference does); none when everything is allowed."""
    dtype = dt(policy.compute_dtype)
    mask = None
    if not bool(allowed.all()):
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask = mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]      # [B, 1, T, S]
    return _fused(q, k, v, policy, attn_mask=mask)


def fused_causal(q, k, v, policy: Policy) -> torch.Tensor:
    """fused_block over the causal mask of T queries and their T keys: the kernel's is_causal."""
    return _fused(q, k, v, policy, is_causal=True)


def _fused(q, k, v, policy: Policy, **mask) -> torch.Tensor:
    dtype = dt(policy.compute_dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype).transpose(1, 2), k.to(dtype).transpose(1, 2), v.to(dtype).transpose(1, 2),
        scale=q.shape[-1] ** -0.5, enable_gqa=True, **mask)
    return out.transpose(1, 2)


def kernel_attention(q, k, v, allowed, policy: Policy) -> torch.Tensor:
    """block_attention's function for a bf16 policy in one pass per tile of queries on the
    fixed-order kernels (CausalAttention): scores rounded to bf16 (scaled before or after, as the
    reference), masked, softmax in f32 with the kernels' exp, probabilities rounded to bf16, their
    product with the values rounded to bf16. The same roundings, summed in another order; the same
    bits on every x86-64 CPU, code path, batch and thread count."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = D ** -0.5
    early = scale_queries(scale, policy.compute_dtype)
    q, k, v = (_kernel_operand(t) for t in (q, k, v))
    seen = allowed.bool()
    seen = seen if seen.stride(-1) == 1 else seen.contiguous()
    out = torch.empty((B, T, Hq, D), dtype=torch.bfloat16, device=q.device)
    fixed_order_kernels().fo_attention(
        B, T, S, Hq, Hkv, D, *_kernel_operand_args(q), scale if early else 0.0, *_kernel_operand_args(k),
        *_kernel_operand_args(v), seen.data_ptr(), seen.stride(0), seen.stride(1), 0.0 if early else scale,
        out.data_ptr(), torch.get_num_threads())
    return out


def _kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """q, k or v as the kernel reads it: bf16 or f32 as they are, another dtype rounded to bf16."""
    t = t if t.dtype in (torch.bfloat16, torch.float32) else t.to(torch.bfloat16)
    return t if t.stride(-1) == 1 else t.contiguous()


def _kernel_operand_args(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype == torch.bfloat16, *t.stride()[:3])


def describe(c: Choices, policy: Policy, device) -> dict[str, str]:
    """{op: how it runs} for the plan's record (llamaspec.plan.OPS)."""
    device = torch.device(device)
    compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
    logits = dt(policy.logits_dtype)
    out = {}
    if c.products == "reference":
        out["products"] = "reference"
    else:
        spans = {"1 row": 1, f"2-{WIDE_MIN_ROWS - 1} rows": 2, f"{WIDE_MIN_ROWS}-{FEW_ROWS} rows": WIDE_MIN_ROWS,
                 f"{FEW_ROWS + 1}+ rows": FEW_ROWS + 1}
        on = [span for span, n in spans.items() if kernel_products(c, compute, accum, compute, n, device)]
        one = _products_plan(c, compute, accum, compute, 1, device)
        one_row = not one.on_kernel and one_row_in_torch_order(c, one.dtype, 1, device)
        rest = [span for span in spans if span not in on and not (one_row and span == "1 row")]
        torch_path = ("torch's" + (", widened to f32 from 8 rows" if compute != accum and _widens(
            c, compute, accum, compute, FEW_ROWS + 1, device) else "")
            + (f", up to {FEW_ROWS} f32 rows in weight-row blocks" if accum == torch.float32
               and one.dtype == torch.float32 else ""))
        out["products"] = "; ".join(filter(None, [
            f"fixed-order gemm ({', '.join(on)})" if on else "",
            f"torch's one-row order ({c.one_row_order} lanes), on the kernels (1 row)" if one_row else "",
            f"{torch_path} ({', '.join(rest)})" if rest else ""]))
    if c.logits == "reference" and logits != compute:
        out["logits"] = "reference"
    else:
        out["logits"] = ("fixed-order gemm (bf16 weights, few rows)" if kernel_logits(c, compute, accum, logits, 1,
                                                                                       device) else "as products")
    if c.attention == "reference":
        out["attention"] = "reference"
    elif kernel_attention_applies(c, policy, device):
        out["attention"] = "fixed-order kernel (prompts and decode steps)"
    else:
        out["attention"] = ("torch sdpa for long prompts, " if fused_attention_applies(c, policy, device) else "") + \
            "blocks of 128 queries"
    out["rope"] = ("fixed-order kernel (bf16 prompts)" if compute == torch.bfloat16 and c.kernel_isa is not None
                   else "reference")
    out["mlp"] = "silu(gate) * up in place"
    cache = Fast(c).cache_dtype(policy, device)
    out["cache"] = "one-block writes" + (f", kept in {str(cache).removeprefix('torch.')}" if cache != compute else "")
    return out
