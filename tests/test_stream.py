"""The layer-streamed ladder (compare.ladder.stream): each side's streamed run is its full run
bit for bit, and the streamed Report carries the full ladder's numbers, clean and with a
precision or semantic finding (teacher forcing's confirmation included)."""

import json

import numpy as np
import pytest

import jaxmodel
import torchref
from compare import compare_models
from compare.adapters import OurModel, Side
from compare.ladder.engine import run_ladder
from compare.ladder.stream import CheckpointModel, checkpoint_side, stream_capture
from llamaspec import CheckpointError, Policy
from llamaspec.testing import write_safetensors

IDS = np.random.default_rng(0).integers(3, 96, (2, 40))
MASK = np.ones_like(IDS)
MASK[1, 29:] = 0     # a padded row: positions and masks come from the mask on both paths
MODELS = {"torchref": torchref, "jaxmodel": jaxmodel}


def _same(a: dict, b: dict) -> list[str]:
    return [t for t in a if not (a[t].dtype == b[t].dtype and np.array_equal(a[t], b[t]))]


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("package", ["torchref", "jaxmodel"])
def test_streamed_run_is_the_full_run_bit_for_bit(package, policy, tiny_dir):
    folder = tiny_dir("gqa")
    logits, full = MODELS[package].from_pretrained(folder, policy=policy).capture(IDS, MASK, ["*"])
    s_logits, streamed = stream_capture(CheckpointModel(package, folder, policy), IDS, MASK, ["*"])
    assert list(streamed) == list(full)
    assert _same(full, streamed) == []
    assert np.array_equal(logits, s_logits)


@pytest.mark.parametrize("name,extra", [("tied", {}), ("bias", {"shards": 3}), ("llama3", {"dtype": "bfloat16"})])
def test_streamed_run_bit_for_bit_on_tied_biased_sharded_bf16_checkpoints(name, extra, tiny_dir):
    folder = tiny_dir(name, **extra)
    for package in MODELS:
        _, full = MODELS[package].from_pretrained(folder, policy="bf16").capture(IDS, MASK, ["*"])
        _, streamed = stream_capture(CheckpointModel(package, folder, "bf16"), IDS, MASK, ["*"])
        assert _same(full, streamed) == [], package


@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_streamed_jaxmodel_with_native_bf16_dots_is_the_full_run_bit_for_bit(name, tiny_dir, monkeypatch):
    """With native bf16 products (forced here on any CPU; on by default with AMX or AVX-512-BF16) the
    full run's scan keeps its blocks on the widened path and its lm_head on the native copy: the streamed
    runner must do both the same way (LayerRunner.block, LayerRunner.logits)."""
    from jaxmodel import plan
    monkeypatch.setenv(plan.BF16_DOTS_ENV, "native")
    # wide enough (hidden 256) that the f32 sums' order shows in the last bit of a bf16 product
    folder = tiny_dir(name, hidden_size=256, intermediate_size=512)
    logits, full = jaxmodel.from_pretrained(folder, policy="bf16").capture(IDS, MASK, ["*"])
    s_logits, streamed = stream_capture(CheckpointModel("jaxmodel", folder, "bf16"), IDS, MASK, ["*"])
    assert list(streamed) == list(full)
    assert _same(full, streamed) == []
    assert np.array_equal(logits, s_logits)


def _numbers(report) -> dict:
    """The Report's numbers, but for timings, the environment and the capture check (its
    plain runs differ by design: the streamed ladder walks the logits alone, the full one
    also runs the forward)."""
    d = report.to_dict()
    d.pop("run"), d.pop("environment"), d.pop("capture")
    return json.loads(json.dumps(d))


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
def test_streamed_report_equals_the_full_ladders(policy, tiny_dir):
    folder = tiny_dir("gqa")
    msgs = []
    full = compare_models("torchref", "jaxmodel", folder, inputs=(IDS, MASK), policy=policy, stream=False)
    streamed = compare_models("torchref", "jaxmodel", folder, inputs=(IDS, MASK), policy=policy, progress=msgs.append)
    assert (full.run["path"], streamed.run["path"]) == ("full", "streamed")
    assert streamed.verdict in ("exact", "drift")
    assert _numbers(streamed) == _numbers(full)
    assert any("layer 2/2 done" in m and "s per layer" in m and "left" in m for m in msgs), msgs
    assert set(streamed.run["seconds"]) >= {"reading", "judging", "capture check"} and len(streamed.run["seconds"]) == 7


def _sides(ref_folder, cand_folder, cand_policy, cand_package="jaxmodel"):
    ref = checkpoint_side("torchref", ref_folder, "fp32")
    cand = CheckpointModel(cand_package, cand_folder, cand_policy)
    return ref, Side(cand_package, cand, CheckpointModel(cand_package, cand_folder, "fp64"), False, cand.taps)


