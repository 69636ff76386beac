"""Batch-invariant versions of the ops whose result for one sequence could depend on the
rest of the batch: same names and signatures as ops.py (the invariant backend: plan.py picks it);
jaxmodel/invariant.py mirrors this file function by function.

Every product, row sum and exp runs on llamaspec.fixed_order's kernels, whose order per
result the code fixes whatever the row count, threads or instruction set; 1/sqrt replaces
rsqrt; RoPE tables come from fixed-shape chunks; attention runs per KEY_BLOCK keys, block
results added in order. What stays in torch is order-free (+, -, *, /, sqrt, max, casts,
gathers, masks). CPU only. docs/invariance.md says why each step is needed; self_check()
verifies the promise on this machine at load.
"""

from __future__ import annotations

import torch

from llamaspec import Policy
from llamaspec import fixed_order as fo
from llamaspec.errors import InvarianceError

from . import fast, ops
from .dtypes import dt
from .fast import times_in_place as times  # noqa: F401 (the same bits as ops.times)
from .ops import apply_rope, cache_dtype, kv_round, rope_inv_freq, rotate_half, write_cache  # noqa: F401 (invariant as is)

# the layout, RoPE tables, in-order block sums and the self-check: one definition for both implementations
from .portable import KEY_BLOCK, LAYOUT_MULTIPLE, ROPE_CHUNK, rope_cos_sin, self_check  # noqa: F401
from .portable import in_order as _in_order

_WTYPE = {torch.float32: fo.WTYPES["float32"], torch.float64: fo.WTYPES["float64"]}  # batched products


def _acc(policy: Policy) -> torch.dtype:
    """The accumulator of every product and sum: f64 for an f64 accumulation, else f32."""
    return torch.float64 if dt(policy.accum_dtype) == torch.float64 else torch.float32


def _on_cpu(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise InvarianceError(f"batch_invariant=True runs on the CPU only (its fixed-order kernels are "
                              f"CPU code); got a tensor on {t.device}")


# ----- fixed-order kernels on torch tensors ------------------------------------------------

def _gemm(x: torch.Tensor, packed: fast.Packed) -> torch.Tensor:
    """x [M, K] (contiguous; bf16 for bf16 x bf16 pairs, else the accumulator dtype) @ w^T
    -> [M, N] in the accumulator dtype."""
    return fast.fixed_order_gemm(x, packed.data, packed.wtype, packed.n)


def _gemm_batched(x: torch.Tensor, w: torch.Tensor, w_kn: bool) -> torch.Tensor:
    """x [P, Q, M, K] @ w[p, q]^T for w [P, Q, N, K] (or [P, Q, K, N] when w_kn), all in
    one accumulator dtype; x's Q axis may have stride 0 (one x for every q)."""
    P, Q, M, K = x.shape
    N = w.shape[-1] if w_kn else w.shape[-2]
    assert x.stride(-1) == 1 and x.stride(-2) == K and w.is_contiguous()
    y = torch.empty((P, Q, M, N), dtype=x.dtype)
    sn, sk = (1, N) if w_kn else (K, 1)
    fast.fixed_order_kernels().fo_gemm_batched(P, Q, M, N, K, x.data_ptr(), K, x.stride(0), x.stride(1),
                                 w.data_ptr(), _WTYPE[x.dtype], sn, sk, w.stride(0), w.stride(1),
                                 y.data_ptr(), N, y.stride(0), y.stride(1), torch.get_num_threads())
    return y


def _row_sums(x: torch.Tensor, squares: bool = False) -> torch.Tensor:
    """Sum over the last axis (of x or x^2), one fma chain per row; x f32 or f64."""
    x = x.contiguous()
    s = torch.empty(x.shape[:-1], dtype=x.dtype)
    fast.fixed_order_kernels().fo_row_sums(s.numel(), x.shape[-1], x.data_ptr(), x.shape[-1], int(squares),
                             int(x.dtype == torch.float64), s.data_ptr(), torch.get_num_threads())
    return s


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp by fixed_order's program; 16-bit inputs are taken in f32 and rounded once (as
    torch's 16-bit exp does)."""
    wide = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    a = x.to(wide).contiguous()
    y = torch.empty_like(a)
    fast.fixed_order_kernels().fo_exp(a.numel(), a.data_ptr(), int(wide == torch.float64), y.data_ptr(),
                        torch.get_num_threads())
    return y.to(x.dtype)


# ----- packed weights ---------------------------------------------------------------------

# ----- the ops ----------------------------------------------------------------------------

def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, policy: Policy,
           out_dtype: str | None = None) -> torch.Tensor:
    """ops.linear: operands rounded to compute_dtype, products summed in the accumulator
    by fixed_order's gemm, bias added, rounded once to out_dtype."""
    return linears(x, (w,), (b,), policy, out_dtype)[0]


