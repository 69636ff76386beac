"""Flax NNX Llama: thin modules over jaxmodel.ops, HF weight layout, explicit KV cache.

Modules hold weights as nnx.Param in Hugging Face shapes ([out, in], never
transposed) under Hugging Face names, so a checkpoint key maps to one attribute path
(model.layers.3.self_attn.q_proj.weight -> layers[3].self_attn.q_proj.weight).
torchref/model.py is the same file in PyTorch: same classes, arguments and tap names.

`Llama` is the network and `LlamaModel` the loaded model (forward, capture, prefill/decode,
generate), as in torchref; nnx modules are built from the weights, torch's shape-first.
LlamaModel splits the network once into a static graphdef and a state of arrays and
jit-compiles pure functions of (state, inputs): nnx.jit would walk the module graph on
every decode step, and passing the state as an argument keeps the weights inputs of the
compiled program, never constants in it.

The KV cache is a plain dict passed in and returned, with torchref's keys: k, v [L, B, S,
Hkv, D] in the backend's kv_dtype (compute_dtype; fast keeps a 16-bit policy's widened to
f32 on the CPU: the same values; per-layer policies: the type their compute dtypes promote to,
each layer's values held exactly), mask [B, S] (slots holding a real token), next_pos [B] (next
position per row) and index (the slot the next token is written to). With dynamic NTK
RoPE past max_position_embeddings, cached keys keep the rotation they were written with,
as in transformers. Keys and values are rounded as the policy's kv_cache says (ops.kv_round)
in every call, before the cache write.

Policy knobs (llamaspec/policy.py): each block is built and run by its layer's policy
(policy.for_layer; blocks of different policies run one after the other, not under one scan);
a block projection under weight_fp8 keeps its weight dequantized in the fp8 product dtype and
its fp8 values and scales beside it (LlamaModel.quantized(), from_weights(..., quantized=) for
the float64 twin); weight_fp8 / act_fp8 projections run ops.fp8_linear. The fast and invariant
backends decline these knobs (plan.declines): such a model runs on the reference ops.

Llama's relatives (llamaspec.config's families: Qwen2/3, Mistral, Gemma 2/3, OLMo 2) are features
of the same modules, as in torchref: a block's norms by role (cfg.norm_modules; checkpoint keys
unchanged), q/k norms, o_proj's own bias, the activation by op name, the embedding scale, soft-caps,
each layer's RoPE (cfg.rope_of) and sliding window (a mask: sliding_allowed); the policy's norm
convention is the family's where the policy leaves it open (Policy.for_family, at load). The plan
runs the ops a feature changes on the reference (plan.WithReference) and says so.

Every module computes with `self.ops`, the backend's op namespace (ops.py: the reference;
fast.Fast; invariant.py or portable.Portable), chosen once by the plan (plan.py; model.plan) and the seam a
planted-bug control replaces on one layer. Matrices are held as the backend's `prepare` makes
them at load (ops.py: the array itself), so its copies are jit state, never made per call.
The invariant backend (batch_invariant=True; docs/invariance.md) runs every call in the
canonical layout of llamaspec.inputs.layout. Its cache has lens [B] in place of mask/next_pos/index: row b's
tokens fill slots [0, lens[b]) and a decode step writes each row at its own lens[b].
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from llamaspec import LlamaConfig, Policy, Sampling, check_tokens, generate, load_weights, positions_from_mask
from llamaspec import taps as tapnames
from llamaspec.checkpoint import is_projection, layer_of_key
from llamaspec.errors import PolicyError
from llamaspec.forward import KV, Context, Recorder
from llamaspec.inputs import Layout, bucket_length, check_inject, check_next_ids, check_prefill, front_padded, layout
from llamaspec.plan import Plan, backend_name

from . import plan as plans
from . import quant
from .dtypes import compiler_options, numpy_dtype, of, opmath
from .ops import fp8_product_dtype
from .sharding import MeshLayout, add_in_order, layout_for, row_parallel, to_host

LAST_SLOT_TAPS = ("logits",)   # prefill computes the lm_head at each row's last slot only
CACHE_BLOCK = 64  # cache length is rounded up to this, so prompts of similar length share a compile
# Shape buckets: outside batch-invariant mode a prefill's prompt is front-padded to
# llamaspec.inputs.bucket_length, so prompt lengths in one bucket share one compiled prefill
# (and its persistent compilation cache entry) and, through the cache length, one decode step;
# padding slots are masked and positions come from the mask, so the function is the same
# (front_padded), its rounding the bucket's. capture / __call__ run at the caller's length
# (the streamed ladder walks the same shapes layer by layer, bit for bit). LlamaModel.buckets
# = False runs prefill at the prompt's own length too.


class OnMesh(NamedTuple):
    """Checkpoint tensors and the layout they are placed with (sharding.py), in place of the
    plain dict the modules are built from when the model runs on a mesh."""
    tensors: dict
    layout: MeshLayout


def _param(weights, key, dtype):
    """A checkpoint tensor rounded to param_dtype on the host (numpy/ml_dtypes round to
    nearest even, the same on every platform); on a mesh, placed shard by shard."""
    if isinstance(weights, OnMesh):
        return weights.layout.weight(key, weights.tensors[key], dtype)
    return _as_param(weights[key], dtype)


def _layout_of(weights) -> MeshLayout | None:
    return weights.layout if isinstance(weights, OnMesh) else None


def shard(layout: MeshLayout | None, x, *logical):
    """x constrained to its logical axes' layout on the mesh; x itself without a mesh."""
    return x if layout is None else layout.shard(x, *logical)


def _as_param(w, dtype):
    """w in dtype as a jax array. Narrowing rounds on the host (see _param); widening is
    exact anywhere, so it happens on the device, without a wide host copy next to the
    device one (a float64 layer of an 8B model is 1.75 GB)."""
    if w.dtype == dtype:
        return jnp.asarray(w)
    if np.dtype(dtype).itemsize > w.dtype.itemsize and np.issubdtype(dtype, np.floating):
        return jnp.asarray(w).astype(dtype)
    return jnp.asarray(w.astype(dtype))


class Fp8(nnx.Variable):
    """A quantized weight's fp8 values or its scales (weight_fp8), kept for quantized() and the
    float64 twin; the products read the dequantized weight (Linear.weight)."""


def _fp8_weight(weights, key, dtype, policy: Policy, given=None):
    """(the weight kept in the fp8 product dtype, (q, scales)) of block projection `key` under the
    policy's weight_fp8: the checkpoint tensor rounded to param_dtype and quantized (given: its
    (q, scales) as quantized() returns them, installed as they are), then dequantized."""
    spec, w = policy.weight_fp8, weights[key]
    if given is None:
        q, scales = quant.quantize(_as_param(w, dtype), spec)
    else:
        q, scales = (jnp.asarray(t) for t in given)
        if tuple(q.shape) != tuple(w.shape):
            raise ValueError(f"{key}: quantized shape {tuple(q.shape)} != the checkpoint's {tuple(w.shape)}")
    return quant.dequantize(q, scales, spec, fp8_product_dtype(policy)), (q, scales)


