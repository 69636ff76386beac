"""The reference: the Llama forward pass as short pure functions, one plain path per op, every
dtype from the policy (llamaspec/policy.py defines each knob).

torchref/ops.py has the same functions with the same signatures, and both read side by side
with transformers' modeling_llama.py. Nothing here reads the machine: speed lives in the
backends beside it (fast.py, invariant.py: the same op names), chosen once by plan.py and
judged against this module by the ladder (tests/test_backends.py).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from llamaspec import Policy, RopeConfig
from llamaspec.forward import scale_queries
from llamaspec.policy import DTYPES

from . import quant
from .dtypes import matmul_precision, of, opmath

# linear's sums may be split over tensor shards and added in shard order (sharding.row_parallel)
ROW_PARALLEL = True


def rms_norm(x, weight, eps: float, policy: Policy, offset: float = 0.0):
    """mean(x^2) and rsqrt over the last axis in norm_dtype; result in compute_dtype. offset: the
    norm multiplies by (offset + weight) (Gemma's 1)."""
    h = x.astype(of(policy.norm_dtype))
    return norm_weight(h * lax.rsqrt(add_scalar(jnp.mean(h * h, axis=-1, keepdims=True), eps)), x, weight, policy,
                       offset)


def norm_weight(h, x, weight, policy: Policy, offset: float = 0.0):
    """The normalised h (in norm_dtype) times (offset + weight), in compute_dtype. norm_cast_before_weight
    True or None (Llama's convention): h is rounded back to x's dtype first and the product is in
    compute_dtype; False (Gemma's, OLMo 2's): the weight (plus offset) and the product in norm_dtype,
    rounded once. The offset is added as torch adds a scalar: in opmath, rounded once (add_scalar)."""
    if policy.norm_cast_before_weight is not False:
        compute = of(policy.compute_dtype)
        w = add_scalar(weight.astype(compute), offset) if offset else weight.astype(compute)
        return w * h.astype(x.dtype).astype(compute)
    w = add_scalar(weight.astype(h.dtype), offset) if offset else weight.astype(h.dtype)
    return (w * h).astype(of(policy.compute_dtype))


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int, seq_len, dtype):
    """Inverse frequencies [head_dim // 2], computed in `dtype` with transformers' formulas.

    seq_len only matters for dynamic NTK: like transformers, the base grows with the
    longest position in the call (max(positions) + 1), never below max_position_embeddings.
    """
    dim = head_dim
    exponent = jnp.arange(0, dim, 2).astype(dtype) / dim
    if rope.type == "dynamic":
        seq = jnp.maximum(jnp.asarray(seq_len), max_position_embeddings).astype(dtype)
        stretch = (rope.factor * seq / max_position_embeddings) - (rope.factor - 1)
        base = rope.theta * stretch ** (dim / (dim - 2))
    else:
        base = jnp.asarray(rope.theta, dtype)
    inv_freq = 1.0 / (base ** exponent)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq, rope: RopeConfig):
    """Llama 3.1 frequency scaling, term for term as transformers' _compute_llama3_parameters."""
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between blended
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq, positions, dtype):
    """cos, sin tables [B, T, head_dim] in `dtype` (HF half-split layout: angles repeated)."""
    angles = positions[..., None].astype(dtype) * inv_freq.astype(dtype)
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x):
    """HF layout: the first half of each head pairs with the second half."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x, cos, sin):
    """x [B, T, H, D]; cos/sin [B, T, D] are rounded to x.dtype first, as HF does; then
    x * cos + rotate_half(x) * sin in x.dtype, each op rounded to it (XLA keeps every rounding:
    dtypes.compiler_options turns excess precision off)."""
    cos = cos.astype(x.dtype)[:, :, None, :]
    sin = sin.astype(x.dtype)[:, :, None, :]
    return x * cos + rotate_half(x) * sin


def linear(x, w, b, policy: Policy, out_dtype=None):
    """x @ w.T with w in HF layout [out, in]: inputs in compute_dtype, products and sums
    in accum_dtype, bias added in accum_dtype, one rounding to out_dtype (or compute)."""
    compute, accum = of(policy.compute_dtype), of(policy.accum_dtype)
    y = linear_sums(x, w, policy)
    if b is not None:
        y = y + b.astype(compute).astype(accum)   # an operand: rounded to compute_dtype as x and w are
    return y.astype(out_dtype or compute)


def linear_sums(x, w, policy: Policy):
    """linear's products and sums, x @ w.T in accum_dtype, not yet rounded: also the partial sums
    a tensor shard of a row-parallel product adds to the others' (sharding.row_parallel)."""
    return _dot(x, w, (((x.ndim - 1,), (1,)), ((), ())), policy)


