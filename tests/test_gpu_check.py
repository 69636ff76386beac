"""The GPU check's dry run (bench/gpu_check.sh --dry-run): the whole command on the CPU with a tiny
checkpoint, the portable invariant path forced, the "GPU" steps on the CPU. Its JSON has every
section a GPU run writes, with real content: the invariant mode bitwise in every case through the
portable path (what the code guarantees on any device), the default mode's variance as numbers,
the determinism settings recorded, each step's status and time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]
CASE_KEYS = {"name", "group", "batch", "row", "bitwise", "max_abs"}
GROUPS = {"batch", "padded right", "padded left", "prefill", "decode"}


def _dry_run(tmp_path, *extra, shell=False, **env) -> dict:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env}
    cmd = (["bash", str(ROOT / "bench" / "gpu_check.sh"), str(out), "--dry-run"] if shell else
           [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out), *extra])
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads((out / gpu_check.JSON_NAME).read_text())
    assert "GPU check (DRY RUN on the CPU)" in r.stdout      # the table, printed
    return doc


def _check_modes(section: dict, mode: str, impls) -> None:
    sizes = gpu_check.DRY
    assert section["policy"] == sizes.policy and section["batch_sizes"] == list(sizes.batch_sizes)
    assert [e["impl"] for e in section["models"]] == list(impls)
    for e in section["models"]:
        assert e["error"] is None, e["error"]
        assert e["mode"] == mode and e["device"] == "cpu"
        assert {c["group"] for c in e["cases"]} == GROUPS
        assert all(set(c) == CASE_KEYS for c in e["cases"])
        # the target at the first, middle and last row of each batch
        assert {c["row"] for c in e["cases"] if c["batch"] == 8} == {0, 4, 7}
        assert e["total"] == len(e["cases"]) == sum(len({0, B // 2, B - 1}) for B in sizes.batch_sizes) + \
            2 * 3 * len(sizes.padded_sizes) + 2 * 3 * len(sizes.decode_sizes)
        assert all(isinstance(c["max_abs"], float) and math.isfinite(c["max_abs"]) for c in e["cases"])
        if mode == "invariant":
            # the portable path (forced by the dry run) is bitwise in every case: what it guarantees
            assert e["path"].startswith("portable"), e["path"]
            assert e["plan"]["backend"] == "invariant"
            assert e["bitwise"] == e["total"] and e["max_abs"] == 0.0, [c for c in e["cases"] if not c["bitwise"]]
        else:
            assert e["plan"]["backend"] == "fast" and 0 <= e["bitwise"] <= e["total"]
            rerun = e["rerun"]
            assert isinstance(rerun["bitwise"], bool) and math.isfinite(rerun["max_abs"])
            assert rerun["determinism"]["torch deterministic algorithms"] in ("off", "on", "on, warn only")


def test_the_dry_run_of_the_invariance_steps(tmp_path):
    """The invariant and default steps of the command, both models: the invariant section bitwise
    through the portable path, the default one's variance as numbers with its run-to-run check and
    the determinism settings that were on; each step's status."""
    doc = _dry_run(tmp_path, "--steps", "invariant", "default")
    assert doc["dry_run"] is True and set(doc["steps"]) == {"invariant", "default"}
    assert all(s["status"] == "ok" and s["seconds"] <= s["limit_s"] for s in doc["steps"].values())
    _check_modes(doc["invariant"], "invariant", gpu_check.IMPLS)
    _check_modes(doc["default"], "default", gpu_check.IMPLS)
    assert doc["default"]["determinism"]["gpu settings"].startswith("no GPU")
    assert any(r[0] == "invariant" and "bitwise" in r[2] for r in doc["summary"])


@pytest.mark.slow
def test_the_whole_dry_run_has_every_section(tmp_path):
    """bash bench/gpu_check.sh --dry-run: every step ok, every section with the keys a GPU run
    writes, and content: the device comparison judged, the roofline's fractions and the
    sharding's rows numbers, the summary table's rows."""
    doc = _dry_run(tmp_path, shell=True, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    assert list(doc["steps"]) == list(gpu_check.STEPS)
    assert all(s["status"] == "ok" for s in doc["steps"].values()), doc["steps"]
    for step in gpu_check.STEPS:
        assert step in doc, step
    assert doc["environment"]["record"]["gpu"] == "none" and doc["environment"]["torch device"] == "cpu"
    assert doc["determinism"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"     # as the command ran
    assert doc["determinism"]["XLA_FLAGS --xla_gpu_deterministic_ops"].startswith("unset")
    _check_modes(doc["invariant"], "invariant", gpu_check.IMPLS)
    _check_modes(doc["default"], "default", gpu_check.IMPLS)
    for e in doc["cost"]["rows"]:
        assert e["error"] is None and e["path"].startswith("portable")
        assert [r["batch"] for r in e["rows"]] == list(gpu_check.DRY.cost_batches)
        for r in e["rows"]:
            assert set(r["prefill_ms"]) == set(r["decode_ms_per_token"]) == {"default", "invariant"}
            assert r["ratio"]["invariant"]["prefill"] > 0 and r["ratio"]["invariant"]["decode"] > 0
    for e in doc["device"]["models"]:
        # the CPU against itself in a dry run: the judge's kind and the numbers are there
        assert e["error"] is None and e["kind"] in ("exact", "drift", "precision", "semantic")
        assert math.isfinite(e["max_abs"]) and 0 < e["cpu_vs_fp64"] < 0.1
    assert doc["device"]["where"] is not None
    rows = doc["roofline"]["rows"]
    assert {r["impl"] for r in rows} == {"torchref", "jaxmodel"} and all(r["x_roofline"] > 0 for r in rows)
    assert doc["roofline"]["note"] == gpu_check.DRY_PEAKS_NOTE
    shard = doc["sharding"]["rows"]
    assert shard and all(r["logits_bitwise_one_device"] for r in shard if r["variant"].startswith("invariant"))
    table = {r[0] for r in doc["summary"]}
    assert {"steps", "determinism", "invariant", "default", "cost", "device", "roofline", "sharding"} <= table
