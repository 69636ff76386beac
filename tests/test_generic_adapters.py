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

def llama_forward(xp, p, cfg, ids, mask, positions, inject=None, bug=None):
    """(logits, {tap: array}) in the dtype of the weights p (checkpoint keys), every tap of
    the vocabulary; xp is numpy or jax.numpy. bug: one of PLANTED, in layer 1 only."""
    H, KV, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    emb = p["model.embed_tokens.weight"]
    dt = emb.dtype
    B, T = ids.shape
    acts = {}

    def norm(x, w, eps=eps):
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
    if bug == "pad_visible":        # every layer attends to padding slots too
        allowed = np.tril(np.ones((T, T), bool))[None, None] | np.zeros_like(allowed)
    h = acts["embed"] = emb[ids]
    for i in range(cfg.num_hidden_layers):
        if inject and i in inject:
            h = xp.asarray(inject[i], dtype=dt)
        pre = f"model.layers.{i}."
        x = acts[f"layers.{i}.attn_norm"] = norm(h, p[pre + "input_layernorm.weight"],
                                                 eps * 100 if (bug, i) == ("eps", 1) else eps)
        q, k, v = (lin(x, pre + f"self_attn.{n}_proj").reshape(B, T, -1, D) for n in "qkv")
        acts.update({f"layers.{i}.q": q, f"layers.{i}.k": k, f"layers.{i}.v": v})
        q = acts[f"layers.{i}.q_rope"] = rope(q)
        k = acts[f"layers.{i}.k_rope"] = rope(k)
        k, v = xp.repeat(k, H // KV, axis=2), xp.repeat(v, H // KV, axis=2)
        s = xp.einsum("bqhd,bkhd->bhqk", q, k) / dt.type(np.sqrt(D))
        sees = allowed | np.eye(T, k=1, dtype=bool)[None, None] if (bug, i) == ("causal", 1) else allowed
        s = xp.where(sees, s, xp.finfo(dt).min)
        e = xp.exp(s - s.max(-1, keepdims=True))
        ctx = acts[f"layers.{i}.attn_ctx"] = xp.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True),
                                                       v).reshape(B, T, H * D)
        a = acts[f"layers.{i}.attn_out"] = lin(ctx, pre + "self_attn.o_proj")
        h = acts[f"layers.{i}.resid_mid"] = h + a
        x = acts[f"layers.{i}.mlp_norm"] = norm(h, p[pre + "post_attention_layernorm.weight"])
        gate, up = ("up", "gate") if (bug, i) == ("swap", 1) else ("gate", "up")
        g = acts[f"layers.{i}.gate"] = lin(x, pre + f"mlp.{gate}_proj")
        u = acts[f"layers.{i}.up"] = lin(x, pre + f"mlp.{up}_proj")
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
    # the dedicated adapter also recomputes q_rope/k_rope (no module boundary to map)
    assert generic.taps == tuple(t for t in dedicated.taps if not t.endswith("_rope"))
    assert generic.num_layers == 2 and generic.supports_inject
    ids, mask = right_padded()
    g_logits, g = generic.capture(ids, mask, taps="*")
    d_logits, d = dedicated.capture(ids, mask, taps=generic.taps)
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
    # with teacher forcing asked for, the ladder runs without it and says why
    report = compare.compare_models("torchref", port, folder, inputs=(ids, mask))
    assert ok(report) and report.local == [] and report.teacher_forcing.startswith("not run: ")
    bad = JaxFunction(lambda p, i, m, pos: (np.zeros((*i.shape, 96)), {}), weights, taps=["embed"])
    with pytest.raises(RuntimeError, match="taps not produced: embed"):
        bad.capture(ids, mask, ["embed"])
    with pytest.raises(ValueError, match="'layers.{i}.hidden'.*tap names are"):
        JaxFunction(lambda *a: None, weights, taps=["layers.{i}.hidden"], num_layers=2)


# A bug planted in layer 1 of the function port, and where the ladder must find it.
PLANTED = {"eps": ("layers.1.attn_norm", "attn_norm"), "swap": ("layers.1.gate", "mlp"),
           "causal": ("layers.1.attn_ctx", "attn")}


class NoTwin:
    """A port that follows the protocol without float64(): judged by structure alone."""

    def __init__(self, port):
        self.port, self.name, self.taps = port, port.name, port.taps
        self.supports_inject = port.supports_inject

    def capture(self, tokens, attention_mask, taps, inject=None):
        return self.port.capture(tokens, attention_mask, taps, inject)


