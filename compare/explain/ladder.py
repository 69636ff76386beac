"""Sentences for the ladder's records (compare.evidence): a tap's hint, a divergence's hint,
teacher forcing's evidence. Every word the terminal, JSON, HTML and assert_parity show
about a verdict is made here, from numbers; nothing decides on what is written here."""

from __future__ import annotations

from llamaspec import taps as tapnames

from .. import evidence as ev
from ..metrics import unit_roundoff
from ..results import NONE, NONE_AT_FP64, RETURNED
from ..vocabulary import FLOOR_ULPS, KINDS, NOISE_BAND, ONE_ROUNDING, TREND_BUCKETS
from .findings import hint as findings_hint

# Where a precision deviation first shows, the step that most likely lost it.
PRECISION_STEP = {
    "q_rope": "RoPE tables (angles, cos/sin) computed in lower precision",
    "k_rope": "RoPE tables (angles, cos/sin) computed in lower precision",
    "attn_ctx": "attention (scores, softmax or P@V) computed in lower precision",
    "attn_norm": "RMSNorm (mean of squares, rsqrt) computed in lower precision",
    "mlp_norm": "RMSNorm (mean of squares, rsqrt) computed in lower precision",
    "final_norm": "RMSNorm (mean of squares, rsqrt) computed in lower precision",
    "logits": "lm_head output kept in lower precision",
}
# Where a semantic difference with no simple structure first shows: what sits there.
COMPONENT_HINT = {
    "embed": "the embedding table or token ids (or the embedding's scale)",
    "attn_norm": "the input RMSNorm (epsilon, weight convention, normalisation)",
    "mlp_norm": "the post-attention RMSNorm (epsilon, weight convention, normalisation)",
    "final_norm": "the final RMSNorm",
    "lm_head": "the lm_head matrix: everything before the logits agrees (tied vs untied "
               "embeddings, a transposed or another matrix, or the logits' soft-cap)",
}
_PART = {"attn": "attention", "mlp": "MLP", "attn_norm": "input RMSNorm", "mlp_norm": "post-attention RMSNorm",
         "embed": "embedding", "final_norm": "final RMSNorm", "lm_head": "lm_head"}
_QUARTERS = ("highest", "second", "third", "lowest")
_ROPE_STEP = ("a step whose rounding grows with position, most often RoPE angles (position x frequency) "
              "or tables computed in lower precision")


def span(s: ev.Span) -> str:
    if s.unit == "tap":
        return "whole tap"
    if s.unit == "rope_pairs":
        return f"RoPE pairs {s.lo}-{s.hi} of {s.of} (the {_QUARTERS[s.quarter]} quarter of frequencies)"
    return f"{s.unit} {s.lo}-{s.hi}"


def _part_of(tap: str) -> str:
    t = tapnames.tap(tap)
    return f"layer {t.layer}'s {_PART[t.component]}" if t.layer is not None else f"the {_PART[t.component]}"


def _bound(e: ev.Evidence) -> str:
    return f"{e.m:g}x + {FLOOR_ULPS} ulp"


def _nonfinite(tap, e):
    r, c, c64 = e.nonfinite
    return f"NaN/Inf: {r} in the reference, {c} in the candidate ({c64} at fp64)"


# The step a dtype noise belongs to (compare.evidence.Noise.step), and how its rounding shows.
_NOISE_STEP = {"norm_stats": "the RMSNorm's statistics (mean of squares, rsqrt)", "softmax": "the softmax",
               "rope": "the RoPE angles and tables", "sums": "the matmul's sums (accumulation)",
               "output": "this step's output", "kv_cache": "the keys and values attention reads (kv_cache)",
               "weights": "the projection weights (param_dtype, weight_fp8)"}
_NOISE_SHAPE = {"values": "unbiased and uncorrelated with the values",
                "rows": "one factor per row, both signs, rounding-sized: a rounded statistic, not an epsilon",
                "angles": "in the rotation angles, relative to position x frequency, unbiased",
                "kv_cache": "attention recomputed over the oracle's keys and values stored so matches it",
                "weights": "the product recomputed from its own input and the reference's weight stored so matches it"}


