"""jaxmodel against transformers, and its own invariants (KV cache, padding, presets, taps,
generation), on tiny random checkpoints written to a temp folder."""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

import jaxmodel
from llamaspec import PRESETS, InputError, Policy, taps as tapnames
from llamaspec.testing import make_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import modeling_rope_utils  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def tokens(B, T, seed=0, vocab=96):
    return np.random.default_rng(seed).integers(3, vocab, (B, T))


# ---- transformers as the independent implementation ----

class _TorchAllF64(types.ModuleType):
    """Stands in for `torch` inside transformers' Llama and RoPE modules so that their
    float32 islands (RMSNorm, RoPE tables, softmax) run in float64: torch.float and
    torch.float32 name float64 there, everything else is the real torch. This gives a
    transformers Llama that is float64 end to end, with its own formulas untouched."""

    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def hf_logits(path, ids, mask=None, true_f64=True):
    """transformers LlamaForCausalLM (eager, float64) logits, loaded from `path`."""
    saved = modeling_llama.torch, modeling_rope_utils.torch, torch.get_default_dtype()
    if true_f64:
        modeling_llama.torch = modeling_rope_utils.torch = _TorchAllF64("torch")
        torch.set_default_dtype(torch.float64)
    try:
        hf = transformers.LlamaForCausalLM.from_pretrained(
            path, dtype=torch.float64, attn_implementation="eager")
        with torch.no_grad():
            m = None if mask is None else torch.tensor(mask)
            return hf(torch.tensor(ids), attention_mask=m).logits.numpy()
    finally:
        modeling_llama.torch, modeling_rope_utils.torch = saved[:2]
        torch.set_default_dtype(saved[2])


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CONFIGS = {  # features are combined where they cannot mask each other, to keep compiles few
    "gqa": {},
    "mha": dict(num_key_value_heads=4),
    "mqa-tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    # head_dim 16 != hidden 32 / 4 heads; 16 also puts one llama3 frequency in the smoothed band
    "head_dim-bias": dict(head_dim=16, attention_bias=True, mlp_bias=True),
    "llama3-rope_scaling": dict(head_dim=16, rope_scaling=LLAMA3),
    "llama3-rope_parameters": dict(head_dim=16, rope_theta=None,
                                   rope_parameters={**LLAMA3, "rope_theta": 10000.0}),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "dynamic": dict(rope_theta=None, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                      "rope_theta": 10000.0}),
    "bf16-storage": dict(dtype="bfloat16"),
    "fp16-storage-sharded": dict(dtype="float16", shards=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp64_matches_transformers_in_float64(name, tmp_path):
    """The semantic check: same math as transformers, to float64 rounding."""
    path = make_checkpoint(tmp_path, seed=len(name), **CONFIGS[name])
    # dynamic NTK only changes anything past max_position_embeddings (128)
    ids = tokens(2, 150 if name == "dynamic" else 24, seed=1)
    got = np.asarray(jaxmodel.from_pretrained(path, policy="fp64")(ids))
    assert got.dtype == np.float64
    err = rel_l2(got, hf_logits(path, ids))
    assert err < 1e-12, f"{name}: rel L2 {err:.3g} vs transformers in float64"


@pytest.fixture(scope="module")
def gqa_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gqa"), attention_bias=True)


@pytest.fixture(scope="module")
def load(gqa_path):
    """One model per policy for the whole module (each costs an XLA compile per shape)."""
    models = {}

    def get(policy):
        key = policy if isinstance(policy, str) else policy.name
        if key not in models:
            models[key] = jaxmodel.from_pretrained(gqa_path, policy=policy)
        return models[key]
    return get


# Shared input shapes, so tests reuse each other's compiled programs.
IDS = tokens(2, 16, seed=5)


def test_against_stock_transformers_fp64(gqa_path, load):
    """Stock transformers keeps RMSNorm, RoPE tables and softmax in f32 inside a float64
    model. fp64-hf reproduces that structure, but XLA's and ATen's f32 rsqrt, mean, exp
    and cos differ by an ulp here and there, so neither rung matches it beyond f32 noise."""
    ref = hf_logits(gqa_path, IDS, true_f64=False)
    for policy in ("fp64-hf", "fp64"):
        err = rel_l2(load(policy)(IDS), ref)
        print(f"\n{policy} vs stock transformers float64: rel L2 {err:.3g}")
        assert err < 1e-6


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, LLAMA3,
                                  {"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "dynamic", "factor": 2.0}])
def test_rope_inv_freq_f32_matches_transformers(rope):
    """Component check in float32, where transformers computes its tables."""
    from llamaspec import LlamaConfig

    d = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6,
             max_position_embeddings=128, rope_parameters={**rope, "rope_theta": 10000.0})
    hf_cfg = transformers.LlamaConfig(**d)
    init = modeling_rope_utils.ROPE_INIT_FUNCTIONS.get(
        rope["rope_type"], modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters)
    cfg = LlamaConfig.from_dict(d)
    for seq_len in (None, 200):
        if seq_len is not None and rope["rope_type"] != "dynamic":
            continue
        kw = {} if seq_len is None else {"seq_len": torch.tensor(seq_len)}
        want = init(hf_cfg, device=None, **kw)[0].numpy()
        got = np.asarray(jaxmodel.ops.rope_inv_freq(cfg.rope, cfg.head_dim, 128, seq_len or 1,
                                                     np.float32))
        np.testing.assert_allclose(got, want, rtol=2.4e-7, atol=0)


# ---- invariants of jaxmodel itself (fp64: anything above rounding is a bug) ----

def _left_padded_batch():
    """Two prompts of 6 and 3 tokens, left-padded to 6 (the layout generation uses)."""
    ids = tokens(2, 6, seed=3)
    mask = np.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def test_kv_cache_matches_full_recompute(load):
    m = load("fp64")
    ids, mask = _left_padded_batch()
    logits, cache = m.prefill(ids, mask, total_len=6 + 6)
    steps, seq, seq_mask = [logits], ids, mask
    for _ in range(5):
        nxt = logits.argmax(-1)
        seq = np.concatenate([seq, nxt[:, None]], 1)
        seq_mask = np.concatenate([seq_mask, np.ones((2, 1), mask.dtype)], 1)
        logits, cache = m.decode(cache, nxt)
        steps.append(logits)
    full = np.asarray(m(seq, seq_mask))
    for j, step in enumerate(steps):
        err = rel_l2(step, full[:, 5 + j])
        assert err <= 1e-12, f"step {j}: cached vs recomputed rel L2 {err:.3g}"
    assert cache["k"].shape[2] == 64  # 12 slots rounded up to the 64-slot block


def test_padding_left_right_interior_and_empty_rows(load):
    m = load("fp64")
    row = tokens(1, 9, seed=4)[0]
    alone = np.asarray(m(row[None]))[0]
    T = 13
    ids = np.zeros((4, T), np.int64)
    mask = np.zeros((4, T), np.int64)
    where = [np.arange(4, 13), np.arange(0, 9), np.array([0, 1, 3, 4, 5, 8, 9, 10, 12])]
    for b, slots in enumerate(where):
        ids[b, slots], mask[b, slots] = row, 1
    ids[3] = 5  # row 3: nothing real at all
    out = np.asarray(m(ids, mask))
    assert np.isfinite(out).all()
    for b, slots in enumerate(where):
        err = rel_l2(out[b, slots], alone)
        assert err <= 1e-12, f"padding layout {b}: rel L2 {err:.3g} vs the row alone"


def test_every_preset_runs_and_one_knob_matters(load):
    oracle = np.asarray(load("fp64")(IDS))
    bound = {"fp64": 0, "fp64-hf": 1e-6, "fp32": 1e-5, "tf32": 1e-2, "bf16w-f32": 5e-2,
             "fp16": 2e-2, "bf16": 1e-1}
    for name in PRESETS:
        out = load(name)(IDS)
        assert out.dtype == np.dtype(PRESETS[name].logits_dtype), name
        assert np.isfinite(np.asarray(out, np.float64)).all(), name
        assert rel_l2(out, oracle) <= bound[name], name
    m = load(Policy.get("fp32", softmax_dtype="bfloat16"))
    assert m.policy.softmax_dtype == "bfloat16"
    assert not np.array_equal(np.asarray(m(IDS)), np.asarray(load("fp32")(IDS)))


def test_capture_names_shapes_dtypes(load):
    m = load("bf16")
    cfg = m.cfg
    (B, T), D, hd = IDS.shape, cfg.hidden_size, cfg.head_dim
    Hq, Hkv, F = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    logits, acts = m.capture(IDS, taps="*")
    assert list(acts) == tapnames.all_taps(cfg.num_hidden_layers)
    shapes = {"q": (B, T, Hq, hd), "q_rope": (B, T, Hq, hd), "k": (B, T, Hkv, hd),
              "k_rope": (B, T, Hkv, hd), "v": (B, T, Hkv, hd), "attn_ctx": (B, T, Hq * hd),
              "gate": (B, T, F), "up": (B, T, F), "act": (B, T, F),
              "logits": (B, T, cfg.vocab_size)}
    for name, x in acts.items():
        assert x.shape == shapes.get(tapnames.parse(name)[1], (B, T, D)), name
        # bf16 preset: activations stay bf16, logits are f32
        assert x.dtype == (np.float32 if name == "logits" else ml_dtypes.bfloat16), name
    assert np.array_equal(acts["logits"], logits)
    assert np.array_equal(logits, np.asarray(m(IDS)))
    _, some = m.capture(IDS, taps=("layers.1.q", "final_norm"))
    assert set(some) == {"layers.1.q", "final_norm"}
    with pytest.raises(KeyError):
        m.capture(IDS, taps=("layers.9.q",))


def test_observing_activations_does_not_change_them(load):
    """At f32 XLA:CPU's FMA contraction could depend on which activations a program
    returns (jaxmodel.dtypes explains the option that stops it): logits and taps must be
    bitwise the same whatever else is captured."""
    m = load("fp32")
    plain = np.asarray(m(IDS))
    few_logits, few = m.capture(IDS, taps=("layers.0.q_rope", "layers.1.k_rope"))
    all_logits, everything = m.capture(IDS, taps="*")
    assert np.array_equal(few_logits, plain) and np.array_equal(all_logits, plain)
    for name, x in few.items():
        assert np.array_equal(x, everything[name]), name


def test_greedy_generate_batch_equals_rows_and_sampling_is_seeded(load):
    m = load("fp64")
    ids, mask = _left_padded_batch()
    kw = dict(max_new_tokens=6, eos_token_ids=[])
    batch = m.generate(ids, attention_mask=mask, **kw)
    assert batch.shape == (2, 6) and batch.dtype == np.int64
    for b in range(2):
        row = m.generate(ids[b:b + 1], attention_mask=mask[b:b + 1], **kw)
        np.testing.assert_array_equal(batch[b], row[0])
    sample = dict(kw, do_sample=True, temperature=1.5, top_k=20, top_p=0.9)
    s1 = m.generate(ids, attention_mask=mask, seed=11, **sample)
    s2 = m.generate(ids, attention_mask=mask, seed=11, **sample)
    s3 = m.generate(ids, attention_mask=mask, seed=12, **sample)
    np.testing.assert_array_equal(s1, s2)
    assert not np.array_equal(s1, s3)


def test_errors(gqa_path, load):
    m = load("fp64")
    with pytest.raises(NotImplementedError, match="batch-invariance"):
        jaxmodel.from_pretrained(gqa_path, batch_invariant=True)
    with pytest.raises(InputError, match="outside the vocabulary"):
        m(np.array([[1, 96]]))
    with pytest.raises(InputError):
        m(np.array([1, 2, 3]))
    ids, mask = _left_padded_batch()
    _, cache = m.prefill(ids[:1], mask[:1], total_len=7)
    with pytest.raises(InputError, match="outside the vocabulary"):
        m.decode(cache, np.array([-1]))


def test_params_keep_checkpoint_names_and_shapes(load):
    from flax import nnx
    from llamaspec import expected_shapes

    m = load("bf16")
    got = {"model." * (path[0] != "lm_head") + ".".join(map(str, path)): (v.shape, v.dtype)
           for path, v in nnx.to_flat_state(m.state)}
    want = {k: (shape, np.dtype(ml_dtypes.bfloat16))
            for k, shape in expected_shapes(m.cfg).items()}
    assert got == want


# ---- the real model (opt-in: `pytest -m slow`; needs `llama-parity fetch-smollm2`) ----

@pytest.fixture(scope="module")
def smollm2():
    fetch = pytest.importorskip("llama_parity.fetch")
    folder = fetch.default_model_dir()
    if not fetch.is_complete(folder):
        pytest.skip(f"SmolLM2-135M weights are not in {folder}; run `llama-parity fetch-smollm2`")
    return folder


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_matches_transformers_and_answers(smollm2):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    text = ("Floating point is not real arithmetic: addition is not associative, rounding "
            "happens after every operation, and two programs that compute the same formula "
            "in a different order can disagree in the last bits. ") * 8
    ids = np.array([tok.encode(text).ids[:256]])
    hf32 = transformers.LlamaForCausalLM.from_pretrained(
        smollm2, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref32 = hf32(torch.tensor(ids)).logits.numpy()
    m = jaxmodel.from_pretrained(smollm2, policy="fp32")
    got = np.asarray(m(ids))
    print(f"\nSmolLM2 fp32 vs transformers fp32: max abs {np.abs(got - ref32).max():.3g}, "
          f"rel L2 {rel_l2(got, ref32):.3g}")
    assert np.abs(got - ref32).max() < 1e-3 and rel_l2(got, ref32) < 1e-5
    err = rel_l2(jaxmodel.from_pretrained(smollm2, policy="fp64")(ids), hf_logits(smollm2, ids))
    print(f"SmolLM2 fp64 vs transformers in float64: rel L2 {err:.3g}")
    assert err < 1e-12
    chat = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                      "<|im_start|>assistant\n").ids
    answer = tok.decode(m.generate(np.array([chat]), max_new_tokens=12)[0].tolist())
    assert "Paris" in answer, answer
