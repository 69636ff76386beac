"""Greedy divergence linked to its cause: where two implementations' greedy generations
part, and why.

    report = compare_greedy("torchref", "jaxmodel", folder, new_tokens=32, policy="bf16")
    print(report.summary())     # per prompt: same tokens, or the step, both tokens and the cause

Each side generates greedily at the policy from the same prompts with its own generate()
(llamaspec.generate's loop: prefill, then one KV-cache decode step per token; ties go to
the lowest id). Per row, the first step s (1-based: the s-th new token) where the tokens
differ, then:

    prefix  = the prompt + the s - 1 tokens both sides agreed on; its last position is
              the one whose logits chose the s-th token
    capture = both sides at the policy on the prefix (full recompute, no cache): each
              side's top-1/top-2 margin at the last position, and
              D = max(|r[a] - c[a]|, |r[b] - c[b]|), a / b the reference's / candidate's
              token, r / c the two sides' logits there
    ladder  = run_ladder(ref, cand, prefix, teacher_forcing=True): drift or a bug, and where

and the cause:

    the ladder finds precision / semantic        -> that verdict, its first divergence
                                                    (tap, layer, component, hint)
    exact / drift and margin <= 2 D              -> "near tie, drift"
    exact / drift and margin >  2 D              -> the generation path decides (below):
                                                    "near tie, drift" or "unexplained"

Why 2 D, and why it is no tuned threshold. Let m be the reference's top-1/top-2 margin
and suppose the captured logits reproduce the split: the reference ranks a first (so
r[a] - r[b] >= m, b being at best its second) and the candidate ranks b at least as high
as a (c[b] >= c[a]). Then

    m <= (r[a] - r[b]) - (c[a] - c[b]) = (r[a] - c[a]) - (r[b] - c[b]) <= 2 D.

So margin <= 2 D is a necessary condition for the two logit vectors the ladder judged to
choose different tokens: the split is explained by exactly the difference the ladder
measured, and when the ladder calls that difference exact or drift (each side within its
own rounding against the fp64 oracle), the split is rounding at a near tie. It holds for
any model, policy and vocabulary, with no constant fitted to a case.

When is it violated? Only when the capture does not reproduce the split: the tokens were
chosen by the generation path (prefill + KV-cache decode), whose logits are not the full
recompute's. The report then replays each side's generation path (prefill, then decode of
its own tokens, as generate ran it; sides without prefill / decode cannot be replayed:
"unexplained") and judges its logits at the split against the fp64 oracle exactly as the
ladder's precision rung judges a tap: rel L2 over the vocabulary / (M x the reference
recompute's rel L2 + floor), M and floor from compare.vocabulary. Both sides within the
bound (<= 1): the decode path's own rounding decided a near tie -> "near tie, drift".
Either beyond it: that side's decode path computes something its own recompute does not
(a stale mask over the cache; docs/method.md has the measured ratios) -> "unexplained", pointing at
compare_decode, which judges the decode path step by step.
A decode-path bug that splits where the recompute splits too is called a near tie here;
compare_decode finds it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llamaspec import InputError, Policy
from llamaspec.generate import until_eos
from llamaspec.inputs import left_align

from ..adapters import Side
from ..environment import environment, sides_of
from ..explain import ladder as explain
from ..judge.verdicts import Divergence
from ..metrics import rel_l2
from ..results import JsonResult
from ..vocabulary import drift_factor, precision_floor
from .engine import Report, prepare, run_ladder

# In order of severity. "unexplained": the generations part although the ladder says
# drift and the captured logits cannot split (see the module docstring): a finding, since
# the generation path then computes something the full recompute does not.
GREEDY_KINDS = ("exact", "drift", "unexplained", "precision", "semantic")


@dataclasses.dataclass
class GreedyRow:
    row: int
    prompt_tokens: int                      # real tokens in this row's prompt
    reference_tokens: list                  # up to and including EOS
    candidate_tokens: list
    kind: str                               # exact | drift | unexplained | precision | semantic
    cause: str                              # "same tokens" | "near tie, drift" | "semantic, layer 1" | ...
    explanation: str = ""
    step: int | None = None                 # 1-based: the first new token that differs
    reference_token: int | None = None
    candidate_token: int | None = None
    # from the capture of the common prefix (full recompute) on both sides, at its last position
    reference_margin: float | None = None   # reference's top-1 - top-2
    candidate_margin: float | None = None
    logit_difference: float | None = None   # max |ref - cand| over the two tokens
    capture_top1: list | None = None        # [reference's, candidate's] argmax in the capture
    # the generation path replayed (prefill + decode), when the sides have it
    generation: dict = dataclasses.field(default_factory=dict)
    ladder_verdict: str | None = None
    first_divergence: Divergence | None = None
    teacher_forcing: str | None = None


@dataclasses.dataclass
class GreedyReport(JsonResult):
    reference: str
    candidate: str
    policy: dict
    new_tokens: int
    verdict: str                            # the worst row's kind (GREEDY_KINDS)
    rows: list[GreedyRow]
    environment: dict = dataclasses.field(default_factory=dict)
    # the ladder's full Report per parting row (row -> Report); not in to_dict / to_json
    ladders: dict = dataclasses.field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d.pop("ladders", None)
        return d

    def summary(self) -> str:
        return explain.greedy_summary(self)


def _margin(x: np.ndarray) -> float:
    top2 = np.partition(np.asarray(x, np.float64), -2)[-2:]
    return float(top2[1] - top2[0])


def _diff(r, c, a: int, b: int) -> float:
    r, c = np.asarray(r, np.float64), np.asarray(c, np.float64)
    return float(max(abs(r[a] - c[a]), abs(r[b] - c[b])))


def _check_generate(side: Side) -> None:
    if not callable(getattr(side.at_policy, "generate", None)):
        raise TypeError(f"{side.name}: the greedy comparison needs generate(tokens, attention_mask, "
                        "max_new_tokens) -> new ids [B, N] (greedy; torchref, jaxmodel and transformers "
                        f"models have it), and its {type(side.at_policy).__name__} has none")


def _generate(side: Side, ids, mask, new_tokens: int) -> np.ndarray:
    out = np.asarray(side.at_policy.generate(ids, mask, max_new_tokens=new_tokens), np.int64)
    return out.reshape(len(ids), -1)


def _last_logits(impl, ids) -> np.ndarray:
    """The logits at the last position of one row [1, L], full recompute at the policy."""
    taps = ("logits",) if "logits" in getattr(impl, "taps", ()) else tuple(impl.taps[:1])
    logits, _ = impl.capture(ids, np.ones_like(ids), taps)
    return np.asarray(logits, np.float64)[0, -1]


def _replay(impl, ids, mask, tokens, new_tokens: int, want: dict) -> dict | None:
    """Each wanted (row -> step index) logits of the generation path: prefill as generate
    does (the left-aligned batch, total length T + new_tokens), then decode of the side's
    own generated tokens. None when the side has no prefill / decode or the replay does
    not reproduce its tokens (then it is not the path generate took)."""
    if not (callable(getattr(impl, "prefill", None)) and callable(getattr(impl, "decode", None))):
        return None
    last = max(want.values())
    logits, cache = impl.prefill(ids, mask, ids.shape[1] + new_tokens)
    got = {}
    for s in range(last + 1):
        x = np.asarray(logits, np.float64)
        for row, at in want.items():
            if at == s:
                if x[row].argmax() != tokens[row, s]:
                    return None
                got[row] = x[row]
        if s < last:
            logits, cache = impl.decode(cache, tokens[:, s])
    return got


# How a parting row is explained (split_case), and the row's kind and cause for each.
SPLIT_CASES = {
    "ladder": (None, None),                         # the ladder's own verdict on the common prefix
    "near_tie": ("drift", "near tie, drift"),       # the recomputes' difference can flip the top two
    "not_replayed": ("unexplained", "unexplained"),  # the recomputes cannot split; no generation path to replay
    "replay_drift": ("drift", "near tie, drift"),   # the replayed generation paths are within the drift bound
    "replay_beyond": ("unexplained", "unexplained"),  # a replayed generation path loses more than rounding
}


def split_case(row: GreedyRow, ladder: Report) -> str:
    """Which SPLIT_CASES explains a parting row (the rule: module docstring)."""
    if ladder.verdict in ("precision", "semantic"):
        return "ladder"
    if row.reference_margin <= 2 * row.logit_difference:
        return "near_tie"
    g = row.generation
    if not g:
        return "not_replayed"
    return "replay_drift" if max(g["reference_ratio"], g["candidate_ratio"]) <= 1 else "replay_beyond"


def explain_split(row: GreedyRow, ladder: Report, policy: Policy) -> None:
    """Fills a parting row's kind, cause and explanation from the ladder's Report on the
    common prefix and the row's numbers."""
    row.ladder_verdict, row.first_divergence, row.teacher_forcing = (ladder.verdict, ladder.first_divergence,
                                                                     ladder.teacher_forcing)
    case = split_case(row, ladder)
    row.kind, row.cause = SPLIT_CASES[case]
    if case == "ladder":
        div = ladder.first_divergence
        where = f"layer {div.layer}" if div is not None and div.layer is not None else (
            div.component if div is not None else "")
        row.kind, row.cause = ladder.verdict, f"{ladder.verdict}, {where}".rstrip(", ")
    row.explanation = explain.greedy_split(case, row, ladder, policy.name)