def _fp64_noise(tap, e):
    n = e.noise
    if n.inherited_from is not None:
        return f"it carries the {n.dtype} rounding that enters at {n.inherited_from}"
    step = PRECISION_STEP.get(tapnames.tap(tap).kind, "a step rounded to a narrower dtype")
    size = "angle error" if n.shape == "angles" else "rel error"
    err = f"{n.size * unit_roundoff(n.dtype):.1e}" if n.shape == "angles" else f"{e.err_fp64:.1e}"
    prescribed = (f"; {e.policy} prescribes {n.prescribed} for {_NOISE_STEP[n.step]}"
                  if n.prescribed and n.step in _NOISE_STEP else "")
    if n.shape == "weights":
        return (f"{_part_of(tap)} multiplies by weights stored in {n.scheme} even in the float64 run "
                f"(rel error {e.err_fp64:.1e} = {n.size:.2f} {n.dtype} unit roundoffs; {_NOISE_SHAPE['weights']})"
                f"{prescribed}: weights quantized where the policy keeps them wider")
    if n.shape == "kv_cache":
        return (f"{_part_of(tap)} reads its keys and values stored in {n.scheme} even in the float64 run "
                f"(rel error {e.err_fp64:.1e} = {n.size:.2f} {n.dtype} unit roundoffs; {_NOISE_SHAPE['kv_cache']})"
                f"{prescribed}: a KV cache kept narrower than the policy's")
    return (f"{_part_of(tap)} computes at about {n.dtype} precision even in the float64 run ({size} "
            f"{err} = {n.size:.2f} {n.dtype} unit roundoffs; one rounding gives {ONE_ROUNDING:.2f}; "
            f"{_NOISE_SHAPE.get(n.shape, '')}){prescribed}: {step}")


def inherited_hint(inh: ev.Inherited, local: ev.Evidence | None) -> str:
    """A tap after the first divergence whose difference is the divergence's, carried."""
    if inh.how == ev.SAME_LAYER:
        return (f"inherited from {inh.source} (alone it reads as {inh.own_kind}): it follows the first divergence "
                "inside the same layer, where teacher forcing (each layer fed the oracle's input) cannot "
                "separate the two")
    what = (f"its local error is {local.kind} ({local.err_cand:.1e} vs the reference's {local.err_ref:.1e}"
            + (f", fp64 {local.err_fp64:.1e})" if local.err_fp64 == local.err_fp64 else ")"))
    return (f"inherited from {inh.source} (alone it reads as {inh.own_kind}): fed the oracle's input to its "
            f"layer, {what}, so it adds nothing of its own")


def _fp64_math(tap, e):
    why = findings_hint(e.findings) if e.findings else "no simple structure"
    hidden = (f" (bitwise equal at {e.policy} here: the policy rounds it away, it shows further on)"
              if e.hidden_by_policy else "")
    over = f" > {e.floor64:.0e}" if e.err_fp64 > e.floor64 else f", structured above {e.gate:.0e}"
    return f"differs at fp64 (rel L2 {e.err_fp64:.1e}{over}){hidden}: a difference in the math, not rounding; {why}"


def _grows(tr: ev.Trend) -> str:
    return (f"the candidate's error over the reference's grows with position, steadily (rank correlation "
            f"{tr.rho:.2f}), from {tr.first:.2f}x in the first {TREND_BUCKETS}th of the positions to "
            f"{tr.last:.2f}x at {span(tr.last_span)}")


def _precision(tap, e):
    step = PRECISION_STEP.get(tapnames.tap(tap).kind, "a step computed in lower precision "
                              "(matmul accumulation, norm, softmax, RoPE tables)")
    if e.trend is not None and e.trend.rising:
        step = f"{step}; {_grows(e.trend)}: {_ROPE_STEP}"
    if e.span.highest_frequencies:
        step += ("; the excess sits in the highest-frequency pairs, where the angle (position x "
                 "frequency) is largest: angles or their inputs rounded to a narrower dtype")
    times = f"{e.err_cand / e.err_ref:.1f}x" if e.err_ref else "more than"
    return (f"the candidate loses {times} the reference's precision here ({e.err_cand:.1e} vs {e.err_ref:.1e}; "
            f"{e.ratio:.1f}x the drift bound {_bound(e)} over the {span(e.span)}) while fp64 agrees: {step}")


def _drift(tap, e):
    return f"rounding: {e.err_cand:.1e} vs the reference's own {e.err_ref:.1e} (within {_bound(e)})"


def _no_twin_base(e) -> str:
    return (f"the candidate's error is {e.err_cand:.1e} against the reference's {e.err_ref:.1e} ({e.ratio:.1f}x the "
            f"drift bound over the {span(e.span)}); no float64 twin, so judged at {e.policy} by structure alone")


def _no_twin_semantic(tap, e):
    why = (findings_hint(e.findings) if e.findings else
           f"larger than rounding in bf16 or any wider dtype makes ({e.err_cand:.1e} > {NOISE_BAND[1]:g} bf16 "
           "unit roundoffs)")
    return f"{_no_twin_base(e)}: most likely a difference in the math: {why}"


