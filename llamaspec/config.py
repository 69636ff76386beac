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


def _parse(d: dict[str, Any], source: str, from_file: bool = False) -> LlamaConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: must hold a JSON object of config fields, got a {type(d).__name__}")
    f = _Fields(d, source)
    model_type = d.get("model_type", None if from_file else "llama")
    if model_type is None:   # every config.json transformers writes names it
        raise ConfigError(f"{source}: field 'model_type' is missing (a Llama config says \"llama\")")
    if model_type not in ("llama", "smollm", "smollm2"):
        raise ConfigError(f"{source}: model_type '{model_type}' is not a Llama model")
    arch = d.get("architectures")
    if arch is not None and (not isinstance(arch, list) or not all(isinstance(a, str) for a in arch)
                             or not any(a.startswith("Llama") for a in arch)):
        raise ConfigError(f"{source}: architectures {arch!r} names no Llama class (expected "
                          "e.g. [\"LlamaForCausalLM\"])")

    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act '{act}' is not supported (only 'silu')")
    tp = d.get("pretraining_tp", 1)
    if tp not in (None, 1):
        raise ConfigError(f"{source}: pretraining_tp={tp} changes the math and is not supported")
    for key in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) not in (None, False):
            raise ConfigError(f"{source}: field '{key}'={d[key]!r} is not supported")

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

    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    bos, pad = d.get("bos_token_id"), d.get("pad_token_id")

    _reject_unknown(d, source)
    return _check_numerics(source, LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_hidden_layers=f.int("num_hidden_layers", limit=MAX_LAYERS),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.float("rms_norm_eps"),
        max_position_embeddings=max_pos,
        rope=_parse_rope(d, source, max_pos),
        tie_word_embeddings=f.bool("tie_word_embeddings"),
        attention_bias=f.bool("attention_bias"),
        mlp_bias=f.bool("mlp_bias"),
        bos_token_id=None if bos is None else f.token("bos_token_id", bos, vocab),
        eos_token_ids=tuple(f.token("eos_token_id", e, vocab) for e in eos_ids),
        pad_token_id=None if pad is None else f.token("pad_token_id", pad, vocab),
    ))


_PARSED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "bos_token_id",
    "eos_token_id", "pad_token_id", "hidden_act", "pretraining_tp", "sliding_window",
    "attn_logit_softcapping", "final_logit_softcapping", "quantization_config",
}


def _reject_unknown(d: dict[str, Any], source: str) -> None:
    if d.get("quantization_config"):
        raise ConfigError(f"{source}: 'quantization_config' is set; dequantize the "
                          "checkpoint first (weights must be plain fp32/bf16/fp16)")
    unknown = sorted(k for k in d if k not in _PARSED and k not in _HARMLESS)
    if unknown:
        raise ConfigError(f"{source}: unsupported config field(s) {unknown}: they may change "
                          "the math and llama-parity does not implement them")


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
    rope, problems = cfg.rope, []
    if not 1.0 < rope.theta <= _F32_MAX:
        problems.append(f"'rope_theta' = {rope.theta!r} must be above 1 and at most {_F32_MAX:.4g} (float32's "
                        "largest): the RoPE frequencies theta^(-2i/d) are computed in float32, where a base at or "
                        "below 1 turns a frequency into more than a radian per position, or into Inf (NaN angles)")
    if rope.type != "default" and not 1.0 <= rope.factor <= _MAX_ROPE_FACTOR:
        problems.append(f"rope factor ('rope_scaling' / 'rope_parameters' 'factor') = {rope.factor!r} must be in "
                        f"[1, {_MAX_ROPE_FACTOR:g}] for rope type '{rope.type}': a smaller one multiplies the "
                        "frequencies up to Inf in float32, a larger one cancels dynamic scaling's stretch to 0")
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

