"""The Llama ops as small pure functions: the reference, the precision policy's arithmetic.

One plain path per op, readable beside transformers' modeling_llama.py (eager attention): RoPE
in the half-split layout with f32 tables rounded to the activations' dtype, scores = (q @ k^T) *
scale, masked with the dtype's lowest finite value, softmax in softmax_dtype, probabilities
rounded to compute_dtype. Every product takes operands rounded to compute_dtype and sums them in
accum_dtype (16-bit operands widened: their products are exact in f32), one rounding at the end.
jaxmodel/ops.py has the same functions. Backends with the same names and signatures stand in
for these where the plan says so (fast.py, invariant.py); nothing here reads the machine.
"""

from __future__ import annotations

import math

import torch

from llamaspec import Policy, RopeConfig
from llamaspec.forward import scale_queries
from llamaspec.policy import DTYPES

from . import quant
from .dtypes import cast, dt


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, policy: Policy, offset: float = 0.0
             ) -> torch.Tensor:
    """mean(x^2) and rsqrt over the last axis in norm_dtype; result in compute_dtype. offset: the
    norm multiplies by (offset + weight) (Gemma's 1)."""
    h = cast(x, dt(policy.norm_dtype))
    return norm_weight(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), x, weight, policy, offset)


def norm_weight(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, policy: Policy, offset: float = 0.0
                ) -> torch.Tensor:
    """The normalised h (in norm_dtype) times (offset + weight), in compute_dtype. norm_cast_before_weight
    True or None (Llama's convention): h is rounded back to x's dtype first and the product is in
    compute_dtype; False (Gemma's, OLMo 2's): the weight (plus offset) and the product in norm_dtype,
    rounded once."""
    if policy.norm_cast_before_weight is not False:
        compute = dt(policy.compute_dtype)
        w = cast(weight, compute) + offset if offset else cast(weight, compute)
        return w * cast(cast(h, x.dtype), compute)
    w = cast(weight, h.dtype) + offset if offset else cast(weight, h.dtype)
    return cast(w * h, dt(policy.compute_dtype))


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


def _wide(policy: Policy) -> torch.dtype:
    """The dtype products run in: accum_dtype where it is wider than compute_dtype (the operands
    widened exactly), else compute_dtype (torch's kernel sums 16-bit operands in f32 itself)."""
    compute, accum = dt(policy.compute_dtype), dt(policy.accum_dtype)
    return accum if torch.finfo(accum).bits > torch.finfo(compute).bits else compute


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, policy: Policy,
           out_dtype: str | None = None) -> torch.Tensor:
    """x @ w.T + b: operands rounded to compute_dtype, summed in accum_dtype, rounded once to
    out_dtype (compute_dtype by default; the policy's logits_dtype for the lm_head)."""
    compute, wide = dt(policy.compute_dtype), _wide(policy)
    b = None if b is None else cast(cast(b, compute), wide)
    y = torch.nn.functional.linear(cast(cast(x, compute), wide), cast(cast(w, compute), wide), b)
    return cast(y, dt(out_dtype or policy.compute_dtype))


def fp8_product_dtype(policy: Policy) -> str:
    """The dtype a projection with an fp8 operand multiplies in: float32, float64 under a float64
    compute_dtype (llamaspec.policy: fp8 values widen exactly, their products are exact there)."""
    return "float64" if policy.compute_dtype == "float64" else "float32"


def fp8_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, policy: Policy) -> torch.Tensor:
    """A block projection under weight_fp8 / act_fp8: x rounded to compute_dtype, then (act_fp8)
    quantized as a [tokens, in] matrix and dequantized exactly into the fp8 product dtype; w is
    the dequantized weight the model keeps in that dtype (weight_fp8), else rounded to
    compute_dtype; both widened there, summed there, rounded once to compute_dtype."""
    compute, wide = dt(policy.compute_dtype), fp8_product_dtype(policy)
    x = cast(cast(x, compute), dt(wide))
    if policy.act_fp8:
        x = quant.dequantize(*quant.quantize(x.reshape(-1, x.shape[-1]), policy.act_fp8), policy.act_fp8,
                             wide).reshape(x.shape)
    w = w if policy.weight_fp8 else cast(w, compute)
    b = None if b is None else cast(cast(b, compute), dt(wide))
    return cast(torch.nn.functional.linear(x, cast(w, dt(wide)), b), compute)


