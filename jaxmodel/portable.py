"""The invariant backend's portable path: invariant.py's ops (the same names and signatures, the
model's canonical layout unchanged) with no kernel of its own, so it runs wherever XLA runs, a GPU
included. plan.py picks it (llamaspec.plan.INVARIANT_ENV) and fills `Portable`'s fields per device.

- Products at one fixed shape: x's rows (every token of every sequence) cut into chunks of `rows`
  rows, the last one zero-padded, and lax.map over the chunks, so the loop body holds one dot
  [rows, K] x [K, N] whatever the batch: the library's choice of kernel, tiling and split depends
  on the shape, and one shape is one choice; that a row's sum does not depend on its place in the
  chunk is what self_check verifies on the device. 16-bit operands are widened exactly to f32 for
  an f32 product on a CPU (`widen`), taken natively with f32 accumulation elsewhere.
- Every other sum written out as llamaspec.portable defines it (tree_sum: zero-pad to a power of
  two, halve and add): RMSNorm's sum of squares, softmax denominators, attention's q.k over the
  head dim and p.v over the KEY_BLOCK keys of a block (elementwise products, no library dot or
  reduce), block results added in order; max is exact in any order.
- exp by llamaspec.portable's program (+, -, *, rint and power-of-two scalings made from bits);
  1/sqrt in place of rsqrt (sqrt and / are correctly rounded).
- No fma that the program does not ask for. XLA's LLVM backends always allow a multiply feeding
  an add to become one fma (XLA:CPU's CompilerTargetOptions; measured: a*b + c in one XLA:CPU
  program gives the fma's bits), and whether they do depends on what XLA fused around them: the
  scaled scores fused with the softmax's subtraction in a one-key-block program, apart in a
  two-block one, and the row's exp differed. So every product that an add or subtract may read
  is `_product`: the product through a select on its own NaN-ness (a NaN goes through p + p, NaN
  too), which the add then reads in place of the multiply: LLVM contracts only an add of a
  multiply. An optimization_barrier does not do it (XLA removes barriers before fusion), nor a
  select on one operand's NaN-ness (where that operand is the same for a whole inner loop, LLVM
  splits the loop on it and the select goes). Products that are exact (16-bit values in f32)
  need none.

What stays in XLA is elementwise (RoPE's cos and sin included: one program for every element)
or exact (max, gathers, casts, selects). docs/invariance.md says why; self_check() verifies the
promise on the model's device at load.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from llamaspec import Policy
from llamaspec import portable as spec

from . import ops
from .dtypes import matmul_precision, of
from .fast import Fast, write_cache  # noqa: F401 (as invariant.py: a prompt's keys as one block)
from .ops import norm_weight, rope_inv_freq, rotate_half, scanned  # noqa: F401 (as is)

kv_round = ops.kv_round        # called in every attention call; as is without kv_cache (plan.declines it)
fp8_linear = ops.fp8_linear    # reached only with weight_fp8 / act_fp8, which plan.declines

LAYOUT_MULTIPLE = 16  # canonical widths are multiples of this (fewer compiled shapes; order-free)
KEY_BLOCK = 64        # keys per attention block, added in order
SELF_CHECK_SIZES = (2, 5, 17)  # batch sizes of the load-time self-check (each one a compile)
_F32 = jnp.dtype(jnp.float32)


def _acc(policy: Policy):
    """The accumulator of every product and sum: f64 for an f64 accumulation, else f32."""
    return jnp.dtype(jnp.float64) if of(policy.accum_dtype) == jnp.float64 else _F32


def _wide(dtype):
    """A 16-bit dtype's f32, a wider one itself (where sums and exp run)."""
    return dtype if jnp.dtype(dtype).itemsize >= 4 else _F32


def _exact_products(operand, acc) -> bool:
    """Whether every product of two `operand` values is exact in `acc` (twice the significand
    fits; short of underflow): then an fma gives the separately rounded result, no _product guard
    is needed."""
    return 2 * jnp.finfo(operand).nmant + 2 <= jnp.finfo(acc).nmant + 1


def _product(a, b, exact: bool = False):
    """a * b rounded on its own before an add reads it (the module docstring): a select on the
    product's NaN-ness between the product and p + p (the same NaN-ness). As it is where the
    products are exact."""
    p = a * b
    return p if exact else jnp.where(jnp.isnan(p), p + p, p)


