"""Precision policies: one object, the same meaning in JAX and PyTorch.

A policy names the dtype of every numerically relevant step of a Llama forward pass,
so that "what if only softmax were bf16?" is one keyword away:

    Policy.get("bf16", softmax_dtype="bfloat16")

Knob meanings (both models implement exactly this):

- param_dtype: weights are rounded to this dtype on load (what is "stored").
- compute_dtype: activations between ops (embedding output, q/k/v, attention
  probabilities fed to P@V, MLP intermediates). Weights are cast to it for matmuls.
- matmul: "ieee" = full-precision products (JAX Precision.HIGHEST, torch
  fp32_precision "ieee"); "tf32" = TensorFloat-32 where the hardware has it (a CPU has
  not, so tf32 equals ieee there).
- accum_dtype: accumulation dtype of every matmul (JAX preferred_element_type); the
  result is then rounded to compute_dtype.
- norm_dtype: RMSNorm computes mean(x^2) and rsqrt in this dtype.
- norm_cast_before_weight: True: the normalised x is rounded back to the input dtype before it
  is multiplied by the norm weight (transformers' Llama, Qwen, Mistral); False: the weight is
  applied in norm_dtype and the product rounded once (transformers' Gemma and OLMo 2: their
  modeling files say so). None (every preset): the model's family's convention, read from its
  config at load (llamaspec.config.LlamaConfig.norm_weight_in_norm_dtype; Policy.for_family).
- softmax_dtype: attention scores are cast to this dtype for the mask and softmax;
  probabilities are rounded to compute_dtype afterwards.
- rope_dtype: inverse frequencies, angles and cos/sin are computed in this dtype
  (HF: float32), then rounded to compute_dtype when applied.
- residual_dtype: dtype of the residual stream (h = h + sublayer(h)).
- logits_dtype: dtype of the lm_head output (the lm_head matmul accumulates in
  accum_dtype and is rounded once to this).

Quantization and per-layer knobs (docs/fp8.md; None / () = off):

- weight_fp8: an fp8 scaling spec (llamaspec.quant.Scaling, e.g. "e4m3:block128") for the seven
  projection weights of every block (q, k, v, o, gate, up, down; not the embedding, the norms or
  the lm_head). Each is rounded to param_dtype, quantized, and kept dequantized (q x scale) in the
  fp8 product dtype below. The float64 twin keeps the quantized weights (same q, same scales).
- act_fp8: an fp8 scaling spec for the activation entering each of those projections, read as a
  [tokens, in] matrix: "tensor" (one scale per call: it depends on the whole batch, padding
  included) or "channel" (one scale per token). Quantized and dequantized at every call.
- A projection with either knob multiplies in the fp8 product dtype, float32 (float64 under a
  float64 compute_dtype): both operands widened exactly, summed there, rounded once to
  compute_dtype. Widening fp8 values to f32 and multiplying there gives the numbers an fp8 x fp8
  -> f32 product gives (every fp8 x fp8 product is exact in f32), up to the order of the sum.
- kv_cache: the storage of keys (after RoPE) and values, which attention reads: None (as
  computed, compute_dtype), a dtype name (each rounded to it, then back to compute_dtype), or an
  fp8 spec with granularity "channel" (one scale per token and kv head, over head_dim). The
  rounding happens in every call, with or without a cache: a prompt's attention reads what a
  decode step would read back.
- layers: overrides per layer, ((selector, Policy), ...), spelled "layers[0:2]=bf16" in a policy
  string: a selector is a Python index or slice over the layers ("3", "0:2", "-2:"); the layers it
  names compute their block (norms, projections, attention, MLP, residual add, RoPE tables) by
  that policy. The embedding, the final norm, the lm_head and logits_dtype follow the base.

A policy string is a preset with knobs after "+": "bf16+weight_fp8=e4m3:block128",
"bf16+kv_cache=e4m3:channel", "fp8w+layers[0:2]=bf16+layers[-2:]=bf16". Policy.get reads it and
a policy made with overrides is named by it, so a name can be handed back to Policy.get.
"""

from __future__ import annotations

import dataclasses
import re

from .errors import PolicyError
from .quant import Scaling

