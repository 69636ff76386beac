"""A step computed below the policy's dtype for that step (compare/controls/steps.py): softmax,
norm statistics, RoPE angles and a matmul's sums hard-coded to bf16 at the first, a middle or
the last layer (or the final norm), in torchref and transformers, under fp32 and bf16: the ladder
says precision at that step's tap, layer and component, confirmed by teacher forcing, and no
later tap is a finding of its own. The default run covers every step, model, policy and place
once or more; the whole matrix is marked slow (`make test-all`)."""

import numpy as np
import pytest

from compare.controls import check, run_control
from compare.controls.steps import NO_OP_AT_POLICY, POLICIES, STEPS, WHERE, places, step_control

LAYERS = 3
IDS = np.random.default_rng(0).integers(3, 96, (2, 128))


def _matrix():
    """Every control; the default cover: for each step, torchref under one policy and
    transformers under the other, places taken in turn (every place, step, model and policy)."""
    turn = 0
    for i, step in enumerate(STEPS):
        where_policy = [("torchref", POLICIES[(i + 1) % 2]), ("transformers", POLICIES[i % 2])]
        for where in WHERE:
            for policy in POLICIES:
                for place in places(step, LAYERS):
                    default = (where, policy) in where_policy and place == list(places(step, LAYERS))[
                        turn % len(places(step, LAYERS))]
                    marks = [pytest.mark.filterwarnings("ignore::UserWarning")]
                    marks += [] if default else [pytest.mark.slow]
                    yield pytest.param(step, where, policy, place, marks=marks, id=f"{step}-{where}-{policy}-{place}")
            turn += 1


@pytest.fixture(scope="module")
def folder(tiny_dir):
    return tiny_dir("gqa", head_dim=32, num_hidden_layers=LAYERS)


@pytest.mark.parametrize("step,where,policy,place", list(_matrix()))
def test_step_below_the_policy_is_precision_at_its_tap(step, where, policy, place, folder):
    if where == "transformers":
        pytest.importorskip("transformers")
    control = step_control(step, where, policy, place, LAYERS)
    report = run_control(control, folder, IDS)
    assert check(control, report) == [], report.summary()
    if (step, where, policy) in NO_OP_AT_POLICY:
        return      # bitwise the policy's own at P (steps.py): drift, checked above
    d = report.first_divergence
    assert d.confirmed, f"teacher forcing disagrees: {d.evidence}"
    assert d.record.noise is not None and d.record.noise.dtype == "bfloat16"
    assert d.record.noise.prescribed == "float32", d.record.noise
    after = report.taps[[v.tap for v in report.taps].index(d.tap) + 1:]
    own = [v.tap for v in after if v.kind in ("precision", "semantic")]
    assert own == [], f"findings after the first divergence: {own}\n{report.summary()}"


def test_default_cover_takes_every_factor():
    default = [p.values for p in _matrix() if not p.marks or all(m.name != "slow" for m in p.marks)]
    assert {s for s, *_ in default} == set(STEPS)
    assert {(s, w) for s, w, *_ in default} == {(s, w) for s in STEPS for w in WHERE}
    assert {(s, p) for s, _, p, _ in default} == {(s, p) for s in STEPS for p in POLICIES}
    assert {pl for *_, pl in default} == {"first", "middle", "last", "final"}


def test_inherited_taps_in_the_report_terminal_json_and_html(folder, tmp_path, capsys):
    """bf16 softmax at layer 0 under fp32: every later finding is inherited from
    layers.0.attn_ctx, in the Report, the terminal table, the JSON and the HTML page."""
    import json

    from llama_parity.cli import print_verdict_table
    report = run_control(step_control("softmax", "torchref", "fp32", "first", LAYERS), folder, IDS[:, :48])
    assert report.first_divergence.tap == "layers.0.attn_ctx" and report.verdict == "precision"
    inherited = [v for v in report.taps if v.kind == "inherited"]
    assert {v.inherited.how for v in inherited} == {"same_layer", "forced"}
    assert {v.layer for v in inherited} >= {0, 1, 2}
    assert all(v.inherited.source == "layers.0.attn_ctx" and "inherited from layers.0.attn_ctx" in v.hint
               for v in inherited)
    forced = [v for v in inherited if v.inherited.how == "forced"]
    assert all(v.local.kind in ("exact", "drift") for v in forced)
    assert "inherit" in report.summary()
    taps = json.loads(json.dumps(report.to_dict()))["taps"]
    assert sum(t["kind"] == "inherited" for t in taps) == len(inherited)
    assert all(t["inherited"]["own_kind"] in ("precision", "semantic") for t in taps if t["kind"] == "inherited")
    page = report.to_html(tmp_path / "r.html").read_text()
    assert f"{len(inherited)} inherited" in page and "inherited from layers.0.attn_ctx" in page
    print_verdict_table(report, colour=False)
    table = capsys.readouterr().out
    assert any(line.split()[:3] == ["1", "attn", "inherited"] for line in table.splitlines()), table
