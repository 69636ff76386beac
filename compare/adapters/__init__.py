"""What can stand on either side of a comparison, and how it is made ready.

The Implementation protocol: an object with

    name: str
    taps: tuple[str, ...]                         # the tap names it can return
    capture(tokens, attention_mask, taps, inject=None) -> (logits, {tap: array})   # numpy
    float64() -> Implementation                   # optional: the same thing at float64 (the
                                                  # checkpoint's weights, float64 arithmetic; a
                                                  # `checkpoint` keyword is handed the folder)
    keeps_f32: bool                               # optional: its float64 run keeps f32 steps
                                                  # (else inferred from the twin's numbers)
    supports_inject: bool                         # optional: False says "no teacher forcing" up front

The optional parts and their defaults are listed in docs/ports.md; the engine reads nothing
else. torchref and jaxmodel (OurModel) and transformers (TransformersModel) follow it here;
a user's object that has name, taps and capture is wrapped by `Checked` when a Side is made
(resolve_side): what its capture returns is checked against what it promised, and a
failure names the port and the tap (PortError). A capture without an `inject` parameter,
or one raising NotImplementedError for it, means "no teacher forcing" (inject_support,
forced_capture), which the report says.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from llamaspec import ConfigError, LlamaConfig, LlamaParityError, Policy
from llamaspec.config import FAMILIES

from .dump import expected_shape
from .errors import PortError
from .generic import HF_LLAMA_TAPS, HandedOver, JaxFunction, LinenModule, NnxModule, TorchModule
from .ours import PACKAGES, OurModel, fp64_policy, package_of


def is_transformers_llama(obj) -> bool:
    """True for a transformers *ForCausalLM of a family llama-parity implements (LlamaForCausalLM,
    Qwen2ForCausalLM, ..., Olmo2ForCausalLM: llamaspec.config.FAMILIES), checked without importing
    transformers: an instance of one means transformers is imported already."""
    mod = sys.modules.get("transformers")
    if mod is None:
        return False
    classes = tuple(getattr(mod, c) for c in {prefix + "ForCausalLM" for prefix, _, _ in FAMILIES.values()}
                    if hasattr(mod, c))
    return isinstance(obj, classes)


def __getattr__(name):
    # TransformersModel imports torch: loaded when first asked for, so that `import compare`
    # stays light for users who compare JAX ports.
    if name == "TransformersModel":
        from .transformers import TransformersModel  # lazy: imports torch
        return TransformersModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@runtime_checkable
class Implementation(Protocol):
    name: str
    taps: tuple[str, ...]

    def capture(self, tokens, attention_mask, taps, inject=None): ...


def as_implementation(obj, checkpoint=None) -> Implementation:
    """A model object -> an Implementation: ours and transformers' are wrapped, anything
    that already follows the protocol is returned as is."""
    if package_of(obj) is not None:
        return OurModel(obj, checkpoint)
    if is_transformers_llama(obj):
        from .transformers import TransformersModel  # lazy: imports torch (transformers' is loaded)
        return TransformersModel(obj, checkpoint=checkpoint)
    if isinstance(obj, Implementation):
        return obj
    raise TypeError(f"cannot compare a {type(obj).__name__}: pass 'torchref', 'jaxmodel', a transformers "
                    "LlamaForCausalLM, or an object with name, taps and capture(tokens, attention_mask, taps, "
                    "inject=None) (the Implementation protocol)")


def implementation(spec, checkpoint=None, policy="fp32") -> Implementation:
    """"torchref" | "jaxmodel" (loaded from `checkpoint` at `policy`) | a model object."""
    if isinstance(spec, str):
        if spec not in PACKAGES:
            raise ValueError(f"unknown implementation '{spec}' (torchref, jaxmodel, or a transformers "
                             "LlamaForCausalLM instance)")
        return OurModel.load(spec, checkpoint, Policy.get(policy))
    return as_implementation(spec, checkpoint)


# Fields two implementations of one checkpoint must share for their taps to line up, and
# fields whose difference is a finding the ladder should show (a port that drops the
# config's epsilon), not a reason to refuse.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")
VALUE_FIELDS = ("rms_norm_eps", "tie_word_embeddings", "rope_theta")


def architecture(impl) -> dict | None:
    """The config fields above as the implementation states them (a transformers config or
    ours), or None when it states none (a user's port without a config)."""
    cfg = getattr(impl, "config", None) or getattr(impl, "cfg", None)
    if cfg is None:
        return None
    fields = {f: getattr(cfg, f, None) for f in SHAPE_FIELDS + VALUE_FIELDS}
    if fields["rope_theta"] is None:    # ours: cfg.rope.theta; transformers 5: rope_parameters
        rope = getattr(cfg, "rope", None)
        params = getattr(cfg, "rope_parameters", None)
        fields["rope_theta"] = (getattr(rope, "theta", None) if rope is not None else
                                params.get("rope_theta") if isinstance(params, dict) else None)
    return fields


def config_differences(ref, cand) -> list[str]:
    """Refuses two implementations whose shapes differ (ConfigError naming every field);
    returns the value fields that differ, for the report to say."""
    a, b = architecture(ref), architecture(cand)
    if a is None or b is None:
        return []
    differ = [f for f in a if a[f] is not None and b[f] is not None and a[f] != b[f]]
    shapes = [f"{f}: {a[f]} (reference {ref.name}) vs {b[f]} (candidate {cand.name})"
              for f in differ if f in SHAPE_FIELDS]
    if shapes:
        raise ConfigError("the two implementations are not the same model shape, so their taps cannot be "
                          "compared: " + "; ".join(shapes))
    return [f"{f}: {a[f]} (reference) vs {b[f]} (candidate)" for f in differ]


@dataclasses.dataclass
class Side:
    """One side of the ladder: an implementation at the working policy and at float64.
    at_fp64 is None for an implementation without float64(): as the candidate it is judged
    by structure alone (verdicts.classify_without_twin); the reference needs it (its
    float64 run is the oracle)."""
    name: str
    at_policy: Implementation
    at_fp64: Implementation | None
    keeps_f32: bool     # its float64 run keeps f32 steps (transformers does); the ladder also
                        # infers it from the twin's numbers (compare.ladder.twins)
    taps: tuple[str, ...]

    @classmethod
    def of(cls, impl: Implementation) -> "Side":
        twin = impl.float64() if callable(getattr(impl, "float64", None)) else None
        return cls(impl.name, impl, twin, bool(getattr(impl, "keeps_f32", False)), tuple(impl.taps))

    def needs_twin(self, role: str, what: str) -> None:
        """A clear error when this side has no float64 twin but `what` needs one."""
        if self.at_fp64 is None:
            raise TypeError(f"{self.name} has no float64() (the same implementation computing in float64), "
                            f"which {what} needs as the {role}; put it on the candidate side, where it is "
                            "judged by structure alone, or give it float64()")


def resolve_side(spec, checkpoint, policy) -> Side:
    """A Side as given (e.g. a patched model and its twin, as the planted-bug controls
    make them), or one made from anything `implementation` takes; a user's port is wrapped
    by Checked (its outputs checked, with the checkpoint's shapes when it has a config)."""
    if isinstance(spec, Side):
        return spec
    return Side.of(checked(implementation(spec, checkpoint, policy), checkpoint))


# ----- a port's promises, checked ----------------------------------------------------------

class InjectUnsupported(Exception):
    """A port's capture raised NotImplementedError for inject: no teacher forcing for it."""


def inject_support(impl, methods=("capture",)) -> str | None:
    """None when `impl` takes inject (teacher forcing) in each of `methods` (the decode
    comparison asks for prefill and decode_capture); else why not, as a phrase naming it: a
    `supports_inject = False` attribute, or a method without an `inject` parameter (the
    protocol's two ways to say so; a NotImplementedError at the call is forced_capture's)."""
    name = getattr(impl, "name", type(impl).__name__)
    if getattr(impl, "supports_inject", True) is False:
        return f"{name} takes no inject"
    target = getattr(impl, "wrapped", impl)
    for method in methods:
        try:
            params = inspect.signature(getattr(target, method)).parameters
        except (TypeError, ValueError, AttributeError):
            continue
        if not ("inject" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())):
            return f"{name} takes no inject (its {method} has no inject parameter)"
    return None


