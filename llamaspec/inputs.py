"""Checks and derived arrays for model inputs, identical for both frameworks."""

from __future__ import annotations

import dataclasses

import numpy as np

from .config import LlamaConfig
from .errors import InputError


def max_length(cfg: LlamaConfig) -> int:
    """Longest sequence a model accepts. Dynamic NTK RoPE exists to run past the trained
    length, so it may go up to factor x max_position_embeddings."""
    if cfg.rope.type == "dynamic":
        return int(cfg.max_position_embeddings * cfg.rope.factor)
    return cfg.max_position_embeddings


def check_token_array(tokens, attention_mask, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[B, T] integer ids inside the vocabulary (on real positions) and a 0/1 mask.

    Returns ids as int64 with padding slots set to 0 (models never read them, but
    embedding lookups still happen) and the mask as int32.
    """
    if isinstance(tokens, (list, tuple)) and tokens and all(isinstance(r, (list, tuple)) for r in tokens) \
            and len({len(r) for r in tokens}) > 1:
        raise InputError(f"tokens: rows of different lengths ({', '.join(str(len(r)) for r in tokens)}); pad them "
                         "to one length and pass attention_mask (1 = real token, 0 = padding)")
    ids = np.asarray(tokens)
    if ids.ndim == 1:
        raise InputError(f"tokens must be [batch, seq], got a 1-D array of shape {ids.shape}; "
                         "wrap a single sequence as tokens[None]")
    if ids.ndim != 2:
        raise InputError(f"tokens must be [batch, seq], got shape {ids.shape}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InputError(f"empty input: tokens have shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"tokens must be integer ids, got dtype {ids.dtype}")
    if attention_mask is None:
        mask = np.ones(ids.shape, np.int32)
    else:
        mask = np.asarray(attention_mask)
        if mask.shape != ids.shape:
            raise InputError(f"attention_mask shape {mask.shape} != tokens shape {ids.shape}")
        if not np.isin(mask, (0, 1)).all():
            raise InputError("attention_mask must hold only 0 and 1")
        mask = mask.astype(np.int32)
    real = mask.astype(bool)
    bad = real & ((ids < 0) | (ids >= vocab_size))
    if bad.any():
        b, t = map(int, np.argwhere(bad)[0])
        raise InputError(f"token id {int(ids[b, t])} at [{b}, {t}] is outside the vocabulary "
                         f"(vocab_size={vocab_size}); {int(bad.sum())} such id(s)")
    return np.where(real, ids, 0).astype(np.int64), mask


def check_tokens(cfg: LlamaConfig, tokens, attention_mask=None, extra_length: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """check_token_array, plus the length limit of this config.

    extra_length: tokens that generation will append, counted against the limit.
    """
    ids, mask = check_token_array(tokens, attention_mask, cfg.vocab_size)
    limit = max_length(cfg)
    longest = int(mask.sum(1).max()) + extra_length
    if longest > limit:
        what = f" including {extra_length} new tokens" if extra_length else ""
        raise InputError(f"sequence of {longest} tokens{what} is longer than "
                         f"max_position_embeddings={cfg.max_position_embeddings}"
                         + (f" x rope factor {cfg.rope.factor}" if limit != cfg.max_position_embeddings else ""))
    return ids, mask


def positions_from_mask(mask: np.ndarray) -> np.ndarray:
    """Position of each token = number of real tokens before it (0 on padding slots).

    Works for left, right and interior padding alike.
    """
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)


def left_align(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Moves every row's real tokens to the right end (left padding), keeping order.

    Generation appends at the same slot for every row, which needs left alignment.
    """
    out_ids = np.zeros_like(ids)
    out_mask = np.zeros_like(mask)
    T = ids.shape[1]
    for b in range(ids.shape[0]):
        real = ids[b][mask[b].astype(bool)]
        n = len(real)
        if n:
            out_ids[b, T - n:] = real
            out_mask[b, T - n:] = 1
    return out_ids, out_mask


def check_prefill(cfg: LlamaConfig, ids, mask, total_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefill input: valid tokens, left-aligned rows (generation appends at one shared
    slot), and a cache long enough for the prompt."""
    ids, mask = check_tokens(cfg, ids, mask)
    if not mask[:, -1].all():
        raise InputError("prefill needs left-aligned rows with at least one token each "
                         "(see llamaspec.left_align): the last slot must be real in every row")
    if total_len < ids.shape[1]:
        raise InputError(f"total_len={total_len} is shorter than the prompt ({ids.shape[1]})")
    return ids, mask


def check_next_ids(cfg: LlamaConfig, next_ids, rows: int, index: int, slots: int) -> np.ndarray:
    """One decode step's tokens [B]: right row count, inside the vocabulary, cache not full."""
    if index >= slots:
        raise InputError(f"KV cache is full ({slots} slots); prefill with a larger total_len")
    next_ids = np.asarray(next_ids).reshape(-1)
    if next_ids.shape[0] != rows:
        raise InputError(f"next_ids has {next_ids.shape[0]} rows, cache has {rows}")
    bad = (next_ids < 0) | (next_ids >= cfg.vocab_size)
    if bad.any():
        raise InputError(f"token id {int(next_ids[bad][0])} is outside the vocabulary "
                         f"(vocab_size={cfg.vocab_size})")
    return next_ids.astype(np.int64)


def check_inject(cfg: LlamaConfig, inject, tokens_shape) -> dict[int, np.ndarray]:
    """Teacher-forcing inputs {layer index: [B, T, hidden]}: valid layers, right shapes."""
    if not inject:
        return {}
    want = (*tokens_shape, cfg.hidden_size)
    out = {}
    for layer, x in inject.items():
        if not (isinstance(layer, (int, np.integer)) and 0 <= layer < cfg.num_hidden_layers):
            raise InputError(f"inject: layer {layer!r} is not in 0..{cfg.num_hidden_layers - 1}")
        x = np.asarray(x)
        if x.shape != want:
            raise InputError(f"inject[{layer}]: shape {x.shape}, expected {want}")
        out[int(layer)] = x
    return out


def invariant_layout(cfg: LlamaConfig, ids: np.ndarray, mask: np.ndarray, multiple: int,
                     extra_length: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The canonical layout of batch-invariant mode (both models).

    Every row's real tokens move to slots [0, n), in order, so where a token sits (and so
    every reduction over key slots) no longer depends on the padding or on the batch's
    longest row; the width is the longest row rounded up to `multiple`. Returns (ids,
    mask, back): back[b, t] is the canonical slot of the token at slot t (clipped into
    range on padding slots, which the caller masks), to put results back in place. The
    length limit is max_position_embeddings, also for dynamic NTK RoPE: past it the RoPE
    base grows with the longest row of the call, which depends on the batch.
    """
    ids, mask = np.asarray(ids), np.asarray(mask)
    longest = int(mask.sum(1).max())
    if longest + extra_length > cfg.max_position_embeddings:
        what = f" including {extra_length} new tokens" if extra_length else ""
        raise InputError(f"batch_invariant mode: sequence of {longest + extra_length} tokens"
                         f"{what} is longer than its maximum length, max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    B, T = ids.shape
    slot = np.argsort(~mask.astype(bool), axis=1, kind="stable")  # real slots first, in order
    width = max(-(-longest // multiple) * multiple, multiple)
    n = min(T, width)
    out_ids = np.zeros((B, width), ids.dtype)
    out_mask = np.zeros((B, width), mask.dtype)
    out_ids[:, :n] = np.take_along_axis(ids, slot, 1)[:, :n]
    out_mask[:, :n] = np.take_along_axis(mask, slot, 1)[:, :n]
    back = np.minimum(np.argsort(slot, axis=1, kind="stable"), width - 1)
    return out_ids, out_mask, back


@dataclasses.dataclass(frozen=True)
class Layout:
    """A checked batch as a model runs it, and the way back to the caller's slots: the
    canonical layout of batch-invariant mode (invariant_layout), the batch with `offset`
    padding slots put in front (bucketed), or the batch as given (offset 0)."""
    ids: np.ndarray        # [B, W]
    mask: np.ndarray       # [B, W]
    positions: np.ndarray  # [B, W]
    back: np.ndarray | None  # [B, T]: the canonical slot of each caller's slot; None: as given
    caller_mask: np.ndarray  # [B, T]
    offset: int = 0          # padding slots in front of the caller's (back is None)

    def restore(self, x) -> np.ndarray:
        """A per-slot result [B, W, ...] -> the caller's slots [B, T, ...] as numpy: zeros on
        padding (canonical layout), or the slots after the front padding as computed."""
        if self.back is not None:
            return from_canonical(x, self.back, self.caller_mask)
        return np.asarray(x)[:, self.offset:] if self.offset else np.asarray(x)

    def place(self, x) -> np.ndarray:
        """Per-slot inputs [B, T, ...] in the caller's slots -> [B, W, ...]."""
        x = np.asarray(x)
        if self.back is not None:
            return to_canonical(x, self.back, self.caller_mask, self.ids.shape[1])
        return _pad_front(x, self.offset)


def _pad_front(x: np.ndarray, n: int) -> np.ndarray:
    """x [B, T, ...] with n zero slots in front: [B, n + T, ...] (x itself when n is 0)."""
    return np.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2)) if n else x


