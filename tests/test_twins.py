"""A candidate's float64 twin is checked before the ladder trusts it (compare.ladder.twins).

Two ways real ports broke the fp64 rung, rebuilt here on a tiny checkpoint with a small torch
Llama written below (Hugging Face parameter names, wrapped by compare.adapters.TorchModule):
- a twin that keeps float32 steps (torchtune's RMSNorm and RoPE run `x.float()` in its
  float64 model) with keeps_f32 unset: "semantic" for a correct model;
- a twin cast from the working precision's bf16-rounded weights (TorchModule.float64 without
  the checkpoint) while the oracle reads the checkpoint's: "semantic" for a correct bf16 model.
"""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import compare  # noqa: E402
from compare.adapters import HF_LLAMA_TAPS, PortError, TorchModule  # noqa: E402
from compare.ladder import engine, twins  # noqa: E402
from llamaspec import load_weights  # noqa: E402

# B x T with row 1 right-padded: every per-head tap holds > twins.MIN_VALUES values (k_rope:
# (40 + 34) tokens x 2 heads x 8)
IDS = np.random.default_rng(3).integers(3, 96, (2, 40))
MASK = np.ones_like(IDS)
MASK[1, 34:] = 0


# ----- a small torch Llama: `island` is the dtype its norm and RoPE compute in ------------------
# "float32": x.float() inside, as torchtune's modules (so its float64 model keeps f32 steps);
# "wide": at least float32 (float64 in a float64 model: a true float64 twin).

def _wide(x, island):
    return torch.float32 if island == "float32" else torch.promote_types(x.dtype, torch.float32)


class Norm(nn.Module):
    def __init__(self, dim, eps, island):
        super().__init__()
        self.weight, self.eps, self.island = nn.Parameter(torch.ones(dim)), eps, island

    def forward(self, x):
        y = x.to(_wide(x, self.island))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)      # torchtune's and transformers' order


class Rope(nn.Module):
    def __init__(self, cfg, island):
        super().__init__()
        self.theta, self.dim, self.island = cfg.rope.theta, cfg.head_dim, island

    def forward(self, x, positions):        # x [B, T, heads, head_dim]
        dt, D = _wide(x, self.island), self.dim
        inv = 1.0 / self.theta ** (torch.arange(0, D, 2, dtype=dt) / D)
        ang = positions[..., None].to(dt) * inv
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        y = x.to(dt)
        a, b = y[..., :D // 2], y[..., D // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg, island):
        super().__init__()
        H, KV, D, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.H, self.KV, self.D = H, KV, D
        self.q_proj, self.k_proj = nn.Linear(E, H * D, bias=False), nn.Linear(E, KV * D, bias=False)
        self.v_proj, self.o_proj = nn.Linear(E, KV * D, bias=False), nn.Linear(H * D, E, bias=False)
        self.q_rope, self.k_rope = Rope(cfg, island), Rope(cfg, island)

    def forward(self, x, positions, allowed):
        B, T, _ = x.shape
        q = self.q_rope(self.q_proj(x).view(B, T, self.H, self.D), positions)
        k = self.k_rope(self.k_proj(x).view(B, T, self.KV, self.D), positions)
        v = self.v_proj(x).view(B, T, self.KV, self.D)
        k, v = (t.repeat_interleave(self.H // self.KV, dim=2) for t in (k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.D ** 0.5
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        p = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), -1).to(x.dtype)
        return self.o_proj(torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        E, F = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(E, F, bias=False), nn.Linear(E, F, bias=False)
        self.down_proj = nn.Linear(F, E, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg, island, mlp_eps):
        super().__init__()
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps, island)
        self.self_attn = Attention(cfg, island)
        self.post_attention_layernorm = Norm(cfg.hidden_size, mlp_eps, island)
        self.mlp = MLP(cfg)

    def forward(self, h, positions, allowed):
        h = h + self.self_attn(self.input_layernorm(h), positions, allowed)
        return h + self.mlp(self.post_attention_layernorm(h))


class Inner(nn.Module):
    def __init__(self, cfg, island, bug_eps):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, island, bug_eps if (bug_eps and i == 1) else cfg.rms_norm_eps)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps, island)


