"""The Llama ops as small pure functions, each following the policy's dtypes exactly.

jaxmodel/ops.py has the same functions with the same names; the two files differ only
in the framework, and in that torchref's attention runs a long prompt in blocks of queries
(its block_attention is jaxmodel's attention; at f32 policies each block goes through torch's
fused kernel, fused_block, and a plain prompt is one fused_causal call). Numerics follow
transformers' LlamaForCausalLM (eager attention): RoPE half-split layout, scores =
(q @ k^T) * scale, mask then softmax.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import platform
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from llamaspec import Policy, RopeConfig, cpuinfo
from llamaspec.errors import InvarianceError
from llamaspec.forward import scale_queries

from .dtypes import cast, dt

_HALF = (torch.bfloat16, torch.float16)   # the 16-bit compute dtypes, whose products f32 holds exactly


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, policy: Policy) -> torch.Tensor:
    """mean(x^2) and rsqrt in norm_dtype; result in compute_dtype."""
    h = cast(x, dt(policy.norm_dtype))
    return norm_weight(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), x, weight, policy)


def norm_weight(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, policy: Policy) -> torch.Tensor:
    """The normalised h (in norm_dtype) times the weight, in compute_dtype. HF convention
    (norm_cast_before_weight): h is rounded back to x's dtype first."""
    compute = dt(policy.compute_dtype)
    if policy.norm_cast_before_weight:
        return cast(weight, compute) * cast(cast(h, x.dtype), compute)
    return cast(cast(weight, h.dtype) * h, compute)


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                  seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], computed in `dtype` with transformers' formulas."""
    base = rope.theta
    if rope.type == "dynamic":
        # NTK-aware scaling grows the base once the sequence exceeds the trained length.
        seq_len = max(seq_len, max_position_embeddings)
        base = base * ((rope.factor * seq_len / max_position_embeddings)
                       - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency scaling, term for term as transformers' _compute_llama3_parameters."""
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] for integer positions [B, T], computed in `dtype`."""
    angles = positions.to(dtype)[..., None] * inv_freq.to(dtype)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; the tables are rounded to x's dtype first, as HF does."""
    cos = cast(cos, x.dtype).unsqueeze(2)   # [B, T, 1, D]
    sin = cast(sin, x.dtype).unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def kernel_rope_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether queries and keys rotate as one kernel_rope call instead of apply_rope each: both
    bf16 (a bf16 policy's compute dtype) with an even head_dim, on a CPU where the fixed-order
    kernels are built (x86-64). The same bits either way (kernel_rope), so no setting chooses
    and kernels that cannot be built leave apply_rope without a warning of their own (the
    attention's and logits' say it)."""
    return (q.dtype == k.dtype == torch.bfloat16 and q.device.type == k.device.type == "cpu"
            and q.shape[-1] % 2 == 0 and _built_kernels() is not None)


@functools.cache
def _built_kernels():
    """fixed_order_kernels, or None where they cannot be built."""
    try:
        return fixed_order_kernels()
    except InvarianceError:
        return None


def kernel_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cos: torch.Tensor,
                key_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope(q, cos, sin), apply_rope(k, key_cos, key_sin) for bf16 q [B, T, Hq, D] and k [B, T,
    Hk, D] in one call of the fixed-order kernels (llamaspec/fixed_order.h, RopeJob): each of
    apply_rope's bf16 ops (x * cos, rotate_half's negation, its product with sin, the sum) in f32
    and rounded to bf16 as torch's bf16 ops round, so the same bits (a NaN stays NaN, its sign may
    differ), without apply_rope's ten tensors a layer, the positions split among torch's threads:
    SmolLM2's bf16 128-token prefill on a 2-core Zen 4 spent 3.6 ms in the layers' rotations
    with apply_rope, 2.7 with this (in-process A/B of the whole prefill: 1.014x, 15 of 21 rounds
    faster; docs/measurements.md). The tables [B, T, D] (or broadcast to it) are rounded to bf16
    first, as apply_rope rounds them."""
    B, T, Hq, D = q.shape
    if k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != D:
        raise ValueError(f"kernel_rope: keys {tuple(k.shape)} do not match queries {tuple(q.shape)} "
                         "in batch, positions and head_dim")
    outs = tuple(torch.empty(x.shape, dtype=torch.bfloat16, device=x.device) for x in (q, k))
    args, held = [], []   # held: the tensors the pointers point into, alive until the call returns
    for x, c, s, y in ((q, cos, sin, outs[0]), (k, key_cos, key_sin, outs[1])):
        x = x if x.stride(-1) == 1 else x.contiguous()
        c, s = (cast(t, torch.bfloat16).expand(B, T, D) for t in (c, s))
        if c.stride(-1) != 1 or c.stride() != s.stride():   # one set of strides for both tables
            c, s = c.contiguous(), s.contiguous()
        held += [x, c, s]
        args += [x.shape[2], x.data_ptr(), *x.stride()[:3], c.data_ptr(), s.data_ptr(), *c.stride()[:2], y.data_ptr()]
    _built_kernels().fo_rope_bf16(B, T, D, *args, torch.get_num_threads())
    return outs


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, policy: Policy,
           out_dtype: str | None = None) -> torch.Tensor:
    """x @ w.T + b, accumulated in accum_dtype and rounded once to out_dtype.

    Either torch's kernel for compute_dtype operands does that itself (_native), or the
    operands go to it widened to accum_dtype: products of bf16/fp16 numbers are exact in f32,
    so that is the same arithmetic, the sums in another order (drift). A 16-bit weight is
    widened once (_widened). A product whose arithmetic is f32 runs on the fixed-order kernels'
    gemm where kernel_products says so (few rows, or any off Intel: an x86-64 CPU); elsewhere an f32
    product of that few rows on the CPU runs in blocks of the weight's rows
    (_linear_by_row_blocks): so does the f32 lm_head of a bf16 decode step, on the widened copy
    (4.0 ms for SmolLM2's at one row on a Zen 4, against 8.9 when it was widened a chunk at a
    time per step and 2.3 for torch's bf16 product, whose bf16 result the policy's f32 logits
    cannot use)."""
    return linears(x, (w,), (b,), policy, out_dtype)[0]


def linears(x: torch.Tensor, ws, bs, policy: Policy, out_dtype: str | None = None) -> list[torch.Tensor]:
    """linear(x, w, b) for each weight and bias: the projections that read one input, which is
    rounded and widened once for all of them (the same operand each time: the same bits)."""
    compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
    out = dt(out_dtype or policy.compute_dtype)
    on_kernel, dtype, product, one_row = _products_plan(compute, accum, out, x.numel() // max(x.shape[-1], 1),
                                                        x.device)
    if on_kernel:
        return _kernel_linears(x, ws, bs, compute, out)
    # the operands rounded to compute_dtype (no-ops where they are held in it; a policy whose
    # param_dtype is wider needs them), then, where the product widens, widened exactly
    x = cast(cast(x, compute), dtype)
    if one_row:
        # torch's own switch for oneDNN, process-wide for the call (torch.backends.mkldnn.flags
        # sets it too, with its other flags and a warning each time)
        torch._C._set_mkldnn_enabled(False)
    try:
        return [cast(product(x, _widened(cast(w, compute), dtype), _bias(b, compute, dtype)), out)
                for w, b in zip(ws, bs)]
    finally:
        if one_row:
            torch._C._set_mkldnn_enabled(True)


