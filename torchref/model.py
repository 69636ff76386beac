"""A plain PyTorch Llama: the reference implementation.

Module and parameter names mirror Hugging Face's, so `state_dict()` keys are the
checkpoint keys and loading is one-to-one. The math lives in ops.py; modules only
hold weights and wire ops together. Every step follows the precision policy.

batch_invariant=True swaps ops.py for invariant.py (same function names; why each
change is needed is measured and written there) and runs every call in the canonical
layout of llamaspec.inputs.invariant_layout: each row's real tokens at slots [0, n),
positions 0..n-1, width a multiple of LAYOUT_MULTIPLE. Results go back to the caller's slots
(padding slots hold zeros). The KV cache keeps that layout: row b's tokens fill slots
[0, lens[b]) and each decode step writes at its own row's slot lens[b], so a row's keys
sit in the same blocks whatever the other rows' lengths; decode attends to the blocks up
to the longest row only (the blocks after are all masked and would add exact zeros).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from torch import nn

from llamaspec import LlamaConfig, Policy, Sampling, check_tokens, load_weights, positions_from_mask
from llamaspec import generate as run_generation
from llamaspec import taps as tapnames
from llamaspec.inputs import check_inject, check_next_ids, check_prefill, from_canonical, invariant_layout, to_canonical

from . import invariant, ops
from .dtypes import dt, from_numpy, matmul_settings, to_numpy


class Recorder:
    """Collects the requested taps; asking for none costs one set lookup per tap."""

    def __init__(self, wanted=()):
        self.wanted = set(wanted)
        self.acts: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, x: torch.Tensor) -> None:
        if name in self.wanted:
            self.acts[name] = x


def _weight(*shape) -> nn.Parameter:
    # Shape-only placeholder: real tensors are installed by LlamaModel.load_numpy.
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool, kernels=ops):
        super().__init__()
        self.weight = _weight(n_out, n_in)
        self.bias = _weight(n_out) if bias else None
        self.ops = kernels

    def forward(self, x, policy: Policy, out_dtype: str | None = None):
        return self.ops.linear(x, self.weight, self.bias, policy, out_dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels=ops):
        super().__init__()
        self.weight = _weight(dim)
        self.eps = eps
        self.ops = kernels

    def forward(self, x, policy: Policy):
        return self.ops.rms_norm(x, self.weight, self.eps, policy)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels=ops):
        super().__init__()
        d, hd, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = Linear(d, self.n_heads * hd, b, kernels)
        self.k_proj = Linear(d, self.n_kv * hd, b, kernels)
        self.v_proj = Linear(d, self.n_kv * hd, b, kernels)
        self.o_proj = Linear(self.n_heads * hd, d, b, kernels)
        self.ops = kernels

    def forward(self, x, cos, sin, allowed, policy, rec, p, kv=None, index=0):
        B, T, _ = x.shape
        projs = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = self.ops.linears(x, [m.weight for m in projs], [m.bias for m in projs], policy)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k, v = k.view(B, T, self.n_kv, self.head_dim), v.view(B, T, self.n_kv, self.head_dim)
        rec(p + "q", q), rec(p + "k", k), rec(p + "v", v)
        q, k = self.ops.apply_rope(q, cos, sin), self.ops.apply_rope(k, cos, sin)
        rec(p + "q_rope", q), rec(p + "k_rope", k)
        if kv is not None:  # write this call's keys/values into their cache slots
            # The cache is stored [B, Hkv, S, D] so attention reads it without copies;
            # it is handed on as a [B, S, Hkv, D] view, the layout ops.attention takes.
            # index: one slot for every row, or (batch-invariant decode) a slot per row.
            if isinstance(index, torch.Tensor):
                rows = torch.arange(B, device=index.device)
                kv[0][rows, :, index], kv[1][rows, :, index] = k[:, 0], v[:, 0]
            else:
                kv[0][:, :, index:index + T] = k.transpose(1, 2)
                kv[1][:, :, index:index + T] = v.transpose(1, 2)
            S = allowed.shape[-1]  # the slots this call may see (all of them by default)
            k, v = kv[0][:, :, :S].transpose(1, 2), kv[1][:, :, :S].transpose(1, 2)
        ctx = self.ops.attention(q, k, v, allowed, policy).reshape(B, T, -1)
        rec(p + "attn_ctx", ctx)
        return self.o_proj(ctx, policy)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels=ops):
        super().__init__()
        d, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = (Linear(d, f, b, kernels), Linear(d, f, b, kernels),
                                                        Linear(f, d, b, kernels))
        self.ops = kernels

    def forward(self, x, policy, rec, p):
        projs = (self.gate_proj, self.up_proj)
        gate, up = self.ops.linears(x, [m.weight for m in projs], [m.bias for m in projs], policy)
        act = self.ops.silu(gate) * up
        rec(p + "gate", gate), rec(p + "up", up), rec(p + "act", act)
        return self.down_proj(act, policy)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels=ops):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg, kernels)

    def forward(self, h, cos, sin, allowed, policy, rec, p, kv=None, index=0):
        residual = dt(policy.residual_dtype)
        x = self.input_layernorm(h, policy)
        rec(p + "attn_norm", x)
        a = self.self_attn(x, cos, sin, allowed, policy, rec, p, kv, index)
        rec(p + "attn_out", a)
        h = h + a.to(residual)
        rec(p + "resid_mid", h)
        x = self.post_attention_layernorm(h, policy)
        rec(p + "mlp_norm", x)
        m = self.mlp(x, policy, rec, p)
        rec(p + "mlp_out", m)
        h = h + m.to(residual)
        rec(p + "out", h)
        return h


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = _weight(vocab, dim)


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels=ops):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, kernels) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)


class LlamaModel(nn.Module):
    """Llama for causal LM. Call it on [B, T] token ids; see the README for the API."""

    def __init__(self, cfg: LlamaConfig, policy: Policy, device: str | torch.device = "cpu",
                 batch_invariant: bool = False):
        super().__init__()
        self.cfg, self.policy, self.device = cfg, policy, torch.device(device)
        self.batch_invariant = batch_invariant
        self.ops = invariant if batch_invariant else ops
        self.model = Backbone(cfg, self.ops)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False,
                                                                   self.ops)

    # ----- loading -------------------------------------------------------------------

    def load_numpy(self, weights: dict[str, np.ndarray]) -> "LlamaModel":
        """Rounds each checkpoint tensor to param_dtype and installs it under its HF key.

        When compute_dtype is wider than param_dtype (bf16w-f32) the rounded weights are
        kept widened, once, rather than on every matmul: identical values, less work.
        """
        params = dict(self.named_parameters())
        if set(params) != set(weights):
            raise KeyError(f"weights do not match the model: missing {sorted(set(params) - set(weights))}, "
                           f"unexpected {sorted(set(weights) - set(params))}")
        store = dt(self.policy.param_dtype)
        keep = dt(self.policy.compute_dtype) if torch.finfo(dt(self.policy.compute_dtype)).bits > \
            torch.finfo(store).bits else store
        for key, arr in weights.items():
            t = from_numpy(arr).to(store).to(keep).to(self.device)
            if tuple(t.shape) != tuple(params[key].shape):
                raise ValueError(f"{key}: shape {tuple(t.shape)} != model's {tuple(params[key].shape)}")
            owner, _, name = key.rpartition(".")
            self.get_submodule(owner)._parameters[name] = nn.Parameter(t, requires_grad=False)
        self.head_weight = self._lm_head_weight().detach()  # a plain tensor: not a second parameter
        return self

    def weights(self) -> dict[str, np.ndarray]:
        """The parameters under their checkpoint keys, as numpy in param_dtype (no lm_head
        when tied): the values the model computes with, ready for from_weights."""
        store = dt(self.policy.param_dtype)
        return {key: to_numpy(p.to(store)) for key, p in self.named_parameters()}

    # ----- forward -------------------------------------------------------------------

    def _lm_head_weight(self) -> torch.Tensor:
        """The lm_head matrix as ops.linear will use it, prepared once at load.

        bf16/fp16 policies keep logits in f32: ops.linear then multiplies in f32 and would
        widen this [vocab, hidden] matrix on every call, so it is widened here instead
        (exact: every bf16/fp16 value is an f32 value).
        """
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        wide = dt(self.policy.logits_dtype)
        if wide == dt(self.policy.accum_dtype) and torch.finfo(wide).bits > torch.finfo(w.dtype).bits:
            return w.to(wide)
        return w

    def _rope(self, positions: torch.Tensor):
        cfg, rope_dtype = self.cfg, dt(self.policy.rope_dtype)
        seq_len = int(positions.max()) + 1
        inv_freq = self.ops.rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings,
                                          seq_len, rope_dtype).to(self.device)
        return self.ops.rope_cos_sin(inv_freq, positions, rope_dtype)

    def _run(self, ids, positions, allowed, rec, cache=None, index=0, last_only=False, inject=None):
        """Embedding -> blocks -> final norm -> lm_head, recording taps on the way.

        inject {i: h}: teacher forcing, the residual stream entering layer i is replaced
        by h (cast to residual_dtype), whatever the layers before it produced.
        last_only: logits for slot T-1 only; or a [B] tensor of one slot per row.
        """
        policy = self.policy
        residual = dt(policy.residual_dtype)
        h = self.model.embed_tokens.weight[ids].to(residual)
        rec("embed", h)
        cos, sin = self._rope(positions)
        for i, block in enumerate(self.model.layers):
            if inject and i in inject:
                h = inject[i].to(residual)
            kv = None if cache is None else (cache["k"][i], cache["v"][i])
            h = block(h, cos, sin, allowed, policy, rec, f"layers.{i}.", kv, index)
        x = self.model.norm(h, policy)
        rec("final_norm", x)
        if isinstance(last_only, torch.Tensor):
            x = x[torch.arange(x.shape[0], device=x.device), last_only][:, None]
        elif last_only:
            x = x[:, -1:]
        logits = self.ops.linear(x, self.head_weight, None, policy, policy.logits_dtype)
        rec("logits", logits)
        return logits

    def _inputs(self, tokens, attention_mask, extra_length=0):
        ids, mask = check_tokens(self.cfg, tokens, attention_mask, extra_length)
        pos = positions_from_mask(mask)
        return (torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device),
                torch.from_numpy(pos).long().to(self.device))

    @staticmethod
    def _causal(mask: torch.Tensor, n_queries: int, first_query_slot: int = 0) -> torch.Tensor:
        """allowed[b, t, s]: slot s holds a real token and is not after query slot t."""
        S = mask.shape[1]
        q_slot = torch.arange(first_query_slot, first_query_slot + n_queries, device=mask.device)
        return mask.bool()[:, None, :] & (torch.arange(S, device=mask.device)[None, :] <= q_slot[:, None])

    def _canonical(self, ids: torch.Tensor, mask: torch.Tensor):
        """Batch-invariant mode: (ids, mask, positions) in the canonical layout
        (llamaspec.inputs.invariant_layout) for checked inputs, and a function that puts a
        canonical result [B, W, ...] back into the caller's slots (zeros on padding)."""
        mask_np = mask.cpu().numpy()
        ids_c, mask_c, back = invariant_layout(self.cfg, ids.cpu().numpy(), mask_np, invariant.LAYOUT_MULTIPLE)
        to = functools.partial(torch.as_tensor, device=self.device)

        def restore(x: torch.Tensor) -> torch.Tensor:
            return from_numpy(from_canonical(to_numpy(x), back, mask_np)).to(self.device)
        return to(ids_c), to(mask_c), to(positions_from_mask(mask_c)).long(), back, restore

    @torch.inference_mode()
    def forward(self, tokens, attention_mask=None) -> torch.Tensor:
        """Logits [B, T, V] in the policy's logits dtype."""
        ids, mask, pos = self._inputs(tokens, attention_mask)
        with matmul_settings(self.policy):
            if self.batch_invariant:
                ids_c, mask_c, pos_c, _, restore = self._canonical(ids, mask)
                logits = self._run(ids_c, pos_c, self._causal(mask_c, ids_c.shape[1]), Recorder())
                return restore(logits)
            return self._run(ids, pos, self._causal(mask, ids.shape[1]), Recorder())

    @torch.inference_mode()
    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        """(logits, {tap: activation}) as numpy arrays in the dtypes they were computed in.

        inject: {layer index: array [B, T, hidden]} replaces the input of those layers
        (teacher forcing: feed every layer the oracle's input to measure its local error).
        """
        wanted = tapnames.resolve(taps, self.cfg.num_hidden_layers)
        ids, mask, pos = self._inputs(tokens, attention_mask)
        forced = {i: from_numpy(np.asarray(x)).to(self.device)
                  for i, x in check_inject(self.cfg, inject, ids.shape).items()}
        rec = Recorder(wanted)
        with matmul_settings(self.policy):
            if self.batch_invariant:
                ids_c, mask_c, pos_c, back, restore = self._canonical(ids, mask)
                forced = {i: from_numpy(to_canonical(to_numpy(x), back, mask.cpu().numpy(), ids_c.shape[1]))
                          .to(self.device) for i, x in forced.items()}
                logits = self._run(ids_c, pos_c, self._causal(mask_c, ids_c.shape[1]), rec, inject=forced)
                logits = restore(logits)
                rec.acts = {k: restore(a) for k, a in rec.acts.items()}
            else:
                logits = self._run(ids, pos, self._causal(mask, ids.shape[1]), rec, inject=forced)
        return to_numpy(logits), {k: to_numpy(rec.acts[k]) for k in wanted}

    # ----- generation ----------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, ids: np.ndarray, mask: np.ndarray, total_len: int):
        """Runs the left-aligned prompt, filling a cache of total_len slots."""
        ids, mask = check_prefill(self.cfg, ids, mask, total_len)
        if self.batch_invariant:
            return self._prefill_invariant(ids, mask, total_len)
        B, T = ids.shape
        cfg, compute = self.cfg, dt(self.policy.compute_dtype)
        shape = (B, cfg.num_key_value_heads, total_len, cfg.head_dim)
        cache = {"k": [torch.zeros(shape, dtype=compute, device=self.device) for _ in range(cfg.num_hidden_layers)],
                 "v": [torch.zeros(shape, dtype=compute, device=self.device) for _ in range(cfg.num_hidden_layers)],
                 "mask": torch.zeros((B, total_len), dtype=torch.int32, device=self.device),
                 "next_pos": torch.from_numpy(mask.sum(1).astype(np.int64)).to(self.device),
                 "index": T}
        cache["mask"][:, :T] = torch.from_numpy(mask).to(self.device)
        pos = torch.from_numpy(positions_from_mask(mask)).long().to(self.device)
        with matmul_settings(self.policy):
            logits = self._run(torch.from_numpy(ids).to(self.device), pos,
                               self._causal(cache["mask"], T), Recorder(), cache, 0, last_only=True)
        return to_numpy(logits[:, -1]), cache

    @torch.inference_mode()
    def decode(self, cache, next_ids: np.ndarray):
        """One token per row at slot cache['index']; returns (logits [B, V], cache)."""
        if self.batch_invariant:
            return self._decode_invariant(cache, next_ids)
        i = cache["index"]
        B, S = cache["mask"].shape
        next_ids = check_next_ids(self.cfg, next_ids, B, i, S)
        cache["mask"][:, i] = 1
        ids = torch.from_numpy(next_ids).to(self.device)[:, None]
        pos = cache["next_pos"][:, None]
        with matmul_settings(self.policy):
            logits = self._run(ids, pos, self._causal(cache["mask"], 1, i), Recorder(), cache, i)
        cache["index"] = i + 1
        cache["next_pos"] = cache["next_pos"] + 1
        return to_numpy(logits[:, -1]), cache

    def _prefill_invariant(self, ids: np.ndarray, mask: np.ndarray, total_len: int):
        """prefill in the canonical layout; the cache keeps per-row lengths ("lens")."""
        cfg, Kb = self.cfg, invariant.KEY_BLOCK
        ids_c, mask_c, _ = invariant_layout(cfg, ids, mask, invariant.LAYOUT_MULTIPLE,
                                            extra_length=total_len - ids.shape[1])
        B, W = ids_c.shape
        S = -(-max(total_len, W) // Kb) * Kb
        compute = dt(self.policy.compute_dtype)
        shape = (B, cfg.num_key_value_heads, S, cfg.head_dim)
        cache = {"k": [torch.zeros(shape, dtype=compute, device=self.device) for _ in range(cfg.num_hidden_layers)],
                 "v": [torch.zeros(shape, dtype=compute, device=self.device) for _ in range(cfg.num_hidden_layers)],
                 "lens": torch.from_numpy(mask_c.sum(1).astype(np.int64)).to(self.device)}
        visible = torch.zeros((B, -(-W // Kb) * Kb), dtype=torch.int32, device=self.device)
        visible[:, :W] = torch.from_numpy(mask_c).to(self.device)
        pos = torch.from_numpy(positions_from_mask(mask_c)).long().to(self.device)
        with matmul_settings(self.policy):
            logits = self._run(torch.from_numpy(ids_c).to(self.device), pos, self._causal(visible, W),
                               Recorder(), cache, 0, last_only=cache["lens"] - 1)
        return to_numpy(logits[:, -1]), cache

    def _decode_invariant(self, cache, next_ids: np.ndarray):
        """decode with a write slot per row (lens[b]); attends to the blocks in use only."""
        lens, Kb = cache["lens"], invariant.KEY_BLOCK
        B, S, longest = lens.shape[0], cache["k"][0].shape[2], int(lens.max())
        next_ids = check_next_ids(self.cfg, next_ids, B, longest, S)
        width = min(S, -(-(longest + 1) // Kb) * Kb)
        allowed = (torch.arange(width, device=self.device)[None, :] <= lens[:, None])[:, None, :]
        ids = torch.from_numpy(next_ids).to(self.device)[:, None]
        with matmul_settings(self.policy):
            logits = self._run(ids, lens[:, None], allowed, Recorder(), cache, lens)
        cache["lens"] = lens + 1
        return to_numpy(logits[:, -1]), cache

    def generate(self, tokens, attention_mask=None, max_new_tokens: int = 32, do_sample=False,
                 temperature=1.0, top_k=None, top_p=None, seed=0, eos_token_ids=None,
                 pad_token_id=None) -> np.ndarray:
        """New token ids [B, N] (greedy unless do_sample); stops when every row hit EOS."""
        sampling = Sampling(do_sample, temperature, top_k, top_p, seed)
        return run_generation(self.cfg, self.prefill, self.decode, tokens, attention_mask,
                              max_new_tokens, eos_token_ids, pad_token_id, sampling)


def from_weights(cfg: LlamaConfig, weights: dict[str, np.ndarray], policy: str | Policy = "fp32",
                 batch_invariant: bool = False, device: str | None = None) -> LlamaModel:
    """A model from checkpoint-keyed numpy weights (as load_weights or weights() give them),
    each rounded to the policy's param_dtype.

    batch_invariant=True: a sequence's logits and greedy completions are bitwise the same
    whatever the rest of the batch, its row and its padding (see invariant.py)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = LlamaModel(cfg, Policy.get(policy), device, batch_invariant).load_numpy(weights).eval()
    if batch_invariant:
        invariant.self_check(model)
    return model


def from_pretrained(path: str | Path, policy: str | Policy = "fp32", batch_invariant: bool = False,
                    device: str | None = None, check_finite: bool = True) -> LlamaModel:
    """Loads a Hugging Face Llama folder (config.json + safetensors) under a precision policy."""
    cfg, weights = load_weights(path, check_finite=check_finite)
    return from_weights(cfg, weights, policy, batch_invariant, device)
