import os
from pathlib import Path

import numpy as np
import pytest

from llamaspec.testing import make_checkpoint


def rel_l2(a, b) -> float:
    """Relative L2 distance ||a - b|| / ||b|| in float64."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# Tiny configs that cover the architecture space the acceptance criteria name.
CONFIGS = {
    "gqa": {},
    "mha": dict(num_key_value_heads=4),
    "mqa": dict(num_key_value_heads=1),
    "head_dim": dict(head_dim=16),
    "tied": dict(tie_word_embeddings=True),
    "bias": dict(attention_bias=True, mlp_bias=True),
    "llama3": dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=32)),
    "linear": dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0)),
    "dynamic": dict(rope_scaling=dict(type="dynamic", factor=2.0)),
}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Factory: a tiny random checkpoint folder for a CONFIGS name (cached per session)."""
    made = {}

    def get(name="gqa", **extra):
        key = (name, tuple(sorted(extra.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny_{name}")
            made[key] = make_checkpoint(folder, **{**CONFIGS[name], **extra})
        return made[key]

    return get


def smollm2_dir() -> Path | None:
    from llama_parity.fetch import default_model_dir
    d = default_model_dir()
    return d if (d / ".complete").is_file() else None


@pytest.fixture(scope="session")
def smollm2():
    d = smollm2_dir()
    if d is None:
        pytest.skip("SmolLM2 weights not cached: run `llama-parity fetch-smollm2` "
                    "(the README's test command does)")
    return d
