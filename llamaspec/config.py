"""Llama configuration: parsed once from a Hugging Face config.json, shared by both models.

Every field that changes the math is either honoured or rejected with an error that
names it; nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from .budget import MAX_LAYERS, MAX_SIZE_FIELD, check_count, load_json
from .errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF half-split layout)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3 and dynamic: the context length the model was trained with
    original_max_position_embeddings: int | None = None


@dataclasses.dataclass(frozen=True)
class Shape:
    """The numbers that fix a Llama's tensor shapes and its norm: what every implementation
    (ours, a third-party port's own objects: compare.adapters.ports.PortConfig) states."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float


@dataclasses.dataclass(frozen=True)
class LlamaConfig(Shape):
    max_position_embeddings: int
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # The family's features (FAMILIES below): Llama's values by default.
    model_type: str = "llama"
    o_bias: bool | None = None          # o_proj's bias: attention_bias unless the family says (Qwen2: none)
    qk_norm: str | None = None          # None | "head" (over head_dim, per head) | "projection" (over all heads)
    norm_offset: float = 0.0            # an RMSNorm multiplies by (offset + weight): Gemma's 1
    norm_weight_in_norm_dtype: bool = False   # the family's norm applies its weight before rounding (Gemma, OLMo 2)
    norms: str = "pre"                  # "pre" (Llama), "sandwich" (Gemma 2/3), "post" (OLMo 2)
    sliding_window: tuple = ()          # per layer: the window in tokens, or None (global); () = every layer global
    attn_softcap: float | None = None   # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    query_scale: float | None = None    # the scores' scale; None: head_dim ** -0.5
    embed_scale: bool = False           # embeddings times sqrt(hidden_size) (Gemma)
    activation: str = "silu"            # "silu" | "gelu_tanh" (transformers' gelu_pytorch_tanh)
    local_rope: RopeConfig | None = None    # the RoPE of the sliding-window layers where it differs (Gemma 3)

    def __post_init__(self):
        if self.o_bias is None:
            object.__setattr__(self, "o_bias", self.attention_bias)

    @property
    def norm_modules(self) -> dict[str, str]:
        """{the norm's role (its tap name): its module's name in a layer's checkpoint keys}: the
        same checkpoint name plays another role in another family (Gemma's and OLMo 2's
        post_attention_layernorm normalises the attention's output, Llama's the MLP's input)."""
        return NORM_MODULES[self.norms]

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (a query sees the keys less than this many positions
        back, itself included), or None: every earlier key."""
        return self.sliding_window[layer] if self.sliding_window else None

    def rope_of(self, layer: int) -> RopeConfig:
        """The RoPE layer `layer` rotates by: local_rope on a sliding-window layer where set."""
        return self.local_rope if self.local_rope is not None and self.window(layer) is not None else self.rope

    @property
    def scale(self) -> float:
        """The attention scores' scale: query_scale, else 1/sqrt(head_dim)."""
        return self.head_dim ** -0.5 if self.query_scale is None else self.query_scale

    @property
    def layer_steps(self) -> tuple[str, ...]:
        """The tap names of one layer's steps in execution order (llamaspec.taps.steps_of)."""
        from .taps import steps_of
        return steps_of(self)

    def features(self) -> dict:
        """The family features that differ from Llama's, {name: value}, for reports and hints."""
        plain = {"qk_norm": None, "norm_offset": 0.0, "norm_weight_in_norm_dtype": False, "norms": "pre",
                 "sliding_window": (), "attn_softcap": None, "final_softcap": None, "query_scale": None,
                 "embed_scale": False, "activation": "silu", "local_rope": None,
                 "attention_bias": False, "o_bias": self.attention_bias, "mlp_bias": False}
        return {n: getattr(self, n) for n, v in plain.items() if getattr(self, n) != v}

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "LlamaConfig":
        return _parse(d, source)

    @classmethod
    def from_file(cls, path: str | Path) -> "LlamaConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not os.path.lexists(path):     # present but not a file (a FIFO, /dev/zero): load_json names it
            raise ConfigError(f"{path}: config.json not found")
        d = load_json(path, ConfigError, what="config.json")    # bounded; every parser failure a ConfigError
        return _parse(d, str(path), from_file=True)


# Fields that do not change the forward math (bookkeeping, training-only, or handled
# by the caller). Anything not listed here or parsed below is checked in _reject_unknown.
_HARMLESS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "initializer_range", "use_cache", "attention_dropout", "_name_or_path",
    "_model_name_or_path", "unk_token_id", "output_attentions", "output_hidden_states",
    "return_dict", "tokenizer_class", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "torchscript", "use_return_dict",
    "is_decoder", "add_cross_attention", "tie_encoder_decoder", "pruned_heads",
    "task_specific_params", "finetuning_task", "prefix", "sep_token_id",
    "decoder_start_token_id", "bad_words_ids", "num_beams", "max_length",
    "min_length", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
    "num_return_sequences", "cross_attention_hidden_size", "tf_legacy_loss",
    "use_bfloat16", "output_scores", "return_dict_in_generate",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "diversity_penalty", "early_stopping",
    "encoder_no_repeat_ngram_size", "forced_bos_token_id", "forced_eos_token_id",
    "length_penalty", "no_repeat_ngram_size", "num_beam_groups", "typical_p",
    "chat_template",
}


