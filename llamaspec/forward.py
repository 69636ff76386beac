"""What one forward call hands its layers, the same in both models: the tap recorder, the
per-call context and the KV cache a call writes to. Arrays are the framework's own."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .policy import Policy


class Recorder:
    """Keeps the activations whose tap names were asked for (llamaspec.taps names).

    `rec(name, x)` records x under the name (with this recorder's layer prefix) when it
    was asked for, and returns x; `rec.layer(i)` is the recorder for layer i's steps,
    filling the same dict. Asking for no taps costs one set lookup per step.
    """

    def __init__(self, wanted=(), prefix: str = "", acts: dict | None = None):
        self.wanted, self.prefix = frozenset(wanted), prefix
        self.acts = {} if acts is None else acts

    def __call__(self, name: str, x):
        if self.prefix + name in self.wanted:
            self.acts[self.prefix + name] = x
        return x

    def layer(self, i: int) -> "Recorder":
        return Recorder(self.wanted, f"layers.{i}.", self.acts)


class Context(NamedTuple):
    """What every layer of one forward call reads."""
    cos: Any      # RoPE tables [B, T, head_dim]
    sin: Any
    allowed: Any  # [B, T, S]: query slot t may attend to key slot s
    policy: Policy
    positions: Any = None   # [B, T] ints, the tables' positions (for a seam that rebuilds them)
    # A static int c where `allowed` promises causality: allowed[b, t, s] only for s <= c + t (the
    # masks model.causal_allowed builds with a fixed first query slot, once the host has read that
    # the mask keeps it: jaxmodel.model.causal_promise); None: no promise. jaxmodel then reads each
    # block of queries' keys only up to the last one the promise leaves (ops.causal_attention);
    # torchref reads the cut (and whether the mask is a plain prompt's, ops.plain_causal) from the
    # mask itself and ignores it.
    causal_from: int | None = None


class KV(NamedTuple):
    """The KV cache a call writes to: keys and values of every layer (each model's layout,
    on purpose: torchref a [B, Hkv, S, D] tensor per layer, written in place and read as
    strided views; jaxmodel one stacked [L, B, S, Hkv, D] array, updated functionally in a
    donated buffer); index [B] int, the slot of each row's first new token."""
    k: Any
    v: Any
    index: Any


def shared_start(index, T: int, S: int) -> int | None:
    """The slot every row's T new keys start at when KV.index is known on the host (a numpy
    array: a fresh cache's zeros, torchref's decode slot), the same for every row, with room for
    the T keys in a cache of S slots; else None. Then Attention.write_slots' slots (index[b] + t)
    are one block of the cache, and both models write it as such (the same values as the
    scatter): XLA:CPU runs a scatter as a loop over its B * T rows, torch's costs index tensors
    per layer (bench/results/2026-12-03-jaxmodel-prefill-profile.json)."""
    if not isinstance(index, np.ndarray) or index.size == 0 or (index != index.flat[0]).any():
        return None
    start = int(index.flat[0])
    return start if 0 <= start and start + T <= S else None


def scale_queries(scale: float, compute_dtype: str) -> bool:
    """Whether attention may scale the queries [T, D] before their product with the keys instead
    of the scores [T, S] after it (HF's order): the same bits, one pass over the scores less.
    Both models' ops.attention follow it.

    It is when scale is a power of two (head_dim 16, 64, 256) and compute_dtype (a policy's
    name) has f32's exponent range (bfloat16, float32, float64): each product, partial sum and
    rounded result of the product with queries times scale is then the one without it times
    scale, exactly, whatever the kernel's summation order. Except at the ends of the range: a
    value that is subnormal once scaled (below 2^-123 in f32 and bf16 at head_dim 64, about
    1e-37) or a sum that overflows only unscaled. float16 keeps HF's order: its normal range
    ends at 6e-5, where real queries lie."""
    return math.frexp(scale)[0] == 0.5 and compute_dtype in ("bfloat16", "float32", "float64")
