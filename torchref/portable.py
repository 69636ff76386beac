"""The invariant backend's portable path: invariant.py's ops under the same names and signatures,
with no kernel of its own, so it runs wherever torch runs (a GPU included). plan.py picks it
(llamaspec.plan.INVARIANT_ENV) and builds its namespace with the device's row count (`Portable`);
jaxmodel/portable.py mirrors this file function by function.

- Products at one fixed shape: x's rows (every token of every sequence) are cut into chunks of
  `rows` rows, the last zero-padded, and each chunk, a fresh contiguous buffer, is multiplied by
  the weight in a call of its own of the same shape [rows, K] x [K, N]. A library picks kernel,
  tiling, split-K and threads from the shape, so every chunk gets one program, and a GEMM sums
  each output over K in an order that does not depend on the output's row within its tile:
  self_check verifies that second half on the model's device.
- Every other sum written out: llamaspec.portable.tree_sum's halving tree for RMSNorm's sum of
  squares, the softmax denominators, q.k over the head dim and p.v over a key block (elementwise
  products, no library dot or reduce); block results added in order (in_order).
- exp by llamaspec.portable.exp's program (elementwise +, -, *, rint and power-of-two scalings
  built from bits); 1/sqrt for rsqrt; RoPE tables from invariant.py's fixed-shape chunks.

What stays in torch is elementwise (IEEE 754 rounds each result on its own), max, casts, gathers
and masks, and the fixed-shape products.
"""

from __future__ import annotations

import numpy as np
import torch

from llamaspec import Policy
from llamaspec import portable as spec
from llamaspec.selfcheck import check_rows

from . import fast, ops
from .dtypes import cast, dt
from .fast import times_in_place as times  # noqa: F401 (the same bits as ops.times)
from .ops import apply_rope, cache_dtype, kv_round, rope_inv_freq, rotate_half, write_cache  # noqa: F401 (as is)

