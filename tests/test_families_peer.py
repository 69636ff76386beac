"""Llama's relatives (Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, OLMo 2) through compare: transformers'
own class for each family as the peer (its taps, its float64 twin), compare and probe where on
each family, the layer-streamed ladder with each family's steps, and the real shapes of one
model of each family (llamaspec.shapes) streamed against transformers."""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torchref  # noqa: E402
from compare import compare_models  # noqa: E402
from compare.adapters import Side  # noqa: E402
from compare.adapters.transformers import TransformersModel, causal_lm_class  # noqa: E402
from compare.ladder.engine import run_ladder  # noqa: E402
from compare.ladder.stream import CheckpointModel, checkpoint_side, stream_capture  # noqa: E402
from compare.metrics import rel_l2  # noqa: E402
from llamaspec import ConfigError, LlamaConfig, Policy, load_weights  # noqa: E402
from llamaspec import taps as tapnames  # noqa: E402
from llamaspec.files import atomic_write  # noqa: E402
from llamaspec.shapes import SHAPES, shape_config, write_checkpoint  # noqa: E402
from llamaspec.testing import TINY_FAMILIES, make_checkpoint, write_safetensors  # noqa: E402

FAMILY_NAMES = tuple(TINY_FAMILIES)
# transformers' class of each family, by name (the adapter picks it from the config's model_type)
CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
           "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}
# the shapes of Llama's relatives in llamaspec.shapes, by family
FAMILY_SHAPES = {"qwen2.5-0.5b": "qwen2", "qwen3-0.6b": "qwen3", "mistral-7b-v0.1": "mistral",
                 "gemma-2-2b": "gemma2", "gemma-3-1b": "gemma3_text", "olmo-2-0425-1b": "olmo2"}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = make_checkpoint(tmp_path_factory.mktemp(f"peer_{name}"), **TINY_FAMILIES[name])
        return made[name]
    return get


def prompt(B=3, T=10, kind="right", seed=0):
    """ids [B, T] and a mask whose later rows are padded on `kind`'s side (by 3, then 2)."""
    ids = np.random.default_rng(seed).integers(3, 96, (B, T))
    mask = np.ones((B, T), np.int64)
    for row, n in ((1, 3), (2, 2))[:B - 1]:
        if kind == "left":
            mask[row, :n] = 0
        else:
            mask[row, T - n:] = 0
    return ids, mask


def errors(a: dict, b: dict, mask) -> dict:
    real = np.asarray(mask, bool)
    return {k: rel_l2(np.asarray(a[k], np.float64)[real], np.asarray(b[k], np.float64)[real]) for k in a}


def hf_peer_policy(family):
    """torchref's policy that computes what transformers' class does inside a float64 model:
    fp64-hf (f32 norm, RoPE and softmax islands). OLMo 2's norm multiplies its float64 weight by
    the f32 normalised x, a float64 product (Olmo2RMSNorm: `self.weight * hidden_states`), where
    torchref's fp64-hf applies the family's convention (the weight in norm_dtype, f32): the peer
    is fp64-hf with the norm's product in float64 (norm_cast_before_weight=True)."""
    return Policy.get("fp64-hf", norm_cast_before_weight=True) if family == "olmo2" else Policy.get("fp64-hf")


# ----- 1. the peer: transformers' class for the family, its taps, its float64 twin ----------------

