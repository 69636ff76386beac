"""Batch-invariant versions of the ops whose result for one sequence could depend on the
rest of the batch. Same names and signatures as ops.py; the model swaps the module.

What breaks invariance was measured on this project's CPU (torch 2.13, MKL sgemm/dgemm
on AVX2, torch's own bf16/fp16 GEMM; scripts in bench/bench_invariant.py --probe):

- f32 linear layers run on oneDNN (torch.ops.mkldnn._linear_pointwise) against weights
  packed once into its blocked layout (_reorder_linear_weight with a 2-row hint; a
  1-row hint keeps the plain layout, whose kernel is slower at 2+ rows). Its brgemm
  kernel gives a row one result at every row count, one row included (checked at every
  position, 1 and 2 threads: M = 1..4096 on SmolLM2's shapes, stacked ones and the
  lm_head included; M = 1..1100 on 392 shapes from 8 to 1536, with and without bias),
  so nothing is padded. Projections that read one input (q/k/v, gate/up) run as one
  GEMM on their stacked weights: the same bits as one call each, fewer calls. The
  packed copies double the f32 weight memory.
- MKL f32/f64 GEMM (torch's F.linear) gives a row one result whenever it sits in a full
  4-row panel, whatever M (checked M = 4..4096, every row position, fixed K and N); the
  trailing M % 4 rows and M < 4 (GEMV and small kernels) use other summation orders. So
  the matmuls that stay on it (attention's, f64 linears, and f32 linears where oneDNN is
  missing) run on a row count padded to a multiple of ROW_QUANTUM. torch's bf16/fp16 CPU
  GEMM (used when oneDNN has no bf16/fp16 kernel for the CPU) is one fixed dot product
  per output and needs no padding (padding would cost ~M-fold).
- GEMM results also change with K and N (blocking and column tails): attention over a
  key length S that depends on the batch's longest row is not invariant. Attention
  therefore works on key blocks of KEY_BLOCK slots: q.k^T and P@V are GEMMs of one
  fixed [rows, D] x [D, KEY_BLOCK] / [rows, KEY_BLOCK] x [KEY_BLOCK, D] shape, the
  softmax sum is a per-block sum of fixed length, and block results are added in
  order, block by block. The canonical layout (real tokens at slots [0, n), see
  llamaspec.inputs.invariant_layout) puts every key at the same block and column
  whatever the padding, and blocks past a row's end add exact zeros.
- Elementwise kernels run the vectorised body on most elements and a scalar loop on
  the tail of each thread's chunk, and for some functions the two differ: f32/f64
  sigmoid/silu (4% of inputs) and bf16 rsqrt (29%). exp, cos, sin, f32 rsqrt, +-*/
  agree. silu is therefore x / (1 + exp(-x)), and a 16-bit rsqrt goes through f32.
- Row reductions over a fixed length (RMSNorm's mean) and max are row-count invariant.
- Cost, and what was tried before oneDNN (bench/bench_invariant.py, SmolLM2 fp32 decode):
  padding every linear to 4 rows for MKL cost 1.9x the default mode at batch 1 (a 4-row
  GEMM costs 2-3x the GEMV it replaces). With the weight stored transposed MKL gives a
  call of at most 3 rows the GEMV's result at GEMV cost, but per row: batch 1 then
  matched the default mode and 8 rows cost 1.96x, 32 rows 4.11x. oneDNN with weights
  packed per call was slower than the padding; packed once, its 1-row and 2-row calls
  cost about a GEMV (SmolLM2's lm_head: 5.1 ms against MKL's 9.7 ms GEMV), so the mode
  now decodes about as fast as the default one.

Invariance holds up to max_position_embeddings tokens per sequence (prompt plus new
tokens; the dynamic NTK RoPE base depends on the batch's longest row past it). On
GPUs none of the above was measured (cuBLAS picks kernels by M): no claim there.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from llamaspec import Policy

from . import ops
from .dtypes import dt
from .ops import apply_rope, rope_cos_sin, rope_inv_freq, rotate_half  # noqa: F401 (invariant as is)

ROW_QUANTUM = 4     # MKL's f32/f64 micro-panel height on this CPU (measured)
KEY_BLOCK = 64      # keys per attention block: every attention GEMM has this fixed size
MAX_ROWS = 4096     # largest row count measured invariant; longer inputs run in chunks
ONEDNN_PACK_ROWS = 2  # row hint for oneDNN's weight packing: 2+ gives the blocked layout (measured)


def _quantum(dtype: torch.dtype, device: torch.device) -> int:
    """Row padding a matmul on `dtype` operands needs for row-invariant results."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        native = (torch.ops.mkldnn._is_mkldnn_bf16_supported() if dtype == torch.bfloat16
                  else torch.ops.mkldnn._is_mkldnn_fp16_supported())
        if not native:  # torch's own fixed-order kernel, measured invariant at every M
            return 1
    return ROW_QUANTUM


