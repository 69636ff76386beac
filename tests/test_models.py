"""Behaviour both models must share, each test run for torchref and for jaxmodel:
agreement with transformers, KV cache, padding, generation, taps, presets, errors."""

import importlib
import platform
import shutil

import ml_dtypes
import numpy as np
import pytest

from compare.metrics import rel_l2
from llamaspec import PRESETS, InputError, LlamaConfig, Policy, expected_shapes, taps
from llamaspec.testing import TINY_CONFIGS as CONFIGS

FRAMEWORKS = ["torchref", "jaxmodel"]


def load(framework, folder, policy="fp64", **kw):
    return importlib.import_module(framework).from_pretrained(folder, policy=policy, **kw)


def tokens(B=2, T=24, vocab=96, seed=0):
    return np.random.default_rng(seed).integers(3, vocab, (B, T))


def seq_len(config):
    # dynamic NTK only changes anything past max_position_embeddings (128)
    return 150 if config == "dynamic" else 40


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp64_matches_transformers_in_true_float64(framework, config, tiny_dir, hf_logits):
    """The semantic check: the same math as transformers, to float64 rounding."""
    folder = tiny_dir(config)
    ids = tokens(T=seq_len(config))
    err = rel_l2(np.asarray(load(framework, folder, "fp64")(ids)), hf_logits(folder, ids, true_f64=True))
    assert err <= 1e-12, f"{framework}/{config}: rel L2 {err:.2e} vs transformers in true float64"


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp64_hf_policy_matches_stock_transformers(framework, config, tiny_dir, hf_logits):
    """fp64-hf keeps transformers' f32 norm/RoPE/softmax inside an f64 run.

    torchref runs those f32 steps with torch's own kernels, so it must match to 1e-10
    (it is bitwise equal today). jaxmodel runs them with XLA's f32 rsqrt/exp/cos, which
    differ from torch's by an ulp here and there: ~1e-7, f32 roundoff, the figure to
    expect for a cross-framework run that keeps f32 steps.
    """
    folder = tiny_dir(config)
    ids = tokens(T=seq_len(config))
    err = rel_l2(np.asarray(load(framework, folder, "fp64-hf")(ids)), hf_logits(folder, ids))
    bound = 1e-10 if framework == "torchref" else 1e-6
    assert err <= bound, f"{framework}/{config}: rel L2 {err:.2e} vs transformers (fp64-hf)"


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("rope", ["default", "llama3", "linear", "dynamic"])
def test_rope_inv_freq_f32_matches_transformers(framework, rope, tiny_dir):
    """Component check in float32, where transformers computes its RoPE tables."""
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers import modeling_rope_utils
    from transformers.models.llama import modeling_llama
    params = {"default": {"rope_type": "default"},
              "llama3": CONFIGS["llama3"]["rope_scaling"],
              "linear": {"rope_type": "linear", "factor": 2.0},
              "dynamic": {"rope_type": "dynamic", "factor": 2.0}}[rope]
    d = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6,
             max_position_embeddings=128, rope_parameters={**params, "rope_theta": 10000.0})
    init = modeling_rope_utils.ROPE_INIT_FUNCTIONS.get(
        rope, modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters)
    cfg = LlamaConfig.from_dict(d)
    ops = importlib.import_module(framework).ops
    f32 = torch.float32 if framework == "torchref" else np.float32
    for n in ((None, 200) if rope == "dynamic" else (None,)):
        kw = {} if n is None else {"seq_len": torch.tensor(n)}
        want = init(transformers.LlamaConfig(**d), device=None, **kw)[0].numpy()
        got = np.asarray(ops.rope_inv_freq(cfg.rope, cfg.head_dim, 128, n or 1, f32))
        np.testing.assert_allclose(got, want, rtol=2.4e-7, atol=0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_kv_cache_matches_full_recompute(framework, tiny_dir):
    m = load(framework, tiny_dir("gqa"))
    ids = tokens(B=2, T=7)
    mask = np.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0           # a left-padded row
    logits, cache = m.prefill(ids, mask, 16)
    steps, seq, seq_mask = [logits], ids, mask
    for _ in range(6):
        nxt = np.asarray(logits).argmax(-1)
        seq = np.concatenate([seq, nxt[:, None]], 1)
        seq_mask = np.concatenate([seq_mask, np.ones((2, 1), mask.dtype)], 1)
        logits, cache = m.decode(cache, nxt)
        steps.append(logits)
    full = np.asarray(m(seq, attention_mask=seq_mask))
    for j, step in enumerate(steps):
        err = rel_l2(step, full[:, 6 + j])
        assert err <= 1e-12, f"step {j}: cached vs recomputed rel L2 {err:.2e}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_padding_left_right_interior_match_unpadded(framework, tiny_dir):
    m = load(framework, tiny_dir("gqa"))
    row = tokens(B=1, T=9, seed=3)[0]
    alone = np.asarray(m(row[None]))[0]
    ids = np.zeros((4, 13), np.int64)
    mask = np.zeros((4, 13), np.int64)
    where = [np.arange(4, 13), np.arange(0, 9), np.array([0, 1, 3, 4, 5, 8, 9, 10, 12])]
    for b, slots in enumerate(where):                # left, right, interior padding
        ids[b, slots], mask[b, slots] = row, 1
    ids[3] = 5                                       # row 3: fully padded
    out = np.asarray(m(ids, attention_mask=mask))
    assert np.isfinite(out).all(), "NaN/Inf on a padded row"
    for b, slots in enumerate(where):
        err = rel_l2(out[b, slots], alone)
        assert err <= 1e-12, f"padding layout {b}: rel L2 {err:.2e} vs the row alone"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_batched_generation_matches_single_rows_and_sampling_is_seeded(framework, tiny_dir):
    m = load(framework, tiny_dir("gqa"), "fp64")
    rows = [tokens(B=1, T=n, seed=n)[0] for n in (5, 9)]
    ids = np.zeros((2, 9), np.int64)
    mask = np.zeros((2, 9), np.int64)
    ids[0, :5], mask[0, :5] = rows[0], 1             # right padded: generate re-aligns it
    ids[1], mask[1] = rows[1], 1
    kw = dict(max_new_tokens=8, eos_token_ids=[])
    batched = m.generate(ids, attention_mask=mask, **kw)
    assert batched.shape == (2, 8) and batched.dtype == np.int64
    for b, r in enumerate(rows):
        assert batched[b].tolist() == m.generate(r[None], **kw)[0].tolist()
    sample = dict(kw, do_sample=True, temperature=1.5, top_k=20, top_p=0.9)
    s1 = m.generate(ids, attention_mask=mask, seed=11, **sample)
    s2 = m.generate(ids, attention_mask=mask, seed=11, **sample)
    s3 = m.generate(ids, attention_mask=mask, seed=12, **sample)
    assert s1.tolist() == s2.tolist() and s1.tolist() != s3.tolist()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_generation_stops_on_eos(framework, tiny_dir):
    m = load(framework, tiny_dir("gqa"), "fp32")
    ids = tokens(B=1, T=6)
    first = int(m.generate(ids, max_new_tokens=1, eos_token_ids=[])[0, 0])
    out = m.generate(ids, max_new_tokens=10, eos_token_ids=[first])
    assert out.shape == (1, 1) and out[0, 0] == first


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_capture_names_shapes_dtypes(framework, tiny_dir):
    m = load(framework, tiny_dir("head_dim"), "bf16")
    cfg = m.cfg
    ids = tokens(B=2, T=5)
    (B, T), D, hd = ids.shape, cfg.hidden_size, cfg.head_dim
    Hq, Hkv, F = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    logits, acts = m.capture(ids, taps="*")
    assert list(acts) == taps.all_taps(cfg.num_hidden_layers)
    shapes = {"q": (B, T, Hq, hd), "q_rope": (B, T, Hq, hd), "k": (B, T, Hkv, hd),
              "k_rope": (B, T, Hkv, hd), "v": (B, T, Hkv, hd), "attn_ctx": (B, T, Hq * hd),
              "gate": (B, T, F), "up": (B, T, F), "act": (B, T, F), "logits": (B, T, cfg.vocab_size)}
    for name, x in acts.items():
        assert x.shape == shapes.get(taps.parse(name)[1], (B, T, D)), name
        # bf16 preset: activations stay bf16 (no silent upcast), logits are f32
        assert x.dtype == (np.float32 if name == "logits" else ml_dtypes.bfloat16), name
    assert np.array_equal(acts["logits"], logits)
    _, some = m.capture(ids, taps=("layers.1.q", "final_norm"))
    assert list(some) == ["layers.1.q", "final_norm"]
    with pytest.raises(KeyError, match="unknown tap 'layers.9.q'"):
        m.capture(ids, taps=("layers.9.q",))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_observing_activations_does_not_change_them(framework, tiny_dir):
    """Logits and taps are bitwise the same whatever else is captured (XLA could fuse
    differently when a program returns more; jaxmodel.dtypes sets the option that stops it)."""
    m = load(framework, tiny_dir("gqa"), "fp32")
    ids = tokens(B=2, T=16, seed=5)
    plain = np.asarray(m(ids))
    few_logits, few = m.capture(ids, taps=("layers.0.q_rope", "layers.1.k_rope"))
    all_logits, everything = m.capture(ids, taps="*")
    assert np.array_equal(few_logits, plain) and np.array_equal(all_logits, plain)
    for name, x in few.items():
        assert np.array_equal(x, everything[name]), name


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_preset_runs_and_knobs_matter(framework, tiny_dir):
    folder = tiny_dir("gqa")
    ids = tokens(B=2, T=16)
    oracle = np.asarray(load(framework, folder, "fp64")(ids))
    bound = {"fp64": 0, "fp64-hf": 1e-6, "fp32": 1e-5, "tf32": 1e-5,  # CPU: tf32 is ieee
             "bf16w-f32": 5e-2, "fp16": 1e-2, "bf16": 5e-2}
    for name, policy in PRESETS.items():
        out = np.asarray(load(framework, folder, name)(ids))
        assert out.dtype == np.dtype(policy.logits_dtype), name
        err = rel_l2(out, oracle)
        assert np.isfinite(err) and err <= bound[name], f"{name}: {err:.2e}"
    fp32 = rel_l2(np.asarray(load(framework, folder, "fp32")(ids)), oracle)
    one_knob = rel_l2(np.asarray(load(framework, folder, Policy.get("fp32", softmax_dtype="bfloat16"))(ids)),
                      oracle)
    assert one_knob > 10 * fp32, f"softmax in bf16 should cost precision: {one_knob:.2e} vs {fp32:.2e}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_weights_keep_checkpoint_names_shapes_and_param_dtype(framework, tiny_dir):
    m = load(framework, tiny_dir("bias"), "bf16")
    want = {k: tuple(s) for k, s in expected_shapes(m.cfg).items()}
    key = importlib.import_module(f"{framework}.model").checkpoint_key
    if framework == "torchref":
        got = {key(k): tuple(v.shape) for k, v in m.model.state_dict().items()}
        assert all(str(v.dtype) == "torch.bfloat16" for v in m.model.state_dict().values())
        assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == got    # the loaded model: HF's keys
    else:
        from flax import nnx

        from jaxmodel import fast
        from llamaspec import fixed_order as fo
        flat = [(p, v.get_value()) for p, v in nnx.to_flat_state(nnx.filter_state(m.state, nnx.Param))]
        got = {key(".".join(map(str, p))): tuple(v.shape) for p, v in flat}
        assert len(flat) == len(nnx.to_flat_state(m.state))     # every variable a parameter
        # the fast backend keeps a bf16 model's matrices on the CPU as fast.Weight: bf16 values widened
        # to f32 (exact), with a native bf16 copy where the plan's native products are on and a copy
        # packed for the one-row kernel where its kernel_matvecs is
        ops, bf16 = m.model.ops, ml_dtypes.bfloat16
        kept = [w for _, w in flat if isinstance(w, fast.Weight)]
        for w in kept:
            data = np.asarray(w.data)
            assert data.dtype == ops.widened(m.policy) and np.array_equal(data.astype(bf16).astype(data.dtype), data)
            if w.native is not None:
                np.testing.assert_array_equal(np.asarray(w.native), data.astype(bf16))
            if w.matvec is not None:
                np.testing.assert_array_equal(np.asarray(w.matvec.data), fo.pack(data.astype(bf16)).reshape(-1))
        assert bool(kept) == (ops.widened(m.policy) is not None)
        assert any(w.native is not None for w in kept) == ops.native_products(m.policy)
        assert any(w.matvec is not None for w in kept) == ops.kernel_matvecs(m.policy)
        assert all(np.asarray(w).dtype == bf16 for _, w in flat if not isinstance(w, fast.Weight))
        assert all(w.dtype == ml_dtypes.bfloat16 for w in m.weights().values())
    assert got == want


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("config", ["gqa", "tied"])
def test_weights_round_trip_through_from_weights(framework, config, tiny_dir):
    """weights() -> from_weights rebuilds the same model: bitwise-equal logits, tied stays
    tied; the same weights at fp64 give a working fp64 model."""
    mod = importlib.import_module(framework)
    m = load(framework, tiny_dir(config), "bf16")
    w = m.weights()
    assert set(w) == set(expected_shapes(m.cfg))
    assert ("lm_head.weight" in w) == (config != "tied")
    assert all(a.dtype == ml_dtypes.bfloat16 for a in w.values())
    ids = tokens()
    again = mod.from_weights(m.cfg, w, "bf16")
    assert np.array_equal(np.asarray(again(ids)).view(np.uint32), np.asarray(m(ids)).view(np.uint32))
    assert set(again.weights()) == set(w)
    wide = mod.from_weights(m.cfg, w, "fp64")
    assert wide.policy.name == "fp64" and set(wide.weights()) == set(w)
    assert rel_l2(np.asarray(m(ids)), np.asarray(wide(ids))) < 0.05


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_inputs_are_clear_errors(framework, tiny_dir):
    folder = tiny_dir("gqa")
    m = load(framework, folder, "fp32")
    with pytest.raises(InputError, match="outside the vocabulary"):
        m(np.array([[1, 2, 96]]))
    with pytest.raises(InputError, match="longer than max_position_embeddings"):
        m(np.ones((1, 129), np.int64))
    with pytest.raises(InputError, match="empty"):
        m(np.zeros((1, 0), np.int64))
    with pytest.raises(InputError, match="1-D"):
        m(np.array([1, 2, 3]))
    with pytest.raises(InputError, match="empty prompt"):
        m.generate(np.array([[1, 2]]), attention_mask=np.array([[0, 0]]))
    with pytest.raises(InputError, match="including 100 new tokens"):
        m.generate(np.ones((1, 40), np.int64), max_new_tokens=100)
    _, cache = m.prefill(np.array([[4, 5, 6]]), np.ones((1, 3), np.int64), 4)
    with pytest.raises(InputError, match="outside the vocabulary"):
        m.decode(cache, np.array([-1]))
    with pytest.raises(Exception, match="unknown precision policy 'fp12'"):
        load(framework, folder, "fp12")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_teacher_forcing_replaces_layer_inputs(framework, tiny_dir):
    """inject {i: h}: layer i runs on h whatever came before; one call forces every layer."""
    folder = tiny_dir("gqa")
    m64 = load(framework, folder, "fp64")
    ids = tokens(B=2, T=10, seed=9)
    _, ref = m64.capture(ids, taps=["embed", "layers.*.out"])
    # Forcing each layer with its own fp64 input reproduces the normal run exactly.
    inject = {0: ref["embed"], 1: ref["layers.0.out"]}
    _, forced = m64.capture(ids, taps="layers.*.out", inject=inject)
    assert all(np.array_equal(forced[k], ref[k]) for k in forced)
    # A perturbed input to layer 1 leaves layer 0 untouched and changes layer 1.
    bumped = {1: ref["layers.0.out"] * 1.01}
    _, out = m64.capture(ids, taps="layers.*.out", inject=bumped)
    assert np.array_equal(out["layers.0.out"], ref["layers.0.out"])
    assert not np.allclose(out["layers.1.out"], ref["layers.1.out"])
    # Local error: fp32 fed the fp64 inputs differs from fp64 by rounding only.
    _, local = load(framework, folder, "fp32").capture(ids, taps="layers.*.out", inject=inject)
    assert rel_l2(local["layers.1.out"], ref["layers.1.out"]) < 1e-6
    with pytest.raises(InputError, match="inject: layer 7"):
        m64.capture(ids, inject={7: ref["embed"]})
    with pytest.raises(InputError, match=r"inject\[0\]: shape"):
        m64.capture(ids, inject={0: ref["embed"][:, :3]})


def _dtype_of(framework, name: str):
    """A policy's dtype name as the framework's dtype (its own dtypes module's lookup)."""
    dtypes = importlib.import_module(framework + ".dtypes")
    return dtypes.dt(name) if framework == "torchref" else dtypes.of(name)


def _as_framework(framework, dtype: str | None, *arrays):
    """numpy arrays as the framework's tensors in a policy dtype (rounded there: numpy has no
    bf16), or in their own dtype (None)."""
    if framework == "torchref":
        import torch
        out = [torch.from_numpy(a) for a in arrays]
        return out if dtype is None else [x.to(_dtype_of(framework, dtype)) for x in out]
    import jax.numpy as jnp
    out = [jnp.asarray(a) for a in arrays]
    return out if dtype is None else [x.astype(_dtype_of(framework, dtype)) for x in out]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_attention_scales_the_queries_first_only_where_no_bit_changes(framework, monkeypatch):
    """llamaspec.forward.scale_queries, as each model's ops module imports it: attention scales
    the queries before their product with the keys, not
    the scores after it (HF's order), when the scale is a power of two and compute_dtype has
    f32's exponent range. There the output is bitwise the late order's, for queries and keys
    spread over many binades (scores still of order 1, the softmax not saturated) and a padded
    row; at a head_dim whose scale is not a power of two the early order does change bits (so
    this comparison can see a difference), and f16 keeps the late order."""
    ops = importlib.import_module(framework + ".ops")
    rule = ops.scale_queries
    rng = np.random.default_rng(5)
    B, T, Hq, Hkv = 2, 19, 4, 2
    allowed = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    allowed[1, :, :4] = False                       # row 1 front-padded: 4 queries see nothing

    def both_orders(policy, D, early_rule):
        """attention's output in f64 with early_rule as scale_queries, and with the late order."""
        spread = [rng.standard_normal(s) * 2.0 ** rng.uniform(-8, 1, s) for s in ((B, T, Hq, D), (B, T, Hkv, D))]
        q, k, v = _as_framework(framework, Policy.get(policy).compute_dtype, *spread,
                                rng.standard_normal((B, T, Hkv, D)))
        mask, = _as_framework(framework, None, allowed)
        out = []
        for choice in (early_rule, lambda scale, dtype: False):
            monkeypatch.setattr(ops, "scale_queries", choice)
            y = ops.attention(q, k, v, mask, Policy.get(policy))
            out.append(y.double().numpy() if framework == "torchref" else np.asarray(y).astype(np.float64))
        return out

    for policy in ("fp32", "bf16", "fp64"):
        compute = Policy.get(policy).compute_dtype
        for D in (16, 64):
            assert rule(D ** -0.5, compute)
            early, late = both_orders(policy, D, rule)
            np.testing.assert_array_equal(early, late, err_msg=f"{policy}, head_dim {D}")
        assert not rule(32 ** -0.5, compute)
        early, late = both_orders(policy, 32, lambda scale, dtype: True)
        assert not np.array_equal(early, late), f"{policy}: a scale of 32^-0.5 applied early changed no bit"
    assert not rule(0.125, "float16")


MIRRORED_CLASSES = ("Linear", "Embedding", "RMSNorm", "Attention", "MLP", "Block", "Llama", "LlamaModel", "LayerRunner")
MIRRORED_FUNCTIONS = ("rope_tables", "head_logits", "causal_allowed", "checkpoint_key", "from_weights",
                      "from_pretrained")
CACHE_SEAMS = ("key_tables", "write_slots", "stored", "cache_allowed")


def test_torchref_attends_to_long_prompts_in_query_blocks(tiny_dir, monkeypatch):
    """torchref's fast attention computes QUERY_BLOCK queries at a time, each block over the keys
    up to the last one its mask allows (all of them when it holds a query that may see nothing;
    jaxmodel's blocks: the next test). With the block shrunk to 8 on a
    42-token batch (one row left-padded), at fp64: the blocked forward is the one-block forward
    to float64 rounding at every position, padding included, and prefill + decode (blocks over a
    longer cache) match it; a mask that lets each query see the next key (a planted leak) is
    honoured, not cut at the causal bound."""
    import torch

    from torchref import fast
    from torchref.plan import choices
    ids = tokens(B=2, T=42, seed=7)
    mask = np.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    runs = {}
    for block in (10 ** 6, 8):
        monkeypatch.setattr(fast, "QUERY_BLOCK", block)
        m = load("torchref", tiny_dir("gqa"), "fp64")
        runs[block] = np.asarray(m(ids, attention_mask=mask))
    one_block, blocked = runs[10 ** 6], runs[8]
    assert np.isfinite(blocked).all()
    real = mask.astype(bool)
    for rows in (real, ~real):
        err = rel_l2(blocked[rows], one_block[rows])
        assert err <= 1e-13, f"blocked vs one-block forward rel L2 {err:.2e}"
    logits, cache = m.prefill(ids[:, :37], mask[:, :37], 44)
    steps = [np.asarray(logits)]
    for t in range(37, 42):
        logits, cache = m.decode(cache, ids[:, t])
        steps.append(np.asarray(logits))
    err = rel_l2(np.stack(steps, 1), blocked[:, 36:42])
    assert err <= 1e-12, f"blocked prefill + decode vs forward rel L2 {err:.2e}"

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 42, h, 16)) for h in (4, 2, 2))
    causal = np.tril(np.ones((42, 42), bool))[None] & real[:, None, :]
    leak = causal.copy()
    leak[:, :, 1:] |= causal[:, :, :-1]      # each query also sees the next key
    q, k, v, causal, leak = (torch.from_numpy(x) for x in (q, k, v, causal, leak))
    policy = PRESETS["fp64"]
    c = choices(policy, torch.device("cpu"), {})
    every_key = np.asarray(fast.block_attention(c, q, k, v, leak, policy))[real]
    cut = np.asarray(fast.block_attention(c, q, k, v, causal, policy))[real]
    got = np.asarray(fast.attention(c, q, k, v, leak, policy))[real]
    assert rel_l2(got, every_key) <= 1e-14 and rel_l2(every_key, cut) > 1e-3


