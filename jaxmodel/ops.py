"""The Llama forward pass as short pure functions; every dtype comes from the policy.

torchref/ops.py has the same functions with the same signatures. Where a step's
rounding is not obvious, the comment says which dtype it happens in and why (the
meaning of each knob is defined in llamaspec/policy.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import platform
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from llamaspec import Policy, RopeConfig, cpuinfo
from llamaspec.errors import InvarianceError
from llamaspec.forward import scale_queries

from .dtypes import matmul_precision, of, opmath


def rms_norm(x, weight, eps: float, policy: Policy):
    """mean(x^2) and rsqrt in norm_dtype; result in compute_dtype."""
    h = x.astype(of(policy.norm_dtype))
    return norm_weight(h * lax.rsqrt(add_scalar(jnp.mean(h * h, axis=-1, keepdims=True), eps)), x, weight, policy)


def norm_weight(h, x, weight, policy: Policy):
    """The normalised h (in norm_dtype) times the weight, in compute_dtype. HF convention
    (norm_cast_before_weight): h is rounded back to x's dtype first."""
    compute = of(policy.compute_dtype)
    if policy.norm_cast_before_weight:
        return weight.astype(compute) * h.astype(x.dtype).astype(compute)
    return (weight.astype(h.dtype) * h).astype(compute)


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int, seq_len,
                  dtype):
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
    x * cos + rotate_half(x) * sin in x.dtype, each op rounded to it (bf16: _bf16_rope)."""
    cos = cos.astype(x.dtype)[:, :, None, :]
    sin = sin.astype(x.dtype)[:, :, None, :]
    if x.dtype == jnp.dtype(jnp.bfloat16):
        return _bf16_rope(x, cos, sin)
    return x * cos + rotate_half(x) * sin


def _bf16_rope(x, cos, sin):
    """apply_rope for bf16 (x and the tables already bf16): the same values bit for bit (a NaN
    stays a NaN, its sign bit may differ), computed in f32 with each op's result rounded to bf16
    (_rounded) and rotate_half as a reversal: rotate_half(x) * sin = [-x2, x1] * [s1, s2] =
    [x2, x1] * [-s1, s2] exactly (a sign moves between the factors; rounding to nearest is
    symmetric), and [x2, x1] is x's two halves reversed.

    Written so for XLA:CPU, which widens each bf16 op on its own and, with excess precision off,
    keeps every round trip: rotate_half's concatenation of such round trips (and of the rounding
    of the projection before it) compiles to a branch per element and scalar code. SmolLM2's bf16
    prefill of 128 tokens, Zen 4, per layer: the queries' fusion (projection's rounding, RoPE,
    scaling) 290 us as written, 47 so; the keys' (with the cache write) 160 and 27
    (docs/measurements.md). f32, f16 and f64 keep the concatenation, their fast form there (f16:
    XLA:CPU's own f16 loop, 20 us for the queries against 28 in f32)."""
    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
    half = x.shape[-1] // 2
    sign = jnp.where(jnp.arange(2 * half) < half, -1.0, 1.0).astype(f32)
    x = x.astype(f32)
    swapped = lax.rev(x.reshape(*x.shape[:-1], 2, half), (x.ndim - 1,)).reshape(x.shape)   # [x2, x1]
    return (_rounded(x * cos.astype(f32), bf16) + _rounded(swapped * (sin.astype(f32) * sign), bf16)).astype(bf16)


def _rounded(y, dtype):
    """y (f32) rounded to `dtype` (bf16 or f16) and held in f32 again: a 16-bit op computed in f32.

    The same bits as the op in `dtype` itself: an add, subtract or multiply of two bf16 or f16
    values computed in f32 and rounded once is the correctly rounded 16-bit result (f32's 24
    significand bits are at least 2p + 2 for bf16's p = 8 and f16's p = 11, so the second
    rounding never differs from a direct one), as XLA:CPU and PyTorch compute 16-bit elementwise
    ops; the rounding between two ops also keeps the compiler from fusing them into one FMA."""
    return y.astype(dtype).astype(y.dtype)


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
    a tensor shard of a row-parallel product adds to the others' (sharding.row_parallel;
    torchref does not shard, so it has no such function)."""
    return _matmul(x, w, (((x.ndim - 1,), (1,)), ((), ())), policy)


def silu(x):
    """x * sigmoid(x) computed in opmath and rounded once (PyTorch's F.silu does the same
    for bf16/f16; composing two rounded jnp ops would round twice)."""
    xf = x.astype(opmath(x.dtype))
    return (xf * lax.logistic(xf)).astype(x.dtype)


def attention(q, k, v, allowed, policy: Policy):
    """Scaled dot-product attention with a boolean mask.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; allowed [B, T, S]. GQA by reshaping q to
    [B, T, Hkv, G, D] (query head h reads kv head h // G, as HF's repeat_kv), so K/V
    are never repeated. Returns [B, T, Hq, D] in compute_dtype.
    """
    compute, smx = of(policy.compute_dtype), of(policy.softmax_dtype)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = D ** -0.5
    early = scale_queries(scale, policy.compute_dtype)   # HF's order, matmul, round, then scale, in fewer steps
    qg = q.astype(compute)
    qg = (mul_scalar(qg, scale) if early else qg).reshape(B, T, Hkv, Hq // Hkv, D)
    # [B, T, K, G, D] x [B, S, K, D] -> [B, K, T, G, S]
    s = _attention_product(qg, k, (((4,), (3,)), ((0, 2), (0, 2))), policy).astype(compute)
    if not early:
        s = mul_scalar(s, scale)
    s = s.astype(smx)
    # A finite fill (not -inf) keeps fully masked rows (padding queries) free of NaN.
    s = jnp.where(allowed[:, None, :, None, :], s, jnp.finfo(smx).min)
    p = softmax(s).astype(compute)
    # [B, K, T, G, S] x [B, S, K, D] -> [B, K, T, G, D]
    o = _attention_product(p, v, (((4,), (1,)), ((0, 1), (0, 2))), policy).astype(compute)
    return o.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)


# Queries per block of causal_attention. Blocks of a long prompt's queries, each over the keys its
# causal mask leaves, compute about (n + 1) / 2n of the [T, S] scores in n blocks, and each block's
# scores are small enough to stay in the CPU's caches (docs/measurements.md).
QUERY_BLOCK = 256


def causal_attention(q, k, v, allowed, policy: Policy, causal_from: int):
    """attention() over a causal mask (Context.causal_from: allowed[b, t, s] only for
    s <= causal_from + t): in one fused kernel where fused_attention_applies (on a mesh:
    sharding.fused_attention), else in XLA, QUERY_BLOCK queries at a time, each block over the
    keys up to the last one its queries may see; prompts under 2 * QUERY_BLOCK are one block.

    The same function: in attention() a key past that one has the fill's score, so its
    probability is exactly 0 (exp of about -3.4e38 less a real score) and its value adds
    nothing; leaving it out changes only how the remaining sums group (drift, not bits).
    A query that may see no key at all (front padding) gets from attention() the average of
    all S values; here it gets the same average, from one masked query over every key.
    k, v may be Widened (a widened cache)."""
    if fused_attention_applies(policy):
        return fused_attention(q, k, v, allowed, policy)
    T, S = q.shape[1], k.shape[1]
    if T < 2 * QUERY_BLOCK:
        return attention(q, k, v, allowed, policy)
    out = []
    for a in range(0, T, QUERY_BLOCK):
        n = min(S, causal_from + a + QUERY_BLOCK)
        out.append(attention(q[:, a:a + QUERY_BLOCK], _first_keys(k, n), _first_keys(v, n),
                             allowed[:, a:a + QUERY_BLOCK, :n], policy))
    blind = attention(q[:, :1], k, v, jnp.zeros_like(allowed[:, :1]), policy)    # [B, 1, Hq, D]
    return jnp.where(allowed.any(-1)[:, :, None, None], jnp.concatenate(out, axis=1), blind)


# $LLAMA_PARITY_ATTENTION: auto (fused_attention_applies' rule), fused (wherever the kernel
# computes the policy: also f64), or xla (never the kernel)
ATTENTION_ENV = "LLAMA_PARITY_ATTENTION"


def fused_attention_applies(policy: Policy) -> bool:
    """Whether causal_attention runs as fused_attention: with JAX on an x86-64 CPU whose kernel
    code path is AVX2 or better (FUSED_ATTENTION_ISA), for a policy whose scores, softmax and sums the
    kernel computes as the policy says (compute f32 or bf16, softmax and accumulation in f32;
    f64 throughout only when $LLAMA_PARITY_ATTENTION is "fused": its f64 exp is scalar code),
    unless that variable says "xla"; "fused" takes any code path. Decided by the platform and
    the policy, never by a timing. A kernel that cannot be built (no C++
    compiler) leaves XLA's attention, with one warning; asked for by name, it is an error."""
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "fused", "xla"):
        raise ValueError(f"{ATTENTION_ENV}={choice!r}: expected auto, fused or xla")
    if choice == "xla" or jax.default_backend() != "cpu" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    compute, accum, smx = of(policy.compute_dtype), of(policy.accum_dtype), of(policy.softmax_dtype)
    f32, f64 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)
    kinds = {(f32, f32, f32), (jnp.dtype(jnp.bfloat16), f32, f32)} | ({(f64, f64, f64)} if choice == "fused" else set())
    if (compute, accum, smx) not in kinds:
        return False
    if choice == "fused":
        from . import kernels
        kernels.library()
        return True
    return _kernels_reach(FUSED_ATTENTION_ISA)


