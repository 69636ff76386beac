"""compare.adapters.ports: keras-hub, penzai and litgpt Llama ports loaded from one folder and
compared with torchref by the ladder.

Each test skips when its port is not installed (docs/ports.md: how to install them side by
side). On a tiny random checkpoint: the port right (its known fix applied) is drift, its
float64 twin agrees with torchref at fp64, and a bug planted inside it (on both its working
copy and its twin) is found at its layer and component. On SmolLM2 (marked smollm2): what
the issue measured as loaded is named (keras-hub's epsilon, penzai's RoPE base), and with
the fixes applied the ports are drift.
"""

import dataclasses
import json
import os

import numpy as np
import pytest
from port_checks import assert_clean, assert_found

import compare
import torchref
from compare.adapters import Side
from compare.metrics import rel_l2

ROPE_THETA = 100000.0     # as SmolLM2's; penzai's old attribute default (10000) is then wrong


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from llamaspec.testing import TINY_CONFIGS, make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("ports"), **{**TINY_CONFIGS["gqa"], "rope_theta": ROPE_THETA})


@pytest.fixture(scope="module")
def batch(right_padded_pair):
    return right_padded_pair


def compared(port, folder, batch, policy="fp32", twin=None):
    """compare_models("torchref", port); twin replaces port.float64() (a planted bug in both)."""
    cand = port if twin is None else Side(port.name, port, twin, bool(port.keeps_f32), tuple(port.taps))
    return compare.compare_models("torchref", cand, folder, inputs=batch, policy=policy)




def twin_error(port, folder, batch):
    """Worst rel L2 over the port's taps between its float64 twin and torchref at fp64."""
    ids, mask = batch
    _, mine = port.float64().capture(ids, mask, port.taps)
    _, ref = torchref.from_pretrained(folder, policy="fp64").capture(ids, mask, port.taps)
    real = mask.astype(bool)
    return max(rel_l2(np.asarray(mine[t], np.float64)[real], np.asarray(ref[t], np.float64)[real]) for t in port.taps)


# ----- keras-hub ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keras_hub():
    os.environ.setdefault("KERAS_BACKEND", "jax")    # before keras is imported: keras-hub's JAX backend
    return pytest.importorskip("keras_hub", reason="keras-hub not installed (docs/ports.md)")


def test_keras_hub_with_the_config_epsilon_is_drift(keras_hub, folder, batch):
    from compare.adapters.ports import KerasHubLlama
    port = KerasHubLlama(folder, "fp32", rms_norm_eps=1e-5)
    assert port.config.rms_norm_eps == 1e-5 and port.config.rope_theta == ROPE_THETA
    assert_clean(compared(port, folder, batch))
    assert twin_error(port, folder, batch) <= 1e-12


def test_keras_hub_as_loaded_names_its_epsilon(keras_hub, folder, batch):
    from compare.adapters.ports import KerasHubLlama
    report = compared(KerasHubLlama(folder, "fp32"), folder, batch)
    d = assert_found(report, "layers.0.attn_norm", "attn_norm")
    assert "epsilon" in d.hint
    assert report.config_differences == ["rms_norm_eps: 1e-05 (reference) vs 1e-06 (candidate)"]


def test_keras_hub_planted_epsilon_found_at_its_layer(keras_hub, folder, batch):
    from compare.adapters.ports import KerasHubLlama
    port, twin = KerasHubLlama(folder, "fp32", rms_norm_eps=1e-5), KerasHubLlama(folder, "fp64", rms_norm_eps=1e-5)
    for p in (port, twin):
        p.backbone.transformer_layers[1]._feedforward_layernorm.epsilon = 1e-2
    assert_found(compared(port, folder, batch, twin=twin), "layers.1.mlp_norm", "mlp_norm")


def test_keras_hub_inject_replaces_the_layer_input(keras_hub, folder, batch):
    from compare.adapters.ports import KerasHubLlama
    ids, mask = batch
    port = KerasHubLlama(folder, "fp32", rms_norm_eps=1e-5)
    h = np.random.default_rng(2).standard_normal((*ids.shape, 32)).astype(np.float32)
    _, mine = port.capture(ids, mask, ("layers.1.attn_norm", "layers.1.out"), inject={1: h})
    _, ref = torchref.from_pretrained(folder, policy="fp32").capture(ids, mask, ("layers.1.out",), inject={1: h})
    assert rel_l2(mine["layers.1.out"], ref["layers.1.out"]) < 1e-5


# ----- penzai ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def penzai():
    return pytest.importorskip("penzai", reason="penzai not installed (docs/ports.md)")


def test_penzai_with_rope_parameters_is_drift(penzai, folder, batch):
    from compare.adapters.ports import PenzaiLlama
    port = PenzaiLlama(folder, "fp32", rope_theta="rope_parameters")
    assert port.config.rope_theta == ROPE_THETA
    assert_clean(compared(port, folder, batch))
    assert twin_error(port, folder, batch) <= 1e-12


def test_penzai_as_loaded_under_transformers_5_names_the_missing_attribute(penzai, folder):
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 still has config.rope_theta")
    from compare.adapters.ports import PenzaiLlama
    with pytest.raises(AttributeError, match="rope_parameters"):
        PenzaiLlama(folder, "fp32")


def test_penzai_old_rope_attribute_found_as_rope_frequencies(penzai, folder, batch):
    from compare.adapters.ports import PenzaiLlama
    d = assert_found(compared(PenzaiLlama(folder, "fp32", rope_theta=10000.0), folder, batch), "layers.0.q_rope",
                     "attn")
    assert "RoPE" in d.hint