@pytest.mark.parametrize("twin", ["with float64", "without float64"])
@pytest.mark.parametrize("bug", list(PLANTED))
def test_jax_function_planted_bug_found_at_its_layer_and_component(gqa, bug, twin):
    folder, cfg, weights = gqa

    def forward(params, ids, mask, positions, inject=None):
        return llama_forward(jnp, params, cfg, jnp.asarray(ids), mask, positions, inject, bug=bug)

    port = JaxFunction(forward, {k: jnp.asarray(v) for k, v in weights.items()}, name=f"jax llama, {bug}",
                       taps="*", num_layers=cfg.num_hidden_layers)
    if twin == "without float64":
        port = NoTwin(port)
    ids = np.random.default_rng(1).integers(3, 96, (2, 24))
    report = compare.compare_models("torchref", port, folder, inputs=ids)
    d = report.first_divergence
    assert report.verdict == "semantic" and (d.tap, d.layer, d.component) == (*PLANTED[bug][:1], 1,
                                                                             PLANTED[bug][1]), report.summary()
    assert d.confirmed, d.evidence
    if twin == "without float64":
        assert report.semantic_rung.startswith("not run") and "structure alone" in report.summary()
        assert all(v.err_fp64 != v.err_fp64 for v in report.taps)     # NaN: no fp64 rung
    else:
        assert report.semantic_rung == "run"


def test_port_without_twin_clean_is_drift_and_cannot_be_the_reference(gqa):
    folder, cfg, weights = gqa
    port = NoTwin(JaxFunction(lambda p, i, m, pos, inject=None: llama_forward(jnp, p, cfg, jnp.asarray(i), m, pos,
                                                                              inject),
                              {k: jnp.asarray(v) for k, v in weights.items()}, taps="*", num_layers=2))
    ids, mask = right_padded()
    report = compare.compare_models("torchref", port, folder, inputs=(ids, mask))
    assert ok(report) and report.teacher_forcing == "run", report.summary()
    with pytest.raises(TypeError, match="has no float64.*as the reference"):
        compare.compare_models(port, "torchref", folder, inputs=(ids, mask))


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


# ----- Flax NNX and linen: the same Llama as modules -----------------------------------------

def rope_tables(cfg, positions, dt):
    inv = 1.0 / (cfg.rope.theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim))
    ang = jnp.asarray(np.asarray(positions)[..., None] * inv, dtype=dt)
    return jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]


