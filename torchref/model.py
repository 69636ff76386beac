"""A plain PyTorch Llama: the reference implementation.

`Llama` is the network and `LlamaModel` the loaded model (forward, capture, prefill/decode,
generate) that holds it as `model`. Module and parameter names mirror Hugging Face's, so a
parameter's name is its checkpoint key less "model." (checkpoint_key) and loading is
one-to-one. The math lives in ops.py; modules only hold weights and wire ops together.
Every step follows the precision policy. jaxmodel/model.py is the same file in JAX: same
classes, arguments, cache and tap names.

Every module calls its ops through `self.ops`, the backend's namespace (ops.py itself for
the reference, fast.py's, invariant.py's or portable.py's for the others: the same names and
signatures), which plan.py picks once at load (model.plan says what each op runs on). The
invariant backend (batch_invariant=True, docs/invariance.md) runs every call in the canonical
layout of llamaspec.inputs.layout, its constants (LAYOUT_MULTIPLE, KEY_BLOCK) and self-check
read from the namespace the plan chose. The KV cache keeps that layout: row b's tokens fill slots
[0, lens[b]) and a decode step writes each row at its own slot lens[b], so a row's keys
sit in the same blocks whatever the other rows' lengths.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from llamaspec import LlamaConfig, Policy, Sampling, check_tokens, load_weights, positions_from_mask
from llamaspec import generate as run_generation
from llamaspec import taps as tapnames
from llamaspec.checkpoint import is_projection, layer_of_key
from llamaspec.forward import KV, Context, Recorder
from llamaspec.inputs import Layout, check_inject, check_next_ids, check_prefill, layout
from llamaspec.plan import backend_name

from . import quant
from .dtypes import cast, dt, from_numpy, to_numpy
from .ops import fp8_product_dtype
from .plan import check_matmul_settings, make_backend


def _weight(*shape) -> nn.Parameter:
    # Shape-only placeholder: real tensors are installed by Llama._load.
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool, ops):
        super().__init__()
        self.weight = _weight(n_out, n_in)
        self.bias = _weight(n_out) if bias else None
        self.ops = ops

    def forward(self, x, policy: Policy, out_dtype: str | None = None):
        if policy.weight_fp8 or policy.act_fp8:    # a block projection of a quantizing layer
            return self.ops.fp8_linear(x, self.weight, self.bias, policy)
        return self.ops.linear(x, self.weight, self.bias, policy, out_dtype)


def project(ops, x, linears, policy: Policy) -> list:
    """The projections that read one input (q, k, v; gate, up) in one ops.linears call (a backend
    may run them as one product), or each on its own where the layer quantizes (fp8_linear)."""
    if policy.weight_fp8 or policy.act_fp8:
        return [m(x, policy) for m in linears]
    return ops.linears(x, [m.weight for m in linears], [m.bias for m in linears], policy)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = _weight(vocab, dim)

    def forward(self, ids):
        return self.weight[ids]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops, offset: float = 0.0):
        super().__init__()
        self.weight = _weight(dim)
        self.eps = eps
        self.ops = ops
        # Gemma's norms multiply by (1 + weight): an argument only where set (the plan runs such a
        # model's norms on the reference, llamaspec.plan.family_declines)
        self.family = {"offset": offset} if offset else {}

    def forward(self, x, policy: Policy):
        return self.ops.rms_norm(x, self.weight, self.eps, policy, **self.family)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, ops):
        super().__init__()
        d, hd, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = Linear(d, self.heads * hd, b, ops)
        self.k_proj = Linear(d, self.kv_heads * hd, b, ops)
        self.v_proj = Linear(d, self.kv_heads * hd, b, ops)
        self.o_proj = Linear(self.heads * hd, d, cfg.o_bias, ops)
        # q/k norm (Qwen3, Gemma 3: over head_dim, per head; OLMo 2: over the whole projection)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            dims = (hd, hd) if cfg.qk_norm == "head" else (self.heads * hd, self.kv_heads * hd)
            self.q_norm, self.k_norm = (RMSNorm(n, cfg.rms_norm_eps, ops, cfg.norm_offset) for n in dims)
        # Gemma's scale and soft-cap: arguments only where set (the plan runs such a model's
        # attention on the reference)
        self.family = {k: v for k, v in (("scale", cfg.query_scale), ("softcap", cfg.attn_softcap)) if v is not None}
        self.ops = ops

    def forward(self, x, ctx: Context, rec: Recorder, cache: KV | None = None, layer: int = 0):
        """cache: None (keys are this call's tokens), or this call's keys and values go to
        slots index[b] + t of row b in layer `layer`, and attention reads the cache."""
        B, T, _ = x.shape
        q, k, v = project(self.ops, x, (self.q_proj, self.k_proj, self.v_proj), ctx.policy)
        q = rec("q", q.view(B, T, self.heads, self.head_dim))
        k = rec("k", k.view(B, T, self.kv_heads, self.head_dim))
        v = rec("v", v.view(B, T, self.kv_heads, self.head_dim))
        if self.qk_norm == "head":
            q = rec("q_norm", self.q_norm(q, ctx.policy))
            k = rec("k_norm", self.k_norm(k, ctx.policy))
        elif self.qk_norm == "projection":
            q = rec("q_norm", self.q_norm(q.reshape(B, T, -1), ctx.policy).view(q.shape))
            k = rec("k_norm", self.k_norm(k.reshape(B, T, -1), ctx.policy).view(k.shape))
        cos, sin = self.key_tables(ctx, cache)
        q = rec("q_rope", self.ops.apply_rope(q, ctx.cos, ctx.sin))
        k = rec("k_rope", self.ops.apply_rope(k, cos, sin))
        # keys and values as the policy's kv_cache keeps them, in every call (the taps show them
        # as computed, before this rounding)
        k, v = self.ops.kv_round(k, ctx.policy), self.ops.kv_round(v, ctx.policy)
        allowed = ctx.allowed
        if cache is not None:
            # a [B, Hkv, S, D] tensor per layer, written in place: attention reads each kv head's
            # keys as a strided view, no copy (jaxmodel: one [L, B, S, Hkv, D] array)
            k_all, v_all = cache.k[layer], cache.v[layer]
            slots = self.write_slots(cache.index, T, k_all.shape[2])
            self.ops.write_cache(k_all, slots, self.stored(k))
            self.ops.write_cache(v_all, slots, self.stored(v))
            allowed = self.cache_allowed(ctx.allowed, cache.index)
            S = allowed.shape[-1]  # the slots this call may see (all of them by default)
            k, v = (t.narrow(2, 0, S).transpose(1, 2) for t in (k_all, v_all))
        out = rec("attn_ctx", self.ops.attention(q, k, v, allowed, ctx.policy, **self.family).reshape(B, T, -1))
        return self.o_proj(out, ctx.policy), cache

    # Seams: one step each of the cache path, which a planted-bug control may replace on one
    # layer (compare/controls); jaxmodel's Attention has the same four.
    def key_tables(self, ctx: Context, cache: KV | None):
        """The cos, sin tables this call's keys are rotated with: the call's own."""
        return ctx.cos, ctx.sin

    def write_slots(self, index: torch.Tensor, T: int, S: int) -> torch.Tensor:
        """The cache slots [B, T] of this call's keys in a cache of S slots: index[b] + t."""
        return index[:, None] + torch.arange(T, device=index.device)

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """A key or value as the cache keeps it: as computed."""
        return x

    def cache_allowed(self, allowed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The mask [B, T, S] over the cache this call attends with: the call's own."""
        return allowed


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, ops):
        super().__init__()
        d, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = Linear(d, f, b, ops), Linear(d, f, b, ops), Linear(f, d, b, ops)
        self.activation = cfg.activation      # the name of an op: "silu" or "gelu_tanh" (Gemma)
        self.ops = ops

    def forward(self, x, policy: Policy, rec: Recorder):
        gate, up = project(self.ops, x, (self.gate_proj, self.up_proj), policy)
        rec("gate", gate), rec("up", up)
        act = rec("act", self.ops.times(getattr(self.ops, self.activation)(gate), up, gate))
        del gate, up   # freed before down_proj's result is made
        return self.down_proj(act, policy)


class Block(nn.Module):
    """One layer. Its norms sit where the family puts them (cfg.norm_modules: role -> checkpoint
    name): attn_norm / mlp_norm on a sublayer's input (Llama; Gemma), post_attn_norm /
    post_mlp_norm on its output before the residual add (Gemma's sandwich, OLMo 2 without the
    input ones)."""

    def __init__(self, cfg: LlamaConfig, ops):
        super().__init__()
        self.roles = cfg.norm_modules
        for name in self.roles.values():
            self.add_module(name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, cfg.norm_offset))
        self.self_attn = Attention(cfg, ops)
        self.mlp = MLP(cfg, ops)

    def norm(self, role: str, x, policy: Policy, rec: Recorder):
        """The norm of this role applied to x (recorded as its tap), or x where the family has none."""
        name = self.roles.get(role)
        return x if name is None else rec(role, getattr(self, name)(x, policy))

    def forward(self, h, ctx: Context, rec: Recorder, cache: KV | None = None, layer: int = 0):
        residual, p = dt(ctx.policy.residual_dtype), ctx.policy
        h = cast(h, residual)      # a per-layer policy's residual dtype (a no-op otherwise)
        a, cache = self.self_attn(self.norm("attn_norm", h, p, rec), ctx, rec, cache, layer)
        a = self.norm("post_attn_norm", rec("attn_out", a), p, rec)
        h = rec("resid_mid", h + cast(a, residual))
        m = self.mlp(self.norm("mlp_norm", h, p, rec), p, rec)
        m = self.norm("post_mlp_norm", rec("mlp_out", m), p, rec)
        h = rec("out", h + cast(m, residual))
        return h, cache


