"""Synthetic checkpoints of real model shapes, to measure scale without downloading.

    write_checkpoint(folder, "llama-3.2-1b", dtype="bfloat16", layers=4)

writes config.json (the real model's config, with `layers` decoder layers if given) and
random weights in Hugging Face layout, sharded like the hub's (at most SHARD_BYTES a
file), one tensor at a time: memory stays at the largest tensor however big the model.
Each tensor is drawn from its own generator (seeded by the seed and the tensor's name),
so a tensor's values do not depend on the shard layout or on how many layers are
written. Scales follow llamaspec.testing.make_checkpoint: norms multiply by about 1 (their
weights around 1, Gemma's around 0 as its norms multiply by 1 + weight), projections with
std 0.5/sqrt(fan_in), so activations stay O(1) through the layers as in a trained model; the
embedding is N(0, 1).

The shapes are Llama's and its relatives' (llamaspec.config.FAMILIES): each entry is the
model's config.json, its model_type included, without bookkeeping fields; the tokens ids are
SmolLM2's (make-checkpoint copies its tokenizer), not the model's own.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from .checkpoint import expected_shapes
from .config import FAMILIES, LlamaConfig
from .errors import ConfigError
from .files import WriteError, atomic_write

# The real configs (config.json of each model on the hub), without bookkeeping fields.
_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama-3.2-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
    # Llama's relatives (llamaspec.config.FAMILIES), from their config.json on the hub
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
                         use_sliding_window=False, sliding_window=32768, max_window_layers=24),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0,
                       tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
                       sliding_window=None, max_window_layers=28),
    "mistral-7b-v0.1": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                            max_position_embeddings=32768, rope_theta=10000.0, tie_word_embeddings=False,
                            sliding_window=4096),
    "gemma-2-2b": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       rms_norm_eps=1e-6, max_position_embeddings=8192, rope_theta=10000.0,
                       tie_word_embeddings=True, attention_bias=False, hidden_activation="gelu_pytorch_tanh",
                       query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       sliding_window=4096),
    "gemma-3-1b": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=1000000.0,
                       rope_local_base_freq=10000.0, rope_scaling=None, tie_word_embeddings=True,
                       attention_bias=False, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                       attn_logit_softcapping=None, final_logit_softcapping=None, sliding_window=512,
                       sliding_window_pattern=6),
    "olmo-2-0425-1b": dict(model_type="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, rms_norm_eps=1e-6,
                           max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=None,
                           tie_word_embeddings=False, attention_bias=False),
}
SHARD_BYTES = 2 << 30
_DTYPES = {"float32": (np.dtype(np.float32), "F32"), "bfloat16": (np.dtype(ml_dtypes.bfloat16), "BF16"),
           "float16": (np.dtype(np.float16), "F16")}
_CHUNK = 1 << 24   # elements drawn at a time (64 MB of float32)
MARKER = ".llama-parity-checkpoint"   # this folder is a synthetic checkpoint of ours ("complete": written last)


def shape_config(shape: str, layers: int | None = None, bos: int = 1, eos: int = 2,
                 vocab_size: int | None = None) -> dict:
    """config.json for a named shape; `layers` overrides the depth, `vocab_size` the vocabulary
    (a smaller one for quick tests: the embedding and lm_head are most of a small model's
    weights; every other field stays the real model's)."""
    if shape not in SHAPES:
        raise ConfigError(f"unknown shape '{shape}' (one of {', '.join(SHAPES)})")
    real = SHAPES[shape]
    for name, value, most in (("layers", layers, real["num_hidden_layers"]), ("vocab_size", vocab_size,
                                                                               real["vocab_size"])):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}={value!r} must be a positive integer")
        if value is not None and value > most:    # a real shape, at most its size
            raise ConfigError(f"{name}={value}: {shape} has {most} "
                              f"{'decoder layers' if name == 'layers' else 'tokens'}; give at most that many")
    if vocab_size is not None and vocab_size <= max(bos, eos):
        raise ConfigError(f"vocab_size={vocab_size} must hold the token ids bos={bos} and eos={eos}")
    model_type = real.get("model_type", "llama")
    act = {"hidden_act": "gelu_pytorch_tanh"} if "hidden_activation" in real else {"hidden_act": "silu"}
    cfg = dict(dict(act, **real), model_type=model_type,
               architectures=[FAMILIES[model_type][0] + "ForCausalLM"], bos_token_id=bos, eos_token_id=eos)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    return cfg