def forced_capture(impl, tokens, attention_mask, taps, inject):
    """impl.capture with inject (teacher forcing); a NotImplementedError from it is
    InjectUnsupported, so the ladder reports "teacher forcing not run" instead of failing."""
    try:
        return impl.capture(tokens, attention_mask, taps, inject=inject)
    except NotImplementedError as e:
        name = getattr(impl, "name", type(impl).__name__)
        raise InjectUnsupported(f"{name} takes no inject (its capture raised NotImplementedError: {e})") from None


_OWN = ("compare.adapters.ours", "compare.adapters.transformers", "compare.adapters.dump", "compare.ladder.")


def checked(impl, checkpoint=None):
    """`impl` wrapped by Checked unless it is one of ours (OurModel, TransformersModel, a
    Dump, a CheckpointModel), whose outputs are checked where they are made."""
    if isinstance(impl, Checked) or type(impl).__module__.startswith(_OWN):
        return impl
    cfg = None
    if checkpoint is not None and (Path(checkpoint) / "config.json").is_file():
        try:
            cfg = LlamaConfig.from_file(Path(checkpoint) / "config.json")
        except (LlamaParityError, OSError, ValueError):
            cfg = None
    return checked_with(impl, cfg, checkpoint)


def _twin_of(impl, checkpoint):
    """impl.float64(), handed the checkpoint folder when its float64 takes a `checkpoint` keyword
    (TorchModule's does: the twin then reads the checkpoint's weights at float64 instead of
    casting rounded working weights; docs/ports.md, the twin's contract)."""
    try:
        takes = "checkpoint" in inspect.signature(impl.float64).parameters
    except (TypeError, ValueError):
        takes = False
    return impl.float64(checkpoint=checkpoint) if takes and checkpoint is not None else impl.float64()


