"""Where does the circumstance get in? One implementation, two circumstances, every tap.

    from compare.probes.where import probe_where
    r = probe_where("torchref", "padding", checkpoint=folder, policy="bf16")
    r.verdict                       # exact | drift | precision | semantic (the worst tap of any pair)
    c = r.worst                     # the comparison (Pair) that shows it
    c.first_difference              # Parting: the first tap not bitwise equal (tap, layer, component, op)
    c.first_beyond                  # Parting: the first tap beyond drift, with teacher forcing's answer
    explain_where(r)                # the sentences (compare.probes.where_text), made last

The target row is captured at every tap in circumstance A (alone, unpadded, without the
appended tokens, the first run, default mode, this CPU) and in circumstance B (inside a batch,
padded, with tokens appended, a rerun, invariant mode, another device: the GPU, or this CPU
capped to an older instruction set in a second process); only A's positions are compared.
Per tap, with a = A, b = B, oa and ob the model's own float64 twin (the same rounded
weights computing in float64) in A's and in B's circumstance, the one judge of the project
(compare.judge.verdicts.classify, the ladder's rungs) decides, with a as the reference, b as
the candidate, oa as the oracle and ob as the candidate's twin:

    exact      b is bitwise equal to a;
    semantic   NaN/Inf in b, or the fp64 rung differs: ob departs from oa by more than the fp64
               floor with no dtype-noise explanation (in float64 another summation order moves a
               result by ~1e-16; a difference the twin keeps is a difference in the math: pads
               attended, a position shift, a cache slot, a leak from another row);
    precision  the twin agrees, but b's error against it is beyond m err_a + floor (the worst of
               the whole tap and its quarters of positions): in B the model loses more precision
               than in A (bf16 partials chosen by batch shape);
    drift      anything else: b is as close to the exact result as a is.

Without a twin of B's circumstance (rerun and invariant-mode give B A's input; a twin that runs
a padded batch row by row on the real tokens, as transformers' float64 copy does, never sees
the padding) the no-twin rungs decide, as they do for a port without float64(): beyond the
bound, semantic when the difference has a structure rounding does not make or is larger than
any rounding of the declared dtypes, precision when it is rounding-sized. A difference the
softmax cancels (a constant per position of the logits) is drift with reason
"shift_invariant" (the judge's convention rung).

StreamSource walks our models layer by layer (memory does not grow with depth); anything
else is captured whole (CaptureSource). Teacher forcing: at the layer of the first parting,
B's run is fed A's input for the target row (the protocol's inject) and that layer alone
is judged again: does it make the difference (the op depends on the circumstance) or only
inherit it? Records are data; where_text makes every sentence.

The device circumstance records each side (WhereResult.sides: its label and its process's
compare.environment record, the model's plan included), so a reader sees which kernels each ran.
WhereResult.details records the plan the model computed by ("plan": its llamaspec.plan record),
and for the rerun circumstance what decides a rerun's bits ("determinism settings",
compare.environment.determinism_settings of this process, and "fresh process settings", the
same lines of each fresh process's record), which its hint names.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import numpy as np

from llamaspec import LlamaConfig, Policy, caps
from llamaspec import taps as tapnames
from llamaspec.checkpoint import check_checkpoint
from llamaspec.taps import input_tap

from ..adapters import OurModel, as_implementation, fp64_policy
from ..environment import determinism_settings, environment, plan_of
from ..judge.verdicts import TapVerdict, classify, context_for, settle_conventions, standing
from ..metrics import max_ulp, nonfinite
from ..results import JsonResult
from ..vocabulary import F32_STEPS_FLOOR, FP64_FLOOR, KINDS, drift_factor, precision_floor
from .models import ModelSpec, ProbeModel, fp64_twin
from .where_plan import GPU, Pair, check_budget, device_key, mesh_label, plan
from .where_plan import circumstance as circumstance_of
from .where_sources import CaptureSource, DecodeSource, ReplayDiffers, StreamSource, impl_key, stage_taps, stages
from .where_text import explain_where, hint

BEYOND = ("precision", "semantic")


# ----------------------------------------------------------------- records

@dataclasses.dataclass
class Op:
    """The operation a tap is the result of, as a kernel author names it."""
    name: str               # q_proj, k_proj, ..., rope, attention, rms_norm, lm_head
    family: str             # gather | norm | product | rope | attention | elementwise | residual
    k: int | None = None    # a product's inner (summed) dimension
    n: int | None = None    # a product's output width


@dataclasses.dataclass
class TapDiff:
    """B vs A at one tap (the target's compared positions)."""
    tap: str
    layer: int | None
    component: str
    name: str               # the tap's kind within its layer: q, attn_ctx, ... or embed, logits
    kind: str               # exact | drift | precision | semantic (the one judge's, a convention by its standing)
    reason: str             # the judge's reason code (compare.evidence: fp64_math, precision, no_twin_semantic, ...)
    bitwise_equal: bool
    max_ulp: float          # in the tap's dtype
    max_abs: float
    rel_l2: float           # ||b - a|| / ||a||
    err_a: float            # rel_l2(a, twin in A)
    err_b: float            # rel_l2(b, twin in A): the judge's candidate error, against the oracle
    bound: float            # m err_a + floor
    twin_rel: float | None  # rel_l2(twin in B, twin in A); None without a twin of B's circumstance
    twin_floor: float
    nonfinite: int
    ratio: float = 0.0      # the judge's err_b / bound, the worst of the whole tap and its quarters
    first_position: int | None = None   # first compared position that differs
    worst_position: int | None = None   # position with the largest relative difference
    pad_fit: float | None = None        # attn_ctx: dist(b, pads attended) / dist(b, pads masked)
    equal_fraction: float = 1.0         # the fraction of compared values bitwise equal in A and B


@dataclasses.dataclass
class Forced:
    """Teacher forcing at a parting's layer: B fed A's input for the target row."""
    layer: int | None
    ran: bool
    reason: str | None = None    # why not run: input_equal | outside_layers | fresh | no_inject
    kind: str | None = None      # the parting tap's verdict with the same input
    rel_l2: float | None = None
    local: bool | None = None    # True: this layer alone makes the difference


@dataclasses.dataclass
class Parting:
    """Where A and B part: the tap, as data."""
    tap: str
    layer: int | None
    component: str
    name: str
    op: Op
    kind: str
    position: int | None
    before_exact: bool           # every earlier tap bitwise equal
    rows_a: int                  # rows of A's and B's products (batch x slots)
    rows_b: int
    forced: Forced | None = None


@dataclasses.dataclass
class Comparison:
    """One pair of circumstances, every tap."""
    name: str
    group: str
    a_run: str
    b_run: str
    a_row: int
    b_row: int
    a_shape: list                # [rows, slots] of A's and B's calls
    b_shape: list
    positions: int
    b_padded: bool
    step: bool = False           # a decode step: the one new position after the prompt is compared
    verdict: str = "exact"
    taps: list = dataclasses.field(default_factory=list)
    first_difference: Parting | None = None
    first_beyond: Parting | None = None
    findings: list = dataclasses.field(default_factory=list)   # codes: where_text.FINDINGS


@dataclasses.dataclass
class WhereResult(JsonResult):
    probe: str
    circumstance: str
    model: str
    impl: str
    policy: str
    mode: str
    streamed: bool
    target_length: int
    verdict: str
    comparisons: list
    drift_factor: float
    floor: float
    twin_floor: float
    seconds: dict = dataclasses.field(default_factory=dict)
    cost: dict = dataclasses.field(default_factory=dict)
    sides: dict = dataclasses.field(default_factory=dict)   # device: {A, B: {label, environment}}
    details: dict = dataclasses.field(default_factory=dict)  # plan; rerun: the determinism settings (_details)

    @property
    def ok(self) -> bool:
        return self.verdict != "semantic"

    @property
    def worst(self) -> Comparison:
        return max(self.comparisons, key=_severity)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "hint": hint(self), "explanation": explain_where(self)}


