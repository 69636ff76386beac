"""A transformers LlamaForCausalLM behind the models' API, for the invariance probes.

    r = HFRunner(model)                          # a user's instance, run as given
    r = HFRunner.from_pretrained(folder, policy="bf16")
    logits = r(tokens, attention_mask=mask)      # numpy [B, T, V]
    logits, cache = r.prefill(ids, mask, total_len); logits, cache = r.decode(cache, next_ids)
    new = r.generate(tokens, attention_mask=mask, max_new_tokens=32)   # greedy

Positions. Called as `model(input_ids, attention_mask=mask)`, transformers'
LlamaModel.forward gives every row the positions arange(past, past + T)
(modeling_llama: position_ids = arange(...) + past_seen_tokens when position_ids is
None): the attention mask is not consulted, so a left-padded row's first real token
sits at position k (the number of pads before it) instead of 0. Only
`model.generate()` derives position ids from the mask (cumsum(mask) - 1, in
_prepare_position_ids_for_generation). This runner passes position_ids =
cumsum(mask) - 1 (0 on padding) on every call, as torchref and jaxmodel compute them.

positions="default" runs transformers' forward default instead, what a user who calls
the model directly gets. For contiguous left padding that shift is harmless in a RoPE
model: attention scores depend only on position differences, so the outputs move at
rounding level only (cos/sin of larger angles), and the padding probe reports drift.
It is not harmless where absolute positions enter the math (dynamic NTK scaling reads
the largest position) or when the two conventions are mixed (a prefill with
mask-derived positions continued by default-positioned decode steps).
"""

from __future__ import annotations

import inspect
import types

import numpy as np
import torch

from llamaspec import LlamaConfig, Sampling, check_tokens, positions_from_mask
from llamaspec import generate as run_generation
from llamaspec.inputs import check_next_ids, check_prefill
from torchref.dtypes import to_numpy

from .hf_adapter import WrapsModel

POSITIONS = ("mask", "default")


def _config(model) -> LlamaConfig | types.SimpleNamespace:
    """Our config for the generation loop's checks (length limit, EOS, pad id)."""
    try:
        return LlamaConfig.from_dict(model.config.to_dict(), source="transformers config")
    except Exception:  # a config field we do not parse: the loop needs only a few
        c = model.config
        eos = c.eos_token_id if isinstance(c.eos_token_id, (list, tuple)) else (
            [] if c.eos_token_id is None else [c.eos_token_id])
        return types.SimpleNamespace(vocab_size=c.vocab_size, eos_token_ids=tuple(eos),
                                     pad_token_id=c.pad_token_id,
                                     max_position_embeddings=c.max_position_embeddings,
                                     rope=types.SimpleNamespace(type="default", factor=1.0))


class HFRunner(WrapsModel):
    """logits(ids, mask), prefill/decode and greedy generate on a LlamaForCausalLM."""

    def __init__(self, model, positions: str = "mask"):
        if positions not in POSITIONS:
            raise ValueError(f"positions={positions!r}: use one of {POSITIONS}")
        self.model = model.eval()
        self.positions = positions
        self.cfg = _config(model)
        self.attn_implementation = getattr(model.config, "_attn_implementation", None)
        params = inspect.signature(model.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_pretrained(cls, folder, policy="fp32", attn_implementation: str = "eager",
                        positions: str = "mask") -> "HFRunner":
        """Loads the folder at the policy's param dtype (transformers then runs its own
        dtype handling: f32 norm, RoPE and softmax inside a bf16 model)."""
        from transformers import LlamaForCausalLM

        from llamaspec import Policy
        from torchref.dtypes import dt
        policy = Policy.get(policy)
        model = LlamaForCausalLM.from_pretrained(str(folder), dtype=dt(policy.param_dtype),
                                                 attn_implementation=attn_implementation)
        return cls(model, positions)

    def _cache_kw(self, kv) -> dict:
        """transformers 5 names the KV cache argument `cache` (past_key_values before)."""
        return {"cache": kv} if self._cache_arg == "cache" else {"past_key_values": kv}

    @property
    def name(self) -> str:
        pos = "" if self.positions == "mask" else ", default positions"
        return f"transformers[{self.attn_implementation}, {str(self.dtype).removeprefix('torch.')}{pos}]"

    def _t(self, a) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _position_ids(self, mask: np.ndarray, past: int = 0) -> torch.Tensor | None:
        if self.positions == "default":
            return None
        return self._t(positions_from_mask(mask).astype(np.int64))

    @torch.inference_mode()
    def __call__(self, tokens, attention_mask=None) -> np.ndarray:
        ids, mask = check_tokens(self.cfg, tokens, attention_mask)
        out = self.model(input_ids=self._t(ids), attention_mask=self._t(mask.astype(np.int64)),
                         position_ids=self._position_ids(mask), use_cache=False)
        return to_numpy(out.logits)

    logits = __call__

    @torch.inference_mode()
    def prefill(self, ids, mask, total_len: int):
        """Left-aligned prompt -> (last logits [B, V], cache). The cache is transformers'
        own (DynamicCache) plus the slot mask and each row's next position."""
        from transformers import DynamicCache
        ids, mask = check_prefill(self.cfg, ids, mask, total_len)
        kv = DynamicCache(config=self.model.config)
        out = self.model(input_ids=self._t(ids), attention_mask=self._t(mask.astype(np.int64)),
                         position_ids=self._position_ids(mask), use_cache=True, **self._cache_kw(kv))
        cache = {"kv": kv, "mask": mask.astype(np.int64),
                 "next_pos": mask.sum(1).astype(np.int64), "index": ids.shape[1],
                 "slots": int(total_len)}
        return to_numpy(out.logits[:, -1]), cache

    @torch.inference_mode()
    def decode(self, cache, next_ids):
        B = cache["mask"].shape[0]
        next_ids = check_next_ids(self.cfg, next_ids, B, cache["index"], cache["slots"])
        mask = np.concatenate([cache["mask"], np.ones((B, 1), np.int64)], axis=1)
        pos = None if self.positions == "default" else self._t(cache["next_pos"][:, None])
        out = self.model(input_ids=self._t(next_ids[:, None]), attention_mask=self._t(mask),
                         position_ids=pos, use_cache=True, **self._cache_kw(cache["kv"]))
        cache = {**cache, "mask": mask,
                 "next_pos": cache["next_pos"] + 1, "index": cache["index"] + 1}
        return to_numpy(out.logits[:, -1]), cache

    def generate(self, tokens, attention_mask=None, max_new_tokens: int = 32, eos_token_ids=None,
                 pad_token_id=None) -> np.ndarray:
        """Greedy new ids [B, N] through llamaspec's loop (the same token choice as ours)."""
        return run_generation(self.cfg, self.prefill, self.decode, tokens, attention_mask,
                              max_new_tokens, eos_token_ids, pad_token_id, Sampling())
