"""What decides determinism is recorded in the results themselves (issue 61): probe determinism's
details and probe where's rerun carry this process's compare.environment.determinism_settings,
and a rerun that differs names the settings that decide it on this device; the CLI's
meta.environment carries the plans of the models it loaded (not the default CPU plans)."""

import dataclasses
import json

import numpy as np
import pytest

from compare.environment import NO_GPU, determinism_settings
from compare.probes import probe_determinism
from compare.probes.models import ProbeModel, fp64_twin, load_model
from compare.probes.where import Comparison, Op, Parting, TapDiff, probe_where
from compare.probes.where_text import hint, rerun_settings
from llama_parity.cli import main


@pytest.fixture(scope="module")
def ck(tiny_dir):
    return tiny_dir("gqa")


@pytest.fixture(scope="module")
def torch_fp32(ck):
    return load_model("torchref", ck, "fp32")


# ----- probe determinism --------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["torchref", "jaxmodel"])
def test_determinism_details_carry_the_settings_of_this_process(ck, impl):
    r = probe_determinism(load_model(impl, ck, "fp32"), repeats=1, processes=0, batch=2, length=8)
    settings = r.details["determinism settings"]
    assert settings == determinism_settings(uses_jax=impl == "jaxmodel")
    assert ("jax backend" in settings) == (impl == "jaxmodel")       # JAX's lines for a JAX model only
    assert json.loads(json.dumps(r.to_dict()))["details"]["determinism settings"] == settings
    if r.verdict == "exact":
        assert "decides a rerun" not in r.hint and "no GPU here" not in r.hint


def test_a_rerun_that_differs_names_the_settings_in_its_hint(torch_fp32):
    """Positive control: a model whose third call adds a per-entry offset (state left over)."""
    m = torch_fp32.model

    class Stateful:
        calls = 0
        policy, cfg = "fp32", m.cfg

        def __call__(self, tokens, attention_mask=None):
            out = np.asarray(torch_fp32.logits(tokens, attention_mask)).copy()
            self.calls += 1
            stale = np.float32(1e-2) * np.cos(np.arange(out.shape[-1], dtype=np.float32))
            return out if self.calls <= 2 else out + stale

    r = probe_determinism(ProbeModel(Stateful(), oracle=fp64_twin(m)), repeats=2, processes=0, length=8)
    assert r.verdict == "semantic"
    said = rerun_settings(r.details["determinism settings"])
    assert said and said in r.hint
    if r.details["determinism settings"]["gpu settings"] == NO_GPU:
        assert "no GPU here" in r.hint


# ----- the words, on records ------------------------------------------------------------------------

GPU_TORCH = {"gpu settings": "apply: NVIDIA H100", "torch deterministic algorithms": "off",
             "CUBLAS_WORKSPACE_CONFIG": "(unset)", "torch cudnn deterministic": False, "torch cudnn benchmark": False,
             "XLA_FLAGS --xla_gpu_deterministic_ops": "unset (XLA's default)"}


def test_rerun_settings_name_what_decides_a_rerun_on_the_record_device():
    torch_gpu = rerun_settings(GPU_TORCH)
    assert "NVIDIA H100" in torch_gpu and "torch deterministic algorithms=off" in torch_gpu
    assert "CUBLAS_WORKSPACE_CONFIG=(unset)" in torch_gpu and "xla_gpu" not in torch_gpu   # a torch record
    jax_gpu = rerun_settings({**GPU_TORCH, "jax backend": "gpu"})
    assert "--xla_gpu_deterministic_ops=unset" in jax_gpu and "CUBLAS" not in jax_gpu
    cpu = rerun_settings({**GPU_TORCH, "gpu settings": NO_GPU})
    assert "no GPU here" in cpu and "torch threads" not in cpu and "CUBLAS" not in cpu
    assert "torch threads=2" in rerun_settings({"gpu settings": NO_GPU, "torch threads": 2})
    other = rerun_settings(GPU_TORCH, {"fresh 1": {**GPU_TORCH, "torch deterministic algorithms": "on"},
                                       "fresh 2": dict(GPU_TORCH)})
    assert "in fresh 1: torch deterministic algorithms off vs on" in other
    assert "in fresh 2: the same settings" in other
    assert rerun_settings({}) == ""


