"""Explain an fp64-rung difference by keys and values, or weights, stored narrower.

A port that keeps its KV cache in fp8 (or bf16 / fp16) rounds its keys and values in its
float64 run too, since the storage is its code, not its policy: its fp64 twin then differs from
the oracle at the layer's attn_ctx by that rounding, carried through the softmax. The size of
such a difference says little (an fp8 rounding is 2^-4 or 2^-3 relative: as large as many bugs),
so it is not judged by size. Instead, as conventions.py does for attention conventions, attention
is recomputed in float64 from the oracle's q_rope, k_rope and v with k and v rounded by each
storage a KV cache uses (STORAGES: a dtype, or an fp8 format with one scale per token and kv head,
one per call, or none), and the difference is that rounding only where the candidate matches it
(ATOL_MATCH, and at most MATCH_SHARE of its distance to exact attention). A wrong scale, a scale
of another token or head, a missing dequantization: none of them matches, and the rungs judge the
difference as they would without this module.

The same holds for a port whose projection weights are fp8 (or bf16 / fp16) in its float64 run:
at a projection's output (q, k, v, attn_out, gate, up, mlp_out) the product is recomputed from the
candidate's own float64 input to it and the reference's weight (and bias) stored each way
(WEIGHT_STORAGES: fp8 per tensor, per output channel, per 128 x 128 block; bf16; fp16), from the
weight as the checkpoint holds it and as the policy rounds it (a port may quantize either).
"""

from __future__ import annotations

import math

import numpy as np

from llamaspec import quant
from llamaspec.checkpoint import numpy_dtype
from llamaspec.policy import DTYPES

from ..evidence import Noise
from ..metrics import as64, rel_l2, unit_roundoff
from .conventions import ATOL_MATCH, MATCH_SHARE, attention64, reference_keywords

# (name in words, dtype or fp8 format, scaling): fp8 with one scale per token and kv head (the
# policy's kv_cache "channel"), one per call over the layer's keys (or values), or unscaled
# (a static scale of 1, vLLM's default without calibration); 16-bit storage rounds each value.
STORAGES = (
    *((f"{fmt} per token and kv head", fmt, "channel") for fmt in quant.FORMATS),
    *((f"{fmt} per call (one scale)", fmt, "tensor") for fmt in quant.FORMATS),
    *((f"{fmt} unscaled", fmt, None) for fmt in quant.FORMATS),
    ("bfloat16", "bfloat16", None),
    ("float16", "float16", None),
)


# fp8 weights per tensor, per output channel, per 128 x 128 block (DeepSeek-V3's), or 16-bit ones.
WEIGHT_STORAGES = (
    *((f"{fmt} {words}", fmt, scaling) for fmt in quant.FORMATS
      for words, scaling in (("per tensor", "tensor"), ("per output channel", "channel"),
                             ("per 128 x 128 block", "block128"))),
    ("bfloat16", "bfloat16", None),
    ("float16", "float16", None),
)


def stored(x, dtype: str, scaling: str | None) -> np.ndarray:
    """x [B, T, Hkv, D] (float64) as a cache in `dtype` keeps it, read back in float64."""
    x = as64(x)
    if dtype not in quant.FORMATS:
        return x.astype(numpy_dtype(dtype)).astype(np.float64)
    if scaling is None:
        return quant.round_to_fp8(x.astype(np.float32), dtype).astype(np.float64)
    spec = quant.Scaling.parse(f"{dtype}:{scaling}")
    rows = x.reshape(-1, x.shape[-1]) if scaling == "channel" and x.ndim != 2 else x
    with np.errstate(invalid="ignore"):
        q, s = quant.quantize(rows, spec)
        return quant.dequantize(q, s, spec, "float64").reshape(x.shape)


def kv_storage(cand, q, k, v, mask=None, conventions=None) -> Noise | None:
    """The storage whose rounding of k and v the candidate's attn_ctx (fp64 rung) matches, as a
    Noise of shape "kv_cache" (dtype: the storage's; size: the difference in its unit roundoffs;
    scheme: the storage in words); None when none does. q, k, v: the oracle's q_rope, k_rope, v;
    conventions: the layer's (conventions.reference_keywords), Llama's by default."""
    c = as64(cand)
    kw = reference_keywords(conventions)
    exact = attention64(q, k, v, mask, **kw)
    base = rel_l2(c, exact)
    if not base > 0 or not math.isfinite(base):
        return None
    for name, dtype, scaling in STORAGES:
        with np.errstate(over="ignore", invalid="ignore"):
            e = rel_l2(c, attention64(q, stored(k, dtype, scaling), stored(v, dtype, scaling), mask, **kw))
        if e <= ATOL_MATCH and e <= MATCH_SHARE * base:
            return Noise(dtype, base / unit_roundoff(dtype), shape="kv_cache", scheme=name)
    return None


def weight_storage(cand, x, weights, bias=None) -> Noise | None:
    """The storage of a projection's weight that the candidate's output (fp64 rung, [N, out] at
    the real positions) matches, as a Noise of shape "weights"; None when none does. x: the
    candidate's own input to the projection ([N, in], fp64 rung); weights: the reference's [out,
    in] weight as it may have been quantized from (the checkpoint's, the policy's rounding);
    bias [out] or None."""
    c, x = as64(cand), as64(x)
    b = 0.0 if bias is None else as64(bias)
    candidates = []
    for w in weights:
        exact = x @ as64(w).T + b
        base = rel_l2(c, exact)
        if not base > 0 or not math.isfinite(base):
            return None
        candidates.append((w, base))
    for name, dtype, scaling in WEIGHT_STORAGES:
        for w, base in candidates:
            with np.errstate(over="ignore", invalid="ignore"):
                e = rel_l2(c, x @ stored(w, dtype, scaling).T + b)
            if e <= ATOL_MATCH and e <= MATCH_SHARE * base:
                return Noise(dtype, base / unit_roundoff(dtype), shape="weights", scheme=name)
    return None


def weight_storage_dtype(policy) -> str:
    """The dtype (or fp8 format) a policy keeps projection weights in: weight_fp8's format, else param_dtype."""
    return quant.Scaling.parse(policy.weight_fp8).format if policy.weight_fp8 else policy.param_dtype


def kv_storage_dtype(policy) -> str:
    """The dtype (or fp8 format) a policy keeps keys and values in: its kv_cache, else compute_dtype."""
    kv = policy.kv_cache
    if kv is None:
        return policy.compute_dtype
    return kv if kv in DTYPES else quant.Scaling.parse(kv).format