# The least code path of the fixed-order kernels on which auto takes the fused attention: AVX2.
# Its scalar path is the program's definition, not a fast one. The AVX2 path was once left to XLA:
# on session 20's Intel Xeon under the AVX2 cap it took 58.9 ms a layer at fp32 2048 tokens (29.6 on
# AVX-512), and a SmolLM2 prefill of 2048 tokens 3.33 s against XLA's 2.73. Since then its tiles
# keep their accumulators in registers (fixed_order.h's unrolled row loops: 43 -> 106 GF/s a Zen 4
# core) and its q . k block sums in the tile (attention.h's Scores256): on a Zen 4, fp32 2048, 39.4
# then 36.7 ms a layer (AVX-512: 33.0); SmolLM2's prefill under the AVX2 cap there, in-process
# A/Bs, XLA's time / the kernel's: fp32 2048 1.09, 1.09; 512 1.02, 1.03; 128 1.06, 0.93; bf16 2048
# 1.07, 1.06 (docs/measurements.md). The kernel's bits are its AVX-512 path's: where it runs,
# attention gives the same bits on both.
FUSED_ATTENTION_ISA = "avx2"


@functools.cache
def _kernels_build() -> bool:
    from . import kernels
    try:
        kernels.library()
    except InvarianceError as e:
        warnings.warn(f"jaxmodel's fixed-order kernels are not available ({e}); attention and one-row 16-bit "
                      f"products run in XLA ({ATTENTION_ENV}=xla and {MATVEC_ENV}=xla silence this)",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def _kernels_reach(isa: str) -> bool:
    """Whether the fixed-order kernels build (else one warning) and their code path
    ($LLAMA_PARITY_KERNEL_ISA, else the CPU's best) is `isa` or better."""
    from llamaspec import fixed_order as fo

    from . import kernels
    return _kernels_build() and kernels.library().fo_isa() >= fo.ISAS[isa]


def fused_attention(q, k, v, allowed, policy: Policy):
    """attention() as one XLA:CPU custom call (jaxmodel/attention.h's program, on
    llamaspec/fixed_order.h's tiles): per block of 16 queries and one KV head, the scores of
    the keys its queries may see, rounded and scaled as attention() does, softmax in f32 with
    probabilities rounded to compute_dtype, their product with the values in f32, the result
    rounded; nothing [T, S] leaves the CPU's caches. The same function as attention(): the sums
    group otherwise (drift), and the bits do not depend on the batch, the thread count or the
    instruction set. docs/measurements.md has the speed."""
    from . import kernels
    compute = of(policy.compute_dtype)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = D ** -0.5
    early = scale_queries(scale, policy.compute_dtype)
    qg = q.astype(compute)
    qg = (mul_scalar(qg, scale) if early else qg).reshape(B, T, Hkv, Hq // Hkv, D)   # GQA's groups: no copy
    k, v = (x.data if isinstance(x, Widened) else x.astype(compute) for x in (k, v))
    return kernels.attention(qg, k, v, allowed, scale, early).reshape(B, T, Hq, D)


def _first_keys(x, n: int):
    """Keys or values [B, S, Hkv, D] (or Widened) up to slot n."""
    if isinstance(x, Widened):
        return Widened(x.data[:, :n], None if x.native is None else x.native[:, :n])
    return x[:, :n]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "native", "matvec"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Widened:
    """A weight already as _matmul's CPU path feeds it to the dot: rounded to compute_dtype,
    stored in accum_dtype (exact: every bf16 / f16 value is an f32). model.py keeps the
    matrices of a bf16/f16 policy so on the CPU (widened_dtype), so that a dot does not convert
    the whole weight on every call.
    native: the same values in compute_dtype, kept where native_dots says the CPU multiplies
    them faster so (products of NATIVE_MIN_ROWS rows or more take it), else None.
    matvec: the same values packed in compute_dtype for the fixed-order kernel's one-row
    products (a kernels.PackedWeight), kept where kernel_matvecs says so, else None."""
    data: jax.Array
    native: jax.Array | None = None
    matvec: object = None

    @property
    def shape(self):
        return self.data.shape


def widened_dtype(policy: Policy):
    """accum_dtype when _matmul widens compute_dtype operands to it (a bf16/f16 policy on the
    CPU), else None: the dtype model.py stores the matrices in."""
    compute, accum = of(policy.compute_dtype), of(policy.accum_dtype)
    return accum if accum.itemsize > compute.itemsize and jax.default_backend() == "cpu" else None


# $LLAMA_PARITY_BF16_DOTS: auto (native_dots' rule), native or widened (llamaspec.cpuinfo)
BF16_DOTS_ENV = cpuinfo.BF16_DOTS_ENV
# A product of this many rows or more takes a native bf16 weight. A matrix-vector product (one row:
# a batch-1 decode step) reads the widened one: XLA:CPU's one-row bf16 product is 2-12x slower than
# its f32 one, while from two rows on the bf16 product is 1.3-3.7x faster (SmolLM2's shapes on an
# AMX Xeon; on a Zen 4 with AVX-512-BF16: one row 1.3-7.6x slower, 8 rows and more 1.4-3.5x faster;
# docs/measurements.md).
NATIVE_MIN_ROWS = 2
# XLA's --xla_cpu_max_isa values that keep bf16 products in hardware (AVX512_BF16, AMX, AMX_FP16;
# SSE4_2 ... AVX512_VNNI are below them)
_BF16_ISAS = ("AVX512_BF16", "AMX")   # a prefix: AMX_FP16 too


def native_dots(policy: Policy) -> bool:
    """Whether products of a bf16 policy's weights with many rows, and attention's products
    (_attention_product), run in bf16 itself on this CPU (XLA:CPU hands them to its YNNPACK
    kernels, which use AMX's bf16 tiles or AVX-512-BF16's pair products) instead of on f32
    widened copies. Measured: 3-5x the widened product's speed on an AMX Xeon, about 2x on an
    AMD Zen 4 (AVX-512-BF16, no AMX): docs/measurements.md.

    Both compute the same products (bf16 x bf16 is exact in f32; subnormals are flushed on
    both paths, as everywhere in XLA:CPU: checked on Zen 4) and sum them in f32, in different
    orders: the results differ by f32 rounding, not by the policy. Decided by the CPU's
    features, never by a timing, so a machine always runs the same path: on when the CPU has
    AMX-BF16 or AVX-512-BF16 and no XLA instruction-set cap below AVX512_BF16 is set
    (XLA_FLAGS' --xla_cpu_max_isa, which YNNPACK does not itself follow);
    $LLAMA_PARITY_BF16_DOTS overrides."""
    if widened_dtype(policy) is None or of(policy.compute_dtype) != jnp.dtype(jnp.bfloat16):
        return False
    choice = cpuinfo.dots_choice()
    if choice != "auto":
        return choice == "native"
    caps = [a.split("=", 1)[1] for a in os.environ.get("XLA_FLAGS", "").split()
            if a.startswith("--xla_cpu_max_isa=")]
    return ((cpuinfo.has("amx_bf16") or cpuinfo.has("avx512_bf16"))
            and all(cap.strip().upper().startswith(_BF16_ISAS) for cap in caps))


# $LLAMA_PARITY_MATVEC: auto (kernel_matvecs' rule), kernel (wherever the kernels build) or xla (never)
MATVEC_ENV = "LLAMA_PARITY_MATVEC"


def kernel_matvecs(policy: Policy) -> bool:
    """Whether a 16-bit policy's one-row products (a batch-1 decode step's: each matrix times
    one vector) run on the fixed-order kernels' gemm (kernels.gemm over
    kernels.PackedWeight.widening: the weight packed in compute_dtype, read at 2 bytes a value)
    instead of XLA's f32 dot over the widened copy (4 bytes a value). A matrix-vector product
    is bound by the bytes it reads: SmolLM2's 210 layer products at one row, Zen 4, 15.5 ms
    widened against 7.7 with the kernel, on its AVX-512 and its AVX2 path alike; the lm_head
    4.3 against 2.0 (docs/measurements.md).

    The same products (16-bit values widened exactly, multiplied in f32) summed in f32, in the
    kernel's fixed order rather than XLA's: drift, and the same bits on every x86-64 CPU and
    code path. On the CPU with JAX, for a policy whose compute dtype is bf16 or f16 and whose
    accumulator is f32, when the kernel's code path ($LLAMA_PARITY_KERNEL_ISA, else the CPU's
    best) is AVX2 or better (its scalar path is the program's definition, 10-20x slower than
    XLA's dot); never by a timing. $LLAMA_PARITY_MATVEC overrides: kernel takes any code path
    (an error if the kernels cannot be built), xla never the kernel. A kernel that cannot be
    built leaves XLA's dot, with one warning."""
    choice = os.environ.get(MATVEC_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "kernel", "xla"):
        raise ValueError(f"{MATVEC_ENV}={choice!r}: expected auto, kernel or xla")
    if (choice == "xla" or widened_dtype(policy) is None or of(policy.accum_dtype) != jnp.dtype(jnp.float32)
            or platform.machine().lower() not in ("x86_64", "amd64")):
        return False
    if choice == "kernel":
        from . import kernels
        kernels.library()
        return True
    return _kernels_reach("avx2")


def _kernel_matvec(a, w, dims):
    """a [..., k] (one row in all) @ w^T on the fixed-order kernel, w a kernels.PackedWeight
    [n, k] (Widened.matvec); a's compute-dtype values go in widened to f32 (exact)."""
    from . import kernels
    (contract_a, contract_b), batch = dims
    if contract_a != (a.ndim - 1,) or contract_b != (1,) or batch != ((), ()):
        raise ValueError(f"a matvec copy multiplies x @ w.T only, not dimension numbers {dims}")
    y = kernels.gemm(a.reshape(1, a.shape[-1]).astype(jnp.float32), w)
    return y.reshape(*a.shape[:-1], w.n)


def _rows(a, dims) -> int:
    """How many rows a product of `a` has: its elements over its contracted and batch sizes."""
    (contract, _), (batch, _) = dims
    return math.prod(n for i, n in enumerate(a.shape) if i not in contract and i not in batch)


def _matmul(a, b, dims, policy: Policy):
    """dot_general with inputs rounded to compute_dtype and sums in accum_dtype.

    When accum is wider than compute (bf16/f16 policies) the rounded inputs are widened
    to accum first on CPU: products of bf16/f16 numbers are exact in f32, so this is the
    same arithmetic on XLA:CPU's f32 kernels (chosen for speed: docs/measurements.md).
    GPUs keep the native low-precision dot, which is what their tensor cores are for.
    b may be Widened (a weight stored so): then it goes to the dot as it is, the same values
    in the same dtype as the conversions would make; or, when it holds a native copy and
    the product has NATIVE_MIN_ROWS rows or more, that copy goes to a bf16 dot with f32 sums;
    when it holds a matvec copy and the product has one row, that copy goes to the fixed-order
    kernel (kernel_matvecs).
    """
    compute, accum = of(policy.compute_dtype), of(policy.accum_dtype)
    wide = widened_dtype(policy) is not None
    a = a.astype(compute)
    if isinstance(b, Widened) and b.matvec is not None and _rows(a, dims) == 1:
        return _kernel_matvec(a, b.matvec, dims)
    if isinstance(b, Widened) and b.native is not None and _rows(a, dims) >= NATIVE_MIN_ROWS:
        return lax.dot_general(a, b.native, dims, precision=matmul_precision(policy), preferred_element_type=accum)
    if isinstance(b, Widened):
        b = b.data if wide else b.data.astype(compute)
    else:
        b = b.astype(compute)
        if wide:
            b = b.astype(accum)
    if wide:
        a = a.astype(accum)
    return lax.dot_general(a, b, dims, precision=matmul_precision(policy),
                           preferred_element_type=accum)


def _attention_product(a, b, dims, policy: Policy):
    """One of attention's two products (queries x keys, probabilities x values). Where native_dots
    says so and it has NATIVE_MIN_ROWS rows or more (per KV head: a decode step's G query heads
    count), bf16 operands with f32 sums, as the matrices' native products; a widened cache's
    values go back to bf16 for it (exact: they are bf16 values). Else _matmul's widened product.
    Same products, other summation order: drift. SmolLM2's attention at 512 tokens, bf16, AMX
    Xeon: 8.9 ms a layer widened, 3.3 native (docs/measurements.md)."""
    if native_dots(policy) and _rows(a, dims) >= NATIVE_MIN_ROWS:
        compute = of(policy.compute_dtype)
        b = b.data if isinstance(b, Widened) else b
        return lax.dot_general(a.astype(compute), b.astype(compute), dims, precision=matmul_precision(policy),
                               preferred_element_type=of(policy.accum_dtype))
    return _matmul(a, b, dims, policy)


def softmax(s):
    """Softmax over the last axis in s.dtype: exp(s - max) / sum."""
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def mul_scalar(x, c: float):
    """x * c as PyTorch computes a tensor-scalar op: in opmath, rounded once."""
    return (x.astype(opmath(x.dtype)) * c).astype(x.dtype)


def add_scalar(x, c: float):
    return (x.astype(opmath(x.dtype)) + c).astype(x.dtype)