def test_torchref_query_blocks_read_the_keys_their_masks_allow(monkeypatch):
    """keys_read, the keys each query block of torchref's attention reads, against its definition
    block by block: one past the last key any query of the block (any row) may see, or every key
    when a query of the block may see none. Masks: causal, left-padded, a leak past the causal
    bound, a fully masked row, over a longer cache, T not a multiple of the block."""
    import torch

    from torchref import fast
    monkeypatch.setattr(fast, "QUERY_BLOCK", 8)

    def by_definition(allowed):
        T, S = allowed.shape[1:]
        out = []
        for a in range(0, T, 8):
            seen = allowed[:, a:a + 8]
            out.append(int(seen.any(0).any(0).nonzero().max()) + 1 if bool(seen.any(-1).all()) else S)
        return out

    rng = np.random.default_rng(3)
    for T, S in ((42, 42), (40, 40), (42, 60), (17, 17)):
        causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None].repeat(2, 1, 1)
        padded = causal.clone()
        padded[1, :, :5] = False                       # row 1 left-padded by 5: its first queries see nothing
        leak = causal | torch.ones(T, S, dtype=torch.bool).tril(S - T + 1)[None]
        dead = causal.clone()
        dead[0, T // 2] = False
        noise = torch.from_numpy(rng.random((2, T, S)) < 0.3)
        for allowed in (causal, padded, leak, dead, noise):
            assert fast.keys_read(allowed) == by_definition(allowed), (T, S)
    causal = torch.ones(42, 42, dtype=torch.bool).tril()[None]
    assert fast.keys_read(causal) == [8, 16, 24, 32, 40, 42]


def test_jaxmodel_attends_to_long_prompts_in_query_blocks(tiny_dir, monkeypatch, request):
    """The fast backend's XLA attention over a causal mask (checked in the program: no query sees
    a later slot; forward, capture, prefill, the streamed layers) takes QUERY_BLOCK queries at a
    time, each block over the keys up to its causal bound (fast.Fast._causal_blocks). With the
    block shrunk to 8 on a 42-token batch (one row left-padded: its first queries see no key), at
    fp64: forward, the streamed layers, prefill + decode and every layer's attention output are
    the one-block ones to float64 rounding, padding positions included; a mask changed through
    the cache_allowed seam (a planted leak: each query also sees the next key) runs as one block
    over every key, so the leak is honoured, not cut at the causal bound."""
    import jaxmodel
    import jaxmodel.model as jm
    from jaxmodel import fast
    from llamaspec import load_weights
    request.addfinalizer(jm.clear_programs)
    folder = tiny_dir("gqa")
    cfg, weights = load_weights(folder)
    ids = tokens(B=2, T=42, seed=7)
    mask = np.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    real = mask.astype(bool)

    def run(block):
        monkeypatch.setattr(fast, "QUERY_BLOCK", block)
        jm.clear_programs()
        m = jaxmodel.from_weights(cfg, weights, "fp64")
        logits, acts = m.capture(ids, mask, taps=["layers.*.attn_ctx", "layers.*.out"])
        runner = jm.LayerRunner(cfg, "fp64")
        runner.start(ids, mask)
        h, streamed = runner.embed(weights["model.embed_tokens.weight"][ids]), []
        for i in range(cfg.num_hidden_layers):
            layer = {k: v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")}
            h = runner.block(i, layer, h)[f"layers.{i}.out"]
            streamed.append(h)
        out, cache = m.prefill(ids[:, :37], mask[:, :37], 44)
        steps = [np.asarray(out)]
        for t in range(37, 42):
            out, cache = m.decode(cache, ids[:, t])
            steps.append(np.asarray(out))
        layers = {name: np.stack([acts[f"layers.{i}.{name}"] for i in range(cfg.num_hidden_layers)])
                  for name in ("attn_ctx", "out")}
        return m, np.asarray(logits), layers, np.stack(streamed), np.stack(steps, 1)

    _, one_block, acts1, _, steps1 = run(10 ** 6)
    _, blocked, acts8, streamed8, steps8 = run(8)
    assert np.isfinite(blocked).all()
    for rows in (real, ~real):
        assert rel_l2(blocked[rows], one_block[rows]) <= 1e-13
        for name in ("attn_ctx", "out"):
            assert rel_l2(acts8[name][:, rows], acts1[name][:, rows]) <= 1e-13, name
        assert rel_l2(streamed8[:, rows], acts8["out"][:, rows]) <= 1e-13
    assert rel_l2(steps8, steps1) <= 1e-13 and rel_l2(steps8, blocked[:, 36:42]) <= 1e-12

    def leak(self, allowed, index):
        return allowed.at[:, :, 1:].set(allowed[:, :, 1:] | allowed[:, :, :-1])
    monkeypatch.setattr(jm.Attention, "cache_allowed", leak)
    leaked = {}
    for block in (10 ** 6, 8):
        monkeypatch.setattr(fast, "QUERY_BLOCK", block)
        jm.clear_programs()
        out, _ = jaxmodel.from_weights(cfg, weights, "fp64").prefill(ids[:, :37], mask[:, :37], 44)
        leaked[block] = np.asarray(out)
    assert rel_l2(leaked[8], leaked[10 ** 6]) <= 1e-14 and rel_l2(leaked[8], steps1[:, 0]) > 1e-3


@pytest.mark.parametrize("reach", [1, 9])
def test_jaxmodel_query_blocks_honour_a_mask_that_breaks_the_causal_promise(tiny_dir, monkeypatch, request, reach):
    """A bug planted in jaxmodel's own causal_allowed (each query also sees the key `reach`
    slots after it) breaks the causality by which the fast backend's query blocks leave out
    later keys. The program checks the mask and runs such a call as one block over every key:
    with the blocks shrunk to 8 (42 tokens, fp64,
    XLA's attention), the forward's, the prefill's and the streamed layers' outputs are the
    one-block ones to rounding, the leak included (reach 9 crosses a block's bound, so the
    blocks alone would have cut it for every query), and far from the honest model's. (The
    prefill's leak also reaches its empty cache slots, so it is held to its own one-block run.)"""
    import jaxmodel
    import jaxmodel.model as jm
    from jaxmodel import fast, plan
    from llamaspec import load_weights
    request.addfinalizer(jm.clear_programs)
    monkeypatch.setenv(plan.ATTENTION_ENV, "reference")
    cfg, weights = load_weights(tiny_dir("gqa"))
    ids = tokens(B=2, T=42, seed=3)
    mask = np.ones_like(ids)

    def run(block):
        monkeypatch.setattr(fast, "QUERY_BLOCK", block)
        jm.clear_programs()
        m = jaxmodel.from_weights(cfg, weights, "fp64")
        return np.asarray(m(ids, mask)), np.asarray(m.prefill(ids, mask, 44)[0])

    def streamed(block):
        monkeypatch.setattr(fast, "QUERY_BLOCK", block)
        jm.clear_programs()
        runner = jm.LayerRunner(cfg, "fp64")
        runner.start(ids, mask)
        h = runner.embed(weights["model.embed_tokens.weight"][ids])
        for i in range(cfg.num_hidden_layers):
            h = runner.block(i, {k: v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")}, h)[
                f"layers.{i}.out"]
        return h

    honest, _ = run(8)
    honest_stream = streamed(8)
    honest_causal = jm.causal_allowed

    def leaky(slots, n_queries, first_query_slot=0):
        allowed = honest_causal(slots, n_queries, first_query_slot)
        return allowed.at[:, :, reach:].set(allowed[:, :, reach:] | allowed[:, :, :-reach])
    monkeypatch.setattr(jm, "causal_allowed", leaky)
    (fwd8, pre8), (fwd1, pre1) = run(8), run(10 ** 6)
    assert rel_l2(fwd8, fwd1) <= 1e-13 and rel_l2(pre8, pre1) <= 1e-13
    assert rel_l2(fwd8, honest) > 1e-3
    stream8 = streamed(8)
    assert rel_l2(stream8, streamed(10 ** 6)) <= 1e-13 and rel_l2(stream8, honest_stream) > 1e-3


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_jaxmodel_prefill_writes_the_prompt_to_its_cache_as_one_block(tiny_dir, monkeypatch, request, policy):
    """A prefill's keys and values go to the fresh cache one block per layer
    (lax.dynamic_update_slice; fast.write_cache: its slots are known while tracing), not through a
    scatter, which XLA:CPU runs as a loop over every token: the prefill program has no loop. The
    cache and the logits are bitwise the scatter's, which a prefill takes when write_slots,
    replaced on the class or on an instance, gives slots known only in the program (here wrappers
    returning the module's own slots as a jax array: the program then has its loops again). B=2
    with a left-padded row, fp32 and bf16 (a cache widened to f32 on the CPU)."""
    import jax.numpy as jnp

    import jaxmodel.model as jm
    request.addfinalizer(jm.clear_programs)
    ids = tokens(B=2, T=20, seed=3)
    mask = np.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0

    def prefill(m):
        text = m.prefill_program_text(ids, mask, 30)
        logits, cache = m.prefill(ids, mask, 30)
        return text.count(" while("), np.asarray(logits), {n: np.asarray(cache[n]) for n in ("k", "v")}

    loops, logits, cache = prefill(load("jaxmodel", tiny_dir("gqa"), policy))
    assert loops == 0
    own = jm.Attention.write_slots
    module = load("jaxmodel", tiny_dir("gqa"), policy).model
    attn = module.layers[1].self_attn
    attn.write_slots = lambda index, T, S: jnp.asarray(own(attn, index, T, S))
    on_instance = prefill(jm.LlamaModel(module))
    monkeypatch.setattr(jm.Attention, "write_slots", lambda self, index, T, S: jnp.asarray(own(self, index, T, S)))
    jm.clear_programs()       # programs are kept per structure, and the class is not part of it
    for scattered in (on_instance, prefill(load("jaxmodel", tiny_dir("gqa"), policy))):
        assert scattered[0] > 0
        assert np.array_equal(scattered[1], logits)
        for n in ("k", "v"):
            assert scattered[2][n].dtype == cache[n].dtype and np.array_equal(scattered[2][n], cache[n]), n


@pytest.mark.parametrize("policy,dots,attention", [("fp32", "auto", "auto"), ("bf16", "widened", "reference"),
                                                   ("fp16", "widened", "auto"), ("bf16", "native", "auto"),
                                                   ("bf16", "widened", "auto")])
def test_torchref_cache_widened_and_written_as_one_block(tiny_dir, monkeypatch, policy, dots, attention):
    """torchref's KV cache on the fast backend: kept in f32 where attention widens a 16-bit
    policy's products (cache_dtype: $LLAMA_PARITY_BF16_DOTS=widened here), else in compute_dtype,
    as it is where a bf16 policy's attention runs on the fixed-order kernels (auto on x86-64) or
    on the reference; a call whose rows all write from one slot (prefill, decode) writes a slice.
    The prefill, decode steps (B=2 with a left-padded row, and B=1) and the cache's values are
    bitwise those of a compute_dtype cache written by the reference's scatter (cache_dtype and
    write_cache replaced by the reference's), and the widened cache holds compute_dtype values."""
    import torch

    from compare.controls.prefill import Ops
    from torchref import fast, ops
    from torchref.dtypes import dt
    from torchref.plan import ATTENTION_ENV, choices
    monkeypatch.setenv("LLAMA_PARITY_BF16_DOTS", dots)
    monkeypatch.setenv(ATTENTION_ENV, attention)
    compute = dt(Policy.get(policy).compute_dtype)
    c = choices(Policy.get(policy), torch.device("cpu"), {"LLAMA_PARITY_BF16_DOTS": dots, ATTENTION_ENV: attention})
    kernel = fast.kernel_attention_applies(c, Policy.get(policy), torch.device("cpu"))
    if policy != "bf16" or attention == "reference":
        assert not kernel
    want = torch.float32 if dots == "widened" and not kernel and attention != "reference" else compute
    ns = fast.namespace(c)
    assert ns.cache_dtype(Policy.get(policy), torch.device("cpu")) == want
    assert ns.cache_dtype(Policy.get(policy), torch.device("cuda")) == compute   # only the device's type is read
    ids = tokens(B=2, T=20, seed=4)
    mask = np.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0

    def run(plain=False):
        m = load("torchref", tiny_dir("gqa"), policy)
        if plain:
            m.ops = Ops(m.ops, cache_dtype=ops.cache_dtype)
            for layer in m.model.layers:
                layer.self_attn.ops = Ops(layer.self_attn.ops, write_cache=ops.write_cache)
        out = []
        for rows in (slice(0, 2), slice(0, 1)):
            logits, cache = m.prefill(ids[rows], mask[rows], 24)
            out.append(np.asarray(logits, np.float32))
            for t in range(3):
                logits, cache = m.decode(cache, np.asarray(logits).argmax(-1))
                out.append(np.asarray(logits, np.float32))
        return out, cache

    blocks = []
    real_block = fast.one_block
    monkeypatch.setattr(fast, "one_block", lambda *a: blocks.append(real_block(*a)) or blocks[-1])
    got, cache = run()
    assert blocks and None not in blocks                     # every write of the default run is a slice
    assert {c.dtype for c in cache["k"] + cache["v"]} == {want}
    for t in cache["k"] + cache["v"]:
        assert torch.equal(t, t.to(compute).to(t.dtype))
    ref, ref_cache = run(plain=True)
    assert {t.dtype for t in ref_cache["k"]} == {compute}
    for a, b in zip(got, ref):
        assert np.array_equal(a, b)
    for a, b in zip(cache["k"] + cache["v"], ref_cache["k"] + ref_cache["v"]):
        assert torch.equal(a.to(compute), b)


def test_the_two_models_mirror_each_other(tiny_dir):
    """One name, one role in both files: the same classes, public functions and Attention
    seams, `model` the network (a Llama) with head_weight() a method, the same cache keys."""
    import jaxmodel.model as jm
    import torchref.model as tm
    for name in MIRRORED_CLASSES + MIRRORED_FUNCTIONS:
        assert hasattr(tm, name) and hasattr(jm, name), name
    for seam in CACHE_SEAMS:
        assert callable(getattr(tm.Attention, seam)) and callable(getattr(jm.Attention, seam)), seam
    ids, mask = tokens(2, 6), np.ones((2, 6), np.int64)
    keys = []
    for framework, mod in (("torchref", tm), ("jaxmodel", jm)):
        m = load(framework, tiny_dir(), "fp32")
        assert isinstance(m, mod.LlamaModel) and isinstance(m.model, mod.Llama) and callable(m.model.head_weight)
        _, cache = m.prefill(ids, mask, 8)
        _, cache = m.decode(cache, ids[:, 0])
        keys.append(sorted(cache))
    assert keys[0] == keys[1] == ["index", "k", "mask", "next_pos", "v"]


@pytest.mark.parametrize("policy,config", [("bf16", "gqa"), ("bf16", "tied"), ("fp16", "bias")])
def test_jaxmodel_widened_weights_change_no_bit(policy, config, tiny_dir, monkeypatch):
    """A 16-bit policy on the CPU keeps jaxmodel's matrices widened to f32 (their values rounded to
    the param dtype, held exactly), so no dot converts a whole weight per call: logits, every tap,
    the prefill, a decode step and the greedy tokens are bitwise those of the model that keeps them
    in the param dtype; weights() still gives the param dtype. (On the widened path: the native bf16
    dots of an AMX or AVX-512-BF16 CPU sum in another order, test_jaxmodel_native_bf16_dots_are_drift.)"""
    import jax

    import jaxmodel
    import jaxmodel.model as jm
    from jaxmodel import fast, ops
    from llamaspec import load_weights
    if jax.default_backend() != "cpu":
        pytest.skip("the widened storage is the CPU path")
    monkeypatch.setenv("LLAMA_PARITY_BF16_DOTS", "widened")
    cfg, w = load_weights(tiny_dir(config))
    ids, mask = np.random.default_rng(3).integers(3, 96, (3, 13)), np.ones((3, 13), np.int64)
    mask[2, :5] = 0

    def run(m):
        logits, acts = m.capture(ids, mask, taps=["*"])
        first, cache = m.prefill(ids, mask, 20)
        step, _ = m.decode(cache, first.argmax(-1))
        return {"logits": logits, **acts, "prefill": first, "decode": step,
                "greedy": m.generate(ids, mask, max_new_tokens=5)}

    wide = jaxmodel.from_weights(cfg, w, policy)
    assert wide.model.layers[0].mlp.up_proj.weight[...].dtype == np.float32
    assert wide.weights()["model.layers.0.mlp.up_proj.weight"].dtype == jm.numpy_dtype(Policy.get(policy).param_dtype)
    # the fast backend holding its matrices and cache in the param dtype (the reference's way)
    monkeypatch.setattr(fast.Fast, "prepare", lambda self, w, policy, layout=None, one_row=True: w)
    monkeypatch.setattr(fast.Fast, "kv_dtype", lambda self, policy: ops.kv_dtype(policy))
    narrow = jaxmodel.from_weights(cfg, w, policy)
    assert narrow.model.layers[0].mlp.up_proj.weight[...].dtype != np.float32
    a, b = run(wide), run(narrow)
    for key in b:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bf16_rope_rounds_each_op_once_to_bf16(framework):
    """apply_rope on bf16 queries is x * cos + rotate_half(x) * sin with cos, sin rounded to bf16
    and each product and the sum rounded to bf16 once, bit for bit, on every bf16 pattern (zeros,
    subnormals, infinities, NaN): jaxmodel computes it in f32 with rotate_half as a reversal and
    the sign on sin (fast._bf16_rope), torchref as written. The reference is numpy's: a product or
    sum of two bf16 values in f32 rounded to bf16 is the correctly rounded bf16 result (f32's 24
    bits >= 2 * 8 + 2), so it does not depend on the CPU; for jaxmodel with XLA:CPU's flushing
    (subnormal operands and results are zero, on every x86 CPU), and also against XLA's own bf16
    ops in apply_rope's written order (what jaxmodel computed before _bf16_rope)."""
    B, T, H, D = 2, 64, 3, 64
    rng = np.random.default_rng(7)
    x = rng.integers(0, 2 ** 16, (B, T, H, D), dtype=np.uint16).view(ml_dtypes.bfloat16)
    cos, sin = (np.concatenate([rng.standard_normal((B, T // 2, D)).astype(np.float32),   # ordinary tables
                                rng.integers(0, 2 ** 32, (B, T // 2, D), dtype=np.uint32).view(np.float32)],
                               axis=1) for _ in range(2))                                   # and any f32
    bf16, f32 = ml_dtypes.bfloat16, np.float32
    flush = framework == "jaxmodel"

    def ftz(y):
        return np.where(np.abs(y) < np.finfo(f32).tiny, np.copysign(f32(0), y), y) if flush else y

    def rnd(y):
        return y.astype(bf16).astype(f32)

    def op(f, a, b):            # one f32 op of two bf16 values, rounded to bf16
        return rnd(ftz(f(ftz(a), ftz(b))))

    with np.errstate(all="ignore"):
        xf, c, s = x.astype(f32), rnd(cos)[:, :, None], rnd(sin)[:, :, None]
        turned = np.concatenate([-xf[..., D // 2:], xf[..., :D // 2]], axis=-1)
        want = op(np.add, op(np.multiply, xf, c), op(np.multiply, turned, s)).astype(bf16)
    nan = np.isnan(want.astype(f32))
    assert nan.any() and np.isinf(want.astype(f32)).any()    # the patterns reach both
    if framework == "jaxmodel":
        import jax

        from jaxmodel import fast, ops
        from jaxmodel.dtypes import compiler_options
        if jax.default_backend() != "cpu":
            pytest.skip("the reference models XLA:CPU's flushing of subnormals")
        # the fast backend's bf16 RoPE (a reversal in f32, each op rounded) is the reference's, bit for bit
        got, before = (np.asarray(jax.jit(f, compiler_options=compiler_options())(x, cos, sin))
                       for f in (fast.Fast.apply_rope, ops.apply_rope))
        np.testing.assert_array_equal(got.view(np.uint16)[~nan], before.view(np.uint16)[~nan])
    else:
        import torch

        from torchref import ops
        as_torch = torch.from_numpy(x.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
        tables = torch.from_numpy(cos), torch.from_numpy(sin)
        out = ops.apply_rope(as_torch, *tables)
        got = out.view(torch.int16).numpy().view(np.uint16).view(bf16)
        # a bf16 prompt's rotation on the fast backend (fast.rope_kernel, every code path): the same
        # bits, for keys of other heads (a strided view) on tables of other strides
        if platform.machine().lower() in ("x86_64", "amd64") and shutil.which("g++"):
            from llamaspec import fixed_order as fo
            from torchref import fast
            lib = fast.fixed_order_kernels()
            spaced = tuple(torch.cat([t, t], dim=-1)[..., :D] for t in tables)   # rows 2 D apart
            for path in fo.code_paths(lib):
                with fo.code_path(lib, path):
                    q, k = fast.rope_kernel(as_torch, *tables), fast.rope_kernel(as_torch[:, :, 1:], *spaced)
                for y, ref, nans in ((q, want, nan), (k, want[:, :, 1:], nan[:, :, 1:])):
                    y = y.view(torch.int16).numpy().view(np.uint16).view(bf16)
                    np.testing.assert_array_equal(np.isnan(y.astype(f32)), nans, err_msg=path)
                    np.testing.assert_array_equal(y.view(np.uint16)[~nans], ref.view(np.uint16)[~nans],
                                                  err_msg=path)
    np.testing.assert_array_equal(np.isnan(got.astype(f32)), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def test_torchref_bf16_prompt_rope_on_the_kernel_keeps_every_bit(tiny_dir, monkeypatch):
    """A bf16 model on the fast backend (its prompts' RoPE on the fixed-order kernel) gives every
    activation and logit of a capture, a prefill and decode steps bit for bit as the same backend
    with the reference's apply_rope in every layer."""
    pytest.importorskip("torch")
    import torchref
    from compare.controls.prefill import Ops
    from torchref import ops
    if platform.machine().lower() not in ("x86_64", "amd64") or not shutil.which("g++"):
        pytest.skip("the fixed-order kernels are x86-64 code built with g++")
    m = torchref.from_pretrained(tiny_dir("gqa"), policy="bf16")
    assert m.plan.op("rope").startswith("fixed-order")
    ids = np.random.default_rng(4).integers(3, 96, (2, 11))
    mask = np.ones_like(ids)
    mask[1, :4] = 0

    def run():
        logits, acts = m.capture(ids[:, :8], mask[:, :8], taps=["*"])
        first, cache = m.prefill(ids[:, :8], mask[:, :8], 11)
        steps = [m.decode(cache, ids[:, t])[0] for t in range(8, 10)]
        return {"logits": logits, "prefill": first, **acts, **{f"step{i}": s for i, s in enumerate(steps)}}

    with_kernel = run()
    for layer in m.model.layers:
        layer.self_attn.ops = Ops(layer.self_attn.ops, apply_rope=ops.apply_rope)
    without = run()
    assert with_kernel.keys() == without.keys()
    for name in with_kernel:
        np.testing.assert_array_equal(np.asarray(with_kernel[name]).view(np.uint8),
                                      np.asarray(without[name]).view(np.uint8), err_msg=name)


def test_bucket_lengths_and_front_padding_are_neutral():
    """bucket_length: at least T, the stated widths, monotone; front_padded keeps the caller's
    slots and positions (positions count real tokens) and puts masked slots in front."""
    from llamaspec.inputs import bucket_length, front_padded
    widths = [bucket_length(t) for t in range(1, 3000)]
    assert all(w >= t for t, w in zip(range(1, 3000), widths))
    assert widths == sorted(widths)
    assert [bucket_length(t) for t in (1, 16, 17, 33, 64, 65, 129, 512, 513, 2048)] == \
        [16, 16, 32, 64, 64, 128, 192, 512, 768, 2048]
    assert len(set(widths[:2048])) == 3 + 7 + 6      # 16/32/64, 128..512 by 64, 768..2048 by 256
    ids = np.array([[0, 0, 5, 6, 7], [4, 5, 6, 7, 8]])
    mask = (ids > 0).astype(np.int64)
    run = front_padded(ids, mask, 16)
    assert run.ids.shape == (2, 16) and run.offset == 11 and not run.mask[:, :11].any()
    np.testing.assert_array_equal(run.restore(run.ids), ids)
    np.testing.assert_array_equal(run.restore(run.positions)[mask.astype(bool)], [0, 1, 2, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(run.restore(run.place(np.ones((2, 5, 3)))), np.ones((2, 5, 3)))


def test_jaxmodel_prefill_buckets_share_a_program_and_keep_the_function(tiny_dir):
    """Prompts of 17..32 tokens prefill under one compiled program (the bucket), and one decode
    step program serves them (unbucketed they compile apart); at fp64 the bucketed prefill,
    decode and greedy tokens equal the unbucketed ones to 1e-12 (the padding is masked,
    positions come from the mask)."""
    import jaxmodel
    m = jaxmodel.from_pretrained(tiny_dir("gqa"), policy="fp64")
    plain = jaxmodel.from_pretrained(tiny_dir("gqa"), policy="fp64")
    plain.buckets = False
    cases = []
    for T in (17, 23, 32):
        ids = tokens(B=2, T=T, seed=T)
        mask = np.ones_like(ids)
        ids[1, :4], mask[1, :4] = 0, 0
        cases.append((ids, mask))
    runs, seen = [], []
    for ids, mask in cases:
        logits, cache = m.prefill(ids, mask, ids.shape[1] + 6)
        steps = [logits]
        for _ in range(3):
            logits, cache = m.decode(cache, np.asarray(logits).argmax(-1))
            steps.append(logits)
        runs.append((steps, m.generate(ids, mask, max_new_tokens=6)))
        seen.append(m.compiled_programs())
    # the first length compiles (or found compiled by an earlier test); the other two add nothing.
    # Counted before `plain` runs: both models share the compiled programs of their structure
    assert seen[0]["prefill"] == seen[2]["prefill"], "three prompt lengths in one bucket: one prefill program"
    assert seen[0]["decode"] == seen[2]["decode"], "one decode program for the bucket's cache length"
    plain_before = plain.compiled_programs()["prefill"]
    for (ids, mask), (steps, tokens_) in zip(cases, runs):
        logits, cache = plain.prefill(ids, mask, ids.shape[1] + 6)
        for k, step in enumerate(steps):
            assert rel_l2(step, logits) <= 1e-12, f"T={ids.shape[1]}, step {k}"
            logits, cache = plain.decode(cache, np.asarray(step).argmax(-1))
        np.testing.assert_array_equal(tokens_, plain.generate(ids, mask, max_new_tokens=6))
        # prefill_capture: per-slot taps in the caller's slots, the logits tap at the last slot
        taps = ["layers.0.out", "final_norm", "logits"]
        got, want = m.prefill_capture(ids, mask, ids.shape[1] + 6, taps)[2], \
            plain.prefill_capture(ids, mask, ids.shape[1] + 6, taps)[2]
        for t in taps:
            assert got[t].shape == want[t].shape == ((2, ids.shape[1], 32) if t != "logits" else (2, 1, 96)), t
            real = mask.astype(bool) if t != "logits" else slice(None)
            assert rel_l2(got[t][real], want[t][real]) <= 1e-12, t
    assert plain.compiled_programs()["prefill"] > plain_before, "unbucketed, each length is a program of its own"


@pytest.mark.parametrize("config", ["gqa", "tied"])
def test_jaxmodel_native_bf16_dots_are_drift(config, tiny_dir, monkeypatch):
    """Native bf16 dots (the fast backend's native_products: on by default with AMX or AVX-512-BF16,
    forced here on any CPU; attention in XLA) hold a bf16 copy of each widened matrix beside it and
    use it for products of NATIVE_MIN_ROWS rows
    or more: the same products summed in f32 in another order. The ladder against torchref calls
    that drift, as it does the widened path; weights() are the same bits; the program really
    multiplies bf16 operands, in attention's products too; capture and forward stay bitwise one
    run; prefill then decode (rows below the threshold: the widened copy) generates."""
    import jax
    from flax import nnx

    import compare
    import jaxmodel
    from jaxmodel import fast, plan
    from jaxmodel.model import causal_allowed
    from llamaspec import load_weights
    if jax.default_backend() != "cpu":
        pytest.skip("native vs widened bf16 dots is a CPU choice")
    monkeypatch.setenv(plan.ATTENTION_ENV, "reference")   # attention's products in XLA, checked below
    folder = tiny_dir(config)
    cfg, w = load_weights(folder)
    ids, mask = np.random.default_rng(5).integers(3, 96, (2, 24)), np.ones((2, 24), np.int64)
    mask[1, :4] = 0
    models = {}
    for choice in ("widened", "native"):
        monkeypatch.setenv(plan.BF16_DOTS_ENV, choice)
        assert plan.load("bf16", "cpu", "fast")[1].native_products(Policy.get("bf16")) == (choice == "native")
        models[choice] = m = jaxmodel.from_weights(cfg, w, "bf16")
        copies = [v.get_value().native for _, v in nnx_variables(m, nnx.Param)
                  if isinstance(v.get_value(), fast.Weight) and v.get_value().native is not None]
        assert (len(copies) > 0) == (choice == "native")
        assert all(c.dtype == ml_dtypes.bfloat16 for c in copies)
        report = compare.compare_models("torchref", "jaxmodel", folder, inputs=(ids, mask), policy="bf16")
        assert report.verdict in ("exact", "drift"), (choice, report.summary())
    wide, native = models["widened"], models["native"]
    for key, value in wide.weights().items():
        np.testing.assert_array_equal(native.weights()[key], value, err_msg=key)
    positions = np.broadcast_to(np.arange(24), (2, 24))
    for m, bf16_dots in ((native, True), (wide, False)):
        jaxpr = jax.make_jaxpr(lambda i, m=m: m.model(i, positions, causal_allowed(np.ones((2, 24)), 24))[0])(ids)
        dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
        assert any(e.invars[1].aval.dtype == ml_dtypes.bfloat16 for e in dots) == bf16_dots
        # attention's two products (the dots with batch dimensions) follow the same rule
        batched = [e for e in dots if e.params["dimension_numbers"][1][0]]
        assert len(batched) == 2 * cfg.num_hidden_layers
        assert all((e.invars[0].aval.dtype == e.invars[1].aval.dtype == ml_dtypes.bfloat16) == bf16_dots
                   for e in batched)
    logits, acts = native.capture(ids, mask, taps=["*"])
    np.testing.assert_array_equal(np.asarray(native(ids, mask)), logits)
    assert np.isfinite(logits.astype(np.float32)).all()
    out = native.generate(ids, mask, max_new_tokens=4)
    assert out.shape == (2, 4)


def nnx_variables(m, kind):
    from flax import nnx
    return nnx.to_flat_state(nnx.filter_state(m.state, kind))


def test_native_bf16_dots_rule(monkeypatch):
    """The rule (plan.py, read once at load) is the CPU's features and the caps, never a timing: auto
    is on only with AMX-BF16 or AVX-512-BF16 and no XLA instruction-set cap below AVX512_BF16; bf16
    only; a bad value names the variable."""
    from jaxmodel import plan
    from llamaspec import cpuinfo
    bf16, fp32, fp16 = (Policy.get(p) for p in ("bf16", "fp32", "fp16"))

    def native(policy):
        return plan.load(policy, "cpu", "fast")[1].native_products(policy)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv(plan.BF16_DOTS_ENV, "auto")
    for flags in ({"amx_bf16", "avx512_bf16"}, {"avx512_bf16"}, {"amx_bf16"}, {"avx512f", "avx2"}, set()):
        monkeypatch.setattr(cpuinfo, "has", lambda flag, flags=flags: flag in flags)
        hw = bool(flags & {"amx_bf16", "avx512_bf16"})
        assert native(bf16) is hw, flags
        assert not native(fp32) and not native(fp16)
        for cap, on in (("AVX2", False), ("AVX512", False), ("AVX512_VNNI", False), ("avx512_bf16", True),
                        ("AMX", True), ("AMX_FP16", True), ("SSE4_2", False)):
            monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_max_isa={cap}")
            assert native(bf16) is (hw and on), (flags, cap)
        monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv(plan.BF16_DOTS_ENV, "native")
    assert native(bf16) and not native(fp32)
    monkeypatch.setenv(plan.BF16_DOTS_ENV, "fast")
    with pytest.raises(ValueError, match=plan.BF16_DOTS_ENV):
        native(bf16)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("config", ["tied", "bias"])
@pytest.mark.parametrize("dots", ["auto", "widened"])
def test_a_wider_param_dtype_reaches_products_rounded_to_compute_dtype(framework, config, dots, tiny_dir,
                                                                      monkeypatch):
    """A policy that keeps f32 weights but multiplies in bf16 (param_dtype wider than compute_dtype):
    every product's operands are rounded to bf16, weights and biases included, whichever path
    multiplies them (torch's bf16 kernel, the widened f32 one, jaxmodel's widened storage), so the
    checkpoint whose matrices and biases were rounded to bf16 beforehand gives the same bits: the
    logits (f32: the lm_head's widened product), every tap, a prefill and decode steps at batch 3
    and batch 1. Norm weights stay f32 (the norm's own dtype) in both."""
    import ml_dtypes

    from llamaspec import load_weights
    monkeypatch.setenv("LLAMA_PARITY_BF16_DOTS", dots)
    mod = importlib.import_module(framework)
    policy = Policy.get("bf16", param_dtype="float32")
    cfg, w = load_weights(tiny_dir(config))
    rounded = {k: (v.astype(ml_dtypes.bfloat16).astype(v.dtype) if v.ndim == 2 or k.endswith(".bias") else v)
               for k, v in w.items()}
    assert any(not np.array_equal(rounded[k], w[k]) for k in w if k.endswith(".bias")) or config != "bias"
    ids, mask = tokens(3, 13), np.ones((3, 13), np.int64)
    mask[2, :4] = 0

    def run(m):
        logits, acts = m.capture(ids, mask, taps=["*"])
        first, cache = m.prefill(ids, mask, 16)
        step, _ = m.decode(cache, first.argmax(-1))
        one, cache1 = m.prefill(ids[:1], mask[:1], 16)
        out = {"logits": logits, **acts, "prefill": first, "decode": step, "prefill 1": one}
        for i in range(2):
            one, cache1 = m.decode(cache1, one.argmax(-1))
            out[f"decode 1 step {i}"] = one
        return out

    a, b = run(mod.from_weights(cfg, w, policy)), run(mod.from_weights(cfg, rounded, policy))
    for key in b:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
