"""The decode path: prefill a prompt, then N steps through each side's own KV cache, every
step's taps judged against the oracle's full recompute (docs/method.md, "The decode path").

Ports break most often in the KV cache: the write slot, the positions of cached keys, the
mask over the cache. compare_models judges one prefill, where no cache is read. Here:

    report = compare_decode("torchref", "jaxmodel", folder, steps=32)
    print(report.summary())      # the first step that diverges, and where

The token sequence is fixed in advance (teacher forcing of tokens): the reference's own
greedy continuation at the working policy (or `tokens=` given), so both sides decode the
same tokens and step s of one side is comparable with step s of the other. Step s
(1..N) feeds token x_s at cache slot T + s - 1 (T: the left-padded prompt's width) and
captures the taps of that one new position.

The four runs of the ladder, per step s and position p = T + s - 1:

    ref     the reference decoding at P through its cache           (decode_capture)
    cand    the candidate decoding at P through its cache
    oracle  the reference at fp64, the FULL sequence prompt + x_1..x_N, no cache, one
            capture: its column p is what step s must produce
    cand64  the candidate at fp64 decoding through ITS OWN cache

and verdicts.classify judges every tap of the step exactly as the ladder judges a prefill
tap. The rule that makes a cache bug visible is the choice of cand64: the candidate's
float64 twin decodes through its own cache, and the semantic rung compares that with the
oracle's full recompute. Without a cache bug the two compute the same function (attention
over the same keys, at the same positions, under the same mask; only the order of the
sums differs), so they agree to fp64 rounding (<= ~1e-15 relative, measured: FP64_FLOOR
is 1e-12), or to the f32 steps a transformers float64 model keeps (F32_STEPS_FLOOR); a
wrong slot, a stale mask or a wrong key position changes the function and survives fp64.
This holds for any cache bug whatever its size, and is the same rung with the same
thresholds as the prefill ladder: nothing here is tuned to the planted bugs. A cache that
loses precision at P only (keys stored in bf16 under fp32) is found by the precision rung
as any other lower-precision step: err(cand) vs err(ref), both against the oracle.

A step's findings after its first are judged again on teacher-forced decode runs, as the
prefill ladder's (_inherit_steps): a tap that adds nothing of its own is "inherited".
A step's verdict is its worst tap, its first divergence the earliest tap of that kind (in
execution order); the report's verdict is the worst step's, and `first_step` the earliest
step of that kind. For a semantic step the report says which path is wrong, with the
candidate's float64 FULL recompute (one more capture, made only then): when the decode
path differs from the candidate's own full recompute, the bug is in the decode path (the
KV cache, decode positions, the mask over the cache); when the full recompute differs
from the oracle as much, it is in the model's math and compare_models localises it on
the prompt.

What a step cannot show: taps of one position have no position trend, and the attention
conventions check (conventions.explain_attention) needs every query of a sequence, so it
is not run on decode steps. Bugs that only the prefill's own logits show (the prefill
writes the cache; its taps are not judged here) appear at step 1, where the cache is read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import time

import numpy as np

from llamaspec import InputError, LlamaConfig, Policy
from llamaspec import taps as tapnames
from llamaspec.inputs import left_align

from ..adapters import Checked, OurModel, PortError, Side, config_differences, inject_support
from ..environment import environment, sides_of
from ..evidence import ONSET, POOLED_DRIFT, POOLED_NO_STRUCTURE, DecodePath, Pooled
from ..explain import ladder as explain
from ..judge.verdicts import Divergence, TapVerdict, classify, context_for, first_divergence, precision_ratio
from ..metrics import pair_metrics, rel_l2
from ..results import NONE, RETURNED, TAP, Coverage, JsonResult, coverage, inputs_record
from ..vocabulary import F32_STEPS_FLOOR, FP64_FLOOR, KINDS, TAP_KINDS, drift_factor, precision_floor
from .engine import prepare
from .teacher import inherit, suspects
from .twins import TwinCheck, check_side


@dataclasses.dataclass
class StepVerdict:
    step: int                 # 1..N
    slot: int                 # the cache slot written (= the column of the full sequence)
    tokens: list              # the token fed at this step, per row
    verdict: str
    first_divergence: Divergence | None
    kinds: dict               # verdict -> number of taps
    max_precision_ratio: float
    # cand at P vs ref at P on this step's logits: same top-1 in every row, rel L2
    top1_agree: bool = True
    logits_rel_l2: float = float("nan")
    # semantic steps: rel L2 of the candidate's fp64 decode vs its own fp64 full recompute
    # (the decode path alone) and of that full recompute vs the oracle (the math), at the
    # first divergent tap
    own_recompute: float | None = None
    full_vs_oracle: float | None = None


@dataclasses.dataclass
class DecodeReport(JsonResult):
    reference: str
    candidate: str
    policy: dict
    steps: int
    prompt_tokens: int        # T, the prompt's width (left-padded)
    tokens: list              # [B, N]: the decoded tokens (both sides fed the same)
    token_source: str         # "reference greedy at P" | "given"
    verdict: str
    first_step: int | None    # the earliest step with the worst verdict (precision / semantic)
    first_divergence: Divergence | None
    per_step: list[StepVerdict]
    taps_step: int            # the step whose every tap verdict is in `taps`
    taps: list[TapVerdict]
    timing: dict = dataclasses.field(default_factory=dict)
    environment: dict = dataclasses.field(default_factory=dict)
    config_differences: list = dataclasses.field(default_factory=list)
    oracle: str = "reference at fp64, full recompute without a cache"   # or oracle_kind's other answer
    teacher_forcing: str = "not needed"     # "run" | "not needed" | "not run: <why>" (_inherit_steps)
    # the candidate's float64 twin as checked before its decode was trusted as the semantic rung
    # (twins.check_twin, on the decoded steps' taps); None for a twin this project builds
    twin: TwinCheck | None = None
    # the left-aligned prompt's shape and digest (results.inputs_record): what `repro` checks the prompt by
    inputs: dict = dataclasses.field(default_factory=dict)
    # what was judged (compare.results.Coverage): the reference's taps the candidate does not return,
    # and how each side's logits were judged (a candidate without a "logits" tap: its steps' logits)
    coverage: Coverage | None = None

    def summary(self) -> str:
        return explain.decode_summary(self, FULL_RECOMPUTE)


FULL_RECOMPUTE = "reference at fp64, full recompute without a cache"


def oracle_kind(ref: Side, length: int) -> str:
    """What each decode step is judged against. A full recompute without a cache, except
    for dynamic NTK RoPE past the trained length: there the frequencies depend on the
    length of the call (transformers' dynamic_rope_update, which torchref and jaxmodel
    follow), so a full recompute rotates every key with the final length's base while a
    cache keeps each key as rotated when it was written. The two disagree at every step
    in a correct model (docs/method.md, "The decode path"), and the reference's own fp64 decode through its
    cache is then the oracle: the candidate is judged on following the reference's cache
    semantics, and the cache-or-math split (its own full recompute) is not made."""
    cfg = getattr(ref.at_fp64, "cfg", None)
    rope = getattr(cfg, "rope", None)
    trained = getattr(cfg, "max_position_embeddings", None)
    if getattr(rope, "type", None) == "dynamic" and trained is not None and length > trained:
        return (f"reference at fp64 decoding through its own cache (dynamic RoPE past the trained length "
                f"{trained}: a full recompute would rotate cached keys with the final length's frequencies)")
    return FULL_RECOMPUTE


# ----- one side's decode run ----------------------------------------------------------------

def _stepper(impl, taps, inject=None):
    """(s, cache, next_ids) -> (logits [B, V], cache, {tap: [B, 1, ...]}) for one side's step s;
    inject {layer: [B, N, hidden]}: teacher forcing, column s at step s."""
    if not callable(getattr(impl, "decode_capture", None)):
        raise TypeError(f"{impl.name}: the decode comparison needs prefill(ids, mask, total_len) and "
                        "decode_capture(cache, next_ids, taps) -> (logits, cache, {tap: [B, 1, ...]})")
    if inject is None:
        return lambda s, cache, ids: impl.decode_capture(cache, ids, taps)
    return lambda s, cache, ids: impl.decode_capture(cache, ids, taps,
                                                     inject={i: h[:, s:s + 1] for i, h in inject.items()})


@dataclasses.dataclass
class Forcing:
    """Teacher forcing of a decode run: every layer's input replaced by the oracle's, in the
    prefill (prompt [B, T, hidden] per layer) and at each step (steps [B, N, hidden]), so the
    cache holds the keys and values of the oracle's inputs too."""
    prompt: dict
    steps: dict

    def rows(self, b: int, cols) -> "Forcing":
        return Forcing({i: h[b:b + 1, cols] for i, h in self.prompt.items()},
                        {i: h[b:b + 1] for i, h in self.steps.items()})


