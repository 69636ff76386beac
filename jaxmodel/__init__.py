"""Flax NNX Llama that loads Hugging Face-layout safetensors unchanged.

    m = jaxmodel.from_pretrained("path/to/hf-folder", policy="bf16")
    logits = m(tokens, attention_mask=mask)
"""

import jax

# The fp64 oracle rung needs float64 arrays, which JAX only creates with x64 enabled.
# Every dtype in jaxmodel is explicit (from the policy), so this changes nothing else.
jax.config.update("jax_enable_x64", True)

from . import compile_cache, dtypes, ops  # noqa: E402
from .model import Llama, LlamaModel, from_pretrained, from_weights  # noqa: E402

compile_cache.enable()   # compiled programs persist across processes (LLAMA_PARITY_JAX_CACHE=0: off)

__all__ = ["from_pretrained", "from_weights", "LlamaModel", "Llama", "ops", "dtypes"]
