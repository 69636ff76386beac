"""The slips of Llama's relatives (issue 62), named from the taps and the reference's config.

step_features(tap, cfg) is what the reference's config (a llamaspec.LlamaConfig) says about the
step that made a tap: the attention's scale, soft-cap and window at attn_ctx, the final soft-cap
at the logits, the embedding scale, a norm's epsilon, whether a projection carries a bias.
verdicts.context_for puts it in the tap's context as "step"; conventions.explain_attention reads
the attention's, findings() below the rest.

Each test asks, at the fp64 rung, whether the candidate computes a named variant of the step
exactly (structure.ATOL_VARIANT: f32 steps inside a float64 run land ~1e-7 from their variant,
and the variants below sit O(1e-2) or more apart on real inputs), from its own inputs where the
step has them, or whether a finding of structure.analyse has a named cause. None reads which
slip a control planted; each holds for any checkpoint, prompt and family:

- norm_skipped (any norm tap, with its input): the candidate's norm returns its input unchanged.
  An RMSNorm is the identity only on rows of RMS 1 with every weight 1, which activations never
  are to 1e-6; the reference's own output must not be its input.
- norm_axis (q_norm / k_norm, with q / k): the candidate is the RMSNorm of its own input over the
  other axis (each head's head_dim vs the whole projection, Qwen3 / Gemma 3 vs OLMo 2) with the
  reference's per-feature weight. The two axes give the same output only where every head of a
  row has the same RMS; the reference must fit its own axis exactly (the weight fitted from it)
  and not the other.
- soft_cap (logits): the candidate's logits are the reference's raw logits z (its cap undone,
  z = cap x atanh(ref / cap)) uncapped, or capped at another value: cand = c x tanh(z / c), c
  fitted. tanh bends values near the cap by a known law, which no other slip of the head follows.
  As conventions.explain_attention's matches, the variant must also explain the difference (its
  distance at most MATCH_SHARE of the distance to the reference): a cap far above every logit
  is the identity to within any tiny difference, and must not be named for one.
- embedding_scale (embed, from analyse's global scale): the factor is a power of sqrt(hidden_size)
  (the tap's width), within the rounding of that constant to bfloat16 (transformers multiplies
  by it cast to the weights' dtype). Another global slip lands within 0.8% of such a power only
  by accident.
- projection_bias (a projection's output tap, from analyse's constant offset): one vector added
  at every position of x W^T is a bias term b' - b (a weight difference changes the output with
  x, which varies), named with whether the config gives that projection a bias.
- analyse's norm weight offset (cand - ref = a x the normalised input) is said against the
  config's own offset: w instead of (1 + w) on a Gemma, (2 + w) for a weight stored with its 1.
"""

from __future__ import annotations

import math

import numpy as np

from llamaspec import taps as tapnames

from ..metrics import as64, rel_l2, unit_roundoff
from .conventions import MATCH_SHARE, fit_positive
from .structure import ATOL_VARIANT, MIN_VALUES, Finding

# {output tap kind: (the projection, the config field that gives it a bias)}
BIAS_OF = {"q": ("q_proj", "attention_bias"), "k": ("k_proj", "attention_bias"), "v": ("v_proj", "attention_bias"),
           "attn_out": ("o_proj", "o_bias"), "gate": ("gate_proj", "mlp_bias"), "up": ("up_proj", "mlp_bias"),
           "mlp_out": ("down_proj", "mlp_bias")}
NORM_STEPS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "final_norm")
QK_NORMS = ("q_norm", "k_norm")
# The embedding scale's constant may be rounded to a 16-bit dtype before it multiplies (transformers
# casts sqrt(hidden_size) to the embedding weights' dtype): a factor within two bfloat16 unit
# roundoffs of a power of sqrt(hidden_size) is that constant.
EMBED_SCALE_TOL = 2 * unit_roundoff("bfloat16")
EMBED_SCALE_POWERS = (-2, -1, 1, 2)
# atanh undoes a cap only away from saturation: at |ref| / cap = 1 - s its condition number is
# ~1 / (2 s), so values closer than SATURATED to the cap (and those tanh rounded to exactly +-1)
# are left out; the rest keep fp64 rounding far below ATOL_VARIANT.
SATURATED = 1e-6
# A scalar fit needs no more values than this (a deterministic spread of the tap's rows).
FIT_VALUES = 2 ** 18


