"""compare.adapters.ports.TorchtuneLlama: torchtune's Llama builders, loaded through its own
hf_to_tune, compared with torchref by the ladder.

Skipped without torchtune (0.6.1 needs torchao 0.11: 0.18 lacks the nf4tensor it imports).
On a tiny random tied checkpoint (GQA, RoPE base 100000, as SmolLM2) and a left-padded
batch: the adapter with the protocol's mask is exact or drift, its float64 twin agrees with
torchref at fp64 to float32 rounding (torchtune keeps f32 steps), the q/k taps mapped back
from torchtune's interleaved layout are Hugging Face's, a planted epsilon is found at its
layer and tap, the llama3_2 builder's hard-coded RoPE scaling is named at q_rope, and the
ways torchtune users hand it a padded batch are judged (docs in the module docstring).
"""

import json

import numpy as np
import pytest
from port_checks import assert_clean, assert_found

import compare
import torchref
from compare.adapters import Side
from compare.metrics import rel_l2

torchtune = pytest.importorskip("torchtune", reason="torchtune not installed (docs/ports.md)")

ROPE_THETA = 100000.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from llamaspec.testing import TINY_CONFIGS, make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("torchtune"),
                           **{**TINY_CONFIGS["tied"], "rope_theta": ROPE_THETA})


@pytest.fixture(scope="module")
def left():
    """Left-padded (5 slots), as torchtune's generate pads a batch of prompts."""
    ids = np.random.default_rng(1).integers(3, 96, (2, 16))
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


@pytest.fixture(scope="module")
def right():
    ids = np.random.default_rng(1).integers(3, 96, (2, 16))
    mask = np.ones_like(ids)
    mask[1, 11:] = 0
    return ids, mask


def port(folder, policy="fp32", **kw):
    from compare.adapters.ports import TorchtuneLlama
    return TorchtuneLlama(folder, policy, **kw)


def compared(p, folder, batch, policy="fp32", twin=None):
    cand = p if twin is None else Side(p.name, p, twin, bool(p.keeps_f32), tuple(p.taps))
    return compare.compare_models("torchref", cand, folder, inputs=batch, policy=policy)




@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_with_the_protocols_mask_is_exact_or_drift(folder, left, policy):
    p = port(folder, policy)
    c = p.config
    assert (c.rope_theta, c.tie_word_embeddings, c.rms_norm_eps, c.num_key_value_heads) == (ROPE_THETA, True, 1e-5, 2)
    assert len(p.taps) == 3 + 15 * 2 and "layers.1.k_rope" in p.taps and "logits" in p.taps
    report = compared(p, folder, left, policy)
    assert_clean(report)
    assert report.config_differences == []
    assert report.twin.status == "accepted" and report.twin.weights == "checkpoint"


def test_twin_agrees_with_torchref_at_fp64_to_float32_rounding(folder, left):
    """torchtune's RMSNorm and RoPE run x.float() and its unembed returns .float() logits, also in
    a float64 model: measured worst rel L2 over every tap 1.4e-07 (float32's unit roundoff is
    6e-08), so the bound is 1e-6, not 1e-12; and it is above 1e-10, or keeps_f32 would be wrong."""
    ids, mask = left
    twin = port(folder).float64()
    assert twin.keeps_f32 and twin.module.tok_embeddings.weight.dtype.itemsize == 8
    _, mine = twin.capture(ids, mask, twin.taps)
    _, ref = torchref.from_pretrained(folder, policy="fp64").capture(ids, mask, twin.taps)
    real = mask.astype(bool)
    errors = {t: rel_l2(np.asarray(mine[t], np.float64)[real], np.asarray(ref[t], np.float64)[real])
              for t in twin.taps}
    assert max(errors.values()) <= 1e-6, max(errors.items(), key=lambda kv: kv[1])
    assert max(errors.values()) > 1e-10
    assert errors["embed"] == 0.0     # the checkpoint's weights at float64, not a cast of rounded ones


