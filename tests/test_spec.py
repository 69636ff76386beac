"""Config, checkpoint and input validation: every bad input gets an error naming it."""

import json

import ml_dtypes
import numpy as np
import pytest

from llamaspec import (
    Checkpoint,
    CheckpointError,
    ConfigError,
    InputError,
    LlamaConfig,
    Policy,
    PolicyError,
    check_tokens,
    load_weights,
    positions_from_mask,
    taps,
)
from llamaspec.inputs import left_align
from llamaspec.testing import TINY, make_checkpoint, write_safetensors


def cfg_of(**kw):
    return LlamaConfig.from_dict({**TINY, **kw})


# ----- config ---------------------------------------------------------------------------

def test_config_defaults_and_derived_fields():
    c = cfg_of()
    assert c.head_dim == 8 and c.n_rep == 2 and c.rope.type == "default"
    assert c.eos_token_ids == (2,)
    assert cfg_of(head_dim=16).head_dim == 16
    assert cfg_of(num_key_value_heads=None).num_key_value_heads == 4  # MHA when absent
    assert cfg_of(eos_token_id=[2, 5]).eos_token_ids == (2, 5)


def test_rope_v4_and_v5_spellings_agree():
    v4 = cfg_of(rope_theta=5e5, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0,
                                                   original_max_position_embeddings=32))
    v5 = cfg_of(rope_theta=None, rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0,
                                                      low_freq_factor=1.0, high_freq_factor=4.0,
                                                      original_max_position_embeddings=32))
    assert v4.rope == v5.rope and v4.rope.theta == 5e5
    assert cfg_of(rope_scaling={"type": "linear", "factor": 2.0}).rope.factor == 2.0
    assert cfg_of(rope_scaling={"type": "dynamic", "factor": 2.0}).rope.original_max_position_embeddings == 128


@pytest.mark.parametrize("kw, words", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["rope type 'yarn'"]),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ["original_max_position_embeddings"]),
    (dict(rope_scaling={"rope_type": "linear"}), ["needs 'factor'"]),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
     ["high_freq_factor > low_freq_factor"]),
    (dict(hidden_act="gelu"), ["hidden_act"]),
    (dict(pretraining_tp=2), ["pretraining_tp"]),
    (dict(sliding_window=64), ["sliding_window"]),
    (dict(num_key_value_heads=3), ["num_key_value_heads=3"]),
    (dict(some_new_knob=1.5), ["some_new_knob"]),
    (dict(quantization_config={"quant_method": "gguf"}), ["quantization_config"]),
    (dict(rms_norm_eps=0), ["rms_norm_eps"]),
    (dict(vocab_size=None), ["'vocab_size' is missing"]),
    (dict(model_type="gpt2"), ["not a model llama-parity implements"]),
])
def test_config_rejects_math_it_does_not_implement(kw, words):
    with pytest.raises(ConfigError) as e:
        cfg_of(**kw)
    for w in words:
        assert w in str(e.value)


def test_missing_and_malformed_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        LlamaConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LlamaConfig.from_file(tmp_path)


# ----- checkpoint -----------------------------------------------------------------------

