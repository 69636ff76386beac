"""Batch-invariant versions of the ops whose result for one sequence could depend on the
rest of the batch: the invariant backend, with ops.py's op names (plan.py picks it); mirrors
torchref/invariant.py function by function.

Products (on weights packed once at load), row sums and exp run on llamaspec/fixed_order.h's
programs through XLA's FFI (kernels.py), the ones torchref runs through ctypes; 1/sqrt
replaces rsqrt; attention runs per KEY_BLOCK keys, block results added in order. What stays
in XLA is elementwise, RoPE's cos and sin included. docs/invariance.md says why;
self_check() verifies the promise on this machine at load.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from llamaspec import Policy

from . import kernels, ops
from .dtypes import of
from .fast import Fast, write_cache  # noqa: F401 (a prompt's keys as one block: the same values)
from .kernels import PackedWeight
from .ops import kv_dtype, norm_weight, rope_cos_sin, rope_inv_freq, rotate_half, scanned  # noqa: F401 (as is)

# the self-check: portable.self_check, one check for both implementations (it reads the ops from
# the model's namespace, this module's included)
from .portable import self_check  # noqa: F401

apply_rope = Fast.apply_rope   # elementwise, the same bits in any batch (bf16: fast's vector form)
kv_round = ops.kv_round        # called in every attention call; as is without kv_cache (plan.declines it)
fp8_linear = ops.fp8_linear    # reached only with weight_fp8 / act_fp8, which plan.declines
ROW_PARALLEL = False           # the fixed-order kernels run whole on each device (docs/sharding.md)

LAYOUT_MULTIPLE = 16  # canonical widths are multiples of this (fewer compiled shapes; order-free)
KEY_BLOCK = 64        # keys per attention block: every attention product has this shape
SELF_CHECK_SIZES = (2, 5, 17)  # batch sizes of the load-time self-check (each one a compile)


def _acc(policy: Policy):
    """The accumulator of every product and sum: f64 for an f64 accumulation, else f32."""
    return jnp.dtype(jnp.float64) if of(policy.accum_dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def pack(w, policy: Policy) -> PackedWeight:
    """A weight [out, in] (host array) packed once for linear() at this policy."""
    return PackedWeight.of(w, policy.compute_dtype, policy.accum_dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "packed"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Weight:
    """A matrix as linear() takes it: data, its values in param_dtype (indexing reads them), and
    packed, the same packed once for fixed_order's gemm."""
    data: jax.Array
    packed: PackedWeight

    @property
    def shape(self):
        return self.data.shape

    def __getitem__(self, index):
        return self.data[index]


def prepare(w, policy: Policy, layout=None, one_row: bool = True) -> Weight:
    """ops.prepare: w with its packed form, from the values as rounded to param_dtype. On a mesh
    the packed array is replicated (the fixed-order kernels are per-device code, run whole on each
    device: docs/sharding.md)."""
    from .sharding import to_host
    p = pack(to_host(w), policy)
    data = p.data if layout is None else layout.put_replicated(np.asarray(p.data))
    return Weight(w, PackedWeight(data, p.n, p.k, p.wtype, p.x_dtype, p.acc))


def linear(x, w: Weight, b, policy: Policy, out_dtype=None):
    """ops.linear: operands rounded to compute_dtype, products summed in the accumulator
    by fixed_order's gemm on the packed weight, bias added, rounded once to out_dtype."""
    w = w.packed if isinstance(w, Weight) else w
    rows = x.reshape(-1, x.shape[-1]).astype(of(policy.compute_dtype)).astype(w.x_dtype)
    y = kernels.gemm(rows, w)
    if b is not None:
        y = y + b.astype(of(policy.compute_dtype)).astype(w.acc)
    y = y.astype(out_dtype or of(policy.compute_dtype))
    return y.reshape(*x.shape[:-1], w.n)


