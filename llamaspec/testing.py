"""Tiny random Llama checkpoints for tests: written to a folder in HF layout, in seconds."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from .checkpoint import expected_shapes, numpy_dtype
from .config import LlamaConfig
from .files import atomic_write

_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float64): "F64"}

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, model_type="llama",
            hidden_act="silu")


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata=None) -> None:
    header, offset, blobs = {}, 0, []
    for key, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        raw = arr.tobytes()
        header[key] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                       "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    def write(f):
        f.write(struct.pack("<Q", len(h)) + h)
        for raw in blobs:
            f.write(raw)
    atomic_write(path, write, "safetensors file")


def make_checkpoint(folder, dtype="float32", seed=0, shards=1, scale=0.5,
                    **config) -> Path:
    """Writes config.json and random weights; config keys override TINY.

    Norm weights are drawn around 1 and projections with std scale/sqrt(fan_in) so
    activations stay O(1) through the layers, as in a trained model.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg_dict = {**TINY, **config}
    cfg_dict = {k: v for k, v in cfg_dict.items() if v is not None}
    atomic_write(folder / "config.json", json.dumps(cfg_dict, indent=1), "config.json")
    cfg = LlamaConfig.from_dict(cfg_dict)
    rng = np.random.default_rng(seed)
    np_dtype = numpy_dtype(dtype)
    tensors = {}
    for key, shape in expected_shapes(cfg).items():
        if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
            # around 1 as the norm multiplies: (offset + weight) for Gemma's (1 + w) norms
            w = 1.0 - cfg.norm_offset + 0.2 * rng.standard_normal(shape)
        elif key.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif "embed" in key:
            w = rng.standard_normal(shape)
        else:
            w = scale * rng.standard_normal(shape) / np.sqrt(shape[-1])
        tensors[key] = w.astype(np_dtype)
    keys = list(tensors)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    else:
        weight_map = {}
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[s::shards]}
            write_safetensors(folder / name, part, {"format": "pt"})
            weight_map.update({k: name for k in part})
        atomic_write(folder / "model.safetensors.index.json",
                     json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1), "index")
    return folder


# Tiny configs that cover the architecture space the acceptance criteria name.
TINY_CONFIGS = {
    "gqa": {},
    "mha": dict(num_key_value_heads=4),
    "mqa": dict(num_key_value_heads=1),
    "head_dim": dict(head_dim=16),
    "tied": dict(tie_word_embeddings=True),
    "bias": dict(attention_bias=True, mlp_bias=True),
    "llama3": dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=32)),
    "linear": dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0)),
    "dynamic": dict(rope_scaling=dict(type="dynamic", factor=2.0)),
}


# Tiny configs of the Llama family's relatives (llamaspec.config.FAMILIES), each with its features
# switched on where a tiny prompt reaches them: windows shorter than the tests' prompts (8-12
# tokens), soft-caps small enough that tanh bends (random scores and logits are O(1)), a query
# scale that is not a power of two, a head_dim other than hidden / heads, a Gemma 3 local RoPE base.
TINY_FAMILIES = {
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3": dict(model_type="qwen3", head_dim=16, use_sliding_window=False),
    "mistral": dict(model_type="mistral", sliding_window=5),
    "gemma2": dict(model_type="gemma2", hidden_act=None, hidden_activation="gelu_pytorch_tanh", head_dim=8,
                   query_pre_attn_scalar=12, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
                   sliding_window=4, tie_word_embeddings=True, rms_norm_eps=1e-6),
    "gemma3_text": dict(model_type="gemma3_text", hidden_act=None, hidden_activation="gelu_pytorch_tanh",
                        head_dim=16, query_pre_attn_scalar=16, sliding_window=4, tie_word_embeddings=True,
                        layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=100.0,
                        rope_scaling=dict(rope_type="linear", factor=2.0), rms_norm_eps=1e-6),
    "olmo2": dict(model_type="olmo2", tie_word_embeddings=False),
}