class ProductsPlan(NamedTuple):
    """How linears multiplies a product of some rows (its dtypes, rows and device: _products_plan)."""
    on_kernel: bool     # on the fixed-order kernels' gemm (kernel_products); the rest is then unused
    dtype: torch.dtype  # torch's operands: compute_dtype, or accum_dtype where the product widens
    product: Callable   # torch.nn.functional.linear, or _linear_by_row_blocks for a few f32 rows
    one_row: bool       # oneDNN off for the call (_one_row_kernel)


def _products_plan(compute: torch.dtype, accum: torch.dtype, out: torch.dtype, rows: int,
                   device: torch.device) -> ProductsPlan:
    """linears' choice for a product of `rows` rows, by kernel_products, _widens, _few_f32_rows and
    _one_row_kernel: asked anew every product outside a model call, and once per call (per
    dtypes, rows and device) inside one (one_call)."""
    def decide() -> ProductsPlan:
        if kernel_products(compute, accum, out, rows, device):
            return ProductsPlan(True, compute, torch.nn.functional.linear, False)
        dtype = accum if _widens(compute, accum, out, rows, device) else compute
        return ProductsPlan(False, dtype, _linear_by_row_blocks if _few_f32_rows(dtype, rows, device)
                            else torch.nn.functional.linear, _one_row_kernel(rows, dtype, device))
    return _per_call((compute, accum, out, rows, device), decide)


def _per_call(key, decide: Callable):
    """decide() once per model call for `key` (one_call keeps the answers), anew outside one."""
    plans = getattr(_CALL, "plans", None)
    if plans is None:
        return decide()
    if key not in plans:
        plans[key] = decide()
    return plans[key]


_CALL = threading.local()   # plans: this thread's model call's choices (one_call, _per_call), or absent


@contextlib.contextmanager
def one_call():
    """The extent of one model call (model.py enters it for each): inside it linears decides how
    to multiply a product of some rows and dtypes once (_products_plan), not at every product,
    and attention whether the fixed-order kernel attends once, not every layer (6 us a call).
    Those rules read the environment ($LLAMA_PARITY_TORCHREF_PRODUCTS, the libraries' caps, ...),
    the CPU's flags and torch's oneDNN switch, several microseconds a product: a batch-1 decode
    step of SmolLM2 (120 calls of linears) spent about 1.5 ms of its 22 in linears outside
    torch's products under an AVX2 cap on a Zen 4, 0.4 with the choices kept per call
    (docs/measurements.md). None of them changes during a call: the same choices, the same bits.
    Nested calls share the outer one's plans; outside every call (an op called on its own) each
    product asks anew, so a changed setting counts at once."""
    if getattr(_CALL, "plans", None) is not None:
        yield
        return
    _CALL.plans = {}
    try:
        yield
    finally:
        _CALL.plans = None


# $LLAMA_PARITY_TORCHREF_PRODUCTS: auto (kernel_products' rule), kernel (wherever the fixed-order
# kernels build, for any compute dtype with an f32 accumulator) or torch (never the kernel)
PRODUCTS_ENV = "LLAMA_PARITY_TORCHREF_PRODUCTS"


def kernel_products(compute: torch.dtype, accum: torch.dtype, out: torch.dtype, rows: int,
                    device: torch.device) -> bool:
    """Whether linears runs a product of `rows` rows (result in `out`) on the fixed-order kernels'
    gemm (_kernel_linears) instead of torch's: a product that torch would run in f32, summed in
    f32 (f32 operands, or bf16 / fp16 ones that linears widens: _widens, 8 rows or more on a CPU
    without hardware_products, or an f32 result), on an x86-64 CPU where the kernel's code path
    ($LLAMA_PARITY_KERNEL_ISA, else the CPU's best) is AVX2 or better, and either of at most
    FEW_ROWS rows (a decode step of a small batch) or, more rows, where torch's BLAS is MKL on a
    CPU that is not Intel's (mkl_off_intel). 16-bit products torch runs on its 16-bit kernels
    stay there, except 2 to FEW_ROWS rows on AVX-512 pair products without AMX
    (_pairs_of_few_rows: SmolLM2's bf16 decode at batch 8 on the Zen 4, 42.2 against 51.0 ms a
    step; batch 4 40.4 against 54.6). One 16-bit row stays with torch everywhere: there the kernel
    made SmolLM2's capped bf16 decode step slower (33.5 against 28.0 ms).

    Why few rows: they make the product memory-bound (about M/2 multiply-adds per weight byte
    at f32), and the kernel reads each packed weight byte once, spread over all threads, while
    torch's BLAS reads it at a fraction of the memory's rate there. SmolLM2's seven products of a
    layer on a 2-core Zen 4, us, torch (row blocks; its own linear from 17 rows) / kernel: f32
    1 row 644 / 594, 8 rows 1821 / 715, 16 rows 1913 / 928; bf16 weights under an AVX2 cap
    (row blocks on the widened copy) 8 rows ~1800 / 905 (docs/measurements.md). A 16-bit
    weight is packed in its own dtype and widened in registers, so the kernel reads half the
    bytes the widened copy has.

    Why more rows only off Intel: MKL picks its code by the CPU's vendor as well as its features
    (Intel's notice: its libraries may not optimize to the same degree for other vendors' CPUs),
    and on an AMD Zen 4 the kernel's register-blocked multiply-adds ran every compute-bound
    product faster, on both code paths (the same layer's products,
    ms, MKL / kernel, Zen 4: 128 rows 8.9 / 4.6, 2048 rows 88.9 / 71.8; under the AVX2 cap 7.9 /
    4.8 and 99.4 / 85.6; capped bf16 weights 2048 rows 87.0 / 78.4). On an Intel CPU MKL runs
    its own best kernels, which no one has timed against this one: torch's stay.

    The same exact products, summed in f32 in the kernel's fixed order instead of torch's:
    drift; the same bits on every x86-64 CPU, code path, thread count and row count. Decided by
    the dtypes, the rows, the CPU and torch's BLAS, never by a timing;
    $LLAMA_PARITY_TORCHREF_PRODUCTS overrides: kernel (any rows, also on the scalar path and for
    every 16-bit product with an f32 accumulator; an error if the kernels cannot be built), torch
    (never). Kernels that cannot be built leave torch's products, with one warning."""
    if not (device.type == "cpu" and accum == torch.float32 and compute in (torch.float32, *_HALF)):
        return False
    choice = _kernel_choice(PRODUCTS_ENV)
    if choice is None or (choice == "auto" and (
            (compute in _HALF and not _widens(compute, accum, out, rows, device)
             and not _pairs_of_few_rows(compute, rows))
            or (rows > FEW_ROWS and not mkl_off_intel()))):
        return False
    lib = _available_kernels(choice == "kernel", "products")
    if lib is None:
        return False
    from llamaspec import fixed_order as fo
    return choice == "kernel" or lib.fo_isa() >= fo.ISAS["avx2"]


