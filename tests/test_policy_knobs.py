"""The precision-policy knobs weight_fp8, act_fp8, kv_cache and per-layer overrides
(llamaspec.policy): their spelling and errors, what torchref computes under them (checked against
llamaspec.quant's numpy definition and against plain models teacher-forced at the same layer), and
the ladder's word on a port that rounds its KV cache (compare.judge.storage, the fp8 controls).
jaxmodel's side, bit for bit with torchref: tests/test_policy_knobs_jax.py."""

import numpy as np
import pytest

import torchref
from compare.controls import CONTROLS, Control, check, run_control
from compare.controls.prefill import kv_fp8_port, up_proj_fp8_port
from llamaspec import Policy, quant
from llamaspec.errors import PolicyError
from llamaspec.testing import make_checkpoint

IDS = np.random.default_rng(1).integers(3, 96, (2, 24))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("knobs"), num_hidden_layers=3, head_dim=32)


def _ref(folder, policy):
    return torchref.from_pretrained(folder, policy, backend="reference")


# ----- spelling and errors ------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["bf16+weight_fp8=e4m3:block128", "fp32+act_fp8=e5m2:channel",
                                  "bf16+kv_cache=e4m3:channel:bfloat16", "bf16+kv_cache=float16",
                                  "bf16+layers[0:2]=fp32+layers[-1]=fp16+weight_fp8=e4m3:channel",
                                  "bf16+softmax_dtype=float32+norm_cast_before_weight=false"])
def test_a_policy_string_is_its_name_and_reads_back(text):
    p = Policy.get(text)
    assert Policy.get(p.name) == p
    assert Policy.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("text, words", [
    ("bf16+colour=red", ["unknown knob 'colour'"]),
    ("bf17+kv_cache=e4m3:channel", ["unknown precision policy 'bf17'"]),
    ("bf16+kv_cache=e4m3:tensor", ["kv_cache", "granularity 'tensor'"]),
    ("bf16+act_fp8=e4m3:block128", ["act_fp8", "granularity 'block'"]),
    ("bf16+weight_fp8=e3m4:tensor", ["weight_fp8", "e3m4"]),
    ("bf16+kv_cache=int8", ["kv_cache", "int8"]),
    ("bf16+layers[a]=fp32", ["layers[a]"]),
    ("bf16+layers[0]=bf16+layers[0]", ["'layers[0]' is not KNOB=VALUE"]),
    ("bf16+layers[0]=fp33", ["fp33"]),
])
def test_a_bad_policy_string_names_the_knob(text, words):
    with pytest.raises(PolicyError) as e:
        Policy.get(text)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("text, words", [("bf16+layers[3]=fp32", ["layers[3]", "[-3, 3)"]),
                                         ("bf16+layers[5:]=fp32", ["layers[5:] names none"]),
                                         ("bf16+layers[0:2]=fp32+layers[1]=fp16", ["layer 1", "layers[0:2]"])])
def test_layer_selectors_are_checked_against_the_model(folder, text, words):
    with pytest.raises(PolicyError) as e:
        _ref(folder, text)
    for w in words:
        assert w in str(e.value)


def test_the_fast_backend_declines_and_the_plan_says_so(folder):
    m = torchref.from_pretrained(folder, "bf16+kv_cache=e4m3:channel")
    assert m.plan.backend == "fast"
    assert all(what.startswith("reference (the fast backend declines kv_cache") for _, what in m.plan.ops)
    with pytest.raises(PolicyError, match="invariant backend does not take weight_fp8"):
        torchref.from_pretrained(folder, "bf16+weight_fp8=e4m3:channel", backend="invariant")


# ----- what torchref computes -------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["e4m3:block16", "e5m2:channel:bfloat16", "e4m3:tensor"])
def test_quantized_weights_are_llamaspec_quant_of_the_rounded_checkpoint(folder, spec):
    from llamaspec import load_weights
    from llamaspec.checkpoint import numpy_dtype
    _, w = load_weights(folder)
    m = _ref(folder, f"bf16+weight_fp8={spec}")
    got = m.quantized()
    assert len(got) == 7 * 3                      # seven projections, three layers; nothing else
    for key, (q, s) in got.items():
        q0, s0 = quant.quantize(w[key].astype(numpy_dtype("bfloat16")), spec)
        assert q.view(np.uint8).tobytes() == q0.view(np.uint8).tobytes(), key
        assert np.array_equal(s.view(np.uint8), s0.view(np.uint8)), key
        kept = m.model.get_parameter(key.removeprefix("model."))      # dequantized in f32, once
        assert np.array_equal(kept.numpy(), quant.dequantize(q0, s0, spec, "float32")), key