def _oracle_ratios(row: GreedyRow, ref: Side, prefix, r_cap, gen_r, gen_c, policy: Policy, hidden) -> None:
    """Each side's generation-path logits at the split against the fp64 oracle, as the
    ladder's precision rung judges a tap: rel L2 / (M x the reference recompute's rel L2
    + floor), over the vocabulary at this one position."""
    o = _last_logits(ref.at_fp64, prefix)
    bound = drift_factor(policy) * rel_l2(r_cap, o) + precision_floor(policy, hidden)
    row.generation["reference_ratio"] = rel_l2(gen_r, o) / bound
    row.generation["candidate_ratio"] = rel_l2(gen_c, o) / bound


def _parting_rows(gr, gc, mask, eos) -> tuple[list[GreedyRow], dict]:
    """One GreedyRow per prompt, and row -> the index of the first differing new token."""
    rows, parting = [], {}
    for b in range(len(gr)):
        rt, ct = until_eos(gr[b], eos), until_eos(gc[b], eos)
        n = min(len(rt), len(ct))
        differ = [i for i in range(n) if rt[i] != ct[i]]
        row = GreedyRow(b, int(mask[b].sum()), rt, ct, "exact", "same tokens")
        if differ:
            s = differ[0]
            row.step, row.reference_token, row.candidate_token = s + 1, rt[s], ct[s]
            parting[b] = s
        rows.append(row)
    return rows, parting


