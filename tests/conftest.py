import types
from pathlib import Path

import numpy as np
import pytest

from llamaspec.testing import TINY_CONFIGS as CONFIGS
from llamaspec.testing import make_checkpoint


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


@pytest.fixture(scope="session")
def right_padded_pair():
    """Two rows of 16 random ids, the second right-padded after 11 tokens, as compare's own text
    batches are: the third-party port tests' batch (tests/test_ports.py, test_port_*.py)."""
    ids = np.random.default_rng(1).integers(3, 96, (2, 16))
    mask = np.ones_like(ids)
    mask[1, 11:] = 0
    return ids, mask


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


class _TorchAllF64(types.ModuleType):
    """Stands in for `torch` inside transformers' Llama and RoPE modules so that their
    float32 islands (RMSNorm, RoPE tables, softmax) run in float64: torch.float and
    torch.float32 name float64 there, everything else is the real torch. The result is
    a transformers Llama that is float64 end to end, with its own formulas untouched:
    an independent fp64 implementation to check ours against."""

    def __init__(self, name, torch):
        super().__init__(name)
        self._torch = torch
        self.float = self.float32 = torch.float64

    def __getattr__(self, name):
        return getattr(self._torch, name)


def _hf_logits(folder, ids, mask=None, true_f64=False):
    """transformers LlamaForCausalLM (eager attention, float64) logits as numpy.

    true_f64=True also moves transformers' internal f32 steps to f64 (and the default
    dtype, which dynamic NTK's base uses).
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers import modeling_rope_utils
    from transformers.models.llama import modeling_llama

    saved = modeling_llama.torch, modeling_rope_utils.torch, torch.get_default_dtype()
    if true_f64:
        modeling_llama.torch = modeling_rope_utils.torch = _TorchAllF64("torch", torch)
        torch.set_default_dtype(torch.float64)
    try:
        hf = transformers.LlamaForCausalLM.from_pretrained(
            folder, dtype=torch.float64, attn_implementation="eager").eval()
        with torch.no_grad():
            m = None if mask is None else torch.from_numpy(np.asarray(mask))
            return hf(torch.from_numpy(np.asarray(ids)), attention_mask=m).logits.numpy()
    finally:
        modeling_llama.torch, modeling_rope_utils.torch = saved[:2]
        torch.set_default_dtype(saved[2])


def _hf_family_logits(folder, ids, mask):
    """The transformers class of the folder's family (its config's model_type: LlamaForCausalLM,
    Qwen2ForCausalLM, ..., Olmo2ForCausalLM), eager attention, float64 end to end: its modeling
    module's torch.float / float32 name float64 (as _hf_logits' true_f64), and Tensor.float widens
    to float64 for the call (Gemma's norms call x.float())."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import importlib

    from transformers import modeling_rope_utils

    from compare.adapters.transformers import causal_lm_class
    from llamaspec import LlamaConfig
    cls = causal_lm_class(LlamaConfig.from_file(folder).model_type)
    stem = cls.removesuffix("ForCausalLM").lower()
    mod = importlib.import_module(f"transformers.models.{stem}.modeling_{stem}")
    saved = mod.torch, modeling_rope_utils.torch, torch.get_default_dtype(), torch.Tensor.float
    mod.torch = modeling_rope_utils.torch = _TorchAllF64("torch", torch)
    torch.set_default_dtype(torch.float64)
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.float64)
    try:
        model = getattr(transformers, cls).from_pretrained(folder, dtype=torch.float64,
                                                           attn_implementation="eager").eval()
        with torch.no_grad():
            ids, mask = (torch.from_numpy(np.asarray(a)) for a in (ids, mask))
            return model(ids, attention_mask=mask).logits.numpy()
    finally:
        mod.torch, modeling_rope_utils.torch = saved[:2]
        torch.set_default_dtype(saved[2])
        torch.Tensor.float = saved[3]


@pytest.fixture
def hf_family_logits():
    """transformers' float64 logits of a folder of any family (see _hf_family_logits)."""
    return _hf_family_logits


@pytest.fixture
def hf_logits():
    """transformers' logits for a folder (see _hf_logits); skips without transformers."""
    return _hf_logits