DTYPES = ("float64", "float32", "bfloat16", "float16")
MATMUL = ("ieee", "tf32")
_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    param_dtype: str
    compute_dtype: str
    matmul: str
    accum_dtype: str
    norm_dtype: str
    softmax_dtype: str
    rope_dtype: str
    residual_dtype: str
    logits_dtype: str
    norm_cast_before_weight: bool | None = None
    weight_fp8: str | None = None
    act_fp8: str | None = None
    kv_cache: str | None = None
    layers: tuple = ()

    def __post_init__(self):
        for knob in ("weight_fp8", "act_fp8", "kv_cache"):     # spellings kept as their canonical spec
            v = getattr(self, knob)
            object.__setattr__(self, knob, None if v is None else _check_knob(self.name, knob, v))
        object.__setattr__(self, "layers", _check_layers(self.name, self.layers))
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_dtype") and v not in DTYPES:
                raise PolicyError(f"policy '{self.name}': {f.name}={v!r} is not one of {DTYPES}")
        if _WIDTH[self.accum_dtype] < _WIDTH[self.compute_dtype]:
            raise PolicyError(f"policy '{self.name}': accum_dtype={self.accum_dtype} is narrower "
                              f"than compute_dtype={self.compute_dtype}; low-precision "
                              "accumulation is not something either framework exposes")
        if self.matmul not in MATMUL:
            raise PolicyError(f"policy '{self.name}': matmul={self.matmul!r} is not one of {MATMUL}")
        if self.norm_cast_before_weight is not None and not isinstance(self.norm_cast_before_weight, bool):
            raise PolicyError(f"policy '{self.name}': norm_cast_before_weight={self.norm_cast_before_weight!r} "
                              "must be True or False (a string is not a boolean), or None (the family's convention)")
        if not isinstance(self.name, str) or not self.name:
            raise PolicyError(f"policy name {self.name!r} must be a non-empty string")

    @staticmethod
    def get(policy: "str | Policy", **overrides) -> "Policy":
        """A preset by name or a policy string ("bf16+kv_cache=e4m3:channel", the module
        docstring), or a policy object, with any knob overridden."""
        if isinstance(policy, Policy):
            base = policy
        elif isinstance(policy, str):
            if policy not in PRESETS:
                return _parse(policy, overrides)
            base = PRESETS[policy]
        else:
            raise PolicyError(f"policy must be a preset name or a Policy, not {type(policy).__name__}")
        if not overrides:
            return base
        unknown = set(overrides) - {f.name for f in dataclasses.fields(Policy)}
        if unknown:
            raise PolicyError(f"unknown policy knob(s) {sorted(unknown)}")
        name = overrides.pop("name", None)
        if "layers" in overrides:
            overrides["layers"] = _check_layers(base.name, overrides["layers"])
        new = dataclasses.replace(base, name=base.name, **overrides)
        return dataclasses.replace(new, name=name or base.name + "".join(
            "+" + _spell(k, getattr(new, k)) for k in sorted(overrides)))

    @staticmethod
    def from_dict(d: dict) -> "Policy":
        """A policy from to_dict()'s output (a JSON report's or a dump manifest's)."""
        if not isinstance(d, dict):
            raise PolicyError(f"a policy's knobs are an object, not {type(d).__name__}")
        return Policy(**d)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["layers"] = [[sel, p.to_dict()] for sel, p in self.layers]
        return d

    @property
    def is_fp64(self) -> bool:
        return all(getattr(p, f.name) == "float64" for p in (self, *(p for _, p in self.layers))
                   for f in dataclasses.fields(p) if f.name.endswith("_dtype"))

    @property
    def quantizes(self) -> bool:
        """Whether any layer quantizes weights or activations or rounds its KV cache."""
        return any(p.weight_fp8 or p.act_fp8 or p.kv_cache for p in (self, *(p for _, p in self.layers)))

    @property
    def quantizes_weights(self) -> bool:
        """Whether any layer quantizes its projection weights (weight_fp8)."""
        return any(p.weight_fp8 for p in (self, *(p for _, p in self.layers)))

    def for_family(self, weight_in_norm_dtype: bool) -> "Policy":
        """This policy with norm_cast_before_weight left to the family (None) set to the family's
        convention (weight_in_norm_dtype: the family's norm applies its weight in norm_dtype), per
        layer too; the name unchanged (the convention is the family's, the policy's to_dict shows it)."""
        def fill(p):
            return p if p.norm_cast_before_weight is not None else dataclasses.replace(
                p, norm_cast_before_weight=not weight_in_norm_dtype)
        return dataclasses.replace(fill(self), layers=tuple((sel, fill(p)) for sel, p in self.layers))

    def for_layer(self, i: int, n_layers: int) -> "Policy":
        """The policy layer i of n computes its block by: the override naming it, else this one."""
        for sel, p in self.layers:
            if i in layer_indices(sel, n_layers, self.name):
                return p
        return self if not self.layers else dataclasses.replace(self, layers=())

    def check_layers(self, n_layers: int) -> None:
        """Every override names at least one of the model's n layers, and no layer twice."""
        seen = {}
        for sel, _ in self.layers:
            idx = layer_indices(sel, n_layers, self.name)
            if not idx:
                raise PolicyError(f"policy '{self.name}': layers[{sel}] names none of the model's {n_layers} "
                                  "layers")
            for i in idx:
                if i in seen:
                    raise PolicyError(f"policy '{self.name}': layer {i} is named by layers[{seen[i]}] and "
                                      f"layers[{sel}]")
                seen[i] = sel

    def weight_twin(self) -> "Policy":
        """float64 arithmetic over this policy's weights: param_dtype and weight_fp8 kept (per
        layer too), every activation rounding gone (act_fp8 and kv_cache included). The oracle a
        quantized policy is judged against: the same model, in exact arithmetic."""
        def twin(p):
            return Policy.get("fp64", param_dtype=p.param_dtype, weight_fp8=p.weight_fp8,
                              name=f"fp64 over {p.param_dtype} weights" + (f", {p.weight_fp8}" if p.weight_fp8 else ""))
        base = twin(self)
        if not self.layers:
            return base
        layers = tuple((sel, twin(p)) for sel, p in self.layers)
        return dataclasses.replace(base, layers=layers, name=base.name + "".join(
            f"+layers[{sel}]=({p.name})" for sel, p in layers))