class Checked:
    """A user's port whose capture results are checked: a pair (logits, dict), every asked
    tap present, each numpy-convertible, of a float dtype, shaped [B, T, ...] (the
    checkpoint's shape for the tap when a config is known). Other attributes are the port's."""

    def __init__(self, impl, cfg: LlamaConfig | None = None, checkpoint=None):
        self.wrapped, self.cfg_checked = impl, cfg
        self.name, self.taps = str(impl.name), tuple(impl.taps)
        if callable(getattr(impl, "float64", None)):
            self.float64 = lambda: checked_with(_twin_of(impl, checkpoint), cfg)
        for method in _STEPS:   # the decode protocol's calls, where the port has them (never added)
            if callable(getattr(impl, method, None)):
                setattr(self, method, _handed_read_only(self.name, getattr(impl, method)))

    def __getattr__(self, key):
        if key in ("wrapped", "cfg_checked"):
            raise AttributeError(key)
        return getattr(self.wrapped, key)

    def capture(self, tokens, attention_mask, taps, inject=None):
        given = HandedOver(tokens=tokens, mask=attention_mask)    # read-only copies, checked after the call
        try:
            with given.call(self.name):
                out = (self.wrapped.capture(given["tokens"], given["mask"], taps) if inject is None else
                       self.wrapped.capture(given["tokens"], given["mask"], taps, inject=inject))
        except (NotImplementedError, LlamaParityError):
            raise
        except Exception as e:  # noqa: BLE001 (a port's own failure: say whose)
            raise PortError(f"{self.name}: capture raised {type(e).__name__}: {e}") from e
        B, T = np.shape(tokens)[:2]
        logits, arrays = check_capture(self.name, out, list(taps), B, T, self.cfg_checked)
        if "logits" in arrays and logits is not None:
            # the logits tap is what the model returns: whatever follows the lm_head's product (a
            # final soft-cap, a scaling) is judged, whichever module the port's tap was read from
            arrays["logits"] = logits
        return logits, arrays


