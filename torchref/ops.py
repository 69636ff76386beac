"""The Llama ops as small pure functions, each following the policy's dtypes exactly.

jaxmodel/ops.py has the same functions with the same names; the two files differ only
in the framework, and in that torchref's attention runs a long prompt in blocks of queries
(its block_attention is jaxmodel's attention). Numerics follow transformers'
LlamaForCausalLM (eager attention): RoPE half-split layout, scores = (q @ k^T) * scale,
mask then softmax.
"""

from __future__ import annotations

import math

import torch

from llamaspec import Policy, RopeConfig
from llamaspec.forward import scale_queries

from .dtypes import dt


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, policy: Policy) -> torch.Tensor:
    """mean(x^2) and rsqrt in norm_dtype; result in compute_dtype."""
    h = x.to(dt(policy.norm_dtype))
    return norm_weight(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), x, weight, policy)


def norm_weight(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, policy: Policy) -> torch.Tensor:
    """The normalised h (in norm_dtype) times the weight, in compute_dtype. HF convention
    (norm_cast_before_weight): h is rounded back to x's dtype first."""
    compute = dt(policy.compute_dtype)
    if policy.norm_cast_before_weight:
        return weight.to(compute) * h.to(x.dtype).to(compute)
    return (weight.to(h.dtype) * h).to(compute)


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
    cos = cos.to(x.dtype)[:, :, None, :]
    sin = sin.to(x.dtype)[:, :, None, :]
    return x * cos + rotate_half(x) * sin


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, policy: Policy,
           out_dtype: str | None = None) -> torch.Tensor:
    """x @ w.T + b, accumulated in accum_dtype and rounded once to out_dtype."""
    compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
    out = dt(out_dtype or policy.compute_dtype)
    if _native(compute, accum, out):
        y = torch.nn.functional.linear(x.to(compute), w.to(compute),
                                       None if b is None else b.to(compute))
    else:
        y = torch.nn.functional.linear(x.to(accum), w.to(accum), None if b is None else b.to(accum))
    return y.to(out)


def linears(x: torch.Tensor, ws, bs, policy: Policy, out_dtype: str | None = None) -> list[torch.Tensor]:
    """linear(x, w, b) for each weight and bias: the projections that read one input."""
    return [linear(x, w, b, policy, out_dtype) for w, b in zip(ws, bs)]


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
    return compute in (torch.bfloat16, torch.float16) and accum == torch.float32 and out == compute


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
    block would.
    """
    T = q.shape[1]
    if T < 2 * QUERY_BLOCK:
        return block_attention(q, k, v, allowed, policy)
    out = []
    for a, n in zip(range(0, T, QUERY_BLOCK), keys_read(allowed)):
        out.append(block_attention(q[:, a:a + QUERY_BLOCK], k[:, :n], v[:, :n], allowed[:, a:a + QUERY_BLOCK, :n],
                                   policy))
    return torch.cat(out, dim=1)


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


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    policy: Policy) -> torch.Tensor:
    """Causal GQA attention over every key given. q [B, T, Hq, D]; k, v [B, S, Hkv, D];
    allowed [B, T, S].

    Query head h reads kv head h // G (HF's repeat_kv order). Instead of repeating K
    and V, the G query heads of a group are folded into the row dimension:
    [B, Hkv, G*T, D] @ [B, Hkv, D, S], one plain batched matmul per kv head. (k and v
    may be strided views of a [B, Hkv, S, D] cache; no copy is made of them then.)
    Masked scores get the dtype's most negative finite value, so a row with nothing
    allowed (padding) gives a uniform average instead of NaN.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    compute, soft = dt(policy.compute_dtype), dt(policy.softmax_dtype)
    scale = D ** -0.5
    early = scale_queries(scale, policy.compute_dtype)   # HF's order, (q @ k^T) * scale, in fewer passes
    qg = (q.to(compute) * scale if early else q).reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)
    scores = _matmul(qg.reshape(B, Hkv, G * T, D), k.permute(0, 2, 3, 1), policy)  # [B, Hkv, G*T, S]
    if not early:
        scores = scores * scale
    scores = scores.view(B, Hkv, G, T, -1).to(soft)
    scores.masked_fill_(~allowed[:, None, None], torch.finfo(soft).min)         # scores is this call's own
    probs = softmax(scores).to(compute).view(B, Hkv, G * T, -1)
    ctx = _matmul(probs, v.permute(0, 2, 1, 3), policy)                   # [B, Hkv, G*T, D]
    return ctx.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


def softmax(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis, computed in s.dtype.

    torch.softmax on a bf16/fp16 tensor computes in f32 internally and rounds once, so
    a "softmax in bf16" policy would silently be an f32 softmax. For 16-bit dtypes the
    steps are therefore spelled out (each op rounds to s.dtype, as jaxmodel.ops.softmax
    does); f32/f64 keep torch's kernel, which is the one transformers uses.
    """
    if s.dtype in (torch.bfloat16, torch.float16):
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)
    return torch.softmax(s, dim=-1)


def _matmul(a: torch.Tensor, b: torch.Tensor, policy: Policy) -> torch.Tensor:
    compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
    if _native(compute, accum, compute):
        return torch.matmul(a.to(compute), b.to(compute))
    return torch.matmul(a.to(accum), b.to(accum)).to(compute)


def silu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x)