def decode_run(impl, ids, mask, taps, tokens=None, steps=None, slack=0, prefilled=None,
                forcing: Forcing | None = None):
    """Prefill, then one decode step per token: ({tap: [B, N, ...]}, tokens [B, N]).

    tokens None: greedy (argmax of each step's logits, ties to the lowest id as
    llamaspec.generate), `steps` of them. prefilled: a future of impl.prefill's result
    (_prefill_ahead). forcing: teacher forcing (the prefill and every step). A side whose
    float64 copy captures padded batches row by row (TransformersModel.unpadded_rows:
    transformers' eager float64 attention and left padding, EAGER_F64_LEFT_PADDING)
    decodes row by row too."""
    if getattr(impl, "unpadded_rows", False) and not np.asarray(mask).all():
        rows = []
        for b in range(len(ids)):
            cols = np.flatnonzero(mask[b])
            rows.append(decode_run(impl, ids[b:b + 1, cols], mask[b:b + 1, cols], taps,
                                    None if tokens is None else tokens[b:b + 1], steps, slack,
                                    forcing=None if forcing is None else forcing.rows(b, cols)))
        return ({t: np.concatenate([r[0][t] for r in rows]) for t in taps},
                np.concatenate([r[1] for r in rows]))
    n = steps if tokens is None else tokens.shape[1]
    # a side without a "logits" tap: the logits each step returns stand for it (as the ladder
    # judges a port's returned logits on the prefill)
    returned = "logits" in taps and "logits" not in getattr(impl, "taps", ("logits",))
    step = _stepper(impl, [t for t in taps if not (returned and t == "logits")],
                    None if forcing is None else forcing.steps)
    total = ids.shape[1] + n + slack
    if prefilled is not None:
        logits, cache = prefilled.result()
    elif forcing is not None:
        logits, cache = impl.prefill(ids, mask, total, inject=forcing.prompt)
    else:
        logits, cache = impl.prefill(ids, mask, total)
    out, fed = {t: [] for t in taps}, []
    for s in range(n):
        nxt = np.asarray(logits, np.float64).argmax(-1) if tokens is None else tokens[:, s]
        fed.append(nxt)
        logits, cache, acts = step(s, cache, nxt)
        if returned:
            if logits is None:
                raise PortError(f"{getattr(impl, 'name', type(impl).__name__)}: its decode_capture returned no "
                                "logits and it has no 'logits' tap, so its decode steps' logits cannot be judged")
            acts = {**acts, "logits": np.asarray(logits)[:, None]}
        for t in taps:
            out[t].append(np.asarray(acts[t]))
    return {t: np.concatenate(v, axis=1) for t, v in out.items()}, np.stack(fed, 1).astype(np.int64)


