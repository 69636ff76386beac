"""torchref and jaxmodel under the Implementation protocol.

Their models already capture taps (`capture`) and run the probes' API (call, prefill,
decode, generate); this adds a name, the tap list and the float64 twin.
"""

from __future__ import annotations

import importlib
import sys

import numpy as np

from llamaspec import Policy
from llamaspec import taps as tapnames
from llamaspec.caps import DeviceError
from llamaspec.checkpoint import layer_of_key, numpy_dtype, validated

PACKAGES = ("torchref", "jaxmodel")


def host_array(x) -> np.ndarray:
    """A model's output as a numpy array on the host: a torch tensor through torchref's to_numpy
    (np.asarray refuses a tensor on a GPU, and numpy has no bf16 of torch's), anything else (a
    jax array, numpy) through np.asarray."""
    if type(x).__module__.startswith("torch"):
        from torchref.dtypes import to_numpy  # torchref imports torch: x is a tensor, torch is loaded
        return to_numpy(x)
    return np.asarray(x)


def package_of(model) -> str | None:
    """"torchref" or "jaxmodel" for one of their LlamaModel instances, else None (checked
    without importing either: an instance of one means its package is imported already)."""
    for pkg in PACKAGES:
        mod = sys.modules.get(f"{pkg}.model")
        if mod is not None and isinstance(model, mod.LlamaModel):
            return pkg
    return None


def device_keywords(package: str, device: str) -> dict:
    """from_pretrained's keywords that put `package` on `device`: torchref's {"device": name}
    where torch can compute there (a llamaspec.caps.DeviceError naming the device otherwise: a
    name torch does not know, its meta device, a device this machine or this build lacks);
    jaxmodel's none where `device` is JAX's default backend (jaxmodel takes no device: a
    NotImplementedError otherwise)."""
    if package == "jaxmodel":
        import jax  # jax: slow import; only where a device is named
        if jax.default_backend() != device:
            raise NotImplementedError(f"jaxmodel runs on JAX's default backend ({jax.default_backend()}); "
                                      f"jaxmodel.from_pretrained takes no device, so it cannot load on {device}")
        return {}
    import torch  # torchref imports torch: only where a device is named
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"device {device!r}: not a device torch knows ({e})") from None
    if where.type == "meta":
        raise DeviceError(f"device {device!r}: torch's meta device holds shapes, not values; a model computes on a "
                          "real device (cpu, cuda)")
    try:
        torch.empty(0, device=where)
    except (RuntimeError, AssertionError) as e:     # a CPU-only build asserts
        raise DeviceError(f"device {device!r}: torch cannot place a tensor there ({e})") from None
    return {"device": str(where)}


def fp64_policy(policy: Policy) -> Policy:
    """float64 compute over weights rounded (and fp8-quantized, per layer) as `policy` keeps them
    (Policy.weight_twin)."""
    return policy.weight_twin()