def step_features(tap: str, cfg) -> dict:
    """What the reference's config says about the step that made `tap` ({} without a llamaspec
    config): at attn_ctx the layer's scale, softcap, window and the model's windows; at the logits
    the final softcap; at the embedding whether it is scaled; at a norm its epsilon; at a
    projection's output the projection and whether the config gives it a bias."""
    if cfg is None or not hasattr(cfg, "window"):
        return {}
    t = tapnames.tap(tap)
    if t.kind == "attn_ctx":
        return {"scale": cfg.scale, "softcap": cfg.attn_softcap, "window": cfg.window(t.layer),
                "windows": tuple(sorted({w for w in cfg.sliding_window if w is not None}))}
    if t.kind == "logits":
        return {"softcap": cfg.final_softcap}
    if t.kind == "embed":
        return {"embed_scale": cfg.embed_scale}
    if t.kind in NORM_STEPS:
        return {"eps": cfg.rms_norm_eps, "offset": cfg.norm_offset,
                **({"axis": cfg.qk_norm} if t.kind in QK_NORMS else {})}
    if t.kind in BIAS_OF:
        projection, field = BIAS_OF[t.kind]
        return {"projection": projection, "field": field, "bias": bool(getattr(cfg, field))}
    return {}


def _rows(x, mask) -> np.ndarray:
    """x [B, T, ...] at the real positions: [N, ...] in float64."""
    x = as64(x)
    m = np.ones(x.shape[:2], bool) if mask is None else np.asarray(mask, bool)
    return x[m]


def norm_skipped(cand, ref, x_cand, x_ref, mask=None, step: str = "") -> Finding | None:
    """At a norm tap with each side's input to the norm: is the candidate's output its input?"""
    c, r, xc, xr = (_rows(a, mask) for a in (cand, ref, x_cand, x_ref))
    if c.shape != xc.shape or r.shape != xr.shape or not np.isfinite(c).all():
        return None
    if not rel_l2(c, xc) <= ATOL_VARIANT or rel_l2(r, xr) <= ATOL_VARIANT:
        return None
    return Finding("norm_skipped", 1.0, rel_l2(c, r), dict(step=step))


_AXES = {"head": (-1,), "projection": (-2, -1)}


def _normalised(x: np.ndarray, axis: str, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=_AXES[axis], keepdims=True) + eps)


def norm_axis(cand, ref, x_cand, x_ref, eps: float, mask=None, step: str = "") -> Finding | None:
    """At q_norm / k_norm ([B, T, H, D]) with each side's q / k: does the candidate normalise over
    the other axis (per head vs the whole projection) than the reference, with its weight?"""
    c, r, xc, xr = (_rows(a, mask) for a in (cand, ref, x_cand, x_ref))
    if c.ndim != 3 or not (c.shape == r.shape == xc.shape == xr.shape) or c.shape[1] < 2 or not np.isfinite(c).all():
        return None
    for axis, other in (("head", "projection"), ("projection", "head")):
        h = _normalised(xr, axis, eps)
        den = (h * h).sum(0)
        weight = np.divide((r * h).sum(0), den, out=np.zeros_like(den), where=den > 0)   # per feature [H, D]
        if rel_l2(r, h * weight) > ATOL_VARIANT or rel_l2(r, _normalised(xr, other, eps) * weight) <= ATOL_VARIANT:
            continue    # the reference does not normalise over `axis`, or both axes fit it
        if rel_l2(c, _normalised(xc, other, eps) * weight) <= ATOL_VARIANT:
            return Finding("norm_axis", 1.0, rel_l2(c, r),
                           dict(step=step, cand=other, ref=axis, heads=int(c.shape[1]), head_dim=int(c.shape[2])))
    return None