# ----- llamaspec.portable's programs in jnp ----------------------------------------------

def tree_sum(x, axis: int = -1):
    """llamaspec.portable.tree_sum: the sum over `axis` as a halving tree, zero-padded to a
    power of two (slices and adds only)."""
    axis = axis % x.ndim
    n = x.shape[axis]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - n)
        x = jnp.pad(x, pad)
    while x.shape[axis] > 1:
        h = x.shape[axis] // 2
        x = lax.slice_in_dim(x, 0, h, axis=axis) + lax.slice_in_dim(x, h, 2 * h, axis=axis)
    return lax.squeeze(x, (axis,))


def exp(x):
    """llamaspec.portable.exp for an f32 or f64 array, op for op."""
    dt = np.dtype(x.dtype)
    if dt not in spec.EXP_MAX:
        raise TypeError(f"portable exp: float32 or float64, got {dt}")
    hi, lo = (spec.LN2_HI_F32, spec.LN2_LO_F32) if dt == np.float32 else (spec.LN2_HI_F64, spec.LN2_LO_F64)
    c = dt.type
    n = lax.round(x * c(spec.LOG2E), lax.RoundingMethod.TO_NEAREST_EVEN)
    r = x - n * c(hi)              # n * hi is exact (hi has few bits): an fma gives the same
    r = r - _product(n, c(lo))
    coef = spec.taylor(dt)
    p = jnp.full_like(x, c(coef[0]))
    for ci in coef[1:]:
        p = _product(p, r) + c(ci)
    e = jnp.clip(n, -2000, 2000).astype(jnp.int64 if dt == np.float64 else jnp.int32)
    e1 = e >> 1
    y = _product(p * _pow2(e1, dt), _pow2(e - e1, dt))   # inexact where the result is subnormal
    y = jnp.where(x < c(spec.EXP_MIN[dt]), c(0), y)
    y = jnp.where(x > c(spec.EXP_MAX[dt]), c(np.inf), y)
    return jnp.where(jnp.isnan(x), x, y)


def _pow2(e, dt):
    """2.0**e from its bits (e clipped to the normal range, as llamaspec.portable._pow2)."""
    if dt == np.float32:
        return lax.bitcast_convert_type((jnp.clip(e, -126, 127) + 127).astype(jnp.uint32) << 23, jnp.float32)
    return lax.bitcast_convert_type((jnp.clip(e, -1022, 1023) + 1023).astype(jnp.uint64) << 52, jnp.float64)


def _exp(x):
    """exp by the portable program; 16-bit inputs are taken in f32 and rounded once."""
    return exp(x.astype(_wide(x.dtype))).astype(x.dtype)


# ----- the ops ---------------------------------------------------------------------------