def test_the_float64_twin_keeps_the_fp8_values_and_scales(folder):
    from compare.adapters import OurModel
    m = _ref(folder, "bf16+weight_fp8=e4m3:block16")
    twin = OurModel(m, folder).float64()
    assert twin.model.policy.compute_dtype == "float64" and twin.model.policy.weight_fp8 == "e4m3:block16"
    for key, (q, s) in m.quantized().items():
        q2, s2 = twin.model.quantized()[key]
        assert q.view(np.uint8).tobytes() == q2.view(np.uint8).tobytes() and np.array_equal(s, s2)
        exact = twin.model.model.get_parameter(key.removeprefix("model.")).numpy()
        assert exact.dtype == np.float64
        assert np.array_equal(exact, quant.dequantize(q, s, "e4m3:block16", "float64"))


def test_the_kv_cache_holds_the_keys_and_values_rounded_as_llamaspec_quant_says(folder):
    spec = "e4m3:channel"
    m = _ref(folder, f"bf16+kv_cache={spec}")
    T = IDS.shape[1]
    _, cache, acts = m.prefill_capture(IDS, np.ones_like(IDS), T + 2, taps=["layers.*.k_rope", "layers.*.v"])
    for i in range(3):
        for name, kind in (("k", "k_rope"), ("v", "v")):
            x = acts[f"layers.{i}.{kind}"]                                      # [B, T, Hkv, D], bf16
            want = quant.dequantize(*quant.quantize(x.reshape(-1, x.shape[-1]), spec), spec, "bfloat16")
            got = torchref.dtypes.to_numpy(cache[name][i][:, :, :T].transpose(1, 2))
            assert got.reshape(want.shape).view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


def test_activations_enter_the_product_quantized_per_token(folder):
    """fp32 + act_fp8: layer 0's q is the f32 product of the quantized attn_norm output with the
    weight, up to f32 sums (1e-6), and far from the unquantized product (fp8's ~1e-2)."""
    spec = "e4m3:channel"
    m = _ref(folder, f"fp32+act_fp8={spec}")
    _, acts = m.capture(IDS, taps=["layers.0.attn_norm", "layers.0.q"])
    x = acts["layers.0.attn_norm"].reshape(-1, acts["layers.0.attn_norm"].shape[-1])
    w = m.model.get_parameter("layers.0.self_attn.q_proj.weight").numpy().astype(np.float64)
    xq = quant.dequantize(*quant.quantize(x, spec), spec, "float64")
    q = acts["layers.0.q"].reshape(len(x), -1).astype(np.float64)
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    assert rel(q, xq @ w.T) < 1e-6
    assert rel(q, x.astype(np.float64) @ w.T) > 1e-3


def test_a_layer_override_takes_effect_at_its_layer_only(folder):
    """bf16 with layer 1 in fp32: layers 0 and 2 compute bitwise as the bf16 model fed the same
    input, layer 1 as the fp32 model fed the same input (teacher forcing: capture's inject)."""
    taps = ["embed", "layers.*.attn_norm", "layers.*.q_rope", "layers.*.attn_ctx", "layers.*.act", "layers.*.out",
            "final_norm", "logits"]
    mixed = _ref(folder, "bf16+layers[1]=fp32")
    bf16, fp32 = _ref(folder, "bf16"), _ref(folder, "fp32")
    logits, acts = mixed.capture(IDS, taps=taps)
    _, a_bf16 = bf16.capture(IDS, taps=taps, inject={2: acts["layers.1.out"]})
    _, a_fp32 = fp32.capture(IDS, taps=taps, inject={1: acts["layers.0.out"]})
    for name, got in acts.items():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        want = (a_fp32 if layer == 1 else a_bf16)[name]
        assert got.dtype == want.dtype, name
        assert np.array_equal(got, want), name
    assert acts["layers.1.out"].dtype == np.float32 and acts["layers.2.out"].dtype.name == "bfloat16"


def _decode_vs_full(m) -> list[float]:
    """max |difference| / max |logit| of the prefill's last logits and one decode step's against
    the full forward's at the same positions."""
    full, _ = m.capture(IDS, taps=())
    T = IDS.shape[1] - 1
    first, cache = m.prefill(IDS[:, :T], np.ones((2, T), int), T + 1)
    step, _ = m.decode(cache, IDS[:, T])
    return [float(np.abs(got - want).max() / np.abs(want).max())
            for got, want in ((first, full[:, T - 1]), (step, full[:, T]))]


@pytest.mark.parametrize("policy", ["bf16+weight_fp8=e4m3:block16", "fp32+act_fp8=e4m3:channel",
                                    "bf16+kv_cache=e5m2:channel", "bf16+layers[1]=fp32+kv_cache=float16"])