class TinyLlama(nn.Module):
    def __init__(self, cfg, island="wide", bug_eps=None):
        super().__init__()
        self.config = cfg
        self.model = Inner(cfg, island, bug_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, position_ids):
        T = input_ids.shape[1]
        allowed = torch.tril(torch.ones(T, T, dtype=torch.bool)) & attention_mask.bool()[:, None, None, :]
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, position_ids, allowed)
        return self.lm_head(self.model.norm(h))


TAPS = {**HF_LLAMA_TAPS, "layers.{i}.q_rope": "model.layers.{i}.self_attn.q_rope",
        "layers.{i}.k_rope": "model.layers.{i}.self_attn.k_rope"}


def tiny_llama(folder, dtype=torch.float32, island="wide", bug_eps=None) -> TinyLlama:
    cfg, weights = load_weights(folder)
    model = TinyLlama(cfg, island, bug_eps)
    model.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in weights.items()})
    return model.to(dtype).eval()


def port(folder, dtype=torch.float32, island="wide", bug_eps=None, name="tiny torch llama") -> TorchModule:
    return TorchModule(tiny_llama(folder, dtype, island, bug_eps), TAPS, name)


class OwnTwin:
    """A hand-written port around a TorchModule whose float64() is its own (no checkpoint
    keyword): the working module cast, or `twin` when given."""

    def __init__(self, inner, twin=None):
        self.inner, self.twin = inner, twin
        self.name, self.taps = inner.name, inner.taps

    def capture(self, tokens, attention_mask, taps, inject=None):
        return self.inner.capture(tokens, attention_mask, taps, inject=inject)

    def float64(self):
        return self.twin if self.twin is not None else OwnTwin(self.inner.float64())


class ReturnedWide:
    """A "twin" that is a narrower model whose taps are handed back as float64 arrays."""

    def __init__(self, inner):
        self.inner, self.name, self.taps = inner, inner.name, inner.taps

    def capture(self, tokens, attention_mask, taps, inject=None):
        logits, acts = self.inner.capture(tokens, attention_mask, taps, inject=inject)
        return np.asarray(logits, np.float64), {t: np.asarray(a, np.float64) for t, a in acts.items()}


def ladder(cand, folder, policy="fp32"):
    return compare.compare_models("torchref", cand, folder, inputs=(IDS, MASK), policy=policy)


@pytest.fixture(scope="module")
def folder(tiny_dir):
    return tiny_dir("gqa")


# ----- the numbers' test itself --------------------------------------------------------------------

def test_tap_format_names_the_narrowest_format_that_holds_every_value():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4000)
    assert twins.tap_format(x) is None                                      # float64 arithmetic
    assert twins.tap_format(x.astype(np.float32).astype(np.float64)) == "float32"
    import ml_dtypes
    assert twins.tap_format(x.astype(ml_dtypes.bfloat16).astype(np.float64)) == "bfloat16"
    a, b = (rng.standard_normal(4000).astype(np.float32) for _ in range(2))
    assert twins.tap_format(a.astype(np.float64) * b.astype(np.float64)) == twins.PRODUCT   # f32 step x weight


# ----- (1) the torchtune mechanism: float32 norm and RoPE inside the float64 model -------------------

def test_twin_keeping_f32_steps_gets_keeps_f32_inferred_and_a_correct_model_is_drift(folder):
    report = ladder(port(folder, island="float32"), folder)
    t = report.twin
    assert t.status == twins.INFERRED and t.weights == twins.CHECKPOINT, t
    assert {k for k, f in t.narrow.items() if f == "float32"} == {f"layers.{i}.{n}" for i in (0, 1)
                                                                  for n in ("q_rope", "k_rope")}
    assert {k for k, f in t.narrow.items() if f == twins.PRODUCT} >= {"layers.0.attn_norm", "final_norm"}
    assert "keeps_f32 inferred" in t.note and "q_rope" in t.note
    assert report.verdict in ("exact", "drift") and report.semantic_rung == "run", report.summary()
    assert t.note in report.summary(), report.summary()       # the user reads it in the summary and the page
    from html import escape

    from compare.report.ladder import _notes
    assert any(escape(t.note) in n for n in _notes(report.to_dict(), "fp32")), report.to_dict()["twin"]


