"""compare.adapters.generic: a user's own port compared with no class written (TorchModule,
JaxFunction, NnxModule, LinenModule), and the README's hand-written Implementation.

Real parts only: tiny random checkpoints, transformers' LlamaForCausalLM, a Llama written
here once over an array module (numpy or jax.numpy), the ladder itself.
"""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
jax = pytest.importorskip("jax")
jnp = jax.numpy

import compare  # noqa: E402
from compare.adapters import HF_LLAMA_TAPS, JaxFunction, TorchModule  # noqa: E402
from compare.adapters.transformers import TransformersModel  # noqa: E402
from llamaspec import load_weights  # noqa: E402
from llamaspec import taps as tapnames  # noqa: E402


def hf_model(folder, dtype=torch.float64, attn="eager"):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn).eval()


def right_padded(B=3, T=12, seed=0):
    ids = np.random.default_rng(seed).integers(3, 96, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, T - 4:] = 0
    mask[2, T - 2:] = 0
    return ids, mask


def hooks(model):
    return {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._forward_hooks_with_kwargs),
                   dict(m._forward_pre_hooks_with_kwargs)) for name, m in model.named_modules()}


def ok(report):
    return report.verdict in ("exact", "drift")


# ----- a Llama written once over an array module: the user's own function-based port ---------

def llama_forward(xp, p, cfg, ids, mask, positions, inject=None):
    """(logits, {tap: array}) in the dtype of the weights p (checkpoint keys), every tap of
    the vocabulary; xp is numpy or jax.numpy."""
    H, KV, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    emb = p["model.embed_tokens.weight"]
    dt = emb.dtype
    B, T = ids.shape
    acts = {}

    def norm(x, w):
        return w * (x / xp.sqrt(xp.mean(x * x, -1, keepdims=True) + dt.type(eps)))

    def lin(x, key):
        return x @ p[key + ".weight"].T

    inv = 1.0 / (cfg.rope.theta ** (np.arange(0, D, 2) / D))
    ang = xp.asarray(np.asarray(positions)[..., None] * inv, dtype=dt)
    cos, sin = xp.cos(ang)[:, :, None], xp.sin(ang)[:, :, None]

    def rope(x):
        a, b = x[..., :D // 2], x[..., D // 2:]
        return xp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    allowed = np.asarray(mask, bool)[:, None, None, :] & np.tril(np.ones((T, T), bool))[None, None]
    h = acts["embed"] = emb[ids]
    for i in range(cfg.num_hidden_layers):
        if inject and i in inject:
            h = xp.asarray(inject[i], dtype=dt)
        pre = f"model.layers.{i}."
        x = acts[f"layers.{i}.attn_norm"] = norm(h, p[pre + "input_layernorm.weight"])
        q, k, v = (lin(x, pre + f"self_attn.{n}_proj").reshape(B, T, -1, D) for n in "qkv")
        acts.update({f"layers.{i}.q": q, f"layers.{i}.k": k, f"layers.{i}.v": v})
        q = acts[f"layers.{i}.q_rope"] = rope(q)
        k = acts[f"layers.{i}.k_rope"] = rope(k)
        k, v = xp.repeat(k, H // KV, axis=2), xp.repeat(v, H // KV, axis=2)
        s = xp.einsum("bqhd,bkhd->bhqk", q, k) / dt.type(np.sqrt(D))
        s = xp.where(allowed, s, xp.finfo(dt).min)
        e = xp.exp(s - s.max(-1, keepdims=True))
        ctx = acts[f"layers.{i}.attn_ctx"] = xp.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True),
                                                       v).reshape(B, T, H * D)
        a = acts[f"layers.{i}.attn_out"] = lin(ctx, pre + "self_attn.o_proj")
        h = acts[f"layers.{i}.resid_mid"] = h + a
        x = acts[f"layers.{i}.mlp_norm"] = norm(h, p[pre + "post_attention_layernorm.weight"])
        g = acts[f"layers.{i}.gate"] = lin(x, pre + "mlp.gate_proj")
        u = acts[f"layers.{i}.up"] = lin(x, pre + "mlp.up_proj")
        act = acts[f"layers.{i}.act"] = g / (1 + xp.exp(-g)) * u
        m = acts[f"layers.{i}.mlp_out"] = lin(act, pre + "mlp.down_proj")
        h = acts[f"layers.{i}.out"] = h + m
    x = acts["final_norm"] = norm(h, p["model.norm.weight"])
    logits = acts["logits"] = lin(x, "lm_head")
    return logits, acts


@pytest.fixture(scope="module")
def gqa(tiny_dir):
    folder = tiny_dir("gqa")
    cfg, weights = load_weights(folder)
    return folder, cfg, {k: np.asarray(v, np.float32) for k, v in weights.items()}