def _prefill_ahead(pool, impl, ids, mask, taps, total_len):
    """A jaxmodel side compiles two programs (prefill with the cache, the decode step with
    its taps: most of a comparison's time). They are compiled in
    `pool` while the reference decodes: prefill runs (its result is the one the side's
    decode run continues from) and one decode step runs on a copy of the cache, with the
    prompt's last tokens, so that the compiled step is ready. None for other sides."""
    if not (isinstance(impl, OurModel) and impl.package == "jaxmodel"):
        return None

    def run():
        import jax
        import jax.numpy as jnp
        logits, cache = impl.prefill(ids, mask, total_len)
        impl.model.decode_capture(jax.tree.map(jnp.copy, cache), ids[:, -1], taps)
        return logits, cache
    return pool.submit(run)


# ----- the comparison: run, judge, report -----------------------------------------------------

@dataclasses.dataclass
class _Runs:
    """The four decode runs of one comparison, [B, N, ...] per tap (the oracle's: all taps)."""
    r: dict
    c: dict
    c64: dict
    o: dict
    fed: np.ndarray             # [B, N] the tokens both sides were fed
    source: str                 # where the tokens came from
    oracle: str                 # FULL_RECOMPUTE or oracle_kind's other answer
    full_ids: np.ndarray        # prompt + fed tokens, and its mask
    full_mask: np.ndarray
    o_prompt: dict | None = None  # the oracle's prompt columns (embed, layers.*.out) when it has them