def test_prefill_and_decode_give_the_full_forward(folder, policy):
    """The same values up to the rounding of products of other shapes (f32 logits: ~1e-7)."""
    assert max(_decode_vs_full(_ref(folder, policy))) < 1e-5


def test_a_per_call_activation_scale_makes_a_decode_step_differ(folder):
    """act_fp8 "tensor": one scale per call, so a decode step (one token a row) quantizes its
    activations with another scale than the full forward (all tokens): an fp8-sized difference,
    the circumstance per-tensor dynamic scaling brings (per token, "channel", has none: above)."""
    _, step = _decode_vs_full(_ref(folder, "fp32+act_fp8=e4m3:tensor"))
    assert step > 1e-4


# ----- the ladder on ports that round their KV cache or weights ---------------------------------------

FP8_CONTROLS = ["kv_cache_fp8_at_policy", "kv_cache_fp8_hardcoded", "kv_cache_fp8_wrong_scale", "up_proj_fp8_hardcoded",
                "up_proj_fp8_wrong_scale"]


@pytest.mark.parametrize("name", FP8_CONTROLS)
def test_fp8_kv_cache_controls(name, folder):
    report = run_control(CONTROLS[name], folder, IDS)
    assert check(CONTROLS[name], report) == [], report.summary()
    assert report.first_divergence.confirmed, report.first_divergence.evidence


def test_a_port_whose_fp8_cache_is_the_policys_own_is_not_a_finding(folder):
    control = Control("kv_fp8_as_declared", "torchref", "bf16+kv_cache=e4m3:channel", "drift", None, None, (),
                      kv_fp8_port("e4m3"), "one layer's KV cache hard-coded to fp8 e4m3, as the policy says")
    report = run_control(control, folder, IDS)
    assert check(control, report) == [], report.summary()
    assert report.verdict == "exact"                # the same rounding, bit for bit, at the policy


@pytest.mark.parametrize("fmt, rolled, expected", [("e5m2", 0, "precision"), ("e4m3", -1, "semantic")])
def test_other_fp8_caches(folder, fmt, rolled, expected):
    """e5m2 is recognised as e4m3 is; a scale of the previous kv head is a bug as the next one's is."""
    control = Control(f"kv_{fmt}_{rolled}", "torchref", "bf16", expected, "layers.{L}.attn_ctx", "attn",
                      ("float8_e5m2",) if expected == "precision" else (), kv_fp8_port(fmt, rolled), "")
    report = run_control(control, folder, IDS)
    assert check(control, report) == [], report.summary()


# ----- the probes under a per-call activation scale --------------------------------------------------

def test_the_batch_probe_names_a_per_call_activation_scale(folder):
    """A row alone vs in a batch: per-call fp8 activation scales change its rounding (never a bug), and
    the hint says why; per-token scales add nothing that depends on the batch: where the plain fp32
    reference is bitwise alone and batched on this CPU, so are they (its torch products are the
    BLAS's, which under the avx2 cap of an AMX Xeon split by the batch's size: drift both)."""
    from compare.probes import probe_batch
    per_call = probe_batch(_ref(folder, "fp32+act_fp8=e4m3:tensor"), batch_sizes=(2, 4), length=16)
    per_token = probe_batch(_ref(folder, "fp32+act_fp8=e4m3:channel"), batch_sizes=(2, 4), length=16)
    plain = probe_batch(_ref(folder, "fp32"), batch_sizes=(2, 4), length=16)
    assert per_call.verdict in ("drift", "precision") and per_call.bitwise_equal_frac < 1, per_call.hint
    assert "scales fp8 activations per call (e4m3:tensor)" in per_call.hint
    assert per_token.verdict in ("exact", "drift") and "per call" not in per_token.hint, per_token.hint
    if plain.verdict == "exact":
        assert per_token.verdict == "exact", per_token.hint


def test_a_port_with_fp8_weights_in_blocks_is_named_with_its_blocks(tmp_path):
    """On weights larger than a block (256 x 128 up_proj), per 128 x 128 block is told from per
    tensor and per channel: the hint names the scheme the port uses."""
    big = make_checkpoint(tmp_path / "big", num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                          num_attention_heads=4, num_key_value_heads=2)
    for spec, words in (("e4m3:block128", "float8_e4m3fn per 128 x 128 block"),
                        ("e5m2:channel", "float8_e5m2 per output channel")):
        control = Control(f"up_{spec}", "torchref", "bf16", "precision", "layers.{L}.up", "mlp", (words,),
                          up_proj_fp8_port(spec), "")
        report = run_control(control, big, IDS)
        assert check(control, report) == [], report.summary()