# A prompt's MLP on the fixed-order kernels runs in blocks of rows whose joint gate/up product
# (f32) holds at most this many bytes (mlp_row_block)
MLP_BLOCK_BYTES = 16 * 2 ** 20


def mlp_row_block(rows: int, width: int, policy: Policy, device: torch.device) -> int | None:
    """The rows per block in which the MLP takes a call of `rows` rows whose gate and up products
    have `width` outputs together, or None (all rows at once): a power of two rows whose f32
    gate/up product holds at most MLP_BLOCK_BYTES, where every product of the MLP runs on the
    fixed-order kernels (kernel_products) for the call's rows and for the blocks' alike. The MLP
    is the same function of each row, and the kernel's sums are the same at every row count, so
    blocks give the same bits; elsewhere (torch's products, whose order may follow the row count)
    the rows stay together.

    Why: a long prompt's MLP made and freed tens of megabytes a layer (SmolLM2 at 2048 tokens in
    f32: the 25 MB gate/up product, SiLU's 12.6 MB), and in some processes glibc handed the freed
    top of its heap back to the system after each layer, so the next layer faulted it in again:
    100k-230k minor faults and 0.2-0.4 s a 3.5 s call on a Zen 4. In 1024-row blocks the MLP
    reuses a few megabytes (docs/measurements.md)."""
    block = 1 << (max(MLP_BLOCK_BYTES // (4 * width), 1).bit_length() - 1)
    if rows <= block:
        return None
    compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
    if all(_products_plan(compute, accum, compute, n, device).on_kernel for n in {rows, block, rows % block} - {0}):
        return block
    return None


def _pairs_of_few_rows(compute: torch.dtype, rows: int) -> bool:
    """Whether torch would multiply 2 to FEW_ROWS rows of `compute` (bf16 / fp16) operands with
    oneDNN's AVX-512 pair products: hardware_products by its own rule ($LLAMA_PARITY_BF16_DOTS on
    auto) on a CPU without AMX tiles. oneDNN's path for so few rows is slow there: SmolLM2's seven
    bf16 products of a layer on the Zen 4, us, torch / kernel: 2 rows 710 / 353, 4 rows 800 / 369,
    8 rows 868 / 492, 16 rows 978 / 801 (one row: ATen's matrix-vector kernel 291 / 270, and the
    kernel was the slower in the model, so one row stays with torch). Where they run on AMX tiles
    (amx_products) no one has timed the two: torch's stay."""
    return (1 < rows <= FEW_ROWS and compute in _HALF and cpuinfo.dots_choice() == "auto"
            and hardware_products(compute) and not amx_products(compute))


def mkl_off_intel() -> bool:
    """Whether torch multiplies f32 matrices on MKL (the BLAS it was built with) and this CPU's
    vendor is known and not Intel: there MKL leaves out the code it runs on Intel's CPUs (see
    kernel_products)."""
    return torch.backends.mkl.is_available() and cpuinfo.vendor() not in ("", "GenuineIntel")


def _kernel_choice(env: str) -> str | None:
    """$env's choice between the fixed-order kernel and torch (auto, kernel or torch; another
    value is an error), or None where the kernel cannot run: torch asked for, or not x86-64."""
    choice = os.environ.get(env, "auto").strip().lower() or "auto"
    if choice not in ("auto", "kernel", "torch"):
        raise ValueError(f"{env}={choice!r}: expected auto, kernel or torch")
    return None if choice == "torch" or platform.machine().lower() not in ("x86_64", "amd64") else choice


def _kernel_linears(x: torch.Tensor, ws, bs, compute: torch.dtype, out: torch.dtype) -> list[torch.Tensor]:
    """linears on the fixed-order kernels' gemm: the weights rounded to compute_dtype, stacked
    and packed once in it (_panels), x's rows rounded to compute_dtype and taken in f32, one f32
    multiply-add chain per output; each bias (rounded to compute_dtype) added in f32, the result
    rounded once to `out`. One product for the weights that read x (q, k, v; gate, up)."""
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
    """The weights ws (rows [N_i, K]) rounded to compute_dtype, stacked and packed in the kernels'
    panel layout, with the kernel's weight type: made once per set of tensors and kept while they
    live (_kept), remade when one changes in place."""
    from llamaspec import fixed_order as fo
    wtype = fo.WTYPES[str(compute).removeprefix("torch.")]

    def make():
        w = torch.cat([cast(w.detach(), compute) for w in ws]).contiguous()
        N, K = w.shape
        packed = torch.empty(fo.PANEL * -(-N // fo.PANEL) * K, dtype=compute)
        fixed_order_kernels().fo_pack(w.data_ptr(), wtype, N, K, K, 1, packed.data_ptr())
        return packed
    return kept(ws, ("panels", compute), make), wtype


def fixed_order_gemm(rows: torch.Tensor, packed: torch.Tensor, wtype: int, n: int) -> torch.Tensor:
    """rows [M, K] (contiguous: f32, f64 for f64 weights, bf16 for the bf16 pair program) @ w^T
    for the n rows of w packed in `packed` (llamaspec.fixed_order's panels, weight type wtype):
    [M, n] in f32 (f64 for f64 rows), on torch's threads."""
    M, K = rows.shape
    y = torch.empty((M, n), dtype=torch.float32 if rows.dtype == torch.bfloat16 else rows.dtype)
    fixed_order_kernels().fo_gemm(M, n, K, rows.data_ptr(), K, packed.data_ptr(), wtype, y.data_ptr(), n,
                                  torch.get_num_threads())
    return y


# $LLAMA_PARITY_TORCHREF_LOGITS: auto (kernel_logits' rule), kernel (wherever the fixed-order
# kernels build) or torch (never the kernel)
LOGITS_ENV = "LLAMA_PARITY_TORCHREF_LOGITS"


def kernel_logits(compute: torch.dtype, accum: torch.dtype, out: torch.dtype, rows: int,
                  device: torch.device) -> bool:
    """Whether a product of bf16 operands with an f32 result (a bf16 policy's f32 logits) of
    `rows` rows runs on the fixed-order kernels' gemm (model.head_logits then calls
    invariant.linear: the weight packed once in bf16 and read at 2 bytes a value, vdpbf16ps's
    pairs in the kernel's fixed order) instead of
    torch's f32 product over the widened copy (4 bytes a value). SmolLM2's lm_head [49152, 576]
    on a 2-core Zen 4, ms, torch / kernel: its own AVX-512-BF16 path, 1 row 3.8 / 1.6, 8 rows
    8.4 / 2.5, 16 rows 12.6 / 4.9; under the AVX2 cap (the kernel's AVX2 path widens each pair
    in software) 1 row 5.8 / 3.1, 4 rows 5.7 / 8.2, 16 rows 14.1 / 30.1 (docs/measurements.md).

    The same products (bf16 values, exact in f32) summed in f32 in the kernel's order instead of
    torch's: drift, and the same bits on every x86-64 CPU and code path. On the CPU, x86-64, a
    bf16 compute_dtype with an f32 accumulator and an f32 result: one row where the kernel's code
    path ($LLAMA_PARITY_KERNEL_ISA, else the CPU's best) is AVX2 or better, up to FEW_ROWS rows
    where it is AVX-512-BF16; never by a timing. $LLAMA_PARITY_TORCHREF_LOGITS overrides:
    kernel (any code path, any few rows; an error if the kernels cannot be built), torch (never).
    A kernel that cannot be built leaves torch's product, with one warning."""
    if not (compute == torch.bfloat16 and accum == torch.float32 and out == torch.float32
            and rows <= FEW_ROWS and device.type == "cpu"):
        return False
    choice = _kernel_choice(LOGITS_ENV)
    if choice is None:
        return False
    lib = _available_kernels(choice == "kernel", "logits")
    if lib is None:
        return False
    from llamaspec import fixed_order as fo
    return choice == "kernel" or lib.fo_isa() >= fo.ISAS["avx2" if rows == 1 else "avx512_bf16"]


def _native(compute: torch.dtype, accum: torch.dtype, out: torch.dtype) -> bool:
    """Whether torch's own kernel for `compute` inputs realises this accumulation.

    Same dtype: trivially. bf16/fp16 inputs with an f32 accumulator and a result
    rounded back to bf16/fp16: that is what torch's CPU and CUDA kernels do (and
    matmul_settings forbids cuBLAS' reduced-precision reductions). Any other case
    (f32 logits from bf16 inputs, f32 inputs with f64 accumulation) upcasts the
    inputs instead: their products are exact in the wider type, so the upcast matmul
    *is* "narrow in, wide accumulate", without an extra rounding.
    """
    if accum == compute:
        return True
    return compute in _HALF and accum == torch.float32 and out == compute


# ----- products of 16-bit operands ---------------------------------------------------------

# A product of this many rows or more widens its bf16/fp16 operands to f32 on a CPU without
# hardware products for them (hardware_products). Fewer rows (a decode step of a small batch) keep
# torch's own kernel, which reads the weight's 16-bit bytes and widens them in registers: a
# model's weights come from memory, where the f32 copy reads twice the bytes. SmolLM2's bf16
# decode under an AVX2 cap on a Zen 4, ms per step, widened against torch's bf16 (median of 4):
# batch 2: 118 / 58, 4: 118 / 108, 8: 137 / 166, 16: 123 / 227; a 512-token prefill's
# [512, 576] x [576, 1536]: 5.1 against 25 ms (docs/measurements.md).
WIDE_MIN_ROWS = 8
# oneDNN's instruction-set caps (ONEDNN_MAX_CPU_ISA) that keep bf16 / fp16 products in hardware,
# as prefixes: AVX512_CORE_BF16 and above for bf16 (AVX512_CORE_FP16, AVX512_CORE_AMX[_FP16], the
# AVX10 names), AVX512_CORE_FP16 and above for fp16; lower caps (AVX2, AVX512_CORE, ...) do not.
_HARDWARE_CAPS = {torch.bfloat16: ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "ALL",
                                   "DEFAULT"),
                  torch.float16: ("AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT")}
# the CPU flags of bf16 / fp16 products in hardware, the AMX one first (amx_products reads it)
_HARDWARE_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}


def hardware_products(dtype: torch.dtype) -> bool:
    """Whether torch multiplies `dtype` (bf16 / fp16) matrices of many rows in hardware on this
    CPU: oneDNN's kernels on AMX tiles or AVX-512 pair products (bf16: AMX-BF16 or AVX-512-BF16;
    fp16: AMX-FP16 or AVX-512-FP16), with oneDNN enabled and not capped below them. Elsewhere
    torch multiplies them in software, 4-5x slower than its f32 product of the same size (an
    AVX2-capped Zen 4; torch's bf16 5.7x its fp32 on the Zen 3 of issue 26), so linear and the
    attention products widen them.

    Decided by the CPU's features and the cap, never by a timing, so a machine always runs the
    same path; $LLAMA_PARITY_BF16_DOTS (llamaspec.cpuinfo) overrides: native (torch's 16-bit
    kernels on any CPU) or widened."""
    env = os.environ
    return _hardware_products(dtype, cpuinfo.name_and_flags()[1], env.get(cpuinfo.BF16_DOTS_ENV),
                              env.get("ONEDNN_MAX_CPU_ISA"), env.get("DNNL_MAX_CPU_ISA"),
                              bool(torch.backends.mkldnn.enabled))


@functools.cache
def _hardware_products(dtype: torch.dtype, flags: frozenset, choice, onednn_cap, dnnl_cap, mkldnn_enabled: bool
                       ) -> bool:
    """hardware_products for these settings (read at every product, decided once per setting)."""
    choice = cpuinfo.dots_choice(choice)
    if choice != "auto":
        return choice == "native"
    cap = (onednn_cap or dnnl_cap or "ALL").strip().upper()
    return (any(flag in flags for flag in _HARDWARE_FLAGS[dtype]) and cap.startswith(_HARDWARE_CAPS[dtype])
            and torch.backends.mkldnn.is_available() and mkldnn_enabled)


def _widens(compute: torch.dtype, accum: torch.dtype, out: torch.dtype, rows: int, device: torch.device) -> bool:
    """Whether a product of `rows` rows goes to torch widened to accum (see linear)."""
    if not _native(compute, accum, out):
        return True
    return (compute in _HALF and accum != compute and device.type == "cpu" and rows >= WIDE_MIN_ROWS
            and not hardware_products(compute))


def cache_dtype(policy: Policy, device: torch.device) -> torch.dtype:
    """The dtype the KV cache keeps keys and values in: compute_dtype, except where attention's
    products widen them (_widens, for products of WIDE_MIN_ROWS rows or more, as a decode step's
    G query heads of each kv head mostly are: a bf16/fp16 policy with f32 sums on a CPU without
    hardware products for it): there accum_dtype, holding the same compute_dtype values,
    so that no step widens the whole cache again. The same bits (widening is exact, and a product
    that does not widen rounds them back exactly); twice the cache's memory. A batch-1 decode step
    of SmolLM2 widened 60 caches of 168 slots, about 2.5 ms of its 35 on a Zen 4 under an AVX2
    cap (docs/measurements.md). Not where kernel_attention_applies: the kernel reads bf16 keys and
    values as they are (widening them as it packs them), and a bf16 cache is half the bytes to read
    a step. Decided by the policy and the CPU, as hardware_products."""
    compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
    if kernel_attention_applies(policy, device):
        return compute
    return accum if _widens(compute, accum, compute, WIDE_MIN_ROWS, device) else compute


def _bias(b: torch.Tensor | None, compute: torch.dtype, dtype: torch.dtype) -> torch.Tensor | None:
    """A bias as linears adds it: rounded to compute_dtype, then in the product's dtype."""
    return None if b is None else cast(cast(b, compute), dtype)


def _one_row_kernel(rows: int, compute: torch.dtype, device: torch.device) -> bool:
    """Whether a product of `rows` rows of `compute` operands runs with oneDNN off (linears turns
    it off for the call): a one-row product of 16-bit operands on the CPU (a batch-1 decode step)
    then runs on ATen's matrix-vector kernel, not oneDNN's: both sum the exact products in f32
    (the same function, drift at most), and oneDNN's took twice as long with the weights out of
    cache on a Zen 4 ([1, 576] x [576, 1536] in bf16: 186 against 87 us; docs/measurements.md).
    By the shape, never by a timing."""
    return rows == 1 and compute in _HALF and device.type == "cpu" and torch._C._get_mkldnn_enabled()


def _widened(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in `dtype`. A 16-bit weight is widened once per tensor (again when it is changed in
    place: its version counter moves) and the copy kept while the tensor lives: twice the
    16-bit weight's memory, where converting it at every product would cost a pass over it each
    time. Other tensors (an f32 weight for f64 sums, inference tensors) are converted per call."""
    if w.dtype == dtype:
        return w
    if w.dtype not in _HALF:
        return w.to(dtype)
    return kept((w,), dtype, lambda: w.detach().to(dtype))


def kept(tensors: tuple, what, make):
    """make()'s result for these tensors (what: a key telling results of the same tensors
    apart), made once and kept while every one of them lives, made again when one changes in
    place (its version counter moves): a widened or packed copy of weights (twice a 16-bit
    weight's memory, once an f32 one's; invariant.py's packed weights too). Inference tensors keep
    no version counter: for them make() runs every call."""
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


# A product of at most this many rows (a decode step of a small batch) runs on the fixed-order
# kernels where kernel_products says so, else, in f32 on the CPU, as one batched product over
# blocks of ROW_BLOCK of the weight's rows (_linear_by_row_blocks).
# SmolLM2's f32 decode on a 2-core Zen 4, ms per step, torch's product against the blocks, in
# one process: batch 1 72 / 41, 2 117 / 69, 4 87 / 59, 8 100 / 87, 16 119 / 101; products of
# 24 to 64 rows alone took the same time either way (docs/measurements.md).
FEW_ROWS = 16
ROW_BLOCK = 64


def _few_f32_rows(dtype: torch.dtype, rows: int, device: torch.device) -> bool:
    """Whether a product of `rows` rows of `dtype` operands runs as _linear_by_row_blocks."""
    return dtype == torch.float32 and rows <= FEW_ROWS and device.type == "cpu"


def _linear_by_row_blocks(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + b for f32 x of a few rows and an f32 w [N, K]: w's rows in blocks of ROW_BLOCK,
    the blocks one batched product (torch.bmm; the last N mod ROW_BLOCK rows a product of their
    own). The same f32 products and sums, grouped otherwise (drift). Why: MKL multiplies a
    matrix by one or a few rows on one core, and there the weights' bytes come from memory at
    one core's rate; a batched product goes to torch's threads a block at a time. SmolLM2's
    per-layer f32 weights, one row, on a 2-core Zen 4: 38 against 18 ms for 425 MB; two rows
    58 against 20 (docs/measurements.md). By the shape, never by a timing: the result depends
    on the rows and the weight's shape only, not on the thread count."""
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


# Queries per attention block: a long prompt's scores are computed QUERY_BLOCK queries at a
# time. jaxmodel blocks too (jaxmodel.ops.causal_attention), with the cut from a causal promise
# its jitted programs can read statically, not from the mask (docs/measurements.md).
QUERY_BLOCK = 128


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              policy: Policy) -> torch.Tensor:
    """Causal GQA attention (block_attention's arithmetic), QUERY_BLOCK queries at a time.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; allowed [B, T, S]. A long prompt's [B, Hq, T, S]
    scores are never held at once, and a block reads only the keys up to the last one its mask
    allows (a causal block: none after its last query). The keys left out are masked for every
    query of the block: their probabilities are exactly 0, so only the grouping of the sums over
    keys changes (drift; the tests hold it to rounding). A block with a query that may see
    nothing (a padding position) reads every key, so that query averages all S values as one
    block would. Where fused_attention_applies, a long prompt's blocks run as fused_block, and a
    prompt from slot 0 without padding (plain_causal) as one fused_causal call; where
    kernel_attention_applies (a bf16 policy), every call (a prompt of any length, a decode step)
    as one kernel_attention call.
    """
    T = q.shape[1]
    if _per_call(("kernel attention", policy, q.device.type), lambda: kernel_attention_applies(policy, q.device)):
        return kernel_attention(q, k, v, allowed, policy)
    if T < 2 * QUERY_BLOCK:
        return block_attention(q, k, v, allowed, policy)
    fused = fused_attention_applies(policy, q.device)
    if fused and k.shape[1] >= T and plain_causal(allowed):
        return fused_causal(q, k[:, :T], v[:, :T], policy)
    hiddens = itertools.repeat(0) if fused else first_hidden(allowed)   # the kernel reads the whole mask
    if not fused:
        # the blocks' products widen their keys and values (at QUERY_BLOCK queries they do where
        # any do): widened once here, not a prefix per block (exact: the same operands)
        B, _, Hq, _ = q.shape
        k, v = (_widened_operand(t, policy, B * Hq * QUERY_BLOCK) for t in (k, v))
        scratch = Scratch(q.shape[0] * q.shape[2] * QUERY_BLOCK * k.shape[1])
    out = []
    for a, n, hidden in zip(range(0, T, QUERY_BLOCK), keys_read(allowed), hiddens):
        block = q[:, a:a + QUERY_BLOCK], k[:, :n], v[:, :n], allowed[:, a:a + QUERY_BLOCK, :n], policy
        out.append(fused_block(*block) if fused else
                   block_attention(*block, fill_from=min(hidden, n), scratch=scratch))
    return torch.cat(out, dim=1)


class Scratch:
    """Memory that the blocks of one attention call take their scores and probabilities from,
    instead of fresh tensors per block: the allocator returns a block's megabytes to the system
    and the next block faults them in again (SmolLM2's bf16 2048-token prefill under an AVX2 cap
    on a Zen 4: attention 123 -> 99 ms a layer, docs/measurements.md). A buffer per (name,
    dtype) of `numel` elements, allocated at first use; a request for more gets a tensor of its
    own. Nothing in it outlives the call that made it."""

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


def plain_causal(allowed: torch.Tensor) -> bool:
    """Whether allowed [B, T, S] is a prompt's causal mask from slot 0 without padding: in every
    row, query t may see keys 0..t and nothing else (slots T.. hidden). Read from the mask (its
    bytes against the lower triangle; 2 ms at 2048 x 2049 on a Zen 4), not taken on trust, so a
    mask that a seam, a control or a bug changed never runs as is_causal. Kept per mask
    (last_answer)."""
    return last_answer(_PLAIN, allowed, _is_plain_causal)


def _is_plain_causal(allowed: torch.Tensor) -> bool:
    B, T, S = allowed.shape
    return S >= T and torch.equal(allowed.bool().view(torch.uint8),
                                  torch.ones(T, S, dtype=torch.uint8, device=allowed.device).tril().expand(B, T, S))


def last_answer(memo: list, obj, of):
    """of(obj), kept in memo (a one-element list) for the last object asked about while it
    lives: the layers of one call share their mask, so it is computed once per call, not once a
    layer. Masks are never changed in place (a changed mask is a new tensor); model.py keeps a
    call's KV cache index array's answer so too (model._cache_slots)."""
    last = memo[0]
    if last is not None and last[0]() is obj:
        return last[1]
    answer = of(obj)
    memo[0] = (weakref.ref(obj), answer)
    return answer


_PLAIN: list = [None]     # (weak ref to the last mask plain_causal read, its answer)
_HIDDEN: list = [None]    # (weak ref to the last mask _hidden inverted, its inverse)


def fused_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy) -> torch.Tensor:
    """fused_block over the causal mask of T queries and their T keys (query t sees keys 0..t):
    the kernel's own is_causal, no mask tensor; its tiles above the diagonal are skipped. q
    [B, T, Hq, D]; k, v [B, T, Hkv, D]. A NaN key or value reaches the queries that see it (a
    NaN value, as in fused_block, also others of its tile): never less NaN than block_attention."""
    return _fused(q, k, v, policy, is_causal=True)


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy, **mask) -> torch.Tensor:
    """torch's scaled_dot_product_attention on [B, T, H, D] operands in compute_dtype, GQA's
    groups as they are, the mask given as the kernel takes it (attn_mask= or is_causal=)."""
    dtype = dt(policy.compute_dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype).transpose(1, 2), k.to(dtype).transpose(1, 2), v.to(dtype).transpose(1, 2),
        scale=q.shape[-1] ** -0.5, enable_gqa=True, **mask)
    return out.transpose(1, 2)