def layer_indices(sel: str, n_layers: int, name: str = "") -> list[int]:
    """The layers a selector names: an index ("3", "-1") or a slice ("0:2", "-2:", "::4")."""
    try:
        parts = [int(x) if x.strip() else None for x in sel.split(":")]
        if len(parts) == 1:
            i = parts[0]
            if i is None or not -n_layers <= i < n_layers:
                raise IndexError
            return [i % n_layers]
        if len(parts) > 3 or parts[2:] == [0]:
            raise ValueError
        return list(range(n_layers)[slice(*parts)])
    except (ValueError, IndexError):
        raise PolicyError(f"policy '{name}': layers[{sel}] is not an index in [-{n_layers}, {n_layers}) "
                          "or a slice such as 0:2 or -2:") from None


def _check_knob(name: str, knob: str, value) -> str:
    """A quantization knob's canonical spelling, or a PolicyError naming the policy and the knob."""
    if not isinstance(value, str):
        raise PolicyError(f"policy '{name}': {knob}={value!r} must be a string")
    if knob == "kv_cache" and value in DTYPES:
        return value
    try:
        s = Scaling.parse(value)
    except PolicyError as e:
        extra = f" or one of {DTYPES}" if knob == "kv_cache" else ""
        raise PolicyError(f"policy '{name}': {knob}={value!r}: {e}{extra}") from None
    allowed = {"weight_fp8": ("tensor", "channel", "block"), "act_fp8": ("tensor", "channel"),
               "kv_cache": ("channel",)}[knob]
    if s.granularity not in allowed:
        why = {"act_fp8": "an activation is scaled per call ('tensor') or per token ('channel')",
               "kv_cache": "a cached key or value is scaled per token and kv head ('channel')"}[knob]
        raise PolicyError(f"policy '{name}': {knob}={value!r}: granularity {s.granularity!r} is not taken "
                          f"here ({why})")
    return s.spec


