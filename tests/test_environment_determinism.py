"""What decides a GPU's numbers is recorded (compare.environment.determinism_settings): XLA's
determinism flags, cuBLAS' workspace setting, torch's TF32 state, its deterministic-algorithms
flag, cuDNN's choices, JAX's default matmul precision; read only, in every report's environment
and in the run-to-run check's JSON, on a machine without a GPU too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compare.environment import NO_GPU, determinism_settings, environment, xla_flags

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def torch_flags():
    """torch's process-wide flags as they were, restored after the test changes them."""
    mm, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (mm.fp32_precision, cudnn.deterministic, cudnn.benchmark, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), mm.allow_bf16_reduced_precision_reduction)
    yield
    (mm.fp32_precision, cudnn.deterministic, cudnn.benchmark, enabled, warn_only,
     mm.allow_bf16_reduced_precision_reduction) = saved
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def test_xla_flags_are_read_by_name():
    got = xla_flags("--xla_gpu_deterministic_ops --xla_gpu_autotune_level=4 --xla_gpu_autotune_level=0")
    assert got == {"--xla_gpu_deterministic_ops": "true", "--xla_gpu_autotune_level": "0"}
    assert xla_flags("") == {}


def test_the_record_follows_the_environment_variables(monkeypatch):
    """XLA_FLAGS (whole, and each determinism flag by name, other GPU kernel flags called out) and
    the CUDA libraries' own variables, as set; unset ones say so. uses_jax=False: JAX is not
    started here with these flags (they would stay for the whole test process)."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = determinism_settings(uses_jax=False)
    assert before["XLA_FLAGS"] == "(unset)" and before["CUBLAS_WORKSPACE_CONFIG"] == "(unset)"
    assert before["XLA_FLAGS --xla_gpu_deterministic_ops"].startswith("unset")
    flags = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0 --xla_gpu_enable_cublaslt=false"
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    after = determinism_settings(uses_jax=False)
    assert after["XLA_FLAGS"] == flags
    assert after["XLA_FLAGS --xla_gpu_deterministic_ops"] == "true"
    assert after["XLA_FLAGS --xla_gpu_autotune_level"] == "0"
    assert after["XLA_FLAGS --xla_gpu_enable_triton_gemm"].startswith("unset")
    assert after["XLA_FLAGS other GPU kernel flags"] == "--xla_gpu_enable_cublaslt=false"
    assert after["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_the_record_follows_torchs_flags(torch_flags):
    """torch's deterministic algorithms (and warn-only), cuDNN's deterministic and benchmark, the
    TF32 state and the 16-bit reductions, as they are at the call (restored by the fixture)."""
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.matmul.fp32_precision = "none"
    off = determinism_settings(uses_jax=False)
    assert off["torch deterministic algorithms"] == "off"
    assert off["torch cuda matmul fp32_precision"] == "none"
    assert isinstance(off["torch cuda matmul allow_tf32"], bool)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = not off["torch cudnn deterministic"]
    torch.backends.cudnn.benchmark = not off["torch cudnn benchmark"]
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = \
        not off["torch bf16 reduced-precision reduction"]
    on = determinism_settings(uses_jax=False)
    assert on["torch deterministic algorithms"] == "on, warn only"
    assert on["torch cudnn deterministic"] is not off["torch cudnn deterministic"]
    assert on["torch cudnn benchmark"] is not off["torch cudnn benchmark"]
    assert on["torch cuda matmul fp32_precision"] == "tf32"
    # torch refuses to read the legacy flag once the new API set it: the record says where it was set
    assert on["torch cuda matmul allow_tf32"] == "(set through fp32_precision)"
    assert on["torch bf16 reduced-precision reduction"] is not off["torch bf16 reduced-precision reduction"]
    torch.use_deterministic_algorithms(True)
    assert determinism_settings(uses_jax=False)["torch deterministic algorithms"] == "on"


def test_reading_the_record_changes_nothing(torch_flags):
    """Read only: torch's flags and the environment are the same after the call."""
    determinism_settings()      # JAX's import sets variables of its own (TF_CPP_MIN_LOG_LEVEL): before the snapshot
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.use_deterministic_algorithms(True, warn_only=True)
    env_before = dict(os.environ)
    first = determinism_settings()
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert dict(os.environ) == env_before and determinism_settings() == first


def test_every_report_environment_holds_the_record():
    """environment() (every report's) holds the whole record, one function's: no second reader."""
    env, record = environment("fp32"), determinism_settings()
    assert {k: env[k] for k in record} == record
    assert record["jax backend"] == "cpu" and "jax_default_matmul_precision" in record
    if not torch.cuda.is_available():
        assert record["gpu settings"] == NO_GPU


def test_a_fresh_process_records_its_own_settings(tmp_path):
    """JAX's default matmul precision and XLA's flags as a process starts with them (JAX reads
    them once, at its start: a child process), with the CUDA variables."""
    code = ("import json, sys; from compare.environment import determinism_settings as d; "
            "json.dump(d(), open(sys.argv[1], 'w'))")
    env = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest", "CUBLAS_WORKSPACE_CONFIG": ":16:8",
           "XLA_FLAGS": "--xla_gpu_deterministic_ops=true", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d.json")], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "d.json").read_text())
    assert got["jax_default_matmul_precision"] == "highest"
    assert got["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert got["XLA_FLAGS --xla_gpu_deterministic_ops"] == "true"


def test_the_run_to_run_checks_json_says_which_settings_were_on(tiny_dir, tmp_path, monkeypatch, torch_flags):
    """`probe determinism` (the default mode's run-to-run check) writes the record in its JSON's
    environment: the settings that were on while it ran."""
    from llama_parity.cli import main
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    out = tmp_path / "p.json"
    rc = main(["probe", "determinism", "--checkpoint", str(tiny_dir("gqa")), "--impl", "torchref",
               "--repeats", "1", "--processes", "0", "--length", "8", "--json", str(out), "--no-colour"])
    assert rc == 0
    env = json.loads(out.read_text())["meta"]["environment"]
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert env["torch deterministic algorithms"] == "on, warn only"
    assert set(determinism_settings()) <= set(env)
