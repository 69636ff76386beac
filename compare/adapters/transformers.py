"""A transformers LlamaForCausalLM (or a relative's *ForCausalLM) under the Implementation protocol.

One wrapper for everything the package does with a user's transformers model:

    m = TransformersModel(model)            # used as given: its dtype, device, attention backend
    logits, acts = m.capture(tokens, mask, taps=("layers.*.out",), inject={1: h})   # the ladder
    logits = m(tokens, attention_mask=mask)                                           # the probes
    logits, cache = m.prefill(ids, mask, total_len); logits, cache = m.decode(cache, next_ids)
    twin = m.float64()                      # a float64 deep copy; `model` is left as is

Taps come from forward hooks and forward pre-hooks on module boundaries, registered for
one call and removed in a `finally` (transformers' own lazily installed hooks are not
touched):

    tap         hook                                           tap        hook
    embed       embed_tokens output                            mlp_norm   post_attention_layernorm output
    attn_norm   input_layernorm output                         gate, up   gate_proj / up_proj output
    q, k, v     q_proj / k_proj / v_proj output, [B,T,H,D]     act        down_proj input (silu(gate)*up)
    attn_ctx    o_proj input                                   mlp_out    mlp output
    attn_out    o_proj output                                  out        decoder layer output
    resid_mid   post_attention_layernorm input                 final_norm model.norm output
                                                               logits     what the model returns

The relatives (llamaspec.config.FAMILIES: Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, OLMo 2) are
the same modules with the family's steps (llamaspec.taps.steps_of), read by role from the
config (cfg.norm_modules: which checkpoint module is which norm):

    attn_norm, mlp_norm         the module cfg.norm_modules names for the role, output (OLMo 2
                                has neither: its norms follow the sublayers)
    post_attn_norm, post_mlp_norm   likewise (Gemma 2/3's sandwich norms, OLMo 2's)
    resid_mid                   the input of the mlp_norm module, or of the mlp where there is none
    q_norm, k_norm              self_attn.q_norm / k_norm output, per head [B,T,H,D] (Qwen3 norms
                                [B,T,H,D], Gemma 3 [B,H,T,D], OLMo 2 the whole [B,T,H*D] projection)
    q_rope, k_rope              recomputed from q_norm / k_norm's output where the family has them
    embed                       embed_tokens output: Gemma's scaled embedding (times
                                sqrt(hidden_size)), the hidden state entering layer 0
    logits                      after the final soft-cap (Gemma 2), as the model returns them

    q_rope, k_rope   q_proj / k_proj output with RoPE applied by the model's own
                     apply_rotary_pos_emb, with the cos/sin this layer's self_attn was
                     called with (its position_embeddings: what rotary_emb returned, or
                     what a hook on that layer put in its place)

transformers applies RoPE inside LlamaAttention.forward, a plain function call with no
module boundary, so q_rope and k_rope are not hooked but recomputed from what is: the
same function on the same tensors in the same dtypes, elementwise, so bitwise what the
attention computes when its forward is the standard one (a patched attention forward
that rotates otherwise is seen from attn_ctx on, not here). Recorded this way, a RoPE
table computed in lower precision (angles in bf16) shows at layer 0's q_rope, where the
error is largest relative to the values, rather than diluted in attention's output.

Positions. Every call passes position_ids = cumsum(mask) - 1, as torchref and jaxmodel
compute them. Called without them, transformers' LlamaModel.forward gives every row
arange(past, past + T) whatever the mask (only `generate()` derives them from the mask),
so a left-padded row's first real token sits at position k. positions="default" runs
that default, what a user who calls the model directly gets: harmless for contiguous
left padding in a RoPE model (scores depend on position differences; outputs move at
rounding level), not where absolute positions enter the math (dynamic NTK scaling) or
when the two conventions are mixed (a mask-positioned prefill, default-positioned decode).

Attention backend: the model runs with whatever `config._attn_implementation` it has
(transformers 5 defaults to "sdpa"). Eager attention (matmul, f32 softmax, matmul) is
the arithmetic torchref's fp64-hf policy reproduces bit for bit.
"""

from __future__ import annotations

import copy
import inspect
import sys
import types
import warnings