def test_q_and_k_mapped_back_from_the_interleaved_layout_are_torchrefs(folder, left):
    """hf_order inverts hf_to_tune's row permutation exactly; the mapped-back q_rope / k_rope of the
    twin equal torchref's at fp64 to float32 rounding (torchtune's RoPE rotates x.float()), and
    without the map they are another vector entirely."""
    import torch
    from torchtune.models.convert_weights import hf_to_tune

    from compare.adapters.ports.torchtune import hf_order, load_state
    c = json.loads((folder / "config.json").read_text())
    heads, kv, dim = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    d = dim // heads
    hf = load_state(folder, "float64")
    tt = hf_to_tune(hf, num_heads=heads, num_kv_heads=kv, dim=dim)
    for name, n in (("q_proj", heads), ("k_proj", kv)):
        back = tt[f"layers.0.attn.{name}.weight"].view(n, d, dim)[:, torch.from_numpy(hf_order(d))].reshape(n * d, dim)
        assert torch.equal(back, hf[f"model.layers.0.self_attn.{name}.weight"])

    ids, mask = left
    twin = port(folder).float64()
    wanted = ("layers.0.q", "layers.0.k", "layers.1.q_rope", "layers.1.k_rope")
    _, mine = twin.capture(ids, mask, wanted)
    _, ref = torchref.from_pretrained(folder, policy="fp64").capture(ids, mask, wanted)
    real = mask.astype(bool)
    for t in wanted:
        assert mine[t].shape == ref[t].shape and mine[t].dtype == np.float64
        assert rel_l2(mine[t][real], np.asarray(ref[t])[real]) <= 1e-6, t
    raw = mine["layers.1.q_rope"][..., np.argsort(hf_order(d))]       # torchtune's own layout
    assert rel_l2(raw[real], np.asarray(ref["layers.1.q_rope"])[real]) > 0.1


def test_planted_epsilon_found_at_its_layer_and_tap(folder, left):
    p = port(folder)
    twin = p.float64()
    for q in (p, twin):
        q.module.layers[1].mlp_norm.eps = 1e-2
    d = assert_found(compared(p, folder, left, twin=twin), "layers.1.mlp_norm", "mlp_norm")
    assert "epsilon" in d.hint


def test_llama3_2_builder_rope_scaling_named_at_q_rope(folder, left):
    """torchtune's llama3_2 builder always builds Llama3ScaledRoPE (scale_factor 32): on a
    checkpoint without RoPE scaling that is a different model, named at the first RoPE."""
    p = port(folder, builder="llama3_2")
    assert type(p.module.layers[0].attn.pos_embeddings).__name__ == "Llama3ScaledRoPE"
    d = assert_found(compared(p, folder, left), "layers.0.q_rope", "attn")
    assert "RoPE" in d.hint and "scal" in d.hint


def test_padding_as_torchtune_users_hand_it(folder, left, right):
    """On a left-padded batch: torchtune.generation's mask and positions are drift; positions
    without a mask attend to the padding keys (semantic at the first attention context);
    module(tokens) alone shifts every real token's position by the padding (semantic at the
    first RoPE). On a right-padded batch module(tokens) alone changes nothing a real token sees."""
    assert_clean(compared(port(folder, padding="torchtune"), folder, left))
    assert_found(compared(port(folder, padding="positions"), folder, left), "layers.0.attn_ctx", "attn")
    d = assert_found(compared(port(folder, padding="none"), folder, left), "layers.0.q_rope", "attn")
    assert "RoPE positions shifted: row 1 rotated at its position + 5 (row 0 at its own)" in d.hint, d.hint
    assert_clean(compared(port(folder, padding="none"), folder, right))


