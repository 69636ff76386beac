"""What the third-party port adapters share: the dtype a policy asks of a port, the config
as a port actually uses it, input checks, tap selection and the inject checks."""

from __future__ import annotations

import dataclasses

import numpy as np

from llamaspec import Policy, positions_from_mask
from llamaspec import taps as tapnames
from llamaspec.config import Shape
from llamaspec.inputs import check_token_array

# A policy's parameter dtype -> the dtype name a port is loaded at. A port runs one dtype
# for its parameters and activations (its own f32 islands aside), as transformers does.
PORT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def port_dtype(policy) -> str:
    """"fp32" / a Policy -> "float32" and so on. A policy whose compute dtype differs from its
    parameter dtype (bf16w-f32) is not something a port's loader offers: a ValueError.
    A dtype name ("float32", ...) is taken as it is."""
    if isinstance(policy, str) and policy in PORT_DTYPES:
        return policy
    p = Policy.get(policy)
    if p.param_dtype != p.compute_dtype or p.param_dtype not in PORT_DTYPES:
        raise ValueError(f"policy '{p.name}': a third-party port runs one dtype for weights and activations "
                         f"(params {p.param_dtype}, compute {p.compute_dtype} here); use fp32, bf16, fp16 or fp64")
    return p.param_dtype


@dataclasses.dataclass(frozen=True)
class PortConfig(Shape):
    """The architecture as the port computes it (not as config.json says it), read from the
    port's own objects, for compare.adapters.config_differences and the report."""
    tie_word_embeddings: bool | None
    rope_theta: float | None


class PortBase:
    """Input checks, tap selection and inject checks shared by the port adapters. A
    subclass sets name, config (a PortConfig), taps, supports_inject."""

    keeps_f32 = False
    supports_inject = True

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def cfg(self) -> PortConfig:
        return self.config

    def resolve(self, requested) -> tuple[str, ...]:
        return tapnames.select(requested, self.num_layers, self.taps, lambda pattern, _: (
            f"tap '{pattern}' is not returned by {self.name}; it returns: {', '.join(self.taps)}"))

    def inputs(self, tokens, attention_mask):
        """(ids int64, mask int64, positions int32 = cumsum(mask) - 1), checked."""
        ids, mask = check_token_array(tokens, attention_mask, self.config.vocab_size)
        mask = np.asarray(mask, np.int64)
        return np.asarray(ids, np.int64), mask, positions_from_mask(mask)

    def forced(self, inject, shape) -> dict[int, np.ndarray]:
        """inject {layer: hidden [B, T, D]} checked against this port's layers and the input."""
        out = {}
        for layer, x in (inject or {}).items():
            if not (isinstance(layer, (int, np.integer)) and 0 <= layer < self.num_layers):
                raise ValueError(f"inject: layer {layer!r} is not in 0..{self.num_layers - 1}")
            x = np.asarray(x)
            if x.shape != (*shape, self.config.hidden_size):
                raise ValueError(f"inject[{layer}]: shape {x.shape}, expected {(*shape, self.config.hidden_size)}")
            out[int(layer)] = x
        return out

    def finish(self, logits, acts: dict, wanted):
        missing = [t for t in wanted if t not in acts]
        if missing:
            raise RuntimeError(f"{self.name}: taps not produced: {', '.join(missing)} (the port's forward did "
                               "not call the module they hook; has its code changed?)")
        return np.asarray(logits), {t: np.asarray(acts[t]) for t in wanted}


def by_rows(capture_row, ids, mask, forced):
    """A port without a padding mask on a padded batch: capture_row(ids [1, n], {layer: hidden
    [1, n, D]}) -> (logits, {tap: [1, n, ...]}) on each row's real tokens; padding slots
    hold 0. An unpadded batch is one call."""
    if mask.all():
        return capture_row(ids, forced)
    real = mask.astype(bool)
    logits, acts = None, {}
    for b in range(len(ids)):
        cols = np.flatnonzero(real[b])
        row_logits, row_acts = capture_row(ids[b:b + 1, cols], {i: h[b:b + 1, cols] for i, h in forced.items()})
        if logits is None:
            logits = np.zeros(ids.shape + row_logits.shape[2:], row_logits.dtype)
            acts = {t: np.zeros(ids.shape + x.shape[2:], x.dtype) for t, x in row_acts.items()}
        logits[b, cols] = row_logits[0]
        for t, x in row_acts.items():
            acts[t][b, cols] = x[0]
    return logits, acts