import numpy as np
import torch

from llamaspec import ConfigError, LlamaConfig, Policy, Sampling, check_tokens, load_weights, positions_from_mask
from llamaspec import generate as run_generation
from llamaspec import taps as tapnames
from llamaspec.checkpoint import validated
from llamaspec.config import FAMILIES
from llamaspec.inputs import check_inject, check_next_ids, check_prefill, check_token_array
from torchref.dtypes import TORCH, dt, from_numpy, to_numpy

from .generic import first_input, first_tensor, forcing_hook

# Tap kinds a transformers Llama cannot give, with the reason (none today: q_rope/k_rope
# are recomputed, see the module docstring). Subclasses for other architectures add theirs.
UNAVAILABLE: dict[str, str] = {}

# Where a family's q_norm / k_norm run: on [B, T, H, D] (per head, before the transpose), on
# [B, H, T, D] (per head, after it: Gemma 3), or on the whole projection [B, T, H*D] (OLMo 2).
BEFORE_TRANSPOSE, AFTER_TRANSPOSE, PROJECTION = "heads", "heads first", "projection"
QK_NORM_LAYOUT = {"qwen3": BEFORE_TRANSPOSE, "gemma3_text": AFTER_TRANSPOSE, "olmo2": PROJECTION}


def causal_lm_class(model_type: str) -> str:
    """transformers' *ForCausalLM class name of a config's model_type (llamaspec.config.FAMILIES)."""
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not a model llama-parity implements "
                          f"(it reads {', '.join(FAMILIES)})")
    return FAMILIES[model_type][0] + "ForCausalLM"


def _apply_rope(attention):
    """The apply_rotary_pos_emb that `attention`'s own module calls (looked up at call time,
    so a patched one is the one used)."""
    return sys.modules[type(attention).__module__].apply_rotary_pos_emb

# transformers 5.24, eager attention, float64 model: the additive mask holds float64's
# minimum, which becomes -inf when the scores are cast to float32 for the softmax. A
# query slot with no real token at or before it (left padding) then gets an all -inf
# row, softmax gives NaN there, and from the next layer on that NaN reaches every real
# position of the row through 0 * NaN in probs @ V. float32/bf16 models (finite mask
# minimum) and sdpa attention are not affected, nor is right padding.
EAGER_F64_LEFT_PADDING = (
    "transformers' eager attention in a float64 model gives NaN for query slots that see no "
    "real token (left padding): the float64 mask minimum becomes -inf in its float32 softmax, "
    "and from the next layer on the NaN reaches the row's real positions through 0 * NaN in "
    "probs @ V. Use attn_implementation='sdpa' for float64 runs (copy_at(model, 'float64', "
    "attn_implementation='sdpa'); not for Gemma 2, whose soft-capped attention transformers runs "
    "eager only), right padding, or one row per call.")