class Linear(nnx.Module):
    """x @ weight.T (+ bias). weight: the matrix as the backend's `prepare` holds it (ops.py: the
    array); a block projection under weight_fp8: the dequantized weight in the fp8 product dtype,
    its fp8 values and scales beside it (fp8_q, fp8_scales; quantized: {key: (q, scales)} to
    install instead of quantizing here). split_in: the logical axis its input columns are split
    over on a mesh ("heads" for o_proj, "mlp" for down_proj; None: its output rows, or nothing, are)."""

    def __init__(self, weights, key, dtype, bias: bool, ops, policy: Policy, split_in: str | None = None,
                 quantized: dict | None = None):
        layout = _layout_of(weights)
        if policy.weight_fp8 and is_projection(key + ".weight"):
            given = (quantized or {}).get(key + ".weight")
            w, (q, scales) = _fp8_weight(weights, key + ".weight", dtype, policy, given)
            self.weight = nnx.Param(w)
            self.fp8_q, self.fp8_scales = Fp8(q), Fp8(scales)
        else:
            self.weight = nnx.Param(ops.prepare(_param(weights, key + ".weight", dtype), policy, layout))
        self.bias = nnx.Param(_param(weights, key + ".bias", dtype)) if bias else None
        self.ops = ops
        # partial sums that cross tensor shards, added in shard order (sharding.row_parallel)
        self.row_parallel = split_in if layout is not None and layout.tensor > 1 and ops.ROW_PARALLEL else None
        self.layout = layout

    def __call__(self, x, policy: Policy, out_dtype=None):
        w = self.weight.get_value()
        b = None if self.bias is None else self.bias[...]
        if policy.weight_fp8 or policy.act_fp8:    # a block projection of a quantizing layer
            return self.ops.fp8_linear(x, w, b, policy)
        if self.row_parallel:
            return row_parallel(self.layout, x, w, b, policy, self.row_parallel, self.reduce, out_dtype,
                                self.ops.linear_sums)
        return self.ops.linear(x, w, b, policy, out_dtype)

    def reduce(self, parts):
        """A seam: the tensor shards' partial sums [n, ...] -> their sum, in shard order (a
        planted-bug control may replace it on one layer: compare/controls)."""
        return add_in_order(parts)


class Embedding(nnx.Module):
    """The token table. ops: when it is also the lm_head (tied), the backend whose `prepare`
    holds it as the lm_head's matrix (indexing reads the table's values); else None."""

    def __init__(self, weights, key, dtype, ops=None, policy: Policy | None = None):
        w = _param(weights, key + ".weight", dtype)
        self.weight = nnx.Param(w if ops is None else ops.prepare(w, policy, _layout_of(weights)))

    def __call__(self, ids):
        return self.weight[...][ids]


class RMSNorm(nnx.Module):
    def __init__(self, weights, key, dtype, eps: float, ops, offset: float = 0.0):
        self.weight = nnx.Param(_param(weights, key + ".weight", dtype))
        self.eps = eps
        self.ops = ops
        # Gemma's norms multiply by (1 + weight): an argument only where set (the plan runs such a
        # model's norms on the reference, llamaspec.plan.family_declines). Keyword pairs, not a
        # dict: a graphdef's static attributes are hashed
        self.family = (("offset", offset),) if offset else ()

    def __call__(self, x, policy: Policy):
        return self.ops.rms_norm(x, self.weight[...], self.eps, policy, **dict(self.family))


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, weights, prefix, dtype, ops, policy: Policy, quantized: dict | None = None):
        b = cfg.attention_bias
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            Linear(weights, prefix + name, dtype, bias, ops, policy, split, quantized)
            for name, bias, split in (("q_proj", b, None), ("k_proj", b, None), ("v_proj", b, None),
                                      ("o_proj", cfg.o_bias, "heads")))
        self.layout = _layout_of(weights)
        repeat = 1 if self.layout is None else self.layout.kv_repeat
        # kv_heads as stored: on a mesh with fewer KV heads than shards each is kept `repeat` times
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.kv_heads = cfg.num_key_value_heads * repeat
        # q/k norm (Qwen3, Gemma 3: over head_dim, per head; OLMo 2: over the whole projection)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm, self.k_norm = (RMSNorm(weights, prefix + name, dtype, cfg.rms_norm_eps, ops, cfg.norm_offset)
                                        for name in ("q_norm", "k_norm"))
        # Gemma's scale and soft-cap: arguments only where set (the plan runs such a model's
        # attention on the reference); keyword pairs, as RMSNorm's
        self.family = tuple((k, v) for k, v in (("scale", cfg.query_scale), ("softcap", cfg.attn_softcap))
                            if v is not None)
        self.ops = ops

    def __call__(self, x, ctx: Context, rec: Recorder, cache: KV | None = None, layer=0):
        """cache: None (keys are this call's tokens), or this call's keys and values go to
        slots index[b] + t of row b in layer `layer`, and attention reads the cache."""
        B, T, _ = x.shape
        lay = self.layout
        # a Linear each (torchref: one ops.linears call)
        q = rec("q", shard(lay, self.q_proj(x, ctx.policy).reshape(B, T, self.heads, self.head_dim),
                           "batch", None, "heads", None))
        k = self.kv_tap(rec, "k", shard(lay, self.k_proj(x, ctx.policy).reshape(B, T, self.kv_heads, self.head_dim),
                                        "batch", None, "kv_heads", None))
        v = self.kv_tap(rec, "v", shard(lay, self.v_proj(x, ctx.policy).reshape(B, T, self.kv_heads, self.head_dim),
                                        "batch", None, "kv_heads", None))
        if self.qk_norm == "head":
            q = rec("q_norm", self.q_norm(q, ctx.policy))
            k = self.kv_tap(rec, "k_norm", self.k_norm(k, ctx.policy))
        elif self.qk_norm == "projection":
            q = rec("q_norm", self.q_norm(q.reshape(B, T, -1), ctx.policy).reshape(q.shape))
            k = self.kv_tap(rec, "k_norm", self.k_norm(k.reshape(B, T, -1), ctx.policy).reshape(k.shape))
        q = rec("q_rope", self.ops.apply_rope(q, ctx.cos, ctx.sin))
        k = self.kv_tap(rec, "k_rope", self.ops.apply_rope(k, *self.key_tables(ctx, cache)))
        # keys and values as the policy's kv_cache keeps them, in every call (the taps show them
        # as computed, before this rounding)
        k, v = self.ops.kv_round(k, ctx.policy), self.ops.kv_round(v, ctx.policy)
        allowed = ctx.allowed
        if cache is not None:
            # one [L, B, S, Hkv, D] array, updated functionally in the donated buffer: attention's
            # own key layout (torchref: a [B, Hkv, S, D] tensor per layer, read as strided views)
            new_k, new_v = self.stored(k).astype(cache.k.dtype), self.stored(v).astype(cache.v.dtype)
            slots = self.write_slots(cache.index, T, cache.k.shape[2])
            cache = cache._replace(k=self.ops.write_cache(cache.k, layer, new_k, slots),
                                   v=self.ops.write_cache(cache.v, layer, new_v, slots))
            allowed = self.cache_allowed(ctx.allowed, cache.index)
            # the cache is in the type the layers' kv_dtypes promote to (_empty_cache): this layer's
            # values read back exactly
            kv = self.ops.kv_dtype(ctx.policy)
            k, v = cache.k[layer].astype(kv), cache.v[layer].astype(kv)
        out = self.ops.attention(q, k, v, allowed, ctx.policy, **dict(self.family))
        out = shard(lay, out, "batch", None, "heads", None)
        out = rec("attn_ctx", out.reshape(B, T, -1))
        return self.o_proj(out, ctx.policy), cache

    def kv_tap(self, rec: Recorder, name: str, x):
        """rec(name, x) for keys and values [B, T, Hkv, D]: each KV head once in the tap when the
        mesh layout keeps copies of them (sharding.py); x as it is for the computation."""
        if self.layout is None or self.layout.kv_repeat == 1:
            return rec(name, x)
        rec(name, self.layout.unrepeat(x, 2))
        return x

    # Seams: one step each of the cache path, which a planted-bug control may replace on one
    # layer (compare/controls); torchref's Attention has the same four.
    def key_tables(self, ctx: Context, cache: KV | None):
        """The cos, sin tables this call's keys are rotated with: the call's own."""
        return ctx.cos, ctx.sin

    def write_slots(self, index, T: int, S: int):
        """The cache slots [B, T] of this call's keys in a cache of S slots: index[b] + t (numpy
        where index is: a fresh cache's, known while tracing)."""
        return index[:, None] + np.arange(T)

    def stored(self, x):
        """A key or value as the cache keeps it: as computed (the cache is in compute_dtype)."""
        return x

    def cache_allowed(self, allowed, index):
        """The mask [B, T, S] over the cache this call attends with: the call's own."""
        return allowed


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, weights, prefix, dtype, ops, policy: Policy, quantized: dict | None = None):
        self.gate_proj, self.up_proj, self.down_proj = (
            Linear(weights, prefix + name, dtype, cfg.mlp_bias, ops, policy, split, quantized)
            for name, split in (("gate_proj", None), ("up_proj", None), ("down_proj", "mlp")))
        self.activation = cfg.activation      # the name of an op: "silu" or "gelu_tanh" (Gemma)
        self.ops = ops
        self.layout = _layout_of(weights)

    def __call__(self, x, policy: Policy, rec: Recorder):
        # a Linear each (torchref: gate and up in one ops.linears call)
        columns = ("batch", None, "mlp")
        gate = rec("gate", shard(self.layout, self.gate_proj(x, policy), *columns))
        up = rec("up", shard(self.layout, self.up_proj(x, policy), *columns))
        act = rec("act", getattr(self.ops, self.activation)(gate) * up)
        return self.down_proj(act, policy)


