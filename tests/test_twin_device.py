"""The float64 twin is the model's twin on the model's own device (OurModel.float64 keeps it;
torch's default device, the GPU wherever there is one, does not decide it). A device torch
cannot compute on is a clear error."""

import pytest
import torch

from compare.adapters import OurModel
from compare.probes.models import ModelSpec, fp64_twin
from llamaspec import caps


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return tiny_dir("gqa")


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