def bucket_length(T: int) -> int:
    """The width a bucketed model runs T slots at: a power of two up to 64 (at least 16),
    then a multiple of 64 up to 512, then of 256. Prompts whose lengths share a bucket share
    one compiled program; the padding costs at most 2x at the short end (where compiling,
    not computing, is what costs) and at most 1.5x from 512 slots on."""
    if T <= 64:
        return max(16, 1 << max(T - 1, 0).bit_length())
    step = 64 if T <= 512 else 256
    return -(-T // step) * step


def front_padded(ids: np.ndarray, mask: np.ndarray, width: int) -> Layout:
    """The batch with width - T padding slots (mask 0, token 0) in front of every row.
    Neutral for any mask: positions count real tokens (positions_from_mask) and no slot
    attends a masked one, so the real slots compute the same function; only the shapes (and
    so, in a model that is not batch-invariant, the rounding) are the bucket's."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    T = ids.shape[1]
    pad = width - T
    if pad < 0:
        raise ValueError(f"front_padded: width {width} is shorter than the batch ({T} slots)")
    mask_p = _pad_front(mask, pad)
    return Layout(_pad_front(ids, pad), mask_p, positions_from_mask(mask_p), None, mask, pad)


def layout(cfg: LlamaConfig, ids: np.ndarray, mask: np.ndarray, multiple: int | None = None,
           extra_length: int = 0) -> Layout:
    """Checked ids and mask in invariant_layout(..., multiple) or, when multiple is None, as given."""
    if multiple is None:
        return Layout(ids, mask, positions_from_mask(mask), None, mask)
    ids_c, mask_c, back = invariant_layout(cfg, ids, mask, multiple, extra_length)
    return Layout(ids_c, mask_c, positions_from_mask(mask_c), back, np.asarray(mask))


def to_canonical(x: np.ndarray, back: np.ndarray, mask: np.ndarray, width: int) -> np.ndarray:
    """Per-slot values [B, T, ...] in the caller's slots -> the canonical layout [B, width, ...]
    of invariant_layout (back from it); slots that hold no real token get zeros."""
    x = np.asarray(x)
    rows, slots = np.nonzero(np.asarray(mask))
    out = np.zeros((x.shape[0], width, *x.shape[2:]), x.dtype)
    out[rows, back[rows, slots]] = x[rows, slots]
    return out


def from_canonical(x: np.ndarray, back: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Canonical [B, W, ...] -> the caller's slots [B, T, ...]; padding slots hold zeros."""
    x = np.asarray(x)
    tail = (1,) * (x.ndim - 2)
    out = np.take_along_axis(x, back.reshape(*back.shape, *tail), axis=1)
    return np.where(np.asarray(mask).astype(bool).reshape(*mask.shape, *tail), out, np.zeros((), x.dtype))