def _declared_size(e) -> str:
    d = e.declared
    return f"{d.units:.3g} {d.dtype} unit roundoffs ({d.dtype}: the coarsest dtype {e.policy} declares)"


def _no_twin_precision(tap, e):
    angle = e.span.highest_frequencies
    step = PRECISION_STEP.get(tapnames.tap(tap).kind, "a step computed in lower precision")
    if angle:
        step += ("; the excess sits in the highest-frequency pairs, where the angle (position x frequency) is "
                 "largest")
    d, n = e.declared, e.noise
    size = ("" if angle or d is None else
            f"; {_part_of(tap)} computes at about {n.dtype} precision: every value here is exact in {n.dtype}, "
            f"narrower than {d.dtype} (this step's output was rounded to {n.dtype}, and {n.size:.2g} {n.dtype} unit "
            "roundoffs is that rounding's size)"
            if n is not None and n.inherited_from is None else
            f"; it carries the {n.dtype} rounding of {n.inherited_from} (at most {NOISE_BAND[1]:g} {n.dtype} unit "
            f"roundoffs: {e.err_cand / unit_roundoff(n.dtype):.2g})" if n is not None else
            f" and rounding-sized for its policy ({_declared_size(e)})")
    return (f"{_no_twin_base(e)}: no structure of different math{size}, most "
            f"likely precision: {step} (a small change in the math can look the same without the twin)")


def _no_twin_undecided(tap, e):
    d = e.declared
    fits = (f"; one rounding to {' or '.join(d.narrower)} would be this size" if d.narrower else
            "; smaller than one rounding to a narrower dtype, unless damped by the steps after it")
    return (f"departs at {tap}: {e.ratio:.3g}x the drift bound over the {span(e.span)} (the candidate's error "
            f"{e.err_cand:.1e} against the reference's {e.err_ref:.1e}), {_declared_size(e)}: far beyond any "
            f"rounding of the dtypes its policy declares{fits}. No structure found; without a float64 twin or finer "
            "taps the tool cannot tell rounding from math (a step computed in a narrower dtype than declared, or a "
            "change in the math): counted as semantic; a float64() twin, or taps inside the layer (attn_norm, q, "
            "attn_ctx, ...), decide it")


_PERMUTATION = {"to_interleaved": "interleaved vs half-split RoPE pairs",
                "to_half_split": "half-split vs interleaved RoPE pairs"}


def _shift_invariant(tap, e):
    c = e.convention
    n = c.numbers
    return (f"changes no probability: the logits differ by a constant per position (from {n['shift_min']:.3g} to "
            f"{n['shift_max']:.3g}; as returned they read as {c.raw.kind}, rel L2 {c.raw.err_cand:.1e}), and with "
            f"each position's mean removed they are {c.removed.kind} ({c.removed.err_cand:.1e} vs the reference's "
            f"{c.removed.err_ref:.1e}); softmax is invariant to such a shift: mean KL {n['kl']:.1e}, max "
            f"|log-softmax difference| {n['max_logprob_diff']:.1e} (a convention such as centred unembedding, "
            "not a bug; a consumer of the raw logits sees the shift)")


def _layout_convention(tap, e):
    c = e.convention
    name = _PERMUTATION.get(c.numbers.get("pattern"), "a fixed permutation of each head's features")
    undone = (f"; the attention undoes it: {c.confirmed_by} is within rounding" if c.confirmed else
              "; not yet confirmed by a later tap of the layer")
    return (f"layout convention (features permuted: {name}): with each head's {c.numbers['head_dim']} features "
            f"put back in the reference's order the tap is {c.removed.kind} ({c.removed.err_cand:.1e} vs the "
            f"reference's {c.removed.err_ref:.1e}; as returned it reads as {c.raw.kind}){undone}")


def _no_twin_drift(tap, e):
    return (f"rounding: {e.err_cand:.1e} vs the reference's own {e.err_ref:.1e} (within {_bound(e)}; no float64 "
            f"twin: judged at {e.policy} only)")


def _no_twin_nonfinite(tap, e):
    r, c, _ = e.nonfinite
    return f"NaN/Inf: {r} in the reference, {c} in the candidate (no float64 twin to tell math from overflow)"


def _onset(tap, e):
    dtype = e.looks_like
    return (f"differs at fp64 (rel L2 {e.err_fp64:.1e}) at step {e.step}, where this tap agreed with the oracle to "
            f"fp64 rounding at step {e.agreed_step}: a step rounded to {dtype} would round at every step, so "
            f"this is a difference in the math that starts here, not rounding (it looks like {dtype} "
            "noise: unbiased, unstructured)")