def rms_norm(x, weight, eps: float, policy: Policy):
    """ops.rms_norm with mean(x^2) as a fixed-order sum of squares over the hidden size
    (in f32 for a 16-bit norm dtype, rounded once) and 1/sqrt(var) in place of rsqrt."""
    norm = of(policy.norm_dtype)
    h = x.astype(norm)
    wide = norm if norm.itemsize >= 4 else jnp.dtype(jnp.float32)
    var = ops.add_scalar((kernels.row_sums(h.astype(wide), squares=True) / x.shape[-1]).astype(norm)[..., None],
                         eps)
    return ops.norm_weight(h * (1 / jnp.sqrt(var)), x, weight, policy)


def _exp(x):
    """exp by fixed_order's program; 16-bit inputs are taken in f32 and rounded once."""
    wide = x.dtype if x.dtype.itemsize >= 4 else jnp.dtype(jnp.float32)
    return kernels.exp(x.astype(wide)).astype(x.dtype)


def silu(x):
    """x * sigmoid(x) as x / (1 + exp(-x)) with the fixed exp (16-bit: in f32, rounded once)."""
    wide = x.dtype if x.dtype.itemsize >= 4 else jnp.dtype(jnp.float32)
    h = x.astype(wide)
    return (h / (1 + _exp(-h))).astype(x.dtype)


def _in_order(parts, axis: int):
    """Sum over `axis` one block after the other (XLA does not reassociate float adds);
    trailing blocks that hold only zeros leave the sum unchanged."""
    parts = jnp.moveaxis(parts, axis, 0)
    acc = parts[0]
    for i in range(1, parts.shape[0]):
        acc = acc + parts[i]
    return acc


def attention(q, k, v, allowed, policy: Policy):
    """ops.attention, computed per KEY_BLOCK block of keys in a fixed order (as
    torchref.invariant.attention). q [B, T, Hq, D]; k, v [B, S, Hkv, D]; allowed [B, T, S]."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G, Kb = Hq // Hkv, KEY_BLOCK
    compute, soft, acc = of(policy.compute_dtype), of(policy.softmax_dtype), _acc(policy)
    pad = -S % Kb
    if pad:
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
        allowed = jnp.pad(allowed, ((0, 0), (0, 0), (0, pad)))
    nk, M = (S + pad) // Kb, G * T
    qg = q.astype(compute).reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B * Hkv, 1, M, D)
    kb = k.astype(compute).transpose(0, 2, 1, 3).reshape(B * Hkv, nk, Kb, D)
    scores = kernels.gemm_batched(qg.astype(acc), kb.astype(acc), w_kn=False)   # [B*Hkv, nk, M, Kb]
    scores = ops.mul_scalar(scores.astype(compute), D ** -0.5)
    scores = scores.reshape(B, Hkv, nk, G, T, Kb).astype(soft)
    keep = allowed.reshape(B, T, nk, Kb).transpose(0, 2, 1, 3)[:, None, :, None]
    scores = jnp.where(keep, scores, jnp.finfo(soft).min)
    e = _exp(scores - jnp.max(scores, axis=(2, 5), keepdims=True))
    wide = soft if soft.itemsize >= 4 else jnp.dtype(jnp.float32)
    denom = _in_order(kernels.row_sums(e.astype(wide))[..., None], 2).astype(soft)  # [B, Hkv, G, T, 1]
    probs = (e / denom[:, :, None]).astype(compute).reshape(B * Hkv, nk, M, Kb)
    vb = v.astype(compute).transpose(0, 2, 1, 3).reshape(B * Hkv, nk, Kb, D)
    parts = kernels.gemm_batched(probs.astype(acc), vb.astype(acc), w_kn=True)    # [B*Hkv, nk, M, D]
    ctx = _in_order(parts.reshape(B, Hkv, nk, M, D), 2).astype(compute)           # [B, Hkv, M, D]
    return ctx.reshape(B, Hkv, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
