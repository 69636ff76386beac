"""A candidate's float64 twin, checked before the ladder trusts it.

The fp64 rung reads the twin's difference from the oracle as math: rounding there is ~1e-16,
so what is bigger is the implementation's own. That holds only for a twin that runs the
checkpoint's weights (as the oracle does) and computes in float64. Two ways real ports break
it: a twin cast from the working precision's bf16-rounded weights (every tap then carries the
weights' rounding: "semantic, one-sided error" for a correct model), and a twin whose code
keeps float32 steps (torchtune's RMSNorm and RoPE run `x.float()`) with keeps_f32 unset.

Both leave fingerprints in the twin's own numbers, so they are read there, not trusted:

- weights: the `embed` tap holds the embedding rows the twin runs. They must be the oracle's
  (the checkpoint's at float64) bit for bit; equal to those rounded to a narrower dtype
  instead, the twin was made from rounded weights.
- arithmetic: a float64 result has 53 significant bits. It is representable in float32
  (24 bits) by chance with probability about 2**-29, and has at most 48 bits (the exact
  product of two float32 numbers: an f32 step times a weight, as torchtune's and
  transformers' RMSNorm compute `normed.type_as(x) * weight`) with probability 2**-5. So a
  tap of at least MIN_VALUES nonzero values (MIN_DISTINCT of them different) that all fit a
  narrower format was computed in it; one value that does not fit shows float64 arithmetic. `embed` is left out:
  a copy of float32 weights is float32-exact legitimately.

What follows (TwinCheck.status): "accepted"; "keeps_f32 inferred" when some taps are float32
steps and others float64 (the ladder then judges the fp64 rung above the f32 floor, as for
a port that declares keeps_f32); "refused" (the ladder runs without the twin, judged by
structure alone, which the report says) when nothing is float64 arithmetic or when the
weights are rounded. A 16-bit tap inside an otherwise float64 twin is the port's own
rounding step (a bf16 q_proj, an fp8 quantization: the twin keeps them, as the oracle is
the same model in exact arithmetic): accepted, named in the note, and judged by the
verdicts' dtype-noise rule.
Refused rather than a PortError: the twin is an optional part of the protocol and the rest
of the ladder (the working rung, teacher forcing) stands without it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..evidence import (
    ACCEPTED,
    ARITHMETIC,
    CHECKPOINT,
    DIFFER,
    INFERRED,
    NO_TWIN,
    PRODUCT,
    REFUSED,
    SIXTEEN,
    TWIN_FORMATS,
    UNCHECKED,
    WEIGHTS,
    TwinCheck,
)
from ..explain import ladder as explain
from ..metrics import narrowest_holding, resolve_dtype

# Enough values for "all fit float32" to be no accident (2**-29 each) and for "all are exact
# products of two float32 numbers" too (2**-5 each), counted at the real positions, nonzero;
# MIN_DISTINCT of them different, so that a constant or near-constant tap (a repeated value
# fits as often as it is repeated) decides nothing. A 16-bit tap holds few distinct values by
# nature (256 significands per binade), hence a second, smaller count: 100 distinct values
# fit float32 by chance with probability 2**-2900, exact products 2**-500.
MIN_VALUES, MIN_DISTINCT = 1000, 100


def tap_format(values) -> str | None:
    """The narrowest format of TWIN_FORMATS / PRODUCT that holds every value (float64 numbers),
    None when one needs float64's 53 bits."""
    fmt = narrowest_holding(values, TWIN_FORMATS)
    if fmt is not None:
        return fmt
    return PRODUCT if not np.any(values.view(np.uint64) & np.uint64(0x1F)) else None


def arithmetic(c64: dict, taps, real) -> tuple[dict, int, int]:
    """({tap: narrow format}, taps shown wide, taps undecided) over the twin's taps at the real
    positions; embed (a copy of the weights) is left out."""
    narrow, wide, undecided = {}, 0, 0
    for t in taps:
        if t == "embed" or t not in c64:
            continue
        v = _real(c64[t], real).ravel()
        v = v[np.isfinite(v) & (v != 0)]
        fmt = tap_format(v)
        if fmt is None:
            wide += 1
        elif v.size >= MIN_VALUES and np.unique(v).size >= MIN_DISTINCT:
            narrow[t] = fmt
        else:
            undecided += 1
    return narrow, wide, undecided