def test_without_the_check_the_f32_keeping_twin_is_a_false_semantic(folder, monkeypatch):
    """The mechanism is real on the tiny checkpoint: the same twin trusted as float64 (the
    check replaced by one that accepts everything) makes a correct model 'semantic'."""
    monkeypatch.setattr(engine, "check_side", lambda cand, *a: (twins.TwinCheck(twins.ACCEPTED), cand))
    report = ladder(port(folder, island="float32"), folder)
    assert report.verdict == "semantic", report.summary()


# ----- (2) the TorchModule.float64 mechanism: bf16-rounded weights cast to float64 -------------------

def test_torch_module_float64_reads_the_checkpoints_weights_when_it_knows_the_checkpoint(folder):
    p = port(folder, torch.bfloat16)
    _, weights = load_weights(folder)
    want = np.array(weights["model.layers.0.mlp.up_proj.weight"], np.float64)
    held = {name: p.float64(**kw).module.model.layers[0].mlp.up_proj.weight.detach().numpy()
            for name, kw in (("cast", {}), ("checkpoint", {"checkpoint": folder}))}
    assert np.array_equal(held["checkpoint"], want)
    assert not np.array_equal(held["cast"], want)            # the bf16 rounding, kept by a plain cast
    assert TorchModule(p.module, TAPS, checkpoint=folder).float64().module.lm_head.weight.dtype == torch.float64


def test_bf16_torch_module_through_the_ladder_gets_the_checkpoints_weights_and_is_drift(folder):
    report = ladder(port(folder, torch.bfloat16), folder, "bf16")
    assert report.twin.status == twins.ACCEPTED and report.twin.weights == twins.CHECKPOINT, report.twin
    assert report.twin.note == ""
    assert report.verdict in ("exact", "drift") and report.semantic_rung == "run", report.summary()


def test_twin_of_rounded_weights_is_found_named_and_refused(folder):
    report = ladder(OwnTwin(port(folder, torch.bfloat16)), folder, "bf16")
    t = report.twin
    assert t.status == twins.REFUSED and t.weights == "rounded to bfloat16", t
    assert "rounded to bfloat16" in t.note and "checkpoint's weights at float64" in t.note
    assert report.semantic_rung.startswith("not run") and "rounded to bfloat16" in report.summary()
    assert all(v.err_fp64 != v.err_fp64 for v in report.taps)      # no fp64 rung: judged by structure
    assert report.verdict in ("exact", "drift"), report.summary()


def test_without_the_check_the_rounded_weights_twin_is_a_false_semantic(folder, monkeypatch):
    monkeypatch.setattr(engine, "check_side", lambda cand, *a: (twins.TwinCheck(twins.ACCEPTED), cand))
    report = ladder(OwnTwin(port(folder, torch.bfloat16)), folder, "bf16")
    assert report.verdict == "semantic", report.summary()


# ----- (3) a true float64 twin: accepted as it is --------------------------------------------------

def test_true_float64_twin_is_accepted_unchanged_with_no_note(folder):
    report = ladder(port(folder), folder)
    t = report.twin
    assert (t.status, t.weights, t.narrow, t.note) == (twins.ACCEPTED, twins.CHECKPOINT, {}, ""), t
    assert t.wide == len(report.taps) - 1 and not t.declared_keeps_f32      # every tap but embed
    assert report.verdict in ("exact", "drift") and report.semantic_rung == "run", report.summary()
    assert report.to_dict()["twin"]["status"] == "accepted"


# ----- (4) a planted bug stays semantic with the checks in place ------------------------------------