def test_inject_replaces_the_layer_input(folder, left):
    ids, mask = left
    p = port(folder)
    h = np.random.default_rng(2).standard_normal((*ids.shape, 32)).astype(np.float32)
    _, mine = p.capture(ids, mask, ("layers.1.attn_norm", "layers.1.out"), inject={1: h})
    _, ref = torchref.from_pretrained(folder, policy="fp32").capture(ids, mask, ("layers.1.out",), inject={1: h})
    real = mask.astype(bool)
    assert rel_l2(mine["layers.1.out"][real], ref["layers.1.out"][real]) < 1e-5
    _, free = p.capture(ids, mask, ("layers.1.out",))
    assert rel_l2(free["layers.1.out"][real], mine["layers.1.out"][real]) > 0.1


def test_refuses_what_its_builder_cannot_build(tmp_path, folder):
    from llamaspec.testing import TINY_CONFIGS, make_checkpoint
    scaled = make_checkpoint(tmp_path / "scaled", **TINY_CONFIGS["llama3"])
    with pytest.raises(ValueError, match="RoPE scaling"):
        port(scaled)
    biased = make_checkpoint(tmp_path / "bias", **TINY_CONFIGS["bias"])
    with pytest.raises(ValueError, match="bias"):
        port(biased)
    with pytest.raises(ValueError, match="padding"):
        port(folder, padding="left")


def test_an_untied_checkpoint_loads_with_its_own_output(tmp_path, left):
    from llamaspec.testing import make_checkpoint
    untied = make_checkpoint(tmp_path / "untied", rope_theta=ROPE_THETA)
    p = port(untied)
    assert p.config.tie_word_embeddings is False
    assert_clean(compared(p, untied, left))


@pytest.mark.smollm2
def test_smollm2_rope_tables_carry_float32_angles(smollm2):
    """torchtune's RoPE cache is cos/sin of float32 angles (position * theta in float32), kept in
    its float64 twin: on the built-in prompt (258 tokens) its q_rope is 1e-6 from the exact math,
    the error growing with position; with exact float64 tables the same twin is at 2e-7, flat."""
    import torch

    from compare.ladder.engine import parse_inputs
    ids, mask = parse_inputs(None, smollm2)
    twin = port(smollm2).float64()
    taps = ("layers.1.q_rope", "layers.11.q_rope")
    _, oracle = torchref.from_pretrained(smollm2, policy="fp64").capture(ids, mask, taps)
    _, own = twin.capture(ids, mask, taps)
    rope = twin.module.layers[0].attn.pos_embeddings        # one module, shared by every layer
    d = rope.dim
    theta = 1.0 / (rope.base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(rope.max_seq_len, dtype=torch.float64)[:, None] * theta
    rope.cache = torch.stack([torch.cos(angles), torch.sin(angles)], -1)
    _, exact = twin.capture(ids, mask, taps)

    def per_position(acts):
        x, o = acts["layers.11.q_rope"][0], oracle["layers.11.q_rope"][0]
        return np.linalg.norm((x - o).reshape(len(x), -1), axis=1) / np.linalg.norm(o.reshape(len(o), -1), axis=1)
    for t in taps:
        assert rel_l2(own[t], oracle[t]) > 5e-7 and rel_l2(exact[t], oracle[t]) < 3e-7, t
    grows, flat = per_position(own), per_position(exact)
    assert grows[128:].mean() > 3 * grows[:32].mean()
    assert flat[128:].mean() < 1.5 * flat[:32].mean()


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_fp32(smollm2):
    """docs/ports.md, the torchtune section: drift. Until 2026-12-07 the ladder said "semantic at
    layers.11.q_rope, RoPE angles differ": its twin rotates in float32 (the test above), and the
    frequencies read from float32 values at position 1 were taken for another schedule
    (structure.ROPE_ANGLE_READS); logits agree top-1 everywhere."""
    p = port(smollm2)
    assert p.config.rope_theta == 100000.0 and p.config.tie_word_embeddings is True
    report = compare.compare_models("torchref", p, smollm2, policy="fp32")
    print("\nMEASURED torchtune llama3 builder:", report.summary())
    assert report.teacher_forcing == "run" and report.semantic_rung == "run"
    assert report.config_differences == [] and report.logits["pairs"]["candidate vs reference"]["top1_agreement"] == 1
    assert report.verdict == "drift", report.summary()