def _check_decode_inputs(ref: Side, cand: Side, ids, mask, steps: int, tokens):
    """(ids, mask) left-aligned, tokens [B, N] or None, and the number of steps; refuses what
    the oracle cannot judge."""
    ref.needs_twin("reference", "the decode comparison (its float64 recompute is the oracle)")
    cand.needs_twin("candidate", "the decode comparison (its float64 decode is the semantic rung)")
    ids, mask = left_align(np.asarray(ids, np.int64), np.asarray(mask, np.int64))
    if tokens is not None:
        tokens = np.asarray(tokens, np.int64).reshape(len(ids), -1)
        steps = tokens.shape[1]
    if steps < 1:
        raise InputError(f"steps={steps} must be >= 1")
    lengths = np.asarray(mask).sum(1)
    if oracle_kind(ref, int(lengths.max()) + steps) != FULL_RECOMPUTE and len(set(lengths.tolist())) > 1:
        by_rows = [s.name for s in (ref, cand) if getattr(s.at_fp64, "unpadded_rows", False)]
        if by_rows:
            raise InputError(
                f"dynamic RoPE past the trained length with rows of different lengths ({sorted(set(lengths.tolist()))}"
                f" real tokens): the float64 copy of {', '.join(by_rows)} decodes padded rows one at a time "
                "(transformers' eager float64 attention and left padding: EAGER_F64_LEFT_PADDING), and dynamic "
                "RoPE's frequencies follow the longest row of the call, so its semantic rung would run other "
                "frequencies than the batch. Decode rows of one length, or one row per call.")
    return ids, mask, steps, tokens


def _run_sides(ref: Side, cand: Side, ids, mask, taps, policy: Policy, steps: int, tokens, slack: int,
               progress, lap) -> _Runs:
    """Reference, candidate and candidate at fp64 through their caches on the same tokens, then
    the oracle (module docstring)."""
    T = ids.shape[1]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ahead = {id(impl): _prefill_ahead(pool, impl, ids, mask, taps, T + steps + slack)
                 for impl in (cand.at_policy, cand.at_fp64)}
        progress(f"reference {ref.name} at {policy.name}: prefill + {steps} decode steps")
        r, fed = decode_run(ref.at_policy, ids, mask, taps, tokens, steps, slack)
        lap("reference")
        progress(f"candidate {cand.name} at {policy.name}: the same tokens through its cache")
        c, _ = decode_run(cand.at_policy, ids, mask, taps, fed, slack=slack, prefilled=ahead[id(cand.at_policy)])
        lap("candidate")
        progress(f"candidate {cand.name} at fp64: the same tokens through its cache (semantic rung)")
        c64, _ = decode_run(cand.at_fp64, ids, mask, taps, fed, slack=slack, prefilled=ahead[id(cand.at_fp64)])
        lap("candidate_fp64")
    full_ids = np.concatenate([ids, fed], 1)
    full_mask = np.concatenate([mask, np.ones_like(fed)], 1)
    oracle = oracle_kind(ref, int(full_mask.sum(1).max()))
    if oracle == FULL_RECOMPUTE:
        progress("oracle: reference at fp64 on the full sequence, no cache")
        _, full = ref.at_fp64.capture(full_ids, full_mask, ref.taps)    # all of them: context for the hints
        o = {t: np.asarray(x)[:, T:] for t, x in full.items()}          # column T + s - 1 is step s
        o_prompt = {t: np.asarray(x)[:, :T] for t, x in full.items() if tapnames.is_layer_input(t)}
    else:
        progress(f"oracle: {oracle}")
        o, _ = decode_run(ref.at_fp64, ids, mask, ref.taps, fed, slack=slack)
        o_prompt = None
    lap("oracle")
    source = "reference greedy at P" if tokens is None else "given"
    return _Runs(r, c, c64, o, fed, source, oracle, full_ids, full_mask, o_prompt)