@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_transformers_class_taps_are_torchrefs_at_fp64_hf(family, family_dir):
    """from_pretrained picks the family's class; every tap of the family's steps (q_norm, k_norm
    per head, the norms by role, Gemma's scaled embedding, the soft-capped logits) is torchref's
    at the float64 policy transformers computes by, bit for bit."""
    folder = family_dir(family)
    hf = TransformersModel.from_pretrained(folder, "fp64")
    assert type(hf.model).__name__ == CLASSES[family] == causal_lm_class(LlamaConfig.from_file(folder).model_type)
    ids, mask = prompt()
    logits, acts = hf.capture(ids, mask, taps="*")
    ref_logits, ref = torchref.from_pretrained(folder, policy=hf_peer_policy(family), backend="reference").capture(
        ids, mask, taps=list(acts))
    assert list(acts) == tapnames.all_taps(hf.cfg) == list(hf.taps)
    assert {k: v.shape for k, v in acts.items()} == {k: v.shape for k, v in ref.items()}
    errs = errors({**acts, "returned": logits}, {**ref, "returned": ref_logits}, mask)
    assert max(errs.values()) == 0.0, {k: e for k, e in errs.items() if e}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_float64_twin_of_an_fp32_model_is_the_peer(family, family_dir):
    """The adapter's float64 twin (a float64 copy of the fp32 model, padded batches row by row) is
    the same peer, and its embed tap is the oracle's bit for bit: Gemma's embedding scale is
    sqrt(hidden_size) in float64, not the float32 model's rounded buffer (the twin check reads
    the embed tap as the weights the twin runs)."""
    folder = family_dir(family)
    twin = TransformersModel.from_pretrained(folder, "fp32").float64()
    ids, mask = prompt(kind="left")
    _, acts = twin.capture(ids, mask, taps="*")
    _, ref = torchref.from_pretrained(folder, policy=hf_peer_policy(family), backend="reference").capture(
        ids, mask, taps=list(acts))
    errs = errors(acts, ref, mask)
    assert max(errs.values()) <= 1e-15, {k: e for k, e in errs.items() if e > 1e-15}    # rows alone: other sums
    _, oracle = torchref.from_pretrained(folder, policy="fp64").capture(ids, mask, taps="embed")
    real = mask.astype(bool)
    assert np.array_equal(acts["embed"][real], oracle["embed"][real])


def test_qk_norm_taps_are_per_head_in_every_layout(family_dir):
    """Qwen3 norms [B,T,H,D], Gemma 3 [B,H,T,D] (after the transpose), OLMo 2 the whole
    projection: the taps are [B, T, heads, head_dim] in each, and q_rope is RoPE of q_norm."""
    ids, mask = prompt(B=2, T=7)
    for family in ("qwen3", "gemma3_text", "olmo2"):
        hf = TransformersModel.from_pretrained(family_dir(family), "fp32")
        _, acts = hf.capture(ids, mask, taps=["layers.1.q_norm", "layers.1.k_norm", "layers.1.q", "layers.1.q_rope"])
        cfg = hf.cfg
        assert acts["layers.1.q_norm"].shape == (2, 7, cfg.num_attention_heads, cfg.head_dim), family
        assert acts["layers.1.k_norm"].shape == (2, 7, cfg.num_key_value_heads, cfg.head_dim), family
        assert not np.array_equal(acts["layers.1.q_norm"], acts["layers.1.q"])
        # position 0 is not rotated: q_rope there is q_norm's value
        assert np.array_equal(acts["layers.1.q_rope"][0, 0], acts["layers.1.q_norm"][0, 0])


def test_a_family_model_missing_its_modules_is_refused_by_name(family_dir):
    model = transformers.Olmo2ForCausalLM.from_pretrained(family_dir("olmo2"), dtype=torch.float32).eval()
    del model.model.layers[1].post_feedforward_layernorm
    with pytest.raises(TypeError, match="needs a transformers Olmo2ForCausalLM .*post_feedforward_layernorm"):
        TransformersModel(model)
    # a relative's config we do not read: refused by its field (its norms' roles come from the config)
    gemma = transformers.Gemma2ForCausalLM.from_pretrained(family_dir("gemma2"), dtype=torch.float32).eval()
    gemma.config.use_bidirectional_attention = True
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        TransformersModel(gemma)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_through_the_adapter_is_torchrefs(family, family_dir):
    """prefill/decode through transformers' own cache (sliding windows included), greedy: the
    tokens torchref generates at fp32."""
    folder = family_dir(family)
    ids, mask = prompt(B=2, T=6, kind="left", seed=3)
    theirs = TransformersModel.from_pretrained(folder, "fp32").generate(ids, mask, max_new_tokens=8, eos_token_ids=[])
    ours = torchref.from_pretrained(folder, "fp32").generate(ids, mask, max_new_tokens=8, eos_token_ids=[])
    assert np.asarray(theirs).tolist() == np.asarray(ours).tolist()


# ----- 2. compare on every family: the Python API, the CLI, probe where, dumps ----------------------

@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_clean_transformers_peer_is_exact_or_drift(family, policy, family_dir):
    folder = family_dir(family)
    ids, mask = prompt(B=2, T=12, kind="left", seed=1)
    report = compare_models("torchref", TransformersModel.from_pretrained(folder, policy), folder,
                            inputs=(ids, mask), policy=policy, teacher_forcing=False)
    assert report.verdict in ("exact", "drift"), report.summary()
    assert [v.tap for v in report.taps] == tapnames.all_taps(LlamaConfig.from_file(folder))