# $LLAMA_PARITY_TORCHREF_ATTENTION: auto (fused_attention_applies' and kernel_attention_applies'
# rules), fused (torch's fused kernel for any policy whose attention is in one float dtype: also
# f64), kernel (as auto, an error where the fixed-order kernels cannot be built), or ops (neither:
# block_attention)
ATTENTION_ENV = "LLAMA_PARITY_TORCHREF_ATTENTION"
_ATTENTION_CHOICES = ("auto", "fused", "kernel", "ops")


def _attention_choice() -> str:
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in _ATTENTION_CHOICES:
        raise ValueError(f"{ATTENTION_ENV}={choice!r}: expected {', '.join(_ATTENTION_CHOICES)}")
    return choice


def kernel_attention_applies(policy: Policy, device: torch.device) -> bool:
    """Whether attention runs as kernel_attention instead of block_attention (a prompt's and a
    decode step's alike): a bf16 policy (bf16 operands, f32 accumulation and softmax) on an x86-64
    CPU. block_attention's separate products, roundings, mask and softmax write and read every
    score several times, and torch's fused kernel cannot stand in (it rounds the unnormalised
    exponentials, the policy the probabilities). SmolLM2's attention at 2048 tokens on a 2-core
    Zen 4, one layer: 37 ms against block_attention's 53 with its AVX-512-BF16 products, 42
    against 87 under an AVX2 cap, where the fp32 policy's fused kernel takes 48; a short prompt's
    whole prefill, in-process A/B: 128 tokens 122.8 against 129.2 ms (AVX2 cap 217 / 230), 16
    tokens in a cache of 528 slots 55.7 / 59.3 (block_attention reads every slot, the kernel each
    query's keys up to its last visible one). A decode step, since the kernel reads bf16 (or f32)
    keys and values as they are and packs them 8 at a time (session 37; before, it was the slower
    there): 16 steps after 128 tokens, in-process A/B, ms a step, block_attention / kernel, batch
    1: 23.8 / 20.7, batch 8: 37.9 / 31.9; under the AVX2 cap (the cache then in bf16 too,
    cache_dtype) batch 1: 21.1 / 19.7, batch 8: 54.3 / 56.3 (docs/measurements.md). A query's
    result does not depend on the tile it shares, so a decode step's attention gives the bits the
    same query gets in a prompt. Its bits are the same on every x86-64 CPU, code path, batch and
    thread count. Not where torch's bf16 products run on AMX tiles (amx_products: unmeasured
    there). Decided by the policy and the CPU, never by a timing; $LLAMA_PARITY_TORCHREF_ATTENTION
    overrides (kernel: an error if the kernels cannot be built; fused, ops: never). Kernels that
    cannot be built leave block_attention, with one warning."""
    if not (policy.compute_dtype == "bfloat16" and policy.accum_dtype == "float32"
            and policy.softmax_dtype == "float32" and device.type == "cpu"
            and platform.machine().lower() in ("x86_64", "amd64")):
        return False
    choice = _attention_choice()
    if choice in ("fused", "ops") or (choice == "auto" and amx_products()):
        return False
    return _available_kernels(choice == "kernel", "attention") is not None