def _pooled_drift(tap, e):
    p = e.pooled
    return (f"rounding: {e.err_cand:.1e} vs the reference's own {e.err_ref:.1e} at this one position is "
            f"{e.ratio:.2f}x the drift bound, but {p.ratio:.2f}x over all {p.steps} steps ({span(p.span)}): a step "
            "computed in lower precision would lose precision at every step; one position's ratio scatters")


def _pooled_no_structure(tap, e):
    return (f"fp64 difference {e.err_fp64:.1e} (below the floor) with a pattern at this one position that "
            f"is not there over all steps ({e.pooled.kind} pooled): one row is too few for the structure "
            "detectors; rounding")


_TAP = {ev.NONFINITE: _nonfinite, ev.EXACT: lambda tap, e: "bitwise equal", ev.FP64_NOISE: _fp64_noise,
        ev.FP64_MATH: _fp64_math, ev.PRECISION: _precision, ev.DRIFT: _drift,
        ev.NO_TWIN_SEMANTIC: _no_twin_semantic, ev.NO_TWIN_PRECISION: _no_twin_precision,
        ev.NO_TWIN_UNDECIDED: _no_twin_undecided, ev.SHIFT_INVARIANT: _shift_invariant,
        ev.LAYOUT_CONVENTION: _layout_convention,
        ev.NO_TWIN_DRIFT: _no_twin_drift, ev.NO_TWIN_NONFINITE: _no_twin_nonfinite,
        ev.ONSET: _onset, ev.POOLED_DRIFT: _pooled_drift, ev.POOLED_NO_STRUCTURE: _pooled_no_structure}


def tap_hint(tap: str, e: ev.Evidence) -> str:
    """One tap's verdict in one sentence, from its record."""
    return _TAP[e.reason](tap, e)


def _path(p: ev.DecodePath) -> str:
    if p.decode_wrong:
        return (f"; the candidate's fp64 decode differs from its own fp64 full recompute here (rel L2 "
                f"{p.own_recompute:.1e}; full recompute vs oracle {p.full_vs_oracle:.1e}): the decode "
                "path is wrong, not the model's math: its KV cache (write slot, positions of cached keys, "
                "mask over the cache)" + (" or the key written at this step" if p.key_tap else ""))
    return (f"; the candidate's fp64 full recompute differs from the oracle as much (rel L2 "
            f"{p.full_vs_oracle:.1e}; decode vs own full recompute {p.own_recompute:.1e}): the model's "
            "math, not its cache; compare_models localises it on the prompt")


def divergence_hint(d) -> str:
    """A first divergence (verdicts.Divergence): its tap's sentence; where the difference has
    no simple structure, or starts in the embedding or the lm_head (a table, one matrix),
    what sits there; on decode, which path is wrong."""
    text = tap_hint(d.tap, d.record)
    if d.component in COMPONENT_HINT and (d.record.unstructured or d.component in ("embed", "lm_head")):
        text += f"; it starts in {COMPONENT_HINT[d.component]}"
    return text + (_path(d.path) if d.path is not None else "")


def forcing_sentence(f: ev.Forcing) -> str:
    """Teacher forcing's word on a divergence's layer."""
    if f.rule == "fp64":
        rule = f"fp64 local error of layers.i.{f.what} > {f.gate:.0e}"
    else:
        rule = f"local error of layers.i.{f.what} > {f.m:g}x the reference's + {FLOOR_ULPS} ulp"
    if f.layer is None:
        return (f"teacher forcing: no layer adds the difference on its own ({rule}), so it starts outside the "
                f"layers, in {f.component}" if f.first is None else
                f"teacher forcing: layer {f.first} adds a difference on its own ({rule})")
    if f.first is None:
        return (f"teacher forcing: no layer adds it on its own ({rule}); the difference is inherited or too small "
                "to isolate")
    if f.rule == "fp64":
        nums = f"{f.here:.1e} there" + (f", {f.before:.1e} in layer {f.layer - 1}" if f.before is not None else "")
    else:
        nums = f"{f.cand_local:.1e} vs the reference's {f.ref_local:.1e} there, {f.ratio:.1f}x the bound"
    return (f"teacher forcing (oracle input forced into every layer): layer {f.first} is the first to add it on "
            f"its own ({rule}; {nums})")