def rotate(x, cos, sin):
    a, b = jnp.split(x, 2, -1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def attend(q, k, v, allowed, heads):
    B, T, _, D = q.shape
    k, v = jnp.repeat(k, heads // k.shape[2], axis=2), jnp.repeat(v, heads // v.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / q.dtype.type(np.sqrt(D))
    s = jnp.where(allowed, s, jnp.finfo(q.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(B, T, heads * D)


def rms(x, w, eps):
    return w * (x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + x.dtype.type(eps)))


def causal(mask):
    T = mask.shape[1]
    return np.asarray(mask, bool)[:, None, None, :] & np.tril(np.ones((T, T), bool))[None, None]


NNX_TAPS = {"embed": "embed_tokens", "layers.{i}.attn_norm": "layers.{i}.input_layernorm",
            "layers.{i}.q": "layers.{i}.self_attn.q_proj", "layers.{i}.k": "layers.{i}.self_attn.k_proj",
            "layers.{i}.q_rope": "sow:layers.{i}.self_attn.q_rope", "layers.{i}.attn_out": "layers.{i}.self_attn",
            "layers.{i}.mlp_norm": "layers.{i}.post_attention_layernorm", "layers.{i}.gate": "layers.{i}.mlp.gate_proj",
            "layers.{i}.mlp_out": "layers.{i}.mlp", "layers.{i}.out": "layers.{i}", "final_norm": "norm",
            "logits": "lm_head"}


def nnx_llama(cfg, w):
    from flax import nnx

    class Table(nnx.Module):
        def __init__(self, key):
            self.weight = nnx.Param(jnp.asarray(w[key + ".weight"]))

    class Linear(Table):
        def __call__(self, x):
            return x @ self.weight[...].T

    class Norm(Table):
        def __call__(self, x):
            return rms(x, self.weight[...], cfg.rms_norm_eps)

    class Embed(Table):
        def __call__(self, ids):
            return self.weight[...][ids]

    class Attention(nnx.Module):
        def __init__(self, p):
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (Linear(p + n) for n in ("q_proj", "k_proj",
                                                                                          "v_proj", "o_proj"))

        def __call__(self, x, cos, sin, allowed):
            B, T, _ = x.shape
            q, k, v = (f(x).reshape(B, T, -1, cfg.head_dim) for f in (self.q_proj, self.k_proj, self.v_proj))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            self.sow(nnx.Intermediate, "q_rope", q)
            return self.o_proj(attend(q, k, v, allowed, cfg.num_attention_heads))

    class MLP(nnx.Module):
        def __init__(self, p):
            self.gate_proj, self.up_proj, self.down_proj = (Linear(p + n) for n in ("gate_proj", "up_proj",
                                                                                    "down_proj"))

        def __call__(self, x):
            return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nnx.Module):
        def __init__(self, i):
            p = f"model.layers.{i}."
            self.input_layernorm, self.post_attention_layernorm = (Norm(p + "input_layernorm"),
                                                                   Norm(p + "post_attention_layernorm"))
            self.self_attn, self.mlp = Attention(p + "self_attn."), MLP(p + "mlp.")

        def __call__(self, h, cos, sin, allowed):
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, allowed)
            return h + self.mlp(self.post_attention_layernorm(h))

    class Llama(nnx.Module):
        def __init__(self):
            self.embed_tokens, self.norm, self.lm_head = Embed("model.embed_tokens"), Norm("model.norm"), Linear(
                "lm_head")
            self.layers = nnx.List([Block(i) for i in range(cfg.num_hidden_layers)])

        def __call__(self, ids, mask, positions, inject=None):
            h = self.embed_tokens(ids)
            cos, sin = rope_tables(cfg, positions, h.dtype)
            for i, block in enumerate(self.layers):
                h = jnp.asarray(inject[i], h.dtype) if inject and i in inject else h
                h = block(h, cos, sin, causal(mask))
            return self.lm_head(self.norm(h))

    return Llama()


def test_nnx_module_submodule_outputs_and_sown_values(gqa):
    from flax import nnx

    from compare.adapters import NnxModule
    folder, cfg, weights = gqa
    module = nnx_llama(cfg, weights)
    port = NnxModule(module, NNX_TAPS, name="my nnx llama", head_dim=cfg.head_dim)   # its __call__ takes inject
    assert port.num_layers == 2 and port.supports_inject and "layers.1.q_rope" in port.taps
    ids, mask = right_padded()
    logits, acts = port.capture(ids, mask, "*")
    want_logits, want = llama_forward(np, weights, cfg, ids, mask, np.maximum(np.cumsum(mask, 1) - 1, 0))
    real = mask.astype(bool)   # padding slots hold id 0 in the adapter's input (check_token_array)
    for t, x in acts.items():
        assert x.shape == want[t].shape, t
        np.testing.assert_allclose(x[real], want[t][real], rtol=0, atol=1e-4, err_msg=t)
    report = compare.compare_models("torchref", port, folder, inputs=(ids, mask))
    assert ok(report), report.summary()
    assert all(r.get("cand_local") is not None for r in report.local)
    twin_logits, _ = port.float64().capture(ids, mask, ["logits"])
    assert twin_logits.dtype == np.float64
    assert module.lm_head.weight[...].dtype == jnp.float32     # the module is left as given
    assert not any(hasattr(type(m).__call__, "_does_capturing") for _, m in nnx.iter_modules(module))
    with pytest.raises(LookupError, match=r"tap 'layers.0.attn_out': path 'layers.0.attn'.*self_attn"):
        NnxModule(module, {"layers.{i}.attn_out": "layers.{i}.attn"})


def test_linen_module_capture_intermediates(gqa):
    import flax.linen as nn

    from compare.adapters import LinenModule
    folder, cfg, weights = gqa

    class Linear(nn.Module):
        shape: tuple

        @nn.compact
        def __call__(self, x):
            return x @ self.param("weight", nn.initializers.zeros, self.shape).T

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, cos, sin, allowed):
            H, KV, D, F = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
            d = h.shape[-1]
            x = rms(h, self.param("attn_norm", nn.initializers.ones, (d,)), cfg.rms_norm_eps)
            B, T, _ = x.shape
            q = Linear((H * D, d), name="q_proj")(x).reshape(B, T, H, D)
            k = Linear((KV * D, d), name="k_proj")(x).reshape(B, T, KV, D)
            v = Linear((KV * D, d), name="v_proj")(x).reshape(B, T, KV, D)
            h = h + Linear((d, H * D), name="o_proj")(attend(rotate(q, cos, sin), rotate(k, cos, sin), v, allowed, H))
            x = rms(h, self.param("mlp_norm", nn.initializers.ones, (d,)), cfg.rms_norm_eps)
            return h + Linear((d, F), name="down_proj")(
                jax.nn.silu(Linear((F, d), name="gate_proj")(x)) * Linear((F, d), name="up_proj")(x))

    class Llama(nn.Module):
        @nn.compact
        def __call__(self, ids, mask, positions):
            h = self.param("embed", nn.initializers.zeros, (cfg.vocab_size, cfg.hidden_size))[ids]
            self.sow("intermediates", "embed", h)
            cos, sin = rope_tables(cfg, positions, h.dtype)
            for i in range(cfg.num_hidden_layers):
                h = Block(name=f"layers_{i}")(h, cos, sin, causal(mask))
            h = rms(h, self.param("norm", nn.initializers.ones, (cfg.hidden_size,)), cfg.rms_norm_eps)
            return Linear((cfg.vocab_size, cfg.hidden_size), name="lm_head")(h)

    w = {k: jnp.asarray(v) for k, v in weights.items()}
    params = {"embed": w["model.embed_tokens.weight"], "norm": w["model.norm.weight"],
              "lm_head": {"weight": w["lm_head.weight"]}}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        params[f"layers_{i}"] = {"attn_norm": w[p + "input_layernorm.weight"],
                                 "mlp_norm": w[p + "post_attention_layernorm.weight"],
                                 **{n: {"weight": w[p + f"self_attn.{n}.weight"]} for n in
                                    ("q_proj", "k_proj", "v_proj", "o_proj")},
                                 **{n: {"weight": w[p + f"mlp.{n}.weight"]} for n in
                                    ("gate_proj", "up_proj", "down_proj")}}
    taps = {"embed": "sow:embed", "layers.{i}.q": "layers_{i}.q_proj", "layers.{i}.attn_out": "layers_{i}.o_proj",
            "layers.{i}.gate": "layers_{i}.gate_proj", "layers.{i}.mlp_out": "layers_{i}.down_proj",
            "layers.{i}.out": "layers_{i}", "logits": "lm_head"}
    port = LinenModule(Llama(), {"params": params}, taps, name="my linen llama", num_layers=2,
                       head_dim=cfg.head_dim)
    assert not port.supports_inject and port.taps[0] == "embed" and port.taps[-1] == "logits"
    ids, mask = right_padded()
    logits, acts = port.capture(ids, mask, "*")
    _, want = llama_forward(np, weights, cfg, ids, mask, np.maximum(np.cumsum(mask, 1) - 1, 0))
    real = mask.astype(bool)
    for t, x in acts.items():
        np.testing.assert_allclose(x[real], want[t][real], rtol=0, atol=1e-4, err_msg=t)
    report = compare.compare_models("torchref", port, folder, inputs=(ids, mask), teacher_forcing=False)
    assert ok(report), report.summary()
    assert port.float64().capture(ids, mask, ["layers.1.out"])[1]["layers.1.out"].dtype == np.float64
    wrong = LinenModule(Llama(), {"params": params}, {"layers.{i}.out": "layer_{i}"}, num_layers=2)
    with pytest.raises(RuntimeError, match=r"'layers.0.out' \(layer_0: not in the intermediates tree"):
        wrong.capture(ids, mask, ["layers.0.out"])


