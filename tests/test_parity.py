"""torchref and jaxmodel agree in fp64 on every architecture variant (the exactness
acceptance): what is left at fp64 is rounding, ~1e-15, never a difference in the math."""

import numpy as np
import pytest

import jaxmodel
import torchref
from compare.metrics import rel_l2
from llamaspec.testing import TINY_CONFIGS as CONFIGS
from llamaspec.testing import make_checkpoint


def both(folder, ids, mask=None, policy="fp64"):
    a = np.asarray(torchref.from_pretrained(folder, policy=policy)(ids, attention_mask=mask))
    b = np.asarray(jaxmodel.from_pretrained(folder, policy=policy)(ids, attention_mask=mask))
    return a, b


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp64_logits_agree(config, tiny_dir):
    ids = np.random.default_rng(1).integers(3, 96, (2, 48))
    a, b = both(tiny_dir(config), ids)
    err = rel_l2(b, a)
    assert err <= 1e-12, f"{config}: jaxmodel vs torchref fp64 rel L2 {err:.2e}"


@pytest.mark.parametrize("storage, shards", [("bfloat16", 1), ("float16", 2), ("float32", 3)])
def test_fp64_agree_across_storage_dtypes_and_shards(storage, shards, tmp_path):
    folder = make_checkpoint(tmp_path, dtype=storage, shards=shards, num_key_value_heads=1)
    ids = np.random.default_rng(2).integers(3, 96, (1, 30))
    a, b = both(folder, ids)
    assert rel_l2(b, a) <= 1e-12


def test_fp64_taps_agree_everywhere(tiny_dir):
    """Not just the logits: every named activation, so a bug cannot hide behind a lucky sum."""
    folder = tiny_dir("bias")
    ids = np.random.default_rng(3).integers(3, 96, (2, 12))
    mask = np.ones_like(ids)
    mask[0, :4] = 0
    _, ta = torchref.from_pretrained(folder, policy="fp64").capture(ids, mask, taps="*")
    _, tb = jaxmodel.from_pretrained(folder, policy="fp64").capture(ids, mask, taps="*")
    assert list(ta) == list(tb)
    real = mask.astype(bool)
    worst = max((rel_l2(tb[k][real], ta[k][real]), k) for k in ta)
    assert worst[0] <= 1e-12, f"worst tap {worst[1]}: {worst[0]:.2e}"


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16", "bf16w-f32"])
def test_working_policies_agree_to_their_precision(policy, tiny_dir):
    """Different kernels round differently; the gap must still be at the policy's precision."""
    ids = np.random.default_rng(4).integers(3, 96, (2, 32))
    a, b = both(tiny_dir("gqa"), ids, policy=policy)
    bound = {"fp32": 1e-5, "bf16w-f32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}[policy]
    assert rel_l2(b, a) <= bound