def _both(ref, cand, policy):
    full = run_ladder(ref, cand, IDS, MASK, policy, stream=False)
    streamed = run_ladder(ref, cand, IDS, MASK, policy)
    assert streamed.run["path"] == "streamed"
    return full, streamed


def test_streamed_precision_finding_and_its_confirmation_equal_the_full_ladders(tiny_dir):
    """A candidate whose softmax runs in bf16 (a policy knob): precision at attn_ctx."""
    folder = tiny_dir("gqa")
    policy = Policy.get("fp32")
    full, streamed = _both(*_sides(folder, folder, Policy.get("fp32", softmax_dtype="bfloat16")), policy)
    assert streamed.verdict == "precision" and streamed.first_divergence.component == "attn"
    assert streamed.first_divergence.confirmed is not None
    assert "tap_local_ratio" in streamed.local[0]
    assert _numbers(streamed) == _numbers(full)


def test_streamed_semantic_finding_and_its_confirmation_equal_the_full_ladders(tiny_dir, tmp_path):
    """A candidate reading a config with another RMSNorm epsilon: semantic, per-row scale."""
    folder = tiny_dir("gqa")
    other = tmp_path / "eps"
    other.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-2}))
    (other / "model.safetensors").symlink_to(folder / "model.safetensors")
    policy = Policy.get("fp32")
    full, streamed = _both(*_sides(folder, other, policy), policy)
    assert streamed.verdict == "semantic" and streamed.first_divergence.tap == "layers.0.attn_norm"
    assert streamed.first_divergence.confirmed is True
    assert "cand64_tap_local" in streamed.local[0]
    assert _numbers(streamed) == _numbers(full)


def test_streamed_inherited_taps_equal_the_full_ladders(tiny_dir, tmp_path):
    """A checkpoint copy whose layer-0 post-attention norm weight is w + 1 (a conversion bug in
    one layer): semantic at layers.0.mlp_norm; the later findings are inherited on both paths,
    judged on the same forced runs (the lm_head's too)."""
    from llamaspec import load_weights
    from llamaspec.files import atomic_write
    folder = tiny_dir("gqa")
    cfg, weights = load_weights(folder)
    weights = {k: np.array(v) for k, v in weights.items()}
    weights["model.layers.0.post_attention_layernorm.weight"] += 1
    atomic_write(tmp_path / "config.json", (folder / "config.json").read_text(), "config")
    write_safetensors(tmp_path / "model.safetensors", weights, {"format": "pt"})
    policy = Policy.get("fp32")
    full, streamed = _both(*_sides(folder, tmp_path, policy), policy)
    assert streamed.first_divergence.tap == "layers.0.mlp_norm" and streamed.verdict == "semantic"
    inherited = [v for v in streamed.taps if v.kind == "inherited"]
    assert {v.inherited.how for v in inherited} == {"same_layer", "forced"}, [v.tap for v in inherited]
    assert any(v.tap == "logits" for v in inherited)
    assert _numbers(streamed) == _numbers(full)


def test_stream_true_refuses_sides_that_cannot_stream(tiny_dir):
    folder = tiny_dir("gqa")
    loaded = OurModel(torchref.from_pretrained(folder), folder)
    side = Side.of(loaded)
    with pytest.raises(ValueError, match="cannot stream"):
        run_ladder(side, checkpoint_side("jaxmodel", folder, "fp32"), IDS, MASK, Policy.get("fp32"), stream=True)
    report = run_ladder(side, checkpoint_side("jaxmodel", folder, "fp32"), IDS, MASK, Policy.get("fp32"))
    assert report.run["path"] == "full"


def test_checkpoint_model_loads_the_whole_model_only_when_asked(tiny_dir):
    folder = tiny_dir("gqa")
    m = CheckpointModel("jaxmodel", folder, "bf16")
    assert m._model is None and m.cfg.num_hidden_layers == 2 and m.float64().policy.name == "fp64"
    logits, _ = m.capture(IDS, MASK)
    assert m._model is not None
    assert np.array_equal(logits, jaxmodel.from_pretrained(folder, policy="bf16").capture(IDS, MASK)[0])


def test_a_nan_in_a_layer_tensor_is_named_when_streaming(tiny_dir, tmp_path):
    from llamaspec.checkpoint import Checkpoint
    src = tiny_dir("gqa")
    ckpt = Checkpoint(src)
    tensors = {k: np.array(ckpt.get(k)) for k in ckpt.keys()}
    tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = np.nan
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
                                              r"has 1 NaN/Inf"):
        compare_models("torchref", "jaxmodel", tmp_path, inputs=(IDS, MASK))


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_streamed_report_equals_the_full_ladders(smollm2):
    """The default comparison (258-token prompt, fp32) both ways: the same numbers."""
    full = compare_models("torchref", "jaxmodel", smollm2, stream=False)
    streamed = compare_models("torchref", "jaxmodel", smollm2)
    assert streamed.run["path"] == "streamed"
    assert _numbers(streamed) == _numbers(full)