def _spread(x: np.ndarray, limit: int = FIT_VALUES) -> np.ndarray:
    """[N, F] rows: all of them, or a deterministic spread holding at most `limit` values."""
    if x.size <= limit:
        return x
    return x[np.linspace(0, len(x) - 1, max(1, limit // x.shape[1])).astype(int)]


def _capped(x: np.ndarray, cap: float) -> np.ndarray:
    return cap * np.tanh(x / cap)


def _fit_cap(out: np.ndarray, raw: np.ndarray) -> tuple[float, float]:
    """(c, rel L2 of out against c x tanh(raw / c)) for the best cap c, searched around max |raw|."""
    top = float(np.abs(raw).max())
    if not top > 0:
        return math.nan, math.inf
    return fit_positive(lambda log_c: rel_l2(out, _capped(raw, math.exp(log_c))), math.log(top))


def soft_cap(cand, ref, ref_cap: float | None, mask=None) -> Finding | None:
    """At the logits: is the candidate the reference's raw logits uncapped, or capped at another
    value (ref_cap: the reference's cap, the config's final_logit_softcapping; None: none)?
    Without a cap in the config, also whether the reference's logits are the candidate's capped."""
    c, r = (_spread(_rows(a, mask).reshape(-1, np.shape(a)[-1])) for a in (cand, ref))
    if c.shape != r.shape or not (np.isfinite(c).all() and np.isfinite(r).all()):
        return None
    if ref_cap is not None:
        keep = np.abs(r) < ref_cap * (1 - SATURATED)
        c, raw = c[keep], ref_cap * np.arctanh(r[keep] / ref_cap)
    else:
        raw = r
    if c.size < MIN_VALUES:
        return None
    base = rel_l2(c, r[keep] if ref_cap is not None else r)
    if not base > 0:
        return None
    explains = lambda e: e <= ATOL_VARIANT and e <= MATCH_SHARE * base  # noqa: E731  (conventions' rule)
    size = rel_l2(_rows(cand, mask), _rows(ref, mask))
    data = dict(step="logits", ref_cap=ref_cap, max_raw=float(np.abs(raw).max()))
    if ref_cap is not None and explains(rel_l2(c, raw)):
        return Finding("soft_cap", 1.0, size, dict(data, cap=None))
    cap, e = _fit_cap(c, raw)
    if explains(e) and not (ref_cap is not None and math.isclose(cap, ref_cap, rel_tol=ATOL_VARIANT)):
        return Finding("soft_cap", 1.0, size, dict(data, cap=cap))
    if ref_cap is None:     # the reference capped (a config that does not say so), the candidate not
        cap, e = _fit_cap(r, c)
        if explains(e):
            return Finding("soft_cap", 1.0, size, dict(data, cap=None, ref_cap=cap, max_raw=float(np.abs(c).max())))
    return None


def embedding_scale(scale: Finding, hidden: int, reference_scales: bool | None) -> Finding | None:
    """analyse's global scale at the embedding, named when its factor is a power of sqrt(hidden)."""
    factor = scale.data["factor"]
    for power in EMBED_SCALE_POWERS:
        if factor > 0 and abs(factor / hidden ** (power / 2) - 1) <= EMBED_SCALE_TOL:
            return Finding("embedding_scale", scale.score, scale.size,
                           dict(scale.data, power=power, hidden=int(hidden), reference_scales=reference_scales))
    return None


def projection_bias(offset: Finding, step: dict) -> Finding:
    """analyse's constant offset at a projection's output, as a bias on that projection."""
    return Finding("projection_bias", offset.score, offset.size,
                   dict(offset.data, projection=step["projection"], field=step["field"],
                        reference_bias=step.get("bias")))


def findings(tap: str, cand64, oracle, mask, context: dict, found: list) -> list:
    """analyse's findings at `tap` (found, best first) with the family's tests: the exact variants
    this tap's step has (norm_skipped, norm_axis, soft_cap) first, then found, its global scale at
    the embedding and constant offset at a projection named by their cause where the evidence
    says so. context: verdicts.context_for's ("step", "norm_inputs")."""
    kind = tapnames.tap(tap).kind
    step = context.get("step", {})
    exact = []
    if context.get("norm_inputs") is not None:
        exact.append(norm_skipped(cand64, oracle, *context["norm_inputs"], mask, kind))
        if kind in QK_NORMS and step.get("eps") is not None:
            exact.append(norm_axis(cand64, oracle, *context["norm_inputs"], step["eps"], mask, kind))
    if kind == "logits":
        exact.append(soft_cap(cand64, oracle, step.get("softcap"), mask))
    named = []
    for f in found:
        if f.kind == "global_scale" and kind == "embed":
            f = embedding_scale(f, np.shape(cand64)[-1], step.get("embed_scale")) or f
        elif f.kind == "offset" and "projection" in step:
            f = projection_bias(f, step)
        elif f.kind == "norm_weight_offset" and "offset" in step:     # said against the config's own offset
            f = Finding(f.kind, f.score, f.size, dict(f.data, ref_offset=step["offset"]))
        named.append(f)
    return [f for f in exact if f is not None] + named