def _severity(c: Comparison):
    beyond = c.first_beyond
    first = c.first_difference
    depth = -len(c.taps) if first is None else -c.taps.index(next(t for t in c.taps if t.tap == first.tap))
    return (KINDS.index(c.verdict), beyond is not None, depth)


# ----------------------------------------------------------------- ops

def op_of(tap: str, cfg) -> Op:
    """The operation behind a tap, with a product's dimensions from the config."""
    t = tapnames.tap(tap)
    d, f = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    products = {"q": ("q_proj", d, q), "k": ("k_proj", d, kv), "v": ("v_proj", d, kv), "attn_out": ("o_proj", q, d),
                "gate": ("gate_proj", d, f), "up": ("up_proj", d, f), "mlp_out": ("down_proj", f, d),
                "logits": ("lm_head", d, cfg.vocab_size)}
    if t.kind in products:
        name, k, n = products[t.kind]
        return Op(name, "product", k, n)
    other = {"embed": ("embedding", "gather"), "attn_norm": ("input rms_norm", "norm"),
             "mlp_norm": ("post-attention rms_norm", "norm"), "final_norm": ("final rms_norm", "norm"),
             "q_rope": ("rope on q", "rope"), "k_rope": ("rope on k", "rope"), "attn_ctx": ("attention", "attention"),
             "resid_mid": ("residual add", "residual"), "out": ("residual add", "residual"),
             "act": ("silu(gate) * up", "elementwise")}
    return Op(*other[t.kind])


# ----------------------------------------------------------------- judging

@dataclasses.dataclass(frozen=True)
class Yardstick:
    """What the judge needs besides the arrays (policy, hidden size, keeps_f32), and the bound's
    numbers the result reports (m, floor, the fp64 rung's floor)."""
    policy: Policy
    hidden: int
    keeps_f32: bool
    m: float
    floor: float
    twin_floor: float
    cfg: object = None       # the model's llamaspec config (the family's steps, for the structure analysis)

    @classmethod
    def of(cls, policy: Policy, hidden: int, keeps_f32: bool, cfg=None) -> "Yardstick":
        return cls(policy, hidden, keeps_f32, drift_factor(policy), precision_floor(policy, hidden),
                   F32_STEPS_FLOOR if keeps_f32 else FP64_FLOOR, cfg)


