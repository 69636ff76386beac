"""The repro of the controls beyond tests/test_repro.py's (compare/controls): the planted cache
bugs of the decode path (a case at one decode step, each side decoding through its own KV cache),
the device control (a port wrong only under an instruction-set cap, its case written in a process
under the avx2 cap), the steps computed below the policy's dtype (compare/controls/steps.py), and
the controls that need a checkpoint of their own (OWN_CHECKPOINT_CONTROLS, SQUARE_CONTROLS). Each
case's repro.py runs in a fresh process that cannot import the project (tests/repro_checks.py)
and must name the control's tap (exit 1); clean runs show no difference (exit 0). The planted
sharding bugs' cases are written where jaxmodel runs on forced host devices, and run, in
tests/test_sharding.py.

As in tests/test_repro.py, most cases are written from the report the control's own test asserts
(tests/test_decode.py, tests/test_steps.py, tests/test_structure.py, tests/test_where_device.py),
so that the ladder is not run again for each; one decode case is written from the decode
comparison's own report, and others through its JSON and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from repro_checks import first_difference, one_torch_thread, run_case  # noqa: F401 (a fixture)
from test_decode import no_logits_tap_port
from test_steps import IDS as STEP_IDS
from test_steps import LAYERS as STEP_LAYERS
from test_steps import _matrix as step_matrix

from compare import compare_models
from compare.adapters import resolve_side
from compare.controls import DECODE_CONTROLS, control_side, run_decode_control
from compare.controls.prefill import OWN_CHECKPOINT_CONTROLS, SQUARE_CONTROLS
from compare.controls.steps import expected_tap, places, step_control
from compare.ladder.decode import run_decode
from compare.repro import ReproError, write_repro
from llama_parity.cli import main
from llamaspec import Policy, caps
from llamaspec import taps as tapnames

# tests/test_decode.py's batch: row 1 left-padded by 4, so that slots and positions differ
IDS = np.random.default_rng(0).integers(3, 96, (2, 12))
MASK = np.ones_like(IDS)
MASK[1, :4] = 0
TOKENS = np.random.default_rng(2).integers(3, 96, (2, 8))     # the tokens fed at steps 1..8


@pytest.fixture(scope="module")
def folder(tiny_dir):
    return tiny_dir("gqa")


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    return tmp_path_factory.mktemp("repro_more_run")


def decode_as_reported(control, ref, cand, policy, steps=TOKENS.shape[1]) -> dict:
    """The decode report tests/test_decode.py asserts for `control` (verdict, first step, first
    divergence), as the JSON object write_repro reads, with the tokens fed; an informational
    control (verdict None) as a drift report whose listed step is the control's."""
    step, tap = control.step(IDS.shape[1]), control.tap
    d = None if control.verdict is None else {"tap": tap, "layer": tapnames.layer_of(tap),
                                              "component": control.component, "kind": control.verdict,
                                              "hint": "as tests/test_decode.py asserts"}
    return {"reference": ref.name, "candidate": cand.name, "policy": policy.to_dict(),
            "verdict": control.verdict or "drift", "first_divergence": d, "prompt_tokens": IDS.shape[1],
            "tokens": TOKENS[:, :steps].tolist(), "first_step": None if d is None else step, "taps_step": step}


# ----- the decode path ---------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", list(DECODE_CONTROLS))
def test_planted_cache_bug_repro_shows_it_at_its_step(name, folder, tmp_path, outside):
    """Every decode control at fp32 (cache_in_bf16 too: its float64 run keeps the bf16 cache, a
    difference in the math that the decode comparison reports informationally)."""
    control = DECODE_CONTROLS[name]
    if control.where == "transformers":
        pytest.importorskip("transformers")
    policy = Policy.get("fp32")
    ref, cand = resolve_side("torchref", folder, policy), control_side(control, folder, policy, IDS.shape[1])
    case = write_repro(decode_as_reported(control, ref, cand, policy), ref, cand, folder, tmp_path / "case",
                       inputs=(IDS, MASK), unit=control.tap)
    step = control.step(IDS.shape[1])
    assert case.step.step == step and case.step.slot == IDS.shape[1] + step - 1
    meta = json.loads((case.folder / "case.json").read_text())
    assert meta["columns"] == [case.step.slot] and meta["decode"]["step"] == step
    with np.load(case.folder / "inputs.npz") as z:
        assert z["ids"].shape == (2, case.step.slot + 1) and np.array_equal(z["ids"][:, 12:], TOKENS[:, :step])
    done = run_case(case.folder, outside)
    assert (done.returncode, first_difference(done.stdout)) == (1, control.tap), done.stdout + done.stderr