def products(x, w, policy: Policy, rows: int, widen: bool):
    """x [M, K] @ w [N, K]^T in the accumulator, at one shape: M cut into chunks of `rows` rows
    (the last zero-padded), one dot [rows, K] x [K, N] per chunk under lax.map. Operands in
    compute_dtype, taken in the accumulator (exact) at the policy's matmul precision; 16-bit ones
    widened to f32 for f32 dots at HIGHEST where `widen` says so, else native (summed in f32)."""
    compute, acc = of(policy.compute_dtype), _acc(policy)
    x, precision = x.astype(compute), matmul_precision(policy)
    if compute.itemsize >= 4 or widen:
        x = x.astype(acc)
        precision = precision if compute.itemsize >= 4 else lax.Precision.HIGHEST
    w = w.astype(x.dtype)
    M, K = x.shape
    chunks = -(-M // rows)
    x = jnp.pad(x, ((0, chunks * rows - M), (0, 0))).reshape(chunks, rows, K)
    y = lax.map(lambda c: lax.dot_general(c, w, (((1,), (1,)), ((), ())), precision=precision,
                                          preferred_element_type=acc), x)
    return y.reshape(chunks * rows, -1)[:M]


def linear(x, w, b, policy: Policy, out_dtype=None, rows: int = 16, widen: bool = True):
    """ops.linear: products() at one shape, bias added in the accumulator, rounded once."""
    compute = of(policy.compute_dtype)
    y = products(x.reshape(-1, x.shape[-1]), w, policy, rows, widen)
    if b is not None:
        y = y + b.astype(compute).astype(y.dtype)
    return y.astype(out_dtype or compute).reshape(*x.shape[:-1], w.shape[0])


def rms_norm(x, weight, eps: float, policy: Policy):
    """ops.rms_norm with mean(x^2) as a tree sum of squares over the hidden size (in f32 for a
    16-bit norm dtype, rounded once) and 1/sqrt(var) in place of rsqrt."""
    norm = of(policy.norm_dtype)
    h = x.astype(norm)
    wide = _wide(norm)
    hw = h.astype(wide)
    squares = _product(hw, hw, _exact_products(norm, wide))
    total = tree_sum(squares)
    # XLA makes a division by a constant a product with its reciprocal: held apart from the add too
    mean = jnp.where(jnp.isnan(total), total, total / x.shape[-1])
    var = ops.add_scalar(mean.astype(norm)[..., None], eps)
    return ops.norm_weight(h * (1 / jnp.sqrt(var)), x, weight, policy)


def rope_cos_sin(inv_freq, positions, dtype):
    """ops.rope_cos_sin with the angles rounded before cos and sin read them (_product: so that no
    fma joins an angle's product to the functions' range reduction)."""
    angles = _product(positions[..., None].astype(dtype), inv_freq.astype(dtype))
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """ops.apply_rope with each product rounded before the add (bf16: fast's form, which rounds
    each op to bf16 and so has no fma to keep out)."""
    if x.dtype == jnp.bfloat16:
        return Fast.apply_rope(x, cos, sin)
    cos = cos.astype(x.dtype)[:, :, None, :]
    sin = sin.astype(x.dtype)[:, :, None, :]
    return _product(x, cos) + _product(rotate_half(x), sin)


def silu(x):
    """x * sigmoid(x) as x / (1 + exp(-x)) with the portable exp (16-bit: in f32, rounded once)."""
    h = x.astype(_wide(x.dtype))
    return (h / (1 + _exp(-h))).astype(x.dtype)


def _in_order(parts):
    """Sum over the first axis one block after the other (XLA does not reassociate float adds)."""
    acc = parts[0]
    for i in range(1, parts.shape[0]):
        acc = acc + parts[i]
    return acc


def attention(q, k, v, allowed, policy: Policy):
    """ops.attention per KEY_BLOCK block of keys (as invariant.attention), every sum a tree sum.
    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; allowed [B, T, S]."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G, Kb = Hq // Hkv, KEY_BLOCK
    compute, soft, acc = of(policy.compute_dtype), of(policy.softmax_dtype), _acc(policy)
    exact = _exact_products(compute, acc)
    pad = -S % Kb
    if pad:
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
        allowed = jnp.pad(allowed, ((0, 0), (0, 0), (0, pad)))
    nk = (S + pad) // Kb

    def blocks(x):   # [B, S, Hkv, D] -> [nk, B, Hkv, Kb, D], in the accumulator (exact)
        return x.astype(compute).astype(acc).reshape(B, nk, Kb, Hkv, D).transpose(1, 0, 3, 2, 4)

    qg = q.astype(compute).astype(acc).reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    # q.k per block: [B, Hkv, G, T, Kb, D] products, summed over D
    scores = lax.map(lambda kj: tree_sum(_product(qg[:, :, :, :, None], kj[:, :, None, None], exact)), blocks(k))
    scale = D ** -0.5     # ops.mul_scalar (16-bit: in f32, rounded, which no fma crosses)
    scores = (_product(scores, np.asarray(scale, compute)) if compute.itemsize >= 4
              else ops.mul_scalar(scores.astype(compute), scale)).astype(soft)    # [nk, B, Hkv, G, T, Kb]
    keep = allowed.reshape(B, T, nk, Kb).transpose(2, 0, 1, 3)[:, :, None, None]
    scores = jnp.where(keep, scores, jnp.finfo(soft).min)
    e = _exp(scores - jnp.max(scores, axis=(0, 5), keepdims=True))
    denom = _in_order(tree_sum(e.astype(_wide(soft)))).astype(soft)                 # [B, Hkv, G, T]
    probs = (e / denom[..., None]).astype(compute)

    def part(p, vj):  # p [B, Hkv, G, T, Kb], vj [B, Hkv, Kb, D] -> [B, Hkv, G, T, D], summed over Kb
        return tree_sum(_product(p.astype(acc)[..., None], vj[:, :, None, None], exact), axis=4)

    vb = blocks(v)
    ctx = lax.scan(lambda c, pv: (c + part(*pv), None), part(probs[0], vb[0]), (probs[1:], vb[1:]))[0]
    return ctx.astype(compute).transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


# ----- the namespace the plan builds -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Portable:
    """The portable ops for one device (plan.py fills the fields; hashable: part of a model's
    graphdef, so programs compiled for one choice never run for another).

    rows: rows per product chunk (the plan's, per device). widen: 16-bit operands widened to f32
    for the products (a CPU) or taken natively with f32 accumulation (a GPU). layout: the mesh
    layout (sharding.MeshLayout) or None: on a mesh the weights are whole on every device and a
    product runs whole there for the device's rows of the batch (docs/sharding.md)."""
    rows: int = 16
    widen: bool = True
    layout: object = None

    ROW_PARALLEL = False
    LAYOUT_MULTIPLE = LAYOUT_MULTIPLE
    KEY_BLOCK = KEY_BLOCK
    apply_rope = staticmethod(apply_rope)
    kv_round = staticmethod(kv_round)
    fp8_linear = staticmethod(fp8_linear)
    write_cache = staticmethod(write_cache)
    scanned = staticmethod(scanned)
    rope_inv_freq = staticmethod(rope_inv_freq)
    rope_cos_sin = staticmethod(rope_cos_sin)
    rms_norm = staticmethod(rms_norm)
    silu = staticmethod(silu)
    attention = staticmethod(attention)

    def prepare(self, w, policy: Policy, layout=None, one_row: bool = True):
        """ops.prepare: the matrix as the products read it, once: a 16-bit one widened to f32 where
        the products widen (the same values); on a mesh whole on every device."""
        if layout is not None:
            from .sharding import to_host
            w = layout.put_replicated(to_host(w))
        compute = of(policy.compute_dtype)
        return w.astype(compute).astype(_F32) if self.widen and compute.itemsize < 4 else w

    def kv_dtype(self, policy: Policy):
        """ops.kv_dtype; a 16-bit cache kept in f32 where the products widen (the same values:
        XLA:CPU writes a 16-bit row into a larger array by converting the whole array, every step)."""
        compute = of(policy.compute_dtype)
        return _F32 if self.widen and compute.itemsize < 4 else compute

    def linear(self, x, w, b, policy: Policy, out_dtype=None):
        run = functools.partial(linear, policy=policy, out_dtype=out_dtype, rows=self.rows, widen=self.widen)
        if self.layout is None:
            return run(x, w, b)
        # each device: its rows of the batch (the data axis, where they divide), every column, the whole weight
        split = x.shape[0] % self.layout.data == 0
        rows_spec = self.layout.spec("batch" if split else None, *(None,) * (x.ndim - 1))
        whole = jax.sharding.PartitionSpec()
        if b is None:
            return jax.shard_map(lambda x, w: run(x, w, None), mesh=self.layout.mesh, in_specs=(rows_spec, whole),
                                 out_specs=rows_spec)(x, w)
        return jax.shard_map(run, mesh=self.layout.mesh, in_specs=(rows_spec, whole, whole),
                             out_specs=rows_spec)(x, w, b)

    def self_check(self, module) -> None:
        """self_check(module, these ops) on one device: on a mesh each device runs the same program
        for its rows (the weights whole there), and a row's bits do not depend on its batch."""
        self_check(module, dataclasses.replace(self, layout=None))


# ----- the self-check --------------------------------------------------------------------

def self_check(module, ops_=None) -> None:
    """Verifies on the model's device, once per process, configuration, policy and namespace,
    that the ops the model runs (ops_, default module.ops: the linears on its own weights, one
    token per row and LAYOUT_MULTIPLE tokens per row, the lm_head, RMSNorm, silu, attention and
    RoPE's tables on random rows) give a row the same bits alone and inside batches of several
    sizes (llamaspec.selfcheck.check_rows); raises InvarianceError naming the op otherwise. Each
    op is compiled with the batch-invariant compiler options, as the model's programs are. The
    same check serves any namespace with these ops (invariant.py's included)."""
    from llamaspec.selfcheck import check_rows

    from .dtypes import compiler_options
    cfg, policy, ops_ = module.cfg, module.policy, ops_ or module.ops
    key = (cfg, policy, ops_)
    if key in _CHECKED:
        return
    compute, rope = of(policy.compute_dtype), of(policy.rope_dtype)
    rng = np.random.default_rng(0)
    pool = 24
    jit = functools.partial(jax.jit, compiler_options=compiler_options(True))

    def rand(*shape):  # spread over 2^-8..2^8, as torchref's check: the summation order shows
        return jnp.asarray(rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 9, shape), compute)

    def rows_of(fn, x, *params):  # params go in as arguments: constants would slow the compile
        f = jit(fn)
        return lambda idx: np.asarray(f(x[np.asarray(idx)], *params).astype(jnp.float32))

    layer = module.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    d, f, o = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    T = ops_.LAYOUT_MULTIPLE
    x1, xt = rand(pool, 1, d), rand(pool, T, d)

    def lin(m, x, out_dtype=None):
        bias = None if m.bias is None else m.bias[...]
        return rows_of(lambda x, w, b: ops_.linear(x, w, b, policy, out_dtype), x, m.weight.get_value(), bias)

    checks = {
        "linear q_proj (one token)": lin(attn.q_proj, x1),
        f"linear q_proj ({T} tokens)": lin(attn.q_proj, xt),
        "linear o_proj (one token)": lin(attn.o_proj, rand(pool, 1, o)),
        "linear gate_proj (one token)": lin(mlp.gate_proj, x1),
        f"linear down_proj ({T} tokens)": lin(mlp.down_proj, rand(pool, T, f)),
        "lm_head (one token)": rows_of(lambda x, w: ops_.linear(x, w, None, policy, of(policy.logits_dtype)), x1,
                                       module.head_weight()),
        "rms_norm": rows_of(lambda x, w: ops_.rms_norm(x, w, cfg.rms_norm_eps, policy), xt,
                            layer.input_layernorm.weight[...]),
        "silu": rows_of(ops_.silu, rand(pool, T, f)),
        "attention": _attention_rows(cfg, policy, ops_, rng, jit, pool),
        # RoPE's cos and sin stay in XLA (elementwise): checked, at random positions
        "rope tables": rows_of(lambda p, f: jnp.concatenate(ops_.rope_cos_sin(f, p, rope), -1),
                               jnp.asarray(rng.integers(0, cfg.max_position_embeddings, (pool, T))),
                               ops_.rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings,
                                                  cfg.max_position_embeddings, rope)),
    }
    check_rows(checks, pool, sizes=SELF_CHECK_SIZES)
    _CHECKED.add(key)