class Block(nnx.Module):
    """One layer, built by its policy (policy.for_layer; dtype: its param_dtype), which it keeps as
    a static attribute: blocks of different policies differ in structure (Llama.same_blocks) and
    run one after the other. Called with the Context of that policy (Llama.contexts).

    Its norms sit where the family puts them (cfg.norm_modules: role -> checkpoint name):
    attn_norm / mlp_norm on a sublayer's input (Llama; Gemma), post_attn_norm / post_mlp_norm on
    its output before the residual add (Gemma's sandwich, OLMo 2 without the input ones)."""

    def __init__(self, cfg: LlamaConfig, weights, i, dtype, ops, policy: Policy, quantized: dict | None = None):
        p = f"model.layers.{i}."
        self.policy = policy
        self.roles = tuple(cfg.norm_modules.items())     # (role, checkpoint name) pairs: hashable
        for name in cfg.norm_modules.values():
            setattr(self, name, RMSNorm(weights, p + name, dtype, cfg.rms_norm_eps, ops, cfg.norm_offset))
        self.self_attn = Attention(cfg, weights, p + "self_attn.", dtype, ops, policy, quantized)
        self.mlp = MLP(cfg, weights, p + "mlp.", dtype, ops, policy, quantized)
        self.layout = _layout_of(weights)

    def norm(self, role: str, x, policy: Policy, rec: Recorder):
        """The norm of this role applied to x (recorded as its tap), or x where the family has none."""
        name = dict(self.roles).get(role)
        return x if name is None else rec(role, getattr(self, name)(x, policy))

    def __call__(self, h, ctx: Context, rec: Recorder, cache: KV | None = None, layer=0):
        residual, p = of(ctx.policy.residual_dtype), ctx.policy
        h = h.astype(residual)     # a per-layer policy's residual dtype (a no-op otherwise)
        a, cache = self.self_attn(self.norm("attn_norm", h, p, rec), ctx, rec, cache, layer)
        a = self.norm("post_attn_norm", rec("attn_out", a), p, rec)
        # the residual stream is whole on every tensor shard (o_proj's partial sums all-reduced)
        h = rec("resid_mid", shard(self.layout, h + a.astype(residual), "batch", None, None))
        m = self.mlp(self.norm("mlp_norm", h, p, rec), p, rec)
        m = self.norm("post_mlp_norm", rec("mlp_out", m), p, rec)
        h = rec("out", shard(self.layout, h + m.astype(residual), "batch", None, None))
        return h, cache