LAYOUT_MULTIPLE = 4  # canonical widths are multiples of this (fewer shapes; order-free); both implementations
KEY_BLOCK = 64       # keys per attention block: both implementations
ROPE_CHUNK = 4096    # RoPE tables are computed for this many positions at a time


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.rope_cos_sin gathered from tables of ROPE_CHUNK positions (one fixed shape, so an
    entry's cos and sin never depend on which positions the batch holds)."""
    chunks = int(positions.max()) // ROPE_CHUNK + 1 if positions.numel() else 1
    key = (inv_freq.to(torch.float64).cpu().numpy().tobytes(), dtype)
    tables = [_rope_table(key, c, inv_freq) for c in range(chunks)]
    cos, sin = torch.cat([t[0] for t in tables]), torch.cat([t[1] for t in tables])
    flat = positions.reshape(-1).cpu()
    shape = (*positions.shape, cos.shape[-1])
    return cos[flat].reshape(shape).to(positions.device), sin[flat].reshape(shape).to(positions.device)


def _rope_table(key, chunk: int, inv_freq: torch.Tensor):
    """cos, sin for positions [chunk * ROPE_CHUNK, (chunk + 1) * ROPE_CHUNK), computed once per
    key (the inverse frequencies' values and the dtype: a new tensor of the same values, as
    every call makes, finds the table)."""
    if (key, chunk) not in _ROPE_TABLES:
        positions = torch.arange(chunk * ROPE_CHUNK, (chunk + 1) * ROPE_CHUNK)[None]
        cos, sin = ops.rope_cos_sin(inv_freq.cpu(), positions, key[1])
        _ROPE_TABLES[(key, chunk)] = cos[0], sin[0]
    return _ROPE_TABLES[(key, chunk)]


_ROPE_TABLES: dict = {}  # ((inv_freq bytes, dtype), chunk) -> (cos, sin)


def in_order(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` one block after the other: a fixed order, and trailing blocks that
    hold only zeros leave the sum unchanged, whatever their number."""
    acc = parts.select(dim, 0)
    for i in range(1, parts.shape[dim]):
        acc = acc + parts.select(dim, i)
    return acc



_HALF = (torch.bfloat16, torch.float16)
# Elements of one elementwise product tensor in attention (the q.k and p.v trees work through
# their operands in pieces of about this size: 2 MB in f32, within a CPU's caches).
PIECE = 1 << 19
EXP_PIECE = 1 << 17   # elements of one piece of exp's program on a CPU (its ~40 passes in cache)


def _acc(policy: Policy) -> torch.dtype:
    """The accumulator of every sum: f64 for an f64 accumulation, else f32."""
    return torch.float64 if dt(policy.accum_dtype) == torch.float64 else torch.float32


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Where a 16-bit value is summed or exponentiated: f32 (f32 and f64 stay as they are)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


# ----- llamaspec.portable's element programs in torch --------------------------------------

def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The sum over `dim` as a halving tree, zero-padded to a power of two (llamaspec.portable's)."""
    n = x.shape[dim]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        pad = list(x.shape)
        pad[dim] = width - n
        x = torch.cat([x, x.new_zeros(pad)], dim)
    while x.shape[dim] > 1:
        h = x.shape[dim] // 2
        x = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
    return x.squeeze(dim)


def tree_dot(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """tree_sum(a * b, dim) (a and b broadcast): the first level from the halves' products, so
    the full product is never held (the same values: each level adds the same pairs)."""
    n = a.shape[dim]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:     # zero-padded operands: their products are the +0 tree_sum pads with
        a, b = (torch.cat([t, t.new_zeros([width - n if i == dim % t.dim() else s
                                            for i, s in enumerate(t.shape)])], dim) for t in (a, b))
    if width == 1:
        return (a * b).squeeze(dim)
    h = width // 2
    return tree_sum(a.narrow(dim, 0, h) * b.narrow(dim, 0, h) + a.narrow(dim, h, h) * b.narrow(dim, h, h), dim)


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp by llamaspec.portable.exp's program, one elementwise op at a time (no op fused into an
    fma); 16-bit inputs are taken in f32 and rounded once (as torch's 16-bit exp does). On a CPU
    a large tensor goes through in pieces that stay in its caches (elementwise: the same bits)."""
    w = x.to(_wide(x.dtype)).contiguous()
    if w.device.type != "cpu" or w.numel() <= EXP_PIECE:
        return _exp(w).to(x.dtype)
    flat, out = w.view(-1), torch.empty(w.shape, dtype=x.dtype)
    for i in range(0, flat.numel(), EXP_PIECE):
        out.view(-1)[i:i + EXP_PIECE] = _exp(flat[i:i + EXP_PIECE])
    return out


def _exp(w: torch.Tensor) -> torch.Tensor:
    """The program on f32 or f64 values."""
    f32 = w.dtype == torch.float32
    hi, lo = (spec.LN2_HI_F32, spec.LN2_LO_F32) if f32 else (spec.LN2_HI_F64, spec.LN2_LO_F64)
    n = torch.round(w * spec.LOG2E)              # half to even, as numpy's rint
    r = w - n * hi
    r = r - n * lo
    key = np.dtype(np.float32 if f32 else np.float64)
    coef = spec.taylor(key)
    p = torch.full_like(w, coef[0])
    for c in coef[1:]:
        p = p.mul_(r).add_(c)
    # n's finite integers (the masks below replace the rest), in an int of the float's width
    e = torch.nan_to_num(n.clamp(-2000, 2000)).to(torch.int32 if f32 else torch.int64)
    e1 = e >> 1
    y = p.mul_(_pow2(e1, f32)).mul_(_pow2(e - e1, f32))
    y = torch.where(w < spec.EXP_MIN[key], 0.0, y)
    y = torch.where(w > spec.EXP_MAX[key], torch.inf, y)
    return torch.where(torch.isnan(w), w, y)


def _pow2(e: torch.Tensor, f32: bool) -> torch.Tensor:
    """2.0**e as the bits (e + bias) << mantissa bits (e within the normal range where used)."""
    if f32:
        return ((e.clamp(-126, 127) + 127) << 23).view(torch.float32)
    return ((e.clamp(-1022, 1023) + 1023) << 52).view(torch.float64)


# ----- products at one fixed shape ---------------------------------------------------------

class Portable:
    """The portable path's op namespace: the module's functions, linear / linears with products
    in calls of `rows` rows, and attention in pieces of `piece` elements (None: PIECE), as plan.py
    chose for the device. native_half: 16-bit operands multiplied as they are with f32 sums and
    an f32 result (CUDA); otherwise widened to f32."""

    LAYOUT_MULTIPLE, KEY_BLOCK, ROPE_CHUNK = LAYOUT_MULTIPLE, KEY_BLOCK, ROPE_CHUNK

    def __init__(self, rows: int, native_half: bool = False, piece: int | None = None):
        if rows < 1:
            raise ValueError(f"portable products: rows={rows}, expected at least 1")
        self.rows, self.native_half, self.piece = rows, native_half, piece

    def __getattr__(self, name):
        if name.startswith("_") or name not in _OPS:
            raise AttributeError(f"the portable invariant namespace has no {name!r}")
        return _OPS[name]

    def __repr__(self) -> str:
        return f"Portable(rows={self.rows}, native_half={self.native_half}, piece={self.piece})"

    def attention(self, q, k, v, allowed, policy: Policy) -> torch.Tensor:
        """ops.attention (the module's attention, in pieces of this namespace's size)."""
        return attention(q, k, v, allowed, policy, self.piece)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, policy: Policy,
               out_dtype: str | None = None) -> torch.Tensor:
        """ops.linear: operands rounded to compute_dtype, products summed in the accumulator in
        fixed-shape calls, bias added, rounded once to out_dtype."""
        return self.linears(x, (w,), (b,), policy, out_dtype)[0]

    def linears(self, x: torch.Tensor, ws, bs, policy: Policy, out_dtype: str | None = None) -> list[torch.Tensor]:
        """ops.linears as one product against the weights stacked, split into one result per
        weight."""
        if any(b is not None for b in bs) and not all(b is not None for b in bs):
            return [self.linears(x, (w,), (b,), policy, out_dtype)[0] for w, b in zip(ws, bs)]
        compute, acc = dt(policy.compute_dtype), _acc(policy)
        half = self.native_half and compute in _HALF and dt(policy.accum_dtype) == torch.float32
        operand = compute if half else (acc if torch.finfo(acc).bits > torch.finfo(compute).bits else compute)
        if len(ws) == 1 and ws[0].dtype == compute == operand:
            w = ws[0].detach()
        else:   # the weights stacked (and rounded, widened) once, kept while they live
            w = fast.kept(tuple(ws), ("portable", compute, operand),
                          lambda: torch.cat([cast(cast(w.detach(), compute), operand) for w in ws]))
        rows = cast(cast(x.reshape(-1, x.shape[-1]), compute), operand)
        y = self.product(rows, w, half)
        if bs[0] is not None:
            y = y + torch.cat([cast(cast(b, compute), y.dtype) for b in bs])
        y = cast(y, dt(out_dtype or policy.compute_dtype)).reshape(*x.shape[:-1], w.shape[0])
        return list(y.split([w.shape[0] for w in ws], dim=-1)) if len(ws) > 1 else [y]

    def product(self, x: torch.Tensor, w: torch.Tensor, half: bool = False) -> torch.Tensor:
        """x [M, K] @ w[N, K]^T in calls of `rows` rows each (the last chunk zero-padded, each
        chunk a fresh buffer: one shape and one alignment); half: an f32 result of 16-bit operands."""
        R, (M, K) = self.rows, x.shape
        chunks = max(1, -(-M // R))
        padded = x.new_zeros((chunks * R, K))
        padded[:M] = x
        wt = w.t()
        outs = [torch.mm(padded[i * R:(i + 1) * R].clone(), wt, **({"out_dtype": torch.float32} if half else {}))
                for i in range(chunks)]
        return (outs[0] if chunks == 1 else torch.cat(outs))[:M]


# ----- the ops -----------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, policy: Policy) -> torch.Tensor:
    """ops.rms_norm with mean(x^2) as a halving-tree sum of squares over the hidden size (in f32
    for a 16-bit norm dtype, rounded once) and 1/sqrt(var) in place of rsqrt."""
    norm = dt(policy.norm_dtype)
    h = x.to(norm)
    wide = h.to(_wide(norm))
    var = (tree_sum(wide * wide) / x.shape[-1]).to(norm)[..., None] + eps
    return ops.norm_weight(h * (1 / torch.sqrt(var)), x, weight, policy)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)) with the portable exp (16-bit: in f32, rounded once)."""
    h = x.to(_wide(x.dtype))
    return (h / (1 + exp(-h))).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              policy: Policy, piece: int | None = None) -> torch.Tensor:
    """ops.attention, computed per KEY_BLOCK block of keys in a fixed order (invariant.attention's
    steps and roundings, its products written out).

    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; allowed [B, T, S]. S is padded to a multiple of
    KEY_BLOCK (with masked zero keys). A score is the halving tree over D of q * k in the
    accumulator, rounded to compute_dtype and scaled; the softmax takes the max over every block
    (exact in any order), the portable exp, per-block tree sums (in f32 for 16-bit softmax
    dtypes, rounded once) added block after block; a block's P@V partial is the tree over its
    keys of p * v in the accumulator plus +0 (so no partial is -0); partials added in order,
    rounded once to compute_dtype. A block no query of a stretch of positions may see (in any
    row) is not computed there: its scores are masked and its partials +0 either way, and +0
    added to a sum that is not -0 leaves it unchanged. piece: elements per product (None: PIECE).
    """
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G, Kb = Hq // Hkv, KEY_BLOCK
    compute, soft, acc = dt(policy.compute_dtype), dt(policy.softmax_dtype), _acc(policy)
    pad = -S % Kb
    if pad:
        k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad))
        allowed = torch.nn.functional.pad(allowed, (0, pad))
    nk, M, P = (S + pad) // Kb, T * G, B * Hkv
    # queries [P, D, M] (m = t * G + g: a slice of m is a stretch of positions), keys [P, nk, D, Kb],
    # values [P, nk, Kb, D]
    qg = q.to(compute).reshape(B, T, Hkv, G, D).permute(0, 2, 4, 1, 3).reshape(P, D, M).to(acc)
    kb = k.to(compute).reshape(B, nk, Kb, Hkv, D).permute(0, 3, 1, 4, 2).reshape(P, nk, D, Kb).to(acc)
    pieces = _pieces(allowed.bool(), G, P * D * Kb // 2, piece or PIECE)
    scores = q.new_zeros((P, nk, M, Kb), dtype=acc)
    for m, b in pieces:
        scores[:, b, m] = tree_dot(qg[:, None, :, m, None], kb[:, b, :, None, :], 2)
    scores = scores.to(compute) * (D ** -0.5)
    scores = scores.view(B, Hkv, nk, T, G, Kb).to(soft)
    keep = allowed.view(B, T, nk, Kb).permute(0, 2, 1, 3)[:, None, :, :, None]
    scores = scores.masked_fill(~keep, torch.finfo(soft).min)
    e = exp(scores - scores.amax(dim=(2, 5), keepdim=True))
    denom = in_order(tree_sum(e.to(_wide(soft)))[..., None], 2).to(soft)     # [B, Hkv, T, G, 1]
    probs = (e / denom[:, :, None]).to(compute).view(P, nk, M, Kb).transpose(2, 3).to(acc).contiguous()
    vb = v.to(compute).reshape(B, nk, Kb, Hkv, D).permute(0, 3, 1, 2, 4).reshape(P, nk, Kb, D).to(acc)
    parts = q.new_zeros((P, nk, M, D), dtype=acc)
    for m, b in pieces:
        parts[:, b, m] = tree_dot(probs[:, b, :, m, None], vb[:, b, :, None, :], 2) + 0.0
    ctx = in_order(parts.view(B, Hkv, nk, M, D), 2).to(compute)             # [B, Hkv, M, D]
    return ctx.view(B, Hkv, T, G, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)


def _pieces(allowed: torch.Tensor, G: int, unit: int, piece: int) -> list[tuple[slice, slice]]:
    """(query slice, block slice) pairs covering every key block that some row allows to some
    query of a stretch of positions, each product about `piece` elements (unit: one query's
    elements per block). Which pieces there are never changes an element's result."""
    B, T, S = allowed.shape
    nk = S // KEY_BLOCK
    per_t = unit * G
    span = max(1, min(T, piece // per_t))                   # positions per piece
    group = max(1, piece // (per_t * span))                 # blocks per piece
    n = -(-T // span)
    seen = allowed.view(B, T, nk, KEY_BLOCK).any(3).any(0)  # [T, nk]
    seen = torch.cat([seen, seen.new_zeros((n * span - T, nk))]).view(n, span, nk).any(1).tolist()
    out = []
    for i, row in enumerate(seen):
        m = slice(i * span * G, min(T, (i + 1) * span) * G)
        b = 0
        while b < nk:
            end = b
            while end < nk and row[end] and end - b < group:
                end += 1
            if end > b:
                out.append((m, slice(b, end)))
            b = max(end, b + 1)
    return out


# ----- the self-check -------------------------------------------------------------------

def self_check(module) -> None:
    """Verifies on the model's device, once per process, configuration, policy, device and
    namespace, that every op the invariant model runs gives a row the same bits alone and inside
    batches of several sizes (llamaspec.selfcheck.check_rows); raises InvarianceError naming the
    op otherwise. The network's (a model.Llama) own weights for the linears, random rows for the
    rest, all on its device."""
    key = (module.cfg, module.policy.name, module.policy, str(module.device), repr(module.ops))
    if key in _CHECKED:
        return
    cfg, policy, device, ops_ = module.cfg, module.policy, module.device, module.ops
    compute = dt(policy.compute_dtype)
    gen = torch.Generator().manual_seed(0)

    # Values spread over 2^-8..2^8: with bf16 operands of similar size every order sums
    # exactly, and an order that changed with the batch would go unseen.
    def rand(*shape):
        scale = torch.exp2(torch.randint(-8, 9, shape, generator=gen).float())
        return (torch.randn(*shape, generator=gen) * scale).to(compute).to(device)
    pool = 24
    layer = module.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    x_d, x_f, x_o = rand(pool, 1, d), rand(pool, 1, f), rand(pool, 1, cfg.num_attention_heads * hd)
    with torch.inference_mode():
        def rows_of(fn, x):
            return lambda idx: fn(x[torch.as_tensor(idx, device=device)]).float().cpu().numpy()
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        checks = {
            "linear q/k/v": rows_of(lambda x: torch.cat(ops_.linears(
                x, [m.weight for m in qkv], [m.bias for m in qkv], policy), -1), x_d),
            "linear o_proj": rows_of(lambda x: attn.o_proj(x, policy), x_o),
            "linear gate/up": rows_of(lambda x: torch.cat(ops_.linears(
                x, [mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias],
                policy), -1), x_d),
            "linear down_proj": rows_of(lambda x: mlp.down_proj(x, policy), x_f),
            "lm_head": rows_of(lambda x: ops_.linear(x, module.head_weight(), None, policy,
                                                     policy.logits_dtype), x_d),
            "rms_norm": rows_of(lambda x: layer.input_layernorm(x, policy), x_d),
            "silu": rows_of(ops_.silu, x_f),
            "attention": _attention_rows(module, gen),
        }
        check_rows(checks, pool)
    _CHECKED.add(key)


def _attention_rows(model, gen):
    """Rows for the attention check: sequences of random lengths (one to two key blocks), each
    row's keys at slots [0, n) as the canonical layout puts them."""
    cfg, policy, device, ops_ = model.cfg, model.policy, model.device, model.ops
    compute = dt(policy.compute_dtype)
    H, Hkv, D, S = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, ops_.KEY_BLOCK + 16
    pool = 24
    q, k, v = (torch.randn(pool, S, h, D, generator=gen).to(compute).to(device) for h in (H, Hkv, Hkv))
    lens = torch.randint(1, S + 1, (pool,), generator=gen)
    slots = torch.arange(S)
    allowed = ((slots[None, None, :] <= slots[None, :, None]) & (slots[None, None, :] < lens[:, None, None])).to(device)

    def rows(idx):
        i = torch.as_tensor(idx)
        width = -(-int(lens[i].max()) // ops_.LAYOUT_MULTIPLE) * ops_.LAYOUT_MULTIPLE   # as the model's layout
        j = i.to(device)
        out = ops_.attention(q[j, :width], k[j, :width], v[j, :width], allowed[j, :width, :width], policy).cpu()
        full = torch.zeros((len(idx), S, H, D), dtype=out.dtype)
        full[:, :width] = out
        real = slots[None, :, None, None] < lens[i][:, None, None, None]
        return torch.where(real, full, torch.zeros((), dtype=full.dtype)).float().numpy()   # real queries only
    return rows


_CHECKED: set = set()

# what a Portable namespace serves besides linear / linears: the ops and the self-check
_OPS = {name: globals()[name] for name in (
    "rms_norm", "silu", "rope_cos_sin", "rope_inv_freq", "apply_rope", "rotate_half",
    "kv_round", "write_cache", "cache_dtype", "times", "self_check")}
