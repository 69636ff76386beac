"""The words both products (the drift-vs-bug ladder and the invariance probes) share: the
verdict kinds in order of severity, their colours, and the thresholds that tell drift from
a precision deviation. docs/method.md holds the measurements behind each number."""

from __future__ import annotations

import math

from llamaspec import Policy

from .metrics import unit_roundoff

KINDS = ("exact", "drift", "precision", "semantic")   # in order of severity
KIND_HEX = {"exact": "#8a8a8a", "drift": "#2e9d3a", "precision": "#e07b00", "semantic": "#d0312d"}
KIND_ANSI = {"exact": "90", "drift": "32", "precision": "33", "semantic": "31"}  # terminal colour codes


def kind_hex(kind) -> str:
    """The HTML colour of a verdict kind (grey for anything else)."""
    return KIND_HEX.get(str(kind), "#555555")


def ansi(kind, text: str) -> str:
    """text coloured as a verdict kind in a terminal."""
    return f"\033[{KIND_ANSI.get(str(kind), '0')}m{text}\033[0m"


M = 3.0                 # the drift factor at 16-bit and fp64 working dtypes (see M_BY_DTYPE)
# At fp32 the working dtype's own roundings are small, so how an implementation computes
# exp, rsqrt and its reductions shows: measured on SmolLM2 (1x64 tokens), clean jaxmodel
# vs torchref at fp32 reaches 4.4x the reference's error over a whole tap (layers.10.out,
# 3.1e-6 vs 7.1e-7) and ~7x over a quarter of positions (layers.11.attn_norm). At bf16 and
# fp16 the policy's own roundings dominate and the two agree to ~1.1x (worst 0.61 of the
# M = 3 bound, quarters included). So fp32 gets 10, the rest 3.
M_BY_DTYPE = {"float32": 10.0}
# Floor of the precision check, in unit roundoffs of compute_dtype (and never below
# FP64_FLOOR). Was 8: at bf16 that is a rel L2 of 1.6e-2, more than a bf16 tap's whole
# error (~5e-3), so no bf16 precision deviation could ever show. Measured with 1
# (bench/controls.py, the largest err(cand) / (M err(ref) + floor) over every tap and
# quarter of positions): clean jaxmodel vs torchref <= 0.31 on the tiny checkpoint at
# fp32/bf16/fp16 (2x128 tokens); on SmolLM2 (1x64) see M_BY_DTYPE. Planted precision
# bugs: RoPE tables in bf16 2.0 (tiny, head_dim 32, 2x128) and 2.0 (SmolLM2, 1x64, in
# the last quarter of positions; 1.14 over the whole tap), softmax in bf16 inside an
# fp32 model ~1e3.
FLOOR_ULPS = 1
FP64_FLOOR = 1e-12      # measured fp64 noise between our two models: <= 7.4e-15 on SmolLM2
F32_STEPS_FLOOR = 300 * 2.0 ** -24   # a side that keeps f32 steps in its fp64 run
# A side that keeps f32 steps in its fp64 run (transformers: RMSNorm, RoPE tables and
# softmax in f32) is still judged by structure below F32_STEPS_FLOOR: a scale, offset or
# permutation larger than STRUCT_F32_FLOOR is math, not f32 rounding. Measured, clean
# transformers fp64 vs torchref fp64 on SmolLM2 (1x64 tokens), every tap: the largest
# such finding is 9.1e-8 (per-feature scale; per-row 3.8e-8, global 5.1e-8; 1.5 f32 ulps);
# on the tiny checkpoint none. RoPE angles and the softmax rounded in f32 give position
# trends and head/half confinement whose size grows with the sequence length: those
# keep F32_STEPS_FLOOR.
STRUCT_F32_FLOOR = 16 * 2.0 ** -24
QUARTER_POSITIONS = 16   # the precision check also looks at each quarter of positions

def precision_floor(policy: Policy, hidden: int | None = None) -> float:
    """FLOOR_ULPS unit roundoffs of compute_dtype (at least FP64_FLOOR). At fp32, given the
    model's hidden size, at least sqrt(hidden) unit roundoffs: the typical relative error
    of one f32 sum over the hidden size, by which two correct implementations that sum in
    different orders (one fma chain against blocked or pairwise sums, as another CPU's
    kernels choose) can differ. Below it a difference in accuracy is not a lower-precision
    step (docs/method.md)."""
    floor = max(FLOOR_ULPS * unit_roundoff(policy.compute_dtype), FP64_FLOOR)
    if hidden and policy.compute_dtype == "float32":
        floor = max(floor, math.sqrt(hidden) * unit_roundoff("float32"))
    return floor


def drift_factor(policy: Policy) -> float:
    return M_BY_DTYPE.get(policy.compute_dtype, M)
