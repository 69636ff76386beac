"""The ladder knows the family slips (issue 62): each planted slip of Llama's relatives
(compare/controls/families.py) is found as semantic at its tap, layer and component, confirmed
by teacher forcing, with a hint that names it; the hints are the judge's, read from the taps and
the reference's config, so they hold on another checkpoint, another prompt with padding, and at
bf16. Clean runs of every family stay exact or drift at fp32 and bf16, with no finding named.
The judge's attention recomputation (conventions.attention64) is checked against torchref's own
soft-cap and sliding window, and the family tests against plain arrays."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from compare.controls import check, findings_after, run_control
from compare.controls.families import FAMILY_CONTROLS, FAMILY_OF, clean_family, family_checkpoint
from compare.judge import family
from compare.judge.conventions import attention64, explain_attention
from compare.judge.structure import Finding
from llamaspec.testing import TINY_FAMILIES

SHORT = np.random.default_rng(0).integers(3, 96, (2, 48))


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made = {}

    def get(name, seed=0):
        if (name, seed) not in made:
            made[name, seed] = family_checkpoint(tmp_path_factory.mktemp(f"fam_{name}_{seed}"), name, seed=seed)
        return made[name, seed]
    return get


def padded(seed=7, B=3, T=40):
    """Another prompt: row 0 left-padded, row 1 right-padded, row 2 full."""
    ids = np.random.default_rng(seed).integers(3, 96, (B, T))
    mask = np.ones_like(ids)
    mask[0, :6], mask[1, T - 9:] = 0, 0
    return ids, mask


@pytest.mark.parametrize("name", list(FAMILY_CONTROLS))
def test_family_slip_found_at_its_tap_with_a_hint_naming_it(name, family_dir):
    control = FAMILY_CONTROLS[name]
    report = run_control(control, family_dir(FAMILY_OF[name]), SHORT)
    assert check(control, report) == [], report.summary()
    assert report.first_divergence.confirmed, report.first_divergence.evidence
    assert findings_after(report) == [], report.summary()
    report.to_dict()


@pytest.mark.parametrize("name", list(FAMILY_CONTROLS))
def test_family_slip_hint_holds_on_another_checkpoint_and_padded_prompt(name, family_dir):
    """Another random checkpoint of the family, another prompt with left and right padding."""
    control = FAMILY_CONTROLS[name]
    report = run_control(control, family_dir(FAMILY_OF[name], seed=3), *padded())
    assert check(control, report) == [], report.summary()


@pytest.mark.parametrize("name", ["gemma2_norm_offset_missing", "gemma2_embed_scale_twice",
                                  "gemma2_attn_softcap_wrong", "gemma2_final_softcap_missing",
                                  "mistral_window_off_by_one", "olmo2_qk_norm_per_head", "qwen2_o_proj_bias"])
def test_family_slip_found_under_bf16(name, family_dir):
    """The fp64 rung finds the slip whatever the policy rounds; the hint is the same."""
    control = dataclasses.replace(FAMILY_CONTROLS[name], policy="bf16")
    report = run_control(control, family_dir(FAMILY_OF[name]), SHORT, teacher_forcing=False)
    assert check(control, report) == [], report.summary()


def _clean_params():
    for where in ("torchref", "transformers", "jaxmodel"):
        marks = [pytest.mark.slow] if where == "jaxmodel" else []      # a jax compile per family and policy
        if where == "transformers":
            marks.append(pytest.mark.filterwarnings("ignore::UserWarning"))
        for name in TINY_FAMILIES:
            for policy in ("fp32", "bf16"):
                yield pytest.param(where, name, policy, marks=marks, id=f"{where}-{name}-{policy}")


@pytest.mark.parametrize("where,name,policy", list(_clean_params()))
def test_clean_family_is_exact_or_drift_with_no_finding(where, name, policy, family_dir):
    if where == "transformers":
        pytest.importorskip("transformers")
    control = clean_family(name, policy, where)
    report = run_control(control, family_dir(name), SHORT, teacher_forcing=False)
    assert check(control, report) == [] and report.verdict in ("exact", "drift"), report.summary()
    assert [v.tap for v in report.taps if v.record is not None and v.record.findings] == []
    rated = [v.precision_ratio for v in report.taps if v.precision_ratio == v.precision_ratio]
    assert max(rated, default=0) < 1


# ----- the judge's recomputation of attention against torchref's own ---------------------------

@pytest.mark.parametrize("softcap,window", [(None, None), (1.5, None), (None, 4), (2.0, 3)])
def test_attention64_is_torchrefs_attention_with_softcap_and_window(softcap, window):
    """conventions.attention64 (the judge's float64 attention, counting a window in real keys)
    equals torchref.ops.attention over torchref's causal mask and sliding window, padding included."""
    torch = pytest.importorskip("torch")
    from llamaspec import Policy
    from torchref import ops
    from torchref.model import causal_allowed, sliding_allowed
    rng = np.random.default_rng(1)
    B, T, Hq, Hkv, D = 3, 12, 4, 2, 8
    q, k, v = (rng.standard_normal((B, T, h, D)) for h in (Hq, Hkv, Hkv))
    mask = np.ones((B, T), np.int64)
    mask[0, :3], mask[1, 9:] = 0, 0
    allowed = causal_allowed(torch.from_numpy(mask), T)
    if window is not None:
        allowed = sliding_allowed(allowed, window)
    theirs = ops.attention(*(torch.from_numpy(x) for x in (q, k, v)), allowed, Policy.get("fp64"), scale=0.3,
                           softcap=softcap).reshape(B, T, -1).numpy()
    mine = attention64(q, k, v, mask, scale=0.3, softcap=softcap, window=window)
    real = mask.astype(bool)
    np.testing.assert_allclose(mine[real], theirs[real], rtol=1e-12, atol=1e-12)


def _qkv(seed=2, B=2, T=16, Hq=4, Hkv=2, D=8):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, T, h, D)) for h in (Hq, Hkv, Hkv)]