def _pad_rows(x: torch.Tensor, quantum: int) -> torch.Tensor:
    """x [..., M, K] with M padded by zero rows to a multiple of quantum."""
    extra = -x.shape[-2] % quantum
    return torch.nn.functional.pad(x, (0, 0, 0, extra)) if extra else x


def _operand_dtype(policy: Policy, out: torch.dtype) -> torch.dtype:
    compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
    return compute if ops._native(compute, accum, out) else accum


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, policy: Policy,
           out_dtype: str | None = None) -> torch.Tensor:
    """ops.linear with a result per row that does not depend on the row count: f32
    operands on oneDNN (any row count), other dtypes on ops.linear padded to the quantum;
    in chunks of at most MAX_ROWS rows."""
    return linears(x, (w,), (b,), policy, out_dtype)[0]


def linears(x: torch.Tensor, ws, bs, policy: Policy, out_dtype: str | None = None) -> list[torch.Tensor]:
    """ops.linears: on the oneDNN path one GEMM against the weights stacked (packed once),
    split into one result per weight (views of it); otherwise linear() for each."""
    out = dt(out_dtype or policy.compute_dtype)
    operand = _operand_dtype(policy, out)
    packed = _onednn_pack(ws, bs) if operand == torch.float32 else None
    rows = x.reshape(-1, x.shape[-1])
    if packed is None:
        quantum = _quantum(operand, x.device)
        return [_in_chunks(rows, x.shape, lambda r: ops.linear(_pad_rows(r, quantum), w, b, policy,
                                                                out_dtype)[:r.shape[0]])
                for w, b in zip(ws, bs)]
    y = _in_chunks(rows.to(operand), x.shape, lambda r: torch.ops.mkldnn._linear_pointwise(
        r, packed.weight, packed.bias, "none", [], "").to(out))
    return list(y.split([w.shape[0] for w in ws], dim=-1)) if len(ws) > 1 else [y]


def _in_chunks(rows: torch.Tensor, shape, fn) -> torch.Tensor:
    """fn on chunks of at most MAX_ROWS rows, joined and shaped as [*shape[:-1], out]."""
    y = fn(rows) if rows.shape[0] <= MAX_ROWS else torch.cat([fn(r) for r in rows.split(MAX_ROWS)])
    return y.reshape(*shape[:-1], y.shape[-1])


class _Packed(NamedTuple):
    refs: tuple          # weak references to the source tensors (they drop the entry)
    versions: tuple      # their version counters when packed
    weight: torch.Tensor  # the weights stacked, f32, in oneDNN's blocked layout
    bias: torch.Tensor | None