def test_a_family_model_object_is_taken_as_a_transformers_model(family_dir):
    folder = family_dir("qwen3")
    model = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    report = compare_models("torchref", model, folder, inputs=prompt(B=2), policy="fp32", teacher_forcing=False)
    assert report.verdict in ("exact", "drift")


def test_cli_compare_with_transformers_on_a_family(family_dir, tmp_path, capsys):
    """`compare --candidate transformers` loads the folder's family class (Gemma 3: q/k norms,
    sandwich norms, a local RoPE), not a LlamaForCausalLM."""
    from llama_parity.cli import main
    out = tmp_path / "r.json"
    rc = main(["compare", str(family_dir("gemma3_text")), "--candidate", "transformers", "--random-tokens", "2x10",
               "--policy", "bf16", "--json", str(out), "--no-files", "--no-colour", "--no-teacher-forcing"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    r = json.loads(out.read_text())
    assert r["verdict"] in ("exact", "drift") and r["candidate"].startswith("transformers[eager, bfloat16")
    assert {"layers.1.q_norm", "layers.1.post_attn_norm", "layers.1.post_mlp_norm"} <= {v["tap"] for v in r["taps"]}


@pytest.mark.parametrize("impl", ["torchref", "transformers"])
def test_probe_where_batch_on_a_family(impl, family_dir, tmp_path, capsys):
    """probe where (batch) on a Gemma 2 checkpoint: every comparison row judged, the family's
    steps in the taps (torchref streamed, transformers' class loaded whole)."""
    from llama_parity.cli import main
    out = tmp_path / "where.json"
    rc = main(["probe", "where", str(family_dir("gemma2")), "--circumstance", "batch", "--impl", impl,
               "--policy", "fp32", "--batch-sizes", "2", "--no-colour", "--json", str(out)])
    capsys.readouterr()
    assert rc == 0
    (res,) = json.loads(out.read_text())["results"]
    assert res["circumstance"] == "batch" and res["comparisons"]
    assert all(c["verdict"] in ("exact", "drift") for c in res["comparisons"])
    assert "layers.1.post_mlp_norm" in {t["tap"] for t in res["comparisons"][0]["taps"]}


def test_a_family_dump_is_read_back_with_the_live_numbers(family_dir, tmp_path):
    from compare import Dump, capture
    folder = family_dir("gemma2")
    ids, mask = prompt(B=2, T=12)
    out = capture(folder, TransformersModel.from_pretrained(folder, "bf16"), "bf16", inputs=(ids, mask),
                  out=tmp_path / "dump")
    d = Dump(out)
    assert d.taps == tuple(tapnames.all_taps(d.cfg))
    live = compare_models("torchref", TransformersModel.from_pretrained(folder, "bf16"), folder, inputs=(ids, mask),
                          policy="bf16", teacher_forcing=False)
    fromdump = compare_models("torchref", d, folder, inputs=d.inputs, policy=d.policy, teacher_forcing=False)
    assert [(v.tap, v.kind, v.err_cand) for v in fromdump.taps] == [(v.tap, v.kind, v.err_cand) for v in live.taps]


# ----- 3. the layer-streamed ladder with the family's steps -------------------------------------------

@pytest.mark.parametrize("policy", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_streamed_run_is_the_full_run_bit_for_bit(family, policy, family_dir):
    folder = family_dir(family)
    ids, mask = prompt(kind="left")
    logits, full = torchref.from_pretrained(folder, policy=policy).capture(ids, mask, ["*"])
    s_logits, streamed = stream_capture(CheckpointModel("torchref", folder, policy), ids, mask, ["*"])
    assert list(streamed) == list(full) == tapnames.all_taps(LlamaConfig.from_file(folder))
    assert [t for t in full if not np.array_equal(full[t], streamed[t])] == []
    assert np.array_equal(logits, s_logits)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_streamed_ladder_judges_every_family_step(family, family_dir):
    """torchref's default backend against its reference backend, streamed: each layer's taps
    are the family's steps (cfg.layer_steps), judged."""
    folder = family_dir(family)
    ids, mask = prompt(B=2, T=12, kind="left")
    ref, cand = checkpoint_side("torchref", folder, "bf16"), checkpoint_side("torchref", folder, "bf16", "reference")
    report = run_ladder(ref, cand, ids, mask, Policy.get("bf16"))
    assert report.run["path"] == "streamed" and report.verdict in ("exact", "drift"), report.summary()
    assert [v.tap for v in report.taps] == tapnames.all_taps(LlamaConfig.from_file(folder))


def _numbers(report) -> dict:
    d = report.to_dict()
    d.pop("run"), d.pop("environment"), d.pop("capture")
    return json.loads(json.dumps(d))


def test_streamed_finding_at_a_family_step_equals_the_full_ladders(family_dir, tmp_path):
    """A Gemma 2 copy whose layer-1 post-feedforward norm weight is off by 0.5 (a conversion bug
    in a sandwich norm): semantic at layers.1.post_mlp_norm, confirmed by teacher forcing over
    the family's steps, the same report streamed and full."""
    folder = family_dir("gemma2")
    _, weights = load_weights(folder)
    weights = {k: np.array(v) for k, v in weights.items()}
    weights["model.layers.1.post_feedforward_layernorm.weight"] += 0.5
    atomic_write(tmp_path / "config.json", (folder / "config.json").read_text(), "config")
    write_safetensors(tmp_path / "model.safetensors", weights, {"format": "pt"})
    policy = Policy.get("fp32")
    ref = checkpoint_side("torchref", folder, policy)
    cand = CheckpointModel("torchref", tmp_path, policy)
    cand = Side("torchref", cand, cand.float64(), False, cand.taps)
    ids, mask = prompt(B=2, T=12)
    full = run_ladder(ref, cand, ids, mask, policy, stream=False)
    streamed = run_ladder(ref, cand, ids, mask, policy)
    assert streamed.run["path"] == "streamed"
    assert streamed.verdict == "semantic" and streamed.first_divergence.tap == "layers.1.post_mlp_norm"
    assert streamed.first_divergence.confirmed is True
    assert _numbers(streamed) == _numbers(full)


# ----- 4. real shapes of the relatives (llamaspec.shapes), streamed against transformers -------------

def test_family_shapes_are_the_real_configs_as_transformers_reads_them(tmp_path):
    """Each relative's shape is read by transformers' config class as by ours (their class fills
    a pad id in: left aside), with the family's features."""
    cfgs = {}
    for shape, family in FAMILY_SHAPES.items():
        folder = tmp_path / shape
        folder.mkdir()
        atomic_write(folder / "config.json", json.dumps(shape_config(shape)), "config.json")
        ours = LlamaConfig.from_file(folder)
        theirs = LlamaConfig.from_dict(transformers.AutoConfig.from_pretrained(folder).to_dict(), "transformers")
        assert ours.model_type == family and dataclasses.replace(theirs, pad_token_id=None) == ours, shape
        cfgs[shape] = ours
    assert cfgs["qwen2.5-0.5b"].attention_bias and not cfgs["qwen2.5-0.5b"].o_bias
    assert cfgs["qwen2.5-0.5b"].sliding_window == () and cfgs["qwen2.5-0.5b"].head_dim == 64
    assert cfgs["qwen3-0.6b"].qk_norm == "head" and cfgs["qwen3-0.6b"].head_dim == 128
    assert cfgs["mistral-7b-v0.1"].sliding_window == (4096,) * 32
    g2 = cfgs["gemma-2-2b"]
    assert (g2.attn_softcap, g2.final_softcap, g2.scale, g2.norms) == (50.0, 30.0, 256 ** -0.5, "sandwich")
    assert g2.sliding_window == (4096, None) * 13
    g3 = cfgs["gemma-3-1b"]
    assert g3.sliding_window == ((512,) * 5 + (None,)) * 4 + (512, 512)
    assert g3.local_rope.theta == 10000.0 and g3.rope.theta == 1000000.0 and g3.num_key_value_heads == 1
    o2 = cfgs["olmo-2-0425-1b"]
    assert (o2.norms, o2.qk_norm, o2.num_key_value_heads) == ("post", "projection", 16)
    with pytest.raises(ConfigError, match="vocab_size=300000: gemma-2-2b has 256000 tokens"):
        shape_config("gemma-2-2b", vocab_size=300000)


def _streamed_against_transformers(folder, T, seed=0):
    """torchref at fp32 walked layer by layer vs transformers' class loaded whole at fp32: {tap:
    rel L2} at the real positions, and the share of positions with the same top token."""
    cfg = LlamaConfig.from_file(folder)
    ids = np.random.default_rng(seed).integers(3, cfg.vocab_size, (2, T))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    s_logits, streamed = stream_capture(CheckpointModel("torchref", folder, "fp32"), ids, mask, ["*"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = TransformersModel.from_pretrained(folder, "fp32")
    logits, acts = hf.capture(ids, mask, "*")
    del hf
    assert list(acts) == list(streamed) == tapnames.all_taps(cfg)
    real = mask.astype(bool)
    same_top = float((np.argmax(logits[real], -1) == np.argmax(s_logits[real], -1)).mean())
    return {t: rel_l2(acts[t][real], streamed[t][real]) for t in streamed}, same_top


# rounding at fp32 through a layer or two of a real width: a few 1e-6 (measured up to 3e-6)
SHAPE_TOL = 1e-4


# one layer's parameters: Qwen2.5-0.5B 15M, Qwen3-0.6B 16M, Gemma-3-1B 27M in the default run (biases,
# per-head q/k norms, sandwich norms, the scaled embedding, a local RoPE); OLMo-2-1B 67M, Gemma-2-2B
# 78M and Mistral-7B 218M (seconds each to draw, write and load) with the slow tests
QUICK_SHAPES = ("qwen2.5-0.5b", "qwen3-0.6b", "gemma-3-1b")


@pytest.mark.parametrize("shape", [s if s in QUICK_SHAPES else pytest.param(s, marks=pytest.mark.slow)
                                   for s in FAMILY_SHAPES])
def test_real_shape_one_layer_streamed_matches_transformers(shape, tmp_path):
    """Each relative's real widths, heads and features at one layer with a 512-token vocabulary
    (the embedding and lm_head are most of a small model's weights): torchref streamed vs
    transformers at fp32 within rounding."""
    folder = write_checkpoint(tmp_path / shape, shape, "bfloat16", layers=1, vocab_size=512)
    errs, same_top = _streamed_against_transformers(folder, T=16)
    assert max(errs.values()) <= SHAPE_TOL, {t: e for t, e in errs.items() if e > SHAPE_TOL}
    assert same_top == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("shape", FAMILY_SHAPES)
def test_real_shape_streamed_matches_transformers(shape, tmp_path):
    """Each relative's real shape (its whole vocabulary, two layers) streamed vs transformers at
    fp32; Gemma 3's prompt is longer than its 512-token window, so the window is engaged."""
    folder = write_checkpoint(tmp_path / shape, shape, "bfloat16", layers=2)
    window = min((w for w in LlamaConfig.from_file(folder).sliding_window if w is not None), default=None)
    errs, same_top = _streamed_against_transformers(folder, T=window + 8 if window and window <= 1024 else 24)
    assert max(errs.values()) <= SHAPE_TOL, {t: e for t, e in errs.items() if e > SHAPE_TOL}
    assert same_top >= 0.99


@pytest.mark.slow
def test_cli_make_checkpoint_of_a_smaller_vocabulary_has_no_tokenizer(tmp_path, capsys, smollm2):
    """Mistral's 32000 tokens cannot take SmolLM2's ids (49152): no tokenizer, said so."""
    from llama_parity.cli import main
    out = tmp_path / "mistral"
    assert main(["make-checkpoint", "--shape", "mistral-7b-v0.1", "--layers", "1", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "without a tokenizer" in printed and not (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
    assert set(SHAPES) >= set(FAMILY_SHAPES)


# Gemma 3's real window (512) is longer than this prompt: its windows are engaged at fp64 in
# tests/test_families.py (tiny) and at fp32 in test_real_shape_streamed_matches_transformers.
FP64_SHAPE_TOKENS = 24


@pytest.mark.parametrize("shape", FAMILY_SHAPES)
def test_real_shape_streamed_at_fp64_matches_transformers_class(shape, tmp_path, hf_family_logits):
    """The fp64 agreement at each relative's real widths, heads and features (one layer, a
    512-token vocabulary): torchref walked layer by layer at fp64 vs transformers' class loaded
    whole and run in float64 end to end (conftest's hf_family_logits), within 1e-12."""
    folder = write_checkpoint(tmp_path / shape, shape, "bfloat16", layers=1, vocab_size=512)
    ids = np.random.default_rng(7).integers(3, 512, (2, FP64_SHAPE_TOKENS))
    mask = np.ones_like(ids)
    mask[1, :5] = 0                     # a left-padded row
    ours, _ = stream_capture(CheckpointModel("torchref", str(folder), "fp64"), ids, mask, ["logits"])
    theirs = hf_family_logits(folder, ids, mask)
    real = mask.astype(bool)
    err = rel_l2(np.asarray(ours)[real], theirs[real])
    print(f"\nMEASURED {shape} one layer streamed fp64 vs transformers: rel L2 {err:.2e}")
    assert err <= 1e-12, f"{shape}: rel L2 {err:.2e} streamed fp64 vs transformers' class in float64"