def greedy_split(case: str, row, ladder, policy: str) -> str:
    """Why a greedy row parts (compare.ladder.greedy.SPLIT_CASES), from the row's numbers and
    the ladder's Report on the common prefix."""
    m, d = row.reference_margin, row.logit_difference
    if case == "ladder":
        div = ladder.first_divergence
        return (f"the ladder on the common prefix ({row.prompt_tokens + row.step - 1} tokens) finds "
                f"{ladder.verdict}" + (f" first at {div.tap} (layer {div.layer}, {div.component}): "
                                       f"{div.hint}" if div is not None else "")
                + f"; the reference's top two are {m:.2e} apart there, the sides' logits differ by {d:.2e}")
    if case == "near_tie":
        return (f"the two sides' logits differ by {d:.2e} where the reference's top two are {m:.2e} apart "
                f"(a split needs margin <= 2 x difference: {m:.2e} <= {2 * d:.2e}); the ladder on the "
                f"common prefix says {ladder.verdict} at {policy}")
    head = (f"the full recomputes of the common prefix differ by only {d:.2e} at the two tokens, where the "
            f"reference's top two are {m:.2e} apart (> 2 x {d:.2e}): they cannot split (capture top-1: reference "
            f"{row.capture_top1[0]}, candidate {row.capture_top1[1]}); the tokens came from the generation path "
            "(prefill + KV-cache decode)")
    if case == "not_replayed":
        return (head + "; it could not be replayed (no prefill / decode, or the replay did not "
                f"reproduce the tokens), so nothing explains the split; the ladder says {ladder.verdict}; "
                "compare_decode judges the decode path step by step")
    g = row.generation
    numbers = (f"replayed, the generation paths' logits differ by {g['logit_difference']:.2e} where the reference's "
               f"top two are {g['reference_margin']:.2e} apart; against the fp64 oracle each generation path is at "
               f"{g['reference_ratio']:.2f}x (reference) and {g['candidate_ratio']:.2f}x (candidate) the drift bound "
               f"(M x the reference recompute's error + floor, as the ladder's precision rung)")
    if case == "replay_drift":
        return (head + "; " + numbers + f": rounding in the decode path at a near tie (the ladder on the "
                f"prefix says {ladder.verdict} at {policy})")
    worse = "candidate" if g["candidate_ratio"] > g["reference_ratio"] else "reference"
    return (head + "; " + numbers + f": the {worse}'s decode path loses more than rounding although its "
            f"full recompute is {ladder.verdict} (its decode path vs its own recompute: "
            f"{g[worse + '_vs_recompute']:.2e} at the two tokens); compare_decode judges the decode path "
            "(KV cache, positions, mask) step by step")


# Why a capture check (or one of its plain runs) was not run, per compare.evidence reason.
_NOT_RUN = {ev.WHOLE_MODEL: "it loads the whole model, which the streamed ladder avoids; compare_models(stream=False) "
                            "runs it",
            ev.REPLAYED: "a dump replays stored arrays, so every capture of it is the same bytes; the check belongs "
                         "to the run that was dumped",
            ev.NO_LOGITS: "its capture returned no logits",
            ev.NO_FORWARD: "it has none the engine may call (the Implementation protocol defines capture, not a "
                           "plain forward)",
            ev.NOT_NEEDED: "the capture is bitwise the plain forward already, so whether that forward repeats "
                           "cannot change the answer"}


def _differs(a: ev.LogitsAgreement, dtype: str) -> str:
    return f"{a.baseline} (rel L2 {a.rel_l2:.1e}, max {a.max_ulp:.0f} ULP in {dtype}, max abs {a.max_abs:.1e})"


def capture_note(c: ev.CaptureCheck) -> str:
    """One side's capture check (compare.ladder.capture_check) in one sentence, from its record."""
    skipped = "".join(f"; {what} not run: {_NOT_RUN[why]}" for what, why in c.not_run.items() if what != "check")
    if not c.ran:
        return f"capture check of {c.side} not run: {_NOT_RUN[c.not_run['check']]}"
    if c.bitwise:
        again = ", and its forward repeats bitwise" if c.repeats else ""
        return (f"capture check: {c.side}'s logits with {c.taps} taps captured are bitwise those of "
                f"{', '.join(a.baseline for a in c.against)}{again}{skipped}")
    differ = ", ".join(_differs(a, c.dtype) for a in c.against if not a.bitwise)
    cannot = (f"differences below rel L2 {c.floor:.1e} (this floor) are what its taps cannot resolve; the verdict "
              "judges the taps as captured")
    if c.repeats is False:
        return (f"{c.side}'s plain forward does not repeat itself (two runs: {_differs(c.again, c.dtype)}), so its "
                f"capture check cannot tell capturing from run-to-run noise; its logits with {c.taps} taps captured "
                f"differ from {differ}: {cannot}{skipped}")
    return (f"capturing changes {c.side}'s numbers: its logits with {c.taps} taps captured differ from {differ}, "
            f"so its taps show a run that is not its plain one: {cannot}{skipped}")