def amx_products(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether torch multiplies `dtype` (bf16 / fp16) matrices on AMX tiles here
    (hardware_products, the CPU's AMX flag for it, amx_bf16 / amx_fp16, and oneDNN not capped
    below AMX). There a bf16 block_attention's products run on oneDNN's AMX kernels, several times
    the AVX-512 multiply-adds kernel_attention runs on, and no one has timed the two against each
    other on such a CPU: auto leaves block_attention there (and torch's few-row products:
    _pairs_of_few_rows)."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").strip().upper()
    amx_flag = _HARDWARE_FLAGS[dtype][0]
    return (hardware_products(dtype) and amx_flag in cpuinfo.name_and_flags()[1]
            and cap.startswith(("AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT")))


@functools.cache
def fixed_order_kernels():
    """fixed_order's library, its parallel work on torch's OpenMP threads where torch has
    GNU OpenMP: a pool of its own would compete with torch's spinning threads for the
    cores (docs/measurements.md)."""
    from llamaspec import fixed_order as fo
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


# what runs on torch's ops instead where the fixed-order kernels cannot be built, and the
# setting that chooses torch's ops outright (the warning names both)
_WITHOUT_KERNELS = {"products": ("products of a few rows run on torch's", f"{PRODUCTS_ENV}=torch"),
                    "logits": ("a bf16 policy's f32 logits run on torch's f32 product", f"{LOGITS_ENV}=torch"),
                    "attention": ("a bf16 policy's long-prompt attention runs as separate torch ops",
                                  f"{ATTENTION_ENV}=ops")}