def test_attention_conventions_name_the_window_and_cap_against_the_layers_own():
    q, k, v = _qkv()
    own = {"scale": 0.3, "softcap": 1.5, "window": 5, "windows": (5,)}
    cases = {(None, 5): ("softcap", "softcap", None), (2.5, 5): ("softcap", "softcap", 2.5),
             (1.5, 6): ("window", "window", 6), (1.5, 4): ("window", "window", 4),
             (1.5, None): ("window", "window", None)}
    for (cap, window), (convention, key, value) in cases.items():
        cand = attention64(q, k, v, scale=0.3, softcap=cap, window=window)
        f = explain_attention(cand, q, k, v, conventions=own)
        got = f.data[key]
        assert f.data["convention"] == convention and (got is None if value is None else
                                                       got == pytest.approx(value, rel=1e-6)), f
    on_global = attention64(q, k, v, scale=0.3, window=5)
    f = explain_attention(on_global, q, k, v, conventions={"scale": 0.3, "window": None, "windows": (5,)})
    assert (f.data["convention"], f.data["window"], f.data["ref_window"]) == ("window", 5, None)
    # the layer's own conventions explain nothing: no finding
    assert explain_attention(attention64(q, k, v, scale=0.3, softcap=1.5, window=5), q, k, v, conventions=own) is None


# ----- the family tests on plain arrays: they name what is there, and nothing in rounding ------

def _rms(x, axes, eps=1e-6):
    return x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)


def test_norm_axis_and_skipped_from_the_inputs():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 10, 4, 8)) * rng.uniform(0.2, 3.0, (1, 1, 4, 1))   # heads of other sizes
    w = 1 + 0.2 * rng.standard_normal((4, 8))
    per_head, whole = _rms(x, (-1,)) * w, _rms(x, (-2, -1)) * w
    f = family.norm_axis(whole, per_head, x, x, 1e-6, step="q_norm")
    assert (f.kind, f.data["cand"], f.data["ref"]) == ("norm_axis", "projection", "head")
    f = family.norm_axis(per_head, whole, x, x, 1e-6, step="k_norm")
    assert (f.data["cand"], f.data["ref"]) == ("head", "projection")
    assert family.norm_axis(per_head * (1 + 1e-3), per_head, x, x, 1e-6) is None   # not the other axis
    assert family.norm_skipped(x, per_head, x, x, step="q_norm").kind == "norm_skipped"
    noisy = per_head * (1 + 1e-7 * rng.standard_normal(per_head.shape))           # rounding: not a slip
    assert family.norm_skipped(noisy, per_head, x, x) is None and family.norm_axis(noisy, per_head, x, x, 1e-6) is None


def test_soft_cap_missing_other_or_added_and_not_in_rounding():
    z = 6 * np.random.default_rng(4).standard_normal((2, 5, 50))
    capped = 2.0 * np.tanh(z / 2.0)
    assert family.soft_cap(z, capped, 2.0).data["cap"] is None
    assert family.soft_cap(3.0 * np.tanh(z / 3.0), capped, 2.0).data["cap"] == pytest.approx(3.0, rel=1e-6)
    assert family.soft_cap(capped, z, None).data["cap"] == pytest.approx(2.0, rel=1e-6)
    unsaid = family.soft_cap(z, capped, None)                 # a config that does not say the reference caps
    assert unsaid.data["cap"] is None and unsaid.data["ref_cap"] == pytest.approx(2.0, rel=1e-6)
    assert family.soft_cap(capped * (1 + 1e-7 * np.sign(z)), capped, 2.0) is None
    assert family.soft_cap(z + 0.3, z, None) is None            # a shift is no cap


