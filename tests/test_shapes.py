"""Synthetic checkpoints of real shapes (llamaspec.shapes, `llama-parity make-checkpoint`)."""

import json

import numpy as np
import pytest

from llama_parity.cli import main
from llamaspec import ConfigError, LlamaConfig, load_weights
from llamaspec.shapes import SHAPES, shape_config, write_checkpoint


def test_shapes_are_the_real_models_configs():
    for name in SHAPES:   # each passes the config checks a real config.json gets
        LlamaConfig.from_dict(shape_config(name), source=name)
    one_b = LlamaConfig.from_dict(shape_config("llama-3.2-1b"))
    assert (one_b.hidden_size, one_b.num_hidden_layers, one_b.vocab_size, one_b.tie_word_embeddings) == \
        (2048, 16, 128256, True)
    assert one_b.rope.type == "llama3" and one_b.rope.factor == 32.0
    eight_b = LlamaConfig.from_dict(shape_config("llama-3.1-8b"))
    assert (eight_b.hidden_size, eight_b.intermediate_size, eight_b.num_hidden_layers) == (4096, 14336, 32)
    with pytest.raises(ConfigError, match="unknown shape 'llama-9'"):
        shape_config("llama-9")
    with pytest.raises(ConfigError, match="layers=0 must be a positive integer"):
        shape_config("llama-3.2-1b", layers=0)


def test_written_checkpoint_loads_is_sharded_and_each_tensor_is_its_own_draw(tmp_path):
    a = write_checkpoint(tmp_path / "a", "smollm2-135m", "bfloat16", layers=2, shard_bytes=20 << 20)
    b = write_checkpoint(tmp_path / "b", "smollm2-135m", "bfloat16", layers=1)
    assert (a / "model.safetensors.index.json").is_file() and len(list(a.glob("model-*.safetensors"))) > 1
    cfg_a, wa = load_weights(a)
    cfg_b, wb = load_weights(b)
    assert cfg_a.num_hidden_layers == 2 and cfg_b.num_hidden_layers == 1
    # the same tensor whatever the depth or the sharding
    for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert np.array_equal(np.asarray(wa[key]), np.asarray(wb[key])), key
    norm = np.asarray(wa["model.layers.1.input_layernorm.weight"], np.float32)
    q = np.asarray(wa["model.layers.1.self_attn.q_proj.weight"], np.float32)
    assert abs(norm.mean() - 1) < 0.05 and abs(q.std() * np.sqrt(q.shape[1]) - 0.5) < 0.05
    c = write_checkpoint(tmp_path / "c", "smollm2-135m", "bfloat16", layers=1, seed=1)
    assert not np.array_equal(np.asarray(load_weights(c)[1]["model.norm.weight"]), np.asarray(wb["model.norm.weight"]))


def test_cli_writes_with_the_tokenizer_and_refuses_the_repo_and_overwrites(tmp_path, capsys, smollm2):
    import torchref
    out = tmp_path / "synth"
    assert main(["make-checkpoint", "--shape", "smollm2-135m", "--layers", "1", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert (out / "tokenizer.json").is_file() and json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    logits = torchref.from_pretrained(out, policy="bf16")(np.array([[1, 2, 3, 4]]))
    assert np.isfinite(np.asarray(logits, np.float32)).all()
    assert main(["make-checkpoint", "--shape", "smollm2-135m", "--layers", "1", str(out)]) == 2
    assert "holds a checkpoint already; pass --force" in capsys.readouterr().err
    from pathlib import Path
    inside = Path(__file__).resolve().parents[1] / "synthetic-weights"
    assert main(["make-checkpoint", "--shape", "smollm2-135m", str(inside)]) == 2
    assert "inside the llama-parity repository" in capsys.readouterr().err and not inside.exists()
