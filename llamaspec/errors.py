"""Error types. Each message names the file, tensor key, shape or field that is wrong."""


class LlamaParityError(Exception):
    """Base class for every error this project raises on bad input."""


class ConfigError(LlamaParityError, ValueError):
    """config.json is missing, malformed, or asks for math we do not implement."""


class CheckpointError(LlamaParityError, ValueError):
    """Safetensors files are missing, corrupt, or hold the wrong tensors."""


class InputError(LlamaParityError, ValueError):
    """Token ids, masks, lengths or prompts that a model cannot run."""


class PolicyError(LlamaParityError, ValueError):
    """An unknown precision preset or knob value."""


class InvarianceError(LlamaParityError, RuntimeError):
    """The batch-invariant mode cannot promise invariance on this machine (its self-check
    found an operation whose result for a row depends on the rest of the batch, or the
    fixed-order kernels cannot be built)."""


class TokenizerError(LlamaParityError, ValueError):
    """tokenizer.json (or its metadata files) is missing fields, corrupt, or belongs to
    another model."""


class CacheError(LlamaParityError, RuntimeError):
    """The llama-parity cache folder cannot be created or written, or a cached file no
    longer matches what was recorded when it was made."""