class _StepJudge:
    """classify on each step's one position, with evidence pooled over the steps where one
    position is too few (module docstring; _pool says which rung pools what)."""

    def __init__(self, runs: _Runs, taps, policy: Policy, keeps_f32: bool, own_full, cfg=None):
        self.runs, self.taps, self.policy, self.keeps_f32 = runs, taps, policy, keeps_f32
        self.cfg = cfg if isinstance(cfg, LlamaConfig) else None    # the family's steps, for context_for
        self.hidden = np.shape(runs.o["embed"])[-1] if "embed" in runs.o else None
        self.floor64 = F32_STEPS_FLOOR if keeps_f32 else FP64_FLOOR
        self.steps = runs.fed.shape[1]
        self.agreed = {}    # tap -> the first step where cand64's decode agreed with the oracle to fp64 rounding
        self.own_full = own_full    # () -> the candidate's fp64 full recompute, captured on first use

    def taps_of(self, s: int) -> list[TapVerdict]:
        """Step s + 1: every tap judged in execution order (steps in order: _pool reads the
        earlier ones)."""
        at, runs = slice(s, s + 1), self.runs
        rs, cs, c64s = ({t: x[t][:, at] for t in self.taps} for x in (runs.r, runs.c, runs.c64))
        os_ = {t: x[:, at] for t, x in runs.o.items()}
        real = np.ones((len(runs.fed), 1), bool)
        verdicts, noise_from = [], None
        for t in self.taps:
            ctx = context_for(t, c64s, os_, cfg=self.cfg)
            ctx.pop("qkv", None)    # explain_attention needs every query of a sequence
            v = classify(t, rs[t], cs[t], os_[t], c64s[t], real, self.policy, self.keeps_f32, ctx, self.hidden,
                         noise_from)
            v = self._pool(v, s + 1)
            if v.noise_dtype and v.kind == "precision" and noise_from is None:
                noise_from = v
            if v.err_fp64 <= self.floor64:
                self.agreed.setdefault(t, s + 1)
            verdicts.append(v)
        return verdicts

    def step(self, s: int, verdicts: list[TapVerdict]) -> StepVerdict:
        """Step s + 1's verdict from its judged taps (inherited ones relabelled already)."""
        at, runs = slice(s, s + 1), self.runs
        worst, div = first_divergence(verdicts)
        rated = [v.precision_ratio for v in verdicts if not math.isnan(v.precision_ratio)]
        st = StepVerdict(s + 1, runs.full_ids.shape[1] - self.steps + s, runs.fed[:, s].tolist(), worst, div,
                         {k: n for k in TAP_KINDS if (n := sum(v.kind == k for v in verdicts))},
                         max(rated, default=float("nan")))
        if "logits" in self.taps:
            rl, cl = runs.r["logits"][:, at], runs.c["logits"][:, at]
            st.top1_agree = bool((rl[:, 0].argmax(-1) == cl[:, 0].argmax(-1)).all())
            st.logits_rel_l2 = rel_l2(np.asarray(cl, np.float64), np.asarray(rl, np.float64))
        if div is not None and div.kind == "semantic" and runs.oracle == FULL_RECOMPUTE:
            _which_path(st, div, runs.c64[div.tap][:, at], self.own_full()[div.tap][:, at], runs.o[div.tap][:, at],
                        self.keeps_f32)
        return st

    def _pool(self, v: TapVerdict, step: int) -> TapVerdict:
        """One step's record, checked against the steps pooled where one position is too few:
        - dtype noise at a tap that agreed with the oracle at an earlier step is no rounding:
          every step runs the same code, so a step that rounds to a narrower dtype rounds from
          step 1 on; an fp64 difference that starts later is a change in the math (a cache
          that wraps, a mask that goes stale past some slot). One position per step is also
          too few values for the noise test to tell a small unstructured bug from rounding;
        - a precision ratio over the bound stands when the tap also loses precision over all
          steps (or a quarter of them): one position's ratio scatters far more than a
          prefill tap's over hundreds (docs/method.md, "The decode path");
        - a semantic verdict that rests on structure alone (fp64 difference below the floor)
          stands when the structure is also there over all steps: on one position a per-row
          pattern is a global one."""
        ev = v.record
        if v.kind == "precision" and v.noise_dtype and v.tap in self.agreed:
            return v.judged(dataclasses.replace(ev, kind="semantic", reason=ONSET, noise=None, step=step,
                                                agreed_step=self.agreed[v.tap], looks_like=v.noise_dtype))
        if v.kind == "precision" and not math.isnan(v.precision_ratio):
            pooled = self._pooled_ratio(v.tap)
            if pooled.ratio <= 1:
                return v.judged(dataclasses.replace(ev, kind="drift", reason=POOLED_DRIFT, pooled=pooled))
        if v.kind == "semantic" and v.err_fp64 <= self.floor64:
            kind = self._pooled_kind(v.tap)
            if kind != "semantic":
                return v.judged(dataclasses.replace(ev, kind="drift", reason=POOLED_NO_STRUCTURE,
                                                    pooled=Pooled(self.steps, kind=kind)))
        return v

    @functools.cache
    def _pooled_ratio(self, t: str) -> Pooled:
        """The precision rung over every step at once (one row per step and batch row;
        quarters of the steps when there are >= 16)."""
        B, n = self.runs.fed.shape
        pos = np.broadcast_to(np.arange(1, n + 1), (B, n)).ravel()
        rows = [np.asarray(x[t], np.float64).reshape(B * n, -1) for x in (self.runs.r, self.runs.c, self.runs.o)]
        ratio, where = precision_ratio(*rows, pos, precision_floor(self.policy, self.hidden),
                                       drift_factor(self.policy))
        return Pooled(n, ratio, where.as_steps())

    @functools.cache
    def _pooled_kind(self, t: str) -> str:
        """classify's kind over every step at once (N positions per batch row)."""
        runs = self.runs
        ctx = context_for(t, runs.c64, runs.o, cfg=self.cfg)
        ctx.pop("qkv", None)
        return classify(t, runs.r[t], runs.c[t], runs.o[t], runs.c64[t], np.ones(runs.fed.shape, bool), self.policy,
                        self.keeps_f32, ctx, self.hidden).kind