def _draw(key: str, shape: tuple, seed: int, np_dtype, norm_offset: float = 0.0) -> np.ndarray:
    """The tensor `key`, drawn from its own generator; float32 draws in chunks, then cast.
    norm_offset: the config's (a norm multiplies by offset + weight), so norms multiply by about 1."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    n = int(np.prod(shape))
    if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
        loc, std = 1.0 - norm_offset, 0.2
    elif key.endswith(".bias"):
        loc, std = 0.0, 0.1
    elif "embed" in key:
        loc, std = 0.0, 1.0
    else:
        loc, std = 0.0, 0.5 / np.sqrt(shape[-1])
    out = np.empty(n, np_dtype)
    for start in range(0, n, _CHUNK):
        part = rng.standard_normal(min(_CHUNK, n - start), dtype=np.float32)
        out[start:start + len(part)] = (part * np.float32(std) + np.float32(loc)).astype(np_dtype)
    return out.reshape(shape)


def write_checkpoint(folder, shape: str, dtype: str = "bfloat16", layers: int | None = None, seed: int = 0,
                     shard_bytes: int = SHARD_BYTES, progress=lambda msg: None, vocab_size: int | None = None) -> Path:
    """Writes the synthetic checkpoint into `folder` (created) and returns it (vocab_size: as
    shape_config takes it)."""
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype '{dtype}' is not one of {', '.join(_DTYPES)}")
    np_dtype, st_name = _DTYPES[dtype]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg_dict = shape_config(shape, layers, vocab_size=vocab_size)
    cfg = LlamaConfig.from_dict(cfg_dict, source=f"shape {shape}")
    shapes = expected_shapes(cfg)
    # Shards: tensors in checkpoint order, a new file when the next tensor would pass shard_bytes.
    shards, size = [[]], 0
    for key, shp in shapes.items():
        nbytes = int(np.prod(shp)) * np_dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(int(np.prod(s)) for s in shapes.values())
    _check_space(folder, total * np_dtype.itemsize)
    mark = {"shape": shape, "dtype": dtype, "layers": cfg.num_hidden_layers, "seed": seed,
            **({} if vocab_size is None else {"vocab_size": vocab_size})}
    # first: a run cut short (full disk, kill) leaves a folder known as ours, to be written again with --force
    atomic_write(folder / MARKER, json.dumps({**mark, "complete": False}) + "\n", "checkpoint marker")
    done = 0
    for name, keys in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt", "llama_parity_shape": shape, "seed": str(seed)}}, 0
        for key in keys:
            nbytes = int(np.prod(shapes[key])) * np_dtype.itemsize
            header[key] = {"dtype": st_name, "shape": list(shapes[key]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)

        def write(f, keys=keys, name=name, raw=raw):
            nonlocal done
            f.write(struct.pack("<Q", len(raw)) + raw)
            for key in keys:
                f.write(_draw(key, tuple(shapes[key]), seed, np_dtype, cfg.norm_offset).tobytes())
                done += int(np.prod(shapes[key]))
                progress(f"{name}: {key} ({100 * done / total:.0f}% of {total / 1e9:.2f}B parameters)")
        atomic_write(folder / name, write, "checkpoint file")
    if len(shards) > 1:
        weight_map = {k: n for n, keys in zip(names, shards) for k in keys}
        atomic_write(folder / "model.safetensors.index.json", json.dumps(
            {"metadata": {"total_size": total * np_dtype.itemsize}, "weight_map": weight_map}, indent=1),
            "checkpoint index")
    atomic_write(folder / "config.json", json.dumps(cfg_dict, indent=1), "checkpoint config")
    atomic_write(folder / MARKER, json.dumps({**mark, "complete": True}) + "\n", "checkpoint marker")
    return folder


def _check_space(folder: Path, nbytes: int) -> None:
    """Refuses, before writing, a checkpoint that cannot fit the free space of its disk."""
    import shutil
    free = shutil.disk_usage(folder).free
    if nbytes > free:
        raise WriteError(f"checkpoint folder {folder}: the weights need {nbytes / 1e9:.2f} GB, the disk has "
                         f"{free / 1e9:.2f} GB free; choose fewer --layers or another folder")
