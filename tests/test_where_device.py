"""probe where, device: one implementation on this CPU and on another device (this CPU capped to
an older instruction set in a second process, llamaspec.caps; or the GPU), judged tap by tap
against each side's own float64 twin. Clean runs never read semantic (rounding differences
are drift or precision, and which one depends on the CPU: not asserted); a bug that shows only
under the cap is semantic at its tap; a cap this CPU lacks and a GPU this machine lacks are
clear errors, before anything loads."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compare.controls.device import FACTORY, LAYER, TRIGGER
from compare.probes import load_model
from compare.probes.where import Comparison, Op, Parting, TapDiff, WhereResult, gpu_report, probe_where, resolve_device
from compare.probes.where_text import explain_where, hint
from compare.probes.where_worker import check_under
from compare.probes.worker import run_job
from compare.report.where import format_table, render_html, to_document
from llama_parity.cli import main as cli
from llamaspec import caps, cpuinfo
from llamaspec.taps import all_taps

ROOT = Path(__file__).resolve().parents[1]
LAPTOP = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})     # an AVX2 laptop's flags

needs_avx2 = pytest.mark.skipif(not caps.x86() or "avx2" not in caps.honoured(),
                                reason="the caps are x86 code paths, and this CPU cannot run the avx2 cap")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return tiny_dir("gqa")


def kinds(result) -> set:
    return {t.kind for c in result.comparisons for t in c.taps}


@pytest.fixture(scope="module")
def fp64_avx2(tiny):
    return probe_where("torchref", "device", checkpoint=tiny, policy="fp64", device="avx2")


# ----- clean runs under the avx2 cap -------------------------------------------------------------

@needs_avx2
def test_torchref_fp64_under_the_avx2_cap_is_exact_or_drift_at_every_tap(fp64_avx2):
    (c,) = fp64_avx2.comparisons
    assert [t.tap for t in c.taps] == list(all_taps(2))
    assert kinds(fp64_avx2) <= {"exact", "drift"}
    assert c.group == "device" and c.b_run == "cap avx2"


@needs_avx2
def test_the_report_names_both_sides_and_what_each_ran(fp64_avx2):
    a, b = fp64_avx2.sides["A"], fp64_avx2.sides["B"]
    assert a["label"] == caps.this_cpu(os.environ) and b["label"] == "cap avx2 (a second process)"
    assert a["label"] in fp64_avx2.comparisons[0].name and b["label"] in fp64_avx2.comparisons[0].name
    ea, eb = a["environment"], b["environment"]
    # the cap acted on the second process: torch's kernels, the plan's record of the settings it read
    assert eb["torch cpu capability"] == "AVX2" and eb["model plan library torch cpu capability"] == "AVX2"
    assert all(f"{k}={v}" in eb["isa caps"] for k, v in caps.CAPS["avx2"].variables if k != "XLA_FLAGS")
    assert "LLAMA_PARITY_KERNEL_ISA=avx2" in eb["model plan settings"]
    assert ea["model plan backend"] == eb["model plan backend"] == "fast"
    assert fp64_avx2.to_dict()["sides"]["B"]["label"] == b["label"]


@needs_avx2
def test_torchref_bf16_fast_under_the_avx2_cap_is_never_semantic(tiny):
    r = probe_where("torchref", "device", checkpoint=tiny, policy="bf16", device="avx2")
    assert "semantic" not in kinds(r)
    assert r.sides["B"]["environment"]["model plan policy"] == "bf16"


@needs_avx2
@pytest.mark.parametrize("policy", ["fp64", "bf16"])
def test_jaxmodel_under_the_avx2_cap_is_never_semantic(tiny, policy):
    r = probe_where("jaxmodel", "device", checkpoint=tiny, policy=policy, device="avx2")
    assert kinds(r) <= ({"exact", "drift"} if policy == "fp64" else {"exact", "drift", "precision"})
    assert r.sides["B"]["environment"]["model plan library xla max isa"] == "AVX2"


@needs_avx2
def test_the_second_process_starts_under_the_cap_and_the_worker_only_checks_it(tmp_path):
    check_under("avx2", caps.environ("avx2", {}))        # the table's variables, XLA's among XLA_FLAGS
    with pytest.raises(RuntimeError, match="without the cap 'avx2' in force.*ONEDNN_MAX_CPU_ISA=AVX2"):
        check_under("avx2", {"ATEN_CPU_CAPABILITY": "avx2"})
    # a capped job in a process started without the cap's variables is refused before it loads anything
    job = {"spec": {"impl": "torchref", "checkpoint": str(tmp_path / "none")}, "cap": "avx2"}
    env = {k: "" for k in caps.VARIABLES}        # whatever this process runs under, the child lacks the cap
    with pytest.raises(RuntimeError, match="(?s)where: a capped job failed.*without the cap 'avx2' in force"):
        run_job("compare.probes.where_worker", job, tmp_path, 120, "where: a capped job", env=env)


# ----- a bug that shows only under the cap -------------------------------------------------------

@needs_avx2
def test_a_bug_only_under_the_cap_is_semantic_at_its_layer_and_tap(tiny):
    if os.environ.get(TRIGGER[0]) == TRIGGER[1]:
        pytest.skip(f"this process runs under {TRIGGER[0]}={TRIGGER[1]} already: the bug is on both sides")
    pm = load_model("torchref+avx2 bug", tiny, "fp32", factory=FACTORY)
    r = probe_where(pm, "device", device="avx2")
    (c,) = r.comparisons
    tap = f"layers.{LAYER}.attn_norm"
    assert r.verdict == "semantic" and c.first_beyond.tap == tap and c.first_beyond.kind == "semantic"
    assert c.first_beyond.layer == LAYER and c.first_beyond.op.name == "input rms_norm"
    d = next(t for t in c.taps if t.tap == tap)
    assert d.twin_rel > d.twin_floor      # the fp64 rung keeps it: B's own twin ran under the cap
    before = c.taps[:[t.tap for t in c.taps].index(tap)]
    assert before and all(t.kind in ("exact", "drift") for t in before)


# ----- clear errors ------------------------------------------------------------------------------

def test_a_cap_a_cpu_lacks_is_a_clear_error():
    with pytest.raises(caps.DeviceError, match=r"'avx512'.*lacks avx512f, avx512bw, avx512vl, avx512dq.*"
                                               r"honour: avx2, baseline"):
        caps.check("avx512", LAPTOP)
    assert caps.check("avx2", LAPTOP).name == "avx2" and caps.level(LAPTOP) == "avx2"
    with pytest.raises(caps.DeviceError, match="unknown instruction-set cap 'sse9'.*avx512, avx2, baseline"):
        caps.check("sse9")


def test_probe_where_and_the_cli_refuse_a_cap_this_cpu_lacks_before_loading(tiny, monkeypatch, capsys):
    monkeypatch.setattr(caps, "x86", lambda: True)
    monkeypatch.setattr(cpuinfo, "name_and_flags", lambda: ("an AVX2 laptop", LAPTOP))
    with pytest.raises(caps.DeviceError, match="an AVX2 laptop lacks avx512f"):
        probe_where("torchref", "device", checkpoint=tiny, device="avx512")
    rc = cli(["probe", "where", str(tiny), "--circumstance", "device", "--device-cap", "avx512"])
    assert rc == 2 and "cap 'avx512'" in capsys.readouterr().err


@pytest.mark.parametrize("impl", ["torchref", "jaxmodel"])
def test_the_gpu_on_a_machine_without_one_is_a_clear_error(tiny, impl, capsys):
    if gpu_report(impl)[0] is not None:
        pytest.skip("this machine has a GPU")
    said = "torch.cuda.is_available\\(\\) is False" if impl == "torchref" else "JAX reports no GPU"
    with pytest.raises(caps.DeviceError, match=f"no GPU to compare this CPU with: .*{said}"):
        probe_where(impl, "device", checkpoint=tiny, device="gpu")
    rc = cli(["probe", "where", str(tiny), "--impl", impl, "--circumstance", "device", "--other-device", "gpu"])
    assert rc == 2 and "no GPU" in capsys.readouterr().err


def test_the_default_other_device_is_the_gpu_else_the_avx2_cap():
    has_gpu = gpu_report("torchref")[0] is not None
    assert resolve_device("torchref") == ("gpu" if has_gpu else caps.DEFAULT)


def test_the_cli_refuses_device_flags_elsewhere_and_together(tiny, capsys):
    assert cli(["probe", "where", str(tiny), "--device-cap", "avx2"]) == 2
    assert "only --circumstance device" in capsys.readouterr().err
    assert cli(["probe", "where", str(tiny), "--circumstance", "device", "--other-device", "gpu",
                "--device-cap", "avx2"]) == 2
    assert "give one" in capsys.readouterr().err


# ----- the one table of caps ---------------------------------------------------------------------

def test_the_caps_live_in_one_table_that_make_reads():
    assert "ATEN_CPU_CAPABILITY" not in (ROOT / "Makefile").read_text()     # no second copy
    env = caps.environ("avx2", {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX512"})
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    bad = subprocess.run([sys.executable, "-m", "llamaspec.caps", "sse9"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown instruction-set cap 'sse9'" in bad.stderr


@needs_avx2
def test_python_m_llamaspec_caps_prints_the_env_line():
    out = subprocess.run([sys.executable, "-m", "llamaspec.caps", "avx2"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == caps.CAPS["avx2"].line()


# ----- the CLI -----------------------------------------------------------------------------------

@needs_avx2
def test_cli_probe_where_device_prints_both_sides_and_writes_them(tiny, tmp_path, capsys):
    out = tmp_path / "device.json"
    rc = cli(["probe", "where", str(tiny), "--circumstance", "device", "--device-cap", "avx2", "--policy", "fp32",
              "--no-colour", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "B: cap avx2 (a second process)" in text and f"A: {caps.this_cpu(os.environ)}" in text
    assert "torch cpu capability:" in text      # among the lines where the two records differ
    (res,) = json.loads(out.read_text())["results"]
    assert res["circumstance"] == "device" and "ATEN_CPU_CAPABILITY=avx2" in res["sides"]["B"]["environment"][
        "isa caps"]


# ----- the words: a difference within drift across devices is not a batch-invariance matter ------

def drift_result(circumstance: str, sides=None) -> WhereResult:
    """A result whose one comparison first differs at layer 1's o_proj and stays within drift."""
    tap = "layers.1.attn_out"
    d = TapDiff(tap, 1, "attn", "attn_out", "drift", "drift", False, 3.0, 1e-7, 2e-8, 1e-7, 1.2e-7, 3e-7, 1e-16,
                1e-14, 0, ratio=0.4, first_position=0)
    part = Parting(tap, 1, "attn", "attn_out", Op("o_proj", "product", 32, 32), "drift", 0, True, 64, 64)
    c = Comparison(f"B=4 mixed, row 0: A vs B ({circumstance})", circumstance, "A", "B", 0, 0, [4, 16], [4, 16], 6,
                   False, verdict="drift", taps=[d], first_difference=part)
    return WhereResult("where", circumstance, "torchref fp32 default", "torchref", "fp32", "default", False, 6,
                       "drift", [c], 2.0, 1e-7, 1e-14, sides=sides or {})