# ----- probe where, rerun -------------------------------------------------------------------------

def _drifting(r):
    """r with one comparison that first differs at layer 1's o_proj and stays within drift."""
    tap = "layers.1.attn_out"
    d = TapDiff(tap, 1, "attn", "attn_out", "drift", "drift", False, 3.0, 1e-7, 2e-8, 1e-7, 1.2e-7, 3e-7, 1e-16,
                1e-14, 0, ratio=0.4, first_position=0)
    part = Parting(tap, 1, "attn", "attn_out", Op("o_proj", "product", 32, 32), "drift", 0, True, 64, 64)
    c = Comparison("repeat 1 in this process", "repeat", "A", "B", 0, 0, [4, 16], [4, 16], 6, False,
                   verdict="drift", taps=[d], first_difference=part)
    return dataclasses.replace(r, verdict="drift", comparisons=[c])


def test_where_rerun_records_the_settings_and_the_plan(ck):
    r = probe_where("torchref", "rerun", checkpoint=ck, policy="fp32", processes=0, repeats=1)
    assert r.details["determinism settings"] == determinism_settings(uses_jax=False)
    assert r.details["fresh process settings"] == {}
    assert r.details["plan"]["backend"] == "fast" and r.details["plan"]["framework"] == "torch"
    assert json.loads(json.dumps(r.to_dict()))["details"]["determinism settings"] == r.details["determinism settings"]
    if r.verdict == "exact":
        assert "decides a rerun" not in hint(r) and "no GPU here" not in hint(r)
    drift = _drifting(r)
    said = rerun_settings(r.details["determinism settings"])
    assert said[1:] in hint(drift) and "a kernel whose order is not fixed from run to run" in hint(drift)
    batch = dataclasses.replace(drift, circumstance="batch")
    assert said[1:] not in hint(batch)           # the settings are the rerun's words only


def test_where_rerun_records_each_fresh_process_settings(ck):
    r = probe_where("torchref", "rerun", checkpoint=ck, policy="fp32", processes=1, repeats=0)
    fresh = r.details["fresh process settings"]
    assert list(fresh) == ["fresh 1"] and set(fresh["fresh 1"]) == set(r.details["determinism settings"])


def test_where_records_the_plan_of_a_streamed_run(ck):
    r = probe_where("torchref", "padding", checkpoint=ck, policy="fp32", pad=2, length=6)
    assert r.streamed and r.details["plan"]["framework"] == "torch" and r.details["plan"]["policy"] == "fp32"
    assert "determinism settings" not in r.details


# ----- the CLI: meta.environment has the loaded models' plans --------------------------------------------

def test_cli_probe_records_the_loaded_models_plans(ck, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["probe", "determinism", "--checkpoint", str(ck), "--impl", "torchref", "--mode", "default,invariant",
               "--repeats", "1", "--processes", "0", "--length", "8", "--json", str(out), "--no-colour"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    doc = json.loads(out.read_text())
    env = doc["meta"]["environment"]
    assert env["torchref fp32 default plan backend"] == "fast"
    assert env["torchref fp32 invariant plan backend"] == "invariant"
    # no default CPU plan (roles "torchref", "jaxmodel"): only the loaded models'
    assert {k.split(" plan ")[0] for k in env if " plan " in k} == {"torchref fp32 default", "torchref fp32 invariant"}
    assert doc["results"][0]["details"]["determinism settings"] == determinism_settings(uses_jax=False)


def test_cli_probe_where_records_the_models_plan(ck, tmp_path, capsys):
    out = tmp_path / "w.json"
    rc = main(["probe", "where", str(ck), "--impl", "torchref", "--circumstance", "rerun", "--mode", "invariant",
               "--repeats", "1", "--processes", "0", "--length", "8", "--json", str(out), "--no-colour"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    doc = json.loads(out.read_text())
    model = doc["results"][0]["model"]
    assert doc["meta"]["environment"][f"{model} plan backend"] == "invariant"
    assert doc["results"][0]["details"]["plan"]["backend"] == "invariant"