_NOT_RUN_SHORT = {ev.WHOLE_MODEL: "streamed: it loads the whole model", ev.REPLAYED: "a dump replays stored arrays",
                  ev.NO_LOGITS: "no logits", ev.NO_FORWARD: "not part of the protocol",
                  ev.NOT_NEEDED: "not needed: bitwise"}


def _capture_brief(role: str, c: ev.CaptureCheck) -> str:
    """A clean (or not run) capture check in a short line for the terminal."""
    head = f"capture check, {role} {c.side}"
    if not c.ran:
        return f"{head}: not run ({_NOT_RUN_SHORT[c.not_run['check']]})"
    skipped = "".join(f"; {what} not run ({_NOT_RUN_SHORT[why]})" for what, why in c.not_run.items())
    return (f"{head}: logits with {c.taps} taps captured bitwise = {', '.join(a.baseline for a in c.against)}"
            f"{' (which repeats)' if c.repeats else ''}{skipped}")


def capture_lines(r) -> tuple[list[str], list[str]]:
    """The Report's capture checks: (warnings, for the top: a side whose capture is not its
    plain run's bytes; short lines for the rest, for the bottom)."""
    checks = list((getattr(r, "capture", None) or {}).items())
    warn = [f"WARNING ({role}): {c.note or capture_note(c)}" for role, c in checks if c.ran and not c.bitwise]
    return warn, [_capture_brief(role, c) for role, c in checks if not c.ran or c.bitwise]


# ----- what was judged (compare.results.Coverage) ---------------------------------------------

def _steps(unjudged: dict) -> str:
    """{step: [tap, ...]} as "q (layers 0-29), k_rope (layer 3), logits"."""
    parts = []
    for step, taps in unjudged.items():
        layers = sorted({n for n in (tapnames.layer_of(t) for t in taps) if n is not None})
        parts.append(step if not layers else f"{step} ({_layer_list(layers)})")
    return ", ".join(parts)


def _layer_list(layers: list[int]) -> str:
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    return "layers " + ", ".join(map(str, layers))


def coverage_line(c) -> str:
    """Report.coverage (compare.results.Coverage) in one line: how the logits were judged where
    a side has no "logits" tap, the lm_head not judged, and the reference's taps the candidate
    does not return; "" when every tap was judged."""
    if c is None:
        return ""
    names = {"reference": c.reference, "candidate": c.candidate}
    parts = []
    returned = [names[role] for role, how in c.logits.items() if how == RETURNED]
    if c.logits_judged and returned:
        parts.append(f"logits judged from what {' and '.join(returned)} returns (its capture's first element: it "
                     "has no 'logits' tap), so the lm_head and whatever follows it are judged")
    if not c.logits_judged:
        why = [f"{names[role]} returns no logits and has no 'logits' tap" if how == NONE else
               f"{names[role]}'s float64 run returns no logits and {names[role]} has no 'logits' tap"
               for role, how in c.logits.items() if how in (NONE, NONE_AT_FP64)]
        parts.append("lm_head not judged: " + "; ".join(why))
    withheld = getattr(c, "withheld", None) or {}
    others = {step: [t for t in taps if t not in withheld] for step, taps in c.unjudged.items() if step != "logits"}
    others = {step: taps for step, taps in others.items() if taps}
    if others:
        n = sum(map(len, others.values()))
        parts.append(f"not judged, {n} of the reference's {c.reference_taps} taps ({c.candidate} returns no such "
                     f"tap): {_steps(others)}")
    if withheld:
        reasons: dict = {}
        for t, why in withheld.items():
            reasons.setdefault(why, []).append(t)
        parts.append(f"withheld by {c.candidate}, not judged: " + "; ".join(
            f"{_steps(_by_step(taps))} ({why})" for why, taps in reasons.items()))
    if c.candidate_only:
        parts.append(f"{c.candidate}'s taps the reference has no oracle for, not judged: "
                     f"{_steps(_by_step(c.candidate_only))}")
    return "; ".join(parts)


def _by_step(taps) -> dict:
    out: dict = {}
    for t in taps:
        out.setdefault(tapnames.parse(t)[1], []).append(t)
    return out