def test_an_earlier_step_of_a_late_cache_bug_shows_no_difference(folder, tmp_path, outside):
    """The wrapping cache is right until the prompt + LATE_SLOTS slots: its case at step 1 is clean,
    so a decode case judges the step it is written at, not the whole run."""
    control = DECODE_CONTROLS["cache_wraps"]
    policy = Policy.get("fp32")
    ref, cand = resolve_side("torchref", folder, policy), control_side(control, folder, policy, IDS.shape[1])
    case = write_repro(decode_as_reported(control, ref, cand, policy), ref, cand, folder, tmp_path / "case",
                       inputs=(IDS, MASK), step=1)
    done = run_case(case.folder, outside)
    assert (done.returncode, first_difference(done.stdout)) == (0, None), done.stdout + done.stderr
    check = next(line for line in done.stdout.splitlines() if line.startswith("check:"))
    assert "above" not in check, check


@pytest.mark.parametrize("unit", ["layers.0", "layers.1", "embed", "head"])
def test_clean_jaxmodel_decode_repro_is_drift_at_every_unit(unit, folder, tmp_path, outside):
    """The decode comparison's own report (jaxmodel against torchref at bf16, left-padded): each
    unit at its listed step, exit 0, and the script's float64 without a cache agrees with the
    recorded oracle."""
    policy = Policy.get("bf16")
    ref, cand = resolve_side("torchref", folder, policy), resolve_side("jaxmodel", folder, policy)
    report = run_decode(ref, cand, IDS, MASK, policy, steps=3)
    assert report.verdict in ("exact", "drift"), report.summary()
    case = write_repro(report, ref, cand, folder, tmp_path / "case", inputs=(IDS, MASK), unit=unit)
    assert case.step.step == report.taps_step
    done = run_case(case.folder, outside)
    assert (done.returncode, first_difference(done.stdout)) == (0, None), done.stdout + done.stderr
    check = next(line for line in done.stdout.splitlines() if line.startswith("check:"))
    assert "above" not in check, check


def test_the_decode_reports_own_finding_through_its_json_and_the_command_line(folder, tmp_path, outside, capsys):
    """run_decode_control's report of stale_mask, written to JSON: `llama-parity repro` on it (the
    prompt given again) writes the case of its first divergent step, which names layer 1's
    attn_ctx; a prompt that is not the report's is refused, naming both shapes."""
    control = DECODE_CONTROLS["stale_mask"]
    report = run_decode_control(control, folder, IDS, MASK, steps=3)
    assert report.first_step == 1 and report.first_divergence.tap == control.tap, report.summary()
    path = report.to_json(tmp_path / "r-decode.json")
    ref, cand = resolve_side("torchref", folder, "fp32"), control_side(control, folder, "fp32", IDS.shape[1])
    case = write_repro(json.loads(path.read_text()), ref, cand, folder, tmp_path / "case", inputs=(IDS, MASK))
    assert case.unit.name == "layers.1" and case.step.step == 1
    done = run_case(case.folder, outside)
    assert (done.returncode, first_difference(done.stdout)) == (1, control.tap), done.stdout
    with pytest.raises(ReproError, match=r"after a prompt of 12 slots .* the inputs given are 2 x 10"):
        write_repro(report, ref, cand, folder, tmp_path / "other", inputs=(IDS[:, 2:], MASK[:, 2:]))
    with pytest.raises(ReproError, match=r"step 4: the report decoded steps 1\.\.3"):
        write_repro(report, ref, cand, folder, tmp_path / "other", inputs=(IDS, MASK), step=4)
    with pytest.raises(ReproError, match=r"computed on other inputs \(2 x 12 slots, 20 real tokens"):
        write_repro(report, ref, cand, folder, tmp_path / "other", inputs=(IDS + 1, MASK))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_prefill_report_records_its_inputs_and_the_repro_refuses_others(folder, tmp_path, outside):
    """Report.inputs: the shape and the SHA-256 of the real tokens and the mask; a padding slot's id
    is not part of it (the math does not read it). write_repro refuses inputs the report was not
    computed on, and takes the report's again, whatever their padding slots hold."""
    from compare.controls import CONTROLS, run_control
    control = CONTROLS["rmsnorm_eps"]
    ids, mask = IDS.copy(), MASK.copy()
    report = run_control(control, folder, ids, mask)
    assert report.inputs["rows"] == 2 and report.inputs["tokens"] == 12 and report.inputs["real_tokens"] == 20
    assert len(report.inputs["sha256"]) == 64
    # the streamed ladder (both sides named) records the same
    streamed = compare_models("torchref", "torchref", folder, inputs=(ids, mask))
    assert streamed.run["path"] == "streamed" and streamed.inputs == report.inputs
    ref, cand = resolve_side("torchref", folder, "fp32"), control.side(folder)
    other = ids.copy()
    other[0, -1] += 1
    with pytest.raises(ReproError, match="computed on other inputs"):
        write_repro(report, ref, cand, folder, tmp_path / "a", inputs=(other, mask))
    ids[1, :4] = 0      # row 1's padding slots (mask 0): another pad id
    case = write_repro(report.to_dict(), ref, cand, folder, tmp_path / "b", inputs=(ids, mask))
    done = run_case(case.folder, outside)
    assert (done.returncode, first_difference(done.stdout)) == (1, control.expected_tap), done.stdout


