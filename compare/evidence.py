"""The ladder's evidence as data: what each rung measured and decided for one tap.

A rung (compare.judge.verdicts) returns an Evidence record; decode and greedy pool records,
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
NO_TWIN_PRECISION = "no_twin_precision"   # no twin: within the rounding of the policy's own dtypes
# no twin, no structure, beyond any rounding of the policy's declared dtypes but within what a step in a
# narrower dtype could make: the evidence cannot tell a lower-precision step from a change in the math
NO_TWIN_UNDECIDED = "no_twin_undecided"
NO_TWIN_DRIFT = "no_twin_drift"
NO_TWIN_NONFINITE = "no_twin_nonfinite"
ONSET = "decode_onset"                  # decode: dtype noise that starts at a later step
POOLED_DRIFT = "decode_pooled_drift"    # decode: one step over the bound, all steps under it
POOLED_NO_STRUCTURE = "decode_pooled_no_structure"  # decode: a pattern one step shows, all steps not
# A difference a convention explains (kind "convention": reported apart from findings, standing as drift)
SHIFT_INVARIANT = "shift_invariant"     # logits: a per-position constant shift, which changes no probability
LAYOUT_CONVENTION = "layout_convention"     # q/k: features permuted within each head, undone by attention


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
    # signs: a norm's statistics), "angles" (RoPE angles position x frequency rounded), "kv_cache"
    # (attention matches one over keys and values kept in a narrower storage: judge.storage),
    # "weights" (a projection matches one over its weight kept in a narrower storage: the same)
    shape: str = "values"
    # the dtype the policy prescribes for the step this rounding belongs to (verdicts.step_dtype)
    prescribed: str | None = None
    step: str | None = None     # that step, in words' key: "norm_stats", "softmax", "rope", "sums", "output",
    #                             "kv_cache"
    scheme: str | None = None   # shape "kv_cache": the storage matched, in words (judge.storage.STORAGES)


@dataclasses.dataclass(frozen=True)
class Declared:
    """No twin: the error measured against the rounding the candidate's declared policy makes.
    dtype: the coarsest dtype the policy names for any step (compute, accum, norm, softmax, RoPE,
    residual, logits, params); units: the candidate's rel error in that dtype's unit roundoffs;
    narrower: the dtypes narrower than it whose one rounding (NOISE_BAND) the error's size fits;
    held: a narrower dtype that holds every value of the candidate's tap (a step whose output was
    rounded to it: a named narrower dtype), None when none does."""
    dtype: str
    units: float
    narrower: tuple = ()
    held: str | None = None


@dataclasses.dataclass(frozen=True)
class Convention:
    """A difference that a convention explains, not a finding (kind "convention"):
    what      "logit_shift": the logits differ by a constant per position (softmax-invariant);
              "feature_permutation": q/k features permuted within each head (a RoPE pair layout)
    raw       the tap's own record before the convention was removed (its kind: what it read as)
    removed   the record of the same rung on the difference with the convention removed
              (logits minus their per-position mean; the candidate's features put back in place)
    numbers   plain values: logit_shift {"kl", "max_logprob_diff", "shift_min", "shift_max"};
              feature_permutation {"perm", "pattern", "head_dim"}
    confirmed feature_permutation: the first tap of its layer after the attention (attn_ctx on,
              `confirmed_by`) is exact or drift (verdicts.settle_conventions); None until settled"""
    what: str
    raw: "Evidence"
    removed: "Evidence"
    numbers: dict = dataclasses.field(default_factory=dict)
    confirmed: bool | None = None
    confirmed_by: str | None = None


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
    declared: Declared | None = None     # no twin: the error against the declared policy's rounding
    convention: Convention | None = None     # kind "convention": what explains the difference
    step: int | None = None         # decode: this step, and the step where the tap agreed before
    agreed_step: int | None = None
    pooled: Pooled | None = None
    looks_like: str | None = None   # decode onset: the dtype whose rounding the difference resembles

    @property
    def undecided(self) -> bool:
        """No twin and coarse evidence: a lower-precision step and a change in the math both fit."""
        return self.reason == NO_TWIN_UNDECIDED

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
    teacher forcing's record of the tap's own error (how == FORCED) is the tap's `local`."""
    source: str                     # the first divergence's tap
    how: str                        # FORCED | SAME_LAYER
    own_kind: str                   # precision | semantic


# The capture check (compare.ladder.capture_check): the plain runs a capturing run's logits are held to,
LOGITS_ONLY = "capture(logits)"   # the protocol's capture, asked for the logits alone
FORWARD = "forward"               # the object's plain __call__(tokens, attention_mask)
FORWARD_AGAIN = "forward, again"  # the plain run against itself: does the side repeat?
STREAMED_LOGITS = "streamed capture(logits)"   # the streamed walk asked for the logits alone
# and why one was not run (compare.explain.ladder has one phrase per reason).
WHOLE_MODEL = "whole_model"       # streamed: the plain forward loads the whole model, which streaming avoids
REPLAYED = "replayed"             # a dump replays stored arrays: each of its runs is the same bytes
NO_LOGITS = "no_logits"           # the capturing run returned no logits (a dump that stored none)
NO_FORWARD = "no_forward"         # no plain forward: none, or a port's (not part of the protocol)
NOT_NEEDED = "not_needed"         # the forward again: the capture is bitwise the plain runs already


@dataclasses.dataclass(frozen=True)
class LogitsAgreement:
    """The capturing run's logits against one plain run's (real positions only)."""
    baseline: str           # LOGITS_ONLY | FORWARD | FORWARD_AGAIN | STREAMED_LOGITS
    bitwise: bool
    rel_l2: float           # ||capturing - plain|| / ||plain|| (0.0 when bitwise)
    max_ulp: float          # in the logits' own dtype
    max_abs: float


@dataclasses.dataclass
class CaptureCheck:
    """One side at the working policy: does recording its taps change its logits? The
    derived fields (bitwise, floor, changes_numbers) are stored, so the JSON carries them."""
    side: str               # the implementation's name
    dtype: str              # the logits' dtype (ULPs are counted in it); "" when not run
    taps: int               # how many taps the capturing run recorded
    against: list           # LogitsAgreement per plain run compared
    # False when the plain forward, run twice, differs from itself (`again` says by how much):
    # then a difference above is the side's own run-to-run noise as much as capturing's;
    # None: no forward run
    repeats: bool | None = None
    again: LogitsAgreement | None = None
    not_run: dict = dataclasses.field(default_factory=dict)   # {baseline or "check": WHOLE_MODEL | ...}
    note: str = ""          # compare.explain.ladder.capture_note's sentence, for the renderings
    # the capturing run's logits equal every plain run's, bit for bit (False when none ran)
    bitwise: bool = dataclasses.field(init=False)
    # the largest relative L2 difference capturing makes: what this side's taps cannot resolve
    floor: float = dataclasses.field(init=False)
    # capturing itself changes the logits: they differ from a plain run that repeats
    changes_numbers: bool = dataclasses.field(init=False)

    def __post_init__(self):
        self.bitwise = bool(self.against) and all(a.bitwise for a in self.against)
        self.floor = max((a.rel_l2 for a in self.against), default=0.0)
        self.changes_numbers = bool(self.against) and not self.bitwise and self.repeats is not False

    @property
    def ran(self) -> bool:
        return bool(self.against)


# ----- the candidate's float64 twin as checked (compare.ladder.twins) ---------------------------

# TwinCheck.status
ACCEPTED, INFERRED, REFUSED, NO_TWIN = "accepted", "keeps_f32 inferred", "refused", "no twin"
# The narrower formats a twin's tap may be found in (twins.tap_format), narrowest first; "float32
# product": at most 48 significant bits (the exact product of two float32 numbers)
TWIN_FORMATS = ("bfloat16", "float16", "float32")
PRODUCT = "float32 product"
SIXTEEN = ("bfloat16", "float16")
# TwinCheck.weights (or "rounded to <dtype>")
CHECKPOINT, DIFFER, UNCHECKED = "checkpoint", "differ", "not checked"
# TwinCheck.refused_for
WEIGHTS, ARITHMETIC = "weights", "arithmetic"


@dataclasses.dataclass
class TwinCheck:
    """What the candidate's float64 twin was found to be (Report.twin)."""
    status: str                 # ACCEPTED | INFERRED | REFUSED | NO_TWIN
    weights: str = UNCHECKED    # CHECKPOINT | "rounded to <dtype>" | DIFFER | UNCHECKED (no embed tap)
    narrow: dict = dataclasses.field(default_factory=dict)   # {tap: format} whose every value fits it
    wide: int = 0               # taps shown to hold float64 arithmetic
    undecided: int = 0          # taps with too few (distinct) nonzero values to tell
    returned: dict = dataclasses.field(default_factory=dict)  # {tap: dtype} of arrays returned narrower than float64
    declared_keeps_f32: bool = False
    refused_for: tuple = ()     # REFUSED: WEIGHTS (the policy's rounding), ARITHMETIC (no tap is float64)
    note: str = ""              # explain.ladder.twin_note's sentence ("" for a twin accepted as it is)

    @property
    def refused(self) -> bool:
        return self.status == REFUSED