def _positions(a: np.ndarray, b: np.ndarray) -> tuple[int | None, int | None]:
    """First differing compared position, and the one with the largest relative difference."""
    a64, b64 = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    differ = np.flatnonzero(~(a64 == b64).all(1))
    if not differ.size:
        return None, None
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.linalg.norm(b64 - a64, axis=1) / np.maximum(np.linalg.norm(a64, axis=1), np.finfo(float).tiny)
    return int(differ[0]), int(np.nanargmax(np.where(np.isfinite(rel), rel, np.inf)))


def rel(cand, ref) -> float:
    """metrics.rel_l2 (NaN on NaN/Inf, the norm of cand - ref where ref is all zero) with
    the sums in einsum: np.linalg.norm's BLAS dot stalls on a loaded machine (its threads
    spin against the others'), einsum does not."""
    c, r = np.asarray(cand, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    if not (np.isfinite(c).all() and np.isfinite(r).all()):
        return math.nan
    d = c - r
    num, den = math.sqrt(float(np.einsum("i,i->", d, d))), math.sqrt(float(np.einsum("i,i->", r, r)))
    return num / den if den else num


def verdict(tap: str, a, b, oa, ob, yard: Yardstick, context: dict | None = None) -> TapVerdict:
    """The one judge (compare.judge.verdicts.classify) on B (b) vs A (a) at one tap ([slots, ...]
    rows of the target: one row of real positions), against the twin in A (oa) and in B (ob, or
    None). context: the twins' taps of the layer, {"c64": ..., "o": ...} (context_for: what the
    structure analysis reads)."""
    real = np.ones((1, len(a)), bool)
    ctx = context_for(tap, context["c64"], context["o"], cfg=yard.cfg) if context else None
    return classify(tap, np.asarray(a)[None], np.asarray(b)[None], np.asarray(oa)[None],
                    None if ob is None else np.asarray(ob)[None], real, yard.policy, yard.keeps_f32, ctx, yard.hidden)


def tap_diff(v: TapVerdict, a, b, has_twin: bool, yard: Yardstick) -> TapDiff:
    """The probe's record of one judged tap (v), with what the judge does not measure: bits, ULPs,
    where in the row the difference starts and peaks."""
    a, b = np.asarray(a), np.asarray(b)
    t = tapnames.tap(v.tap)
    bad = nonfinite(b) + nonfinite(a)
    equal = bool(np.array_equal(a, b)) and not bad
    ev = v.record
    ratio = ev.ratio if math.isfinite(ev.ratio) else (0.0 if equal else math.inf)
    diff = TapDiff(v.tap, t.layer, t.component, t.kind, standing(v), ev.reason, equal,
                   max_ulp(b, a, tapnames.dtype_of(v.tap, yard.policy)) if not bad else math.nan,
                   float(np.abs(b.astype(np.float64) - a.astype(np.float64)).max()) if not bad else math.nan,
                   rel(b, a), v.err_ref, v.err_cand, yard.m * v.err_ref + yard.floor,
                   v.err_fp64 if has_twin else None, yard.twin_floor, bad, ratio)
    if not equal:
        diff.equal_fraction = equal_fraction(a, b)
        diff.first_position, diff.worst_position = _positions(a, b) if not bad else (None, None)
    return diff


def judge_tap(tap: str, a, b, oa, ob, yard: Yardstick) -> TapDiff:
    """One tap judged alone (no other tap of its layer to settle a layout convention with)."""
    v = verdict(tap, a, b, oa, ob, yard)
    settle_conventions([v])
    return tap_diff(v, a, b, ob is not None, yard)


def equal_fraction(a: np.ndarray, b: np.ndarray) -> float:
    """The fraction of values whose bits are the same in a and b (0 when dtype or shape differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return 0.0
    bits = np.dtype(f"u{a.dtype.itemsize}")
    return float(np.mean(np.ascontiguousarray(a).view(bits) == np.ascontiguousarray(b).view(bits)))


def pad_fit(q, k, v, ctx, mask_row, slots) -> tuple[float, float]:
    """B's attn_ctx at the compared slots against two float64 recomputes from B's own q_rope,
    k_rope, v of the target row: keys at real slots only (pads masked) and keys at every
    earlier slot (pads attended): (distance to the first, distance to the second)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    W, Hq, D = q.shape
    G = Hq // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)        # head h reads kv head h // G
    scores = np.einsum("thd,shd->hts", q[slots], k) * D ** -0.5       # [Hq, T', W]
    causal = np.arange(W)[None, :] <= np.asarray(slots)[:, None]
    out = []
    for allowed in (causal & np.asarray(mask_row, bool)[None, :], causal):
        s = np.where(allowed[None], scores, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out.append(rel(ctx, np.einsum("hts,shd->thd", p, v).reshape(len(slots), Hq * D)))
    return out[0], out[1]


# ----------------------------------------------------------------- the walk

@dataclasses.dataclass
class _Pairing:
    pair: Pair
    comparison: Comparison
    mask_row: np.ndarray         # B's row of its mask (the pad recompute's key slots)
    b_twin: bool                 # B is judged against its own twin run: the pair has one and it computes B
    last_exact: bool = True


def _comparison(pair: Pair, runs: dict) -> Comparison:
    ra, rb = runs[pair.a.run], runs[pair.b.run]
    return Comparison(pair.name, pair.group, ra.key, rb.key, pair.a.row, pair.b.row, ra.call_shape, rb.call_shape,
                      len(pair.a.slots), not bool(rb.mask[pair.b.row].all()), rb.step is not None)


def _rows(got: dict, s, twin: bool):
    return got.get((s.run, twin, s.row))


def _sliced(rows: dict, s) -> dict:
    """A sample's compared slots of every tap of a stage, as one batch row ([1, slots, ...])."""
    return {t: np.asarray(x)[s.slots][None] for t, x in rows.items()}


def _judge_stage(p: _Pairing, stage, got: dict, yard: Yardstick, available) -> list[TapDiff]:
    a, b = p.pair.a, p.pair.b
    ra, rb, oa = _rows(got, a, False), _rows(got, b, False), _rows(got, a, True)
    ob = _rows(got, b, True) if p.b_twin else None
    if oa is None:
        raise ValueError(f"where: no float64 twin run for '{a.run}': the probe judges against the model's own twin")
    # what the structure analysis reads besides the tap: the candidate's twin (without one, the
    # candidate) and the oracle, as the ladder hands them (engine.judge_taps)
    context = {"c64": _sliced(rb if ob is None else ob, b), "o": _sliced(oa, a)}
    taps = list(stage_taps(stage, available))
    verdicts = [verdict(t, ra[t][a.slots], rb[t][b.slots], oa[t][a.slots], None if ob is None else ob[t][b.slots],
                        yard, context) for t in taps]
    settle_conventions(verdicts)
    out = []
    for tap, v in zip(taps, verdicts):
        d = tap_diff(v, ra[tap][a.slots], rb[tap][b.slots], ob is not None, yard)
        # the pad recompute needs every key slot's k_rope and v: not at a decode step (one slot)
        if d.name == "attn_ctx" and d.kind in BEYOND and p.comparison.b_padded and not p.comparison.step and all(
                f"layers.{d.layer}.{n}" in rb for n in ("q_rope", "k_rope", "v")):
            masked, attended = pad_fit(*(rb[f"layers.{d.layer}.{n}"] for n in ("q_rope", "k_rope", "v")),
                                       rb[tap][b.slots], p.mask_row, b.slots)
            d.pad_fit = attended / masked if masked > 0 else math.inf
        out.append(d)
    return out


def _parting(d: TapDiff, before_exact: bool, cfg, c: Comparison) -> Parting:
    """A parting at tap d; its position is None at a decode step (one position: the step)."""
    return Parting(d.tap, d.layer, d.component, d.name, op_of(d.tap, cfg), d.kind,
                   None if c.step else d.first_position,
                   before_exact, c.a_shape[0] * c.a_shape[1], c.b_shape[0] * c.b_shape[1])


def _force(p: _Pairing, part: Parting, source, prev: dict, got: dict, yard: Yardstick, runs) -> Forced:
    """Teacher forcing at a parting's layer (see the module docstring)."""
    a, b = p.pair.a, p.pair.b
    if part.layer is None:
        return Forced(None, False, "input_equal" if part.before_exact else "outside_layers")
    into = input_tap(part.layer)
    before = next((t for t in p.comparison.taps if t.tap == into), None)
    decode = a.feed is not None     # a decode step: the layer also reads its cache, made from the prompt
    if decode and source.can_force(b.run, False) and source.can_force(a.run, False):
        equal = np.array_equal(source.layer_input(a.run, False, part.layer)[a.row][a.fed],
                               source.layer_input(b.run, False, part.layer)[b.row][b.fed])
        if equal:
            return Forced(part.layer, False, "input_equal", part.kind, None, True)
    elif not decode and before is not None and before.bitwise_equal:
        return Forced(part.layer, False, "input_equal", part.kind, None, True)
    if runs[b.run].fresh:
        return Forced(part.layer, False, "fresh")
    if not source.can_force(b.run, False) or (decode and not source.can_force(a.run, False)):
        return Forced(part.layer, False, "no_inject")

    def forced(twin, a_rows):
        h = np.array(source.layer_input(b.run, twin, part.layer))
        a_in = source.layer_input(a.run, twin, part.layer)[a.row] if decode else np.asarray(a_rows[into])
        h[b.row, b.fed] = a_in[a.fed].astype(h.dtype)
        return np.asarray(source.force(b.run, twin, part.layer, h)[part.tap])[b.row][b.slots]

    try:
        fb = forced(False, _rows(prev, a, False))
        twin_too = p.b_twin and source.can_force(b.run, True) and (not decode or source.can_force(a.run, True))
        fob = forced(True, _rows(prev, a, True)) if twin_too else None
    except NotImplementedError:
        return Forced(part.layer, False, "no_inject")
    except ReplayDiffers:
        return Forced(part.layer, False, "replay_differs")
    d = judge_tap(part.tap, _rows(got, a, False)[part.tap][a.slots], fb, _rows(got, a, True)[part.tap][a.slots],
                  fob, yard)
    local = (not d.bitwise_equal) if part.kind not in BEYOND else d.kind in BEYOND
    return Forced(part.layer, True, None, d.kind, d.rel_l2, local)


def _walk(source, pairings: list[_Pairing], runs: dict, cfg, yard: Yardstick, available, progress) -> None:
    prev: dict = {}
    n = cfg.num_hidden_layers
    for stage in stages(n):
        got = source.rows(stage)
        for p in pairings:
            c = p.comparison
            for d in _judge_stage(p, stage, got, yard, available):
                if not d.bitwise_equal and c.first_difference is None:
                    c.first_difference = _parting(d, p.last_exact, cfg, c)
                    c.first_difference.forced = _force(p, c.first_difference, source, prev, got, yard, runs)
                if d.kind in BEYOND and c.first_beyond is None:
                    c.first_beyond = _parting(d, p.last_exact, cfg, c)
                    c.first_beyond.forced = _force(p, c.first_beyond, source, prev, got, yard, runs)
                p.last_exact = p.last_exact and d.bitwise_equal
                c.taps.append(d)
        prev = got
        if progress and stage not in ("embed", "final"):
            progress(f"where: layer {stage + 1}/{n} judged")
    for p in pairings:
        c = p.comparison
        c.verdict = max((d.kind for d in c.taps), key=KINDS.index, default="exact")
        c.findings = findings(c)


def _row_findings(comps: list[Comparison]) -> None:
    """Within one batch run the target goes beyond drift at some rows and not at others:
    the result depends on the target's row index ("row_position")."""
    by_run: dict = {}
    for c in comps:
        by_run.setdefault(c.b_run, []).append(c)
    for group in by_run.values():
        beyond = [c.first_beyond is not None for c in group]
        if any(beyond) and not all(beyond):
            for c in group:    # more specific than a value leak ("rows"), which it replaces
                if c.first_beyond is not None:
                    c.findings = [f for f in c.findings if f != "rows"] + ["row_position"]


def findings(c: Comparison) -> list[str]:
    """What the records say about the cause (codes; where_text.FINDINGS words them)."""
    out = []
    first = c.first_beyond
    by_tap = {d.tap: d for d in c.taps}
    if first is not None:
        if first.name == "attn_ctx" and (by_tap[first.tap].pad_fit or math.inf) < 1:
            out.append("pad_keys")
        if first.name in ("q_rope", "k_rope"):
            pre = by_tap.get(f"layers.{first.layer}.{first.name[0]}")
            if pre is None or pre.kind not in BEYOND:
                out.append("positions")
            ctx = by_tap.get(f"layers.{first.layer}.attn_ctx")
            if ctx is not None and ctx.kind not in BEYOND:
                out.append("absorbed")
        if c.group == "equal":
            out.append("rows")
        if c.group == "append":
            out.append("later_positions")
        if first.forced is not None and first.forced.ran and not first.forced.local:
            out.append("inherited")
    if c.group in ("repeat", "fresh") and c.verdict != "exact":
        out.append("nondeterministic")
    return out


# ----------------------------------------------------------------- the probe

PACKAGES = ("torchref", "jaxmodel")


@dataclasses.dataclass
class _Setup:
    name: str
    impl: str
    policy: Policy
    mode: str
    keeps_f32: bool
    cfg: object
    impls: dict                  # main, twin, other: Implementations (capture path)
    taps: tuple
    package: str | None = None   # stream path: torchref | jaxmodel over `folder`
    folder: str | None = None
    spec: object = None          # a ModelSpec: fresh processes


def _policy_of(impl, policy) -> Policy:
    pol = policy or getattr(impl, "policy", None)
    if pol is None:
        raise TypeError(f"{getattr(impl, 'name', type(impl).__name__)}: probe where judges against the policy's "
                        "rounding and this model states none: pass policy= (fp32, bf16, fp16, fp64)")
    return Policy.get(pol) if isinstance(pol, str) else pol


def _load(spec):
    return as_implementation(spec.load(), spec.checkpoint)


def _by_name(name, circumstance, checkpoint, policy, stream, other, hf):
    if checkpoint is None:
        raise ValueError(f"probe where '{name}': checkpoint= (a Hugging Face folder) is needed to load it")
    pol = Policy.get(policy or "fp32")
    spec = ModelSpec(name, str(checkpoint), pol.name, **(hf if name == "transformers" else {}))
    if circumstance_of(circumstance).other_device:     # this side on the CPU, whatever the default device
        spec = dataclasses.replace(spec, device="cpu")
    if name in PACKAGES and circumstance_of(circumstance).streamed and stream is not False:
        cfg = check_checkpoint(checkpoint).config
        return _Setup(f"{name} {pol.name} default", name, pol, "default", False, cfg, {},
                      tuple(tapnames.all_taps(cfg)), name, str(checkpoint), spec)
    main = _load(spec)
    impls = {"main": main, "twin": main.float64(rounded_weights=True)}     # on main's device
    if circumstance_of(circumstance).needs_other:
        impls["other"] = other if other is not None else _load(dataclasses.replace(spec, batch_invariant=True))
    cfg = getattr(main, "config", None) or main.cfg
    return _Setup(f"{getattr(main, 'name', name)} {pol.name} default", name, pol, "default",
                  bool(getattr(main, "keeps_f32", False)), cfg, impls, tuple(main.taps), spec=spec)


def _of_object(model, circumstance, checkpoint, policy, oracle, other):
    spec = name = None
    if isinstance(model, ProbeModel):
        spec, name, oracle = model.spec, model.name, oracle or model.oracle()
        policy, model = policy or model.policy, model.model
    impl = as_implementation(model, checkpoint)
    twin = oracle if oracle is not None else fp64_twin(model)
    if twin is None:
        raise TypeError(f"{getattr(impl, 'name', type(model).__name__)}: probe where needs the model's float64 twin "
                        "(the same implementation computing in float64): pass oracle=")
    impls = {"main": impl, "twin": as_implementation(twin)}
    if circumstance_of(circumstance).needs_other:
        if other is None:
            raise TypeError(f"probe where, {circumstance}: pass other= (the same model in batch-invariant mode)")
        impls["other"] = as_implementation(other)
    pol = _policy_of(impl, policy)
    mode = "invariant" if getattr(impl, "batch_invariant", False) else "default"
    cfg = getattr(impl, "config", None) or getattr(impl, "cfg", None)
    if cfg is None or getattr(cfg, "hidden_size", None) is None:
        raise TypeError(f"{getattr(impl, 'name', type(model).__name__)}: probe where needs the model's config "
                        "(a cfg or config attribute with hidden_size, vocab_size, num_hidden_layers, ...)")
    return _Setup(name or f"{getattr(impl, 'name', type(model).__name__)} {pol.name} {mode}",
                  getattr(impl, "package", None) or getattr(impl, "name", type(model).__name__), pol, mode,
                  bool(getattr(impl, "keeps_f32", False)), cfg, impls, tuple(impl.taps), spec=spec)


def default_meshes(cfg, devices: int) -> list[dict]:
    """Every tensor size from 2 to min(8, devices) the model's sizes allow, then data=2."""
    from jaxmodel.sharding import ShardingError, check_sizes
    out = []
    for t in range(2, min(8, devices) + 1):
        try:
            check_sizes(cfg, t)
            out.append({"tensor": t})
        except ShardingError:
            pass
    return out + ([{"data": 2}] if devices >= 2 else [])


def _sharded(setup: _Setup, meshes, progress) -> list[dict]:
    """Adds jaxmodel on each mesh (and its float64 twin on the same mesh) to setup.impls, built
    from the main model's weights in its mode; returns the meshes (default: default_meshes)."""
    import jax

    import jaxmodel
    from jaxmodel.sharding import make_mesh

    main = setup.impls["main"]
    if getattr(main, "package", None) != "jaxmodel" or getattr(main, "mesh", None) is not None:
        raise ValueError(f"probe where, sharding: the model must be jaxmodel on one device, not "
                         f"{getattr(main, 'name', type(main).__name__)} (the sharded runs are jaxmodel on meshes)")
    meshes = [dict(m) for m in (meshes or default_meshes(setup.cfg, len(jax.devices())))]
    if not meshes:
        raise ValueError(f"probe where, sharding: JAX has {len(jax.devices())} device(s), too few for a mesh "
                         "(on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts; the "
                         "CLI sets it)")
    model = main.model
    weights = model.weights()
    quantized = model.quantized() or None      # a quantizing policy's fp8 values and scales, as they are
    for mesh in meshes:
        make_mesh(mesh)   # enough devices, known axes: checked before anything is built
        key = f"mesh {mesh_label(mesh)}"
        if progress:
            progress(f"where: loading jaxmodel on {key} and its float64 twin")
        # both from the main model's rounded weights, read once (a twin from the sharded model's
        # weights() would gather the same values again per mesh)
        setup.impls[key] = OurModel(jaxmodel.from_weights(model.cfg, weights, model.policy, model.batch_invariant,
                                                          mesh=mesh, quantized=quantized))
        setup.impls[key + " twin"] = OurModel(jaxmodel.from_weights(model.cfg, weights, fp64_policy(model.policy),
                                                                    mesh=mesh, quantized=quantized))
    return meshes


def gpu_report(impl: str) -> tuple[str | None, str]:
    """(the GPU's name, or None where there is none; what the framework reports): JAX's for
    jaxmodel, torch's for the others."""
    if impl == "jaxmodel":
        import jax  # jax: slow import; only for the device circumstance
        try:
            gpu = jax.devices("gpu")[0]
        except RuntimeError as e:
            return None, f"JAX reports no GPU ({e})"
        return gpu.device_kind, f"JAX reports {gpu}"
    import torch  # torch: slow import; only for the device circumstance
    if not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return None, (f"torch reports no GPU (torch.cuda.is_available() is False; torch {torch.__version__}, "
                      f"{build}, {torch.cuda.device_count()} CUDA devices)")
    return torch.cuda.get_device_name(0), f"torch reports {torch.cuda.get_device_name(0)}"


def resolve_device(impl: str, device: str | None = None) -> str:
    """The device circumstance's other device for implementation `impl`: `device` ("gpu", or an
    instruction-set cap of llamaspec.caps.CAPS) checked, or by default the GPU where the
    implementation's framework reports one, else the cap caps.DEFAULT (avx2) on an x86 CPU. A GPU
    this machine lacks (with what JAX or torch reports), an unknown cap or one this CPU cannot
    honour is a caps.DeviceError."""
    if device is not None and device != GPU:
        if device not in caps.CAPS:
            raise caps.DeviceError(f"probe where, device: unknown other device {device!r} ({GPU}, or an "
                                   f"instruction-set cap: {', '.join(caps.CAPS)})")
        return caps.check(device).name
    name, said = gpu_report(impl)
    if name is not None:
        return GPU
    if device == GPU:
        raise caps.DeviceError(f"probe where, device: no GPU to compare this CPU with: {said}")
    if not caps.x86():
        raise caps.DeviceError(f"probe where, device: no other device here: {said}, and the instruction-set caps "
                               f"are x86 code paths (this is {caps.this_cpu({})})")
    return caps.check(caps.DEFAULT).name


def _impl_name(model) -> str:
    if isinstance(model, str):
        return model
    if isinstance(model, ProbeModel):
        return model.impl
    return getattr(model, "package", None) or getattr(model, "name", None) or type(model).__name__


def _other_device(setup: _Setup, device: str, progress) -> tuple[str, str]:
    """(this side's label, the other's); for the GPU, adds the model on it and its float64 twin
    there (from the spec, on the GPU) to setup.impls under the run's model key."""
    here = caps.this_cpu(os.environ)
    if setup.spec is None:
        raise ValueError("probe where, device: the model must be loadable again on the other device or in a second "
                         "process (give it by name, or load it with compare.probes.load_model)")
    if device != GPU:
        return here, f"cap {device} (a second process)"
    if progress:
        progress("where: loading the model on the GPU and its float64 twin there")
    key = device_key(GPU)
    spec = dataclasses.replace(setup.spec, device="cuda")
    setup.impls[key] = _load(spec)
    setup.impls[impl_key(key, True)] = as_implementation(fp64_twin(setup.impls[key]))     # on the GPU too
    return here, f"GPU ({gpu_report(setup.spec.impl)[0]})"


def _side(label: str, policy: Policy, impl) -> dict:
    """A side of the device circumstance: its label and this process's record with its model's plan."""
    return {"label": label, "environment": environment(policy, uses_jax=getattr(impl, "package", None) == "jaxmodel",
                                                        sides={"model": impl})}


def _sides(setup: _Setup, source, cap: str | None, labels) -> dict:
    """The device circumstance's two sides (WhereResult.sides): B's record is its second
    process's under a cap (CaptureSource.records), else this process's with the GPU's model."""
    b = ({"label": labels[1], "environment": source.records[device_key(cap)]} if cap
         else _side(labels[1], setup.policy, setup.impls[device_key(GPU)]))
    return {"A": _side(labels[0], setup.policy, setup.impls["main"]), "B": b}


def _details(setup: _Setup, source, circumstance: str) -> dict:
    """WhereResult.details: "plan", the record of the plan the model at the policy computed by
    (the loaded model's, or the streamed runs' LayerRunner's; none for an implementation without
    one); for a rerun, this process's determinism settings and the same lines of each fresh
    process's record (CaptureSource.records)."""
    if isinstance(source, StreamSource):
        plan = next(getattr(run.runner, "plan", None) for (_, twin), run in source.layer_runs.items() if not twin)
    else:
        plan = plan_of(setup.impls["main"])
    out = {"plan": plan.record()} if plan is not None and hasattr(plan, "record") else {}
    if circumstance == "rerun":
        mine = determinism_settings(uses_jax=setup.impl == "jaxmodel")
        out["determinism settings"] = mine
        out["fresh process settings"] = {key: {k: record[k] for k in mine if k in record}
                                         for key, record in getattr(source, "records", {}).items()}
    return out


def twin_computes(setup: _Setup, run) -> bool:
    """Whether the float64 twin's run of `run` computes run's circumstance: not where the twin
    captures a padded batch row by row on the real tokens (TransformersModel.unpadded_rows, so
    that eager attention cannot turn left padding into NaN), which never sees the padding; such a
    pair is judged without B's twin (the no-twin rungs), as a port without float64() is."""
    twin = setup.impls.get(impl_key(run.model, True))
    return not (getattr(twin, "unpadded_rows", False) and not np.asarray(run.mask).all())


def _target(cfg, ids, length: int, seed: int) -> np.ndarray:
    if ids is None:
        return np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, length)).astype(np.int64)
    a = np.asarray(ids, np.int64)
    return a[None] if a.ndim == 1 else a[:1]