def _dot(a, b, dims, policy: Policy):
    """dot_general of a and b rounded to compute_dtype, products and sums in accum_dtype
    (HIGHEST: IEEE f32 products where the policy's matmul is ieee)."""
    compute = of(policy.compute_dtype)
    return lax.dot_general(a.astype(compute), b.astype(compute), dims, precision=matmul_precision(policy),
                           preferred_element_type=of(policy.accum_dtype))


def fp8_product_dtype(policy: Policy) -> str:
    """The dtype a projection with an fp8 operand multiplies in: float32, float64 under a float64
    compute_dtype (llamaspec.policy: fp8 values widen exactly, their products are exact there)."""
    return "float64" if policy.compute_dtype == "float64" else "float32"


def fp8_linear(x, w, b, policy: Policy):
    """A block projection under weight_fp8 / act_fp8: x rounded to compute_dtype, then (act_fp8)
    quantized as a [tokens, in] matrix and dequantized exactly into the fp8 product dtype; w is
    the dequantized weight the model keeps in that dtype (weight_fp8), else rounded to
    compute_dtype; both widened there, summed there, rounded once to compute_dtype."""
    compute, name = of(policy.compute_dtype), fp8_product_dtype(policy)
    wide = of(name)
    x = x.astype(compute).astype(wide)
    if policy.act_fp8:
        rows = x.reshape(-1, x.shape[-1])
        x = quant.dequantize(*quant.quantize(rows, policy.act_fp8), policy.act_fp8, name).reshape(x.shape)
    w = (w if policy.weight_fp8 else w.astype(compute)).astype(wide)
    y = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=wide)
    if b is not None:
        y = y + b.astype(compute).astype(wide)
    return y.astype(compute)


def kv_round(x, policy: Policy):
    """A key (after RoPE) or value [B, T, Hkv, D] as the policy's kv_cache keeps it, back in x's
    dtype: as computed (None), rounded to a dtype, or quantized per token and kv head (an fp8
    spec, granularity channel) and dequantized to x's dtype."""
    kv = policy.kv_cache
    if kv is None:
        return x
    if kv in DTYPES:
        return x.astype(of(kv)).astype(x.dtype)
    q, scales = quant.quantize(x.reshape(-1, x.shape[-1]), kv)
    return quant.dequantize(q, scales, kv, x.dtype.name).reshape(x.shape)


def silu(x):
    """x * sigmoid(x) computed in opmath and rounded once (PyTorch's F.silu does the same
    for bf16/f16; composing two rounded jnp ops would round twice)."""
    xf = x.astype(opmath(x.dtype))
    return (xf * lax.logistic(xf)).astype(x.dtype)


# torch's GELU tanh constants (its kernel's kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 and kKappa), as C
# computes them in double before they meet the opmath dtype
_GELU_BETA = 1.41421356237309504880 * 1.12837916709551257390 * 0.5
_GELU_KAPPA = 0.044715


def gelu_tanh(x):
    """GELU with the tanh approximation (Gemma's gelu_pytorch_tanh), torch's formula and order:
    0.5 * x * (1 + tanh(kBeta * (x + kKappa * x^3))), computed in opmath and rounded once (torch's
    kernel takes a 16-bit x in f32, as silu's does)."""
    xf = x.astype(opmath(x.dtype))
    inner = _GELU_BETA * (xf + _GELU_KAPPA * (xf * xf * xf))
    return (0.5 * xf * (1 + tanh(inner))).astype(x.dtype)


def soft_cap(x, cap: float):
    """cap * tanh(x / cap) in x's dtype, each step rounded there (Gemma 2's attention scores and
    final logits, transformers' order; each step as torch computes it: in opmath, rounded once)."""
    t = tanh(div_scalar(x, cap).astype(opmath(x.dtype))).astype(x.dtype)
    return mul_scalar(t, cap)


def tanh(x):
    """tanh as torch's CPU kernel computes it, within an ulp of the exact value: XLA's float32 tanh
    is a faster approximation some ulps off (most float32 results differ from torch's), so a
    float32 x goes through float64 and is rounded once (the correctly rounded tanh, which torch's
    gives for all but a few values in 1000)."""
    if x.dtype.itemsize >= 8:
        return jnp.tanh(x)
    return jnp.tanh(x.astype(jnp.float64)).astype(x.dtype)