class Llama(nn.Module):
    """The network. cfg, policy, plan and ops are plain attributes; parameter names are the
    checkpoint keys without the "model." prefix (lm_head keeps its own). torch modules are
    built shape-first, so weights are installed after (weights=None: shapes only). backend:
    reference, fast or invariant (None: llamaspec.plan.backend_name's rule)."""

    def __init__(self, cfg: LlamaConfig, policy: Policy, weights: dict[str, np.ndarray] | None = None,
                 batch_invariant: bool = False, device: str | torch.device = "cpu", backend: str | None = None,
                 quantized: dict | None = None):
        super().__init__()
        backend = backend_name(backend, batch_invariant)
        policy = policy.for_family(cfg.norm_weight_in_norm_dtype)    # the family's norm convention where left to it
        self.cfg, self.policy, self.batch_invariant = cfg, policy, backend == "invariant"
        policy.check_layers(cfg.num_hidden_layers)
        self.layer_policies = [policy.for_layer(i, cfg.num_hidden_layers) for i in range(cfg.num_hidden_layers)]
        self.device = torch.device(device)
        self.plan, self.ops = make_backend(policy, self.device, backend, cfg)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, self.ops) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ops, cfg.norm_offset)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, self.ops)
        if weights is not None:
            self._load(weights, quantized or {})

    def _load(self, weights: dict[str, np.ndarray], quantized: dict) -> None:
        """Rounds each checkpoint tensor to param_dtype and installs it under its HF key.

        When compute_dtype is wider than param_dtype (bf16w-f32) the rounded weights are
        kept widened, once, rather than on every matmul: identical values, less work.
        """
        shapes = {checkpoint_key(name): p.shape for name, p in self.named_parameters()}
        if set(shapes) != set(weights):
            raise KeyError(f"weights do not match the model: missing {sorted(set(shapes) - set(weights))}, "
                           f"unexpected {sorted(set(weights) - set(shapes))}")
        stray = sorted(k for k in quantized if not (is_projection(k) and self.policy_of(k).weight_fp8))
        if stray:
            raise KeyError(f"quantized weights given for {stray}: not projections this policy quantizes "
                           f"({self.policy.name})")
        for key, arr in weights.items():
            self._install(key, arr, shapes[key], quantized.get(key))

    def policy_of(self, key: str) -> Policy:
        """The policy a checkpoint tensor is kept by: its layer's (per-layer overrides), else the base."""
        layer = layer_of_key(key)
        return self.policy if layer is None else self.layer_policies[layer]

    def _param(self, arr: np.ndarray, key: str | None = None, quantized=None) -> torch.Tensor:
        """A checkpoint tensor as the model keeps it: rounded to param_dtype, then widened to
        compute_dtype when that is wider (bf16w-f32). A block projection's weight under weight_fp8
        is quantized (quantized: its (q, scales) given, e.g. the model's own for its float64 twin)
        and kept dequantized in the fp8 product dtype (ops.fp8_product_dtype)."""
        policy = self.policy if key is None else self.policy_of(key)
        store, compute = dt(policy.param_dtype), dt(policy.compute_dtype)
        if policy.weight_fp8 and is_projection(key):
            if quantized is None:
                quantized = quant.quantize(from_numpy(arr).to(store), policy.weight_fp8)
            q, scales = (t if isinstance(t, torch.Tensor) else from_numpy(t) for t in quantized)
            w = quant.dequantize(q, scales, policy.weight_fp8, fp8_product_dtype(policy))
            return w.to(self.device), (q, scales)
        keep = compute if torch.finfo(compute).bits > torch.finfo(store).bits else store
        return from_numpy(arr).to(store).to(keep).to(self.device)

    def _install(self, key: str, arr: np.ndarray, shape, quantized=None) -> None:
        t = self._param(arr, key, quantized)
        t, qs = t if isinstance(t, tuple) else (t, None)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{key}: shape {tuple(t.shape)} != model's {tuple(shape)}")
        self._set(key, nn.Parameter(t, requires_grad=False))
        if qs is not None:      # the fp8 values and scales, for quantized() (a Linear's attribute)
            self.get_submodule(key.removeprefix("model.").rpartition(".")[0]).fp8 = qs

    def contexts(self, positions: torch.Tensor, allowed: torch.Tensor) -> list[Context]:
        """Each layer's Context: its policy, the RoPE tables of its rope and policy (computed once
        per distinct rope / rope dtype / compute dtype), and its mask: `allowed`, within the layer's
        sliding window where it has one (sliding_allowed)."""
        tables, masks, out = {}, {}, []
        for i, p in enumerate(self.layer_policies):
            rope, window = self.cfg.rope_of(i), self.cfg.window(i)
            key = (rope, p.rope_dtype, p.compute_dtype)
            if key not in tables:
                tables[key] = rope_tables(self.cfg, p, self.ops, positions, rope)
            if window not in masks:
                masks[window] = allowed if window is None else sliding_allowed(allowed, window)
            out.append(Context(*tables[key], masks[window], p, positions))
        return out

    def _set(self, key: str, p: nn.Parameter) -> None:
        owner, _, name = key.removeprefix("model.").rpartition(".")
        self.get_submodule(owner)._parameters[name] = p

    def head_weight(self) -> torch.Tensor:
        """The lm_head's [vocab, hidden] matrix (the embedding table when tied)."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head).weight

    def forward(self, ids, positions, allowed, taps=(), cache: KV | None = None, last=None, inject=None):
        """Embedding -> blocks -> final norm -> lm_head; returns (logits, {tap: activation}, cache).

        ids, positions [B, T]; allowed [B, T, S]. last [B]: logits for slot last[b] of each
        row only. inject {i: h}: teacher forcing, layer i's input is replaced by h
        (rounded to that layer's residual dtype, as the block rounds any input).
        """
        policy = self.policy
        residual = dt(policy.residual_dtype)
        rec = Recorder(taps)
        h = rec("embed", self.embedding(self.embed_tokens(ids)))
        if cache is not None and isinstance(cache.index, np.ndarray):
            cache = cache._replace(index=torch.as_tensor(cache.index, device=ids.device))   # once per call
        ctxs = self.contexts(positions, allowed)
        for i, block in enumerate(self.layers):
            if inject and i in inject:
                h = inject[i]       # rounded to the layer's residual dtype by the block, as any input
            h, cache = block(h, ctxs[i], rec.layer(i), cache, i)
        x = rec("final_norm", self.norm(cast(h, residual), policy))
        if last is not None:
            x = _take_slots(x, last)
        logits = rec("logits", head_logits(x, self.head_weight(), self.ops, policy, self.cfg.final_softcap))
        return logits, rec.acts, cache

    def embedding(self, rows: torch.Tensor) -> torch.Tensor:
        """The embedding tap from the table's rows (as the model keeps them): scaled by
        sqrt(hidden_size) where the family says (Gemma), then rounded to the residual dtype."""
        if self.cfg.embed_scale:
            rows = self.ops.scale_embedding(rows, self.cfg.hidden_size)
        return rows.to(dt(self.policy.residual_dtype))


def checkpoint_key(name: str) -> str:
    """A Llama parameter's checkpoint key: "model." + its name, lm_head's as they are."""
    return name if name.startswith("lm_head.") else "model." + name


def rope_tables(cfg: LlamaConfig, policy: Policy, ops, positions: torch.Tensor, rope_config=None):
    """cos, sin [B, T, head_dim] for positions [B, T] (dynamic NTK reads the longest), computed in
    rope_dtype and rounded to compute_dtype, the dtype of the queries and keys apply_rope rounds
    them to: once per call here, not twice a layer there (the same values; HF's rotary embedding
    also rounds its tables once). rope_config: a layer's (cfg.rope_of), cfg.rope by default."""
    rope = dt(policy.rope_dtype)
    inv_freq = ops.rope_inv_freq(rope_config or cfg.rope, cfg.head_dim, cfg.max_position_embeddings,
                                 int(positions.max()) + 1, rope).to(positions.device)
    return tuple(t.to(dt(policy.compute_dtype)) for t in ops.rope_cos_sin(inv_freq, positions, rope))


def head_logits(x: torch.Tensor, head: torch.Tensor, ops, policy: Policy, softcap: float | None = None
                ) -> torch.Tensor:
    """The lm_head: final_norm output x times the [vocab, hidden] matrix (or a chunk of its rows),
    rounded to the policy's logits dtype; soft-capped there where the family caps them (Gemma 2)."""
    logits = ops.linear(x, head, None, policy, policy.logits_dtype)
    return logits if softcap is None else ops.soft_cap(logits, softcap)


class LlamaModel(nn.Module):
    """A loaded model: forward, activation capture, prefill/decode and generation (the
    API is in docs/guide.md). `model` is the network (a Llama)."""

    def __init__(self, module: Llama):
        super().__init__()
        self.cfg, self.policy, self.batch_invariant = module.cfg, module.policy, module.batch_invariant
        self.device, self.plan = module.device, module.plan
        self.model = module

    @property
    def ops(self):
        """The network's op namespace (its RoPE tables read it; each module holds its own)."""
        return self.model.ops

    @ops.setter
    def ops(self, namespace) -> None:
        self.model.ops = namespace

    def state_dict(self, *args, **kwargs):
        """The network's parameters under their checkpoint keys (Hugging Face's names), so a
        LlamaForCausalLM can load them as they are."""
        return {checkpoint_key(k): v for k, v in self.model.state_dict(*args, **kwargs).items()}

    def weights(self) -> dict[str, np.ndarray]:
        """The parameters under their checkpoint keys, as numpy in their layer's param_dtype (no
        lm_head when tied): the values the model computes with, ready for from_weights. A weight
        the policy quantizes (weight_fp8) comes back dequantized, rounded to param_dtype: give
        from_weights quantized() too to rebuild it exactly (quantizing is not idempotent)."""
        out = {}
        for name, p in self.model.named_parameters():
            key = checkpoint_key(name)
            out[key] = to_numpy(p.to(dt(self.model.policy_of(key).param_dtype)))
        return out

    def quantized(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{checkpoint key: (q, scales)} of every weight the policy quantizes (weight_fp8), numpy
        (ml_dtypes' fp8); from_weights(..., quantized=) installs them as they are."""
        return {checkpoint_key(name + ".weight"): tuple(to_numpy(t) for t in m.fp8)
                for name, m in self.model.named_modules() if getattr(m, "fp8", None) is not None}

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return from_numpy(np.asarray(a)).to(self.device)

    def _layout(self, ids, mask, extra_length=0) -> Layout:
        """The batch as the network runs it: canonical in batch-invariant mode."""
        return layout(self.cfg, ids, mask, self.model.ops.LAYOUT_MULTIPLE if self.batch_invariant else None,
                      extra_length)

    @torch.inference_mode()
    def forward(self, tokens, attention_mask=None) -> torch.Tensor:
        """Logits [B, T, V] in the policy's logits dtype."""
        ids, mask = check_tokens(self.cfg, tokens, attention_mask)
        run = self._layout(ids, mask)
        with check_matmul_settings(self.policy, self.device):
            logits, _, _ = self.model(self._tensor(run.ids), self._tensor(run.positions).long(),
                                      causal_allowed(self._tensor(run.mask), run.ids.shape[1]))
        return self._tensor(run.restore(to_numpy(logits))) if self.batch_invariant else logits

    @torch.inference_mode()
    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        """(logits, {tap: activation}) as numpy arrays in the dtypes they were computed in.

        inject: {layer index: array [B, T, hidden]} replaces the input of those layers
        (teacher forcing: feed every layer the oracle's input to measure its local error).
        """
        names = tapnames.resolve(taps, self.cfg)
        ids, mask = check_tokens(self.cfg, tokens, attention_mask)
        run = self._layout(ids, mask)
        forced = {i: self._tensor(run.place(x)) for i, x in check_inject(self.cfg, inject, ids.shape).items()}
        with check_matmul_settings(self.policy, self.device):
            logits, acts, _ = self.model(self._tensor(run.ids), self._tensor(run.positions).long(),
                                         causal_allowed(self._tensor(run.mask), run.ids.shape[1]), names,
                                         inject=forced)
        return run.restore(to_numpy(logits)), {n: run.restore(to_numpy(acts[n])) for n in names}

    # ----- generation ----------------------------------------------------------------
    # The cache is a dict: k, v (see KV), then mask [B, S] (slots holding a real token),
    # next_pos [B] (the next position per row) and index (the next write slot), as in
    # jaxmodel; batch-invariant mode keeps lens [B] in place of the last three.

    def _empty_cache(self, B: int, S: int) -> KV:
        """Keys and values in the backend's cache_dtype (compute_dtype, or the same values widened
        where its attention widens them); the write index on the host."""
        cfg, ops = self.cfg, self.model.ops
        shape = (B, cfg.num_key_value_heads, S, cfg.head_dim)
        zeros = [[torch.zeros(shape, dtype=ops.cache_dtype(p, self.device), device=self.device)
                  for p in self.model.layer_policies] for _ in "kv"]
        return KV(*zeros, np.zeros(B, np.int64))

    @torch.inference_mode()
    def prefill(self, ids: np.ndarray, mask: np.ndarray, total_len: int, inject=None):
        """Runs the left-aligned prompt, filling a cache of total_len slots. inject {layer:
        [B, T, hidden]}: teacher forcing, as capture takes it (the cache then holds the keys
        and values of the forced inputs)."""
        logits, cache, _ = self.prefill_capture(ids, mask, total_len, (), inject)
        return logits, cache

    @torch.inference_mode()
    def prefill_capture(self, ids: np.ndarray, mask: np.ndarray, total_len: int, taps=("layers.*.out",),
                        inject=None):
        """prefill, also returning the prompt's activations as the prefill computed them:
        (logits [B, V], cache, {tap: numpy [B, T, ...]}; logits and final_norm at the last
        slot only). probe where's decode circumstance feeds them back (teacher forcing)."""
        names = tapnames.resolve(taps, self.cfg)
        ids, mask = check_prefill(self.cfg, ids, mask, total_len)
        forced = {i: self._tensor(x) for i, x in check_inject(self.cfg, inject, ids.shape).items()}
        if self.batch_invariant:
            if forced or names:
                raise NotImplementedError("prefill: inject and taps are not taken in batch-invariant mode")
            return (*self._prefill_invariant(ids, mask, total_len), {})
        B, T = ids.shape
        kv = self._empty_cache(B, total_len)
        cache = {"k": kv.k, "v": kv.v, "mask": torch.zeros((B, total_len), dtype=torch.bool, device=self.device),
                 "next_pos": self._tensor(mask.sum(1).astype(np.int64)), "index": T}
        cache["mask"][:, :T] = self._tensor(mask.astype(bool))
        last = torch.full((B,), T - 1, device=self.device)
        with check_matmul_settings(self.policy, self.device):
            logits, acts, _ = self.model(self._tensor(ids), self._tensor(positions_from_mask(mask)).long(),
                                         causal_allowed(cache["mask"], T), names, cache=kv, last=last, inject=forced)
        return to_numpy(logits[:, -1]), cache, {n: to_numpy(acts[n]).copy() for n in names}

    @torch.inference_mode()
    def decode(self, cache, next_ids: np.ndarray):
        """One token per row at slot cache['index']; returns (logits [B, V], cache)."""
        logits, cache, _ = (self._decode_invariant if self.batch_invariant else self._decode)(cache, next_ids, ())
        return logits, cache

    @torch.inference_mode()
    def decode_capture(self, cache, next_ids: np.ndarray, taps=("layers.*.out",), inject=None):
        """decode, also returning the step's activations: (logits [B, V], cache, {tap:
        numpy [B, 1, ...]}), the taps of the one new position, as the decode path computed
        them (compare.ladder.decode judges them against a full recompute). inject {layer:
        [B, 1, hidden]}: teacher forcing of the new position (compare.ladder.decode's
        inherited taps)."""
        names = tapnames.resolve(taps, self.cfg)
        if self.batch_invariant:
            if inject:
                raise NotImplementedError("decode_capture: inject is not taken in batch-invariant mode")
            return self._decode_invariant(cache, next_ids, names)
        return self._decode(cache, next_ids, names, inject)

    def _decode(self, cache, next_ids, names, inject=None):
        i = cache["index"]
        B, S = cache["mask"].shape
        next_ids = check_next_ids(self.cfg, next_ids, B, i, S)
        forced = {k: self._tensor(x) for k, x in check_inject(self.cfg, inject, (B, 1)).items()}
        cache["mask"][:, i] = True
        kv = KV(cache["k"], cache["v"], np.full(B, i, np.int64))
        with check_matmul_settings(self.policy, self.device):
            logits, acts, _ = self.model(self._tensor(next_ids)[:, None], cache["next_pos"][:, None],
                                         causal_allowed(cache["mask"], 1, i), names, cache=kv, inject=forced)
        cache["index"] = i + 1
        cache["next_pos"] = cache["next_pos"] + 1
        return to_numpy(logits[:, -1]), cache, {n: to_numpy(acts[n]).copy() for n in names}

    def _prefill_invariant(self, ids: np.ndarray, mask: np.ndarray, total_len: int):
        """prefill in the canonical layout; the cache keeps per-row lengths ("lens")."""
        Kb = self.model.ops.KEY_BLOCK
        run = self._layout(ids, mask, extra_length=total_len - ids.shape[1])
        B, W = run.ids.shape
        kv = self._empty_cache(B, -(-max(total_len, W) // Kb) * Kb)
        cache = {"k": kv.k, "v": kv.v, "lens": self._tensor(run.mask.sum(1).astype(np.int64))}
        visible = torch.zeros((B, -(-W // Kb) * Kb), dtype=torch.int32, device=self.device)
        visible[:, :W] = self._tensor(run.mask)
        with check_matmul_settings(self.policy, self.device):
            logits, _, _ = self.model(self._tensor(run.ids), self._tensor(run.positions).long(),
                                      causal_allowed(visible, W), cache=kv, last=cache["lens"] - 1)
        return to_numpy(logits[:, -1]), cache

    def _decode_invariant(self, cache, next_ids: np.ndarray, names=()):
        """decode with a write slot per row (lens[b]); attends to the blocks in use only;
        returns (logits, cache, {tap: [B, 1, ...]} for the tap names asked)."""
        lens, Kb = cache["lens"], self.model.ops.KEY_BLOCK
        B, S, longest = lens.shape[0], cache["k"][0].shape[2], int(lens.max())
        next_ids = check_next_ids(self.cfg, next_ids, B, longest, S)
        width = min(S, -(-(longest + 1) // Kb) * Kb)
        allowed = (torch.arange(width, device=self.device)[None, :] <= lens[:, None])[:, None, :]
        with check_matmul_settings(self.policy, self.device):
            logits, acts, _ = self.model(self._tensor(next_ids)[:, None], lens[:, None], allowed, names,
                                         cache=KV(cache["k"], cache["v"], lens))
        cache["lens"] = lens + 1
        return to_numpy(logits[:, -1]), cache, {n: to_numpy(acts[n]).copy() for n in names}

    def generate(self, tokens, attention_mask=None, max_new_tokens: int = 32, do_sample=False,
                 temperature=1.0, top_k=None, top_p=None, seed=0, eos_token_ids=None,
                 pad_token_id=None) -> np.ndarray:
        """New token ids [B, N] (greedy unless do_sample); stops when every row hit EOS."""
        sampling = Sampling(do_sample, temperature, top_k, top_p, seed)
        return run_generation(self.cfg, self.prefill, self.decode, tokens, attention_mask,
                              max_new_tokens, eos_token_ids, pad_token_id, sampling)


class LayerRunner:
    """The model run one piece at a time over weights handed in as numpy (checkpoint keys
    and storage dtype), for a comparison that never holds the whole model
    (compare.ladder.stream). The same modules and steps as Llama.forward: a weightless
    Llama whose one block, final norm and lm_head chunk get their weights installed
    (rounded as Llama rounds them) for the call and dropped after it. Arrays in and
    out are numpy; a hidden state given to `block` is rounded to that layer's residual dtype.
    backend: reference or fast (the invariant backend needs the canonical layout: an error)."""

    def __init__(self, cfg: LlamaConfig, policy: str | Policy, device: str | None = None, backend: str = "fast"):
        if backend == "invariant":
            raise ValueError("LayerRunner: the invariant backend runs whole calls in the canonical layout; "
                             "a layer-streamed comparison takes backend='reference' or 'fast'")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.module = Llama(cfg, Policy.get(policy), device=device, backend=backend)
        self.plan = self.module.plan
        self.cfg, self.policy = cfg, self.module.policy
        self.ctxs: list[Context] | None = None

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return from_numpy(np.asarray(a)).to(self.module.device)

    def _residual(self, h: torch.Tensor) -> torch.Tensor:
        return h.to(dt(self.policy.residual_dtype))

    @torch.inference_mode()
    def start(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """The RoPE tables and the causal mask of one batch, for every later call."""
        ids, mask = check_tokens(self.cfg, ids, mask)
        positions = self._tensor(positions_from_mask(mask)).long()
        allowed = causal_allowed(self._tensor(mask), ids.shape[1])
        self.ctxs = self.module.contexts(positions, allowed)

    @torch.inference_mode()
    def embed(self, rows: np.ndarray) -> np.ndarray:
        """The embedding tap from the table's rows of the batch's ids ([B, T, hidden]):
        gathering then rounding equals rounding the table then gathering."""
        return to_numpy(self.module.embedding(self.module._param(rows)))

    @torch.inference_mode()
    def block(self, i: int, weights: dict[str, np.ndarray], h: np.ndarray, taps=()) -> dict[str, np.ndarray]:
        """Layer i on the hidden state h (layer i's input); {tap name: numpy} for the
        requested per-layer tap names ("layers.i.<name>") plus "layers.i.out" always."""
        m, block = self.module, self.module.layers[i]
        prefix = f"model.layers.{i}."
        shapes = {prefix + k: p.shape for k, p in block.named_parameters()}
        for key in shapes:
            m._install(key, weights[key], shapes[key])
        rec = Recorder({*taps, f"layers.{i}.out"})
        try:
            with check_matmul_settings(self.policy, m.device):
                block(self._tensor(h), self.ctxs[i], rec.layer(i))     # the block rounds h to its residual dtype
        finally:
            for key in shapes:
                m._set(key, _weight(*shapes[key]))
        return {n: to_numpy(a) for n, a in rec.acts.items()}

    @torch.inference_mode()
    def final_norm(self, weight: np.ndarray, h: np.ndarray) -> np.ndarray:
        m = self.module
        m._install("model.norm.weight", weight, (self.cfg.hidden_size,))
        with check_matmul_settings(self.policy, m.device):
            return to_numpy(m.norm(self._residual(self._tensor(h)), m.policy))

    @torch.inference_mode()
    def logits(self, x: np.ndarray, head_rows: np.ndarray) -> np.ndarray:
        """The logits of final_norm output x for the lm_head rows given (a vocabulary chunk)."""
        m = self.module
        with check_matmul_settings(self.policy, m.device):
            return to_numpy(head_logits(self._tensor(x), m._param(head_rows), m.ops, m.policy, self.cfg.final_softcap))


def _take_slots(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """x[b, last[b]] as [B, 1, ...]. When every row takes slot T-1 (a left-aligned prefill)
    this is the slice x[:, -1:], as it always was there: torch's matmul sums a strided view
    in another order than a gathered copy, so a gather would change those logits' bits."""
    if bool((last == x.shape[1] - 1).all()):
        return x[:, -1:]
    return x[torch.arange(x.shape[0], device=x.device), last][:, None]


def sliding_allowed(allowed: torch.Tensor, window: int) -> torch.Tensor:
    """allowed [B, T, S] limited to the keys less than `window` tokens back from each query
    (transformers: kv_idx > q_idx - window). Counted in the mask's own keys, not in slots: a query
    at position p sees its row's real keys at positions 0..p (the causal mask), so the key at
    position j has p - j allowed keys after it. Pad slots anywhere (left, interior, a cache's
    unused ones) then count for nothing, in every layout and cache the models use."""
    seen = allowed.to(torch.int32).cumsum(-1)
    return allowed & (seen[..., -1:] - seen < window)


def causal_allowed(mask: torch.Tensor, n_queries: int, first_query_slot: int = 0) -> torch.Tensor:
    """allowed[b, t, s]: slot s holds a real token and is not after query slot first + t."""
    S = mask.shape[1]
    q_slot = torch.arange(first_query_slot, first_query_slot + n_queries, device=mask.device)
    return mask.bool()[:, None, :] & (torch.arange(S, device=mask.device)[None, :] <= q_slot[:, None])


def from_weights(cfg: LlamaConfig, weights: dict[str, np.ndarray], policy: str | Policy = "fp32",
                 batch_invariant: bool = False, device: str | None = None, backend: str | None = None,
                 quantized: dict | None = None) -> LlamaModel:
    """A model from checkpoint-keyed numpy weights (as load_weights or weights() give them),
    each rounded to the policy's param_dtype. quantized {key: (q, scales)} (a model's quantized()):
    those weights installed from their fp8 values and scales instead of quantized here.

    backend: "reference" (ops.py), "fast" (the default) or "invariant" (= batch_invariant=True: a
    sequence's logits and greedy completions are bitwise the same whatever the rest of the batch,
    its row and its padding; see invariant.py and portable.py)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    module = Llama(cfg, Policy.get(policy), weights, batch_invariant, device, backend, quantized).eval()
    if module.batch_invariant:
        module.ops.self_check(module)     # the chosen path's check, on the model's device
    return LlamaModel(module).eval()


def from_pretrained(path: str | Path, policy: str | Policy = "fp32", batch_invariant: bool = False,
                    device: str | None = None, check_finite: bool = True, backend: str | None = None) -> LlamaModel:
    """Loads a Hugging Face Llama folder (config.json + safetensors) under a precision policy,
    computing on `backend` (from_weights)."""
    cfg, weights = load_weights(path, check_finite=check_finite)
    return from_weights(cfg, weights, policy, batch_invariant, device, backend)