def run_decode(ref: Side, cand: Side, ids, mask, policy: Policy, steps: int = 32, tokens=None,
               progress=lambda msg: None, slack: int = 0) -> DecodeReport:
    """compare_decode on two prepared Sides and a left-aligned prompt (ids, mask) [B, T]:
    run the four decodes, judge every step, report."""
    ids, mask, steps, tokens = _check_decode_inputs(ref, cand, ids, mask, steps, tokens)
    # the taps both return, and the logits where the reference has the tap: a candidate without it
    # is judged on the logits its decode steps return (decode_run)
    taps = tuple(t for t in ref.taps if t in set(cand.taps) or t == "logits")
    timing, clock = {}, [time.perf_counter()]

    def lap(name):
        now = time.perf_counter()
        timing[name], clock[0] = round(now - clock[0], 3), now

    runs = _run_sides(ref, cand, ids, mask, taps, policy, steps, tokens, slack, progress, lap)
    twin, cand = _checked_twin(cand, runs, taps, policy, progress)

    @functools.cache
    def own_full():
        progress(f"candidate {cand.name} at fp64 on the full sequence (is it the cache or the math?)")
        theirs = set(cand.taps)
        lg, x = cand.at_fp64.capture(runs.full_ids, runs.full_mask, [t for t in taps if t in theirs])
        if "logits" in taps and "logits" not in x and lg is not None:
            x = {**x, "logits": lg}
        lap("candidate_fp64_full")
        return {t: np.asarray(a)[:, ids.shape[1]:] for t, a in x.items()}

    keeps_f32 = ref.keeps_f32 or cand.keeps_f32
    judge = _StepJudge(runs, taps, policy, keeps_f32, own_full, getattr(ref.at_fp64, "cfg", None))
    verdicts = [judge.taps_of(s) for s in range(steps)]
    forcing = _inherit_steps(ref, cand, ids, mask, runs, taps, verdicts, policy, keeps_f32, slack, progress)
    if forcing == "run":
        lap("teacher_forcing")
    judged = [(judge.step(s, v), v) for s, v in enumerate(verdicts)]
    report = _decode_report(ref, cand, policy, runs, ids.shape[1], judged, timing)
    report.teacher_forcing, report.twin, report.inputs = forcing, twin, inputs_record(ids, mask)
    report.coverage = coverage(ref.name, cand.name, ref.taps, cand.taps, taps,
                               {role: TAP if "logits" in side.taps else RETURNED if "logits" in taps else NONE
                                for role, side in (("reference", ref), ("candidate", cand))})
    report.coverage.note = explain.coverage_line(report.coverage)
    return report


