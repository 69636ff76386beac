"""compare.ladder.capture_check: capturing every tap leaves a side's logits as a plain run
gives them (torchref: the same kernels, the hooks only copy), and a capture that changes
the run (a hook that rounds a step to bf16 in capture mode only) is caught, with its size."""

import numpy as np
import pytest

from compare.adapters import OurModel
from compare.ladder.capture_check import FORWARD, LOGITS_ONLY, capture_check

IDS = np.random.default_rng(0).integers(3, 96, (2, 24))
MASK = np.ones_like(IDS)
MASK[1, :5] = 0     # left padding: only real positions count


@pytest.fixture(scope="module")
def folder(tiny_dir):
    return tiny_dir("gqa")


class _Port:
    """torchref under the Implementation protocol, with what its capture does to the run
    changed by `during_capture(model)` (returns the hook handles to remove)."""

    def __init__(self, folder, during_capture=None, forward_noise=0.0):
        self.inner = OurModel.load("torchref", folder, "fp32")
        self.name, self.taps = "planted", self.inner.taps
        self.during_capture, self.forward_noise = during_capture, forward_noise
        self.rng = np.random.default_rng(1)

    def capture(self, tokens, attention_mask, taps, inject=None):
        hooks = self.during_capture(self.inner.model) if self.during_capture and set(taps) != {"logits"} else []
        try:
            return self.inner.capture(tokens, attention_mask, taps, inject)
        finally:
            for h in hooks:
                h.remove()

    def __call__(self, tokens, attention_mask=None):
        out = self.inner(tokens, attention_mask)
        return out * (1 + self.forward_noise * self.rng.standard_normal(out.shape)).astype(out.dtype)


def _mlp_output_in_bf16(model):
    import torch
    mlp = model.model.layers[0].mlp
    return [mlp.register_forward_hook(lambda mod, args, out: out.to(torch.bfloat16).to(out.dtype))]


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp64"])
def test_torchref_capture_is_bitwise_a_plain_run(folder, policy):
    model = OurModel.load("torchref", folder, policy)
    check = capture_check(model, IDS, MASK)
    assert [a.baseline for a in check.against] == [LOGITS_ONLY, FORWARD]
    assert check.bitwise and check.repeats and not check.changes_numbers
    assert check.floor == 0.0 and check.taps == len(model.taps)


def test_a_capture_that_rounds_a_step_to_bf16_is_caught(folder):
    check = capture_check(_Port(folder, _mlp_output_in_bf16), IDS, MASK)
    assert not check.bitwise and check.repeats and check.changes_numbers
    for a in check.against:
        # bf16 rounding of one MLP output, carried to the logits: far more than an f32 ulp,
        # far less than a different model
        assert not a.bitwise and a.max_ulp >= 1 and 0 < a.rel_l2 < 0.1 and a.max_abs > 0
    assert check.floor == max(a.rel_l2 for a in check.against)
    assert check.dtype == "float32"


def test_a_side_that_does_not_repeat_is_not_blamed_on_capturing(folder):
    check = capture_check(_Port(folder, forward_noise=1e-3), IDS, MASK)
    assert check.repeats is False and not check.bitwise and not check.changes_numbers
    assert check.against[0].bitwise       # the two captures agree; only the noisy forward does not


def test_a_port_without_a_forward_is_checked_against_its_logits_capture(folder):
    inner = _Port(folder, _mlp_output_in_bf16)

    class NoForward:
        name, taps = "no-forward", inner.taps
        capture = inner.capture

    check = capture_check(NoForward(), IDS, MASK, taps=("layers.0.mlp_out", "logits"))
    assert check.repeats is None and [a.baseline for a in check.against] == [LOGITS_ONLY]
    assert check.changes_numbers and check.taps == 2
