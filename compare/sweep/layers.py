"""Which layers a policy hurts, and a mixed policy that keeps them wide (docs/sweep.md, "Layers").

Teacher forcing: the oracle runs a window once and gives every layer's input (its `embed` and
`layers.{i}.out` taps; layer i's input is layer i-1's output). That input, rounded to the policy's
residual dtype (as the policy's model holds a hidden state, and as it rounds an injected one), is
injected into every layer of the policy's model and of the oracle (one capture each), so that
both compute each layer from the same input and what differs is that layer's own arithmetic.
Per layer, over the window's positions:

- update: the layer's update, what its attention and MLP add to the residual stream
  (`attn_out + mlp_out`), against the oracle's: ||Δu|| / ||u||;
- stream: the same error relative to the oracle's layer output, ||Δu|| / ||out||: the ranking
  key, the perturbation the layer's own arithmetic adds to what every later layer reads (they
  read it through an RMSNorm: its size relative to the stream is what travels);
- out: rel_l2 of `layers.{i}.out`, the residual adds' roundings included (which keeping the layer
  wide removes only in part: the next narrow layer rounds its input again).

The input's rounding to the residual dtype is the previous layer's (its output's) and is charged
to none: a layer kept wide inside a narrow policy then shows only its wide arithmetic.
Errors are ratios of sums of squares over the windows measured (not means of ratios); a NaN or
Inf anywhere makes the layer's value NaN, and a NaN ranks as the most sensitive (never hidden).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from llamaspec import Policy
from llamaspec import taps as tapnames
from llamaspec.checkpoint import numpy_dtype
from llamaspec.policy import layer_indices

from ..adapters import forced_capture
from ..metrics import as64, rel_from_squares

SUMS = ("du", "u", "out", "dout")      # per layer: ||Δupdate||², ||update||², ||out||², ||Δout||²


@dataclasses.dataclass(frozen=True)
class LayerErrors:
    """One policy's local error per layer (the module docstring), most sensitive first in
    `ranking` (by `stream`); `window_top`: each measured window's own top layers (as many as the
    sweep keeps wide, at least 3), to see whether one window would have named the same."""
    policy: str
    update: list
    stream: list
    out: list
    ranking: list
    windows: int
    tokens: int
    window_top: list


def layer_taps_of(i: int) -> list[str]:
    """Layer i's output and the two parts of its update."""
    return [f"layers.{i}.{t}" for t in ("out", "attn_out", "mlp_out")]


def layer_taps(num_layers: int) -> list[str]:
    """What a forced capture returns: every layer's layer_taps_of."""
    return [t for i in range(num_layers) for t in layer_taps_of(i)]


class OracleWindow:
    """The oracle's runs of one window: its layers' inputs, and per residual dtype (at()) those
    inputs rounded to it with the oracle's outputs and updates from them, in float64."""

    def __init__(self, oracle, chunk: np.ndarray, num_layers: int):
        self.oracle, self.n, self.tokens = oracle, num_layers, chunk[None, :]
        _, acts = oracle.capture(self.tokens, None, ["embed", *(f"layers.{i}.out" for i in range(num_layers))])
        self.inputs = tapnames.layer_inputs(acts, num_layers)
        self._dtype, self._held = None, None

    def at(self, dtype: str) -> tuple[dict, list, list]:
        """(inject, outputs, updates): the inputs rounded to `dtype`, and the oracle from them; the
        last dtype asked is held (ask policies grouped by residual dtype)."""
        if dtype != self._dtype:
            self._held = None     # one dtype's arrays in memory at a time
            inject = {i: x.astype(numpy_dtype(dtype)) for i, x in self.inputs.items()}
            _, acts = forced_capture(self.oracle, self.tokens, None, layer_taps(self.n), inject)
            self._dtype = dtype
            terms = [oracle_terms(acts, i) for i in range(self.n)]
            self._held = (inject, [t[0] for t in terms], [t[1] for t in terms])
        return self._held


def _update(acts: dict, i: int) -> np.ndarray:
    return as64(acts[f"layers.{i}.attn_out"]) + as64(acts[f"layers.{i}.mlp_out"])