class _Fields:
    """Typed reads of config fields; every error names the file and the field."""

    def __init__(self, d: dict[str, Any], source: str):
        self.d, self.source = d, source

    def fail(self, key: str, rule: str):
        raise ConfigError(f"{self.source}: field '{key}' = {self.d.get(key)!r} must be {rule}")

    def int(self, key: str, default=None, limit: int = MAX_SIZE_FIELD):
        """A positive JSON integer (not a bool, not 32.9) up to `limit` (a size: sane bounds, before
        anything is allocated from it); default when absent or null."""
        v = self.d.get(key)
        if v is None:
            if default is None:
                raise ConfigError(f"{self.source}: required field '{key}' is missing")
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            self.fail(key, "a positive integer")
        check_count(v, limit, f"{self.source}: field '{key}'", ConfigError, "a sanity bound on a model's sizes")
        return v

    def float(self, key: str, default=None, positive: bool = True, table: dict | None = None):
        d = self.d if table is None else table
        v = d.get(key)
        if v is None:
            if default is None:
                raise ConfigError(f"{self.source}: required field '{key}' is missing")
            return float(default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or (positive and not v > 0):
            raise ConfigError(f"{self.source}: field '{key}' = {v!r} must be a finite "
                              f"{'positive ' if positive else ''}number")
        return float(v)

    def bool(self, key: str, default: bool = False) -> bool:
        v = self.d.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.fail(key, "a JSON boolean (true or false, not a string)")
        return v

    def token(self, key: str, value, vocab: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
            raise ConfigError(f"{self.source}: field '{key}' = {value!r} must be a token id in "
                              f"[0, vocab_size={vocab})")
        return value


# The families read as features of one model: model_type -> (the architectures' class-name prefix,
# transformers' config-class defaults of the math fields a config.json may leave out, the fields
# that family's config may carry besides Llama's). Defaults are checked against transformers'
# config classes in tests/test_families.py.
FAMILIES = {
    "llama": ("Llama", {}, ()),
    "smollm": ("Llama", {}, ()),
    "smollm2": ("Llama", {}, ()),
    "mistral": ("Mistral", {"sliding_window": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}, ()),
    "qwen2": ("Qwen2", {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_sliding_window": False,
                        "sliding_window": 4096, "max_window_layers": 28},
              ("use_sliding_window", "max_window_layers", "layer_types")),
    "qwen3": ("Qwen3", {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_sliding_window": False,
                        "sliding_window": 4096, "max_window_layers": 28, "head_dim": 128},
              ("use_sliding_window", "max_window_layers", "layer_types")),
    "gemma2": ("Gemma2", {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "head_dim": 256,
                          "sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"},
               ("layer_types", "query_pre_attn_scalar", "hidden_activation", "use_bidirectional_attention",
                "cache_implementation")),
    "gemma3_text": ("Gemma3", {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "head_dim": 256,
                               "sliding_window": 4096, "query_pre_attn_scalar": 256,
                               "hidden_activation": "gelu_pytorch_tanh", "rope_local_base_freq": 10000.0,
                               "rope_theta": 1000000.0,
                               "_sliding_window_pattern": 6},
                    ("layer_types", "query_pre_attn_scalar", "hidden_activation", "use_bidirectional_attention",
                     "rope_local_base_freq", "_sliding_window_pattern", "sliding_window_pattern",
                     "cache_implementation")),
    "olmo2": ("Olmo2", {"rms_norm_eps": 1e-5, "tie_word_embeddings": False}, ()),
}
# Where a family's layer norms sit: {norms: {role (its tap name): module name in the checkpoint}}.
NORM_MODULES = {
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "sandwich": {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"},
    "post": {"post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"},
}
# transformers' names of the activations (ACT2FN) the models compute, and ours
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _parse(d: dict[str, Any], source: str, from_file: bool = False) -> LlamaConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: must hold a JSON object of config fields, got a {type(d).__name__}")
    model_type = d.get("model_type", None if from_file else "llama")
    if model_type is None:   # every config.json transformers writes names it
        raise ConfigError(f"{source}: field 'model_type' is missing (a Llama config says \"llama\")")
    if model_type not in FAMILIES:
        also = " (a Gemma 3 checkpoint with a vision tower: convert its text model, model_type 'gemma3_text')" \
            if model_type == "gemma3" else ""
        raise ConfigError(f"{source}: model_type {model_type!r} is not a model llama-parity implements "
                          f"(it reads {', '.join(FAMILIES)}){also}")
    prefix, class_defaults, own_fields = FAMILIES[model_type]
    arch = d.get("architectures")
    if arch is not None and (not isinstance(arch, list) or not all(isinstance(a, str) for a in arch)
                             or not any(a.startswith(prefix) for a in arch)):
        raise ConfigError(f"{source}: architectures {arch!r} names no {prefix} class (model_type "
                          f"{model_type!r} expects e.g. [\"{prefix}ForCausalLM\"])")
    # a field left out takes the family's config-class default (transformers writes only what differs)
    d = {**class_defaults, **{k: v for k, v in d.items() if v is not None or k not in class_defaults}}
    f = _Fields(d, source)
    family = model_type if model_type in ("mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2") else "llama"

    act = d.get("hidden_activation") if family.startswith("gemma") else d.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        key = "hidden_activation" if family.startswith("gemma") else "hidden_act"
        raise ConfigError(f"{source}: {key} {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    tp = d.get("pretraining_tp", 1)
    if tp not in (None, 1):
        raise ConfigError(f"{source}: pretraining_tp={tp} changes the math and is not supported")
    if d.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: field 'use_bidirectional_attention'={d['use_bidirectional_attention']!r}: "
                          "non-causal attention is not supported")
    softcaps = ("attn_logit_softcapping", "final_logit_softcapping")
    for key in ("sliding_window", *softcaps):
        if family == "llama" and d.get(key) not in (None, False):
            raise ConfigError(f"{source}: field '{key}'={d[key]!r} is not supported for model_type "
                              f"{model_type!r}")
    if family in ("mistral", "qwen2", "qwen3", "olmo2") and any(d.get(k) is not None for k in softcaps):
        raise ConfigError(f"{source}: field '{next(k for k in softcaps if d.get(k) is not None)}' is not part "
                          f"of a {model_type} model")

    vocab = f.int("vocab_size")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", default=heads)
    if d.get("head_dim") is None and hidden % heads:
        f.fail("hidden_size", f"a multiple of num_attention_heads={heads} when head_dim is not given")
    head_dim = f.int("head_dim", default=hidden // heads)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv_heads}")
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim={head_dim} must be even for RoPE")
    max_pos = f.int("max_position_embeddings")
    n_layers = f.int("num_hidden_layers", limit=MAX_LAYERS)

    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    bos, pad = d.get("bos_token_id"), d.get("pad_token_id")

    _reject_unknown(d, source, own_fields, family)
    rope, local_rope = _parse_ropes(d, source, max_pos, family)
    attention_bias = True if family == "qwen2" else f.bool("attention_bias")
    gemma = family.startswith("gemma")
    return _check_numerics(source, LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.float("rms_norm_eps"),
        max_position_embeddings=max_pos,
        rope=rope,
        tie_word_embeddings=f.bool("tie_word_embeddings"),
        attention_bias=attention_bias,
        mlp_bias=f.bool("mlp_bias"),
        bos_token_id=None if bos is None else f.token("bos_token_id", bos, vocab),
        eos_token_ids=tuple(f.token("eos_token_id", e, vocab) for e in eos_ids),
        pad_token_id=None if pad is None else f.token("pad_token_id", pad, vocab),
        model_type=family,
        o_bias=False if family == "qwen2" else attention_bias,
        qk_norm={"qwen3": "head", "gemma3_text": "head", "olmo2": "projection"}.get(family),
        norm_offset=1.0 if gemma else 0.0,
        norm_weight_in_norm_dtype=gemma or family == "olmo2",
        norms="sandwich" if gemma else "post" if family == "olmo2" else "pre",
        sliding_window=_windows(f, d, source, family, n_layers),
        attn_softcap=None if not gemma or d.get(softcaps[0]) is None else f.float(softcaps[0]),
        final_softcap=None if not gemma or d.get(softcaps[1]) is None else f.float(softcaps[1]),
        query_scale=f.float("query_pre_attn_scalar") ** -0.5 if gemma else None,
        embed_scale=gemma,
        activation=_ACTIVATIONS[act],
        local_rope=local_rope,
    ))


def _windows(f: "_Fields", d: dict, source: str, family: str, n_layers: int) -> tuple:
    """The sliding window of each layer (None: global), () when no layer has one, as transformers'
    config classes derive it: Mistral's sliding_window on every layer; Qwen2/3's on the layers from
    max_window_layers on when use_sliding_window; Gemma's on the layers layer_types names
    "sliding_attention" (by default every other layer, Gemma 3: five of every six)."""
    types = d.get("layer_types")
    if family == "llama":
        return ()
    if family == "mistral":
        w = d.get("sliding_window")
        return () if w is None else (f.int("sliding_window"),) * n_layers
    if family in ("qwen2", "qwen3"):
        use = f.bool("use_sliding_window")
        if not use or d.get("sliding_window") is None:
            if types is not None and "sliding_attention" in types:
                raise ConfigError(f"{source}: field 'layer_types' names sliding_attention layers but "
                                  "use_sliding_window is false (transformers' classes disagree on such a config)")
            return ()
        first = f.int("max_window_layers", limit=MAX_LAYERS) if d.get("max_window_layers") else 0
        derived = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    elif family == "olmo2":
        return ()
    else:       # gemma2, gemma3_text
        # Gemma 2: every other layer; Gemma 3: the pattern (older configs spell it without the "_")
        pattern = "sliding_window_pattern" if d.get("sliding_window_pattern") is not None else "_sliding_window_pattern"
        every = 2 if family == "gemma2" else f.int(pattern)
        derived = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
            raise ConfigError(f"{source}: field 'layer_types' = {types!r} must list one of "
                              f"{', '.join(_LAYER_TYPES)} for each of the {n_layers} layers")
        derived = types
    if "sliding_attention" not in derived:
        return ()
    w = f.int("sliding_window")
    return tuple(w if t == "sliding_attention" else None for t in derived)


_PARSED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "bos_token_id",
    "eos_token_id", "pad_token_id", "hidden_act", "pretraining_tp", "sliding_window",
    "attn_logit_softcapping", "final_logit_softcapping", "quantization_config",
}


def _reject_unknown(d: dict[str, Any], source: str, own_fields=(), family: str = "llama") -> None:
    if d.get("quantization_config"):
        raise ConfigError(f"{source}: 'quantization_config' is set; dequantize the "
                          "checkpoint first (weights must be plain fp32/bf16/fp16)")
    if family == "qwen2" and d.get("attention_bias") is not None:
        raise ConfigError(f"{source}: field 'attention_bias' is not read by Qwen2 (q, k and v always carry a "
                          "bias, o_proj none): a config that sets it means another model")
    unknown = sorted(k for k in d if k not in _PARSED and k not in _HARMLESS and k not in own_fields)
    if unknown:
        raise ConfigError(f"{source}: unsupported config field(s) {unknown}: they may change "
                          "the math and llama-parity does not implement them")


def _parse_ropes(d: dict[str, Any], source: str, max_pos: int, family: str) -> tuple[RopeConfig, RopeConfig | None]:
    """(the RoPE of every layer, or of the global ones; the sliding-window layers' where it differs:
    Gemma 3's, from rope_parameters per layer type or rope_local_base_freq)."""
    if family != "gemma3_text":
        return _parse_rope(d, source, max_pos), None
    params = d.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(_LAYER_TYPES):
        if set(params) - set(_LAYER_TYPES):
            raise ConfigError(f"{source}: field 'rope_parameters' mixes layer types {_LAYER_TYPES} with "
                              f"{sorted(set(params) - set(_LAYER_TYPES))}")
        if d.get("rope_scaling") is not None:
            raise ConfigError(f"{source}: fields 'rope_scaling' and 'rope_parameters' per layer type are both "
                              "set; give one")
        ropes = {}
        for t in _LAYER_TYPES:
            p = params.get(t) or {}
            if not isinstance(p, dict):
                raise ConfigError(f"{source}: field 'rope_parameters' {t!r} = {p!r} must be a JSON object")
            theta = d["rope_local_base_freq"] if t == "sliding_attention" else d.get("rope_theta")
            p = {"rope_theta": theta, **p} if theta is not None else p
            ropes[t] = _parse_rope({"rope_parameters": p}, f"{source} (rope_parameters {t!r})", max_pos)
        glob, local = ropes["full_attention"], ropes["sliding_attention"]
    else:
        glob = _parse_rope(d, source, max_pos)
        local = _parse_rope({"rope_theta": _Fields(d, source).float("rope_local_base_freq")}, source, max_pos)
    return glob, (None if local == glob else local)


def _parse_rope(d: dict[str, Any], source: str, max_pos: int) -> RopeConfig:
    # transformers 5 puts everything in rope_parameters; 4.x used rope_theta + rope_scaling.
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ConfigError(f"{source}: field '{key}' = {d[key]!r} must be a JSON object (or null)")
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling")
    if scaling and params and any(params.get(k) != v for k, v in scaling.items()
                                  if k in params):
        raise ConfigError(f"{source}: rope_scaling and rope_parameters disagree: "
                          f"{scaling} vs {params}")
    merged = {**(scaling or {}), **params}
    f = _Fields(d, source)
    theta = f.float("rope_theta", table={"rope_theta": merged.get("rope_theta", d.get("rope_theta", 10000.0))})
    rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rtype not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope type '{rtype}' is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    known = {"rope_theta", "rope_type", "type", "factor", "low_freq_factor",
             "high_freq_factor", "original_max_position_embeddings", "partial_rotary_factor"}
    extra = sorted(set(merged) - known)
    if extra:
        raise ConfigError(f"{source}: unsupported rope parameter(s) {extra} for type '{rtype}'")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor="
                          f"{merged['partial_rotary_factor']} is not supported")
    if not (theta > 0 and math.isfinite(theta)):
        raise ConfigError(f"{source}: rope_theta={theta} must be a positive number")

    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key in merged:
            f.float(key, table=merged)
    if merged.get("original_max_position_embeddings") is not None:
        _Fields(merged, source).int("original_max_position_embeddings")
    factor = float(merged.get("factor", 1.0))
    if rtype != "default" and "factor" not in merged:
        raise ConfigError(f"{source}: rope type '{rtype}' needs 'factor'")
    if rtype != "default" and not factor > 0:
        raise ConfigError(f"{source}: rope factor={factor} must be positive")
    orig = merged.get("original_max_position_embeddings")
    if rtype == "llama3" and orig is None:
        raise ConfigError(f"{source}: rope type 'llama3' needs 'original_max_position_embeddings'")
    if rtype == "llama3" and not (float(merged.get("high_freq_factor", 4.0))
                                  > float(merged.get("low_freq_factor", 1.0))):
        raise ConfigError(f"{source}: llama3 rope needs high_freq_factor > low_freq_factor "
                          f"(got {merged.get('high_freq_factor')} and {merged.get('low_freq_factor')})")
    if rtype == "dynamic":
        orig = max_pos  # transformers scales against max_position_embeddings itself
    return RopeConfig(
        theta=theta,
        type=rtype,
        factor=factor if rtype != "default" else 1.0,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if orig is None else int(orig),
    )


# Values that are valid numbers but make float32 arithmetic (the RoPE tables', a norm's) give
# NaN/Inf or lose their meaning, refused here so that no comparison blames a precision for
# them (issue 58). float32's largest and smallest normal numbers; positions up to 2**24 are
# exact in float32, which the RoPE angles are computed in.
_F32_MAX, _F32_TINY, _F32_EXACT_INTS = 3.4028234663852886e38, 1.1754943508222875e-38, 2 ** 24
_MAX_ROPE_FACTOR = 2.0 ** 16


def _check_numerics(source: str, cfg: LlamaConfig) -> LlamaConfig:
    problems = []
    for rope, name in ((cfg.rope, "rope_theta"), (cfg.local_rope, "rope_local_base_freq")):
        if rope is None:
            continue
        if not 1.0 < rope.theta <= _F32_MAX:
            problems.append(f"'{name}' = {rope.theta!r} must be above 1 and at most {_F32_MAX:.4g} (float32's "
                            "largest): the RoPE frequencies theta^(-2i/d) are computed in float32, where a base at "
                            "or below 1 turns a frequency into more than a radian per position, or into Inf (NaN "
                            "angles)")
        if rope.type != "default" and not 1.0 <= rope.factor <= _MAX_ROPE_FACTOR:
            problems.append(f"rope factor ('rope_scaling' / 'rope_parameters' 'factor') = {rope.factor!r} must be "
                            f"in [1, {_MAX_ROPE_FACTOR:g}] for rope type '{rope.type}': a smaller one multiplies the "
                            "frequencies up to Inf in float32, a larger one cancels dynamic scaling's stretch to 0")
    for cap, name in ((cfg.attn_softcap, "attn_logit_softcapping"), (cfg.final_softcap, "final_logit_softcapping")):
        if cap is not None and not _F32_TINY <= cap <= _F32_MAX:
            problems.append(f"'{name}' = {cap!r} must be a normal float32 number: the cap divides the scores "
                            "in the model's dtype")
    if cfg.rms_norm_eps < _F32_TINY:
        problems.append(f"'rms_norm_eps' = {cfg.rms_norm_eps!r} must be at least {_F32_TINY:.4g} (float32's "
                        "smallest normal number): below it the epsilon is 0 or subnormal in float32 and bfloat16, "
                        "and a zero hidden row is divided by 0 (NaN)")
    if cfg.max_position_embeddings > _F32_EXACT_INTS:
        problems.append(f"'max_position_embeddings' = {cfg.max_position_embeddings} must be at most 2**24 = "
                        f"{_F32_EXACT_INTS}: RoPE angles are position x frequency in float32, where larger "
                        "positions are not all integers")
    if problems:
        raise ConfigError(f"{source}: field " + "; field ".join(problems))
    return cfg

