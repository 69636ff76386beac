"""decode_capture: a decode step that also returns its taps."""

import numpy as np
import pytest

STEPS = 8
# a left-padded batch: row 1's prompt is 4 tokens shorter, so slots and positions differ
IDS = np.random.default_rng(0).integers(3, 96, (2, 12))
MASK = np.ones_like(IDS)
MASK[1, :4] = 0


@pytest.fixture(scope="module")
def folder(tiny_dir):
    return tiny_dir("gqa")


@pytest.mark.parametrize("package", ["torchref", "jaxmodel"])
def test_decode_capture_is_decode_plus_the_steps_taps(package, folder):
    """decode_capture's logits are decode's, bit for bit, and its taps are the full
    recompute's at the new position (to fp64 rounding at fp64)."""
    import importlib
    mod = importlib.import_module(package)
    m = mod.from_pretrained(folder, policy="fp64")
    toks = np.array([[5, 6, 7], [8, 9, 10]])
    _, a = m.prefill(IDS, MASK, 16)
    _, b = m.prefill(IDS, MASK, 16)
    _, full = m.capture(np.concatenate([IDS, toks], 1), np.concatenate([MASK, np.ones_like(toks)], 1), "*")
    for s in range(toks.shape[1]):
        la, a = m.decode(a, toks[:, s])
        lb, b, acts = m.decode_capture(b, toks[:, s], "*")
        assert np.array_equal(la, lb)
        assert set(acts) == set(full)
        for t, x in acts.items():
            want = full[t][:, IDS.shape[1] + s]
            assert x.shape[1] == 1
            assert np.abs(x[:, 0] - want).max() <= 1e-12 * max(1.0, np.abs(want).max()), t
