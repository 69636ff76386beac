"""The sweep's per-layer part (compare.sweep.layers): the local error per layer against a
layer-by-layer computation of its own (torchref's LayerRunner), a per-layer override moving the
ranking where it acts and nowhere else, the suggested mixed policy measured as a row, the HTML
page (from a result and from its JSON read back) and the CLI flags."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest

from compare.report.sweep import render_html, write_html
from compare.sweep import sweep
from compare.sweep.layers import covers, rank
from llama_parity import cli
from llama_parity.checks import _ours
from llama_parity.cli import main
from llamaspec import Policy, load_weights
from llamaspec.files import atomic_write

LAYERS = 4


@pytest.fixture(scope="module")
def folder(tiny_dir):
    return tiny_dir(num_hidden_layers=LAYERS)


def _ids(n=48, seed=0):
    return np.random.default_rng(seed).integers(0, 96, n)


def _by_hand(folder, ids, window, policy="bf16"):
    """Per layer sum ||Δ(attn_out + mlp_out)||² and ||out||² over the windows, layer by layer with
    LayerRunner: the oracle's input to each layer from an fp64 run of the blocks one at a time,
    rounded to bf16 (ml_dtypes), then that block alone at the policy and at fp64."""
    from torchref.model import LayerRunner
    cfg, w = load_weights(folder)
    lo, hi = LayerRunner(cfg, policy, device="cpu"), LayerRunner(cfg, "fp64", device="cpu")
    du, out = np.zeros(LAYERS), np.zeros(LAYERS)
    for a in range(0, len(ids), window):
        chunk = ids[a:a + window][None]
        mask = np.ones_like(chunk)
        lo.start(chunk, mask)
        hi.start(chunk, mask)
        h = hi.embed(w["model.embed_tokens.weight"][chunk])
        for i in range(LAYERS):
            x = h.astype(ml_dtypes.bfloat16)
            taps = (f"layers.{i}.attn_out", f"layers.{i}.mlp_out")
            got, want = lo.block(i, w, x, taps), hi.block(i, w, x.astype(np.float64), taps)
            upd = [sum(r[t].astype(np.float64) for t in taps) for r in (got, want)]
            du[i] += ((upd[0] - upd[1]) ** 2).sum()
            out[i] += (want[f"layers.{i}.out"] ** 2).sum()
            h = hi.block(i, w, h)[f"layers.{i}.out"]
    return np.sqrt(du / out)


def test_local_error_matches_a_layer_by_layer_computation(folder):
    ids = _ids()
    res = sweep("torchref", folder, ["bf16"], tokens=ids, window=16, prompts=0, sensitivity_windows=3)
    (e,) = res.layers
    assert (e.windows, e.tokens, res.sensitivity_windows) == (3, 48, 3)
    want = _by_hand(folder, ids, 16)
    assert e.stream == pytest.approx(want, rel=1e-6)
    assert e.ranking == sorted(range(LAYERS), key=lambda i: -want[i])
    assert all(0 < x < 0.05 for x in e.update) and all(0 < x < 0.05 for x in e.out)


def test_a_layer_kept_wide_moves_the_ranking_there_and_nowhere_else(folder):
    res = sweep("torchref", folder, ["bf16", "bf16+layers[1]=fp32", "fp32"], tokens=_ids(32, 1), window=16,
                prompts=0, sensitivity_windows=2)
    bf16, mixed, fp32 = res.layers
    assert mixed.policy == "bf16+layers[1]=fp32"
    # one backend for all: the fast one declines per-layer overrides (compare.sweep.run.sweep_backend);
    # on an AMX Xeon the fast bf16 products are not the reference's bits, so the layers below would differ
    assert all(res.environment[f"{p} plan backend"] == "reference" for p in ("bf16", mixed.policy, "fp32"))
    assert mixed.stream[1] < 1e-3 * bf16.stream[1]        # fp32 arithmetic from the same bf16 input
    assert mixed.stream[1] < 10 * max(fp32.stream)
    for i in (0, 2, 3):                                   # the other layers: bf16's, from the same inputs
        assert mixed.stream[i] == pytest.approx(bf16.stream[i], rel=1e-9)
    assert mixed.ranking == [i for i in bf16.ranking if i != 1] + [1]     # the ranking moved: layer 1 last


def test_suggested_policy_is_run_and_measured(folder, tmp_path):
    res = sweep("torchref", folder, ["fp32", "bf16"], tokens=_ids(64, 2), window=16, prompts=1, prompt_tokens=4,
                new_tokens=2, keep_wide=2, sensitivity_windows=1)
    bf16 = res.layers[1]
    (s,) = res.suggested                                  # fp32 is already as wide as fp32: none for it
    assert s.policy == "bf16" and s.kept == sorted(bf16.ranking[:2]) and s.wide == "fp32"
    assert s.name == "bf16" + "".join(f"+layers[{i}]=fp32" for i in s.kept)
    assert Policy.get(s.name).for_layer(s.kept[0], LAYERS).compute_dtype == "float32"    # the name is the policy
    rows = {r.candidate: r.measures for r in res.rows}
    assert list(rows) == ["fp32", "bf16", s.name]         # next to the policy it came from
    assert math.isfinite(rows[s.name].kld_mean.value) and rows[s.name].tokens == rows["bf16"].tokens
    assert 0 < rows[s.name].kld_mean.value
    mixed = res.layers[2]
    assert mixed.policy == s.name and all(mixed.stream[i] < 1e-3 * bf16.stream[i] for i in s.kept)
    assert [g.policy for g in res.greedy] == ["fp32", "bf16", s.name]
    doc = json.loads(res.to_json(tmp_path / "s.json").read_text())
    assert doc["suggested"][0]["kept"] == s.kept and doc["layers"][1]["ranking"] == bf16.ranking
    assert doc["keep_wide"] == 2 and doc["wide_policy"] == "fp32" and _ours(tmp_path / "s.json")
    # the page: from the result, and from its JSON read back; the three figures drawn
    for page in (res.to_html(tmp_path / "a.html"), write_html(doc, tmp_path / "b.html")):
        text = page.read_text()
        assert text.count("<img") == 3 and "plot failed" not in text and s.name in text
        assert _ours(page)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html", "b.html", "s.json"]    # no temp files left
    # an old JSON without the per-layer fields renders too (the KLD figure; the others say why not)
    old = {k: v for k, v in doc.items() if k not in ("layers", "suggested", "keep_wide", "wide_policy",
                                                     "sensitivity_windows")}
    text = render_html(old)
    assert text.count("<img") == 1 and "not measured" in text


def test_rank_and_covers():
    assert rank([1.0, math.nan, 3.0, 3.0]) == [1, 2, 3, 0]          # NaN first, ties by layer
    wide = Policy.get("fp32")
    assert covers(Policy.get("fp32"), wide) and covers(Policy.get("fp64"), wide) and covers(Policy.get("tf32"), wide)
    for p in ("bf16", "bf16w-f32", "fp32+kv_cache=bfloat16", "fp32+layers[0]=bf16"):
        assert not covers(Policy.get(p), wide), p


def test_cli_keep_wide_html_and_json(folder, tmp_path, capsys, monkeypatch):
    html, js = tmp_path / "out.html", tmp_path / "out.json"
    base = ["sweep", str(folder), "--policies", "fp32,bf16", "--random-tokens", "40", "--window", "16",
            "--prompts", "0"]
    assert main(base + ["--keep-wide", "1", "--html", str(html), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "most sensitive layers" in out and "suggested: bf16 with layers" in out
    doc = json.loads(js.read_text())
    assert len(doc["suggested"]) == 1 and len(doc["suggested"][0]["kept"]) == 1
    assert html.read_text().count("<img") == 3
    assert main(base + ["--keep-wide", "1", "--html", str(html)]) == 0      # its own page: overwritten
    foreign = tmp_path / "notes.html"
    atomic_write(foreign, "<p>mine</p>")
    assert main(base + ["--html", str(foreign)]) == 2 and "--force" in capsys.readouterr().err

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")
    from compare.adapters import OurModel
    monkeypatch.setattr(OurModel, "load", no_model)
    for argv, named in ((["--keep-wide", "-1"], "--keep-wide"), (["--keep-wide", str(LAYERS + 1)], "--keep-wide"),
                        (["--wide-policy", "nope"], "--wide-policy"),
                        (["--wide-policy", "fp32+layers[0]=bf16"], "--wide-policy"),
                        (["--sensitivity-windows", "0", "--keep-wide", "1"], "--keep-wide"),
                        (["--policies", "bf16+layers[7]=fp32"], "--policies")):
        assert main(base + argv) == 2, argv
        assert named in capsys.readouterr().err


def test_cli_defaults_are_the_apis():
    from compare.sweep import run
    assert (cli.SENSITIVITY_WINDOWS, cli.WIDE_POLICY) == (run.SENSITIVITY_WINDOWS, run.WIDE_POLICY)


def test_one_backend_for_every_policy_of_a_sweep():
    """The default (fast) unless a policy is one the fast backend declines (per-layer overrides,
    fp8, a KV-cache knob) or mixed policies will be suggested (keep_wide): then the reference."""
    from compare.sweep.run import sweep_backend
    assert sweep_backend([Policy.get("bf16"), Policy.get("fp32")], 0) is None
    assert sweep_backend([Policy.get("bf16"), Policy.get("bf16+layers[1]=fp32")], 0) == "reference"
    assert sweep_backend([Policy.get("bf16")], 2) == "reference"
    assert sweep_backend([Policy.get("bf16+weight_fp8=e4m3:channel")], 0) == "reference"