def _real(x, real) -> np.ndarray:
    """x at the real positions (a [B, T, ...] tap), as float64."""
    a = np.asarray(x)
    return np.asarray(a[real] if a.shape[:2] == real.shape else a, np.float64)


def weights(c64: dict, oracle: dict, real) -> str:
    """The twin's embedding rows against the oracle's (the checkpoint's at float64), at the
    real positions: CHECKPOINT, "rounded to <dtype>", DIFFER, or UNCHECKED without an embed tap."""
    if "embed" not in c64 or "embed" not in oracle:
        return UNCHECKED
    a, b = (_real(x["embed"], real) for x in (c64, oracle))
    if a.shape != b.shape:
        return DIFFER
    if np.array_equal(a, b):
        return CHECKPOINT
    for name in TWIN_FORMATS:
        rounded = b.astype(resolve_dtype(name)).astype(np.float64)
        if not np.array_equal(rounded, b) and np.array_equal(a, rounded):
            return f"rounded to {name}"
    return DIFFER


def check_twin(name: str, c64: dict, oracle: dict, taps, real, keeps_f32: bool,
               param_dtype: str | None = None) -> TwinCheck:
    """The twin's captures (c64, the taps the ladder asked for) read for its weights and its
    arithmetic; `name` the candidate's, keeps_f32 what it declares, param_dtype the working
    policy's (weights rounded to it are the policy's rounding, which the reference at the
    policy shares and the oracle does not: refused; rounded to another dtype, narrower than
    the policy's, they are the port's own rounding, kept in its twin as a quantization is:
    named, and judged like any tap). None: any rounding is refused."""
    narrow, wide, undecided = arithmetic(c64, taps, real)
    returned = {t: str(np.asarray(c64[t]).dtype) for t in taps
                if t in c64 and np.asarray(c64[t]).dtype != np.float64}
    check = TwinCheck(ACCEPTED, weights(c64, oracle, real), narrow, wide, undecided, returned, keeps_f32)
    policys = param_dtype is None or check.weights == f"rounded to {param_dtype}"
    check.refused_for = tuple(why for why, bad in ((WEIGHTS, check.weights.startswith("rounded") and policys),
                                                   (ARITHMETIC, bool(narrow) and not wide)) if bad)
    if check.refused_for:
        check.status = REFUSED
    elif any(f not in SIXTEEN for f in narrow.values()) and not keeps_f32:
        check.status = INFERRED
    check.note = explain.twin_note(name, check)
    return check


def check_side(cand, c64: dict, oracle: dict, taps, real, param_dtype: str, progress) -> tuple[TwinCheck, object]:
    """check_twin on the candidate Side's twin captures, its note said through progress, and the
    Side as the rungs then run it (applied): what the prefill ladder and the decode comparison
    both do with a port's twin."""
    check = check_twin(cand.name, c64, oracle, taps, real, cand.keeps_f32, param_dtype)
    if check.note:
        progress(check.note)
    return check, applied(cand, check)


def applied(side, check: TwinCheck):
    """The candidate Side as the ladder runs it after the check: without its twin when refused,
    with keeps_f32 when inferred, else as it is."""
    if check.status == REFUSED:
        return dataclasses.replace(side, at_fp64=None)
    if check.status == INFERRED:
        return dataclasses.replace(side, keeps_f32=True)
    return side


__all__ = ["ACCEPTED", "CHECKPOINT", "DIFFER", "INFERRED", "MIN_VALUES", "NO_TWIN", "PRODUCT", "REFUSED", "UNCHECKED",
           "WEIGHTS", "TwinCheck", "applied", "arithmetic", "check_side", "check_twin", "tap_format", "weights"]
