"""compare.adapters.generic.TorchModule never loses what it was given, and maps what users' ports
do: a module that runs more than once per layer (by its call index, "#n"), a forward that cannot
take the padding mask or the positions (refused, or a warning when nothing is lost), and the
module's own config for the config check and `probe where`.

Real parts: transformers' LlamaForCausalLM on a tiny random checkpoint, wrapped the ways real
ports are built (a forward over tokens alone, one module shared by every layer's q and k).
"""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import compare  # noqa: E402
from compare.adapters import HF_LLAMA_TAPS, TorchModule  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from llamaspec.testing import TINY_CONFIGS, make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("inputs"), **TINY_CONFIGS["gqa"])


def hf(folder):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                         attn_implementation="eager").eval()


class Shared(torch.nn.Module):
    """One module object every layer's q_proj and k_proj end in (as torchtune's one RoPE module
    is every attention's pos_embeddings): it runs twice per layer, for q, then for k."""

    def forward(self, x):
        return x * 1.0


def with_shared(model):
    shared = Shared()
    for layer in model.model.layers:
        layer.self_attn.q_proj = torch.nn.Sequential(layer.self_attn.q_proj, shared)
        layer.self_attn.k_proj = torch.nn.Sequential(layer.self_attn.k_proj, shared)
    return model


def ids_mask(B=2, T=9, pad=None):
    ids = np.random.default_rng(0).integers(3, 96, (B, T))
    mask = np.ones((B, T), np.int64)
    if pad == "right":
        mask[1, T - 3:] = 0
    elif pad == "left":
        mask[1, :3] = 0
    return ids, mask


def test_a_module_called_twice_per_layer_is_mapped_by_its_call_index(folder):
    plain = TorchModule(hf(folder), HF_LLAMA_TAPS, name="plain")
    taps = {**HF_LLAMA_TAPS, "layers.{i}.q": "model.layers.{i}.self_attn.q_proj.1#0",
            "layers.{i}.k": "model.layers.{i}.self_attn.k_proj.1#1"}
    shared = TorchModule(with_shared(hf(folder)), taps, name="shared")
    ids, mask = ids_mask(pad="right")
    want = ("layers.*.q", "layers.*.k", "layers.*.out")
    _, a = plain.capture(ids, mask, want)
    _, b = shared.capture(ids, mask, want)
    assert set(a) == set(b) and len(a) == 3 * plain.num_layers
    for tap in a:
        np.testing.assert_array_equal(a[tap], b[tap], err_msg=tap)
    # the other call index names the other call: q's map then reads k's values, in layer 1's own
    swapped = TorchModule(with_shared(hf(folder)), {**taps, "layers.{i}.q": "model.layers.{i}.self_attn.q_proj.1#1"})
    _, c = swapped.capture(ids, mask, ("layers.1.q",))
    np.testing.assert_array_equal(c["layers.1.q"], a["layers.1.k"])


def test_call_index_errors_name_the_fix(folder):
    model = with_shared(hf(folder))
    twice = TorchModule(model, {**HF_LLAMA_TAPS, "layers.{i}.q": "model.layers.{i}.self_attn.q_proj.1"})
    with pytest.raises(RuntimeError, match=r"fired 4 times.*'#n'"):     # 2 layers x (q and k)
        twice.capture(*ids_mask(), ("layers.0.q",))
    beyond = TorchModule(model, {**HF_LLAMA_TAPS, "layers.{i}.q": "model.layers.{i}.self_attn.q_proj.1#2"})
    with pytest.raises(RuntimeError, match=r"taps not produced: 'layers.0.q'"):
        beyond.capture(*ids_mask(), ("layers.0.q",))
    with pytest.raises(ValueError, match="inject_map"):
        TorchModule(model, {"layers.{i}.q": "model.layers.{i}.self_attn.q_proj.1#0"}, num_layers=2)
    with pytest.raises(ValueError, match="call index"):
        TorchModule(model, {**HF_LLAMA_TAPS, "layers.{i}.q": "model.layers.{i}.self_attn.q_proj.1#first"})


def test_call_indexed_port_compared_with_torchref(folder):
    """The ladder on a port mapped by call index, teacher forcing included: drift."""
    taps = {**HF_LLAMA_TAPS, "layers.{i}.q": "model.layers.{i}.self_attn.q_proj.1#0",
            "layers.{i}.k": "model.layers.{i}.self_attn.k_proj.1#1"}
    port = TorchModule(with_shared(hf(folder)), taps, name="shared", keeps_f32=True, checkpoint=folder)
    report = compare.compare_models("torchref", port, folder, inputs=ids_mask(pad="right"), policy="fp32")
    assert report.verdict in ("exact", "drift"), report.summary()
    assert report.teacher_forcing == "run"


class TokensOnly(torch.nn.Module):
    """A port whose forward takes the tokens alone (litgpt's, torchtune's without its mask)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, tokens):
        return self.inner(input_ids=tokens).logits


class NoPositions(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask).logits


def test_default_forward_never_drops_the_mask_or_positions(folder):
    taps = {t: "pre:inner." + p[4:] if p.startswith("pre:") else "inner." + p for t, p in HF_LLAMA_TAPS.items()}
    port = TorchModule(TokensOnly(hf(folder)), taps, name="tokens-only")
    with pytest.raises(ValueError, match=r"takes no input_ids.*padding mask and positions.*forward="):
        port.capture(*ids_mask(pad="right"), ("layers.0.out",))
    with pytest.warns(UserWarning, match=r"called as module\(ids\) without the attention mask"):
        logits, _ = port.capture(*ids_mask(), ("layers.0.out",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # once per module, not at every capture
        again, _ = port.capture(*ids_mask(), ("layers.0.out",))
    np.testing.assert_array_equal(logits, again)

    no_pos = TorchModule(NoPositions(hf(folder)), taps, name="no-positions", num_layers=2)
    with pytest.raises(ValueError, match=r"no position_ids.*not 0..T-1"):
        no_pos.capture(*ids_mask(pad="left"), ("layers.0.out",))
    right, _ = no_pos.capture(*ids_mask(pad="right"), ("layers.0.out",))   # positions 0..n-1: nothing lost
    full = TorchModule(hf(folder), HF_LLAMA_TAPS)
    want, _ = full.capture(*ids_mask(pad="right"), ("layers.0.out",))
    real = ids_mask(pad="right")[1].astype(bool)
    np.testing.assert_array_equal(right[real], want[real])


def test_config_is_the_modules_own_and_probe_where_takes_it(folder):
    model = hf(folder)
    port = TorchModule(model, HF_LLAMA_TAPS, name="hf via paths", keeps_f32=True, checkpoint=folder)
    assert port.config is model.config and port.float64().config.hidden_size == model.config.hidden_size
    bare = TorchModule(TokensOnly(model), {"layers.{i}.out": "inner.model.layers.{i}"}, num_layers=2)
    assert bare.config is model.config          # the wrapper's own config attribute
    stated = TorchModule(torch.nn.Sequential(model), {"layers.{i}.out": "0.model.layers.{i}"}, config=model.config)
    assert stated.config is model.config
    assert TorchModule(torch.nn.Sequential(model), {"layers.{i}.out": "0.model.layers.{i}"}).config is None
    from compare.probes.where import probe_where
    result = probe_where(port, "batch", checkpoint=folder, policy="fp32", length=10)
    assert result.comparisons and result.verdict != "semantic", result.verdict
