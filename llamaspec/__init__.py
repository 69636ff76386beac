"""Framework-neutral pieces shared by jaxmodel and torchref (numpy only).

Config parsing, checkpoint reading, tap names, precision policies, input checks and
the generation loop live here once; the models import them and never each other.
"""

from . import taps
from .checkpoint import Checkpoint, expected_shapes, load_weights
from .config import LlamaConfig, RopeConfig
from .errors import CheckpointError, ConfigError, InputError, LlamaParityError, PolicyError
from .generate import Sampling, generate
from .inputs import check_tokens, left_align, positions_from_mask
from .policy import PRESETS, Policy

__all__ = [
    "Checkpoint", "expected_shapes", "load_weights", "LlamaConfig", "RopeConfig",
    "CheckpointError", "ConfigError", "InputError", "LlamaParityError", "PolicyError",
    "Sampling", "generate", "check_tokens", "left_align", "positions_from_mask",
    "PRESETS", "Policy", "taps",
]