def _onednn_pack(ws, bs) -> _Packed | None:
    """The weights (and biases) stacked as f32 and packed for oneDNN, once per set of
    tensors and again when one is replaced or changed in place (its version counter
    moves). None where the oneDNN path does not apply (no oneDNN, not on the CPU, an
    inference-mode tensor, which has no version counter, or biases on some weights
    only): those weights always take ops.linear's padded path instead."""
    if not _ONEDNN:
        return None
    tensors = tuple(ws) + tuple(b for b in bs if b is not None)
    if len(tensors) not in (len(ws), 2 * len(ws)) or any(
            t.device.type != "cpu" or t.is_inference() for t in tensors):
        return None
    # An entry lives only while all its tensors do (each weak reference drops it when its
    # tensor dies, before the id can be reused), so the ids name these very tensors.
    key = tuple(map(id, tensors))
    entry = _PACKED.get(key)
    if entry is None or entry.versions != tuple(t._version for t in tensors):
        drop = lambda _, key=key: _PACKED.pop(key, None)  # noqa: E731
        weight = torch.cat([w.detach().float() for w in ws])
        bias = torch.cat([b.detach().float() for b in bs]) if len(tensors) > len(ws) else None
        entry = _PACKED[key] = _Packed(tuple(weakref.ref(t, drop) for t in tensors),
                                       tuple(t._version for t in tensors),
                                       torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_ROWS), bias)
    return entry


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_PACKED: dict[tuple, _Packed] = {}  # ids of the source tensors -> their packed form


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, policy: Policy) -> torch.Tensor:
    """ops.rms_norm; a 16-bit rsqrt is taken in f32 and rounded once (what the vectorised
    kernel does; its scalar tail rounds twice)."""
    compute, norm = dt(policy.compute_dtype), dt(policy.norm_dtype)
    h = x.to(norm)
    var = h.pow(2).mean(-1, keepdim=True) + eps
    h = h * (torch.rsqrt(var.float()).to(norm) if norm in (torch.bfloat16, torch.float16)
             else torch.rsqrt(var))
    if policy.norm_cast_before_weight:
        return weight.to(compute) * h.to(x.dtype).to(compute)
    return (weight.to(h.dtype) * h).to(compute)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)): torch's f32/f64 silu differs between its
    vector body and scalar tail; exp and division do not. 16-bit silu agrees in both."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return torch.nn.functional.silu(x)
    return x / (1 + torch.exp(-x))


def _in_order(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` one block after the other: a fixed order, and trailing blocks that
    hold only zeros leave the sum unchanged, whatever their number."""
    acc = parts.select(dim, 0)
    for i in range(1, parts.shape[dim]):
        acc = acc + parts.select(dim, i)
    return acc


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              policy: Policy) -> torch.Tensor:
    """ops.attention, computed per KEY_BLOCK block of keys in a fixed order.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; allowed [B, T, S]. S is padded to a multiple of
    KEY_BLOCK (with masked zero keys). The softmax takes the max over every block (exact
    in any order), exp, per-block sums, and adds the block sums in order (16-bit softmax
    dtypes add in f32 and round once, as torch's sum does); P@V partials are taken in
    accum_dtype and added in order, then rounded once to compute_dtype.
    """
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G, Kb = Hq // Hkv, KEY_BLOCK
    compute, accum, soft = dt(policy.compute_dtype), dt(policy.accum_dtype), dt(policy.softmax_dtype)
    pad = -S % Kb
    if pad:
        k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad))
        allowed = torch.nn.functional.pad(allowed, (0, pad))
    nk, M = (S + pad) // Kb, G * T
    quantum = _quantum(_operand_dtype(policy, compute), q.device)
    qg = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, M, D)
    # Contiguous copies: the cache is a slice of a longer buffer or the whole of it, and
    # torch's bf16 matmul sums in another order for another operand layout (measured:
    # one bf16 rounding in layer 24 of SmolLM2 changed with the cache length).
    kb = k.permute(0, 2, 1, 3).reshape(B, Hkv, nk, Kb, D).contiguous()
    scores = ops._matmul(_pad_rows(qg, quantum)[:, :, None], kb.transpose(-1, -2), policy)
    scores = scores[..., :M, :] * (D ** -0.5)                            # [B, Hkv, nk, M, Kb]
    scores = scores.view(B, Hkv, nk, G, T, Kb).to(soft)
    keep = allowed.view(B, T, nk, Kb).permute(0, 2, 1, 3)[:, None, :, None]
    scores = scores.masked_fill(~keep, torch.finfo(soft).min)
    e = torch.exp(scores - scores.amax(dim=(2, 5), keepdim=True))
    wide = torch.float32 if soft in (torch.bfloat16, torch.float16) else soft
    denom = _in_order(e.sum(-1, keepdim=True, dtype=wide), 2).to(soft)  # [B, Hkv, G, T, 1]
    probs = (e / denom[:, :, None]).to(compute).view(B, Hkv, nk, M, Kb)
    vb = v.permute(0, 2, 1, 3).reshape(B, Hkv, nk, Kb, D).contiguous()
    quantum = _quantum(accum, q.device)
    parts = torch.matmul(_pad_rows(probs, quantum).to(accum), vb.to(accum))  # [B, Hkv, nk, M', D]
    ctx = _in_order(parts[..., :M, :], 2).to(compute)                     # [B, Hkv, M, D]
    return ctx.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
