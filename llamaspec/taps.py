"""Tap names: the shared vocabulary of intermediate activations.

Both models (and the transformers adapter) expose activations under these names,
in this execution order. Shapes are [B, T, ...]: per-head taps (q, k, v, q_rope,
k_rope) are [B, T, heads, head_dim]; attn_ctx is [B, T, heads * head_dim].
"""

from __future__ import annotations

import fnmatch
import functools
import re
from typing import NamedTuple

LAYER_TAPS = ("attn_norm", "q", "k", "v", "q_rope", "k_rope", "attn_ctx", "attn_out",
              "resid_mid", "mlp_norm", "gate", "up", "act", "mlp_out", "out")

# Every layer step of the family's models in execution order (llamaspec.config.FAMILIES): a
# model's layers have the steps its config names (steps_of), Llama's are LAYER_TAPS.
# q_norm, k_norm: the queries and keys after their norm (Qwen3, Gemma 3 per head; OLMo 2 over
# the whole projection), before RoPE; post_attn_norm, post_mlp_norm: a sublayer's output after
# its norm, before the residual add (Gemma 2/3's sandwich norms, OLMo 2's).
STEPS = ("attn_norm", "q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope", "attn_ctx", "attn_out",
         "post_attn_norm", "resid_mid", "mlp_norm", "gate", "up", "act", "mlp_out", "post_mlp_norm", "out")

# Tap kinds with a heads axis ([B, T, heads, head_dim] in both models).
PER_HEAD = ("q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope")
COMPONENTS = ("embed", "attn_norm", "attn", "mlp_norm", "mlp", "final_norm", "lm_head")

_COMPONENT_OF_LAYER_TAP = {
    "attn_norm": "attn_norm", "q": "attn", "k": "attn", "v": "attn", "q_norm": "attn", "k_norm": "attn",
    "q_rope": "attn", "k_rope": "attn", "attn_ctx": "attn", "attn_out": "attn", "post_attn_norm": "attn_norm",
    "resid_mid": "attn", "mlp_norm": "mlp_norm", "gate": "mlp", "up": "mlp", "act": "mlp", "mlp_out": "mlp",
    "post_mlp_norm": "mlp_norm", "out": "mlp",
}


def steps_of(cfg) -> tuple[str, ...]:
    """The layer steps (tap kinds) of a model of config `cfg` (a llamaspec.LlamaConfig), in order."""
    skip = set()
    if cfg.qk_norm is None:
        skip |= {"q_norm", "k_norm"}
    if cfg.norms == "pre":
        skip |= {"post_attn_norm", "post_mlp_norm"}
    if cfg.norms == "post":
        skip |= {"attn_norm", "mlp_norm"}
    return tuple(s for s in STEPS if s not in skip)


class Vocabulary(NamedTuple):
    """Layers and their steps, for all_taps / resolve / select: e.g. Vocabulary(n, STEPS), every
    step of every family (what a third-party port may map, whatever its family)."""
    num_hidden_layers: int
    layer_steps: tuple[str, ...]


def _layers_and_steps(model) -> tuple[int, tuple[str, ...]]:
    """(layers, steps) of `model`: a layer count (a Llama's steps), a llamaspec.LlamaConfig (its
    family's) or a Vocabulary, or another config with num_hidden_layers (a third-party port's: a
    Llama's)."""
    if isinstance(model, int):
        return model, LAYER_TAPS
    return model.num_hidden_layers, tuple(getattr(model, "layer_steps", LAYER_TAPS))

_LAYER_RE = re.compile(r"^layers\.(\d+)\.([a-z_]+)$")


def all_taps(model) -> list[str]:
    """Every tap name of a model, in execution order: `model` a config (its family's steps), or a
    layer count (a Llama's)."""
    num_layers, steps = _layers_and_steps(model)
    names = ["embed"]
    for i in range(num_layers):
        names += [f"layers.{i}.{t}" for t in steps]
    return names + ["final_norm", "logits"]


def parse(tap: str) -> tuple[int | None, str]:
    """'layers.3.q' -> (3, 'q'); 'embed' -> (None, 'embed')."""
    m = _LAYER_RE.match(tap)
    if m:
        return int(m.group(1)), m.group(2)
    return None, tap