@functools.cache
def _available_kernels(strict: bool, user: str):
    """fixed_order_kernels for `user` (a key of _WITHOUT_KERNELS), or None where they cannot be
    built (one warning per user; strict: the error)."""
    try:
        return fixed_order_kernels()
    except InvarianceError as e:
        if strict:
            raise
        fallback, setting = _WITHOUT_KERNELS[user]
        warnings.warn(f"torchref's fixed-order kernels are not available ({e}); {fallback} ({setting} silences "
                      "this)", RuntimeWarning, stacklevel=4)
        return None


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     policy: Policy) -> torch.Tensor:
    """block_attention's function for a bf16 policy in one pass per tile of queries, on the
    fixed-order kernels (llamaspec/fixed_order.h, CausalAttention; docs/measurements.md): the scores
    of a tile's rows rounded to bf16 (and scaled, as block_attention, before or after), masked,
    softmax in f32 with the kernels' exp, the probabilities rounded to bf16, their product with the
    values rounded to bf16, every score kept in cache instead of written out and read back per
    step. The same products and roundings as block_attention, summed in another order (drift,
    held to rounding by the tests), and the same bits on every x86-64 CPU, code path, batch and
    thread count. Each query reads the keys up to its last visible one (all S when it sees none,
    averaging every value as block_attention does). Shapes as block_attention."""
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
    """q, k or v as kernel_attention hands it to the kernel, which reads bf16 as it is and f32
    rounded to bf16 (a bf16 policy's f32 KV cache: the identity), so neither is copied here:
    another dtype rounded to bf16 by torch (as block_attention's cast), its last dimension
    contiguous."""
    t = t if t.dtype in (torch.bfloat16, torch.float32) else t.to(torch.bfloat16)
    return t if t.stride(-1) == 1 else t.contiguous()