def _checked_twin(cand: Side, runs: _Runs, taps, policy: Policy, progress) -> tuple[TwinCheck | None, Side]:
    """A user's port's float64 decode read before it is trusted as the semantic rung, as the
    prefill ladder reads its twin (twins.check_twin: its weights, its arithmetic), on the decoded
    steps' taps: keeps_f32 inferred where it keeps float32 steps; refused (a PortError: the
    decode comparison has no rung without it) where its weights are the policy's rounding or no
    tap is float64. (None, cand) for a twin this project builds."""
    if not isinstance(cand.at_fp64, Checked):
        return None, cand
    twin, checked = check_side(cand, runs.c64, runs.o, taps, np.ones(runs.fed.shape, bool), policy.param_dtype,
                               progress)
    if twin.refused:
        raise PortError(f"the decode comparison judges each step against the candidate's float64 decode, and "
                        f"{twin.note}")
    return twin, checked


def _inherit_steps(ref: Side, cand: Side, ids, mask, runs: _Runs, taps, verdicts: list[list[TapVerdict]],
                   policy: Policy, keeps_f32: bool, slack: int, progress) -> str:
    """Teacher forcing's word on each step's findings after its first (teacher.inherit, as the
    prefill ladder): each side decodes again with every layer fed the oracle's input, in the
    prefill and at every step, so that its cache too holds what the oracle's inputs give; a
    later finding whose forced run is within drift, judged by the same rungs (_StepJudge on
    the forced runs), adds nothing of its own and is "inherited". Runs up to the last step
    with such findings only. DecodeReport.teacher_forcing: "run", "not needed" (no finding
    after a first one at any step), or "not run: <why>"."""
    for v in verdicts:          # in the first finding's own layer: inherited without forcing
        inherit(v, {})
    wanted = [s for s, v in enumerate(verdicts) if suspects(v)]
    if not wanted:
        return "not needed"
    impls = (ref.at_policy, cand.at_policy, cand.at_fp64)
    no_inject = [why for why in dict.fromkeys(inject_support(i, ("prefill", "decode_capture")) for i in impls) if why]
    if no_inject:
        return f"not run: {'; '.join(no_inject)} (teacher forcing needs it)"
    n_layers = sum(1 for t in runs.o if t.startswith("layers.") and t.endswith(".out"))
    if not n_layers or any(tapnames.input_tap(i) not in runs.o for i in range(n_layers)):
        return "not run: the oracle has no embed or layer outputs to feed the layers"
    o_prompt = runs.o_prompt
    if o_prompt is None:    # the oracle decoded through its cache: its prompt columns as the prefill computed them
        _, o_prompt = ref.at_fp64.capture(ids, mask, [tapnames.input_tap(i) for i in range(n_layers)])
    n = wanted[-1] + 1
    forcing = Forcing(tapnames.layer_inputs(o_prompt, n_layers), tapnames.layer_inputs(runs.o, n_layers, slice(0, n)))
    progress(f"teacher forcing: every layer fed the oracle's input for {n} decode step(s), each side "
             "(are the later findings the first one's, inherited?)")
    fed = runs.fed[:, :n]
    try:
        forced = [decode_run(impl, ids, mask, taps, fed, slack=slack + runs.fed.shape[1] - n, forcing=forcing)[0]
                  for impl in impls]
    except NotImplementedError as e:
        return f"not run: {e} (teacher forcing needs it)"
    o = {t: x[:, :n] for t, x in runs.o.items()}
    fjudge = _StepJudge(dataclasses.replace(runs, r=forced[0], c=forced[1], c64=forced[2], o=o, fed=fed),
                        taps, policy, keeps_f32, own_full=None, cfg=getattr(ref.at_fp64, "cfg", None))
    for s in range(n):
        local = fjudge.taps_of(s)
        if s in wanted:
            inherit(verdicts[s], {v.tap: v for v in local})
    return "run"


