"""The oracle ladder on tiny checkpoints: clean runs are exact/drift (negative controls),
planted bugs get the right class, layer and component (positive controls, first few)."""

import types

import numpy as np
import pytest
import torch

import torchref
from compare.engine import Side, compare_models, run_ladder
from llamaspec import Policy, taps as tapnames

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


# ----- more positive controls: bugs planted in a patched torchref at layer 1 -----------

def _mlp_with(act_fn, swap=False):
    """An MLP forward with a different activation, or gate and up swapped."""
    def forward(self, x, policy, rec, p):
        gate, up = self.gate_proj(x, policy), self.up_proj(x, policy)
        if swap:
            gate, up = up, gate
        act = act_fn(gate) * up
        rec(p + "gate", gate), rec(p + "up", up), rec(p + "act", act)
        return self.down_proj(act, policy)
    return forward


def _patch_mlp(forward):
    def patch(m):
        mlp = m.model.layers[1].mlp
        mlp.forward = types.MethodType(forward, mlp)
    return patch


def _one_plus_w(m):
    norm = m.model.layers[1].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight + 1, requires_grad=False)


def _qk_interleave(m):
    """A conversion script's q/k row permutation (half-split <-> interleaved) per head."""
    attn = m.model.layers[1].self_attn
    for proj in (attn.q_proj, attn.k_proj):
        n, d = proj.weight.shape[0], attn.head_dim
        perm = torch.arange(n).view(-1, 2, d // 2).transpose(1, 2).reshape(-1)
        proj.weight = torch.nn.Parameter(proj.weight[perm], requires_grad=False)


PLANTED = {
    "rmsnorm_eps": (lambda m: setattr(m.model.layers[1].input_layernorm, "eps", 1e-6),
                    "layers.1.attn_norm", "attn_norm"),
    "silu_to_gelu": (_patch_mlp(_mlp_with(torch.nn.functional.gelu)), "layers.1.act", "mlp"),
    "gate_up_swapped": (_patch_mlp(_mlp_with(torch.nn.functional.silu, swap=True)),
                        "layers.1.gate", "mlp"),
    "norm_one_plus_w": (_one_plus_w, "layers.1.mlp_norm", "mlp_norm"),
    "qk_permutation": (_qk_interleave, "layers.1.q", "attn"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bug_is_semantic_at_its_tap(bug, tiny_dir):
    patch, tap, component = PLANTED[bug]
    folder = tiny_dir("gqa")
    fp32 = Policy.get("fp32")
    report = run_ladder(clean_side(folder, fp32), torch_side(folder, fp32, patch), IDS, MASK, fp32,
                        teacher_forcing=False)
    d = report.first_divergence
    assert report.verdict == "semantic", report.summary()
    assert (d.tap, d.layer, d.component) == (tap, 1, component), report.summary()