def report_summary(r) -> str:
    """The ladder's Report (compare.ladder.engine.Report) in a few lines; a capture that
    changes a side's numbers leads (the verdict is unchanged: it judges the taps as captured)."""
    warn, rest = capture_lines(r)
    lines = warn + [f"{r.candidate} vs {r.reference} at {r.policy['name']}: {r.verdict}"]
    if r.first_divergence:
        d = r.first_divergence
        lines.append(f"first {d.kind} at {d.tap} (layer {d.layer}, {d.component}): {d.hint}")
        if d.evidence:
            lines.append(d.evidence)
    inherited = [v for v in r.taps if v.inherited is not None]
    if inherited:
        lines.append(f"{len(inherited)} later tap(s) inherit it (teacher forcing: nothing of their own), "
                     f"not findings: {inherited[0].tap} .. {inherited[-1].tap}")
    cover = coverage_line(getattr(r, "coverage", None))
    if cover:
        lines.append(cover)
    lines += convention_lines(r.taps)
    if getattr(r, "nonfinite", None):
        lines.append(r.nonfinite.get("note") or nonfinite_line(r.nonfinite))
    if r.config_differences:
        lines.append("the configs differ: " + "; ".join(r.config_differences))
    if r.teacher_forcing not in ("run", "off"):     # "not run: <why>"
        lines.append(f"teacher forcing {r.teacher_forcing}")
    if r.semantic_rung != "run":
        lines.append(f"fp64 rung {r.semantic_rung}: verdicts judged at {r.policy['name']} by structure "
                     "alone, a lower-precision step and a small change in the math can look alike")
    twin = getattr(r, "twin", None)     # a refused twin's note is in the fp64 rung's line above
    if twin is not None and twin.note and not twin.refused:
        lines.append(twin.note)
    return "\n".join(lines + rest)


def convention_lines(taps) -> list[str]:
    """Taps whose difference a convention explains (kind "convention"), apart from the findings:
    one line naming them and what the first of each reason is, or none."""
    conv = [v for v in taps if v.kind == "convention"]
    if not conv:
        return []
    seen, parts = set(), []
    for v in conv:
        if v.record.reason not in seen:
            seen.add(v.record.reason)
            parts.append(f"{v.tap}: {v.hint}")
    return [f"{len(conv)} tap(s) differ by a convention that changes no prediction (not findings; the verdict "
            f"counts them as {', '.join(sorted({v.record.convention.removed.kind for v in conv}))}): "
            + "; ".join(parts)]


def nonfinite_line(n: dict) -> str:
    """Report.nonfinite in a sentence: the first tap with NaN/Inf, whose, and the config field
    (or the positions) that explains it, else that none does."""
    r, c, c64 = n["reference"], n["candidate"], n["candidate_fp64"]
    both = f"in both sides at the policy{' alike' if r == c else ''}, so not the candidate's doing alone"
    whose = (both if r and c else "in the candidate only" if c else "in the reference only" if r else
             "in the candidate's float64 run")
    head = f"NaN/Inf first at {n['tap']}: {r} in the reference, {c} in the candidate, {c64} at fp64 ({whose})"
    if "cause" in n:
        return f"{head}; the {n['cause']} explains it: {n['why']}"
    return f"{head}; no config field explains it (an overflow of the policy's dtypes, a fully masked softmax row or " \
           "a division by zero in the implementation)"


def parity_failure(r) -> str:
    """assert_parity's message: the summary and the first taps of the worst kind."""
    worst = [v for v in r.taps if v.kind == r.verdict][:5]
    return "\n".join([report_summary(r)] + [f"  {v.tap}: {v.kind}, cand {v.err_cand:.2e} vs ref "
                                           f"{v.err_ref:.2e}, fp64 {v.err_fp64:.2e}" for v in worst])


def decode_summary(r, full_recompute: str) -> str:
    """The decode comparison's DecodeReport in a few lines."""
    counts = {k: sum(s.verdict == k for s in r.per_step) for k in KINDS}
    per = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    lines = [f"{r.candidate} vs {r.reference} at {r.policy['name']}, decode of {r.steps} "
             f"steps after a {r.prompt_tokens}-token prompt: {r.verdict} ({per})"]
    if r.first_divergence is not None:
        d = r.first_divergence
        step = r.per_step[r.first_step - 1]
        lines.append(f"first {d.kind} at step {r.first_step} (slot {step.slot}): {d.tap} (layer {d.layer}, "
                     f"{d.component}): {d.hint}")
        inherited = [v for v in r.taps if v.inherited is not None]
        if inherited:
            lines.append(f"{len(inherited)} later tap(s) of step {r.taps_step} inherit it (teacher forcing: nothing "
                         f"of their own), not findings: {inherited[0].tap} .. {inherited[-1].tap}")
    cover = coverage_line(getattr(r, "coverage", None))
    if cover:
        lines.append(cover)
    if r.teacher_forcing not in ("run", "not needed"):     # "not run: <why>"
        lines.append(f"teacher forcing {r.teacher_forcing}")
    if r.config_differences:
        lines.append("the configs differ: " + "; ".join(r.config_differences))
    if r.oracle != full_recompute:
        lines.append(f"oracle: {r.oracle}")
    return "\n".join(lines)