def _split(row: GreedyRow, ref: Side, cand: Side, prefix, replayed: tuple, policy: Policy, hidden,
           progress, stream=None) -> Report:
    """One parting row: both sides' full recompute of the common prefix, the replayed
    generation paths' logits there, the ladder on the prefix, and the row explained."""
    b, a, c_tok = row.row, row.reference_token, row.candidate_token
    progress(f"row {b}: both sides on the common prefix ({prefix.shape[1]} tokens)")
    r, c = _last_logits(ref.at_policy, prefix), _last_logits(cand.at_policy, prefix)
    row.reference_margin, row.candidate_margin = _margin(r), _margin(c)
    row.logit_difference = _diff(r, c, a, c_tok)
    row.capture_top1 = [int(r.argmax()), int(c.argmax())]
    gr_, gc_ = replayed
    if gr_ is not None and gc_ is not None:
        row.generation = {"reference_margin": _margin(gr_[b]), "candidate_margin": _margin(gc_[b]),
                          "logit_difference": _diff(gr_[b], gc_[b], a, c_tok),
                          "reference_vs_recompute": _diff(gr_[b], r, a, c_tok),
                          "candidate_vs_recompute": _diff(gc_[b], c, a, c_tok)}
    progress(f"row {b}: the ladder on the common prefix")
    ladder = run_ladder(ref, cand, prefix, np.ones_like(prefix), policy, teacher_forcing=True,
                        progress=lambda msg: progress(f"row {b}, ladder: {msg}"), stream=stream)
    if ladder.verdict in ("exact", "drift") and row.reference_margin > 2 * row.logit_difference and row.generation:
        progress(f"row {b}: the recomputes cannot split; the generation paths against the fp64 oracle")
        _oracle_ratios(row, ref, prefix, r, gr_[b], gc_[b], policy, hidden)
    explain_split(row, ladder, policy)
    return ladder