class OurModel:
    """A torchref or jaxmodel LlamaModel; `checkpoint` (the folder it came from) lets the
    float64 twin read the checkpoint's own values rather than the model's rounded ones."""

    keeps_f32 = False

    def __init__(self, model, checkpoint=None):
        self.package = package_of(model)
        if self.package is None:
            raise TypeError(f"OurModel wraps a torchref or jaxmodel LlamaModel, got {type(model).__name__}")
        self.model = model
        self.checkpoint = checkpoint
        self._weights = self._ckpt = None      # weight_sources' reads, on first use
        mesh = getattr(model, "mesh", None)
        # a sharded jaxmodel says so in every report: "jaxmodel (mesh data=1, tensor=3)"
        self.name = self.package if mesh is None else (
            f"{self.package} (mesh {', '.join(f'{a}={n}' for a, n in mesh.shape.items())})")
        if self.backend == "reference":   # the plain reference, said where it is not the default
            self.name += " (reference backend)"
        self.taps = tuple(tapnames.all_taps(model.cfg))

    @classmethod
    def load(cls, package: str, checkpoint, policy, batch_invariant: bool = False, mesh=None,
             backend: str | None = None, device: str | None = None) -> "OurModel":
        """mesh: jaxmodel on a jax.sharding.Mesh (jaxmodel/sharding.py); torchref has none.
        backend: llamaspec.plan.BACKENDS (None: from_pretrained's default). device: torch's name
        of the device torchref loads on (None: torchref's default, the GPU wherever torch reports
        one); jaxmodel runs on JAX's default backend and takes only its name (device_keywords)."""
        if package not in PACKAGES:
            raise ValueError(f"unknown implementation '{package}' (one of {', '.join(PACKAGES)})")
        mod = importlib.import_module(package)
        kw = {"batch_invariant": True} if batch_invariant else {}
        if backend is not None:
            kw["backend"] = backend
        if device is not None:
            kw.update(device_keywords(package, device))
        if mesh is not None:
            if package != "jaxmodel":
                raise ValueError(f"a mesh is for jaxmodel; {package} runs on one device")
            kw["mesh"] = mesh
        return cls(mod.from_pretrained(checkpoint, policy=policy, **kw), checkpoint)

    @property
    def mesh(self):
        """The jax mesh a sharded jaxmodel runs on (its float64 twin runs on the same), else None."""
        return getattr(self.model, "mesh", None)

    @property
    def device(self) -> str | None:
        """The torch device a torchref model is on ("cpu", "cuda:0"); None for jaxmodel (JAX's
        default backend, or its mesh's devices)."""
        return str(self.model.device) if self.package == "torchref" else None

    @property
    def backend(self) -> str | None:
        """The backend the model runs on (its plan's), None for a model without a plan."""
        plan = getattr(self.model, "plan", None)
        return None if plan is None else plan.backend

    @property
    def cfg(self):
        return self.model.cfg

    @property
    def policy(self) -> Policy:
        return self.model.policy

    @property
    def batch_invariant(self) -> bool:
        return bool(getattr(self.model, "batch_invariant", False))

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        return self.model.capture(tokens, attention_mask, taps, inject=inject)

    def __call__(self, tokens, attention_mask=None) -> np.ndarray:
        return host_array(self.model(tokens, attention_mask=attention_mask))

    def prefill(self, ids, mask, total_len: int, inject=None):
        return self.model.prefill(ids, mask, total_len, inject=inject)

    def decode(self, cache, next_ids):
        return self.model.decode(cache, next_ids)

    def prefill_capture(self, ids, mask, total_len: int, taps, inject=None):
        return self.model.prefill_capture(ids, mask, total_len, taps, inject=inject)

    def decode_capture(self, cache, next_ids, taps, inject=None):
        return self.model.decode_capture(cache, next_ids, taps, inject=inject)

    def generate(self, tokens, attention_mask=None, max_new_tokens: int = 32, **kw) -> np.ndarray:
        return self.model.generate(tokens, attention_mask=attention_mask, max_new_tokens=max_new_tokens, **kw)

    def weight_sources(self, key: str):
        """([the weights a port may have quantized projection `key` ("model.layers.{i}.mlp.up_proj")
        from: the checkpoint's own values and their rounding to the layer's param_dtype, or without
        a folder the model's own], its bias or None), for the judge's stored-weights test
        (compare.judge.storage); None for a key the model lacks. Read on first use."""
        if self.checkpoint is None:
            if self._weights is None:
                self._weights = self.model.weights()
            w = self._weights.get(key + ".weight")
            return None if w is None else ([w], self._weights.get(key + ".bias"))
        if self._ckpt is None:
            self._ckpt = validated(self.checkpoint)
        if key + ".weight" not in self._ckpt.keys():
            return None
        layer = layer_of_key(key + ".weight")
        policy = self.policy if layer is None else self.policy.for_layer(layer, self.cfg.num_hidden_layers)
        raw = self._ckpt.read_rows(key + ".weight")
        bias = self._ckpt.read_rows(key + ".bias") if key + ".bias" in self._ckpt.keys() else None
        param = numpy_dtype(policy.param_dtype)
        return [raw, raw.astype(param)], None if bias is None else bias.astype(param)

    def float64(self, rounded_weights: bool = False) -> "OurModel":
        """The same implementation computing in float64, on the model's device (a sharded
        jaxmodel's on its mesh): over the checkpoint's values when the folder is known (the
        ladder's oracle reads the same), else, or with rounded_weights, or under a policy that
        quantizes weights (weight_fp8), over the model's own weights as it rounded and quantized
        them."""
        mod = importlib.import_module(self.package)
        kw = {} if self.mesh is None else {"mesh": self.mesh}     # a sharded model's twin, sharded alike
        if self.device is not None:     # torchref's default is the GPU wherever there is one
            kw["device"] = self.device
        if self.backend == "reference":     # the reference's twin is the reference at float64
            kw["backend"] = "reference"
        quantized = self.model.quantized()
        if self.checkpoint is not None and not rounded_weights and not quantized:
            return OurModel(mod.from_pretrained(self.checkpoint, policy="fp64", **kw), self.checkpoint)
        # a quantizing policy's twin holds the model's own fp8 values and scales (quantizing again
        # from dequantized values would not give them back)
        if quantized:
            kw["quantized"] = quantized
        twin = mod.from_weights(self.model.cfg, self.model.weights(), policy=fp64_policy(self.model.policy), **kw)
        return OurModel(twin, self.checkpoint)
