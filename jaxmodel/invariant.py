"""Batch-invariant versions of the ops whose result for one sequence could depend on the
rest of the batch. Same names and signatures as ops.py; the model picks the module.

What breaks invariance under XLA:CPU was measured (jax 0.10, this project's compiler
options; bench/bench_invariant.py --probe prints it again):

- A dot gives a row one result for every row count M >= 2 (checked to M = 4096, every
  position, SmolLM2 and tiny shapes); M = 1 is a matrix-vector product with another
  summation order (XLA's own code: YNNPACK, which runs 2+ rows, takes no vectors).
  Multi-token calls (prefill, forward) therefore never run a linear layer on a single
  row (ROW_MIN). One-token-per-sequence calls (decode) with f32 operands run on
  rowdot.cc instead, an FFI kernel with one fixed order per output at any M: padding
  them to 2 rows made batch-1 decode 2x slower (YNNPACK repacks the weights on every
  call); the kernel costs about the default mode's matrix-vector product (decode ratio
  1.0 at batch 1, 0.7 at 8, SmolLM2 fp32). bf16/f16 policies keep the padding (their
  decode is no slower than the default mode's), as does any machine where the kernel
  cannot be built (rowdot.available()).
- Which dot algorithm XLA picks also depends on the other sizes (a [M, 64] x [64, 8]
  product changed result between M = 8 and M = 96): attention dots must have one fixed
  shape. Queries go through in tiles of Q_BLOCK (lax.map, so XLA cannot merge the tiles
  back into one dot) and keys in blocks of KEY_BLOCK (lax.map for q.k^T; P@V has the
  block index as a batch dimension of both operands).
- Reductions (jnp.sum/mean) change their order with the number of rows reduced at once
  and with the reduced length, even when the extra elements are zeros. Sums are
  therefore written out: a fixed pairwise tree over a fixed length (the hidden size for
  RMSNorm, KEY_BLOCK for the softmax), then block after block in order. Blocks past a
  row's end hold only zeros and add nothing. max is exact in any order.
- Elementwise ops (exp, logistic, rsqrt, cos, sin) gave the same result at every
  position: they are used as in ops.py. But XLA hands a large enough softmax fusion
  (max-reduce + exp) to YNNPACK, whose exp differs in the last bit, and from 8 rows on
  fuses a dot with its elementwise neighbours in YNNPACK; batch-invariant programs are
  therefore compiled with YNNPACK kept to individual dots (dtypes._INVARIANT_OPTIONS).
  Before that, decode logits differed by up to 1e-4 between a sequence alone and in
  4-16-row batches.

Invariance holds up to max_position_embeddings tokens per sequence (prompt plus new
tokens; past it dynamic NTK RoPE depends on the batch's longest row). Not measured on
GPU: no claim there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from llamaspec import Policy

from . import ops, rowdot
from .dtypes import matmul_precision, of
from .ops import apply_rope, rope_cos_sin, rope_inv_freq, rotate_half, silu  # noqa: F401 (invariant as is)

ROW_MIN = 2        # a linear layer never runs on fewer rows (one row is a GEMV)
Q_BLOCK = 16       # queries per attention tile (prefill widths are multiples of it)
KEY_BLOCK = 64     # keys per attention block: every attention dot has this fixed size
SELF_CHECK_SIZES = (2, 5, 17)  # batch sizes of the load-time self-check (each one a compile)


def tree_sum(x, wide=None):
    """Sum over the last axis as a fixed pairwise tree (zero-padded to a power of two):
    the order depends on the axis length only, never on the other axes."""
    if wide is not None:
        x = x.astype(wide)
    n = x.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - n)])
    while size > 1:
        size //= 2
        x = x[..., :size] + x[..., size:]
    return x[..., 0]


def _in_order(parts):
    """parts[0] + parts[1] + ... left to right (XLA does not reassociate float adds)."""
    acc = parts[0]
    for i in range(1, parts.shape[0]):
        acc = acc + parts[i]
    return acc


def linear(x, w, b, policy: Policy, out_dtype=None):
    """ops.linear at a row count whose result does not depend on the batch.

    One token per sequence (x [B, 1, in]: decode steps, and the lm_head on each row's
    last slot) with f32 operands on the CPU: rowdot's fixed-order kernel, one result per
    row at any B, at matrix-vector cost. Otherwise ops.linear on the rows flattened, with
    a zero row added when there is only one (XLA's 1-row product sums in another order).
    """
    rows = x.reshape(-1, x.shape[-1])
    if x.ndim == 3 and x.shape[1] == 1 and _row_kernel(w, policy):
        y = rowdot.row_dot(rows, w)  # compute_dtype is f32 here: row_dot rounds to it
        if b is not None:
            y = y + b.astype(of(policy.accum_dtype))
        y = y.astype(out_dtype or of(policy.compute_dtype))
        return y.reshape(*x.shape[:-1], y.shape[-1])
    M = rows.shape[0]
    if M < ROW_MIN:
        rows = jnp.pad(rows, ((0, ROW_MIN - M), (0, 0)))
    y = ops.linear(rows, w, b, policy, out_dtype)[:M]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _row_kernel(w, policy: Policy) -> bool:
    """Whether rowdot computes this product exactly as the policy asks: f32 inputs, f32
    sums, full-precision products (HIGHEST; "tf32" is f32 on a CPU), on the CPU."""
    f32 = jnp.dtype(jnp.float32)
    return (of(policy.compute_dtype) == f32 and of(policy.accum_dtype) == f32 and w.dtype == f32
            and jax.default_backend() == "cpu" and rowdot.available())


def rms_norm(x, weight, eps: float, policy: Policy):
    """ops.rms_norm with mean(x^2) as tree_sum(x^2) / hidden."""
    norm, compute = of(policy.norm_dtype), of(policy.compute_dtype)
    xn = x.astype(norm)
    var = (tree_sum(xn * xn) / x.shape[-1])[..., None]
    y = xn * lax.rsqrt(ops._add_scalar(var, eps))
    if policy.norm_cast_before_weight:
        return weight.astype(compute) * y.astype(x.dtype).astype(compute)
    return (weight.astype(norm) * y).astype(compute)


def attention(q, k, v, allowed, policy: Policy):
    """ops.attention in fixed-shape tiles: q [B, T, Hq, D]; k, v [B, S, Hkv, D];
    allowed [B, T, S]. T is a multiple of Q_BLOCK or a single tile (decode); S is padded
    to a multiple of KEY_BLOCK with masked zero keys."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    Kb = KEY_BLOCK
    pad = -S % Kb
    if pad:
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
        allowed = jnp.pad(allowed, ((0, 0), (0, 0), (0, pad)))
    nk = (S + pad) // Kb
    Tq = Q_BLOCK if T % Q_BLOCK == 0 else T
    nq = T // Tq
    kb = k.reshape(B, nk, Kb, Hkv, D).transpose(1, 0, 2, 3, 4)      # [nk, B, Kb, Hkv, D]
    vb = v.reshape(B, nk, Kb, Hkv, D).transpose(1, 0, 2, 3, 4)
    qt = q.reshape(B, nq, Tq, Hq, D).transpose(1, 0, 2, 3, 4)       # [nq, B, Tq, Hq, D]
    at = allowed.reshape(B, nq, Tq, nk, Kb).transpose(1, 3, 0, 2, 4)  # [nq, nk, B, Tq, Kb]
    out = lax.map(lambda tile: _attend(*tile, kb, vb, policy), (qt, at))
    return out.transpose(1, 0, 2, 3, 4).reshape(B, T, Hq, D)


def _attend(q, allowed, kb, vb, policy: Policy):
    """One query tile q [B, Tq, Hq, D] against every key block; allowed [nk, B, Tq, Kb]."""
    compute, accum, smx = of(policy.compute_dtype), of(policy.accum_dtype), of(policy.softmax_dtype)
    B, Tq, Hq, D = q.shape
    Hkv = kb.shape[3]
    qg = q.astype(compute).reshape(B, Tq, Hkv, Hq // Hkv, D)
    # [B, Tq, K, G, D] x [B, Kb, K, D] -> [B, K, Tq, G, Kb], one block at a time
    s = lax.map(lambda kblk: ops._dot(qg, kblk, (((4,), (3,)), ((0, 2), (0, 2))), policy), kb)
    s = ops._mul_scalar(s.astype(compute), D ** -0.5).astype(smx)   # [nk, B, K, Tq, G, Kb]
    s = jnp.where(allowed[:, :, None, :, None, :], s, jnp.finfo(smx).min)
    e = jnp.exp(s - jnp.max(s, axis=(0, 5), keepdims=True))
    wide = jnp.float32 if smx.itemsize < 4 else smx   # 16-bit: add in f32, round once
    denom = _in_order(tree_sum(e, wide)).astype(smx)               # [B, K, Tq, G]
    p = (e / denom[None, ..., None]).astype(compute)
    # [nk, B, K, Tq, G, Kb] x [nk, B, Kb, K, D] -> [nk, B, K, Tq, G, D], summed in order
    parts = lax.dot_general(p.astype(accum), vb.astype(compute).astype(accum),
                            (((5,), (2,)), ((0, 1, 2), (0, 1, 3))),
                            precision=matmul_precision(policy), preferred_element_type=accum)
    o = _in_order(parts).astype(compute)                           # [B, K, Tq, G, D]
    return o.transpose(0, 2, 1, 3, 4).reshape(B, Tq, Hq, D)


# ----- the self-check -------------------------------------------------------------------

def self_check(module) -> None:
    """Verifies on this machine, once per process, configuration and policy, that the ops
    the invariant model runs give a row the same bits alone and inside batches of several
    sizes (llamaspec.selfcheck.check_rows): the linears on the model's own weights, one
    token per row (decode) and Q_BLOCK tokens per row (prefill), RMSNorm, silu and
    attention on random rows; raises InvarianceError naming the op otherwise. Each op is
    compiled with the batch-invariant compiler options, as the model's programs are."""
    import functools

    import numpy as np

    from llamaspec.selfcheck import check_rows

    from .dtypes import compiler_options
    cfg, policy = module.cfg, module.policy
    key = (cfg, policy)
    if key in _CHECKED:
        return
    compute = of(policy.compute_dtype)
    rng = np.random.default_rng(0)
    pool = 24
    jit = functools.partial(jax.jit, compiler_options=compiler_options(True))

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape), compute)

    def rows_of(fn, x, *params):  # params go in as arguments: constants would slow the compile
        f = jit(fn)
        return lambda idx: np.asarray(f(x[np.asarray(idx)], *params).astype(jnp.float32))

    layer = module.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    d, f, o = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    x1, xq = rand(pool, 1, d), rand(pool, Q_BLOCK, d)
    head = module.embed_tokens.weight[...] if module.lm_head is None else module.lm_head.weight[...]
    def lin(m):
        return lambda x, w, b: linear(x, w, b, policy)

    def wb(m):
        return (m.weight[...], None if m.bias is None else m.bias[...])

    checks = {
        "linear q_proj (one token)": rows_of(lin(attn.q_proj), x1, *wb(attn.q_proj)),
        f"linear q_proj ({Q_BLOCK} tokens)": rows_of(lin(attn.q_proj), xq, *wb(attn.q_proj)),
        "linear o_proj (one token)": rows_of(lin(attn.o_proj), rand(pool, 1, o), *wb(attn.o_proj)),
        "linear gate_proj (one token)": rows_of(lin(mlp.gate_proj), x1, *wb(mlp.gate_proj)),
        f"linear down_proj ({Q_BLOCK} tokens)": rows_of(lin(mlp.down_proj), rand(pool, Q_BLOCK, f),
                                                       *wb(mlp.down_proj)),
        "lm_head (one token)": rows_of(lambda x, w: linear(x, w, None, policy, policy.logits_dtype), x1, head),
        "rms_norm": rows_of(lambda x, w: rms_norm(x, w, cfg.rms_norm_eps, policy), xq,
                            layer.input_layernorm.weight[...]),
        "silu": rows_of(silu, rand(pool, Q_BLOCK, f)),
        "attention": _attention_rows(cfg, policy, rng, jit, pool),
    }
    check_rows(checks, pool, sizes=SELF_CHECK_SIZES)
    _CHECKED.add(key)


