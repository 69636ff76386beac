"""The streamed sweep (sweep(stream=True), compare.sweep.stream): the loaded sweep's numbers from
walks over the checkpoint that never load a model, and its CLI flag."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from compare.adapters import OurModel
from compare.adapters.streaming import CheckpointModel
from compare.sweep import sweep
from llama_parity.cli import main
from llamaspec import InputError

LAYERS = 3
POLICIES = ["fp32", "bf16", "bf16+kv_cache=e4m3:channel"]


@pytest.fixture(scope="module")
def folder(tiny_dir):
    return tiny_dir(num_hidden_layers=LAYERS)


def _kw(**extra):
    ids = np.random.default_rng(3).integers(0, 96, 40)
    return dict(tokens=ids, window=16, pairs=[("bf16", "fp32")], prompts=2, prompt_tokens=4, new_tokens=3,
                keep_wide=1, sensitivity_windows=2, **extra)


def _layers(res):
    return [(e.policy, e.update, e.stream, e.out, e.ranking, e.window_top, e.windows, e.tokens) for e in res.layers]


@pytest.mark.parametrize("package", ["torchref", "jaxmodel"])
def test_streamed_sweep_gives_the_loaded_sweeps_numbers(folder, package):
    """Bit for bit: the local errors (the same blocks on the same rounded inputs), the suggestions,
    every measure of every row (the same logits: one lm_head piece, the same products) and the
    greedy divergence (the last position of a whole-sequence forward picks the cached decode's
    token here; it need not in general: a near tie may round either way)."""
    policies = POLICIES if package == "torchref" else POLICIES[:2]
    loaded = sweep(package, folder, policies, **_kw())
    lines = []
    streamed = sweep(package, folder, policies, progress=lines.append, **_kw(stream=True))
    assert (loaded.stream, streamed.stream) == (False, True)
    assert _layers(streamed) == _layers(loaded)
    assert streamed.suggested == loaded.suggested and len(streamed.suggested) == len(policies) - 1
    assert [(r.candidate, r.base) for r in streamed.rows] == [(r.candidate, r.base) for r in loaded.rows]
    for a, b in zip(loaded.rows, streamed.rows):
        assert dataclasses.asdict(b.measures) == dataclasses.asdict(a.measures), (a.candidate, a.base)
    assert [(g.policy, g.indices) for g in streamed.greedy] == [(g.policy, g.indices) for g in loaded.greedy]
    assert sum(x.startswith("window") and "ETA" in x for x in lines) == 3
    assert sum(x.startswith("local error per layer") and "ETA" in x for x in lines) == 4    # policies, suggested
    assert sum(x.startswith("greedy step") and "ETA" in x for x in lines) == 3                # one walk per token
    assert not any(x.startswith("loading") for x in lines)
    assert set(streamed.seconds) == set(loaded.seconds) | {"reading"}


def test_stream_never_loads_a_model(folder, tmp_path, monkeypatch):
    """No from_pretrained, no OurModel, no CheckpointModel.model: the sweep still runs whole,
    suggested rows and greedy included, and its JSON says it streamed."""
    def refuse(*a, **k):
        raise AssertionError("a whole model was loaded")
    import jaxmodel
    import torchref
    for mod in (torchref, jaxmodel):
        monkeypatch.setattr(mod, "from_pretrained", refuse)
    monkeypatch.setattr(OurModel, "load", refuse)
    monkeypatch.setattr(CheckpointModel, "model", property(refuse))
    res = sweep("torchref", folder, ["fp32", "bf16"], **_kw(stream=True))
    assert [r.candidate for r in res.rows] == ["fp32", "bf16", res.suggested[0].name, "bf16"]
    assert len(res.greedy) == 3 and len(res.layers) == 3
    doc = json.loads(res.to_json(tmp_path / "s.json").read_text())
    assert doc["stream"] is True and any(k.startswith("fp64 plan") for k in doc["environment"])   # no load


def test_stream_must_be_a_bool(folder):
    with pytest.raises(InputError, match="stream 'yes'"):
        sweep("torchref", folder, ["fp32", "bf16"], **_kw(stream="yes"))


def test_cli_stream(folder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "s.json"
    base = ["sweep", str(folder), "--policies", "fp32,bf16", "--random-tokens", "40", "--window", "16",
            "--prompts", "1", "--new-tokens", "2"]
    assert main(base + ["--stream", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["stream"] is True and len(doc["rows"]) == 3
    assert "greedy step 2/2" in capsys.readouterr().err
    # a bad combination: --stream with a window whose logits of every model at once (fp64, 2 policies,
    # their 2 suggested rows: 5 x 16 x 96 float64, 61 KB) exceed the memory; loaded, one at a time fits
    import llamaspec.budget as budget
    monkeypatch.setattr(budget, "memory_bytes", lambda: 40_000)
    monkeypatch.setattr(OurModel, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(base + ["--stream"]) == 2
    err = capsys.readouterr().err
    assert "--stream with --window 16" in err and "5 models" in err
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--help"])
    assert e.value.code == 0
    assert "--new-tokens walks" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("package", ["torchref", "jaxmodel"])
def test_adjacent_wide_layers_stream_as_loaded(folder, package):
    """Two adjacent layers wider than the base (bf16+layers[1:3]=fp32): layer 1's fp32 output reaches
    layer 2 as it is, streamed as loaded (each block rounds its input to its own residual dtype)."""
    kw = dict(tokens=np.random.default_rng(3).integers(0, 96, 32), window=16, prompts=0, sensitivity_windows=0)
    loaded = sweep(package, folder, ["bf16+layers[1:3]=fp32"], **kw)
    streamed = sweep(package, folder, ["bf16+layers[1:3]=fp32"], stream=True, **kw)
    assert streamed.rows[0].measures == loaded.rows[0].measures
