"""The ladder's evidence as data: what each rung measured and decided for one tap.

A rung (compare.ladder.verdicts) returns an Evidence record; decode and greedy pool records,
they never edit sentences; compare.explain renders every sentence a user reads from these
records, last. No decision reads a formatted string (tests/test_imports.py checks it).
"""

from __future__ import annotations

import dataclasses

NAN = float("nan")

# Which rung decided, and how (compare.explain.ladder has one sentence per reason).
NONFINITE = "nonfinite"                 # NaN/Inf on either side
EXACT = "exact"                         # bitwise equal at the policy
FP64_NOISE = "fp64_dtype_noise"         # the fp64 run rounds like a narrower dtype: precision
FP64_MATH = "fp64_math"                 # the fp64 runs differ beyond rounding, or with structure
PRECISION = "precision"                 # the working rung: err(cand) > M err(ref) + floor
DRIFT = "drift"                         # within the drift bound
NO_TWIN_SEMANTIC = "no_twin_semantic"   # no float64 twin: structure or size says math
NO_TWIN_PRECISION = "no_twin_precision"
NO_TWIN_DRIFT = "no_twin_drift"
NO_TWIN_NONFINITE = "no_twin_nonfinite"
ONSET = "decode_onset"                  # decode: dtype noise that starts at a later step
POOLED_DRIFT = "decode_pooled_drift"    # decode: one step over the bound, all steps under it
POOLED_NO_STRUCTURE = "decode_pooled_no_structure"  # decode: a pattern one step shows, all steps not


@dataclasses.dataclass(frozen=True)
class Span:
    """Where on a tap a ratio was found: the whole tap, a run of positions (decode: of
    steps), or a quarter of the RoPE pairs (quarter 0 holds the highest frequencies)."""
    unit: str = "tap"            # "tap" | "positions" | "steps" | "rope_pairs"
    lo: int | None = None
    hi: int | None = None
    of: int | None = None        # rope_pairs: the number of pairs (head_dim / 2)
    quarter: int | None = None   # rope_pairs: 0 highest .. 3 lowest frequencies

    @property
    def highest_frequencies(self) -> bool:
        return self.unit == "rope_pairs" and self.quarter == 0

    def as_steps(self) -> "Span":
        """The same span with positions read as decode steps (one position per step)."""
        return dataclasses.replace(self, unit="steps") if self.unit == "positions" else self


WHOLE_TAP = Span()


@dataclasses.dataclass(frozen=True)
class Trend:
    """The candidate's error over the reference's in equal runs of positions: its rank
    correlation with position, the first and last runs' ratios, and the last run."""
    rho: float
    first: float
    last: float
    last_span: Span
    rising: bool


@dataclasses.dataclass(frozen=True)
class Noise:
    """The fp64-rung difference looks like `dtype`'s rounding: `size` in its unit roundoffs
    (None when carried from `inherited_from`, the earlier tap where it entered), against the
    dtype the policy prescribes for that step."""
    dtype: str
    size: float | None = None
    inherited_from: str | None = None
    # how the rounding shows: "values" (each value rounded), "rows" (one factor per row, both
    # signs: a norm's statistics), "angles" (RoPE angles position x frequency rounded)
    shape: str = "values"
    # the dtype the policy prescribes for the step this rounding belongs to (verdicts.step_dtype)
    prescribed: str | None = None
    step: str | None = None     # that step, in words' key: "norm_stats", "softmax", "rope", "sums", "output"


@dataclasses.dataclass(frozen=True)
class Pooled:
    """Decode: a rung judged over every step at once (ratio and span, or the pooled kind)."""
    steps: int
    ratio: float = NAN
    span: Span = WHOLE_TAP
    kind: str | None = None


@dataclasses.dataclass
class Evidence:
    """What the rung that decided one tap's verdict saw. Numbers, not sentences."""
    kind: str                       # exact | drift | precision | semantic
    reason: str                     # one of the constants above
    policy: str                     # the working policy's name
    err_ref: float = NAN
    err_cand: float = NAN
    err_fp64: float = NAN
    ratio: float = NAN              # err(cand) / (M err(ref) + floor), the worst span's
    span: Span = WHOLE_TAP
    m: float = NAN                  # the drift factor M at this policy
    findings: list = dataclasses.field(default_factory=list)   # structure findings of the fp64 difference
    noise: Noise | None = None
    trend: Trend | None = None
    floor64: float = NAN            # the fp64 rung's floor and structure gate here
    gate: float = NAN
    hidden_by_policy: bool = False  # bitwise equal at the policy although the fp64 runs differ
    nonfinite: tuple = (0, 0, 0)    # NaN/Inf counts: reference, candidate, candidate at fp64
    too_big_for_rounding: bool = False   # no twin: larger than NOISE_BAND[1] bf16 roundings
    step: int | None = None         # decode: this step, and the step where the tap agreed before
    agreed_step: int | None = None
    pooled: Pooled | None = None
    looks_like: str | None = None   # decode onset: the dtype whose rounding the difference resembles

    @property
    def unstructured(self) -> bool:
        """A semantic difference on the fp64 rung for which no structure detector fired."""
        return self.reason == FP64_MATH and not self.findings


@dataclasses.dataclass(frozen=True)
class Forcing:
    """Teacher forcing's measurement of a divergence (compare.ladder.teacher): which layer is
    the first to add it on its own, by which rule, and the local errors at its layer."""
    first: int | None               # the first layer that adds the difference on its own
    rule: str                       # "fp64": the twin's local error > gate; "policy": the drift bound
    what: str                       # the tap kind measured in every layer ("out" outside the layers)
    layer: int | None               # the divergence's layer (None: outside the layers)
    component: str
    gate: float = NAN               # rule "fp64"
    m: float = NAN                  # rule "policy"
    here: float | None = None       # fp64: the twin's local error at the layer, and the layer before
    before: float | None = None
    ref_local: float | None = None  # policy: both sides' local errors at the layer, and the ratio
    cand_local: float | None = None
    ratio: float = NAN


@dataclasses.dataclass(frozen=True)
class DecodePath:
    """Decode: the candidate's fp64 decode vs its own fp64 full recompute, and that recompute
    vs the oracle, at the first divergent tap; which path is wrong."""
    own_recompute: float
    full_vs_oracle: float
    decode_wrong: bool
    key_tap: bool                   # the tap is a q/k one (the key written at this step may be wrong)


# How a tap after the first divergence is known to inherit it (Inherited.how).
FORCED = "forced"           # fed the oracle's input to its layer, the tap is within drift: nothing of its own
SAME_LAYER = "same_layer"   # in the first divergence's own layer, after it: layer-level forcing cannot split them


@dataclasses.dataclass(frozen=True)
class Inherited:
    """A tap whose difference is the first divergence's, carried downstream: never a finding
    of its own (compare.ladder.teacher.inherit). own_kind is what the tap alone was judged;
    local is teacher forcing's record of the tap's own error (how == FORCED)."""
    source: str                     # the first divergence's tap
    how: str                        # FORCED | SAME_LAYER
    own_kind: str                   # precision | semantic
    local: Evidence | None = None