@pytest.mark.parametrize("bug", [None, "pad_visible"])
def test_probes_take_a_port_under_the_protocol(gqa, bug):
    """The batch and padding probes on a JAX function port: its capture's logits, its
    float64() as the twin; a port that lets queries see padding slots is caught by the
    padding probe."""
    from compare.probes import probe_batch, probe_padding
    folder, cfg, weights = gqa

    def forward(params, ids, mask, positions, inject=None):
        return llama_forward(jnp, params, cfg, jnp.asarray(ids), mask, positions, inject, bug=bug)

    port = JaxFunction(forward, {k: jnp.asarray(v) for k, v in weights.items()}, name="jax port", taps="*",
                       num_layers=cfg.num_hidden_layers)
    port.config = cfg       # the probes read vocab_size / pad_token_id from it
    with pytest.raises(TypeError, match="pass policy="):
        probe_padding(port, length=12)
    from compare.probes.models import as_probe_model
    pm = as_probe_model(port, policy="fp32")
    assert pm.name == "jax port" and pm.oracle() is not None
    padding = probe_padding(pm, length=12)
    batch = probe_batch(pm, length=12, batch_sizes=(2, 3), padding_side="left")   # pads before the target
    if bug is None:
        assert padding.verdict in ("exact", "drift") and batch.verdict in ("exact", "drift"), padding.summary()
    else:
        assert padding.verdict == "semantic", padding.summary()