SIDES = {"A": {"label": "this CPU (avx512_bf16)", "environment": {"torch cpu capability": "AVX512", "torch": "2.6"}},
         "B": {"label": "cap avx2 (a second process)",
               "environment": {"torch cpu capability": "AVX2", "torch": "2.6", "isa caps": "ATEN_CPU_CAPABILITY=avx2"}}}


def test_drift_across_devices_is_not_sent_to_the_batch_invariant_mode():
    device, batch = drift_result("device", SIDES), drift_result("batch")
    assert "no mode makes two devices' sums bitwise equal" in hint(device)
    assert "use the batch-invariant mode" not in hint(device) and "use the batch-invariant mode" in hint(batch)
    assert "two devices" not in hint(batch)
    assert hint(device) in explain_where(device)
    exact = dataclasses.replace(device, verdict="exact")
    assert "the two devices computed the same bits" in hint(exact)


def test_the_table_and_the_page_show_the_two_sides_and_where_their_records_differ():
    device, batch = drift_result("device", SIDES), drift_result("batch")
    text = format_table(device)
    assert "A: this CPU (avx512_bf16)" in text and "B: cap avx2 (a second process)" in text
    assert "torch cpu capability: AVX512 | AVX2" in text and "isa caps: - | ATEN_CPU_CAPABILITY=avx2" in text
    assert "torch: 2.6" not in text                    # the same on both sides
    assert "no mode makes two devices' sums bitwise equal" in text
    page = render_html(to_document(device.to_dict()))
    assert "The two sides" in page and "cap avx2 (a second process)" in page and "AVX512" in page
    assert "two sides" not in format_table(batch) and "The two sides" not in render_html(to_document(batch))
