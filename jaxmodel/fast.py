"""The fast backend: ops.py's op names and signatures, each a drop-in for the reference op of the
same name, computing the same function with other roundings only where a sum's order changes
(drift, judged by the ladder: tests/test_backends.py). plan.py decides once, from the machine and
the environment, what this machine may use (`Fast`'s fields); the rules by policy are here.

- Matrices of a 16-bit policy on the CPU are kept widened to f32 (`Weight.data`: the same values,
  exact), so no product converts a weight per call; beside them, where the plan says so, a native
  bf16 copy for products of NATIVE_MIN_ROWS rows or more (bf16 products in hardware) and a copy
  packed for the fixed-order kernel's one-row products (kernels.gemm). `Weight` is what `prepare`
  makes at load and linear() reads: jit state of the model, never recomputed per call.
- Attention: the fused CPU kernel (attention.h) for prompts; else XLA's, over a causal mask in
  blocks of QUERY_BLOCK queries, each over the keys its queries may see.
- RoPE at bf16 in f32 with each op rounded to bf16 and rotate_half as a reversal (_bf16_rope).
- The KV cache of a 16-bit policy widened to f32 as the matrices; a prompt's keys written as one
  block where the slots are known while tracing.
docs/performance.md has the measurements behind each choice.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from llamaspec import Policy
from llamaspec.forward import scale_queries

from . import ops
from .dtypes import matmul_precision, numpy_dtype, of

# A product of this many rows or more takes a native bf16 weight; a one-row product (a batch-1
# decode step) reads the widened one (XLA:CPU's one-row bf16 product is slower than its f32 one).
NATIVE_MIN_ROWS = 2
# Queries per block of XLA's attention over a causal mask: blocks of a long prompt's queries, each
# over the keys its causal mask leaves, compute about (n + 1) / 2n of the [T, S] scores in n blocks,
# and each block's scores stay in the CPU's caches. Read while tracing.
QUERY_BLOCK = 256
_F32, _F64, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float64), jnp.dtype(jnp.bfloat16)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "native", "matvec"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Weight:
    """A matrix as the fast products take it: data, its values (rounded to compute_dtype) kept in
    accum_dtype (exact); native, the same values in compute_dtype for bf16 products in hardware,
    or None; matvec, the same values packed for the fixed-order kernel's one-row products (a
    kernels.PackedWeight), or None. Indexing reads data, as the plain array would be read."""
    data: jax.Array
    native: jax.Array | None = None
    matvec: object = None

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    def __getitem__(self, index):
        return self.data[index]


@dataclasses.dataclass(frozen=True)
class Fast:
    """The fast ops for one machine (plan.py fills the fields; hashable: it is part of a model's
    graphdef, so programs compiled for one set of choices are never run for another).

    cpu: XLA runs on the CPU (16-bit products on f32 widened operands there).
    bf16_products: bf16 products in hardware allowed (AMX / AVX-512-BF16, no lower ISA cap).
    matvec_kernel: one-row 16-bit products on the fixed-order kernel.
    attention_kernel: the fused attention kernel for f32 and bf16 policies; attention_f64 for f64 too.
    layout: the mesh layout (sharding.MeshLayout) or None; on a mesh no copies are kept and the
    attention kernel runs per shard."""
    cpu: bool = True
    bf16_products: bool = False
    matvec_kernel: bool = False
    attention_kernel: bool = False
    attention_f64: bool = False
    layout: object = None

    ROW_PARALLEL = True
    rms_norm = staticmethod(ops.rms_norm)
    norm_weight = staticmethod(ops.norm_weight)
    rope_inv_freq = staticmethod(ops.rope_inv_freq)
    rope_cos_sin = staticmethod(ops.rope_cos_sin)
    rotate_half = staticmethod(ops.rotate_half)
    silu = staticmethod(ops.silu)
    softmax = staticmethod(ops.softmax)
    mul_scalar = staticmethod(ops.mul_scalar)
    add_scalar = staticmethod(ops.add_scalar)
    # the policy knobs this backend declines (plan.declines) run on the reference's ops: kv_round is
    # called in every attention call and leaves a policy without kv_cache's keys as they are
    kv_round = staticmethod(ops.kv_round)
    fp8_linear = staticmethod(ops.fp8_linear)

    # ---- the rules, by policy ----

    def widened(self, policy: Policy):
        """accum_dtype when 16-bit operands go to f32 dots on the CPU (a bf16/f16 policy), else None."""
        compute, accum = of(policy.compute_dtype), of(policy.accum_dtype)
        return accum if self.cpu and accum.itemsize > compute.itemsize else None

    def native_products(self, policy: Policy) -> bool:
        """Whether products of NATIVE_MIN_ROWS rows or more run in bf16 itself (f32 sums)."""
        return self.bf16_products and self.widened(policy) is not None and of(policy.compute_dtype) == _BF16

    def kernel_matvecs(self, policy: Policy) -> bool:
        """Whether one-row products of a widened 16-bit policy run on the fixed-order kernel."""
        return self.matvec_kernel and self.widened(policy) is not None and of(policy.accum_dtype) == _F32

    def fused_attention(self, policy: Policy) -> bool:
        """Whether prompts' attention runs on the fused kernel (which computes scores, softmax and
        sums as the policy says for these dtype triples only)."""
        kind = (of(policy.compute_dtype), of(policy.accum_dtype), of(policy.softmax_dtype))
        return ((self.attention_kernel and kind in {(_F32, _F32, _F32), (_BF16, _F32, _F32)})
                or (self.attention_f64 and kind == (_F64, _F64, _F64)))

    # ---- weights and the cache ----

    def prepare(self, w, policy: Policy, layout=None, one_row: bool = True):
        """A matrix as linear() takes it: a Weight (widened, with the copies the rules ask for; on
        a mesh none; the matvec copy only where one-row products are to come) where the policy's
        param_dtype is a widened compute_dtype, else w."""
        wide = self.widened(policy)
        if wide is None or of(policy.param_dtype) != of(policy.compute_dtype):
            return w
        native = matvec = None
        if layout is None and self.native_products(policy):
            native = w.astype(numpy_dtype(policy.param_dtype))
        if layout is None and one_row and self.kernel_matvecs(policy):
            from . import kernels
            matvec = kernels.PackedWeight.widening(np.asarray(w).astype(numpy_dtype(policy.compute_dtype)))
        return Weight(w.astype(wide), native, matvec)

    @staticmethod
    def scanned(w):
        """Inside XLA:CPU's loop a bf16 product runs slower than the widened one, and the stacked
        layers would hold the one-row copies twice for a one-token prompt's sake: data only."""
        return Weight(w.data) if isinstance(w, Weight) else w

    def kv_dtype(self, policy: Policy):
        """Keys and values of a widened policy kept in f32 (compute values, exact), as the matrices."""
        return self.widened(policy) or of(policy.compute_dtype)

    @staticmethod
    def write_cache(store, layer: int, x, slots):
        return write_cache(store, layer, x, slots)

    # ---- the ops ----

    @staticmethod
    def apply_rope(x, cos, sin):
        if x.dtype != _BF16:
            return ops.apply_rope(x, cos, sin)
        return _bf16_rope(x, cos.astype(x.dtype)[:, :, None, :], sin.astype(x.dtype)[:, :, None, :])

    def linear(self, x, w, b, policy: Policy, out_dtype=None):
        compute, accum = of(policy.compute_dtype), of(policy.accum_dtype)
        y = self.linear_sums(x, w, policy)
        if b is not None:
            y = y + b.astype(compute).astype(accum)
        return y.astype(out_dtype or compute)

    def linear_sums(self, x, w, policy: Policy):
        return self._matmul(x, w, (((x.ndim - 1,), (1,)), ((), ())), policy)

    def attention(self, q, k, v, allowed, policy: Policy):
        """ops.attention. Keys and values wider than the queries are a widened cache (kv_dtype:
        compute values held exactly). A prompt (two queries or more) takes the fused kernel where
        fused_attention says so (per shard on a mesh; a decode step's one query stays in XLA);
        in XLA, a prompt of 2 * QUERY_BLOCK queries or more whose mask is causal (checked in the
        program: no query sees a later slot) runs in query blocks (_causal_blocks)."""
        k, v = (Weight(x) if x.dtype != q.dtype else x for x in (k, v))
        T = q.shape[1]
        if T > 1 and self.fused_attention(policy):
            if self.layout is None:
                return fused(q, k, v, allowed, policy)
            from .sharding import per_shard_attention
            return per_shard_attention(self.layout, functools.partial(fused, policy=policy),
                                       q, k, v, allowed)
        if T < 2 * QUERY_BLOCK:
            return self._attention(q, k, v, allowed, policy)
        causal = ~(allowed & (jnp.arange(allowed.shape[2])[None, :] > jnp.arange(T)[:, None])[None]).any()
        return lax.cond(causal, lambda: self._causal_blocks(q, k, v, allowed, policy),
                        lambda: self._attention(q, k, v, allowed, policy))

    # ---- how ----

    def _causal_blocks(self, q, k, v, allowed, policy: Policy):
        """_attention over a mask where no query t sees a slot after t: QUERY_BLOCK queries at a
        time, each over the keys up to its last query's slot. The same function: in _attention a
        key past that one has the fill's score, so its probability is exactly 0 and its value adds
        nothing; leaving it out changes only how the sums group (drift, not bits). A query that may
        see no key at all (front padding) gets the average of all S values, as in _attention."""
        T, S = q.shape[1], k.shape[1]
        out = []
        for a in range(0, T, QUERY_BLOCK):
            n = min(S, a + QUERY_BLOCK)
            out.append(self._attention(q[:, a:a + QUERY_BLOCK], _first_keys(k, n), _first_keys(v, n),
                                       allowed[:, a:a + QUERY_BLOCK, :n], policy))
        blind = self._attention(q[:, :1], k, v, jnp.zeros_like(allowed[:, :1]), policy)    # [B, 1, Hq, D]
        return jnp.where(allowed.any(-1)[:, :, None, None], jnp.concatenate(out, axis=1), blind)

    def _attention(self, q, k, v, allowed, policy: Policy):
        """ops.attention with _attention_product's products."""
        compute, smx = of(policy.compute_dtype), of(policy.softmax_dtype)
        B, T, Hq, D = q.shape
        Hkv = k.shape[2]
        scale = D ** -0.5
        early = scale_queries(scale, policy.compute_dtype)
        qg = q.astype(compute)
        qg = (ops.mul_scalar(qg, scale) if early else qg).reshape(B, T, Hkv, Hq // Hkv, D)
        s = self._attention_product(qg, k, (((4,), (3,)), ((0, 2), (0, 2))), policy).astype(compute)
        if not early:
            s = ops.mul_scalar(s, scale)
        s = s.astype(smx)
        s = jnp.where(allowed[:, None, :, None, :], s, jnp.finfo(smx).min)
        p = ops.softmax(s).astype(compute)
        o = self._attention_product(p, v, (((4,), (1,)), ((0, 1), (0, 2))), policy).astype(compute)
        return o.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)

    def _attention_product(self, a, b, dims, policy: Policy):
        """One of attention's two products: where native_products and it has NATIVE_MIN_ROWS rows
        or more (per KV head: a decode step's G query heads count), bf16 operands with f32 sums (a
        widened cache's values back to bf16: exact); else _matmul's widened product."""
        if self.native_products(policy) and _rows(a, dims) >= NATIVE_MIN_ROWS:
            compute = of(policy.compute_dtype)
            b = b.data if isinstance(b, Weight) else b
            return lax.dot_general(a.astype(compute), b.astype(compute), dims, precision=matmul_precision(policy),
                                   preferred_element_type=of(policy.accum_dtype))
        return self._matmul(a, b, dims, policy)

    def _matmul(self, a, b, dims, policy: Policy):
        """ops._dot, with 16-bit operands widened to f32 on the CPU (their products are exact in
        f32: the same arithmetic on XLA:CPU's f32 kernels). b may be a Weight: its data goes to the
        dot as it is; its native copy to a bf16 dot for NATIVE_MIN_ROWS rows or more; its matvec
        copy to the fixed-order kernel for one row."""
        compute, accum = of(policy.compute_dtype), of(policy.accum_dtype)
        wide = self.widened(policy) is not None
        a = a.astype(compute)
        if isinstance(b, Weight) and b.matvec is not None and _rows(a, dims) == 1:
            return _kernel_matvec(a, b.matvec, dims)
        if isinstance(b, Weight) and b.native is not None and _rows(a, dims) >= NATIVE_MIN_ROWS:
            return lax.dot_general(a, b.native, dims, precision=matmul_precision(policy), preferred_element_type=accum)
        if isinstance(b, Weight):
            b = b.data if wide else b.data.astype(compute)
        else:
            b = b.astype(compute)
            if wide:
                b = b.astype(accum)
        if wide:
            a = a.astype(accum)
        return lax.dot_general(a, b, dims, precision=matmul_precision(policy), preferred_element_type=accum)


