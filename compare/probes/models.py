"""Models as the invariance probes see them: a name, a policy, a mode, an fp64 twin.

    pm = load_model("jaxmodel", folder, "bf16", batch_invariant=True)   # by name
    pm = as_probe_model(my_model)                                        # any model object

A probe needs three things from a model: logits(ids, mask) -> numpy [B, T, V];
prefill/decode for greedy loops (llamaspec.generate's contract); and the model's own
rounding error, to tell drift from a bug. The rounding error is measured against the
model's fp64 twin: the same implementation with the same (already rounded) weights,
computing in float64. Weight rounding is shared by every run of the model, so only
compute rounding can make two runs differ, and that is what the twin isolates.

A ModelSpec (impl, checkpoint, policy, mode, device) can be rebuilt in another process: the
determinism probe's fresh-process runs use it (compare.probes.worker), and probe where's (rerun
in a fresh process; the device circumstance's side under an instruction-set cap). A port is
rebuilt there by its factory, "module:function" (function(checkpoint, policy) -> the port),
named in Python by its author (never read from a checkpoint, dump or command line).
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import numpy as np

from llamaspec import Policy

from ..adapters import OurModel, as_implementation, is_transformers_llama, package_of
from ..adapters.ours import host_array

IMPLS = ("torchref", "jaxmodel", "transformers")
_FACTORY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    impl: str                   # torchref | jaxmodel | transformers
    checkpoint: str
    policy: str = "fp32"        # preset name
    batch_invariant: bool = False
    attn_implementation: str = "eager"   # transformers only
    positions: str = "mask"              # transformers only: "mask" | "default"
    device: str | None = None   # torch's device name ("cpu", "cuda"); None: the implementation's default
    factory: str | None = None  # a port: "module:function" that loads it (impl is then the port's name)

    def __post_init__(self):
        if self.factory is not None:
            if not _FACTORY.fullmatch(self.factory):
                raise ValueError(f"factory {self.factory!r}: expected 'module.name:function' (an importable module, "
                                 "not a path)")
        elif self.impl not in IMPLS:
            raise ValueError(f"unknown implementation '{self.impl}' (one of {', '.join(IMPLS)}; a port: factory=)")

    @property
    def mode(self) -> str:
        return "invariant" if self.batch_invariant else "default"

    def load(self):
        """The model: a torchref/jaxmodel LlamaModel, a TransformersModel, or the factory's port.
        device: torchref loads there, jaxmodel only on JAX's default backend (adapters.ours.
        device_keywords), transformers only on the CPU (a NotImplementedError names it otherwise)."""
        if self.factory is not None:
            module, _, name = self.factory.partition(":")
            return getattr(importlib.import_module(module), name)(self.checkpoint, self.policy)
        if self.impl == "transformers":
            if self.device not in (None, "cpu"):
                raise NotImplementedError(f"transformers loads on the CPU only here, not on {self.device}")
            if self.batch_invariant:
                raise NotImplementedError("transformers has no batch-invariant mode")
            from ..adapters.transformers import TransformersModel  # lazy: imports torch
            return TransformersModel.from_pretrained(self.checkpoint, self.policy, self.attn_implementation,
                                                     self.positions)
        return OurModel.load(self.impl, self.checkpoint, self.policy, self.batch_invariant, device=self.device).model

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ProbeModel:
    """A model plus what the probes need to judge it (name, policy, mode, fp64 twin)."""

    def __init__(self, model, name: str | None = None, policy: str | None = None,
                 mode: str | None = None, oracle=None, spec: ModelSpec | None = None):
        self.model = model
        self.spec = spec
        self.impl = spec.impl if spec else _impl_of(model)
        pol = policy or getattr(model, "policy", None)
        pol = Policy.get(pol) if isinstance(pol, str) else pol   # TransformersModel names a preset
        self.policy = spec.policy if spec else getattr(pol, "name", None)
        if self.policy is None:
            raise TypeError(f"{name or _impl_of(model)}: the probes judge against the policy's rounding and this "
                            "model states none: pass policy= (a preset name: fp32, bf16, fp16, fp64)")
        self.compute_dtype = (pol or Policy.get(self.policy)).compute_dtype
        self.mode = mode or (spec.mode if spec else
                             "invariant" if getattr(model, "batch_invariant", False) else "default")
        self.name = name or f"{self.impl} {self.policy} {self.mode}"
        # transformers keeps f32 steps (norm, RoPE, softmax) inside a float64 model
        self.keeps_f32 = self.impl == "transformers"
        self._oracle = oracle

    def logits(self, ids, mask=None) -> np.ndarray:
        return logits_of(self.model, ids, mask)

    def prefill(self, ids, mask, total_len):
        self._needs("prefill")
        return self.model.prefill(ids, mask, total_len)

    def decode(self, cache, next_ids):
        self._needs("decode")
        return self.model.decode(cache, next_ids)

    def _needs(self, method: str):
        if not callable(getattr(self.model, method, None)):
            raise TypeError(f"{self.name}: this probe decodes greedily and needs {method}(...) (llamaspec.generate's "
                            "contract: prefill(ids, mask, total_len) and decode(cache, next_ids)); the batch, "
                            "padding and determinism probes need only logits")

    @property
    def cfg(self):
        cfg = getattr(self.model, "cfg", None) or getattr(self.model, "config", None)
        if cfg is None or getattr(cfg, "vocab_size", None) is None:
            raise TypeError(f"{self.name}: the probes need the model's vocab_size (a `cfg` or `config` attribute "
                            "with vocab_size, and pad_token_id / eos_token_ids where it has them)")
        return cfg

    @property
    def vocab_size(self) -> int:
        return int(self.cfg.vocab_size)

    @property
    def pad_id(self) -> int:
        pad = getattr(self.cfg, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    def oracle(self):
        """The fp64 twin (built on first use), or None when none can be made."""
        if self._oracle is None:
            self._oracle = fp64_twin(self.model)
        return self._oracle


def _impl_of(model) -> str:
    return getattr(model, "package", None) or package_of(model) or type(model).__name__


def fp64_twin(model):
    """The same implementation with the same rounded weights, computing in float64 on the same
    device (adapters: OurModel.float64, TransformersModel.float64), or None for an object whose
    twin cannot be made (a user's wrapper: pass its twin as `oracle`)."""
    try:
        impl = as_implementation(model)
    except TypeError:
        return None
    make = getattr(impl, "float64", None)
    if make is None:
        return None
    try:
        return make(rounded_weights=True)
    except TypeError:       # a port's float64() casts its own (rounded) weights: the same thing
        return make()


def load_model(impl: str, checkpoint, policy: str = "fp32", batch_invariant: bool = False,
               **hf_options) -> ProbeModel:
    """Loads an implementation by name; raises NotImplementedError when the mode is not
    available (batch_invariant on an implementation that has no such mode)."""
    spec = ModelSpec(impl, str(checkpoint), Policy.get(policy).name, batch_invariant, **hf_options)
    return ProbeModel(spec.load(), spec=spec)


def as_probe_model(model, oracle=None, name: str | None = None, policy=None) -> ProbeModel:
    """Wraps any model object (torchref, jaxmodel, a transformers LlamaForCausalLM or
    TransformersModel, a patched model with the same call API, or a port under the
    Implementation protocol: its capture's logits, its float64() as the twin; policy=
    when it states none) for the probes."""
    if isinstance(model, ProbeModel):
        if oracle is not None:
            model._oracle = oracle
        return model
    if is_transformers_llama(model):
        from ..adapters.transformers import TransformersModel  # lazy: imports torch
        model = TransformersModel(model)
    port = not (package_of(model) or getattr(model, "package", None) == "transformers")
    return ProbeModel(model, name=name or (getattr(model, "name", None) if port else None), policy=policy,
                      oracle=oracle)


def logits_of(model, ids, mask) -> np.ndarray:
    """A model's logits whether it is called (ours, transformers) or captures (a port)."""
    if callable(model):
        return host_array(model(ids, attention_mask=mask))
    return np.asarray(model.capture(ids, mask, ["logits"])[0])