def oracle_terms(acts: dict, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(out, update) of layer i in float64, from the oracle's taps (layer_taps) of that layer."""
    return as64(acts[f"layers.{i}.out"]), _update(acts, i)


def layer_sums(acts: dict, i: int, out_o: np.ndarray, update_o: np.ndarray) -> tuple[float, ...]:
    """Layer i's SUMS: the policy's taps `acts` against the oracle's (out, update) (oracle_terms),
    both from the same input."""
    return (_sq(_update(acts, i) - update_o), _sq(update_o), _sq(out_o),
            _sq(as64(acts[f"layers.{i}.out"]) - out_o))


def _sq(x: np.ndarray) -> float:
    """sum x² in float64; NaN when x holds NaN or Inf (rel_from_squares carries it)."""
    return float(np.sum(x * x)) if np.isfinite(x).all() else math.nan


class LayerAccumulator:
    """Sums of squares per layer for one policy, fed one window at a time (add), then result()."""

    def __init__(self, policy: str, num_layers: int, top: int):
        self.policy, self.n, self.top = policy, num_layers, top
        self.sums = {k: np.zeros(num_layers) for k in SUMS}
        self.window_top: list[list[int]] = []
        self.windows = self.tokens = 0

    def add(self, model, oracle: OracleWindow) -> None:
        """The policy's model on the window, every layer's input forced to the oracle's (rounded
        to the policy's residual dtype, as the oracle's run it is compared with)."""
        inject, outs, updates = oracle.at(model.policy.residual_dtype)
        _, acts = forced_capture(model, oracle.tokens, None, layer_taps(self.n), inject)
        self.add_window([layer_sums(acts, i, outs[i], updates[i]) for i in range(self.n)], oracle.tokens.shape[1])

    def add_window(self, rows: list, tokens: int) -> None:
        """One window's layer_sums, a row per layer (the streamed sweep makes them layer by layer)."""
        one = {k: np.array([row[j] for row in rows], np.float64) for j, k in enumerate(SUMS)}
        for k in SUMS:
            self.sums[k] += one[k]
        self.window_top.append(rank(_stream(one))[:self.top])
        self.windows += 1
        self.tokens += tokens

    def result(self) -> LayerErrors:
        s = self.sums
        stream = _stream(s)
        return LayerErrors(self.policy, [rel_from_squares(a, b) for a, b in zip(s["du"], s["u"])], stream,
                           [rel_from_squares(a, b) for a, b in zip(s["dout"], s["out"])], rank(stream),
                           self.windows, self.tokens, self.window_top)


def _stream(s: dict) -> list[float]:
    return [rel_from_squares(a, b) for a, b in zip(s["du"], s["out"])]


def rank(errors) -> list[int]:
    """Layer indices, the largest error first (NaN before everything; ties: the earlier layer)."""
    return sorted(range(len(errors)), key=lambda i: (not math.isnan(errors[i]), -errors[i] if errors[i] == errors[i]
                                                     else 0.0, i))


_MANTISSA = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7}


def covers(policy: Policy, wide: Policy) -> bool:
    """Whether `policy` is already at least as wide as `wide` everywhere: no per-layer overrides,
    every dtype with at least as many mantissa bits, no quantization `wide` does not also do.
    Keeping its layers wide would change nothing (fp32 against a wide fp32, fp64-hf, tf32 on a CPU)."""
    if policy.layers:
        return False
    dtypes = [f.name for f in dataclasses.fields(Policy) if f.name.endswith("_dtype")]
    if any(_MANTISSA[getattr(policy, d)] < _MANTISSA[getattr(wide, d)] for d in dtypes):
        return False
    return all(getattr(policy, k) in (None, getattr(wide, k)) for k in ("weight_fp8", "act_fp8", "kv_cache"))


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """`policy` with its `kept` layers (the most sensitive it does not override already) computed
    by `wide`: the policy named `name`, measured over the text as a row of its own."""
    policy: str
    name: str
    kept: list
    wide: str


def suggest(policy: Policy, errors: LayerErrors, k: int, wide: Policy) -> tuple[Suggestion, Policy] | None:
    """The mixed policy: `policy` with its k most sensitive layers overridden to `wide`; None when
    k is 0 or the policy already covers `wide`. Its name is the policy string (P+layers[i]=W...)."""
    if k <= 0 or covers(policy, wide):
        return None
    n = len(errors.ranking)
    taken = {i for sel, _ in policy.layers for i in layer_indices(sel, n, policy.name)}
    kept = sorted([i for i in errors.ranking if i not in taken][:k])
    if not kept:
        return None
    name = policy.name + "".join(f"+layers[{i}]={wide.name}" for i in kept)
    mixed = Policy.get(policy, layers=(*policy.layers, *((str(i), wide) for i in kept)), name=name)
    return Suggestion(policy.name, name, kept, wide.name), mixed
