"""The oracle ladder on tiny checkpoints: clean runs are exact/drift (negative controls),
a planted bug gets the right class and layer, the report's contents, assert_parity.
The full planted-bug suite is tests/test_controls.py (compare/controls.py)."""

import numpy as np
import pytest
import torch

import torchref
from compare import compare_models
from compare.adapters import Side
from compare.ladder.engine import run_ladder
from llamaspec import Policy
from llamaspec import taps as tapnames

IDS = np.random.default_rng(0).integers(3, 96, (2, 40))
MASK = np.ones_like(IDS)


@pytest.mark.parametrize("policy", ["fp64", "fp32", "bf16", "fp16"])
def test_clean_jaxmodel_vs_torchref_is_never_a_finding(policy, tiny_dir):
    report = compare_models("torchref", "jaxmodel", tiny_dir("gqa"), inputs=IDS, policy=policy)
    assert report.verdict in ("exact", "drift"), report.summary()
    assert report.first_divergence is None
    assert len(report.local) == 2 and all(r["cand_local"] < 1 for r in report.local)
    report.to_dict()  # JSON-safe


def test_report_carries_per_tap_metrics_logits_agreement_and_environment(tiny_dir, tmp_path):
    report = compare_models("torchref", "jaxmodel", tiny_dir("gqa"), inputs=IDS, policy="bf16")
    for v in report.taps:
        assert set(v.metrics) == {"max_abs", "max_ulp", "cosine", "frac_beyond"}, v.tap
        if v.kind == "exact":
            assert v.metrics["max_ulp"] == 0 and v.metrics["max_abs"] == 0
        else:
            assert v.metrics["max_ulp"] >= 1 and 0.9 < v.metrics["cosine"] <= 1
    pairs = report.logits["pairs"]
    assert set(pairs) == {"candidate vs reference", "reference vs oracle", "candidate vs oracle"}
    assert pairs["candidate vs reference"]["top1_agreement"] > 0.9
    assert len(report.logits["positions"]["kl_cand_ref"]) == IDS.size
    assert report.environment["torch"].startswith("2.") and "jax backend" in report.environment
    assert report.environment["cpu"] and report.environment["cpu isa"] and report.environment["cpu vendor"]
    assert report.local[1]["cand_amplification"] > 0
    page = report.to_html(tmp_path / "r.html").read_text()
    assert "Logits agreement" in page and "max ULP" in page and "jax backend" in page


def test_clean_transformers_vs_torchref_at_fp32(tiny_dir):
    transformers = pytest.importorskip("transformers")
    folder = tiny_dir("gqa")
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    report = compare_models("torchref", hf, folder, inputs=IDS, policy="fp32")
    assert report.verdict in ("exact", "drift"), report.summary()


def padded(side: str):
    """IDS with row 1 padded by 7 slots on `side` (two rows of different lengths)."""
    mask = np.ones_like(IDS)
    if side == "left":
        mask[1, :7] = 0
    else:
        mask[1, -7:] = 0
    return IDS, mask


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("dtype,policy", [("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16")])
def test_clean_transformers_on_padded_batches_is_never_a_finding(attn, side, dtype, policy, tiny_dir):
    """The engine's float64 copy of an eager model once turned left padding into NaN and
    blamed the model (semantic at layer 1): its captures now run row by row."""
    transformers = pytest.importorskip("transformers")
    folder = tiny_dir("gqa")
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype),
                                                       attn_implementation=attn).eval()
    report = compare_models("torchref", hf, folder, inputs=padded(side), policy=policy)
    assert report.verdict in ("exact", "drift"), report.summary()
    assert not any(v.nonfinite for v in report.taps)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
def test_clean_jaxmodel_on_padded_batches_is_never_a_finding(side, policy, tiny_dir):
    report = compare_models("torchref", "jaxmodel", tiny_dir("gqa"), inputs=padded(side), policy=policy)
    assert report.verdict in ("exact", "drift"), report.summary()


def torch_side(folder, policy, patch):
    """A torchref candidate with one planted bug, at the policy and at fp64."""
    models = [torchref.from_pretrained(folder, policy=p) for p in (policy, "fp64")]
    for m in models:
        patch(m)
    return Side("torchref+bug", models[0], models[1], False,
                tuple(tapnames.all_taps(models[0].cfg.num_hidden_layers)))


def clean_side(folder, policy):
    return torch_side(folder, policy, lambda m: None)


def test_planted_rmsnorm_epsilon_is_semantic_at_its_layer(tiny_dir):
    folder = tiny_dir("gqa")

    def bug(m):
        m.model.layers[1].input_layernorm.eps = 1e-6   # config says 1e-5
    report = run_ladder(clean_side(folder, Policy.get("fp32")),
                        torch_side(folder, Policy.get("fp32"), bug), IDS, MASK, Policy.get("fp32"))
    d = report.first_divergence
    assert report.verdict == "semantic", report.summary()
    assert (d.tap, d.layer, d.component) == ("layers.1.attn_norm", 1, "attn_norm"), report.summary()


def test_assert_parity_passes_clean_and_fails_with_the_summary(tiny_dir):
    import compare
    folder = tiny_dir("gqa")
    compare.assert_parity("torchref", "jaxmodel", folder, policy="fp32", inputs=IDS)

    def bug(m):
        m.model.layers[0].post_attention_layernorm.eps = 1e-3
    planted = torch_side(folder, Policy.get("fp32"), bug)
    with pytest.raises(AssertionError, match=r"semantic at layers\.0\.mlp_norm"):
        compare.assert_parity("torchref", planted, folder, policy="fp32", inputs=IDS,
                              teacher_forcing=False)


def test_probe_and_bench_records_name_the_cpu():
    """The invariance lab and the probes record the run environment by policy name; the
    record must be the full one (CPU, its ISA, the caps), not the fallback."""
    from compare.environment import environment
    env = environment("bf16")
    assert env["cpu"] and "isa caps" in env and "fixed-order kernels" in env


def test_the_recorded_caps_name_xlas_cap(monkeypatch):
    """XLA's instruction-set cap is one flag among XLA_FLAGS: the caps line names it with the
    libraries' own variables (the benchmark's header printed "caps: ..." without it)."""
    from compare.environment import ISA_CAPS, cpu
    for name in ISA_CAPS:                   # the test-caps runs set them
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu()["isa caps"] == "ONEDNN_MAX_CPU_ISA=AVX2, --xla_cpu_max_isa=AVX2"