@pytest.mark.parametrize("island", ["wide", "float32"])
def test_planted_epsilon_in_port_and_twin_is_still_semantic(folder, island):
    report = ladder(port(folder, island=island, bug_eps=1e-2), folder)
    d = report.first_divergence
    assert report.verdict == "semantic" and (d.tap, d.layer) == ("layers.1.mlp_norm", 1), report.summary()
    assert report.twin.status == (twins.ACCEPTED if island == "wide" else twins.INFERRED), report.twin


# ----- (5) a twin that is not float64 at all: refused with the reason ------------------------------

def test_bf16_twin_returned_as_float64_is_refused_with_the_reason(folder):
    """The port at fp32; its "float64()" is the bf16 model with its taps widened on return:
    every tap bfloat16-exact (and its weights the checkpoint's rounded)."""
    fp32 = port(folder)
    narrow = ReturnedWide(TorchModule(tiny_llama(folder, torch.bfloat16), TAPS, fp32.name))
    report = ladder(OwnTwin(fp32, twin=narrow), folder)
    t = report.twin
    assert t.status == twins.REFUSED and t.wide == 0, t
    assert set(t.narrow.values()) == {"bfloat16"} and len(t.narrow) == len(report.taps) - 1
    assert "not float64 arithmetic" in t.note and "bfloat16" in t.note
    assert report.semantic_rung.startswith("not run") and "not float64 arithmetic" in report.summary()
    assert report.verdict in ("exact", "drift"), report.summary()


def test_twin_with_float32_taps_only_is_refused_even_when_it_declares_keeps_f32(folder):
    fp32 = port(folder)
    fp32.keeps_f32 = True
    report = ladder(OwnTwin(fp32, twin=ReturnedWide(port(folder))), folder)
    assert report.twin.status == twins.REFUSED and set(report.twin.narrow.values()) == {"float32"}, report.twin
    assert report.verdict in ("exact", "drift"), report.summary()


def test_check_twin_without_an_embed_tap_says_the_weights_were_not_checked():
    rng = np.random.default_rng(0)
    real = np.ones((2, 40), bool)
    c64 = {"layers.0.out": rng.standard_normal((2, 40, 32))}
    t = twins.check_twin("p", c64, {"embed": rng.standard_normal((2, 40, 32)), **c64}, list(c64), real, False)
    assert (t.status, t.weights) == (twins.ACCEPTED, twins.UNCHECKED) and "not checked" in t.note


def test_applied_side():
    side = compare.adapters.Side("p", object(), object(), False, ())
    assert twins.applied(side, twins.TwinCheck(twins.REFUSED)).at_fp64 is None
    assert twins.applied(side, twins.TwinCheck(twins.INFERRED)).keeps_f32 is True
    assert twins.applied(side, twins.TwinCheck(twins.ACCEPTED)) == dataclasses.replace(side)


def test_a_16_bit_rounding_step_inside_a_float64_twin_is_the_ports_own_and_accepted():
    """A bf16 q_proj kept in the twin (as a quantization is: compare.controls' hf_q_proj_bf16)
    is a step the dtype-noise rule judges, not a reason to refuse the twin or infer keeps_f32."""
    import ml_dtypes
    rng = np.random.default_rng(0)
    real = np.ones((2, 40), bool)
    c64 = {t: rng.standard_normal((2, 40, 32)) for t in ("embed", "layers.0.attn_norm", "layers.0.q", "layers.0.out")}
    c64["layers.0.q"] = c64["layers.0.q"].astype(ml_dtypes.bfloat16).astype(np.float64)
    t = twins.check_twin("p", c64, dict(c64), list(c64), real, False)
    assert (t.status, t.narrow, t.wide) == (twins.ACCEPTED, {"layers.0.q": "bfloat16"}, 2), t
    assert "16-bit rounding" in t.note and "layers.0.q" in t.note
    c64["layers.0.attn_norm"] = c64["layers.0.attn_norm"].astype(np.float32).astype(np.float64)
    t = twins.check_twin("p", c64, dict(c64), list(c64), real, False)
    assert t.status == twins.INFERRED and "layers.0.attn_norm" in t.note and "16-bit" in t.note, t