def run_greedy(ref: Side, cand: Side, ids, mask, policy: Policy, new_tokens: int = 32,
               progress=lambda msg: None, generations=None, stream: bool | None = None) -> GreedyReport:
    """compare_greedy on two prepared Sides and a prompt batch (ids, mask) [B, T].
    generations: (reference's, candidate's) new ids [B, N], already generated greedily by
    these sides at this policy from these prompts (the demo has them), instead of generating
    again; each side's replay still checks that its generation path gives them. stream: the
    ladders on the common prefixes, as run_ladder takes it."""
    ref.needs_twin("reference", "greedy divergence (the oracle's margin at the parting step)")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, (int, np.integer)) or new_tokens < 1:
        raise InputError(f"new_tokens={new_tokens!r} must be an integer >= 1")
    for side in (ref, cand):
        _check_generate(side)
    ids, mask = left_align(np.asarray(ids, np.int64), np.asarray(mask, np.int64))
    cfg = getattr(ref.at_policy, "cfg", None) or getattr(cand.at_policy, "cfg", None)
    if generations is None:
        progress(f"reference {ref.name} at {policy.name}: greedy, {new_tokens} new tokens")
        gr = _generate(ref, ids, mask, new_tokens)
        progress(f"candidate {cand.name} at {policy.name}: greedy, {new_tokens} new tokens")
        gc = _generate(cand, ids, mask, new_tokens)
    else:
        gr, gc = (np.asarray(g, np.int64).reshape(len(ids), -1) for g in generations)
        if gr.shape[1] > new_tokens or gc.shape[1] > new_tokens:
            raise InputError(f"generations of {gr.shape[1]} and {gc.shape[1]} tokens: more than "
                             f"new_tokens={new_tokens}")
    rows, parting = _parting_rows(gr, gc, mask, tuple(getattr(cfg, "eos_token_ids", ()) or ()))
    replays = {}
    if parting:
        for name, side, toks in (("reference", ref, gr), ("candidate", cand, gc)):
            progress(f"{name} {side.name}: replaying the generation path to the split")
            replays[name] = _replay(side.at_policy, ids, mask, toks, new_tokens, parting)
    ladders = {}
    for b, s in parting.items():
        prefix = np.concatenate([ids[b][mask[b].astype(bool)], np.asarray(rows[b].reference_tokens[:s], np.int64)])
        ladders[b] = _split(rows[b], ref, cand, prefix[None], (replays.get("reference"), replays.get("candidate")),
                            policy, getattr(cfg, "hidden_size", None), progress, stream)
    verdict = max((r.kind for r in rows), key=GREEDY_KINDS.index)
    uses_jax = any(getattr(side.at_policy, "package", None) == "jaxmodel" for side in (ref, cand))
    return GreedyReport(ref.name, cand.name, policy.to_dict(), int(new_tokens), verdict, rows,
                        environment(policy, uses_jax, sides_of(ref, cand)), ladders)


def compare_greedy(reference="torchref", candidate="jaxmodel", checkpoint=None, inputs=None, new_tokens: int = 32,
                   policy="fp32", progress=lambda msg: None) -> GreedyReport:
    """Greedy generations of both sides from the same prompts; where they part, the step,
    both tokens, the margins, and the ladder's cause on the common prefix (module
    docstring). reference / candidate / inputs: as compare_models takes them."""
    ref, cand, ids, mask, policy = prepare(reference, candidate, checkpoint, inputs, policy, progress)
    return run_greedy(ref, cand, ids, mask, policy, new_tokens, progress)