def test_penzai_planted_epsilon_found_at_its_layer(penzai, folder, batch):
    import jax
    from penzai import pz
    from penzai.nn.standardization import RMSStandardize

    from compare.adapters.ports import PenzaiLlama

    def planted(p):     # layer 1's feed-forward norm (body: embedding, block 0, block 1, ...)
        def eps(n):
            return dataclasses.replace(n, epsilon=jax.numpy.asarray(1e-2, n.epsilon.dtype))
        with jax.enable_x64(p.x64):
            norm = pz.select(p.model).at(lambda m: m.body.sublayers[2].sublayers[1].delta.sublayers[0])
            model = norm.at_instances_of(RMSStandardize).apply(eps)
        return PenzaiLlama(folder, p.dtype, "rope_parameters", model=model)
    port = PenzaiLlama(folder, "fp32", rope_theta="rope_parameters")
    report = compared(planted(port), folder, batch, twin=planted(port.float64()))
    assert_found(report, "layers.1.mlp_norm", "mlp_norm")


# ----- litgpt ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def litgpt():
    return pytest.importorskip("litgpt", reason="litgpt not installed (docs/ports.md)")


def litgpt_config(folder) -> dict:
    """A litgpt config for the tiny checkpoint (litgpt's table has none; it reads no config.json)."""
    c = json.loads((folder / "config.json").read_text())
    return dict(name="tiny-llama", block_size=c["max_position_embeddings"], vocab_size=c["vocab_size"],
                padded_vocab_size=c["vocab_size"], n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"],
                n_embd=c["hidden_size"], n_query_groups=c["num_key_value_heads"], rotary_percentage=1.0,
                parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                intermediate_size=c["intermediate_size"], rope_base=c["rope_theta"], norm_eps=c["rms_norm_eps"])


def test_litgpt_is_drift_and_leaves_the_folder_alone(litgpt, folder, batch):
    from compare.adapters.ports import LitGPTLlama
    before = sorted(p.name for p in folder.iterdir())
    port = LitGPTLlama(folder, "fp32", litgpt_config=litgpt_config(folder))
    assert sorted(p.name for p in folder.iterdir()) == before
    assert port.config.rope_theta == ROPE_THETA and port.config.tie_word_embeddings is False
    assert not {"layers.0.q", "layers.0.q_rope"} & set(port.taps)
    assert_clean(compared(port, folder, batch))
    # its twin keeps litgpt's f32 steps (RMSNorm in x.float(), RoPE cache in float32)
    assert port.keeps_f32 and twin_error(port, folder, batch) <= 1e-6


def test_litgpt_planted_epsilon_found_at_its_layer(litgpt, folder, batch):
    from compare.adapters.ports import LitGPTLlama
    port = LitGPTLlama(folder, "fp32", litgpt_config=litgpt_config(folder))
    twin = port.float64()
    for p in (port, twin):
        p.module.transformer.h[1].norm_2.eps = 1e-2
    assert_found(compared(port, folder, batch, twin=twin), "layers.1.mlp_norm", "mlp_norm")


def test_litgpt_without_a_config_name_says_so(litgpt, folder):
    from compare.adapters.ports import LitGPTLlama
    with pytest.raises(ValueError, match="litgpt has no config named"):
        LitGPTLlama(folder, "fp32")


# ----- SmolLM2 (the measurements) ----------------------------------------------------------

SMOL_EPS = 9.999999747378752e-06    # SmolLM2's config.json (1e-5 as float32)


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_keras_hub_as_loaded_and_fixed(keras_hub, smollm2):
    from compare.adapters.ports import KerasHubLlama
    report = compare.compare_models("torchref", KerasHubLlama(smollm2, "fp32"), smollm2, policy="fp32")
    print("\nMEASURED keras-hub as loaded:", report.summary())
    assert_found(report, "layers.0.attn_norm", "attn_norm")
    assert any(f.startswith("rms_norm_eps") for f in report.config_differences)
    report = compare.compare_models("torchref", KerasHubLlama(smollm2, "fp32", rms_norm_eps=SMOL_EPS), smollm2,
                                    policy="fp32")
    print("MEASURED keras-hub eps passed:", report.summary())
    assert report.verdict in ("exact", "drift"), report.summary()


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_penzai_old_attribute_and_fixed(penzai, smollm2):
    from compare.adapters.ports import PenzaiLlama
    report = compare.compare_models("torchref", PenzaiLlama(smollm2, "fp32", rope_theta=10000.0), smollm2,
                                    policy="fp32")
    print("\nMEASURED penzai rope_theta 10000:", report.summary())
    d = assert_found(report, "layers.0.q_rope", "attn")
    assert "RoPE" in d.hint
    report = compare.compare_models("torchref", PenzaiLlama(smollm2, "fp32", rope_theta="rope_parameters"), smollm2,
                                    policy="fp32")
    print("MEASURED penzai rope_parameters:", report.summary())
    assert report.verdict in ("exact", "drift"), report.summary()


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_litgpt(litgpt, smollm2):
    from compare.adapters.ports import LitGPTLlama
    report = compare.compare_models("torchref", LitGPTLlama(smollm2, "fp32", model_name="SmolLM2-135M-Instruct"),
                                    smollm2, policy="fp32")
    print("\nMEASURED litgpt:", report.summary())
    assert report.verdict in ("exact", "drift"), report.summary()
