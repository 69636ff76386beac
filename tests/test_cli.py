"""The command line on a tiny checkpoint: exit codes and report files."""

import json
from pathlib import Path

import numpy as np
import pytest

from llama_parity.cli import main


def test_compare_writes_json_and_exits_zero_on_drift(tiny_dir, tmp_path, capsys):
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    rc = main(["compare", str(tiny_dir("gqa")), "--random-tokens", "2x24", "--policy", "bf16",
               "--json", str(out), "--html", str(page), "--no-colour"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    assert report["verdict"] in ("exact", "drift") and report["first_divergence"] is None
    assert "data:image/png;base64," in page.read_text()
    assert "layer component" in printed and "jaxmodel vs torchref at bf16" in printed


def test_unknown_policy_is_a_clear_error(tiny_dir, capsys):
    rc = main(["compare", str(tiny_dir("gqa")), "--random-tokens", "1x8", "--policy", "fp12"])
    assert rc == 2 and "unknown precision policy 'fp12'" in capsys.readouterr().err


def test_compare_writes_both_reports_to_out_dir_by_default(tiny_dir, tmp_path, capsys):
    rc = main(["compare", str(tiny_dir("gqa")), "--random-tokens", "1x16", "--no-colour",
               "--no-teacher-forcing", "--out-dir", str(tmp_path / "rep")])
    assert rc == 0, capsys.readouterr().out
    written = sorted(p.name for p in (tmp_path / "rep").iterdir())
    assert written == ["jaxmodel-vs-torchref-fp32.html", "jaxmodel-vs-torchref-fp32.json"]
    assert json.loads((tmp_path / "rep" / written[1]).read_text())["policy"]["name"] == "fp32"


def test_compare_decode_judges_each_step_and_writes_its_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["compare", str(tiny_dir("gqa")), "--random-tokens", "2x12", "--decode", "3", "--json", str(out),
               "--no-files", "--no-teacher-forcing"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "decode of 3 steps" in printed
    decoded = json.loads((tmp_path / "r-decode.json").read_text())
    assert decoded["steps"] == 3 and len(decoded["per_step"]) == 3 and decoded["verdict"] in ("exact", "drift")


def test_compare_generate_reports_where_greedy_parts_and_writes_its_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["compare", str(tiny_dir("gqa")), "--random-tokens", "3x10", "--generate", "6", "--json", str(out),
               "--no-files", "--no-teacher-forcing"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    greedy = json.loads((tmp_path / "r-greedy.json").read_text())
    assert greedy["verdict"] in ("exact", "drift") and len(greedy["rows"]) == 3


def test_help_lists_every_verb_on_one_line_and_each_verb_has_an_example(capsys):
    import pytest
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    top = capsys.readouterr().out
    assert done.value.code == 0
    verbs = ("demo", "compare", "capture", "fetch-smollm2", "make-checkpoint", "probe")
    for verb in verbs:
        line = next(ln for ln in top.splitlines() if ln.strip().startswith(verb + " "))
        assert len(line.split(None, 1)) == 2, f"{verb}: its summary is not on its line: {line!r}"
        assert f"llama-parity {verb}" in top          # an example per verb in the top-level help
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        examples = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(" ")
                    and ln.strip().startswith(f"llama-parity {verb}")]
        assert examples, f"{verb} --help shows no example"


def _tokenized_tiny(smollm2, folder):
    """A tiny random checkpoint whose vocabulary fits SmolLM2's tokenizer, with that tokenizer."""
    import shutil

    from llamaspec.testing import make_checkpoint
    make_checkpoint(folder, vocab_size=49152, tie_word_embeddings=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2 / name).is_file():
            shutil.copyfile(smollm2 / name, folder / name)
    return folder


def test_demo_explains_every_split_or_shows_the_nearest_tie(smollm2, tmp_path, capsys):
    folder = _tokenized_tiny(smollm2, tmp_path / "tiny")
    rc = main(["demo", str(folder), "--policy", "fp32", "bf16", "--max-new-tokens", "4", "--prompt", "Hi",
               "--prompt", "What is 2 + 2?", "--out-dir", str(tmp_path / "rep")])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    summary = json.loads((tmp_path / "rep" / "demo.json").read_text())
    for pol in summary["policies"]:
        a = pol["answers"]
        same = all(x == a["torchref"]["alone"] for impl in a for x in a[impl].values())
        # every difference has its explanation; the nearest tie exactly when none differs
        assert same == (not pol["batching"] and not pol["models"]) == ("nearest_tie" in pol), pol
        for f in pol["batching"]:
            assert pol["invariant"][f["impl"]][str(f["prompt"])] is True     # invariant mode: alone == batched
        assert pol["verdict"] in ("exact", "drift") and (tmp_path / "rep" / Path(pol["html"]).name).is_file()
        assert f"cost at {pol['policy']}:" in printed
    assert "where the answers differ, and why:" in printed


def test_demo_calls_a_planted_batching_change_where_the_model_was_sure_a_bug(smollm2, tmp_path):
    """explain_batching on real traces of a tiny model, with the batched answer's second token
    replaced (its logits kept): the model led there by its own margin, far beyond what
    rounding flips, so the split must be called semantic, and the oracle named."""
    from compare.ladder.engine import prepare
    from compare.probes import as_probe_model
    from llama_parity import demo
    from llamaspec.tokenizer import Tokenizer
    folder = _tokenized_tiny(smollm2, tmp_path / "tiny")
    tok = Tokenizer.from_pretrained(folder)
    ids, mask = tok.batch_encode(["Hi", "What is 2 + 2?"], chat=True, padding_side="left")
    ref, _, ids, mask, _ = prepare("torchref", "jaxmodel", folder, (ids, mask), "fp32")
    runs = demo.greedy_runs(as_probe_model(ref.at_policy.model), ids, mask, 3, eos=())   # 3 steps whatever comes
    runs.batched.tokens[0, 1] = (runs.batched.tokens[0, 1] + 1) % 49152     # planted: another token
    lines = []
    found = demo.explain_batching(lines.append, tok, ref, runs, 0, ids, mask, tuple(tok.eos_ids))
    assert found["step"] == 2 and found["kind"] == "semantic", lines
    assert found["margin_alone"] > 2 * found["threshold"] and "the model was sure" in "\n".join(lines)
    assert set(found["oracle"]) == {"a", "b", "top"}


def test_demo_keeps_a_float64_run_and_gives_it_back_unchanged(tiny_dir):
    """KeptRuns: the same capture asked twice (same ids, mask, taps, injected states) runs the
    model once and gives back the first run's arrays, read-only; other inputs or another
    injected state run the model again."""
    import torchref
    from compare.adapters import OurModel
    from llama_parity.demo import KeptRuns
    model = OurModel(torchref.from_pretrained(tiny_dir(), policy="fp64"))
    calls = []
    real = model.capture
    model.capture = lambda *a, **kw: calls.append(kw.get("inject")) or real(*a, **kw)
    kept = KeptRuns(model)
    ids = np.array([[3, 5, 7, 9], [0, 2, 4, 6]])
    mask = np.array([[1, 1, 1, 1], [0, 1, 1, 1]])
    logits, acts = kept.capture(ids, mask, ["layers.0.out", "logits"])
    again, acts2 = kept.capture(ids, mask, ["layers.0.out", "logits"])
    assert len(calls) == 1 and again is logits and acts2["layers.0.out"] is acts["layers.0.out"]
    with pytest.raises(ValueError):
        logits[0, 0, 0] = 0.0           # read-only: no reader changes what the next one gets
    h = acts["layers.0.out"]
    kept.capture(ids, mask, ["layers.1.out"], inject={1: h})
    kept.capture(ids, mask, ["layers.1.out"], inject={1: h.copy()})     # same values: kept
    kept.capture(ids, mask, ["layers.1.out"], inject={1: h + 1.0})      # another state: run
    kept.capture(ids[:, 1:], mask[:, 1:], ["layers.0.out", "logits"])   # other inputs: run
    assert len(calls) == 4 and calls[1] is not None and calls[3] is None
    kept.capture(ids, None, ["logits"])
    kept.capture(ids, None, ["logits"])                                 # no mask: kept as such
    assert len(calls) == 5
    assert np.array_equal(kept(ids, attention_mask=mask), model(ids, attention_mask=mask))