def test_embedding_rounded_below_the_policys_weights_is_the_ports_own_rounding_not_a_refusal():
    """Rounded to the policy's weight dtype: the policy's rounding, refused. Rounded to a narrower
    dtype than the policy's (a port that stores bf16 weights at fp32): its own step, kept."""
    import ml_dtypes
    rng = np.random.default_rng(0)
    real = np.ones((2, 40), bool)
    oracle = {t: rng.standard_normal((2, 40, 32)) for t in ("embed", "layers.0.out")}
    c64 = {**oracle, "embed": oracle["embed"].astype(ml_dtypes.bfloat16).astype(np.float64)}
    own = twins.check_twin("p", c64, oracle, list(c64), real, False, "float32")
    policys = twins.check_twin("p", c64, oracle, list(c64), real, False, "bfloat16")
    assert (own.status, own.weights) == (twins.ACCEPTED, "rounded to bfloat16") and "own rounding" in own.note
    assert policys.status == twins.REFUSED and policys.refused_for == (twins.WEIGHTS,), policys


# ----- the decode comparison checks the twin too -----------------------------------------------

class _DecodingPort:
    """A user's port with the decode protocol (torchref underneath, reached through its public
    calls only); float64() is the port's twin: `rounded` builds it from the working precision's
    rounded weights (the mistake), else from the checkpoint's weights at float64."""

    def __init__(self, impl, rounded: bool):
        self.impl, self.rounded = impl, rounded
        self.name, self.taps, self.cfg = "decoding port", impl.taps, impl.cfg

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        return self.impl.capture(tokens, attention_mask, taps, inject)

    def prefill_capture(self, ids, mask, total_len, taps, inject=None):
        return self.impl.prefill_capture(ids, mask, total_len, taps, inject)

    def decode_capture(self, cache, next_ids, taps, inject=None):
        return self.impl.decode_capture(cache, next_ids, taps, inject)

    def prefill(self, ids, mask, total_len, inject=None):
        return self.impl.prefill(ids, mask, total_len, inject)

    def decode(self, cache, next_ids):
        return self.impl.decode(cache, next_ids)

    def float64(self):
        return _DecodingPort(self.impl.float64(rounded_weights=self.rounded), self.rounded)


def _decoding_port(folder, rounded: bool):
    from compare.adapters import OurModel
    return _DecodingPort(OurModel.load("torchref", folder, "bf16"), rounded)


def test_decode_comparison_refuses_a_twin_of_rounded_weights_and_accepts_a_true_one(folder):
    """compare_decode judges each step against the candidate's float64 decode: a twin whose
    weights are the policy's bf16 rounding would make every step's fp64 rung a difference in the
    math; it is found and refused with the reason (a PortError: the decode comparison has no rung
    without it), as the prefill ladder refuses it. The same port with a true twin is accepted."""
    ids = IDS[:, :12]
    inputs = (ids, np.ones_like(ids))
    with pytest.raises(PortError, match="weights rounded to bfloat16"):
        compare.compare_decode("torchref", _decoding_port(folder, rounded=True), folder, inputs=inputs, steps=2,
                               policy="bf16")
    report = compare.compare_decode("torchref", _decoding_port(folder, rounded=False), folder, inputs=inputs, steps=2,
                                    policy="bf16")
    assert report.twin is not None and not report.twin.refused and report.twin.weights == twins.CHECKPOINT
    assert report.verdict in ("exact", "drift"), report.summary()


def test_without_the_check_the_rounded_twin_makes_a_correct_decode_semantic(folder, monkeypatch):
    """The mechanism is real: the same rounded twin trusted as the semantic rung calls a correct
    bf16 decode semantic."""
    from compare.ladder import decode
    monkeypatch.setattr(decode, "check_side", lambda cand, *a: (twins.TwinCheck(twins.ACCEPTED), cand))
    ids = IDS[:, :12]
    report = compare.compare_decode("torchref", _decoding_port(folder, rounded=True), folder,
                                    inputs=(ids, np.ones_like(ids)), steps=2, policy="bf16")
    assert report.verdict == "semantic"
