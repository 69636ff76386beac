"""The words both products (the drift-vs-bug ladder and the invariance probes) share: the
verdict kinds in order of severity, their colours, and the thresholds that tell drift from
a precision deviation. docs/method.md holds the measurements behind each number."""

from __future__ import annotations

import math

from llamaspec import Policy

from .metrics import unit_roundoff

KINDS = ("exact", "drift", "precision", "semantic")   # in order of severity
# A tap after the first divergence that carries its difference (teacher forcing: nothing of its
# own) is "inherited": a tap state, never a verdict (Report.verdict is one of KINDS). A tap whose
# difference a convention explains that changes no prediction (logits shifted by a constant per
# position; q/k features permuted in a layout the attention undoes: evidence.Convention) is
# "convention": reported apart from the findings, it stands as drift in the overall verdict.
TAP_KINDS = ("exact", "drift", "convention", "inherited", "precision", "semantic")
KIND_HEX = {"exact": "#8a8a8a", "drift": "#2e9d3a", "convention": "#4f8fc0", "inherited": "#b8a27a",
            "precision": "#e07b00", "semantic": "#d0312d"}
KIND_ANSI = {"exact": "90", "drift": "32", "convention": "36", "inherited": "2;33", "precision": "33",
             "semantic": "31"}  # terminal colours


def kind_hex(kind) -> str:
    """The HTML colour of a verdict kind (grey for anything else)."""
    return KIND_HEX.get(str(kind), "#555555")


def ansi(kind, text: str) -> str:
    """text coloured as a verdict kind in a terminal."""
    return f"\033[{KIND_ANSI.get(str(kind), '0')}m{text}\033[0m"


# The thresholds of the ladder. Each is a measured margin over clean runs and under the
# planted bugs: docs/method.md, "Where the thresholds come from", has the numbers and the
# commands (python -m bench.controls) that reproduce them.
M = 3.0                  # drift factor at 16-bit and fp64 working dtypes: err(cand) <= M err(ref) + floor
M_BY_DTYPE = {"float32": 10.0}   # at fp32 each implementation's own exp, rsqrt and sums show
FLOOR_ULPS = 1           # the precision check's floor, in unit roundoffs of compute_dtype
FP64_FLOOR = 1e-12       # fp64 rounding between two implementations (measured: docs/method.md)
F32_STEPS_FLOOR = 300 * 2.0 ** -24   # ... when one side keeps f32 steps in its fp64 run (transformers)
STRUCT_F32_FLOOR = 16 * 2.0 ** -24   # below F32_STEPS_FLOOR, a structured difference above this is math
QUARTER_POSITIONS = 16   # the precision check also looks at each quarter of positions
# ... and of the RoPE frequencies at q_rope/k_rope, each only when its relative error is an
# average over at least this many effective values, n_eff = (sum o^2)^2 / sum o^4 of the
# oracle's values there: a relative L2 error weighs each value by o^2, and where a few huge
# activations carry the energy (attention-sink channels) it is the error of those few
# values, whose ratio between two clean sides scatters widely. With 64 the estimate of an error is good to
# ~1/sqrt(2*64) = 9%. The whole tap is always judged. docs/method.md, "Position and
# frequency structure".
SUBSET_MIN_VALUES = 64
# Dtype noise (a step that rounds to a narrower dtype even in the float64 run): one
# round-to-nearest leaves a relative error uniform in [-u, u], RMS u/sqrt(3); an fp64-rung
# difference is that dtype's noise when it is unbiased and uncorrelated with the values
# (|mean| and the global-scale fit each under NOISE_SHAPE of its size) and its rel L2 is
# within NOISE_BAND of one rounding's. docs/method.md, "Dtype noise".
ONE_ROUNDING = 3 ** -0.5
NOISE_BAND = (1 / 16, 4.0)
NOISE_SHAPE = 0.25
NOISE_DTYPES = ("bfloat16", "float16", "float32")
# The hint of a precision finding names a step whose rounding grows with position (RoPE
# angles in low precision) when the candidate's error over the reference's, in
# TREND_BUCKETS equal runs of positions, rises steadily (Spearman rho >= TREND_RHO) by at
# least TREND_GROWTH from the first run to the last.
TREND_BUCKETS = 8
TREND_RHO = 0.9
TREND_GROWTH = 2.0


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