# The decode protocol's calls: their token ids and masks (numpy arrays) are handed over as
# capture's are, read-only copies checked after the call; the cache is the port's own object.
_STEPS = ("prefill", "prefill_capture", "decode", "decode_capture")


def _handed_read_only(name: str, method):
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(method)
    def call(*args, **kwargs):
        bound = None
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                bound = None
        if bound is None:       # a signature we cannot read: the call as given, its arrays guarded by position
            given = HandedOver(**{f"argument {i}": a for i, a in enumerate(args) if isinstance(a, np.ndarray)})
            args = tuple(given[f"argument {i}"] if isinstance(a, np.ndarray) else a for i, a in enumerate(args))
        else:
            given = HandedOver(**{k: a for k, a in bound.arguments.items() if isinstance(a, np.ndarray)})
            for k in given.arrays:
                bound.arguments[k] = given[k]
            args, kwargs = bound.args, bound.kwargs
        with given.call(name):
            return method(*args, **kwargs)
    return call


def checked_with(impl, cfg, checkpoint=None):
    return (CheckedCallable if callable(impl) else Checked)(impl, cfg, checkpoint)


class CheckedCallable(Checked):
    """Checked for a port that also has a plain forward (__call__), which stays callable."""

    def __call__(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)


def check_capture(name: str, out, asked, batch: int, length: int, cfg=None):
    """(logits, {tap: numpy array}) from what a port's capture returned, or a PortError."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        got = f"a {type(out).__name__}" + (f" of {len(out)} items" if isinstance(out, (tuple, list)) else "")
        raise PortError(f"{name}: capture returned {got}; the protocol returns a pair (logits, {{tap: array}})")
    logits, acts = out
    if not isinstance(acts, Mapping):
        raise PortError(f"{name}: capture's second value is a {type(acts).__name__}; expected a dict {{tap: array}}")
    missing = [t for t in asked if t not in acts]
    if missing:
        raise PortError(f"{name}: capture returned no '{missing[0]}' ({len(missing)} of the {len(asked)} taps asked "
                        f"for missing; it returned {', '.join(list(map(str, acts))[:6]) or 'none'})")
    arrays = {t: _port_array(name, t, acts[t], batch, length, cfg) for t in asked}
    if logits is not None:
        logits = _port_array(name, "logits", logits, batch, length, cfg)
    return logits, arrays


_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _port_array(name: str, tap: str, x, batch: int, length: int, cfg) -> np.ndarray:
    try:
        a = np.asarray(x)
    except Exception as e:  # noqa: BLE001 (a torch tensor needing grad, a list of lists of different lengths)
        raise PortError(f"{name}: tap '{tap}' is a {type(x).__name__} that numpy cannot convert ({e}); return numpy "
                        "arrays (a torch tensor: t.detach().cpu().float().numpy())") from None
    if a.dtype.name not in _FLOATS:
        raise PortError(f"{name}: tap '{tap}' has dtype {a.dtype}; expected a float dtype ({', '.join(_FLOATS)})")
    want = None
    if cfg is not None:
        want = expected_shape(tap, cfg, batch, length)
    if (want is not None and a.shape != want) or a.ndim < 3 or a.shape[:2] != (batch, length):
        said = list(want) if want is not None else f"[{batch}, {length}, ...]"
        raise PortError(f"{name}: tap '{tap}' has shape {list(a.shape)}; expected {said} ([B, T, ...] for "
                        f"{batch} x {length} tokens)")
    return a


__all__ = ["SHAPE_FIELDS", "VALUE_FIELDS", "Checked", "Implementation", "InjectUnsupported", "OurModel", "PortError",
           "Side", "TransformersModel", "check_capture", "checked", "forced_capture", "inject_support",
           "architecture", "as_implementation", "config_differences", "fp64_policy", "implementation",
           "is_transformers_llama", "package_of", "resolve_side"]
__all__ += ["HF_LLAMA_TAPS", "JaxFunction", "LinenModule", "NnxModule", "TorchModule"]
