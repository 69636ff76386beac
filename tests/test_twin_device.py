"""The float64 twin is the model's twin wherever the model runs: in a fresh process (probe where
captures a fresh run's twin there, computing in float64, not a second run at the policy) and on
the model's own device (OurModel.float64 keeps it; torch's default device, the GPU wherever
there is one, does not decide it). A device torch cannot compute on is a clear error."""

import numpy as np
import pytest
import torch

from compare.adapters import OurModel
from compare.probes.models import ModelSpec, fp64_twin
from compare.probes.where_plan import Run
from compare.probes.where_sources import CaptureSource
from llamaspec import caps
from llamaspec.taps import all_taps


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return tiny_dir("gqa")


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 64, (2, 7)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :2] = 0         # row 1 left-padded
    return ids, mask


# ----- a fresh run's twin is captured in float64 ------------------------------------------------

def test_a_fresh_runs_twin_is_the_float64_twin_not_a_second_run_at_the_policy(tiny, batch):
    ids, mask = batch
    taps = list(all_taps(2))
    spec = ModelSpec("torchref", str(tiny), "fp32", device="cpu")
    src = CaptureSource({}, [Run("fresh", ids, mask, fresh=True)], {"fresh": [0, 1]}, taps, spec)
    here = OurModel.load("torchref", tiny, "fp32", device="cpu")
    _, at_policy = here.capture(ids, mask, taps)
    _, in_fp64 = here.float64(rounded_weights=True).capture(ids, mask, taps)
    for row in (0, 1):
        model, twin = src.kept[("fresh", False, row)], src.kept[("fresh", True, row)]
        for t in taps:
            assert model[t].dtype == np.float32 and twin[t].dtype == np.float64, t
            # the same program in another process: float64 rounding apart, far below fp32's
            np.testing.assert_allclose(twin[t], np.asarray(in_fp64[t])[row], rtol=1e-10, atol=1e-12, err_msg=t)
            np.testing.assert_allclose(model[t], np.asarray(at_policy[t])[row], rtol=1e-5, atol=1e-6, err_msg=t)
    assert not np.array_equal(src.kept[("fresh", True, 0)]["logits"],
                              src.kept[("fresh", False, 0)]["logits"].astype(np.float64))


def test_a_fresh_run_without_a_twin_captures_no_twin(tiny, batch):
    ids, mask = batch
    spec = ModelSpec("torchref", str(tiny), "fp32")
    src = CaptureSource({}, [Run("fresh", ids, mask, fresh=True, twin=False)], {"fresh": [0]}, ["logits"], spec)
    assert set(src.kept) == {("fresh", False, 0)}


# ----- the twin on the model's device -----------------------------------------------------------

def test_the_twin_is_on_the_models_device(tiny):
    m = OurModel.load("torchref", tiny, "fp32", device="cpu")
    assert m.device == "cpu"
    for twin in (m.float64(), m.float64(rounded_weights=True), fp64_twin(m)):
        assert twin.device == m.device and twin.model.policy.compute_dtype == "float64"
    assert OurModel.load("jaxmodel", tiny, "fp32").device is None      # JAX's default backend, no torch device


def test_the_twin_of_a_cpu_model_stays_on_the_cpu_where_torch_reports_a_gpu(tiny, monkeypatch):
    """torchref's own default is the GPU wherever torch reports one: the twin must not follow it.
    (Here torch is told there is one; placing anything on it would fail on this machine.)"""
    m = OurModel.load("torchref", tiny, "fp32", device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for twin in (m.float64(), m.float64(rounded_weights=True)):
        assert twin.device == "cpu"
        assert next(twin.model.parameters()).device.type == "cpu"


@pytest.mark.parametrize("device, said", [("meta", "torch.s meta device holds shapes"),
                                          ("gpu0", "not a device torch knows"),
                                          ("cuda:99" if torch.cuda.is_available() else "cuda",
                                           "torch cannot place a tensor there")])
def test_a_device_torch_cannot_compute_on_is_a_clear_error(tiny, device, said):
    with pytest.raises(caps.DeviceError, match=f"device {device!r}: {said}"):
        OurModel.load("torchref", tiny, "fp32", device=device)
    with pytest.raises(caps.DeviceError, match=f"device {device!r}"):
        ModelSpec("torchref", str(tiny), "fp32", device=device).load()


def test_jaxmodel_takes_no_device_but_its_default_backend(tiny):
    import jax
    other = "cuda" if jax.default_backend() == "cpu" else "cpu"
    with pytest.raises(NotImplementedError, match=f"jaxmodel runs on JAX's default backend.*cannot load on {other}"):
        OurModel.load("jaxmodel", tiny, "fp32", device=other)
    assert OurModel.load("jaxmodel", tiny, "fp32", device=jax.default_backend()).package == "jaxmodel"