class Llama(nnx.Module):
    """The network. cfg and policy are static attributes (part of the graphdef); the
    state's paths are the checkpoint keys without the "model." prefix."""

    def __init__(self, cfg: LlamaConfig, policy: Policy, weights: dict[str, np.ndarray],
                 batch_invariant: bool = False, layout: MeshLayout | None = None, backend: str | None = None,
                 quantized: dict | None = None):
        backend = backend_name(backend, batch_invariant)
        policy = policy.for_family(cfg.norm_weight_in_norm_dtype)    # the family's norm convention where left to it
        n = cfg.num_hidden_layers
        policy.check_layers(n)
        # each block's policy (per-layer overrides); the embedding, final norm and lm_head follow the base
        self.layer_policies = tuple(policy.for_layer(i, n) for i in range(n))
        self.plan: Plan
        self.plan, self.ops = plans.load(policy, None, backend, layout, cfg)
        self.cfg, self.policy, self.batch_invariant = cfg, policy, backend == "invariant"
        self.layout = layout   # None: one device; else the mesh layout of sharding.py
        if layout is not None:
            _check_mesh_policy(policy)
            weights = OnMesh(weights, layout)
        quantized = quantized or {}
        stray = sorted(k for k in quantized if not (is_projection(k) and self.policy_of(k).weight_fp8))
        if stray:
            raise KeyError(f"quantized weights given for {stray}: not projections this policy quantizes "
                           f"({policy.name})")
        dt = numpy_dtype(policy.param_dtype)
        # a tied table is also the lm_head's matrix: held as the Linears hold theirs
        self.embed_tokens = Embedding(weights, "model.embed_tokens", dt, self.ops if cfg.tie_word_embeddings else None,
                                      policy)
        self.layers = nnx.List([Block(cfg, weights, i, numpy_dtype(p.param_dtype), self.ops, p, quantized)
                                for i, p in enumerate(self.layer_policies)])
        self.norm = RMSNorm(weights, "model.norm", dt, cfg.rms_norm_eps, self.ops, cfg.norm_offset)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(weights, "lm_head", dt, False, self.ops, policy)

    def policy_of(self, key: str) -> Policy:
        """The policy a checkpoint tensor is kept by: its layer's (per-layer overrides), else the base."""
        layer = layer_of_key(key)
        return self.policy if layer is None else self.layer_policies[layer]

    def contexts(self, positions, allowed) -> list[Context]:
        """Each layer's Context: its policy, the RoPE tables of its rope (cfg.rope_of) and its policy's
        rope_dtype (computed once per distinct pair; apply_rope rounds them to the queries' and keys'
        dtype), and its mask: `allowed`, within the layer's sliding window where it has one
        (sliding_allowed)."""
        tables, masks, out = {}, {}, []
        for i, p in enumerate(self.layer_policies):
            rope, window = self.cfg.rope_of(i), self.cfg.window(i)
            key = (rope, p.rope_dtype)
            if key not in tables:
                tables[key] = rope_tables(self.cfg, p, self.ops, positions, rope)
            if window not in masks:
                masks[window] = allowed if window is None else sliding_allowed(allowed, window)
            out.append(Context(*tables[key], masks[window], p, positions))
        return out

    def scan_contexts(self, ctxs: list[Context]):
        """The Context of layer i (a traced index) inside the layers' scan: the first layer's where
        every layer rotates by its RoPE and sees through its window (Llama), else the distinct
        contexts' tables and masks stacked (Gemma's sliding and global layers: two of them) and
        the layer's read by index, so that one scan, and one block program, still runs them all."""
        cfg = self.cfg
        keys = [(cfg.rope_of(i), cfg.window(i)) for i in range(cfg.num_hidden_layers)]
        distinct = list(dict.fromkeys(keys))
        if len(distinct) == 1:
            return lambda i: ctxs[0]
        which = jnp.asarray([distinct.index(k) for k in keys])
        first = [ctxs[keys.index(k)] for k in distinct]
        cos, sin, allowed = (jnp.stack([getattr(c, f) for c in first]) for f in ("cos", "sin", "allowed"))
        return lambda i: ctxs[0]._replace(cos=cos[which[i]], sin=sin[which[i]], allowed=allowed[which[i]])

    def embedding(self, rows):
        """The embedding tap from the table's rows (as the model holds them): embed_rows."""
        return embed_rows(self.cfg, self.policy, self.ops, rows)

    def head_weight(self):
        """The lm_head's matrix as the ops take it (the embedding table when tied)."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head).weight.get_value()

    def __call__(self, ids, positions, allowed, taps=(), cache: KV | None = None, last=None, inject=None,
                 scan=False, stacked=None):
        """Embedding -> blocks -> final norm -> lm_head; returns (logits, {tap: activation}, cache).

        ids, positions [B, T]; allowed [B, T, S]. last [B]: logits for slot last[b] of each
        row only. inject {i: h}: teacher forcing, layer i's input is replaced by h.
        scan: run the blocks under one lax.scan (no cache; see _scan_layers), over `stacked` (the
        blocks' states stacked on a layer axis, stack_layers) when given.
        """
        policy = self.policy
        residual = of(policy.residual_dtype)
        rec = Recorder(taps)
        h = rec("embed", shard(self.layout, self.embedding(self.embed_tokens(ids)), "batch", None, None))
        ctxs = self.contexts(positions, allowed)
        if scan:
            h, acts = self._scan_layers(h, ctxs, taps, inject, stacked)
            rec.acts.update(acts)
        else:
            for i, block in enumerate(self.layers):
                if inject and i in inject:
                    h = inject[i]       # rounded to the layer's residual dtype by the block, as any input
                h, cache = block(h, ctxs[i], rec.layer(i), cache, i)
        x = rec("final_norm", self.norm(h.astype(residual), policy))
        if last is not None:
            x = x[jnp.arange(x.shape[0]), last][:, None]
        logits = rec("logits", head_logits(x, self.head_weight(), self.ops, policy, self.cfg.final_softcap))
        return logits, rec.acts, cache

    def _scan_layers(self, h, ctxs: list[Context], taps, inject, stacked=None):
        """The blocks as one lax.scan over their weights stacked on a layer axis, so XLA
        compiles one block instead of num_hidden_layers copies (docs/performance.md).

        stacked: the stacked weights (stack_layers), which LlamaModel builds once and keeps;
        None: stacked here, a copy of the layer weights on each call (which cost more than the
        forward itself on SmolLM2). A decode step stays unrolled. Per-layer taps come out
        stacked: a tap asked for at any layer is returned for every layer as
        "layers.*.<name>" [L, ...], and the caller picks the layers (one output per layer
        would cost compile time per output). inject {i: h}: layer i's input is replaced by
        h (a select, so exact). ctxs: each layer's Context (the same policy in each, where one
        scan runs them; a family's layers may differ in RoPE tables and window: scan_contexts).
        """
        n_layers = self.cfg.num_hidden_layers
        graphdef = nnx.graphdef(scan_block(self.layers[0]))
        names = frozenset(t.split(".", 2)[2] for t in taps if t.startswith("layers."))
        if not self.same_blocks():
            return self._loop_layers(h, ctxs, names, inject)
        context_of = self.scan_contexts(ctxs)
        ctx = ctxs[0]
        # the carry in the blocks' residual dtype, as each block casts its input (an injected state too)
        layer_resid = of(ctx.policy.residual_dtype)
        h = h.astype(layer_resid)
        if stacked is None:
            stacked = stack_layers(self)
        forced_on = np.zeros(n_layers, bool)
        forced_on[list(inject or ())] = True
        forced = (jnp.stack([inject[i].astype(layer_resid) if i in inject else jnp.zeros_like(h)
                             for i in range(n_layers)]) if inject else None)

        dtypes = {}

        def step(h, xs):
            i, weights, on, h_in = xs
            if h_in is not None:
                h = jnp.where(on, h_in, h)
            rec = Recorder(names)
            h, _ = nnx.merge(graphdef, weights)(h, context_of(i), rec, None, i)
            # 16-bit taps leave the loop widened to f32 (exact) and are rounded back after it (exact
            # again): XLA:CPU writes a bf16 slice into the stacked output by converting the whole
            # stack to f32 and back on every layer (docs/performance.md)
            dtypes.update({name: x.dtype for name, x in rec.acts.items()})
            return h, {name: x.astype(opmath(x.dtype)) for name, x in rec.acts.items()}

        h, acts = lax.scan(step, h, (jnp.arange(n_layers), stacked, jnp.asarray(forced_on), forced))
        return h, {f"layers.*.{name}": stack.astype(dtypes[name]) for name, stack in acts.items()}

    def same_blocks(self) -> bool:
        """Whether every block has the first one's structure, so that one lax.scan runs them all
        (not so when a planted-bug control patched one layer's seams, or per-layer overrides give
        blocks different policies)."""
        graphdef = nnx.graphdef(self.layers[0])
        return all(nnx.graphdef(block) == graphdef for block in self.layers[1:])

    def _loop_layers(self, h, ctxs: list[Context], names, inject):
        """_scan_layers for blocks that differ in structure (a planted-bug control patched one
        layer's seams; per-layer policies), which one scan cannot run: the blocks one after the
        other, the per-layer taps stacked as the scan stacks them, or, where the layers' taps
        differ in dtype (per-layer policies), a tuple of them, one per layer, each in its dtype."""
        per_layer = []
        for i, block in enumerate(self.layers):
            if inject and i in inject:
                h = inject[i]
            rec = Recorder(names)
            h, _ = block(h, ctxs[i], rec, None, i)
            per_layer.append(rec.acts)
        return h, {f"layers.*.{name}": _stack_taps([acts[name] for acts in per_layer]) for name in names}


def _stack_taps(xs: list):
    """One tap of every layer stacked on a layer axis, or as a tuple where their dtypes differ
    (a stack would widen some: LlamaModel.capture picks a layer's from either)."""
    return jnp.stack(xs) if len({x.dtype for x in xs}) == 1 else tuple(xs)


def _check_mesh_policy(policy: Policy) -> None:
    """A PolicyError naming the knob a model on a mesh does not take: fp8 projections (weight_fp8,
    act_fp8) are quantized and multiplied on one device only (their groups span the shards)."""
    for sel, p in (("", policy), *policy.layers):
        for knob in ("weight_fp8", "act_fp8"):
            if getattr(p, knob):
                where = f" (layers[{sel}])" if sel else ""
                raise PolicyError(f"policy {policy.name!r}: {knob}{where} is not taken on a mesh (jaxmodel "
                                  "quantizes and multiplies fp8 projections on one device only); load without mesh=")


def scan_block(block: Block) -> Block:
    """The block as the layers' lax.scan runs it: a copy whose matrices are as their backend's
    `scanned` keeps them in the stacked layers (fast: without the copies only unrolled products
    use)."""
    copy = nnx.merge(*nnx.split(block))
    for _, module in nnx.iter_modules(copy):
        if isinstance(module, Linear):
            module.weight.set_value(module.ops.scanned(module.weight.get_value()))
    return copy


def stack_layers(model: Llama):
    """The blocks' states (weights, packed weights) stacked on a leading layer axis, as
    _scan_layers' lax.scan takes them (scan_block)."""
    return jax.tree.map(lambda *w: jnp.stack(w), *(nnx.state(scan_block(block)) for block in model.layers))


@functools.partial(jax.jit, static_argnums=0)
def _stack_state(graphdef, state):
    return stack_layers(nnx.merge(graphdef, state))


def checkpoint_key(name: str) -> str:
    """A Llama parameter's checkpoint key: "model." + its name, lm_head's as they are."""
    return name if name.startswith("lm_head.") else "model." + name


def to_residual(x, policy: Policy) -> np.ndarray:
    """A hidden state handed in from outside (teacher forcing's oracle input) in the residual
    dtype, rounded on the host: numpy rounds float64 to float16 once, where XLA:CPU's
    conversion may go through float32 (two roundings) depending on the program around it."""
    x, dtype = np.asarray(x), numpy_dtype(policy.residual_dtype)
    return x if x.dtype == dtype else x.astype(dtype)


def rope_tables(cfg: LlamaConfig, policy: Policy, ops, positions, rope_config=None):
    """cos, sin [B, T, head_dim] for positions [B, T] (dynamic NTK reads the longest). rope_config:
    a layer's (cfg.rope_of), cfg.rope by default."""
    rope = of(policy.rope_dtype)
    inv_freq = ops.rope_inv_freq(rope_config or cfg.rope, cfg.head_dim, cfg.max_position_embeddings,
                                 jnp.max(positions) + 1, rope)
    return ops.rope_cos_sin(inv_freq, positions, rope)


def head_logits(x, head, ops, policy: Policy, softcap: float | None = None):
    """The lm_head: final_norm output x times the [vocab, hidden] matrix (or a chunk of its rows),
    in the policy's logits dtype; soft-capped there where the family caps them (Gemma 2)."""
    logits = ops.linear(x, head, None, policy, of(policy.logits_dtype))
    return logits if softcap is None else ops.soft_cap(logits, softcap)


def embed_rows(cfg: LlamaConfig, policy: Policy, ops, rows):
    """The embedding tap from the table's rows: scaled by sqrt(hidden_size) where the family says
    (Gemma), in the dtype torchref keeps the table in (param_dtype, or compute_dtype where wider:
    the same values as a widened copy here), then rounded to the residual dtype."""
    if cfg.embed_scale:
        param, compute = of(policy.param_dtype), of(policy.compute_dtype)
        rows = ops.scale_embedding(rows.astype(compute if compute.itemsize > param.itemsize else param),
                                   cfg.hidden_size)
    return rows.astype(of(policy.residual_dtype))


class LayerRunner:
    """The model run one piece at a time over weights handed in as numpy (checkpoint keys
    and storage dtype), for a comparison that never holds the whole model
    (compare.ladder.stream). The same modules and steps as Llama.__call__: one Block built
    from the layer's weights (rounded as Llama rounds them) runs under one jit-compiled
    program per (policy, shapes, taps), reused for every layer; the final norm and lm_head
    chunks likewise. Arrays in and out are numpy. backend: as from_pretrained's (not invariant)."""

    def __init__(self, cfg: LlamaConfig, policy: str | Policy, backend: str = "fast"):
        if backend == "invariant":
            raise PolicyError("LayerRunner: the invariant backend runs whole models only (its canonical "
                              "layout is the batch's); stream with backend='fast' or 'reference'")
        # the family's norm convention where the policy leaves it to the family, as Llama fills it
        self.cfg, self.policy = cfg, Policy.get(policy).for_family(cfg.norm_weight_in_norm_dtype)
        self.policy.check_layers(cfg.num_hidden_layers)
        self.layer_policies = [self.policy.for_layer(i, cfg.num_hidden_layers) for i in range(cfg.num_hidden_layers)]
        self.plan, self.ops = plans.load(self.policy, None, backend, cfg=cfg)
        self.dtype = numpy_dtype(self.policy.param_dtype)
        self.tables = None

    def start(self, ids, mask) -> None:
        """The RoPE tables (per rope and rope_dtype of the layers) and the causal mask (per sliding
        window of the layers) of one batch, for every later call, as Llama.contexts makes them."""
        ids, mask = check_tokens(self.cfg, ids, mask)
        positions = positions_from_mask(mask)
        allowed = causal_allowed(jnp.asarray(mask), ids.shape[1])
        tables, masks = {}, {}
        for i, p in enumerate(self.layer_policies):
            rope, window = self.cfg.rope_of(i), self.cfg.window(i)
            if (rope, p.rope_dtype) not in tables:
                tables[rope, p.rope_dtype] = _piece_programs(self.cfg, p, self.ops)[0](positions, rope)
            if window not in masks:
                masks[window] = allowed if window is None else sliding_allowed(allowed, window)
        self.tables = (tables, masks)

    def embed(self, rows) -> np.ndarray:
        """The embedding tap from the table's rows of the batch's ids ([B, T, hidden]):
        gathering then rounding equals rounding the table then gathering (embed_rows)."""
        return np.asarray(embed_rows(self.cfg, self.policy, self.ops, jnp.asarray(rows.astype(self.dtype))))

    def block(self, i: int, weights: dict, h, taps=()) -> dict:
        """Layer i on the hidden state h (layer i's input); {tap name: numpy} for the
        requested per-layer tap names ("layers.i.<name>") plus "layers.i.out" always."""
        p = self.layer_policies[i]
        # as the forward's scan runs it
        block = scan_block(Block(self.cfg, weights, i, numpy_dtype(p.param_dtype), self.ops, p))
        graphdef, state = nnx.split(block)
        names = tuple(sorted({tapnames.parse(t)[1] for t in taps} | {"out"}))
        tables, masks = self.tables
        # h in the layer's residual dtype (on the host), as Block casts any input
        acts = _block_program(graphdef, p, names)(state, jnp.asarray(to_residual(h, p)),
                                                  *tables[self.cfg.rope_of(i), p.rope_dtype], masks[self.cfg.window(i)])
        return {f"layers.{i}.{n}": np.asarray(a) for n, a in acts.items()}

    def final_norm(self, weight, h) -> np.ndarray:
        norm = RMSNorm({"model.norm.weight": weight}, "model.norm", self.dtype, self.cfg.rms_norm_eps, self.ops,
                       self.cfg.norm_offset)
        return np.asarray(_piece_programs(self.cfg, self.policy, self.ops)[1](norm.weight[...], jnp.asarray(h)))

    def logits(self, x, head_rows) -> np.ndarray:
        """The logits of final_norm output x for the lm_head rows given (a vocabulary chunk), the
        rows held as Llama holds its head (no one-row copy: x holds the batch's rows)."""
        w = self.ops.prepare(_as_param(head_rows, self.dtype), self.policy, None, False)
        return np.asarray(_piece_programs(self.cfg, self.policy, self.ops)[2](jnp.asarray(x), w))


@functools.lru_cache(maxsize=16)
def _block_program(graphdef, policy: Policy, names: tuple):
    """One jitted Block for a structure and a set of tap names; jit compiles once per shape."""
    resid = of(policy.residual_dtype)

    def run(state, h, cos, sin, allowed):
        rec = Recorder(names)
        nnx.merge(graphdef, state)(h.astype(resid), Context(cos, sin, allowed, policy), rec, None, 0)
        return rec.acts
    return jax.jit(run, compiler_options=compiler_options(False))


@functools.lru_cache(maxsize=16)
def _piece_programs(cfg: LlamaConfig, policy: Policy, ops):
    """The jitted RoPE tables, final norm and lm_head (chunk) of LayerRunner, with `ops`."""
    jit = functools.partial(jax.jit, compiler_options=compiler_options(False))
    resid = of(policy.residual_dtype)
    offset = {"offset": cfg.norm_offset} if cfg.norm_offset else {}     # as RMSNorm passes it
    return (jit(lambda positions, rope: rope_tables(cfg, policy, ops, positions, rope), static_argnums=1),
            jit(lambda w, h: ops.rms_norm(h.astype(resid), w, cfg.rms_norm_eps, policy, **offset)),
            jit(lambda x, w: head_logits(x, w, ops, policy, cfg.final_softcap)))


# ---- pure functions of (graphdef, state, inputs), jit-compiled per model ----

def sliding_allowed(allowed, window: int):
    """allowed [B, T, S] limited to the keys less than `window` tokens back from each query
    (transformers: kv_idx > q_idx - window). Counted in the mask's own keys, not in slots: a query
    at position p sees its row's real keys at positions 0..p (the causal mask), so the key at
    position j has p - j allowed keys after it. Pad slots anywhere (left, interior, a shape
    bucket's front padding, a cache's unused ones) then count for nothing, in every layout and
    cache the models use."""
    seen = jnp.cumsum(allowed.astype(jnp.int32), axis=-1)
    return allowed & (seen[..., -1:] - seen < window)


def causal_allowed(mask, n_queries: int, first_query_slot=0):
    """allowed[b, t, s]: slot s holds a real token and is not after query slot first + t."""
    S = mask.shape[1]
    q_slot = first_query_slot + jnp.arange(n_queries)
    return mask.astype(bool)[:, None, :] & (jnp.arange(S)[None, :] <= q_slot[:, None])[None]


def _whole(model, tree):
    """What a program hands back to its caller, whole on every device of the mesh (each
    process then reads it as numpy); as it is on one device."""
    return tree if model.layout is None else model.layout.replicated(tree)


def _cache_out(model, cache: dict) -> dict:
    """A cache to return: keys and values stay sharded (batch over data, KV heads over tensor),
    the bookkeeping (mask, positions, index, lens) whole."""
    kv = {n: shard(model.layout, cache[n], None, "batch", None, "kv_heads", None) for n in ("k", "v")}
    return {**_whole(model, {n: x for n, x in cache.items() if n not in kv}), **kv}


def _forward(graphdef, state, stacked, ids, mask, positions, inject, *, taps):
    """The whole prompt through the blocks' lax.scan, over `stacked` (stack_layers; None: stacked
    in the program)."""
    model = nnx.merge(graphdef, state)
    logits, acts, _ = model(ids, positions, causal_allowed(mask, ids.shape[1]), taps=taps, inject=inject,
                            scan=True, stacked=stacked)
    return _whole(model, (logits, acts))


def _empty_cache(model, B: int, S: int) -> KV:
    """Keys and values in the backend's kv_dtype (ops.py: compute_dtype); with per-layer policies,
    the type every layer's kv_dtype promotes to (each layer's values held exactly; bfloat16 and
    float16 layers: float32), each layer casting on write and read (Attention)."""
    cfg = model.cfg
    shape = (cfg.num_hidden_layers, B, S, model.layers[0].self_attn.kv_heads, cfg.head_dim)
    dtype = functools.reduce(jnp.promote_types, (model.ops.kv_dtype(p) for p in model.layer_policies))
    zeros = shard(model.layout, jnp.zeros(shape, dtype), None, "batch", None, "kv_heads", None)
    return KV(zeros, zeros, np.zeros(B, np.int32))     # numpy: known while tracing (_shared_start)


def _prefill(graphdef, state, ids, mask, positions, inject=None, *, cache_len):
    """inject {layer: [B, T, hidden]} or None: teacher forcing (jit compiles it apart)."""
    logits, cache, _ = _prefill_taps(graphdef, state, ids, mask, positions, inject, cache_len=cache_len, taps=())
    return logits, cache


def _prefill_taps(graphdef, state, ids, mask, positions, inject, *, cache_len, taps):
    """_prefill, also returning the prompt's activations {tap: [B, T, ...]} (unrolled layers:
    per-layer names as asked)."""
    model = nnx.merge(graphdef, state)
    B, T = ids.shape
    slots = jnp.zeros((B, cache_len), bool).at[:, :T].set(mask.astype(bool))
    logits, acts, kv = model(ids, positions, causal_allowed(slots, T), taps=taps,
                             cache=_empty_cache(model, B, cache_len), last=jnp.full(B, T - 1), inject=inject)
    cache = {"k": kv.k, "v": kv.v, "mask": slots, "next_pos": mask.sum(1).astype(jnp.int32), "index": jnp.int32(T)}
    return _whole(model, logits[:, 0]), _cache_out(model, cache), _whole(model, acts)


def _decode(graphdef, state, cache, next_ids):
    logits, cache, _ = _decode_taps(graphdef, state, cache, next_ids, None, taps=())
    return logits, cache


def _decode_taps(graphdef, state, cache, next_ids, inject, *, taps):
    """_decode, also returning the step's activations {tap: [B, 1, ...]} (unrolled layers:
    per-layer names as asked). inject {layer: [B, 1, hidden]} or None: teacher forcing."""
    model = nnx.merge(graphdef, state)
    index = cache["index"]
    slots = cache["mask"].at[:, index].set(True)
    B = slots.shape[0]
    kv = KV(cache["k"], cache["v"], jnp.full(B, index))
    logits, acts, kv = model(next_ids[:, None], cache["next_pos"][:, None], causal_allowed(slots, 1, index),
                             taps=taps, cache=kv, inject=inject)
    cache = {"k": kv.k, "v": kv.v, "mask": slots, "next_pos": cache["next_pos"] + 1, "index": index + 1}
    return _whole(model, logits[:, 0]), _cache_out(model, cache), _whole(model, acts)


def _prefill_invariant(graphdef, state, ids, mask, positions, *, cache_len):
    """_prefill in the canonical layout: row b fills slots [0, lens[b]); logits of each
    row's last real slot."""
    model = nnx.merge(graphdef, state)
    B, T = ids.shape
    slots = jnp.zeros((B, cache_len), bool).at[:, :T].set(mask.astype(bool))
    lens = mask.sum(1).astype(jnp.int32)
    logits, _, kv = model(ids, positions, causal_allowed(slots, T), cache=_empty_cache(model, B, cache_len),
                          last=lens - 1)
    return _whole(model, logits[:, 0]), _cache_out(model, {"k": kv.k, "v": kv.v, "lens": lens})


def _decode_invariant(graphdef, state, cache, next_ids):
    """_decode writing row b at its own slot lens[b] (slots [0, lens[b]) are all real)."""
    model = nnx.merge(graphdef, state)
    lens = cache["lens"]
    S = cache["k"].shape[2]
    allowed = (jnp.arange(S)[None, :] <= lens[:, None])[:, None, :]
    logits, _, kv = model(next_ids[:, None], lens[:, None], allowed, cache=KV(cache["k"], cache["v"], lens))
    return _whole(model, logits[:, 0]), _cache_out(model, {"k": kv.k, "v": kv.v, "lens": lens + 1})


@functools.lru_cache(maxsize=16)
def _programs(graphdef, batch_invariant: bool):
    """The jitted forward, prefill and decode for one model structure (config + policy).

    Models loaded twice with the same structure share compiled programs (a comparison
    loads several copies). The graphdef is bound here, once: hashing it costs
    milliseconds, too much to pay on every decode step as a static argument.
    """
    jit = functools.partial(jax.jit, compiler_options=compiler_options(batch_invariant))
    prefill, decode = (_prefill_invariant, _decode_invariant) if batch_invariant else (_prefill, _decode)
    return (jit(functools.partial(_forward, graphdef), static_argnames="taps"),
            jit(functools.partial(prefill, graphdef), static_argnames="cache_len"),
            # the cache is donated: each step updates it in place instead of copying it
            jit(functools.partial(decode, graphdef), donate_argnums=1))


@functools.lru_cache(maxsize=16)
def _prefill_capture_program(graphdef):
    """The jitted _prefill_taps for one model structure (LlamaModel.prefill_capture)."""
    jit = functools.partial(jax.jit, compiler_options=compiler_options(False))
    return jit(functools.partial(_prefill_taps, graphdef), static_argnames=("cache_len", "taps"))


@functools.lru_cache(maxsize=16)
def _decode_capture_program(graphdef):
    """The jitted _decode_taps for one model structure (LlamaModel.decode_capture)."""
    jit = functools.partial(jax.jit, compiler_options=compiler_options(False))
    return jit(functools.partial(_decode_taps, graphdef), static_argnames="taps", donate_argnums=1)


def clear_programs() -> None:
    """Forget every traced and compiled program of this process (the jit caches and the programs
    bound per model structure), so that the next call traces again: after changing a constant
    that tracing reads (fast.QUERY_BLOCK). The persistent compilation
    cache on disk is keyed by the program itself and stays."""
    jax.clear_caches()
    for cached in (_programs, _block_program, _piece_programs, _prefill_capture_program, _decode_capture_program):
        cached.cache_clear()


def _pick(acts: dict, tap: str) -> np.ndarray:
    layer = tapnames.layer_of(tap)
    if layer is None:
        return acts[tap]
    return acts[f"layers.*.{tapnames.parse(tap)[1]}"][layer]


class LlamaModel:
    """A loaded model: forward, activation capture, prefill/decode and generation."""

    def __init__(self, module: Llama):
        self.cfg: LlamaConfig = module.cfg
        self.policy: Policy = module.policy
        self.batch_invariant: bool = module.batch_invariant
        self.plan: Plan = module.plan   # how it computes: backend, machine, a choice per op (plan.py)
        self.layout: MeshLayout | None = module.layout   # None: one device (sharding.py)
        self.layer_policies = module.layer_policies       # each layer's policy (per-layer overrides)
        # the canonical layout's width multiple of the invariant backend (invariant.py or portable.py)
        self.layout_multiple = module.ops.LAYOUT_MULTIPLE if module.batch_invariant else None
        self.graphdef, self.state = nnx.split(module)
        self._forward, self._prefill, self._decode = _programs(self.graphdef, self.batch_invariant)
        self._stack = (None, None)    # (the state it was built from, stack_layers of it or None)

    def _stacked(self):
        """The blocks' weights stacked on a layer axis for the forward's lax.scan (stack_layers):
        built on the first forward or capture and kept, so each call does not copy every layer
        weight again (that copy cost about as much as the forward itself). The layer weights are
        then held twice. On a mesh the stack is built for each call and not kept: a model is put
        on a mesh to spread its memory, and a probe holds several of them. None when the blocks
        differ in structure (they then run one after the other, Llama._loop_layers)."""
        state, stacked = self._stack
        if state is not self.state:
            stacked = _stack_state(self.graphdef, self.state) if self.model.same_blocks() else None
            if self.layout is None:
                self._stack = (self.state, stacked)
        return stacked

    def compiled_programs(self) -> dict[str, int]:
        """How many programs jit holds compiled (or loaded from the persistent cache) for the
        forward, prefill and decode of this model's structure: one per shape (and tap set)
        seen; models of the same structure share them. What the shape buckets save shows here."""
        return {name: fn._cache_size() for name, fn in
                (("forward", self._forward), ("prefill", self._prefill), ("decode", self._decode))}

    @property
    def mesh(self):
        """The jax.sharding.Mesh the model runs on, or None (one device)."""
        return None if self.layout is None else self.layout.mesh

    def _put(self, x):
        """A per-row input (ids, mask, positions, a forced hidden state) as the programs take it:
        split over the mesh's data axis on a mesh, else as it is."""
        return x if self.layout is None else self.layout.put_batch(x)

    def _inputs(self, run: Layout) -> tuple:
        """The run's ids, mask and positions, placed (_put)."""
        return tuple(map(self._put, (run.ids, run.mask, run.positions)))

    def _forced(self, forced: dict, run: Layout | None = None) -> dict:
        """inject's states in their layer's residual dtype (rounded on the host), placed."""
        states = {i: to_residual(x if run is None else run.place(x), self.layer_policies[i])
                  for i, x in forced.items()}
        return {i: jnp.asarray(x) if self.layout is None else self._put(x) for i, x in states.items()}

    @property
    def model(self) -> Llama:
        """The network (a Llama, merged from graphdef and state: a copy, as nnx gives it)."""
        return nnx.merge(self.graphdef, self.state)

    module = model   # the same, under the name earlier code used

    def weights(self) -> dict[str, np.ndarray]:
        """The parameters under their checkpoint keys, as numpy in their layer's param_dtype (no
        lm_head when tied): the values the model computes with, ready for from_weights. A weight
        the policy quantizes (weight_fp8) comes back dequantized, rounded to param_dtype: give
        from_weights quantized() too to rebuild it exactly (quantizing is not idempotent)."""
        module, out = self.model, {}
        for path, var in nnx.to_flat_state(nnx.filter_state(self.state, nnx.Param)):
            key = checkpoint_key(".".join(map(str, path)))
            # a widened matrix: exact; a dequantized one: rounded (nearest even, on the host)
            w = to_host(var[...]).astype(numpy_dtype(module.policy_of(key).param_dtype))
            out[key] = w if self.layout is None else self.layout.as_checkpoint(key, w)
        return out

    def quantized(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{checkpoint key: (q, scales)} of every weight the policy quantizes (weight_fp8), numpy
        (ml_dtypes' fp8); from_weights(..., quantized=) installs them as they are."""
        parts: dict = {}
        for path, var in nnx.to_flat_state(nnx.filter_state(self.state, Fp8)):
            *owner, name = map(str, path)
            parts.setdefault(checkpoint_key(".".join(owner) + ".weight"), {})[name] = to_host(var[...])
        return {key: (p["fp8_q"], p["fp8_scales"]) for key, p in parts.items()}

    buckets = True     # prefill front-padded to a shape bucket (CACHE_BLOCK's comment); False: as given

    def _layout(self, ids, mask, extra_length=0, bucket=False) -> Layout:
        """The batch as the programs run it: canonical in batch-invariant mode, else front-padded
        to its shape bucket when asked (and buckets is on), else as given."""
        if self.batch_invariant:
            return layout(self.cfg, ids, mask, self.layout_multiple, extra_length)
        if bucket and self.buckets:
            return front_padded(ids, mask, bucket_length(ids.shape[1]))
        return layout(self.cfg, ids, mask)

    @staticmethod
    def _cache_len(run: Layout, total_len: int) -> int:
        """KV cache slots for a prefill to total_len tokens, rounded up to CACHE_BLOCK: total_len
        plus the front padding of a bucketed run (decode writes after the run's width); in the
        canonical layout, total_len or its width if longer."""
        need = max(total_len + run.offset, run.ids.shape[1])
        return -(-need // CACHE_BLOCK) * CACHE_BLOCK

    def __call__(self, tokens, attention_mask=None):
        """Logits [B, T, V] (jax array, logits_dtype) for token ids [B, T]."""
        ids, mask = check_tokens(self.cfg, tokens, attention_mask)
        run = self._layout(ids, mask)
        logits, _ = self._forward(self.state, self._stacked(), *self._inputs(run), {}, taps=())
        return jnp.asarray(run.restore(logits)) if self.batch_invariant else logits

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        """(logits as numpy, {tap: numpy activation}) for the requested tap names/patterns.

        Activations keep their dtype (bf16 stays bf16, via ml_dtypes). inject: {layer
        index: array [B, T, hidden]} replaces the input of those layers (teacher forcing).
        The set of injected layers is part of the compiled program's structure."""
        names = tapnames.resolve(taps, self.cfg)
        ids, mask = check_tokens(self.cfg, tokens, attention_mask)
        run = self._layout(ids, mask)
        forced = self._forced(check_inject(self.cfg, inject, ids.shape), run)
        # the program depends on which tap names are asked for, not at which layers; "logits"
        # is what every program returns, so asking for it alone runs the plain forward's program
        program_taps = tuple(sorted({n if tapnames.layer_of(n) is None
                                     else "layers.*." + tapnames.parse(n)[1] for n in names} - {"logits"}))
        logits, acts = self._forward(self.state, self._stacked(), *self._inputs(run), forced, taps=program_taps)
        # per-layer taps come stacked (a tuple, one per layer, where per-layer policies differ in dtype)
        acts = {k: [np.asarray(x) for x in a] if isinstance(a, tuple) else np.asarray(a) for k, a in acts.items()}
        acts["logits"] = logits = np.asarray(logits)
        return run.restore(logits), {n: run.restore(_pick(acts, n)) for n in names}

    def prefill(self, ids, mask, total_len: int, inject=None):
        """Runs the left-aligned prompt, fills cache slots [0, T); returns (last logits [B, V]
        as numpy, cache). The cache holds total_len tokens, rounded up to CACHE_BLOCK.
        inject {layer: [B, T, hidden]}: teacher forcing, as capture takes it (jit compiles a
        program per set of injected layers; the cache holds the forced keys and values)."""
        shape, run, inputs, cache_len = self._prefill_inputs(ids, mask, total_len)
        forced = check_inject(self.cfg, inject, shape)
        if not forced:
            logits, cache = self._prefill(self.state, *inputs, cache_len=cache_len)
            return np.asarray(logits), cache
        if self.batch_invariant:
            raise NotImplementedError("prefill: inject is not taken in batch-invariant mode")
        logits, cache = self._prefill(self.state, *inputs, self._forced(forced, run), cache_len=cache_len)
        return np.asarray(logits), cache

    def prefill_program_text(self, ids, mask, total_len: int) -> str:
        """The compiled HLO text of the program prefill runs for inputs of these shapes (with
        the call stack of every op in its metadata: bench/profile_ops.py reads it). Compiles,
        or loads from the compilation cache, as prefill would."""
        _, run, inputs, cache_len = self._prefill_inputs(ids, mask, total_len)
        return self._prefill.lower(self.state, *inputs, cache_len=cache_len).compile().as_text()

    def _prefill_inputs(self, ids, mask, total_len: int):
        """A prefill's prompt checked and laid out in its shape bucket: (the prompt's [B, T] shape,
        the layout, its placed inputs, the cache length)."""
        ids, mask = check_prefill(self.cfg, ids, mask, total_len)
        run = self._layout(ids, mask, extra_length=total_len - ids.shape[1], bucket=True)
        return ids.shape, run, self._inputs(run), self._cache_len(run, total_len)

    def prefill_capture(self, ids, mask, total_len: int, taps=("layers.*.out",), inject=None):
        """prefill, also returning the prompt's activations as the prefill computed them:
        (logits [B, V], cache, {tap: numpy [B, T, ...]}; the logits tap at the last slot only,
        [B, 1, V]). A program of its own (compiled per set of tap names and injected layers);
        prefill's stays as it is."""
        if self.batch_invariant:
            raise NotImplementedError("prefill_capture: not in batch-invariant mode")
        names = tapnames.resolve(taps, self.cfg)
        shape, run, inputs, cache_len = self._prefill_inputs(ids, mask, total_len)
        forced = self._forced(check_inject(self.cfg, inject, shape), run)
        logits, cache, acts = _prefill_capture_program(self.graphdef)(
            self.state, *inputs, forced, cache_len=cache_len, taps=tuple(names))
        # per-slot taps back to the caller's slots; logits holds the last slot only
        return np.asarray(logits), cache, {n: np.asarray(acts[n]) if n in LAST_SLOT_TAPS else run.restore(acts[n])
                                           for n in names}

    def decode(self, cache, next_ids):
        """Appends one token per row at the cache's write index; returns (logits [B, V], cache)."""
        if self.batch_invariant:
            (B, S), index = cache["k"].shape[1:3], int(cache["lens"].max())
        else:
            (B, S), index = cache["mask"].shape, int(cache["index"])
        next_ids = check_next_ids(self.cfg, next_ids, B, index, S)
        logits, cache = self._decode(self.state, cache, self._put(next_ids))
        return np.asarray(logits), cache

    def decode_capture(self, cache, next_ids, taps=("layers.*.out",), inject=None):
        """decode, also returning the step's activations: (logits [B, V], cache, {tap: numpy
        [B, 1, ...]}), the taps of the one new position, as the decode path computed them
        (compare.ladder.decode judges them against a full recompute). A program of its own
        (compiled per set of tap names and of injected layers): decode's stays as it is.
        inject {layer: [B, 1, hidden]}: teacher forcing of the new position."""
        if self.batch_invariant:
            raise NotImplementedError("decode_capture: not in batch-invariant mode")
        names = tapnames.resolve(taps, self.cfg)
        (B, S), index = cache["mask"].shape, int(cache["index"])
        next_ids = check_next_ids(self.cfg, next_ids, B, index, S)
        forced = self._forced(check_inject(self.cfg, inject, (B, 1)))
        logits, cache, acts = _decode_capture_program(self.graphdef)(self.state, cache, self._put(next_ids), forced,
                                                                     taps=names)
        return np.asarray(logits), cache, {n: np.asarray(acts[n]) for n in names}

    def generate(self, tokens, attention_mask=None, max_new_tokens=32, do_sample=False,
                 temperature=1.0, top_k=None, top_p=None, seed=0, eos_token_ids=None,
                 pad_token_id=None) -> np.ndarray:
        """New token ids [B, N] (int64), greedy by default; llamaspec.generate picks tokens."""
        sampling = Sampling(do_sample=do_sample, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed)
        return generate(self.cfg, self.prefill, self.decode, tokens, attention_mask,
                        max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                        pad_token_id=pad_token_id, sampling=sampling)


def from_weights(cfg: LlamaConfig, weights: dict[str, np.ndarray], policy: str | Policy = "fp32",
                 batch_invariant: bool = False, mesh=None, shard_sums: str = "ordered",
                 backend: str | None = None, quantized: dict | None = None) -> LlamaModel:
    """A model from checkpoint-keyed numpy weights (as load_weights or weights() give them),
    each rounded to the policy's param_dtype. quantized {key: (q, scales)} (a model's quantized()):
    those weights installed from their fp8 values and scales instead of quantized here.

    backend: "reference" (ops.py), "fast" (the default) or "invariant" (llamaspec.plan.BACKENDS;
    plan.py decides what each runs on this machine, model.plan records it).
    batch_invariant=True (the invariant backend): a sequence's logits and greedy completions are
    bitwise the same whatever the rest of the batch, its row and its padding (invariant.py's fixed-order
    kernels, or portable.py where the plan says: llamaspec.plan.INVARIANT_ENV).
    mesh: a jax.sharding.Mesh with axes data/tensor, or their sizes ({"data": 2, "tensor": 4},
    "data=2,tensor=4"): the model sharded as sharding.py lays it out, weights placed shard
    by shard (None: one device). shard_sums: "ordered" (cross-shard sums added in shard order:
    bitwise the same in one process or several) or "all-reduce" (XLA's psum), sharding.py."""
    layout = None if mesh is None else layout_for(cfg, mesh, shard_sums)
    module = Llama(cfg, Policy.get(policy), weights, batch_invariant, layout, backend, quantized)
    if module.batch_invariant:
        module.ops.self_check(module)    # the invariant backend's (invariant.py or portable.py)
    return LlamaModel(module)


def from_pretrained(path, policy: str | Policy = "fp32", batch_invariant: bool = False,
                    check_finite: bool = True, mesh=None, shard_sums: str = "ordered",
                    backend: str | None = None) -> LlamaModel:
    """Loads a Hugging Face Llama folder (config.json + safetensors) under a precision policy
    (mesh, shard_sums, backend: see from_weights; each device's shards are read from the
    memory-mapped files)."""
    cfg, weights = load_weights(path, check_finite=check_finite)
    return from_weights(cfg, weights, policy, batch_invariant, mesh, shard_sums, backend)