def _attention_rows(cfg, policy: Policy, ops_, rng, jit, pool):
    """Rows for the attention check: sequences of random lengths (up to two key blocks),
    keys at slots [0, n) as the canonical layout puts them; the batch's longest row sets
    the width, rounded up to LAYOUT_MULTIPLE, as in the model."""
    compute, multiple = of(policy.compute_dtype), ops_.LAYOUT_MULTIPLE
    H, Hkv, D, S = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, ops_.KEY_BLOCK + multiple
    q, k, v = (np.asarray(rng.standard_normal((pool, S, h, D)), np.float32) for h in (H, Hkv, Hkv))
    lens = rng.integers(1, S + 1, pool)
    slots = np.arange(S)
    allowed = (slots[None, None, :] <= slots[None, :, None]) & (slots[None, None, :] < lens[:, None, None])
    fn = jit(lambda q, k, v, a: ops_.attention(q.astype(compute), k.astype(compute), v.astype(compute), a, policy))

    def rows(idx):
        idx = np.asarray(idx)
        width = -(-int(lens[idx].max()) // multiple) * multiple
        out = np.asarray(fn(q[idx, :width], k[idx, :width], v[idx, :width], allowed[idx, :width, :width])
                         .astype(jnp.float32))
        full = np.zeros((len(idx), S, H, D), np.float32)
        full[:, :width] = out
        return np.where(slots[None, :, None, None] < lens[idx][:, None, None, None], full, 0)
    return rows


_CHECKED: set = set()