def test_loads_every_storage_dtype_and_shards(tmp_path):
    for dtype, np_dtype in [("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16),
                            ("float16", np.float16)]:
        cfg, w = load_weights(make_checkpoint(tmp_path / dtype, dtype=dtype, shards=3))
        assert all(a.dtype == np_dtype for a in w.values())
        assert w["model.layers.1.mlp.down_proj.weight"].shape == (cfg.hidden_size, cfg.intermediate_size)
    # bf16 bits survive exactly (no detour through another dtype)
    a = load_weights(tmp_path / "bfloat16")[1]["model.norm.weight"]
    b = Checkpoint(tmp_path / "bfloat16").get("model.norm.weight")
    assert a.view(np.uint16).tolist() == b.view(np.uint16).tolist()


def test_missing_folder_and_no_safetensors(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint folder not found"):
        load_weights(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_weights(tmp_path)


def test_truncated_safetensors_names_file_and_tensor(tmp_path):
    d = make_checkpoint(tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor '.*'"):
        load_weights(d)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="no header"):
        load_weights(d)


def test_corrupt_header(tmp_path):
    d = make_checkpoint(tmp_path)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe\x00!"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_weights(d)
    f.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        load_weights(d)


def test_missing_unexpected_and_misshaped_tensors_are_all_listed(tmp_path):
    d = make_checkpoint(tmp_path)
    tensors = {k: np.array(Checkpoint(d).get(k)) for k in Checkpoint(d).keys()}
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["lm_head.weight"]
    tensors["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((32, 64), np.float32)
    write_safetensors(d / "model.safetensors", tensors)
    with pytest.raises(CheckpointError) as e:
        load_weights(d)
    msg = str(e.value)
    for words in ["missing tensors: lm_head.weight, model.layers.1.self_attn.k_proj.weight",
                  "unexpected tensors: model.layers.0.extra.weight",
                  "model.layers.0.mlp.up_proj.weight: expected [64, 32], found [32, 64]"]:
        assert words in msg


def test_nan_and_inf_in_weights_reported_on_load(tmp_path):
    d = make_checkpoint(tmp_path, dtype="bfloat16")
    tensors = {k: np.array(Checkpoint(d).get(k)) for k in Checkpoint(d).keys()}
    tensors["model.layers.1.mlp.gate_proj.weight"][3, 4] = np.nan
    tensors["model.layers.1.mlp.gate_proj.weight"][5, 6] = np.inf
    write_safetensors(d / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.gate_proj.weight' has 2 NaN/Inf"):
        load_weights(d)


def test_sharded_index_errors(tmp_path):
    d = make_checkpoint(tmp_path, shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00009-of-00009.safetensors: safetensors shard not found"):
        load_weights(d)


def test_tied_checkpoint_may_carry_identical_lm_head(tmp_path):
    d = make_checkpoint(tmp_path, tie_word_embeddings=True)
    ck = Checkpoint(d)
    tensors = {k: np.array(ck.get(k)) for k in ck.keys()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    write_safetensors(d / "model.safetensors", tensors)
    load_weights(d)  # accepted: same values
    tensors["lm_head.weight"][0, 0] += 1
    write_safetensors(d / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_weights(d)


# ----- inputs ---------------------------------------------------------------------------

def test_token_checks():
    c = cfg_of()
    with pytest.raises(InputError, match=r"token id 96 at \[0, 1\] is outside the vocabulary"):
        check_tokens(c, [[1, 96, 3]])
    with pytest.raises(InputError, match="empty input"):
        check_tokens(c, np.zeros((1, 0), np.int64))
    with pytest.raises(InputError, match="longer than max_position_embeddings=128"):
        check_tokens(c, np.ones((1, 129), np.int64))
    with pytest.raises(InputError, match="including 10 new tokens"):
        check_tokens(c, np.ones((1, 120), np.int64), extra_length=10)
    with pytest.raises(InputError, match="1-D"):
        check_tokens(c, [1, 2, 3])
    # ids under padding are never read, so they may be anything
    ids, mask = check_tokens(c, [[-1, 5, 6]], [[0, 1, 1]])
    assert ids.tolist() == [[0, 5, 6]]


def test_positions_and_left_align():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 1, 2, 2]]
    ids = np.arange(15).reshape(3, 5)
    a_ids, a_mask = left_align(ids, mask)
    assert a_ids.tolist() == [[0, 0, 2, 3, 4], [0, 0, 5, 6, 7], [0, 0, 10, 12, 13]]
    assert a_mask.tolist() == [[0, 0, 1, 1, 1]] * 3


# ----- policies and taps ----------------------------------------------------------------

def test_policies():
    assert Policy.get("fp64").is_fp64 and not Policy.get("fp64-hf").is_fp64
    p = Policy.get("bf16", softmax_dtype="bfloat16")
    assert p.softmax_dtype == "bfloat16" and p.norm_dtype == "float32"
    with pytest.raises(PolicyError, match="unknown precision policy 'fp8'"):
        Policy.get("fp8")
    with pytest.raises(PolicyError, match="unknown policy knob"):
        Policy.get("fp32", softmax="bfloat16")
    with pytest.raises(PolicyError, match="accum_dtype=bfloat16 is narrower"):
        Policy.get("fp32", accum_dtype="bfloat16")
    with pytest.raises(PolicyError, match="norm_dtype='float8'"):
        Policy.get("fp32", norm_dtype="float8")


def test_tap_names():
    names = taps.all_taps(2)
    assert names[0] == "embed" and names[-1] == "logits" and len(names) == 2 + 2 * 15 + 1
    assert taps.resolve(["layers.*.out", "embed"], 2) == ("embed", "layers.0.out", "layers.1.out")
    assert taps.component_of("layers.1.q_rope") == "attn" and taps.layer_of("layers.1.q_rope") == 1
    assert taps.component_of("logits") == "lm_head"
    with pytest.raises(KeyError, match="unknown tap 'layers.5.out'"):
        taps.resolve("layers.5.out", 2)


@pytest.mark.parametrize("stored, policy_dtype, exact", [("float32", "float32", True), ("float32", "bfloat16", False),
                                                         ("bfloat16", "float32", True), ("float32", "float64", True),
                                                         ("float16", "bfloat16", False)])
def test_checkpoint_says_whether_a_dtype_holds_every_tensor_exactly(tiny_dir, stored, policy_dtype, exact):
    from llamaspec.checkpoint import Checkpoint
    assert Checkpoint(tiny_dir(dtype=stored)).exact_in(policy_dtype) is exact
