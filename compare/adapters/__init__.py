"""What can stand on either side of a comparison, and how it is made ready.

The Implementation protocol: an object with

    name: str
    taps: tuple[str, ...]                         # the tap names it can return
    capture(tokens, attention_mask, taps, inject=None) -> (logits, {tap: array})   # numpy
    float64() -> Implementation                   # optional: the same thing at float64
    keeps_f32: bool                               # optional: its float64 run keeps f32 steps

torchref and jaxmodel (OurModel) and transformers (TransformersModel) follow it here; a
user's object that has name, taps and capture is used as it is.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Protocol, runtime_checkable

from llamaspec import ConfigError, Policy

from .generic import HF_LLAMA_TAPS, JaxFunction, LinenModule, NnxModule, TorchModule
from .ours import PACKAGES, OurModel, fp64_policy, package_of


def is_transformers_llama(obj) -> bool:
    """True for a transformers LlamaForCausalLM (checked without importing transformers:
    an instance of one means transformers is imported already)."""
    mod = sys.modules.get("transformers")
    return mod is not None and isinstance(obj, mod.LlamaForCausalLM)


def __getattr__(name):
    # TransformersModel imports torch: loaded when first asked for, so that `import compare`
    # stays light for users who compare JAX ports.
    if name == "TransformersModel":
        from .transformers import TransformersModel
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
        from .transformers import TransformersModel
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
    keeps_f32: bool     # its float64 run keeps f32 steps (transformers does)
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
    make them), or one made from anything `implementation` takes."""
    if isinstance(spec, Side):
        return spec
    return Side.of(implementation(spec, checkpoint, policy))


__all__ = ["SHAPE_FIELDS", "VALUE_FIELDS", "Implementation", "OurModel", "Side", "TransformersModel",
           "architecture", "as_implementation", "config_differences", "fp64_policy", "implementation",
           "is_transformers_llama", "package_of", "resolve_side"]
__all__ += ["HF_LLAMA_TAPS", "JaxFunction", "LinenModule", "NnxModule", "TorchModule"]