def linears(x: torch.Tensor, ws, bs, policy: Policy, out_dtype: str | None = None) -> list[torch.Tensor]:
    """ops.linears as one product against the weights stacked (packed once: fast.pack), split into
    one result per weight: the same bits as one call each."""
    _on_cpu(x)
    return fast.packed_linears(x, ws, bs, policy, out_dtype, lambda rows, packed: _gemm(rows, packed))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, policy: Policy) -> torch.Tensor:
    """ops.rms_norm with mean(x^2) as a fixed-order sum of squares over the hidden size
    (in f32 for a 16-bit norm dtype, rounded once) and 1/sqrt(var) in place of rsqrt."""
    norm = dt(policy.norm_dtype)
    h = x.to(norm)
    wide = norm if norm in (torch.float32, torch.float64) else torch.float32
    var = (_row_sums(h.to(wide), squares=True) / x.shape[-1]).to(norm)[..., None] + eps
    return ops.norm_weight(h * (1 / torch.sqrt(var)), x, weight, policy)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)) with the fixed exp (16-bit: in f32, rounded once)."""
    wide = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    h = x.to(wide)
    return (h / (1 + _exp(-h))).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              policy: Policy) -> torch.Tensor:
    """ops.attention, computed per KEY_BLOCK block of keys in a fixed order.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; allowed [B, T, S]. S is padded to a multiple of
    KEY_BLOCK (with masked zero keys). Scores are fixed-order products rounded to
    compute_dtype and scaled; the softmax takes the max over every block (exact in any
    order), the fixed exp, per-block fixed-order sums (in f32 for 16-bit softmax dtypes,
    rounded once) added block after block; P@V partials are fixed-order products in the
    accumulator, added in order, then rounded once to compute_dtype.
    """
    _on_cpu(q)
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G, Kb = Hq // Hkv, KEY_BLOCK
    compute, soft, acc = dt(policy.compute_dtype), dt(policy.softmax_dtype), _acc(policy)
    pad = -S % Kb
    if pad:
        k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad))
        allowed = torch.nn.functional.pad(allowed, (0, pad))
    nk, M = (S + pad) // Kb, G * T
    qg = q.to(compute).reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B * Hkv, 1, M, D)
    kb = k.to(compute).permute(0, 2, 1, 3).reshape(B * Hkv, nk, Kb, D)
    scores = _gemm_batched(qg.to(acc).contiguous().expand(B * Hkv, nk, M, D), kb.to(acc).contiguous(),
                           w_kn=False)                                    # [B*Hkv, nk, M, Kb]
    scores = scores.to(compute) * (D ** -0.5)
    scores = scores.view(B, Hkv, nk, G, T, Kb).to(soft)
    keep = allowed.view(B, T, nk, Kb).permute(0, 2, 1, 3)[:, None, :, None]
    scores = scores.masked_fill(~keep, torch.finfo(soft).min)
    e = _exp(scores - scores.amax(dim=(2, 5), keepdim=True))
    wide = torch.float32 if soft in (torch.bfloat16, torch.float16) else soft
    denom = _in_order(_row_sums(e.to(wide))[..., None], 2).to(soft)       # [B, Hkv, G, T, 1]
    probs = (e / denom[:, :, None]).to(compute).view(B * Hkv, nk, M, Kb)
    vb = v.to(compute).permute(0, 2, 1, 3).reshape(B * Hkv, nk, Kb, D)
    parts = _gemm_batched(probs.to(acc).contiguous(), vb.to(acc).contiguous(), w_kn=True)
    ctx = _in_order(parts.view(B, Hkv, nk, M, D), 2).to(compute)          # [B, Hkv, M, D]
    return ctx.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


# ----- the self-check -------------------------------------------------------------------