def kv_round(x: torch.Tensor, policy: Policy) -> torch.Tensor:
    """A key (after RoPE) or value [B, T, Hkv, D] as the policy's kv_cache keeps it, back in x's
    dtype: as computed (None), rounded to a dtype, or quantized per token and kv head (an fp8
    spec, granularity channel) and dequantized to x's dtype."""
    kv = policy.kv_cache
    if kv is None:
        return x
    if kv in DTYPES:
        return cast(cast(x, dt(kv)), x.dtype)
    q, scales = quant.quantize(x.reshape(-1, x.shape[-1]), kv)
    return quant.dequantize(q, scales, kv, str(x.dtype).removeprefix("torch.")).reshape(x.shape)


def linears(x: torch.Tensor, ws, bs, policy: Policy, out_dtype: str | None = None) -> list[torch.Tensor]:
    """linear(x, w, b) for each weight and bias: the projections that read one input (q, k, v;
    gate, up), a seam a backend may run as one product."""
    return [linear(x, w, b, policy, out_dtype) for w, b in zip(ws, bs)]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              policy: Policy, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal GQA attention, transformers' eager order. q [B, T, Hq, D]; k, v [B, S, Hkv, D];
    allowed [B, T, S] (a sliding window is in it); out [B, T, Hq, D] in compute_dtype.

    Query head h reads kv head h // G (repeat_kv). scores = (q @ k^T) * scale (scale: D ** -0.5
    unless the family says, Gemma's query_pre_attn_scalar ** -0.5), or q * scale first where that
    gives the same bits (llamaspec.forward.scale_queries); soft-capped where the family caps them
    (Gemma 2: softcap(scores) in compute_dtype); masked scores get the softmax dtype's lowest
    finite value, so a query that may see nothing (padding) averages every value instead of giving
    NaN; the probabilities are rounded to compute_dtype before @ v."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    compute, soft, wide = dt(policy.compute_dtype), dt(policy.softmax_dtype), _wide(policy)
    scale = D ** -0.5 if scale is None else scale
    early = scale_queries(scale, policy.compute_dtype)
    q = cast(q, compute).transpose(1, 2)                                      # [B, Hq, T, D]
    k, v = (cast(t, compute).transpose(1, 2).repeat_interleave(G, dim=1) for t in (k, v))   # [B, Hq, S, D]
    if early:
        q = q * scale
    scores = cast(torch.matmul(cast(q, wide), cast(k, wide).transpose(-1, -2)), compute)
    if not early:
        scores = scores * scale
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    scores = cast(scores, soft).masked_fill(~allowed.bool()[:, None], torch.finfo(soft).min)
    probs = cast(softmax(scores), compute)
    ctx = cast(torch.matmul(cast(probs, wide), cast(v, wide)), compute)       # [B, Hq, T, D]
    return ctx.transpose(1, 2)


def softmax(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis, computed in s.dtype.

    torch.softmax on a bf16/fp16 tensor computes in f32 internally and rounds once, so a "softmax
    in bf16" policy would silently be an f32 softmax: for 16-bit dtypes the steps are spelled out
    (each op rounds to s.dtype, as jaxmodel.ops.softmax does); f32/f64 keep torch's kernel, the
    one transformers uses."""
    if s.dtype in (torch.bfloat16, torch.float16):
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)
    return torch.softmax(s, dim=-1)


def silu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's gelu_pytorch_tanh): torch's kernel, which computes
    a 16-bit x in f32 and rounds once, as silu's does."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) in x's dtype, each step rounded there (Gemma 2's attention scores and
    final logits, transformers' order)."""
    return torch.tanh(x / cap) * cap


def scale_embedding(rows: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Embedding rows times sqrt(hidden_size) rounded to the rows' dtype, multiplied there (Gemma:
    transformers multiplies by its scale cast to the embedding weight's dtype)."""
    return rows * torch.tensor(hidden_size ** 0.5, dtype=rows.dtype, device=rows.device)


def times(a: torch.Tensor, b: torch.Tensor, *made_from: torch.Tensor) -> torch.Tensor:
    """a * b (the MLP's silu(gate) * up; made_from: the tensors a was computed from, for a backend
    that writes into a)."""
    return a * b


def write_cache(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Writes x [B, T, Hkv, D] into cache [B, Hkv, S, D] at slots [B, T] of each row."""
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    cache[rows, :, slots] = cast(x, cache.dtype)


def cache_dtype(policy: Policy, device) -> torch.dtype:
    """The dtype the KV cache keeps keys and values in: compute_dtype."""
    return dt(policy.compute_dtype)