def _kernel_operand_args(t: torch.Tensor) -> tuple:
    """fo_attention's arguments for one operand: its memory, whether it is bf16, its strides."""
    return (t.data_ptr(), t.dtype == torch.bfloat16, *t.stride()[:3])


def fused_attention_applies(policy: Policy, device: torch.device) -> bool:
    """Whether attention runs the blocks of a long prompt (2 * QUERY_BLOCK queries or more) as
    fused_block (torch's fused kernel; a plain prompt as one fused_causal call) instead of
    block_attention's separate products, mask and softmax. Shorter calls (short prompts, decode
    steps) always run block_attention: their attention is a small part of their time (SmolLM2,
    128 tokens: the same time either way), and there torchref's f32 attention keeps
    transformers' eager arithmetic.

    auto: on the CPU, for a policy whose attention is f32 throughout (compute, accumulation and
    softmax in f32, IEEE products: fp32, bf16w-f32), where the kernel computes what the policy
    says and only the order of its sums differs. A 16-bit policy keeps block_attention: the
    kernel rounds the unnormalised exps to bf16 for p . v, the policy the normalised
    probabilities (another rounding point, not only another order). Decided by the device and
    the policy, never by a timing; $LLAMA_PARITY_TORCHREF_ATTENTION overrides (fused: also f64
    policies, on any device; ops: never)."""
    choice = _attention_choice()
    kinds = {policy.compute_dtype, policy.accum_dtype, policy.softmax_dtype}
    if choice == "fused":
        return kinds in ({"float32"}, {"float64"})
    return choice == "auto" and kinds == {"float32"} and policy.matmul == "ieee" and device.type == "cpu"


def fused_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                policy: Policy) -> torch.Tensor:
    """block_attention's function through torch's fused kernel (scaled_dot_product_attention:
    on the CPU its flash kernel, which sums the keys in tiles with a running max and divides
    by the total at the end): the same scores, exponentials and products, summed in another
    order (drift, held to rounding by the tests). Shapes as block_attention; q, k, v share the
    policy's one float dtype.

    The mask goes in as an additive one: 0 where allowed, the dtype's most negative finite value
    elsewhere. A score plus that value is that value (the score is far below its ulp), as
    block_attention's fill gives, so a query that may see nothing averages every value here
    too, where a boolean mask (-inf) would give NaN. No mask at all when everything is allowed.
    A NaN key, masked or not, makes NaN scores for the queries of the kernel's tile: more NaN than
    block_attention's fill leaves (it hides a masked one), never less.
    """
    dtype = dt(policy.compute_dtype)
    mask = None
    if not bool(allowed.all()):
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask = mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]      # [B, 1, T, S]
    return _fused(q, k, v, policy, attn_mask=mask)


def keys_read(allowed: torch.Tensor) -> list[int]:
    """How many keys each block of QUERY_BLOCK queries reads (attention): one past the last key
    that any query of the block, in any row, may see; every key (S) when some query of the block
    may see none. allowed [B, T, S]. Read from the mask in one pass (one host sync per call)."""
    T, S = allowed.shape[1:]
    pad = -T % QUERY_BLOCK
    # the mask's bytes as 0/1: torch reduces uint8 with vector code, bool not (max over the last
    # axis of a [2048, 2048] mask: 0.05 ms against 1.5 ms for any(), AMX Xeon)
    seen = allowed.bool().view(torch.uint8)
    by_query = seen.amax(0)                                                # [T, S]
    sees_some = torch.nn.functional.pad(seen.amax(-1).amin(0), (0, pad), value=1)
    by_block = torch.nn.functional.pad(by_query, (0, 0, 0, pad)).view(-1, QUERY_BLOCK, S).amax(1)
    last = S - by_block.flip(-1).argmax(-1)                               # one past the last 1
    everything = (sees_some.view(-1, QUERY_BLOCK).amin(-1) == 0) | (by_block.amax(-1) == 0)
    return torch.where(everything, S, last).tolist()