def greedy_summary(r) -> str:
    """The greedy comparison's GreedyReport: each row, the same tokens or where it parts and why."""
    parted = [row for row in r.rows if row.step is not None]
    lines = [f"{r.candidate} vs {r.reference} at {r.policy['name']}, greedy, up to {r.new_tokens} "
             f"new tokens on {len(r.rows)} prompt(s): {r.verdict} ({len(parted)} part)"]
    for row in r.rows:
        if row.step is None:
            lines.append(f"  row {row.row}: the same {len(row.reference_tokens)} tokens")
        else:
            lines.append(f"  row {row.row}: part at step {row.step} (reference {row.reference_token}, candidate "
                         f"{row.candidate_token}): {row.cause}: {row.explanation}")
    return "\n".join(lines)


# ----- the candidate's float64 twin (compare.ladder.twins) ----------------------------------------

def _twin_taps(taps) -> str:
    """Tap names shortened for a sentence: layers.{i}.q_rope for every layer's, else a list."""
    taps = list(taps)
    kinds = {}
    for t in taps:
        layer, kind = tapnames.layer_of(t), t.rsplit(".", 1)[-1]
        kinds.setdefault(kind if layer is not None else t, []).append(layer)
    parts = [k if layers == [None] else (f"layers.{{i}}.{k} ({len(layers)} layers)" if len(layers) > 1 else
                                         f"layers.{layers[0]}.{k}") for k, layers in kinds.items()]
    return ", ".join(parts[:6]) + (f" and {len(parts) - 6} more" if len(parts) > 6 else "")


_TWIN_FORMAT = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
           ev.PRODUCT: "exact products of two float32 numbers (an f32 step times a weight)"}


def _twin_formats(narrow: dict) -> str:
    by = {}
    for t, f in narrow.items():
        by.setdefault(f, []).append(t)
    return "; ".join(f"{_TWIN_FORMAT[f]}: {_twin_taps(ts)}" for f, ts in by.items())


def twin_note(name: str, c: ev.TwinCheck) -> str:
    """The report's sentence on the twin ("" when it is accepted as it is, its weights the
    checkpoint's)."""
    if c.status == ev.REFUSED:
        return f"{name}'s float64() is refused: " + "; and ".join(_twin_refusals(c))
    sixteen = {t: f for t, f in c.narrow.items() if f in ev.SIXTEEN}
    rounds = (f"; a 16-bit rounding inside it ({_twin_formats(sixteen)}) is the port's own step, kept in its twin as "
              "a quantization is, and judged by the dtype-noise rule" if sixteen else "")
    if c.status == ev.INFERRED:
        wider = {t: f for t, f in c.narrow.items() if f not in ev.SIXTEEN}
        return (f"{name}'s float64() keeps float32 steps (keeps_f32 inferred): {_twin_formats(wider)}; the fp64 rung "
                f"is judged above float32 rounding, as for a port that declares keeps_f32{rounds}")
    if c.weights.startswith("rounded"):
        return (f"{name}'s float64() runs embedding rows {c.weights} (narrower than the policy's weights): the "
                f"port's own rounding, kept in its twin as a quantization is, and judged at the embed tap{rounds}")
    if sixteen:
        return f"{name}'s float64() is float64 arithmetic{rounds}"
    if c.weights == ev.UNCHECKED and c.status == ev.ACCEPTED:
        return f"{name}'s float64() weights not checked: it returns no embed tap"
    if c.weights == ev.DIFFER:
        return (f"{name}'s float64() embed rows differ from the checkpoint's (not by a rounding): judged as its "
                "math at the embed tap")
    return ""


def _twin_refusals(c: ev.TwinCheck) -> list[str]:
    out = []
    if ev.WEIGHTS in c.refused_for:
        dtype = c.weights.removeprefix("rounded to ")
        out.append(f"it runs weights rounded to {dtype}, not the checkpoint's (its embed rows are the checkpoint's "
                   f"rounded to {dtype}; the oracle reads the checkpoint's, so every tap would carry that rounding "
                   "as a difference in the math): give float64() the checkpoint's weights at float64 (TorchModule "
                   "and TransformersModel do when they know the checkpoint)")
    returned = (f", returned as {', '.join(sorted(set(c.returned.values())))} arrays" if c.returned else "")
    if ev.ARITHMETIC in c.refused_for:
        out.append(f"it is not float64 arithmetic: every tap it returns fits a narrower format{returned} "
                   f"({_twin_formats(c.narrow)})")
    return out