# ----- TorchModule ------------------------------------------------------------------------------

def test_torch_module_taps_equal_the_transformers_adapter(gqa):
    """A module-path map over transformers' Llama gives what the dedicated adapter gives,
    inject included, and leaves no hook behind."""
    folder, cfg, _ = gqa
    model = hf_model(folder)
    before = hooks(model)
    generic = TorchModule(model, HF_LLAMA_TAPS, name="hf via paths")
    dedicated = TransformersModel(model)
    assert generic.taps == dedicated.taps and generic.num_layers == 2 and generic.supports_inject
    ids, mask = right_padded()
    g_logits, g = generic.capture(ids, mask, taps="*")
    d_logits, d = dedicated.capture(ids, mask, taps="*")
    assert list(g) == list(d)
    for t in d:
        assert g[t].shape == d[t].shape, t
        np.testing.assert_allclose(g[t], d[t], rtol=0, atol=1e-12, err_msg=t)
    np.testing.assert_allclose(g_logits, d_logits, rtol=0, atol=1e-12)
    h = np.random.default_rng(1).standard_normal((*ids.shape, cfg.hidden_size))
    _, gi = generic.capture(ids, mask, ["layers.1.attn_norm", "layers.1.out"], inject={1: h})
    _, di = dedicated.capture(ids, mask, ["layers.1.attn_norm", "layers.1.out"], inject={1: h})
    for t in di:
        np.testing.assert_allclose(gi[t], di[t], rtol=0, atol=1e-12, err_msg=t)
    assert not np.allclose(gi["layers.1.out"], g["layers.1.out"])
    assert hooks(model) == before


def test_torch_module_compared_with_torchref_is_drift(gqa):
    """compare_models takes it as the candidate; transformers' float64 run keeps its f32
    islands (keeps_f32=True, as the dedicated adapter says of itself)."""
    folder, *_ = gqa
    model = hf_model(folder, torch.float32)
    cand = TorchModule(model, HF_LLAMA_TAPS, name="hf via paths", keeps_f32=True)
    report = compare.compare_models("torchref", cand, folder, inputs=right_padded()[0])
    assert ok(report), report.summary()
    assert report.candidate == "hf via paths" and next(model.parameters()).dtype == torch.float32


def test_torch_module_planted_bug_is_semantic_at_its_layer(gqa):
    """A user's forward hook scaling layer 1's attention output by 1.01 is part of the
    model: the float64 twin (a deep copy) carries it, and the ladder finds it there."""
    folder, *_ = gqa
    model = hf_model(folder, torch.float32)
    model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda mod, args, out: out * 1.01)
    cand = TorchModule(model, HF_LLAMA_TAPS, name="hf+bug", keeps_f32=True)
    twin = cand.float64()
    assert next(twin.module.parameters()).dtype == torch.float64
    assert len(twin.module.model.layers[1].self_attn.o_proj._forward_hooks) == 1
    report = compare.compare_models("torchref", cand, folder, inputs=right_padded()[0])
    assert report.verdict == "semantic", report.summary()
    d = report.first_divergence
    assert (d.tap, d.confirmed) == ("layers.1.attn_out", True), report.summary()
    assert "scale factor 1.01" in d.hint, d.hint


def test_torch_module_refuses_bad_maps_and_unsupported_inject(gqa):
    folder, *_ = gqa
    model = hf_model(folder)
    with pytest.raises(LookupError, match=r"tap 'layers.0.attn_out'.*model.layers.0.self_atn.*self_attn"):
        TorchModule(model, {"layers.{i}.attn_out": "model.layers.{i}.self_atn"})
    with pytest.raises(ValueError, match=r"'layers.{i}.attention'.*tap names are embed, layers.{i}.<attn_norm"):
        TorchModule(model, {"layers.{i}.attention": "model.layers.{i}.self_attn"})
    with pytest.raises(ValueError, match=r"'lm_logits'.*tap names are"):
        TorchModule(model, {"lm_logits": "lm_head"})
    only = TorchModule(model, {"embed": "model.embed_tokens", "logits": "lm_head"})
    assert only.taps == ("embed", "logits") and not only.supports_inject
    ids, mask = right_padded()
    with pytest.raises(KeyError, match=r"'layers.0.out' is not returned by .*embed, logits"):
        only.capture(ids, mask, ["layers.0.out"])
    with pytest.raises(NotImplementedError, match="inject_map"):
        only.capture(ids, mask, ["embed"], inject={0: np.zeros((*ids.shape, 32))})
    # a mapped module the forward never calls: named with its path
    never = TorchModule(model, {"embed": "model.rotary_emb"}, forward=lambda m, i, a, p: m.lm_head.weight[i])
    with pytest.raises(RuntimeError, match=r"'embed' \(model.rotary_emb\)"):
        never.capture(ids, mask, ["embed"])
    assert hooks(model) == hooks(hf_model(folder))