def _decode_report(ref: Side, cand: Side, policy: Policy, runs: _Runs, T: int, judged, timing) -> DecodeReport:
    """The worst step, its first divergence, and every tap of the step the report lists (the
    first divergent one, or for a clean run the step nearest the precision bound)."""
    per_step = [st for st, _ in judged]
    worst = max((st.verdict for st in per_step), key=KINDS.index)
    first = next((st for st in per_step if st.verdict == worst), None) if worst in ("precision", "semantic") else None
    listed = first.step if first is not None else max(
        per_step, key=lambda st: -1 if math.isnan(st.max_precision_ratio) else st.max_precision_ratio).step
    listed_taps = judged[listed - 1][1]
    B, at = len(runs.fed), slice(listed - 1, listed)
    for v in listed_taps:
        v.metrics = pair_metrics(runs.c[v.tap][:, at].reshape(B, -1), runs.r[v.tap][:, at].reshape(B, -1),
                                 tapnames.dtype_of(v.tap, policy))
    uses_jax = any(getattr(side.at_policy, "package", None) == "jaxmodel" for side in (ref, cand))
    return DecodeReport(ref.name, cand.name, policy.to_dict(), len(per_step), T, runs.fed.tolist(), runs.source,
                        worst, None if first is None else first.step,
                        None if first is None else first.first_divergence, per_step, listed, listed_taps, timing,
                        environment(policy, uses_jax, sides_of(ref, cand)),
                        config_differences(ref.at_policy, cand.at_policy), runs.oracle)


def _which_path(st: StepVerdict, div: Divergence, dec, own, orc, keeps_f32) -> None:
    """Records in the divergence whether the decode path or the model's math is wrong: the
    candidate's fp64 decode (dec) vs its own fp64 full recompute (own), and own vs the oracle."""
    dec, own, orc = (np.asarray(x, np.float64) for x in (dec, own, orc))
    st.own_recompute, st.full_vs_oracle = rel_l2(dec, own), rel_l2(own, orc)
    floor = F32_STEPS_FLOOR if keeps_f32 else FP64_FLOOR
    wrong = st.own_recompute > floor and st.own_recompute >= st.full_vs_oracle
    div.path = DecodePath(st.own_recompute, st.full_vs_oracle, wrong,
                          tapnames.tap(div.tap).kind in ("k", "k_rope", "q_rope", "q"))
    div.explain()


def compare_decode(reference="torchref", candidate="jaxmodel", checkpoint=None, inputs=None, steps: int = 32,
                   policy="fp32", tokens=None, progress=lambda msg: None) -> DecodeReport:
    """Decodes `steps` tokens after the prompt through each side's own KV cache and judges
    every step's taps against the oracle's full recompute (module docstring).

    reference / candidate: as compare_models takes them ("torchref", "jaxmodel", a
    transformers LlamaForCausalLM, or a Side). inputs: as compare_models (None: the
    built-in 258-token prompt); rows are left-aligned for the cache. tokens [B, N]: the
    tokens to feed (default: the reference's greedy continuation at the policy)."""
    ref, cand, ids, mask, policy = prepare(reference, candidate, checkpoint, inputs, policy, progress)
    ids, mask = left_align(np.asarray(ids, np.int64), np.asarray(mask, np.int64))
    return run_decode(ref, cand, ids, mask, policy, steps, tokens, progress)