def _check_layers(name: str, layers) -> tuple:
    """layers as ((selector, Policy), ...): from pairs of (selector, Policy / preset / policy
    string / to_dict() dict); an override has no overrides of its own."""
    if isinstance(layers, dict):
        layers = list(layers.items())
    if not isinstance(layers, (list, tuple)):
        raise PolicyError(f"policy '{name}': layers={layers!r} must be (selector, policy) pairs")
    out = []
    for item in layers:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str):
            raise PolicyError(f"policy '{name}': layers entry {item!r} must be a (selector, policy) pair "
                              "such as ('0:2', 'bf16')")
        sel, p = item[0].replace(" ", ""), item[1]
        p = Policy.from_dict(p) if isinstance(p, dict) else Policy.get(p)
        if p.layers:
            raise PolicyError(f"policy '{name}': layers[{sel}]={p.name} has per-layer overrides of its own")
        if not re.fullmatch(r"-?\d+|(-?\d+)?:(-?\d+)?(:(-?[1-9]\d*)?)?", sel):
            raise PolicyError(f"policy '{name}': layers[{sel}] is not a layer index or a slice such as "
                              "0:2 or -2: (its range is checked against the model's layers at load)")
        out.append((sel, p))
    return tuple(out)


def _spell(knob: str, value) -> str:
    if knob == "layers":
        return "+".join(f"layers[{sel}]={p.name}" for sel, p in value)
    if isinstance(value, bool):
        value = str(value).lower()
    return f"{knob}={'none' if value is None else value}"


_BOOLS = {"true": True, "false": False}


def _parse(text: str, overrides: dict) -> Policy:
    """A policy string: PRESET(+KNOB=VALUE)*, with layers[SEL]=PRESET among the knobs."""
    base, *knobs = text.split("+")
    if base not in PRESETS:
        raise PolicyError(f"unknown precision policy '{base}' (presets: {', '.join(PRESETS)}; "
                          "a policy string is PRESET+KNOB=VALUE+..., e.g. bf16+kv_cache=e4m3:channel)")
    fields = {f.name for f in dataclasses.fields(Policy)} - {"name", "layers"}
    parsed, layers = {}, []
    for k in knobs:
        key, eq, value = k.partition("=")
        if not eq or not value:
            raise PolicyError(f"policy '{text}': '{k}' is not KNOB=VALUE")
        if key.startswith("layers[") and key.endswith("]"):
            layers.append((key[len("layers["):-1], value))
        elif key in fields:
            parsed[key] = (None if value == "none" else _BOOLS.get(value, value))
        else:
            raise PolicyError(f"policy '{text}': unknown knob '{key}' (knobs: {', '.join(sorted(fields))}, "
                              "layers[SEL])")
    if layers:
        parsed["layers"] = layers
    parsed.update(overrides)
    return Policy.get(PRESETS[base], **parsed) if parsed else PRESETS[base]


def _preset(name, params, act, accum=None, small="float32", matmul="ieee", logits=None):
    return Policy(name=name, param_dtype=params, compute_dtype=act, matmul=matmul,
                  accum_dtype=accum or act, norm_dtype=small, softmax_dtype=small,
                  rope_dtype=small, residual_dtype=act, logits_dtype=logits or act)


PRESETS: dict[str, Policy] = {
    "fp64": _preset("fp64", "float64", "float64", small="float64"),
    "fp32": _preset("fp32", "float32", "float32"),
    "tf32": _preset("tf32", "float32", "float32", matmul="tf32"),
    # Low-precision presets follow HF conventions (norm, softmax and RoPE tables in f32,
    # f32 accumulation) except that logits are kept in f32, as most inference engines do.
    "bf16": _preset("bf16", "bfloat16", "bfloat16", accum="float32", logits="float32"),
    "fp16": _preset("fp16", "float16", "float16", accum="float32", logits="float32"),
    "bf16w-f32": _preset("bf16w-f32", "bfloat16", "float32"),
    # What transformers does inside a float64 model: RMSNorm, RoPE tables and softmax
    # stay in float32. Used to check torchref against transformers at fp64.
    "fp64-hf": Policy(name="fp64-hf", param_dtype="float64", compute_dtype="float64",
                      matmul="ieee", accum_dtype="float64", norm_dtype="float32",
                      softmax_dtype="float32", rope_dtype="float32",
                      residual_dtype="float64", logits_dtype="float64"),
}