def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy copy (the hooked tensor may be reused by the model), bf16 kept as bf16."""
    return to_numpy(t).copy()


def _from_numpy(a) -> torch.Tensor:
    return a if isinstance(a, torch.Tensor) else from_numpy(a)


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if name not in TORCH:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(TORCH)}")
    return TORCH[name]


def copy_at(model, dtype, attn_implementation: str | None = None):
    """A deep copy of `model` cast to `dtype` (torch dtype or name: "float64", ...).

    The user's instance is never modified: the engine uses this to get e.g. an fp64
    oracle copy of a bf16 model. Non-persistent buffers (RoPE inverse frequencies) are
    cast too; transformers' Llama converts them back to float32 before use.
    attn_implementation switches the copy's attention backend ("eager", "sdpa"); by
    default the copy keeps the model's. Note EAGER_F64_LEFT_PADDING before making a
    float64 copy of an eager model for left-padded inputs.
    """
    dt = _torch_dtype(dtype)
    twin = copy.deepcopy(model).to(dt)
    twin.config.dtype = dt
    if attn_implementation is not None:
        twin.set_attn_implementation(attn_implementation)
    return twin




POSITIONS = ("mask", "default")


def _config(model) -> LlamaConfig | types.SimpleNamespace:
    """Our config: the family's tap steps and norm roles, and the generation loop's checks (length
    limit, EOS, pad id). A Llama config with a field we do not implement still gets the loop's
    fields (a Llama's taps); a relative's is refused (its norms' roles come from the config)."""
    try:
        return LlamaConfig.from_dict(model.config.to_dict(), source="transformers config")
    except ConfigError:  # a field we do not implement: the loop needs only these
        if FAMILIES.get(getattr(model.config, "model_type", None), ("",))[0] != "Llama":
            raise
        c = model.config
        eos = c.eos_token_id if isinstance(c.eos_token_id, (list, tuple)) else (
            [] if c.eos_token_id is None else [c.eos_token_id])
        return types.SimpleNamespace(vocab_size=c.vocab_size, eos_token_ids=tuple(eos),
                                     pad_token_id=c.pad_token_id,
                                     max_position_embeddings=c.max_position_embeddings,
                                     rope=types.SimpleNamespace(type="default", factor=1.0))


class TransformersModel:
    """Taps, logits, prefill/decode and greedy generation on a transformers LlamaForCausalLM or a
    relative's class (llamaspec.config.FAMILIES), numpy in and out, under llamaspec's tap names
    and position convention."""

    package = "transformers"
    unavailable_taps = dict(UNAVAILABLE)
    keeps_f32 = True   # its float64 run keeps f32 steps (norm, RoPE, softmax)

    def __init__(self, model, positions: str = "mask", checkpoint=None, unpadded_rows: bool = False):
        backbone = getattr(model, "model", None)
        layers = getattr(backbone, "layers", None)
        cfg = _config(model) if getattr(model, "config", None) is not None else None
        norms = tuple(cfg.norm_modules.values()) if isinstance(cfg, LlamaConfig) else (
            "input_layernorm", "post_attention_layernorm")
        needed = ("self_attn", "mlp", *norms) + (("self_attn.q_norm", "self_attn.k_norm")
                                                 if getattr(cfg, "qk_norm", None) else ())
        if layers is None or getattr(model, "lm_head", None) is None or not all(
                _has(layer, n) for layer in layers for n in needed):
            what = (f"a transformers {causal_lm_class(cfg.model_type)}" if isinstance(cfg, LlamaConfig)
                    else "a transformers LlamaForCausalLM")
            raise TypeError(f"TransformersModel needs {what} (model.model.layers[i]."
                            f"{{{','.join(needed)}}}, model.lm_head), got {type(model).__name__}")
        if getattr(cfg, "qk_norm", None) and cfg.model_type not in QK_NORM_LAYOUT:
            raise ValueError(f"model_type {cfg.model_type!r} norms its queries and keys ({cfg.qk_norm}), but "
                             "QK_NORM_LAYOUT does not say on which layout its transformers class calls q_norm")
        if positions not in POSITIONS:
            raise ValueError(f"positions={positions!r}: use one of {POSITIONS}")
        if model.training and getattr(model.config, "attention_dropout", 0.0):
            raise ValueError("the transformers model is in training mode with attention_dropout="
                             f"{model.config.attention_dropout}: its outputs are random; call model.eval()")
        self.model = model
        self.positions = positions
        self.checkpoint = checkpoint
        # capture a padded batch one row at a time on its real tokens (the float64 copies:
        # EAGER_F64_LEFT_PADDING); real positions see the same math, padding slots hold 0
        self.unpadded_rows = unpadded_rows
        self.config = model.config
        self.cfg = cfg
        self.num_layers = len(layers)
        self.attn_implementation = getattr(model.config, "_attn_implementation", None)
        self.taps = tuple(t for t in tapnames.all_taps(self._shape)
                          if tapnames.parse(t)[1] not in self.unavailable_taps)
        params = inspect.signature(model.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def _shape(self):
        """What llamaspec.taps reads the tap names from: our config (the family's steps), or the
        layer count (a Llama's steps) for a config we do not implement."""
        return self.cfg if isinstance(self.cfg, LlamaConfig) else self.num_layers

    @classmethod
    def from_pretrained(cls, folder, policy="fp32", attn_implementation: str = "eager",
                        positions: str = "mask") -> "TransformersModel":
        """Loads the folder at the policy's param dtype with transformers' class for its config's
        model_type (LlamaForCausalLM, Qwen2ForCausalLM, Gemma2ForCausalLM...: causal_lm_class);
        transformers then runs its own dtype handling (f32 norm, RoPE and softmax inside a bf16
        model)."""
        import transformers  # slow import; this module loads without it
        policy = Policy.get(policy)
        # refused as torchref / jaxmodel / the streamed ladder refuse it (a tied lm_head...)
        cfg = validated(folder).config
        model = getattr(transformers, causal_lm_class(cfg.model_type)).from_pretrained(
            str(folder), dtype=dt(policy.param_dtype), attn_implementation=attn_implementation).eval()
        return cls(model, positions, checkpoint=folder)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def policy(self) -> str:
        """The preset that names the model's dtype (fp32, bf16, fp16, fp64)."""
        name = str(self.dtype).removeprefix("torch.")
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(name, name)

    @property
    def name(self) -> str:
        pos = "" if self.positions == "mask" else ", default positions"
        return f"transformers[{self.attn_implementation}, {str(self.dtype).removeprefix('torch.')}{pos}]"

    def float64(self, rounded_weights: bool = False) -> "TransformersModel":
        """The same model at float64, on a deep copy. Its weights are the model's own, except
        that a bf16/fp16 model loaded from a wider checkpoint gets the checkpoint's values
        back (unless rounded_weights): see _full_precision_weights. Its captures of padded
        batches run row by row on the real tokens, so that transformers' eager attention
        cannot turn left padding into NaN (EAGER_F64_LEFT_PADDING): a copy made by this
        package must never be the source of a finding."""
        twin = copy_at(self.model, torch.float64)
        _exact_embed_scale(twin)
        if (not rounded_weights and self.checkpoint is not None
                and self.dtype in (torch.bfloat16, torch.float16)):
            _full_precision_weights(twin, self.model, self.checkpoint)
        return TransformersModel(twin, self.positions, self.checkpoint, unpadded_rows=True)

    # ----- tap names -------------------------------------------------------------------

    def resolve(self, requested) -> tuple[str, ...]:
        """Names and globs -> concrete available taps; an explicitly named unavailable tap
        is a KeyError with the reason (UNAVAILABLE)."""
        def why(pattern, lacking):
            kind = tapnames.parse(lacking)[1]
            return f"tap '{pattern}' is not available from a transformers model: {kind}: {self.unavailable_taps[kind]}"
        return tapnames.select(requested, self._shape, self.taps, why)

    # ----- inputs ----------------------------------------------------------------------

    def _inputs(self, tokens, attention_mask):
        ids, mask = check_token_array(tokens, attention_mask, self.config.vocab_size)
        mask = mask.astype(np.int64)
        # Same positions as our models: real tokens count from 0 whatever the padding side.
        pos = positions_from_mask(mask).astype(np.int64)
        dev = self.device
        return (torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev),
                torch.from_numpy(pos).to(dev), attention_mask is not None)

    def _explain_nan(self, logits, mask):
        """NaN is reported, never masked; when it is transformers' known eager-f64
        left-padding trap, say so."""
        left_padded = bool((mask[:, 0] == 0).any())
        if (left_padded and self.attn_implementation == "eager" and self.dtype == torch.float64
                and bool(torch.isnan(logits).any())):
            warnings.warn(EAGER_F64_LEFT_PADDING, RuntimeWarning, stacklevel=3)


    # ----- capture ---------------------------------------------------------------------

    def _hook_plan(self, wanted, tables: dict):
        """[(module, 'pre' | 'post' | 'tables', tap, transform)] for the requested taps only;
        the q_rope/k_rope transforms read the layer's RoPE tables from `tables[layer]`."""
        m = self.model
        plan = []
        for layer in sorted({tapnames.parse(t)[0] for t in wanted if tapnames.parse(t)[1] in ("q_rope", "k_rope")}):
            def keep(mod, args, kwargs, layer=layer):
                tables[layer] = kwargs["position_embeddings"]
            plan.append((m.model.layers[layer].self_attn, "tables", None, keep))
        # logits: what the model returns (after whatever follows the lm_head's product: a final
        # soft-cap, a scaling), read from the model's own output, not from the lm_head module
        top = {"embed": (m.model.embed_tokens, "post"), "final_norm": (m.model.norm, "post"),
               "logits": (m, "returned")}
        cfg = self.cfg if isinstance(self.cfg, LlamaConfig) else None
        roles = cfg.norm_modules if cfg is not None else {"attn_norm": "input_layernorm",
                                                          "mlp_norm": "post_attention_layernorm"}
        layout = QK_NORM_LAYOUT[cfg.model_type] if cfg is not None and cfg.qk_norm else None
        for tap in wanted:
            layer, kind = tapnames.parse(tap)
            if layer is None:
                plan.append((*top[kind], tap, None))
                continue
            blk = m.model.layers[layer]
            att, mlp = blk.self_attn, blk.mlp
            head_dim = att.head_dim

            def per_head(x, d=head_dim):
                return x.view(*x.shape[:-1], -1, d)

            def normed(x, d=head_dim, layout=layout):
                """q_norm / k_norm's output as [B, T, H, D], whatever layout the family norms in."""
                if layout == AFTER_TRANSPOSE:
                    return x.transpose(1, 2)
                return x if layout == BEFORE_TRANSPOSE else x.view(*x.shape[:-1], -1, d)

            def rotated(x, heads=per_head, att=att, layer=layer):
                """[B, T, ...] queries or keys -> [B, T, H, D] after the model's RoPE."""
                cos, sin = tables[layer]
                q = heads(x).transpose(1, 2)
                return _apply_rope(att)(q, q, cos, sin)[0].transpose(1, 2)
            qk = ({"q": att.q_norm, "k": att.k_norm} if layout is not None
                  else {"q": att.q_proj, "k": att.k_proj})
            heads = normed if layout is not None else per_head
            norm_of = {role: getattr(blk, name) for role, name in roles.items()}
            where = {
                "q": (att.q_proj, "post", per_head), "k": (att.k_proj, "post", per_head),
                "v": (att.v_proj, "post", per_head),
                "q_norm": (qk["q"], "post", heads), "k_norm": (qk["k"], "post", heads),
                "q_rope": (qk["q"], "post", lambda x, r=rotated, h=heads: r(x, h)),
                "k_rope": (qk["k"], "post", lambda x, r=rotated, h=heads: r(x, h)),
                "attn_ctx": (att.o_proj, "pre", None), "attn_out": (att.o_proj, "post", None),
                "resid_mid": (norm_of.get("mlp_norm", mlp), "pre", None),
                "gate": (mlp.gate_proj, "post", None), "up": (mlp.up_proj, "post", None),
                "act": (mlp.down_proj, "pre", None), "mlp_out": (mlp, "post", None),
                "out": (blk, "post", None),
                **{role: (module, "post", None) for role, module in norm_of.items()},
            }[kind]
            plan.append((where[0], where[1], tap, where[2]))
        return plan

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        """(logits, {tap: activation}) as numpy arrays in the dtypes the model computed.

        tokens int [B, T]; attention_mask 0/1 [B, T] (any padding side), position ids
        cumsum(mask) - 1 as in our models. inject {layer: [B, T, hidden]}: teacher
        forcing, the hidden states entering that decoder layer are replaced (cast to
        their dtype), whatever earlier layers produced.
        """
        if self.unpadded_rows and attention_mask is not None and not np.asarray(attention_mask).all():
            return self._capture_rows(tokens, attention_mask, taps, inject)
        wanted = self.resolve(taps)
        ids, mask, pos, masked = self._inputs(tokens, attention_mask)
        forced = self._forced(inject, ids.shape)
        with torch.no_grad():
            out, acts = self._hooked(wanted, forced, lambda: self.model(
                input_ids=ids, attention_mask=mask if masked else None, position_ids=pos, use_cache=False))
        self._explain_nan(out.logits, mask)
        return _to_numpy(out.logits), acts

    def decode_capture(self, cache, next_ids, taps, inject=None):
        """decode, with the taps of the one new position: (logits [B, V], cache, {tap: [B, 1, ...]}).
        inject {layer: [B, 1, hidden]}: teacher forcing of the new position."""
        forced = self._forced(inject, (cache["mask"].shape[0], 1))
        (logits, cache), acts = self._hooked(self.resolve(taps), forced, lambda: self.decode(cache, next_ids))
        return logits, cache, acts

    def _forced(self, inject, tokens_shape) -> dict:
        """inject checked ({layer: [B, T, hidden]}) as tensors for the forcing pre-hooks."""
        shape_cfg = types.SimpleNamespace(num_hidden_layers=self.num_layers, hidden_size=self.config.hidden_size)
        return {i: _from_numpy(x) for i, x in check_inject(shape_cfg, inject, tuple(tokens_shape)).items()}

    def _hooked(self, wanted, forced: dict, call):
        """call() with the capture hooks of `wanted` (and the forcing pre-hooks of `forced`)
        registered, removed in a finally: (its result, {tap: numpy activation})."""
        acts: dict[str, np.ndarray] = {}
        tables: dict = {}
        handles = []

        def record(tap, transform):
            def post(module, args, kwargs, output):
                x = first_tensor(output, tap)
                acts[tap] = _to_numpy(transform(x) if transform else x)

            def pre(module, args, kwargs):
                x = first_input(args, kwargs, tap)
                acts[tap] = _to_numpy(transform(x) if transform else x)

            def returned(module, args, kwargs, output):
                acts[tap] = _to_numpy(output.logits)
            return pre, post, returned

        try:
            for i, h in forced.items():
                # Registered first, so the layer's own taps see the forced input.
                handles.append(self.model.model.layers[i].register_forward_pre_hook(
                    forcing_hook(h), with_kwargs=True))
            for module, when, tap, transform in self._hook_plan(wanted, tables):
                if when == "tables":   # self_attn's cos/sin, read before its q/k projections run
                    handles.append(module.register_forward_pre_hook(transform, with_kwargs=True))
                    continue
                pre, post, returned = record(tap, transform)
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True) if when == "pre"
                               else module.register_forward_hook(returned if when == "returned" else post,
                                                                 with_kwargs=True))
            result = call()
        finally:
            for h in handles:
                h.remove()
        missing = [t for t in wanted if t not in acts]
        if missing:
            raise RuntimeError(f"taps {missing} were not produced: the model did not call the hooked "
                               f"modules (is it a {type(self.model).__name__} with its standard forward?)")
        return result, {t: acts[t] for t in wanted}

    def _capture_rows(self, tokens, attention_mask, taps, inject):
        """capture, one row at a time on its real tokens; padding slots are 0."""
        ids, mask = check_token_array(tokens, attention_mask, self.config.vocab_size)
        real = mask.astype(bool)
        logits = acts = None
        for b in range(len(ids)):
            cols = np.flatnonzero(real[b])
            forced = {i: np.asarray(h)[b:b + 1, cols] for i, h in (inject or {}).items()} or None
            row_logits, row_acts = self.capture(ids[b:b + 1, cols], None, taps, forced)
            if logits is None:
                def full(x):
                    return np.zeros(ids.shape + x.shape[2:], x.dtype)
                logits, acts = full(row_logits), {t: full(x) for t, x in row_acts.items()}
            logits[b, cols] = row_logits[0]
            for t, x in row_acts.items():
                acts[t][b, cols] = x[0]
        return logits, acts

    # ----- logits, prefill/decode, generate (the probes) --------------------------------

    def _t(self, a) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _position_ids(self, mask: np.ndarray) -> torch.Tensor | None:
        if self.positions == "default":
            return None
        return self._t(positions_from_mask(mask).astype(np.int64))

    def _cache_kw(self, kv) -> dict:
        """transformers 5 names the KV cache argument `cache` (past_key_values before)."""
        return {self._cache_arg: kv}

    @torch.inference_mode()
    def __call__(self, tokens, attention_mask=None) -> np.ndarray:
        ids, mask = check_tokens(self.cfg, tokens, attention_mask)
        out = self.model(input_ids=self._t(ids), attention_mask=self._t(mask.astype(np.int64)),
                         position_ids=self._position_ids(mask), use_cache=False)
        return to_numpy(out.logits)

    logits = __call__

    def prefill(self, ids, mask, total_len: int, inject=None):
        """Left-aligned prompt -> (last logits [B, V], cache). The cache is transformers'
        own (DynamicCache) plus the slot mask and each row's next position. inject {layer:
        [B, T, hidden]}: teacher forcing, as capture takes it."""
        logits, cache, _ = self.prefill_capture(ids, mask, total_len, (), inject)
        return logits, cache

    @torch.inference_mode()
    def prefill_capture(self, ids, mask, total_len: int, taps=("layers.*.out",), inject=None):
        """prefill, also returning the prompt's activations as the prefill computed them:
        (logits [B, V], cache, {tap: [B, T, ...]})."""
        from transformers import DynamicCache  # transformers: slow import; this module loads without it
        ids, mask = check_prefill(self.cfg, ids, mask, total_len)
        forced = self._forced(inject, ids.shape)
        kv = DynamicCache(config=self.model.config)
        out, acts = self._hooked(self.resolve(taps) if taps else (), forced, lambda: self.model(
            input_ids=self._t(ids), attention_mask=self._t(mask.astype(np.int64)),
            position_ids=self._position_ids(mask), use_cache=True, **self._cache_kw(kv)))
        cache = {"kv": kv, "mask": mask.astype(np.int64),
                 "next_pos": mask.sum(1).astype(np.int64), "index": ids.shape[1],
                 "slots": int(total_len)}
        return to_numpy(out.logits[:, -1]), cache, acts

    @torch.inference_mode()
    def decode(self, cache, next_ids):
        B = cache["mask"].shape[0]
        next_ids = check_next_ids(self.cfg, next_ids, B, cache["index"], cache["slots"])
        mask = np.concatenate([cache["mask"], np.ones((B, 1), np.int64)], axis=1)
        pos = None if self.positions == "default" else self._t(cache["next_pos"][:, None])
        out = self.model(input_ids=self._t(next_ids[:, None]), attention_mask=self._t(mask),
                         position_ids=pos, use_cache=True, **self._cache_kw(cache["kv"]))
        cache = {**cache, "mask": mask,
                 "next_pos": cache["next_pos"] + 1, "index": cache["index"] + 1}
        return to_numpy(out.logits[:, -1]), cache

    def generate(self, tokens, attention_mask=None, max_new_tokens: int = 32, eos_token_ids=None,
                 pad_token_id=None) -> np.ndarray:
        """Greedy new ids [B, N] through llamaspec's loop (the same token choice as ours)."""
        return run_generation(self.cfg, self.prefill, self.decode, tokens, attention_mask,
                              max_new_tokens, eos_token_ids, pad_token_id, Sampling())


