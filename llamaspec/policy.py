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
- norm_cast_before_weight: HF convention. The normalised x is rounded back to the
  input dtype before it is multiplied by the norm weight.
- softmax_dtype: attention scores are cast to this dtype for the mask and softmax;
  probabilities are rounded to compute_dtype afterwards.
- rope_dtype: inverse frequencies, angles and cos/sin are computed in this dtype
  (HF: float32), then rounded to compute_dtype when applied.
- residual_dtype: dtype of the residual stream (h = h + sublayer(h)).
- logits_dtype: dtype of the lm_head output (the lm_head matmul accumulates in
  accum_dtype and is rounded once to this).
"""

from __future__ import annotations

import dataclasses

from .errors import PolicyError

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
    norm_cast_before_weight: bool = True

    def __post_init__(self):
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
        if not isinstance(self.norm_cast_before_weight, bool):
            raise PolicyError(f"policy '{self.name}': norm_cast_before_weight={self.norm_cast_before_weight!r} "
                              "must be True or False (a string is not a boolean)")
        if not isinstance(self.name, str) or not self.name:
            raise PolicyError(f"policy name {self.name!r} must be a non-empty string")

    @staticmethod
    def get(policy: "str | Policy", **overrides) -> "Policy":
        """A preset by name (or a policy object), with any knob overridden."""
        if isinstance(policy, Policy):
            base = policy
        elif isinstance(policy, str):
            if policy not in PRESETS:
                raise PolicyError(f"unknown precision policy '{policy}' "
                                  f"(presets: {', '.join(PRESETS)})")
            base = PRESETS[policy]
        else:
            raise PolicyError(f"policy must be a preset name or a Policy, not {type(policy).__name__}")
        if not overrides:
            return base
        unknown = set(overrides) - {f.name for f in dataclasses.fields(Policy)}
        if unknown:
            raise PolicyError(f"unknown policy knob(s) {sorted(unknown)}")
        name = overrides.pop("name", None) or base.name + "+" + ",".join(
            f"{k}={v}" for k, v in sorted(overrides.items()))
        return dataclasses.replace(base, name=name, **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def is_fp64(self) -> bool:
        return all(getattr(self, f.name) == "float64" for f in dataclasses.fields(self)
                   if f.name.endswith("_dtype"))


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