def _attention_rows(cfg, policy: Policy, rng, jit, pool):
    """Rows for the attention check: sequences of random lengths (up to two key blocks),
    keys at slots [0, n) as the canonical layout puts them; the batch's longest row sets
    the width, rounded up to Q_BLOCK, as in the model."""
    import numpy as np
    compute = of(policy.compute_dtype)
    H, Hkv, D, S = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, KEY_BLOCK + Q_BLOCK
    q, k, v = (np.asarray(rng.standard_normal((pool, S, h, D)), np.float32) for h in (H, Hkv, Hkv))
    lens = rng.integers(1, S + 1, pool)
    slots = np.arange(S)
    allowed = (slots[None, None, :] <= slots[None, :, None]) & (slots[None, None, :] < lens[:, None, None])
    fn = jit(lambda q, k, v, a: attention(q.astype(compute), k.astype(compute), v.astype(compute), a, policy))

    def rows(idx):
        idx = np.asarray(idx)
        width = -(-int(lens[idx].max()) // Q_BLOCK) * Q_BLOCK
        out = np.asarray(fn(q[idx, :width], k[idx, :width], v[idx, :width], allowed[idx, :width, :width])
                         .astype(jnp.float32))
        full = np.zeros((len(idx), S, H, D), np.float32)
        full[:, :width] = out
        return np.where(slots[None, :, None, None] < lens[idx][:, None, None, None], full, 0)
    return rows


_CHECKED: set = set()
