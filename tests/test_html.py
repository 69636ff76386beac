"""compare.report.ladder: a self-contained page from hand-made reports (no model runs)."""

from __future__ import annotations

import re

import pytest

from compare.judge.verdicts import Divergence, TapVerdict
from compare.ladder.engine import Report
from compare.report.ladder import render_html, write_html
from llamaspec import taps as tapnames

POLICY = {"name": "bf16", "param_dtype": "bfloat16", "compute_dtype": "bfloat16", "matmul": "ieee",
          "accum_dtype": "float32", "norm_dtype": "float32", "softmax_dtype": "float32",
          "rope_dtype": "float32", "residual_dtype": "bfloat16", "logits_dtype": "float32"}


def _taps(n_layers, kind_of=lambda tap: "drift", err=lambda i: (1e-3 * (i + 1), 1.5e-3 * (i + 1), 1e-16)):
    out = []
    for i, tap in enumerate(tapnames.all_taps(n_layers)):
        r, c, f = err(i)
        kind = kind_of(tap)
        out.append(TapVerdict(tap, tapnames.layer_of(tap), tapnames.component_of(tap), kind, r, c, f,
                              0, f"hint for {tap} <{kind}>"))
    return out


def _local(n_layers):
    return [{"layer": i, "ref_local": 1e-3, "cand_local": 1.2e-3} for i in range(n_layers)]


def _check_common(page: str, d: dict):
    assert page.startswith("<!DOCTYPE html>")
    assert "data:image/png;base64," in page
    assert "http://" not in page and "https://" not in page
    assert "<link" not in page and "<script" not in page
    for t in d["taps"]:
        assert f">{t['tap']}<" in page
    for k in d["policy"]:
        assert k in page


def test_drift_report():
    r = Report("torchref", "jaxmodel", POLICY, "drift", None,
               _taps(2, err=lambda i: (1e-3, 1.2e-3, 0.0 if i % 2 else 1e-16)), _local(2))
    d = r.to_dict()
    page = render_html(d)
    _check_common(page, d)
    assert ">drift</span>" in page
    assert "jaxmodel vs torchref at bf16" in page
    assert "no precision or semantic difference found" in page
    assert "clipped to 1e-18" in page        # err_fp64 zeros on the log axis
    assert page.count("data:image/png;base64,") == 2


def test_semantic_report_with_first_divergence():
    bad = "layers.1.q_rope"
    def kind_of(tap):
        return "semantic" if tap == bad else ("precision" if tap == "logits" else "drift")
    taps = _taps(3, kind_of)
    first = Divergence(bad, 1, "attn", "semantic", "position-dependent, one half of each head: RoPE layout")
    d = Report("torchref", "jaxmodel", POLICY, "semantic", first, taps, _local(3)).to_dict()
    page = render_html(d)
    _check_common(page, d)
    assert ">semantic</span>" in page
    assert bad in page and "layer 1" in page
    assert "one half of each head: RoPE layout" in page
    assert "no precision or semantic difference found" not in page
    # escaped hints, never raw markup
    assert "&lt;semantic&gt;" in page and "<semantic>" not in page


def test_long_table_collapses_but_findings_stay_visible():
    bad = "layers.3.act"
    taps = _taps(4, lambda tap: "precision" if tap == bad else "drift")   # 63 taps > 40
    d = Report("torchref", "jaxmodel", POLICY, "precision",
               Divergence(bad, 3, "mlp", "precision", "softmax in bf16"), taps, _local(4)).to_dict()
    page = render_html(d)
    _check_common(page, d)
    details = page.index("<details>")
    assert page.index(f">{bad}<") < details            # the finding sits outside the fold
    assert page.count(f"<td class='t'>{bad}<") == 1          # and is not repeated inside it


def test_nan_values_and_empty_local():
    def err(i):
        return (float("nan"), float("inf"), 0.0) if i % 3 == 0 else (1e-3, 2e-3, 1e-16)
    taps = _taps(2, lambda tap: "precision" if tap == "layers.0.out" else "drift", err)
    d = Report("torchref", "jaxmodel", dict(POLICY, name="weird <pol>"), "precision",
               Divergence("layers.0.out", 0, "mlp", "precision", "NaN/Inf: 3 in the candidate"),
               taps, []).to_dict()
    assert d["taps"][0]["err_ref"] == "nan"              # the JSON form the page must accept
    page = render_html(d)
    _check_common(page, d)
    assert ">nan<" in page
    assert "weird &lt;pol&gt;" in page
    assert "No teacher-forced (local) errors" in page
    assert page.count("data:image/png;base64,") == 1     # depth plot only


def test_environment_shown_or_probed():
    d = Report("a", "b", POLICY, "exact", None, _taps(1, lambda t: "exact"), []).to_dict()
    assert re.search(r"<th>numpy</th><td><code>[0-9]", render_html(d))
    d["environment"] = {"gpu": "H200 <sxm>", "jax": "0.0.test"}
    page = render_html(d)
    assert "H200 &lt;sxm&gt;" in page and "0.0.test" in page


@pytest.mark.parametrize("as_dict", [False, True])
def test_write_html(tmp_path, as_dict):
    r = Report("torchref", "jaxmodel", POLICY, "drift", None, _taps(1), _local(1))
    out = write_html(r.to_dict() if as_dict else r, tmp_path / "sub" / "report.html")
    assert out.exists() and out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_notes_say_what_was_not_run_and_what_differs():
    d = Report("torchref", "my port", POLICY, "drift", None, _taps(2), [],
               config_differences=["rms_norm_eps: 1e-05 (reference) vs 1e-06 (candidate)"],
               teacher_forcing="not run: my port takes no inject (teacher forcing needs it)",
               semantic_rung="not run: my port has no float64()").to_dict()
    page = render_html(d)
    assert "The configs differ: rms_norm_eps: 1e-05 (reference) vs 1e-06 (candidate)" in page
    assert "Teacher forcing not run: my port takes no inject" in page
    assert "fp64 rung not run: my port has no float64()" in page and "by structure alone" in page
    plain = render_html(Report("torchref", "jaxmodel", POLICY, "drift", None, _taps(2), _local(2)).to_dict())
    assert "structure alone" not in plain and "configs differ" not in plain