def test_embedding_scale_only_for_powers_of_sqrt_hidden():
    def scale(factor):
        return Finding("global_scale", 1.0, 1.0, dict(factor=factor, explained=1.0))
    assert family.embedding_scale(scale(32 ** -0.5), 32, True).data["power"] == -1
    assert family.embedding_scale(scale(float(np.float32(32 ** 0.5))), 32, True).data["power"] == 1
    assert family.embedding_scale(scale(2.0), 32, True) is None
    assert family.embedding_scale(scale(32 ** 0.5 * 1.05), 32, True) is None


def test_step_features_read_the_config():
    from llamaspec import LlamaConfig
    from llamaspec.testing import TINY
    cfg = LlamaConfig.from_dict({**TINY, **TINY_FAMILIES["gemma2"]})
    assert family.step_features("layers.1.attn_ctx", cfg) == {"scale": 12 ** -0.5, "softcap": 1.5, "window": None,
                                                              "windows": (4,)}
    assert family.step_features("layers.0.attn_ctx", cfg)["window"] == 4
    assert family.step_features("logits", cfg) == {"softcap": 2.0}
    assert family.step_features("embed", cfg) == {"embed_scale": True}
    qwen2 = LlamaConfig.from_dict({**TINY, **TINY_FAMILIES["qwen2"]})
    assert family.step_features("layers.1.attn_out", qwen2)["bias"] is False
    assert family.step_features("layers.1.q", qwen2)["bias"] is True
    assert family.step_features("layers.1.q", None) == {}


# ----- the streamed ladder reads the config too ---------------------------------------------------

def _doctored(folder, tmp_path, change):
    """A copy of the checkpoint with change(weights) applied (what a conversion script writes)."""
    from llamaspec import load_weights
    from llamaspec.files import atomic_write
    from llamaspec.testing import write_safetensors
    _, weights = load_weights(folder)
    weights = {k: np.array(v) for k, v in weights.items()}
    change(weights)
    atomic_write(tmp_path / "config.json", (folder / "config.json").read_text(), "config")
    write_safetensors(tmp_path / "model.safetensors", weights, {"format": "pt"})
    return tmp_path


@pytest.mark.parametrize("family_name,change,tap,words", [
    ("gemma2", lambda w: w.__setitem__("model.layers.1.input_layernorm.weight",
                                       w["model.layers.1.input_layernorm.weight"] + 1),
     "layers.1.attn_norm", ["(2 + w) instead of (1 + w)"]),
    ("qwen2", lambda w: w.__setitem__("model.layers.1.self_attn.k_proj.bias",
                                      np.zeros_like(w["model.layers.1.self_attn.k_proj.bias"])),
     "layers.1.k", ["k_proj's bias", "constant offset"]),
])
def test_streamed_ladder_names_a_family_slip_in_a_converted_checkpoint(family_name, change, tap, words, family_dir,
                                                                       tmp_path):
    """A Gemma 2 norm weight stored with its 1 already added (a conversion to Llama's convention)
    and a Qwen2 k_proj bias written as zeros, layer by layer: the hint says them against the
    config (Gemma's (1 + w), Qwen2's biases on q/k/v)."""
    from compare.adapters import Side
    from compare.adapters.streaming import CheckpointModel
    from compare.ladder.engine import run_ladder
    from compare.ladder.stream import checkpoint_side
    from llamaspec import Policy
    folder = family_dir(family_name)
    policy = Policy.get("fp32")
    cand = CheckpointModel("torchref", _doctored(folder, tmp_path, change), policy)
    report = run_ladder(checkpoint_side("torchref", folder, policy), Side("torchref", cand, cand.float64(), False,
                                                                        cand.taps), *padded(), policy)
    d = report.first_divergence
    assert report.run["path"] == "streamed" and (report.verdict, d.tap) == ("semantic", tap), report.summary()
    assert all(w in d.hint for w in words), d.hint
    assert d.confirmed, d.evidence


def test_soft_cap_is_not_named_for_a_tiny_difference():
    """A cap far above every logit is the identity to within a tiny difference: no finding."""
    z = 6 * np.random.default_rng(5).standard_normal((2, 5, 50))
    assert family.soft_cap(z * (1 + 1e-9), z, None) is None
    capped = 2.0 * np.tanh(z / 2.0)
    assert family.soft_cap(capped * (1 + 1e-9), capped, 2.0) is None