def test_a_decode_head_case_holds_the_logits_a_port_without_the_tap_returns(folder, tmp_path, outside):
    """tests/test_decode.py's port without a "logits" tap, its steps' logits scaled by 1.01: the
    decode comparison finds it at the logits, and the head's case at that step shows it there."""
    policy = Policy.get("fp32")
    ref, cand = resolve_side("torchref", folder, policy), no_logits_tap_port(folder, policy)
    report = run_decode(ref, cand, IDS, MASK, policy, steps=2)
    assert report.first_divergence.tap == "logits", report.summary()
    case = write_repro(report, ref, cand, folder, tmp_path / "case", inputs=(IDS, MASK))
    assert case.unit.name == "head" and "logits" in case.taps
    done = run_case(case.folder, outside)
    assert (done.returncode, first_difference(done.stdout)) == (1, "logits"), done.stdout + done.stderr


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_command_line_writes_a_decode_case_from_compare_and_from_its_json(folder, tmp_path, outside, capsys):
    """`compare --decode 2 --json` writes the decode report beside the prefill's; `repro` on it, with
    the same --random-tokens, writes the case of its listed step (no finding: jaxmodel is clean),
    and repro.py shows no difference."""
    code = main(["compare", str(folder), "--random-tokens", "2x12", "--decode", "2", "--json",
                 str(tmp_path / "r.json"), "--no-files"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    code = main(["repro", str(tmp_path / "r-decode.json"), str(folder), "--random-tokens", "2x12", "--out",
                 str(tmp_path / "case"), "--unit", "head"])
    out = capsys.readouterr().out
    assert code == 0 and "repro case of head at decode step" in out, out
    done = run_case(tmp_path / "case", outside)
    assert (done.returncode, first_difference(done.stdout)) == (0, None), done.stdout + done.stderr


# ----- the device -------------------------------------------------------------------

DEVICE_CASE = """
import sys
import numpy as np
from compare.controls.device import LAYER, avx2_bug
from compare.repro import write_repro
from llamaspec import Policy
from llamaspec.taps import component_of
folder, out = sys.argv[1], sys.argv[2]
port = avx2_bug(folder, "fp32")
assert port.planted, "the process does not run under the avx2 cap"
tap = f"layers.{LAYER}.attn_norm"
report = {"reference": "torchref", "candidate": port.name, "policy": Policy.get("fp32").to_dict(),
          "verdict": "semantic", "first_divergence": {"tap": tap, "layer": LAYER, "component": component_of(tap),
                                                     "kind": "semantic", "hint": "probe where --circumstance device"}}
ids = np.random.default_rng(0).integers(3, 96, (2, 16))
write_repro(report, "torchref", port, folder, out, inputs=ids)
"""


@pytest.mark.skipif(not caps.x86() or "avx2" not in caps.honoured(),
                    reason="the caps are x86 code paths, and this CPU cannot run the avx2 cap")
def test_the_device_controls_repro_is_written_under_the_cap_and_shows_it(folder, tmp_path, outside):
    """compare/controls/device.py: the port is wrong only where its plan reads the avx2 cap. Its case
    is written in a process under that cap (llamaspec.caps, as probe where's second process) and
    names layer 1's attn_norm; its README says under which caps it was captured."""
    env = {**os.environ, **dict(caps.CAPS["avx2"].variables)}
    done = subprocess.run([sys.executable, "-c", DEVICE_CASE, str(folder), str(tmp_path / "case")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ran = run_case(tmp_path / "case", outside)
    assert (ran.returncode, first_difference(ran.stdout)) == (1, "layers.1.attn_norm"), ran.stdout + ran.stderr
    assert "ATEN_CPU_CAPABILITY=avx2" in (tmp_path / "case" / "README.txt").read_text()


# ----- steps below the policy, and controls on checkpoints of their own ------------------------------

def as_reported(control, ref, cand, policy) -> dict:
    """The prefill report the control's test asserts (verdict and first tap), as write_repro reads it."""
    tap = control.expected_tap
    d = None if tap is None else {"tap": tap, "layer": tapnames.layer_of(tap), "component": tapnames.component_of(tap),
                                  "kind": control.verdict, "hint": "as the control's test asserts"}
    return {"reference": ref.name, "candidate": cand.name, "policy": policy.to_dict(),
            "verdict": control.verdict, "first_divergence": d}


def _every_step_control():
    """tests/test_steps.py's whole matrix (it runs the ladder on a cover by default; a case is cheap)."""
    for p in step_matrix():
        yield pytest.param(*p.values, id=p.id, marks=[pytest.mark.filterwarnings("ignore::UserWarning")])


@pytest.mark.parametrize("step,where,policy,place", list(_every_step_control()))
def test_step_below_the_policy_repro_shows_it(step, where, policy, place, tiny_dir, tmp_path, outside):
    """Every step control: a softmax, norm statistics, RoPE
    angles or a matmul's sums in bf16 shows at its tap, in the control's float64 twin, which keeps
    the bf16 step ("precision even in the float64 run", the ladder's hint). Where the step is the
    policy's own (a bf16 softmax in transformers under
    bf16: NO_OP_AT_POLICY) the ladder says drift, and the repro still names the tap: the control's
    float64 twin keeps the bf16 cast (steps.py says so), and repro.py holds a float64 run to the
    float64 gate without the ladder's dtype-noise test (docs/repro.md)."""
    if where == "transformers":
        pytest.importorskip("transformers")
    folder = tiny_dir("gqa", head_dim=32, num_hidden_layers=STEP_LAYERS)
    control = step_control(step, where, policy, place, STEP_LAYERS)
    pol = Policy.get(policy)
    ref, cand = resolve_side("torchref", folder, pol), control.side(folder)
    tap = expected_tap(step, places(step, STEP_LAYERS)[place], place)[0]
    assert control.expected_tap in (None, tap)
    case = write_repro(as_reported(control, ref, cand, pol), ref, cand, folder, tmp_path / "case", inputs=STEP_IDS,
                       unit=tap)
    done = run_case(case.folder, outside)
    assert (done.returncode, first_difference(done.stdout)) == (1, tap), done.stdout + done.stderr
    assert "the candidate's float64 run differs from float64" in done.stdout, done.stdout


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", [*OWN_CHECKPOINT_CONTROLS, *SQUARE_CONTROLS])
def test_controls_on_checkpoints_of_their_own_repro_shows_them(name, tiny_dir, tmp_path, outside):
    """q_proj / k_proj swapped (MHA), q_proj's bias dropped (attention biases), o_proj transposed
    (square), on the checkpoints tests/test_structure.py runs them on."""
    pytest.importorskip("transformers")
    config, control = OWN_CHECKPOINT_CONTROLS.get(name) or ("gqa", SQUARE_CONTROLS[name])
    folder = tiny_dir(config)
    pol = Policy.get(control.policy)
    ref, cand = resolve_side("torchref", folder, pol), control.side(folder)
    case = write_repro(as_reported(control, ref, cand, pol), ref, cand, folder, tmp_path / "case",
                       inputs=np.random.default_rng(0).integers(3, 96, (2, 48)))
    done = run_case(case.folder, outside)
    assert (done.returncode, first_difference(done.stdout)) == (1, control.expected_tap), done.stdout + done.stderr
