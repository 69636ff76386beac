"""The policy sweep (compare.sweep): its measures against a plain numpy computation on saved
logits, the known cases, and the sweep and its CLI verb end to end on a tiny random checkpoint."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from compare.sweep import Accumulator, log_probs, read_text, sweep, table
from llama_parity.cli import main
from llamaspec import InputError, PolicyError
from llamaspec.files import atomic_write


def _softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _plain(base, cand, t):
    """The measures written out by hand: softmax by explicit sums, KL as sum p log(p / q)."""
    p, q = _softmax(base.astype(np.float64)), _softmax(cand.astype(np.float64))
    kl = np.array([sum(pi * math.log(pi / qi) for pi, qi in zip(pr, qr)) for pr, qr in zip(p, q)])
    n = len(t)
    pb, pc = p[np.arange(n), t], q[np.arange(n), t]
    d = np.log(pb) - np.log(pc)
    dp = pc - pb
    same = (base.argmax(1) == cand.argmax(1)).mean()
    return {"kl": kl, "kl_mean": kl.mean(), "kl_se": kl.std() / math.sqrt(n - 1), "same": same,
            "same_se": math.sqrt(same * (1 - same) / (n - 1)),
            "ppl_base": math.exp(-np.log(pb).mean()), "ppl_cand": math.exp(-np.log(pc).mean()),
            "ratio": math.exp(d.mean()), "ratio_se": math.exp(d.mean()) * d.std() / math.sqrt(n - 1),
            "rms": math.sqrt((dp ** 2).mean()),
            "rms_se": (dp ** 2).std() / math.sqrt(n - 1) / (2 * math.sqrt((dp ** 2).mean()))}


def _feed(base, cand, t, cuts):
    acc = Accumulator()
    for a, b in zip((0, *cuts), (*cuts, len(t))):
        acc.add(log_probs(base[a:b]), log_probs(cand[a:b]), t[a:b])
    return acc.result()


def test_measures_match_a_plain_computation_whatever_the_windows():
    rng = np.random.default_rng(1)
    n, v = 60, 9
    base = rng.normal(0, 2, (n, v))
    cand = base + rng.normal(0, 0.3, (n, v))
    t = rng.integers(0, v, n)
    want = _plain(base, cand, t)
    for cuts in ((), (7, 30, 31), (59,)):
        m = _feed(base, cand, t, cuts)
        assert m.tokens == n
        assert m.kld_mean.value == pytest.approx(want["kl_mean"], rel=1e-12)
        assert m.kld_mean.se == pytest.approx(want["kl_se"], rel=1e-9)
        assert m.kld_max == pytest.approx(want["kl"].max(), rel=1e-12)
        for p in (50, 90, 99, 99.9):
            assert m.kld_percentiles[f"p{p:g}"] == pytest.approx(np.percentile(want["kl"], p), rel=1e-12)
        assert m.same_top_p.value == pytest.approx(want["same"])
        assert m.same_top_p.se == pytest.approx(want["same_se"])
        assert m.ppl_base.value == pytest.approx(want["ppl_base"], rel=1e-12)
        assert m.ppl_cand.value == pytest.approx(want["ppl_cand"], rel=1e-12)
        assert m.ppl_ratio.value == pytest.approx(want["ratio"], rel=1e-12)
        assert m.ppl_ratio.se == pytest.approx(want["ratio_se"], rel=1e-9)
        assert m.rms_dp.value == pytest.approx(want["rms"], rel=1e-12)
        assert m.rms_dp.se == pytest.approx(want["rms_se"], rel=1e-9)


def test_identical_and_row_shifted_logits_cost_nothing():
    rng = np.random.default_rng(2)
    base = rng.normal(0, 3, (40, 11)).astype(np.float32)
    t = rng.integers(0, 11, 40)
    shift = rng.normal(0, 50, (40, 1))
    for cand in (base, base.astype(np.float64) + shift):
        m = _feed(base, cand, t, (13,))
        assert m.kld_mean.value == pytest.approx(0, abs=1e-12) and m.kld_max == pytest.approx(0, abs=1e-12)
        assert m.same_top_p.value == 1.0 and m.same_top_p.se == 0.0
        assert m.ppl_ratio.value == pytest.approx(1, abs=1e-12)
        assert m.rms_dp.value == pytest.approx(0, abs=1e-12)
        assert m.ppl_base.value == pytest.approx(m.ppl_cand.value, rel=1e-12)


def test_nan_is_never_masked_and_bad_shapes_are_named():
    base = np.zeros((4, 5))
    cand = base.copy()
    cand[2, 3] = np.nan
    m = _feed(base, cand, np.array([0, 1, 2, 3]), ())
    assert math.isnan(m.kld_mean.value) and math.isnan(m.same_top_p.value) and math.isnan(m.ppl_ratio.value)
    with pytest.raises(ValueError, match="must be"):
        Accumulator().add(np.zeros((3, 5)), np.zeros((3, 5)), np.zeros(4, int))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Accumulator().add(np.zeros((3, 5)), np.zeros((3, 5)), np.array([0, 1, 5]))
    with pytest.raises(ValueError, match="no tokens"):
        Accumulator().result()


def test_sweep_on_a_tiny_checkpoint(tiny_dir, tmp_path):
    folder = tiny_dir()
    ids = np.random.default_rng(0).integers(0, 64, 70)
    lines = []
    res = sweep("torchref", folder, ["fp32", "bf16"], tokens=ids, window=16, pairs=[("bf16", "fp32")],
                prompts=2, prompt_tokens=4, new_tokens=3, progress=lines.append)
    assert (res.tokens, res.windows) == (70, 5)
    assert [(r.candidate, r.base) for r in res.rows] == [("fp32", "fp64"), ("bf16", "fp64"), ("bf16", "fp32")]
    fp32, bf16 = res.rows[0].measures, res.rows[1].measures
    assert fp32.tokens == 4 * 15 + 5             # every position with a next token in its window
    assert fp32.kld_mean.value < 1e-8 < bf16.kld_mean.value
    assert sum(x.startswith("window") and "ETA" in x for x in lines) == 5
    assert sum(x.startswith("local error per layer") and "ETA" in x for x in lines) == 2   # the sensitivity windows
    assert [len(g.indices) for g in res.greedy] == [2, 2] and res.greedy_prompt_tokens == 4
    assert res.environment["cpu"]
    assert any("bf16" in x and "fp32" in x for x in table(res))
    doc = json.loads(res.to_json(tmp_path / "s.json").read_text())
    assert doc["rows"][1]["measures"]["kld_mean"]["value"] == bf16.kld_mean.value
    # the same numbers as the accumulators fed with the models' own logits, window by window
    from compare.adapters import OurModel
    hi, lo = OurModel.load("torchref", folder, "fp64"), OurModel.load("torchref", folder, "bf16")
    acc = Accumulator()
    for a in range(0, 70, 16):
        w = ids[a:a + 16][None]
        acc.add(log_probs(hi(w)[0, :-1]), log_probs(lo(w)[0, :-1]), w[0, 1:])
    assert acc.result().kld_mean.value == pytest.approx(bf16.kld_mean.value, rel=1e-12)


def test_sweep_refuses_bad_arguments(tiny_dir):
    folder = tiny_dir()
    ids = np.arange(10)
    for kw, match in ((dict(policies=["fp32", "nope"]), "nope"), (dict(policies=["fp64"]), "oracle"),
                      (dict(policies=["fp32"], window=1), "window 1"),
                      (dict(policies=["fp32"], pairs=[("bf16", "fp64")]), "bf16"),
                      (dict(policies=["fp32"], impl="transformers"), "transformers"),
                      (dict(policies=["fp32"], window=512), "max_position_embeddings")):
        with pytest.raises((InputError, PolicyError), match=match):
            sweep(kw.pop("impl", "torchref"), folder, tokens=ids, **{"window": 16, **kw})


def test_read_text_is_bounded_and_utf8(tmp_path):
    atomic_write(tmp_path / "ok.txt", "héllo")
    assert read_text(tmp_path / "ok.txt") == "héllo"
    atomic_write(tmp_path / "bad.txt", b"ab\xff")
    with pytest.raises(InputError, match="not UTF-8 text"):
        read_text(tmp_path / "bad.txt")
    with pytest.raises(InputError, match="not a regular file"):
        read_text(tmp_path)


def test_cli_sweep_exit_codes(tiny_dir, tmp_path, capsys):
    folder = str(tiny_dir())
    out = tmp_path / "sweep.json"
    assert main(["sweep", folder, "--policies", "fp32,bf16", "--random-tokens", "40", "--window", "16",
                 "--prompts", "1", "--new-tokens", "2", "--pair", "bf16:fp32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]    # fp32, bf16, bf16 with its 2 layers at fp32 (--keep-wide's
    assert [r["base"] for r in rows] == ["fp64"] * 3 + ["fp32"]      # default on 2 layers), then the pair
    assert "same top p" in capsys.readouterr().out
    # the same command again overwrites its own JSON; a file the tool did not write needs --force
    again = ["sweep", folder, "--policies", "fp32", "--random-tokens", "20", "--window", "10", "--prompts", "1",
             "--new-tokens", "1", "--json"]
    assert main(again + [str(out)]) == 0
    foreign = tmp_path / "notes.json"
    atomic_write(foreign, '{"mine": true}')
    assert main(again + [str(foreign)]) == 2 and "--force" in capsys.readouterr().err
    assert json.loads(foreign.read_text()) == {"mine": True}
    atomic_write(tmp_path / "bad.txt", b"\xff\xfe")
    rnd = ["--random-tokens", "40"]       # the tiny folder has no tokenizer
    for argv, named in ((["--policies", "fp32,nope"], "--policies"), (["--policies", "fp32,fp64", *rnd], "--policies"),
                        (["--policies", "fp32,fp32", *rnd], "--policies"),
                        (["--pair", "bf16:fp32", *rnd], "--pair"), (["--pair", "fp32"], "--pair"),
                        (["--pair", "fp32:fp32", *rnd], "--pair"),
                        (["--window", "1", *rnd], "--window"), (["--window", "100000", *rnd], "--window"),
                        (["--random-tokens", "40", "--text", str(tmp_path / "bad.txt")], "--text"),
                        (["--text", str(tmp_path / "bad.txt")], "--text"), (["--text", str(tmp_path)], "--text"),
                        (["--text", str(tmp_path / "none.txt")], "--text"), ([], "tokenizer.json")):
        code = main(["sweep", folder, *argv] if argv[:1] == ["--policies"] else ["sweep", folder, "--policies",
                                                                                 "fp32", *argv])
        assert code == 2, argv
        assert named in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:      # argparse's own check of a count: exit 2, the flag named
        main(["sweep", folder, "--random-tokens", "0"])
    assert e.value.code == 2 and "--random-tokens" in capsys.readouterr().err


def test_sweep_runs_jaxmodel_too(tiny_dir):
    res = sweep("jaxmodel", tiny_dir(), ["fp32", "bf16"], tokens=np.arange(40) % 64, window=20, prompts=1,
                prompt_tokens=4, new_tokens=2)
    fp32, bf16 = (r.measures for r in res.rows)
    assert fp32.kld_mean.value < 1e-8 < bf16.kld_mean.value and res.environment["jax_enable_x64"] is not None