def _source(setup: _Setup, runs, pairs, rows_of, progress, cap: str | None = None):
    if any(r.step is not None for r in runs):
        return DecodeSource(setup.impls, runs, rows_of, setup.taps, progress)
    if setup.package is not None:
        return StreamSource(setup.package, setup.folder, setup.policy, runs, rows_of)
    if any(r.fresh for r in runs) and setup.spec is None:
        raise ValueError("probe where, rerun in a fresh process: the model must be loadable in another process "
                         "(give it by name, or load it with compare.probes.load_model); or pass processes=0")
    forced = {(p.b.run, twin) for p in pairs for twin in ((False, True) if p.own_twin else (False,))}
    return CaptureSource(setup.impls, runs, rows_of, setup.taps, setup.spec, forced, progress, cap)


def probe_where(model, circumstance: str = "batch", ids=None, *, checkpoint=None, policy=None, oracle=None,
                other=None, stream=None, length: int = 24, seed: int = 0, attn_implementation: str = "eager",
                hf_positions: str = "mask", progress=None, **options) -> WhereResult:
    """The layerwise circumstance comparison. model: "torchref" | "jaxmodel" | "transformers"
    (loaded from checkpoint= at policy=; ours stream for batch/padding/append unless
    stream=False), a ProbeModel, a model object or an Implementation-protocol port (its
    float64 twin from float64(), else oracle=; invariant-mode: other= the invariant-mode
    model; transformers by name: attn_implementation=, hf_positions= "mask" | "default",
    see adapters/transformers.py). options go to where_plan.plan (batch_sizes, kinds, side, pad, appended, token,
    batch, repeats, processes)."""
    circ = circumstance_of(circumstance)       # an unknown name: ValueError with the list
    t0 = time.perf_counter()
    if circ.other_device:       # checked before anything loads
        options["device"] = resolve_device(_impl_name(model), options.get("device"))
    if isinstance(model, str):
        setup = _by_name(model, circumstance, checkpoint, policy, stream, other,
                         {"attn_implementation": attn_implementation, "positions": hf_positions})
    else:
        setup = _of_object(model, circumstance, checkpoint, policy, oracle, other)
    if circ.sharded:
        options["meshes"] = _sharded(setup, options.get("meshes"), progress)
    cap = None
    if circ.other_device:
        options["labels"] = _other_device(setup, options["device"], progress)
        cap = None if options["device"] == GPU else options["device"]
    target = _target(setup.cfg, ids, length, seed)
    # the CLI checks this before loading (probe_cli._where_budget); here for callers of the library
    check_budget(circumstance, target.shape[-1], int(setup.cfg.max_position_embeddings), int(setup.cfg.vocab_size),
                 **{k: v for k, v in options.items() if k != "meshes"})
    pad = getattr(setup.cfg, "pad_token_id", None)
    runs, pairs = plan(circumstance, target, int(setup.cfg.vocab_size), 0 if pad is None else int(pad), seed,
                       **options)
    by_key = {r.key: r for r in runs}
    rows_of = {r.key: sorted({s.row for p in pairs for s in (p.a, p.b) if s.run == r.key}) for r in runs}
    source = _source(setup, runs, pairs, rows_of, progress, cap)
    sides = _sides(setup, source, cap, options["labels"]) if circ.other_device else {}
    details = _details(setup, source, circumstance)
    yard = Yardstick.of(setup.policy, int(setup.cfg.hidden_size), setup.keeps_f32,
                        setup.cfg if isinstance(setup.cfg, LlamaConfig) else None)
    pairings = [_Pairing(p, _comparison(p, by_key), by_key[p.b.run].mask[p.b.row],
                         p.own_twin and twin_computes(setup, by_key[p.b.run])) for p in pairs]
    t_walk, ran_before = time.perf_counter(), sum(source.seconds.values())
    _walk(source, pairings, by_key, setup.cfg, yard, setup.taps, progress)
    comps = [p.comparison for p in pairings]
    _row_findings(comps)
    seconds = {k: round(v, 3) for k, v in source.seconds.items()}
    seconds.update(reading=round(getattr(source, "read_seconds", 0.0), 3),
                   judging=round(time.perf_counter() - t_walk - (sum(source.seconds.values()) - ran_before)
                                 - getattr(source, "read_seconds", 0.0), 3),
                   total=round(time.perf_counter() - t0, 3))
    n_runs = sum(2 if r.twin else 1 for r in runs)
    cost = {"runs": n_runs, "runs_at_policy": len(runs), "twin_runs": sum(r.twin for r in runs),
            "rows_x_slots": int(sum(r.rows * r.width * (2 if r.twin else 1) for r in runs)),
            "teacher_forced_layers": sum(1 for c in comps for p in (c.first_difference, c.first_beyond)
                                         if p is not None and p.forced is not None and p.forced.ran)}
    return WhereResult("where", circumstance, setup.name, setup.impl, setup.policy.name, setup.mode,
                       setup.package is not None, int(target.shape[1]),
                       max((c.verdict for c in comps), key=KINDS.index, default="exact"), comps, yard.m, yard.floor,
                       yard.twin_floor, seconds, cost, sides, details)
