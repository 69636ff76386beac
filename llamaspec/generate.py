"""The generation loop, shared by both models: greedy or seeded sampling, stop on EOS.

A model supplies two functions working on numpy at the boundary:
    prefill(ids [B, T], mask [B, T], total_len) -> (last_logits [B, V], cache)
    decode(cache, next_ids [B]) -> (logits [B, V], cache)
so the token choice (and its random numbers) is the same code for JAX and PyTorch:
two models that produce the same logits produce the same tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .config import LlamaConfig
from .errors import InputError
from .inputs import check_tokens, left_align


@dataclasses.dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise InputError(f"do_sample={self.do_sample!r} must be True or False")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)):
            raise InputError(f"top_k={self.top_k!r} must be an integer >= 1 (or None)")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise InputError(f"{name}={v!r} must be a number")
        if self.do_sample and not self.temperature > 0:
            raise InputError(f"temperature={self.temperature} must be > 0 when sampling")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InputError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise InputError(f"top_k={self.top_k} must be >= 1")


def choose(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """Next token per row. Greedy ties go to the lowest id (np.argmax), in both models."""
    logits = np.asarray(logits, dtype=np.float64)
    if not sampling.do_sample:
        return logits.argmax(-1)
    z = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < z.shape[-1]:
        kth = np.sort(z, axis=-1)[:, -sampling.top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if sampling.top_p is not None and sampling.top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop_sorted = np.cumsum(sorted_p, -1) - sorted_p >= sampling.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, -1)
        p = np.where(drop, 0.0, p)
        p /= p.sum(-1, keepdims=True)
    u = rng.random(p.shape[0])
    cdf = np.cumsum(p, -1)
    return np.minimum((cdf < (u * cdf[:, -1])[:, None]).sum(-1), p.shape[-1] - 1)


def generate(cfg: LlamaConfig, prefill, decode, tokens, attention_mask=None,
             max_new_tokens: int = 32, eos_token_ids=None, pad_token_id=None,
             sampling: Sampling | None = None) -> np.ndarray:
    """Returns the new ids [B, N], N <= max_new_tokens (shorter when every row hit EOS).

    Rows that finished early are filled with the pad id (or their EOS id).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    sampling = sampling or Sampling()
    ids, mask = check_tokens(cfg, tokens, attention_mask, extra_length=max_new_tokens)
    if (mask.sum(1) == 0).any():
        raise InputError("cannot generate from an empty prompt (a row with no real tokens)")
    ids, mask = left_align(ids, mask)
    eos = np.array(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids, np.int64)
    if ((eos < 0) | (eos >= cfg.vocab_size)).any():
        raise InputError(f"eos_token_ids={eos.tolist()} must be token ids in [0, vocab_size={cfg.vocab_size})")
    if pad_token_id is None:
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (
            int(eos[0]) if eos.size else 0)
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, (int, np.integer)) \
            or not 0 <= pad_token_id < cfg.vocab_size:
        raise InputError(f"pad_token_id={pad_token_id!r} must be a token id in [0, vocab_size={cfg.vocab_size})")
    rng = np.random.default_rng(sampling.seed)

    B = ids.shape[0]
    out = np.full((B, max_new_tokens), pad_token_id, np.int64)
    done = np.zeros(B, bool)
    logits, cache = prefill(ids, mask, ids.shape[1] + max_new_tokens)
    for step in range(max_new_tokens):
        nxt = np.where(done, pad_token_id, choose(logits, sampling, rng))
        out[:, step] = nxt
        done |= np.isin(nxt, eos)
        if done.all():
            return out[:, :step + 1]
        if step + 1 < max_new_tokens:
            logits, cache = decode(cache, nxt)
    return out


def until_eos(row, eos_ids) -> list[int]:
    """A generated row up to and including its first EOS (what follows is padding)."""
    out = []
    for t in np.asarray(row).tolist():
        out.append(t)
        if t in eos_ids:
            break
    return out