def _rows(a, dims) -> int:
    """How many rows a product of `a` has: its elements over its contracted and batch sizes."""
    (contract, _), (batch, _) = dims
    return math.prod(n for i, n in enumerate(a.shape) if i not in contract and i not in batch)


def _kernel_matvec(a, w, dims):
    """a [..., k] (one row in all) @ w^T on the fixed-order kernel, w a kernels.PackedWeight
    [n, k] (Weight.matvec); a's compute-dtype values go in widened to f32 (exact)."""
    from . import kernels
    (contract_a, contract_b), batch = dims
    if contract_a != (a.ndim - 1,) or contract_b != (1,) or batch != ((), ()):
        raise ValueError(f"a matvec copy multiplies x @ w.T only, not dimension numbers {dims}")
    y = kernels.gemm(a.reshape(1, a.shape[-1]).astype(jnp.float32), w)
    return y.reshape(*a.shape[:-1], w.n)


def _first_keys(x, n: int):
    """Keys or values [B, S, Hkv, D] (or a widened Weight) up to slot n."""
    return Weight(x.data[:, :n]) if isinstance(x, Weight) else x[:, :n]


def fused(q, k, v, allowed, policy: Policy):
    """ops.attention as one XLA:CPU custom call (attention.h's program, on llamaspec/fixed_order.h's
    tiles): per block of 16 queries and one KV head, the scores of the keys its queries may see,
    rounded and scaled as ops.attention does, softmax in f32 with probabilities rounded to
    compute_dtype, their product with the values in f32, the result rounded; nothing [T, S] leaves
    the CPU's caches. The same function (the sums group otherwise: drift), and bits that depend
    on neither the batch, the thread count nor the instruction set."""
    from . import kernels
    compute = of(policy.compute_dtype)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = D ** -0.5
    early = scale_queries(scale, policy.compute_dtype)
    qg = q.astype(compute)
    qg = (ops.mul_scalar(qg, scale) if early else qg).reshape(B, T, Hkv, Hq // Hkv, D)   # GQA's groups: no copy
    k, v = (x.data if isinstance(x, Weight) else x.astype(compute) for x in (k, v))
    return kernels.attention(qg, k, v, allowed, scale, early).reshape(B, T, Hq, D)


def _bf16_rope(x, cos, sin):
    """ops.apply_rope for bf16 (x and the tables already bf16): the same values bit for bit (a NaN
    stays a NaN, its sign bit may differ), computed in f32 with each op's result rounded to bf16
    (_rounded) and rotate_half as a reversal: rotate_half(x) * sin = [-x2, x1] * [s1, s2] =
    [x2, x1] * [-s1, s2] exactly (a sign moves between the factors; rounding to nearest is
    symmetric), and [x2, x1] is x's two halves reversed. XLA:CPU compiles rotate_half's
    concatenation of bf16 round trips to a branch per element and scalar code; this to vector code."""
    half = x.shape[-1] // 2
    sign = jnp.where(jnp.arange(2 * half) < half, -1.0, 1.0).astype(_F32)
    x = x.astype(_F32)
    swapped = lax.rev(x.reshape(*x.shape[:-1], 2, half), (x.ndim - 1,)).reshape(x.shape)   # [x2, x1]
    return (_rounded(x * cos.astype(_F32), _BF16) + _rounded(swapped * (sin.astype(_F32) * sign), _BF16)).astype(_BF16)


def _rounded(y, dtype):
    """y (f32) rounded to `dtype` (bf16 or f16) and held in f32 again: a 16-bit op computed in f32.

    The same bits as the op in `dtype` itself: an add, subtract or multiply of two bf16 or f16
    values computed in f32 and rounded once is the correctly rounded 16-bit result (f32's 24
    significand bits are at least 2p + 2 for bf16's p = 8 and f16's p = 11), as XLA:CPU computes
    16-bit elementwise ops; the rounding between two ops also keeps the compiler from fusing them
    into one FMA."""
    return y.astype(dtype).astype(y.dtype)


def write_cache(store, layer: int, x, slots):
    """ops.write_cache; where the slots are known while tracing (a numpy array: a fresh cache's
    prompt) and every row's T >= 2 new keys start at one slot, as one block instead of a scatter
    (XLA:CPU runs a scatter as a loop over its B * T rows). The same values either way."""
    T = x.shape[1]
    if isinstance(slots, np.ndarray) and T > 1 and slots.size:
        start = int(slots.flat[0])
        if (slots == start + np.arange(T)).all() and 0 <= start and start + T <= store.shape[2]:
            return lax.dynamic_update_slice(store, x[None], (layer, 0, start, 0, 0))
    return ops.write_cache(store, layer, x, slots)