class Tap(NamedTuple):
    """A tap name parsed once: 'layers.3.q' -> Tap('layers.3.q', 3, 'q', 'attn')."""
    name: str
    layer: int | None   # None outside the layers (embed, final_norm, logits)
    kind: str           # the name within its layer: 'q', 'out', ... or 'embed', 'logits'
    component: str      # one of COMPONENTS


@functools.lru_cache(maxsize=None)
def tap(name: str) -> Tap:
    layer, kind = parse(name)
    return Tap(name, layer, kind, component_of(name))


def layer_of(tap: str) -> int | None:
    return parse(tap)[0]


def input_tap(layer: int) -> str:
    """The tap that is layer `layer`'s input: the embedding for layer 0, else the previous
    layer's output."""
    return "embed" if layer == 0 else f"layers.{layer - 1}.out"


def layer_inputs(acts: dict, num_layers: int, cut=slice(None)) -> dict:
    """{layer: its input} from a capture's taps (teacher forcing's inject), each sliced on the
    position axis by `cut`."""
    return {i: acts[input_tap(i)][:, cut] for i in range(num_layers)}


def is_layer_input(tap: str) -> bool:
    """Whether `tap` is some layer's input (what teacher forcing feeds): the embedding (layer
    0's) or a layer's output (the next one's)."""
    return tap == "embed" or (tap.startswith("layers.") and tap.endswith(".out"))


def component_of(tap: str) -> str:
    layer, name = parse(tap)
    if layer is None:
        return {"embed": "embed", "final_norm": "final_norm", "logits": "lm_head"}[name]
    return _COMPONENT_OF_LAYER_TAP[name]


def resolve(requested, model) -> tuple[str, ...]:
    """Expands names and glob patterns ('layers.*.out', '*') into concrete tap names.

    Unknown names are an error that lists what exists: a typo must not silently
    capture nothing.
    """
    if requested is None:
        return ()
    if isinstance(requested, str):
        requested = [requested]
    num_layers, steps = _layers_and_steps(model)
    names = all_taps(model)
    out: list[str] = []
    for pattern in requested:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise KeyError(f"unknown tap '{pattern}' for a {num_layers}-layer model; taps are "
                           f"embed, layers.<0..{num_layers - 1}>.{{{','.join(steps)}}}, "
                           "final_norm, logits")
        out += [h for h in hits if h not in out]
    return tuple(sorted(out, key=names.index))


def select(requested, num_layers, available, missing) -> tuple[str, ...]:
    """Names and globs -> the concrete taps of `available` (in its order) that they name
    (num_layers: a layer count or a config, as resolve takes).
    A glob expands over the available taps; a name outside the vocabulary is resolve's
    KeyError; a name (or a glob matching only such taps) that `available` lacks is a
    KeyError with the text missing(pattern, the first tap lacking)."""
    if requested is None:
        return ()
    if isinstance(requested, str):
        requested = [requested]
    have = set(available)
    out: list[str] = []
    for pattern in requested:
        hits = resolve([pattern], num_layers)
        kept = [h for h in hits if h in have]
        if not kept or (len(kept) != len(hits) and not any(c in pattern for c in "*?[")):
            raise KeyError(missing(pattern, next(h for h in hits if h not in have)))
        out += [h for h in kept if h not in out]
    order = {n: i for i, n in enumerate(available)}
    return tuple(sorted(out, key=order.__getitem__))


_RESIDUAL_TAPS = {"embed", "resid_mid", "out"}


def dtype_of(tap: str, policy) -> str:
    """The dtype a tap holds under `policy` (a llamaspec.Policy): logits in logits_dtype,
    the residual stream (embed, resid_mid, out) in residual_dtype, every other tap in
    compute_dtype. ULPs and unit roundoffs of a tap are counted in this dtype."""
    name = parse(tap)[1]
    if name == "logits":
        return policy.logits_dtype
    if name in _RESIDUAL_TAPS:
        return policy.residual_dtype
    return policy.compute_dtype
