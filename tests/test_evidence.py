"""The ladder decides on typed records (compare.evidence) and writes sentences last
(compare.explain): no decision reads a formatted string, and rewording every sentence
changes no verdict."""

import ast
from pathlib import Path

import numpy as np
import pytest

from compare.controls import CONTROLS, DECODE_CONTROLS, run_control, run_decode_control
from compare.evidence import Span
from compare.explain import ladder as explain
from llamaspec.testing import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
STRING_METHODS = {"startswith", "endswith", "replace", "find", "index", "split", "rsplit", "partition", "count"}


def _phrase(node) -> bool:
    """A literal of two or more words: a piece of a sentence, not an identifier or a path."""
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and " " in node.value.strip()


def string_decisions(source: str) -> list[tuple[int, str]]:
    """Where code tests a sentence: `"some words" in x`, `x.startswith("some words")`,
    `x.replace("some words", ...)` and the like (an identifier, a tap name or a path is
    fine: those are data)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if _phrase(node.left):
                hits.append((node.lineno, ast.unparse(node)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in STRING_METHODS and any(_phrase(a) for a in node.args)):
            hits.append((node.lineno, ast.unparse(node)))
    return hits


def test_the_checker_sees_a_decision_on_a_sentence():
    assert string_decisions('angle = "highest quarter of frequencies" in where')
    assert string_decisions('if x.startswith("not run"): pass')
    assert string_decisions('w = where.replace("positions", "steps")') == []    # one word: could be data
    assert string_decisions('w = where.replace("the positions", "steps")')
    assert not string_decisions('ok = "logits" in taps')


def test_no_decision_in_compare_reads_a_sentence():
    """compare/controls is exempt: its check() compares the rendered hint with the words a
    control promises its user, which is what a test of the explainer must do."""
    found = {}
    for path in sorted((ROOT / "compare").rglob("*.py")):
        if "controls" in path.relative_to(ROOT).parts:
            continue
        hits = string_decisions(path.read_text())
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert found == {}


def test_span_is_data_and_the_sentence_is_made_from_it():
    band = Span("rope_pairs", 0, 3, 16, 0)
    assert band.highest_frequencies and not Span("rope_pairs", 4, 7, 16, 1).highest_frequencies
    assert explain.span(band) == "RoPE pairs 0-3 of 16 (the highest quarter of frequencies)"
    assert Span("positions", 3, 9).as_steps() == Span("steps", 3, 9)
    assert explain.span(Span("positions", 3, 9).as_steps()) == "steps 3-9"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("evidence") / "tiny", head_dim=32)


def _verdicts(report):
    d = report.first_divergence
    return report.verdict, d and (d.tap, d.layer, d.component, d.confirmed), [v.kind for v in report.taps]


# One control of each rung whose decision once read a sentence: RoPE angles in the top
# frequency band judged without a twin ("highest quarter of frequencies" in where), an
# unstructured fp64 difference at the lm_head ("no simple structure" in hint), and decode's
# pooled steps (where.replace("positions", "steps")).
PREFILL = [("hf_rope_angles_bf16", False), ("lm_head_tied", True)]


@pytest.mark.parametrize("name,twin", PREFILL)
def test_rewording_every_sentence_changes_no_verdict(tiny, monkeypatch, name, twin):
    ids = np.random.default_rng(0).integers(3, 96, (1, 128))
    mask = np.ones_like(ids)
    before = _verdicts(run_control(CONTROLS[name], tiny, ids, mask, twin=twin))
    for fn in ("tap_hint", "divergence_hint", "forcing_sentence", "span"):
        monkeypatch.setattr(explain, fn, lambda *a, **k: "reworded")
    after = run_control(CONTROLS[name], tiny, ids, mask, twin=twin)
    assert _verdicts(after) == before
    assert after.first_divergence.hint == "reworded"


def test_rewording_changes_no_decode_verdict(tiny, monkeypatch):
    ids = np.random.default_rng(1).integers(3, 96, (2, 16))
    control = DECODE_CONTROLS["stale_mask"]
    before = run_decode_control(control, tiny, ids, np.ones_like(ids), steps=4)
    for fn in ("tap_hint", "divergence_hint", "span"):
        monkeypatch.setattr(explain, fn, lambda *a, **k: "reworded")
    after = run_decode_control(control, tiny, ids, np.ones_like(ids), steps=4)
    assert [s.verdict for s in after.per_step] == [s.verdict for s in before.per_step]
    assert (after.first_step, after.first_divergence.tap) == (before.first_step, before.first_divergence.tap)
    assert before.first_divergence.record.reason == after.first_divergence.record.reason