def _has(module, path: str) -> bool:
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


def _exact_embed_scale(model) -> None:
    """A Gemma embedding's scale, sqrt(hidden_size), at the model's float64: the buffer a
    float32 model holds is that number rounded to float32, which copy_at's cast keeps, so the
    twin's embed tap would be the oracle's times a rounded scale (transformers' own float64
    model, loaded at float64, holds it exactly: its _init_weights sets it from the Python
    float)."""
    for module in model.modules():
        scale = getattr(module, "scalar_embed_scale", None)
        buffer = getattr(module, "embed_scale", None)
        if scale is not None and isinstance(buffer, torch.Tensor):
            with torch.no_grad():
                buffer.fill_(scale)


def _full_precision_weights(twin, model, checkpoint) -> bool:
    """A bf16/fp16 transformers model loaded from an f32 checkpoint has lost the weights'
    low bits; its fp64 copy would then run other weights than the oracle (torchref at
    fp64 reads the checkpoint) and every tap would look semantic. When every parameter is
    the checkpoint's tensor rounded to the model's dtype, the copy gets the checkpoint's
    values instead; a model whose weights were changed keeps its own (returns False)."""
    _, weights = load_weights(checkpoint, check_finite=False)
    params = dict(model.named_parameters())
    if not set(params) <= set(weights):
        return False
    for name, p in params.items():
        if not torch.equal(torch.from_numpy(np.array(weights[name], np.float32)).to(p.dtype),
                           p.detach().cpu()):
            return False
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(torch.from_numpy(np.array(weights[name], np.float64)))
    return True
