"""The Llama family's relatives (Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, OLMo 2) in both models:
the config read as features, exact agreement with transformers' own class at fp64, every feature
engaged (turning it off changes the logits), greedy tokens at fp32, the backends on them."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from llamaspec import LlamaConfig
from llamaspec import taps as tapnames
from llamaspec.config import FAMILIES
from llamaspec.errors import ConfigError, PolicyError
from llamaspec.testing import TINY, TINY_FAMILIES, make_checkpoint

FRAMEWORKS = ("torchref", "jaxmodel")
FAMILY_NAMES = tuple(TINY_FAMILIES)
# transformers' class-name stem of each family (modeling module and *ForCausalLM class)
HF = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma2": "Gemma2", "gemma3_text": "Gemma3",
      "olmo2": "Olmo2"}


def load(framework, folder, policy="fp64", **kw):
    mod = importlib.import_module(framework)
    return mod.from_pretrained(folder, policy=policy, **kw)


def logits_of(model, ids, mask=None) -> np.ndarray:
    out = model(ids, mask)
    return out.numpy() if hasattr(out, "numpy") else np.asarray(out)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made = {}

    def get(name, **extra):
        key = (name, tuple(sorted(extra.items())))
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(f"fam_{name}"), **{**TINY_FAMILIES[name], **extra})
        return made[key]
    return get


def prompt(B=2, T=10, pad=3, seed=0):
    """ids [B, T] and a mask with the last row left-padded by `pad`."""
    ids = np.random.default_rng(seed).integers(3, TINY["vocab_size"], (B, T))
    mask = np.ones((B, T), np.int64)
    mask[-1, :pad] = 0
    return ids, mask


def rel(a, b, mask):
    real = mask.astype(bool)
    return float(np.linalg.norm((a - b)[real]) / np.linalg.norm(b[real]))


# ----- the config ------------------------------------------------------------------------------

def test_family_defaults_are_transformers_config_defaults():
    """A field a config.json leaves out takes the family's config-class default: the table in
    llamaspec.config is checked against transformers' classes here."""
    transformers = pytest.importorskip("transformers")
    classes = {"mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
               "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "olmo2": "Olmo2Config"}
    for family, cls in classes.items():
        theirs = getattr(transformers, cls)()
        for key, value in FAMILIES[family][1].items():
            if key == "rope_local_base_freq":
                got = theirs.rope_parameters["sliding_attention"]["rope_theta"]
            elif key == "rope_theta":
                got = theirs.rope_parameters["full_attention"]["rope_theta"]
            elif key == "_sliding_window_pattern":
                got = theirs._sliding_window_pattern
            elif key == "sliding_window" and family in ("qwen2", "qwen3"):
                got = type(theirs).__dataclass_fields__["sliding_window"].default   # kept only with use_sliding_window
            else:
                got = getattr(theirs, key)
            assert got == value, f"{family}.{key}: ours {value!r}, transformers {got!r}"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_transformers_config_reads_as_the_same_features(family, family_dir):
    """transformers' own config object for the family, saved and read back by us, gives the
    config make_checkpoint wrote (its to_dict spells the fields its own way)."""
    transformers = pytest.importorskip("transformers")
    ours = LlamaConfig.from_file(family_dir(family))
    theirs = transformers.AutoConfig.from_pretrained(family_dir(family))
    assert LlamaConfig.from_dict(theirs.to_dict(), "transformers") == ours


def test_features_per_family():
    cfgs = {f: LlamaConfig.from_dict({**TINY, **TINY_FAMILIES[f]}) for f in FAMILY_NAMES}
    assert cfgs["qwen2"].attention_bias and not cfgs["qwen2"].o_bias
    assert cfgs["qwen2"].sliding_window == (None, 4)         # max_window_layers=1: from layer 1 on
    assert cfgs["qwen3"].qk_norm == "head" and cfgs["qwen3"].head_dim == 16
    assert cfgs["mistral"].sliding_window == (5, 5)
    g2 = cfgs["gemma2"]
    assert (g2.norms, g2.norm_offset, g2.activation, g2.embed_scale) == ("sandwich", 1.0, "gelu_tanh", True)
    assert g2.sliding_window == (4, None) and g2.attn_softcap == 1.5 and g2.final_softcap == 2.0
    assert g2.scale == 12 ** -0.5
    g3 = cfgs["gemma3_text"]
    assert g3.qk_norm == "head" and g3.attn_softcap is None and g3.local_rope.theta == 100.0
    assert g3.rope.type == "linear" and g3.rope_of(0) == g3.local_rope and g3.rope_of(1) == g3.rope
    o2 = cfgs["olmo2"]
    assert (o2.norms, o2.qk_norm, o2.norm_weight_in_norm_dtype) == ("post", "projection", True)
    assert LlamaConfig.from_dict(TINY).features() == {}
    steps = {f: c.layer_steps for f, c in cfgs.items()}
    assert steps["olmo2"] == ("q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope", "attn_ctx", "attn_out",
                              "post_attn_norm", "resid_mid", "gate", "up", "act", "mlp_out", "post_mlp_norm", "out")
    assert "post_attn_norm" in steps["gemma2"] and "q_norm" not in steps["gemma2"]
    assert tapnames.all_taps(cfgs["mistral"]) == tapnames.all_taps(2)


@pytest.mark.parametrize("config, match", [
    (dict(model_type="gemma3"), "gemma3_text"),
    (dict(model_type="phi3"), "not a model llama-parity implements"),
    (dict(model_type="qwen2", attention_bias=False), "attention_bias"),
    (dict(model_type="gemma2", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(model_type="gemma2", layer_types=["full_attention"]), "layer_types"),
    (dict(model_type="gemma2", hidden_activation="relu"), "hidden_activation 'relu'"),
    (dict(model_type="mistral", attn_logit_softcapping=30.0), "attn_logit_softcapping"),
    (dict(model_type="llama", sliding_window=4), "sliding_window"),
    (dict(model_type="qwen3", use_sliding_window=False, layer_types=["sliding_attention"] * 2), "layer_types"),
    (dict(model_type="olmo2", architectures=["LlamaForCausalLM"]), "Olmo2"),
    (dict(model_type="gemma3_text", rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0}}),
     "yarn"),
    (dict(model_type="mistral", some_new_field=1), "some_new_field"),
    (dict(model_type="gemma3_text", rope_local_base_freq=0.5), "rope_local_base_freq"),
    (dict(model_type="gemma2", attn_logit_softcapping=1e-300), "attn_logit_softcapping"),
    (dict(model_type="gemma2", query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    (dict(model_type="mistral", sliding_window=0), "sliding_window"),
])
def test_family_configs_that_change_the_math_are_refused(config, match):
    with pytest.raises(ConfigError, match=match):
        LlamaConfig.from_dict({**TINY, **config})


# ----- exact first: fp64 against transformers' class ---------------------------------------------

@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fp64_matches_transformers_class(framework, family, family_dir, hf_family_logits):
    """Each family at fp64 agrees with transformers' own class run in float64 end to end
    (conftest's hf_family_logits): windows shorter than the prompt, soft-caps that bend, left
    padding (the last row)."""
    folder = family_dir(family)
    ids, mask = prompt()
    err = rel(logits_of(load(framework, folder, "fp64", backend="reference"), ids, mask),
              hf_family_logits(folder, ids, mask), mask)
    assert err <= 1e-12, f"{framework}/{family}: rel L2 {err:.2e} vs transformers' class in float64"


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2", "gemma3_text"])
def test_window_longer_than_the_prompt_is_global_attention(family, family_dir):
    """A sliding window at least as long as the prompt changes nothing; one shorter does (so the
    window is engaged in the agreement above)."""
    torchref = pytest.importorskip("torchref")
    ids, mask = prompt()
    short = logits_of(torchref.from_pretrained(family_dir(family), "fp64", backend="reference"), ids, mask)
    cfg = LlamaConfig.from_file(family_dir(family))
    long_w = dataclasses.replace(cfg, sliding_window=tuple(None if w is None else 10 for w in cfg.sliding_window))
    # the same layers sliding (Gemma 3's local RoPE stays theirs), with a window no prompt reaches
    none = dataclasses.replace(cfg, sliding_window=tuple(None if w is None else 10 ** 6 for w in cfg.sliding_window))
    weights = torchref.from_pretrained(family_dir(family), "fp64", backend="reference").weights()
    at = {name: logits_of(torchref.from_weights(c, weights, "fp64", backend="reference"), ids, mask)
          for name, c in (("long", long_w), ("none", none))}
    assert np.array_equal(at["long"], at["none"])
    assert rel(short, at["none"], mask) > 1e-6


@pytest.mark.parametrize("change", ["attn_softcap", "final_softcap", "embed_scale", "norm_offset", "activation",
                                    "query_scale"])
def test_each_gemma_feature_is_engaged(change, family_dir):
    """Turning one Gemma 2 feature off changes the fp64 logits well above rounding: the agreement
    with transformers covers each of them."""
    torchref = pytest.importorskip("torchref")
    folder = family_dir("gemma2")
    m = torchref.from_pretrained(folder, "fp64", backend="reference")
    off = {"attn_softcap": None, "final_softcap": None, "embed_scale": False, "norm_offset": 0.0,
           "activation": "silu", "query_scale": None}[change]
    other = torchref.from_weights(dataclasses.replace(m.cfg, **{change: off}), m.weights(), "fp64",
                                  backend="reference")
    ids, mask = prompt()
    assert rel(logits_of(other, ids, mask), logits_of(m, ids, mask), mask) > 1e-6


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_tokens_match_transformers_at_fp32(framework, family, family_dir):
    """Greedy generation with the KV cache (windows and caps included) at fp32: the same tokens
    as transformers' class at fp32 with its own cache."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = family_dir(family)
    ids, mask = prompt(B=2, T=6, pad=2, seed=3)
    hf = getattr(transformers, HF[family] + "ForCausalLM").from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=8,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs = out[:, ids.shape[1]:].numpy()
    ours = load(framework, folder, "fp32").generate(ids, mask, max_new_tokens=8, eos_token_ids=[])
    assert np.asarray(ours).tolist() == theirs.tolist()


# ----- taps and backends -------------------------------------------------------------------------

@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_capture_has_the_family_steps(framework, family, family_dir):
    m = load(framework, family_dir(family), "fp32")
    ids, mask = prompt()
    logits, acts = m.capture(ids, mask, taps="*")
    assert list(acts) == tapnames.all_taps(m.cfg)
    cfg = m.cfg
    for name, x in acts.items():
        kind = tapnames.parse(name)[1]
        if kind in ("q_norm", "k_norm"):
            heads = cfg.num_attention_heads if kind == "q_norm" else cfg.num_key_value_heads
            assert x.shape == (2, 10, heads, cfg.head_dim), name
    assert np.array_equal(acts["logits"], np.asarray(logits))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fast_backend_is_the_reference_or_declines_by_name(framework, family, family_dir):
    """The fast backend on each family at fp32: every tap within f32 rounding of the reference's
    (exact where it runs the reference), and its plan names the ops it leaves to the reference."""
    folder = family_dir(family)
    ref, fast = (load(framework, folder, "fp32", backend=b) for b in ("reference", "fast"))
    ids, mask = prompt()
    (_, a), (_, b) = (m.capture(ids, mask, taps="*") for m in (ref, fast))
    real = mask.astype(bool)
    for name in a:
        x, y = np.asarray(a[name], np.float64)[real], np.asarray(b[name], np.float64)[real]
        assert np.abs(x - y).max() <= 1e-4 * max(1.0, np.abs(x).max()), name
    cfg = fast.cfg
    if cfg.attn_softcap is not None or cfg.query_scale is not None:
        assert fast.plan.op("attention").startswith("reference (the fast backend declines")
    if cfg.norm_offset or cfg.qk_norm:
        assert "declines" in fast.plan.op("norm")
    if cfg.final_softcap is not None:
        assert "soft-capping" in fast.plan.op("logits")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_invariant_backend_refuses_features_it_does_not_take(framework, family_dir):
    with pytest.raises(PolicyError, match="invariant backend does not take .*attn_softcap"):
        load(framework, family_dir("gemma2"), "fp32", backend="invariant")


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_invariant_backend_on_sliding_windows_and_biases(framework, family, family_dir):
    """Mistral's windows and Qwen2's biases are in the invariant backend's reach: a row alone and
    in a padded batch give the same bits, greedy tokens included."""
    m = load(framework, family_dir(family), "bf16", backend="invariant")
    ids, mask = prompt(B=3, T=9, pad=4, seed=5)
    alone = np.asarray(logits_of(m, ids[:1], mask[:1]))
    batched = np.asarray(logits_of(m, ids, mask))
    assert np.array_equal(alone[0], batched[0])
    g_alone = np.asarray(m.generate(ids[:1], mask[:1], max_new_tokens=4, eos_token_ids=[]))
    g_batch = np.asarray(m.generate(ids, mask, max_new_tokens=4, eos_token_ids=[]))
    assert g_alone[0].tolist() == g_batch[0].tolist()


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_decode_with_cache_equals_full_recompute(framework, family, family_dir):
    """A decode step's logits equal a full recompute of the longer prompt at fp64 (the window
    measured on cache slots as on positions)."""
    m = load(framework, family_dir(family), "fp64", backend="reference")
    ids, mask = prompt(B=2, T=7, pad=2, seed=9)
    logits, cache = m.prefill(ids, mask, total_len=12)
    nxt = np.argmax(np.asarray(logits), -1)
    for _ in range(4):
        step, cache = m.decode(cache, nxt)
        ids, mask = np.concatenate([ids, nxt[:, None]], 1), np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
        full = np.asarray(logits_of(m, ids, mask))[:, -1]
        np.testing.assert_allclose(np.asarray(step), full, rtol=1e-12, atol=1e-12)
        nxt = np.argmax(np.asarray(step), -1)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_counts_tokens_not_pad_slots(framework, family, family_dir):
    """Pad slots inside a row (interior padding) do not count toward the window: the window is
    measured in the row's tokens, so a row's logits at its tokens are those without the pads
    (transformers measures it in slots, the same wherever a row's tokens are contiguous)."""
    m = load(framework, family_dir(family), "fp64", backend="reference")
    ids, _ = prompt(B=1, T=10, pad=0, seed=4)
    plain = logits_of(m, ids, np.ones_like(ids))
    gap = 3     # pad slots after the 6th token
    padded = np.concatenate([ids[:, :6], np.zeros((1, gap), ids.dtype), ids[:, 6:]], 1)
    mask = np.ones_like(padded)
    mask[:, 6:6 + gap] = 0
    out = logits_of(m, padded, mask)
    keep = mask[0].astype(bool)
    np.testing.assert_allclose(out[0, keep], plain[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_policy_the_fast_backend_declines_keeps_its_reason_on_a_family(framework, family_dir):
    """Where the whole model runs on the reference for the policy's sake (a KV-cache knob), the plan
    says that, not the family's reasons; the final soft-cap is named either way."""
    plan = load(framework, family_dir("gemma2"), "bf16+kv_cache=e4m3:channel").plan
    assert plan.op("attention") == "reference (the fast backend declines kv_cache)"
    assert plan.op("logits").endswith("final logit soft-capping (2) by the reference")