# ----- JaxFunction ------------------------------------------------------------------------------

def test_jax_function_compared_with_torchref(gqa):
    """A pure JAX function returning its intermediates: drift at fp32, its float64 twin
    (params cast, x64) agrees with torchref at fp64, teacher forcing through inject."""
    folder, cfg, weights = gqa

    def forward(params, ids, mask, positions, inject=None):
        return llama_forward(jnp, params, cfg, jnp.asarray(ids), mask, positions, inject)

    port = JaxFunction(forward, {k: jnp.asarray(v) for k, v in weights.items()}, name="my jax llama",
                       taps="*", num_layers=cfg.num_hidden_layers)
    assert port.taps == tuple(tapnames.all_taps(2)) and port.supports_inject
    ids, mask = right_padded()
    report = compare.compare_models("torchref", port, folder, inputs=(ids, mask))
    assert ok(report), report.summary()
    assert all(r.get("cand_local") is not None for r in report.local), report.local
    twin = port.float64()
    logits, acts = twin.capture(ids, mask, ["layers.1.q_rope", "logits"])
    assert logits.dtype == np.float64 and acts["layers.1.q_rope"].shape == (3, 12, 4, 8)
    import torchref
    ref_logits, _ = torchref.from_pretrained(folder, policy="fp64").capture(ids, mask, ["logits"])
    real = mask.astype(bool)
    assert np.abs(logits[real] - ref_logits[real]).max() < 1e-10


def test_jax_function_without_inject_says_so(gqa):
    folder, cfg, weights = gqa
    port = JaxFunction(lambda p, i, m, pos: llama_forward(jnp, p, cfg, jnp.asarray(i), m, pos), weights,
                       taps=("embed", "layers.{i}.out", "logits"), num_layers=2)
    assert port.taps == ("embed", "layers.0.out", "layers.1.out", "logits") and not port.supports_inject
    ids, mask = right_padded()
    with pytest.raises(NotImplementedError, match="teacher_forcing=False"):
        port.capture(ids, mask, ["embed"], inject={0: np.zeros((*ids.shape, 32))})
    report = compare.compare_models("torchref", port, folder, inputs=(ids, mask), teacher_forcing=False)
    assert ok(report), report.summary()
    bad = JaxFunction(lambda p, i, m, pos: (np.zeros((*i.shape, 96)), {}), weights, taps=["embed"])
    with pytest.raises(RuntimeError, match="taps not produced: embed"):
        bad.capture(ids, mask, ["embed"])
    with pytest.raises(ValueError, match="'layers.{i}.hidden'.*tap names are"):
        JaxFunction(lambda *a: None, weights, taps=["layers.{i}.hidden"], num_layers=2)


# ----- the README's example: an Implementation written by hand, no compare import -------------

class MyPort:
    """The README's "bring your own port" example (numpy, the user's own forward)."""

    name = "my numpy llama"

    def __init__(self, cfg, weights, dtype=np.float32):
        self.cfg, self.dtype = cfg, dtype
        self.weights = {k: np.asarray(v, dtype) for k, v in weights.items()}
        self.taps = ("embed", *(f"layers.{i}.{t}" for i in range(cfg.num_hidden_layers)
                                for t in ("attn_out", "out")), "final_norm", "logits")

    def capture(self, tokens, attention_mask, taps, inject=None):
        mask = np.ones_like(tokens) if attention_mask is None else np.asarray(attention_mask)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)   # real tokens count from 0
        logits, acts = llama_forward(np, self.weights, self.cfg, np.asarray(tokens), mask, positions, inject)
        return logits, {t: acts[t] for t in taps}

    def float64(self):
        return MyPort(self.cfg, self.weights, np.float64)


def test_readme_example_hand_written_port(gqa):
    folder, cfg, weights = gqa
    ids, mask = right_padded()
    report = compare.compare_models("torchref", MyPort(cfg, weights), folder, inputs=(ids, mask))
    assert ok(report), report.summary()
    assert {v.tap for v in report.taps} == set(MyPort(cfg, weights).taps)
    compare.assert_parity("torchref", MyPort(cfg, weights), folder, inputs=(ids, mask))
    # the same port with a bug: epsilon 1e-3 in every norm is semantic
    wrong = MyPort(dataclasses.replace(cfg, rms_norm_eps=1e-3), weights)
    with pytest.raises(AssertionError, match="semantic"):
        compare.assert_parity("torchref", wrong, folder, inputs=(ids, mask))