def first_hidden(allowed: torch.Tensor) -> list[int]:
    """For each block of QUERY_BLOCK queries (attention), the first key that some query of the
    block, in any row, may not see (S when they all see every key): block_attention fills the
    block's masked scores from there on, the scores before it being all kept (a causal block of
    an unpadded prompt: only its last QUERY_BLOCK keys hold masked scores). allowed [B, T, S];
    one pass, one host sync (read as bytes, as keys_read)."""
    T, S = allowed.shape[1:]
    pad = -T % QUERY_BLOCK
    hides = (~allowed.bool()).view(torch.uint8).amax(0)                             # [T, S]
    by_block = torch.nn.functional.pad(hides, (0, 0, 0, pad)).view(-1, QUERY_BLOCK, S).amax(1)
    return torch.where(by_block.amax(-1) == 1, by_block.argmax(-1), S).tolist()   # argmax: the first 1


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    policy: Policy, fill_from: int = 0, scratch: Scratch | None = None) -> torch.Tensor:
    """Causal GQA attention over every key given. q [B, T, Hq, D]; k, v [B, S, Hkv, D];
    allowed [B, T, S]; fill_from: a key before which every query may see every key (first_hidden),
    so that the fill of masked scores starts there (the same bits as filling from 0, one pass
    over fewer scores); scratch: memory for the scores and probabilities (a long prompt's blocks
    share one; without, fresh tensors: a short call's, as a decode step's, are small, and
    taking them from a Scratch cost a decode step's attention half its time).

    Query head h reads kv head h // G (HF's repeat_kv order). Instead of repeating K
    and V, the G query heads of a group are folded into the row dimension:
    [B, Hkv, G*T, D] @ [B, Hkv, D, S], one plain batched matmul per kv head. (k and v
    may be strided views of a [B, Hkv, S, D] cache; no copy is made of them then.)
    Masked scores get the dtype's most negative finite value, so a row with nothing
    allowed (padding) gives a uniform average instead of NaN.

    Where the products widen (_widens, by their rows: a decode step's keys are many small
    products, which torch's software bf16 kernel would run one by one), their operands go in
    accum_dtype, and the scores and probabilities, rounded to compute_dtype in place
    (_rounded), stay in it: the same values as compute_dtype's, read by the softmax (where
    softmax_dtype is accum_dtype) and the next product without another conversion.
    """
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    compute, accum, soft = dt(policy.compute_dtype), dt(policy.accum_dtype), dt(policy.softmax_dtype)
    wide = accum if _widens(compute, accum, compute, B * Hq * T, q.device) else compute   # the products' dtype
    scale = D ** -0.5
    early = scale_queries(scale, policy.compute_dtype)   # HF's order, (q @ k^T) * scale, in fewer passes
    qg = _query_rows(cast(q, compute) * scale if early else cast(q, compute), Hkv)
    # one bmm over the batch's kv heads (what torch.matmul of the [B, Hkv, ...] operands runs,
    # without its dispatch: about 2.5 us a product, two a layer)
    keys = cast(k.permute(0, 2, 3, 1), wide).reshape(B * Hkv, D, S)
    scores = torch.bmm(cast(qg, wide), keys, **_into(scratch, "scores", (B * Hkv, G * T, S), wide, q.device))
    scores = _rounded(scores, compute, scratch)
    if not early:
        scores = cast(scores, compute) * scale
    scores = cast(scores.view(B, Hkv, G, T, S), soft)   # a no-op where the product left them in soft
    # in place (scores is this call's own), from fill_from on
    hidden, lowest = _hidden(allowed), torch.finfo(soft).min
    if fill_from:
        scores[..., fill_from:].masked_fill_(hidden[..., fill_from:], lowest)
    else:
        scores.masked_fill_(hidden, lowest)
    probs = softmax(scores, **_into(scratch, "probs", scores.shape, soft, q.device)).view(B * Hkv, G * T, S)
    probs = _rounded(probs, compute, scratch) if probs.dtype == wide else cast(probs, compute)
    ctx = torch.bmm(cast(probs, wide), cast(v.permute(0, 2, 1, 3), wide).reshape(B * Hkv, S, D))   # [B Hkv, G T, D]
    return _from_query_rows(cast(ctx, compute), B, T)


def _query_rows(q: torch.Tensor, Hkv: int) -> torch.Tensor:
    """q [B, T, Hq, D] as block_attention's rows [B * Hkv, G * T, D]: kv head h's G query heads
    (heads h * G ... h * G + G - 1), each with its T queries. One query a row (a decode step) is
    that order already: one reshape (a view of a contiguous q), not two and a permute (a decode
    step's ops cost microseconds each, far more than their arithmetic)."""
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
    """{"out": a tensor from scratch's buffer `name`} for an op's out= argument, or {} (a fresh
    result) without scratch."""
    return {} if scratch is None else {"out": scratch.empty(name, shape, dtype, device)}


def _rounded(x: torch.Tensor, dtype: torch.dtype, scratch: Scratch | None) -> torch.Tensor:
    """x's values rounded to `dtype` (narrower than x's, or x's own: then x as it is), in x's
    dtype: x.to(dtype).to(x.dtype), or, with scratch, written back into x through scratch's
    buffer (no new tensor of x's size)."""
    if x.dtype == dtype:
        return x
    if scratch is None:
        return x.to(dtype).to(x.dtype)
    return x.copy_(scratch.empty("rounded", x.shape, dtype, x.device).copy_(x))


def _hidden(allowed: torch.Tensor) -> torch.Tensor:
    """~allowed [B, 1, 1, T, S]: the keys each query may not see, as block_attention's scores
    [B, Hkv, G, T, S] take it, inverted once per call's mask (last_answer)."""
    return last_answer(_HIDDEN, allowed, lambda a: torch.bitwise_not(a)[:, None, None])


def softmax(s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last axis, computed in s.dtype (into `out`, of s's shape and dtype, when
    given).

    torch.softmax on a bf16/fp16 tensor computes in f32 internally and rounds once, so
    a "softmax in bf16" policy would silently be an f32 softmax. For 16-bit dtypes the
    steps are therefore spelled out (each op rounds to s.dtype, as jaxmodel.ops.softmax
    does); f32/f64 keep torch's kernel, which is the one transformers uses.
    """
    if s.dtype in (torch.bfloat16, torch.float16):
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return torch.div(e, e.sum(-1, keepdim=True), out=out)
    return torch.softmax(s, dim=-1, out=out)


def _widened_operand(t: torch.Tensor, policy: Policy, rows: int) -> torch.Tensor:
    """t in accum_dtype where attention's products of `rows` rows widen (their keys, values)."""
    compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
    return t.to(accum) if _widens(compute, accum, compute, rows, t.device) else t


def silu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x)


def times(a: torch.Tensor, b: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """a * b, written into a where that is the same tensor: a is an op's own new result that
    nothing else holds (the caller's promise: the MLP's silu(gate)), of b's shape and dtype,
    sharing memory with neither b nor `inputs` (the tensors a was made from, which a
    user's or a control's op may return as they are or as a view), and no gradient is being
    taken. The same multiplications, the same bits; one [tokens, intermediate] tensor fewer per
    layer: a prompt's MLP then holds what transformers' holds at once (its gate, up, act), so
    that glibc's allocator less often returns the freed top of its heap to the system only to
    fault the pages in again at the next layer (SmolLM2's fp32 2048-token prefill on a Zen 4,
    docs/measurements.md)."""
    # plain comparisons: a decode step calls this once a layer (torch.broadcast_shapes alone
    # costs 9 us, a * b of one row 1.5)
    if a.shape != b.shape or a.dtype != b.dtype or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return a * b
    memory = a.untyped_storage().data_ptr()
    for t in (b, *inputs):
        if t.untyped_storage().data_ptr() == memory:
            return a * b
    return a.mul_(b)
