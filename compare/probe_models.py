"""Models as the invariance probes see them: a name, a policy, a mode, an fp64 twin.

    pm = load_model("jaxmodel", folder, "bf16", batch_invariant=True)   # by name
    pm = as_probe_model(my_model)                                        # any model object

A probe needs three things from a model: logits(ids, mask) -> numpy [B, T, V];
prefill/decode for greedy loops (llamaspec.generate's contract); and the model's own
rounding error, to tell drift from a bug. The rounding error is measured against the
model's fp64 twin: the same implementation with the same (already rounded) weights,
computing in float64. Weight rounding is shared by every run of the model, so only
compute rounding can make two runs differ, and that is what the twin isolates.

A ModelSpec (impl, checkpoint, policy, mode) can be rebuilt in another process: the
determinism probe's fresh-process runs use it (compare.probe_worker).
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np

from llamaspec import Policy

IMPLS = ("torchref", "jaxmodel", "transformers")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    impl: str                   # torchref | jaxmodel | transformers
    checkpoint: str
    policy: str = "fp32"        # preset name
    batch_invariant: bool = False
    attn_implementation: str = "eager"   # transformers only
    positions: str = "mask"              # transformers only: "mask" | "default"

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"unknown implementation '{self.impl}' (one of {', '.join(IMPLS)})")

    @property
    def mode(self) -> str:
        return "invariant" if self.batch_invariant else "default"

    def load(self):
        """The raw model object (torchref/jaxmodel LlamaModel, or an HFRunner)."""
        if self.impl == "transformers":
            if self.batch_invariant:
                raise NotImplementedError("transformers has no batch-invariant mode")
            from .hf_runner import HFRunner
            return HFRunner.from_pretrained(self.checkpoint, self.policy, self.attn_implementation,
                                            self.positions)
        mod = importlib.import_module(self.impl)
        kw = {"batch_invariant": True} if self.batch_invariant else {}
        return mod.from_pretrained(self.checkpoint, policy=self.policy, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ProbeModel:
    """A model plus what the probes need to judge it (name, policy, mode, fp64 twin)."""

    def __init__(self, model, name: str | None = None, policy: str | None = None,
                 mode: str | None = None, oracle=None, spec: ModelSpec | None = None):
        self.model = model
        self.spec = spec
        self.impl = spec.impl if spec else _impl_of(model)
        pol = getattr(model, "policy", None)
        self.policy = policy or (spec.policy if spec else getattr(pol, "name", None) or _hf_policy(model))
        self.compute_dtype = (pol.compute_dtype if pol is not None else
                              _hf_dtype(model) if self.impl == "transformers" else
                              Policy.get(self.policy).compute_dtype)
        self.mode = mode or (spec.mode if spec else
                             "invariant" if getattr(model, "batch_invariant", False) else "default")
        self.name = name or f"{self.impl} {self.policy} {self.mode}"
        # transformers keeps f32 steps (norm, RoPE, softmax) inside a float64 model
        self.keeps_f32 = self.impl == "transformers"
        self._oracle = oracle

    def logits(self, ids, mask=None) -> np.ndarray:
        return np.asarray(self.model(ids, attention_mask=mask))

    def prefill(self, ids, mask, total_len):
        return self.model.prefill(ids, mask, total_len)

    def decode(self, cache, next_ids):
        return self.model.decode(cache, next_ids)

    @property
    def vocab_size(self) -> int:
        return int(self.model.cfg.vocab_size)

    @property
    def pad_id(self) -> int:
        pad = getattr(self.model.cfg, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    def oracle(self):
        """The fp64 twin (built on first use), or None when none can be made."""
        if self._oracle is None:
            self._oracle = fp64_twin(self.model, self.spec)
        return self._oracle


def _impl_of(model) -> str:
    mod = type(model).__module__.split(".")[0]
    if mod in ("torchref", "jaxmodel"):
        return mod
    if type(model).__name__ in ("HFRunner", "LlamaForCausalLM"):
        return "transformers"
    return type(model).__name__


def _hf_dtype(model) -> str:
    return str(getattr(model, "dtype", "float32")).removeprefix("torch.")


def _hf_policy(model) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(
        _hf_dtype(model), _hf_dtype(model))


def fp64_policy(policy: Policy) -> Policy:
    """float64 compute over weights rounded as `policy` rounds them."""
    return Policy.get("fp64", param_dtype=policy.param_dtype, name=f"fp64 over {policy.param_dtype} weights")


def fp64_twin(model, spec: ModelSpec | None = None):
    """The same implementation with the same rounded weights, computing in float64.

    torchref and jaxmodel twins are built from the model's own weights (no path
    needed); a transformers model is deep-copied to float64 (it keeps its f32 islands).
    Returns None for an object we do not know how to copy.
    """
    impl = spec.impl if spec else _impl_of(model)
    if impl == "transformers":
        import torch

        from .hf_adapter import copy_at
        from .hf_runner import HFRunner
        runner = model if isinstance(model, HFRunner) else HFRunner(model)
        return HFRunner(copy_at(runner.model, torch.float64), runner.positions)
    if impl == "torchref":
        import torchref.model as tm
        from torchref.dtypes import to_numpy
        weights = {k: to_numpy(v.detach().cpu()) for k, v in model.state_dict().items()}
        return tm.LlamaModel(model.cfg, fp64_policy(model.policy), "cpu").load_numpy(weights).eval()
    if impl == "jaxmodel":
        from flax import nnx

        import jaxmodel.model as jm
        weights = {}
        for path, var in nnx.to_flat_state(model.state):
            key = ".".join(str(p) for p in path)
            weights[key if key.startswith("lm_head") else "model." + key] = np.asarray(var[...])
        return jm.LlamaModel(jm.Llama(model.cfg, fp64_policy(model.policy), weights))
    return None


def load_model(impl: str, checkpoint, policy: str = "fp32", batch_invariant: bool = False,
               **hf_options) -> ProbeModel:
    """Loads an implementation by name; raises NotImplementedError when the mode is not
    available (batch_invariant on an implementation that has no such mode)."""
    spec = ModelSpec(impl, str(checkpoint), Policy.get(policy).name, batch_invariant, **hf_options)
    return ProbeModel(spec.load(), spec=spec)


def as_probe_model(model, oracle=None, name: str | None = None) -> ProbeModel:
    """Wraps any model object (torchref, jaxmodel, transformers LlamaForCausalLM or
    HFRunner, or a patched model with the same call API) for the probes."""
    if isinstance(model, ProbeModel):
        if oracle is not None:
            model._oracle = oracle
        return model
    if type(model).__name__ == "LlamaForCausalLM":
        from .hf_runner import HFRunner
        model = HFRunner(model)
    return ProbeModel(model, name=name, oracle=oracle)