def scale_embedding(rows, hidden_size: int):
    """Embedding rows times sqrt(hidden_size) rounded to the rows' dtype, multiplied there (Gemma:
    transformers multiplies by its scale cast to the embedding weight's dtype; torch rounds the
    double to a 16-bit dtype through f32, as here)."""
    scale = np.asarray(hidden_size ** 0.5, opmath(rows.dtype)).astype(rows.dtype)
    return rows * scale


def attention(q, k, v, allowed, policy: Policy, scale: float | None = None, softcap: float | None = None):
    """Scaled dot-product attention with a boolean mask, transformers' eager order.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; allowed [B, T, S] (a sliding window is in it). GQA by
    reshaping q to [B, T, Hkv, G, D] (query head h reads kv head h // G, as HF's repeat_kv), so
    K/V are never repeated. Returns [B, T, Hq, D] in compute_dtype. scale: D ** -0.5 unless the
    family says (Gemma's query_pre_attn_scalar ** -0.5); softcap: the scores soft-capped in
    compute_dtype after scaling, before the mask (Gemma 2).
    """
    compute, smx = of(policy.compute_dtype), of(policy.softmax_dtype)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    early = scale_queries(scale, policy.compute_dtype)   # HF's order, matmul, round, then scale, in fewer steps
    qg = q.astype(compute)
    qg = (mul_scalar(qg, scale) if early else qg).reshape(B, T, Hkv, Hq // Hkv, D)
    # [B, T, K, G, D] x [B, S, K, D] -> [B, K, T, G, S]
    s = _dot(qg, k, (((4,), (3,)), ((0, 2), (0, 2))), policy).astype(compute)
    if not early:
        s = mul_scalar(s, scale)
    if softcap is not None:
        s = soft_cap(s, softcap)
    s = s.astype(smx)
    # A finite fill (not -inf) keeps fully masked rows (padding queries) free of NaN.
    s = jnp.where(allowed[:, None, :, None, :], s, jnp.finfo(smx).min)
    p = softmax(s).astype(compute)
    # [B, K, T, G, S] x [B, S, K, D] -> [B, K, T, G, D]
    o = _dot(p, v, (((4,), (1,)), ((0, 1), (0, 2))), policy).astype(compute)
    return o.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)


def softmax(s):
    """Softmax over the last axis in s.dtype: exp(s - max) / sum, each op rounded to s.dtype
    (a 16-bit softmax_dtype: every step in 16 bits, as the policy asks)."""
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def mul_scalar(x, c: float):
    """x * c as PyTorch computes a tensor-scalar op: in opmath, rounded once."""
    return (x.astype(opmath(x.dtype)) * c).astype(x.dtype)


def add_scalar(x, c: float):
    return (x.astype(opmath(x.dtype)) + c).astype(x.dtype)


def div_scalar(x, c: float):
    """x / c as PyTorch computes a tensor-scalar division: in opmath, rounded once. The divisor is
    an array of x's shape behind an optimization barrier: XLA's simplifier turns a division by a
    broadcast scalar into a product with its reciprocal, which rounds twice (a third of float32
    quotients by 1.5 differ); the barrier hides the broadcast from it and goes before code is made."""
    wide = opmath(x.dtype)
    return (x.astype(wide) / lax.optimization_barrier(jnp.full(x.shape, c, wide))).astype(x.dtype)


# ---- how the model holds weights and the KV cache (a backend may keep them otherwise) ----

def prepare(w, policy: Policy, layout=None, one_row: bool = True):
    """A matrix [out, in] as linear() takes it, made once at load: the array itself. (layout: the
    model's mesh layout or None; one_row: whether one-row products of it are to come.)"""
    return w


def scanned(w):
    """A prepared matrix as the layers' lax.scan holds it (stacked over layers): as it is."""
    return w


def kv_dtype(policy: Policy):
    """The dtype the KV cache keeps a layer's keys and values in: compute_dtype (kv_cache's
    rounding is done by kv_round before the write; the values it leaves are compute_dtype's)."""
    return of(policy.compute_dtype)


def write_cache(store, layer: int, x, slots):
    """store [L, B, S, Hkv, D] with layer `layer`'s slots [B, T] of row b set to x [B, T, Hkv, D]."""
    rows = jnp.arange(x.shape[0])[:, None]
    return store.at[layer, rows, slots].set(x)
