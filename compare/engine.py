"""The oracle ladder (docs/method.md): one verdict per tap.

Four captures of the same inputs, all numpy:
    ref  = reference at the working policy P      cand   = candidate at P
    oracle = reference at fp64                    cand64 = candidate at fp64
Per tap, in this order:
    exact      cand is bitwise equal to ref;
    semantic   cand64 differs from oracle beyond fp64 rounding (or the floor of a side
               that keeps f32 steps inside its fp64 run), or the difference is
               structured (structure.analyse, RoPE pairs, attention conventions): a
               difference in the math, with a hint that names the structure;
    precision  err(cand) > M * err(ref) + floor at P, errors measured against the
               oracle, over the whole tap or any quarter of its positions: the
               candidate loses more precision than the reference;
    drift      anything else: rounding, as much as the reference's own.
Teacher forcing (every layer fed the oracle's input) gives each layer's local error and
confirms the first divergence's layer: the first layer that adds it on its own.
compare/controls.py holds the planted bugs and clean runs that calibrate all this.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from pathlib import Path

import numpy as np

from llamaspec import Policy, positions_from_mask
from llamaspec import taps as tapnames

from .conventions import explain_attention
from .environment import environment
from .metrics import logits_agreement, nonfinite, pair_metrics, rel_l2
from .structure import analyse
from .structure import hint as structure_hint
from .vocabulary import (
    F32_STEPS_FLOOR,
    FLOOR_ULPS,
    FP64_FLOOR,
    KINDS,
    QUARTER_POSITIONS,
    STRUCT_F32_FLOOR,
    M,
    drift_factor,
    precision_floor,
)

_F32_STEP_KINDS = ("position_trend", "head_confinement", "half_confinement", "sign_bias")
# Where a precision deviation first shows, the step that most likely lost it.
_PRECISION_STEP = {
    "q_rope": "RoPE tables (angles, cos/sin) computed in lower precision",
    "k_rope": "RoPE tables (angles, cos/sin) computed in lower precision",
    "attn_ctx": "attention (scores, softmax or P@V) computed in lower precision",
    "attn_norm": "RMSNorm (mean of squares, rsqrt) computed in lower precision",
    "mlp_norm": "RMSNorm (mean of squares, rsqrt) computed in lower precision",
    "final_norm": "RMSNorm (mean of squares, rsqrt) computed in lower precision",
    "logits": "lm_head output kept in lower precision",
}
# Where a semantic difference with no simple structure first shows: what sits there.
_COMPONENT_HINT = {
    "embed": "the embedding table or token ids",
    "attn_norm": "the input RMSNorm (epsilon, weight convention, normalisation)",
    "mlp_norm": "the post-attention RMSNorm (epsilon, weight convention, normalisation)",
    "final_norm": "the final RMSNorm",
    "lm_head": "the lm_head matrix: everything before the logits agrees (tied vs untied "
               "embeddings, a transposed or another matrix)",
}


@dataclasses.dataclass
class TapVerdict:
    tap: str
    layer: int | None
    component: str
    kind: str
    err_ref: float      # ref at P vs oracle
    err_cand: float     # cand at P vs oracle
    err_fp64: float     # cand at fp64 vs oracle
    nonfinite: int
    hint: str
    # err(cand) / (M * err(ref) + floor), the worse of the whole tap and its quarters of
    # positions: > 1 is a precision deviation (when fp64 agrees)
    precision_ratio: float = float("nan")
    # candidate vs reference at the policy: max abs, max ULP (compute dtype), cosine,
    # fraction of elements beyond 16 unit roundoffs (metrics.pair_metrics)
    metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Divergence:
    tap: str
    layer: int | None
    component: str
    kind: str
    hint: str
    # Teacher forcing's word on the layer: True when the layer that adds the error on its
    # own (oracle input forced) is this one, False when it is another, None when not run.
    confirmed: bool | None = None
    evidence: str = ""


@dataclasses.dataclass
class Side:
    name: str
    at_policy: object   # anything with capture(tokens, mask, taps, inject=None)
    at_fp64: object
    keeps_f32: bool     # its fp64 run keeps f32 steps (transformers does)
    taps: tuple[str, ...]


def _ours(name: str, checkpoint, policy: Policy) -> Side:
    mod = importlib.import_module(name)
    at_p = mod.from_pretrained(checkpoint, policy=policy)
    at_64 = mod.from_pretrained(checkpoint, policy="fp64")
    return Side(name, at_p, at_64, False, tuple(tapnames.all_taps(at_p.cfg.num_hidden_layers)))


def transformers_side(model, checkpoint=None) -> Side:
    import torch

    from .hf_adapter import HFAdapter, copy_at
    adapter = HFAdapter(model)
    twin = copy_at(model, torch.float64)
    if checkpoint is not None and adapter.dtype in (torch.bfloat16, torch.float16):
        _full_precision_weights(twin, model, checkpoint)
    return Side(adapter.name, adapter, HFAdapter(twin), True, tuple(adapter.available_taps))


def _full_precision_weights(twin, model, checkpoint) -> bool:
    """A bf16/fp16 transformers model loaded from an f32 checkpoint has lost the weights'
    low bits; its fp64 copy would then run other weights than the oracle (torchref at
    fp64 reads the checkpoint) and every tap would look semantic. When every parameter is
    the checkpoint's tensor rounded to the model's dtype, the copy gets the checkpoint's
    values instead; a model whose weights were changed keeps its own (returns False)."""
    import torch

    from llamaspec import load_weights
    _, weights = load_weights(checkpoint, check_finite=False)
    params = dict(model.named_parameters())
    if not set(params) <= set(weights):
        return False
    for name, p in params.items():
        if not torch.equal(torch.from_numpy(np.array(weights[name], np.float32)).to(p.dtype),
                           p.detach().cpu()):
            return False
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(torch.from_numpy(np.array(weights[name], np.float64)))
    return True


def resolve_side(spec, checkpoint, policy: Policy) -> Side:
    """"torchref" | "jaxmodel" | a transformers LlamaForCausalLM instance | a prepared Side
    (e.g. a patched model and its fp64 twin, as the planted-bug controls use)."""
    if isinstance(spec, Side):
        return spec
    if isinstance(spec, str):
        if spec not in ("torchref", "jaxmodel"):
            raise ValueError(f"unknown implementation '{spec}' (torchref, jaxmodel, or a "
                             "transformers LlamaForCausalLM instance)")
        return _ours(spec, checkpoint, policy)
    if type(spec).__name__ == "LlamaForCausalLM":
        return transformers_side(spec, checkpoint)
    raise TypeError(f"cannot compare a {type(spec).__name__}: pass 'torchref', 'jaxmodel' or a "
                    "transformers LlamaForCausalLM")


def _findings(tap, cand64, oracle, mask, keeps_f32, context) -> list:
    """Structure of the fp64-rung difference at one tap (structure.analyse, RoPE pairs with
    the pre-RoPE inputs, attention conventions with the oracle's q/k/v)."""
    kind = tapnames.parse(tap)[1]
    per_head = kind in ("q", "k", "v", "q_rope", "k_rope")
    c64, o = np.asarray(cand64, np.float64), np.asarray(oracle, np.float64)
    found = analyse(c64, o, mask, per_head=per_head, pre=context.get("pre"),
                    norm_input=context.get("norm_input"))
    if kind == "attn_ctx" and context.get("qkv") is not None:
        conv = explain_attention(c64, *context["qkv"], mask)
        found = ([conv] if conv else []) + found
    if keeps_f32:
        found = [f for f in found
                 if f.size > (F32_STEPS_FLOOR if f.kind in _F32_STEP_KINDS else STRUCT_F32_FLOOR)]
    return found


class _RowErrors:
    """Squared norms per row (position) against one yardstick, so that the relative L2
    error of any set of rows is two sums: one pass over each array instead of one per
    subset (a report asks for the whole tap and four quarters of it, for ~450 taps).
    rel(x, rows) equals metrics.rel_l2(x[rows], yardstick[rows]), NaN/Inf included."""

    def __init__(self, yardstick):
        self.o = self._rows(yardstick)
        self.norm = np.einsum("ij,ij->i", self.o, self.o)

    @staticmethod
    def _rows(x) -> np.ndarray:
        x = np.asarray(x, np.float64)
        return x.reshape(len(x), -1)

    def sq(self, x) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            d = self._rows(x) - self.o
            return np.einsum("ij,ij->i", d, d)

    def rel(self, sq, rows=slice(None)) -> float:
        e, n = float(np.sum(sq[rows])), float(np.sum(self.norm[rows]))
        return math.sqrt(e / n) if n else math.sqrt(e)


def precision_ratio(r, c, o, pos, floor, m=M, rows: _RowErrors | None = None
                    ) -> tuple[float, str]:
    """err(c) / (M err(r) + floor) over the whole tap and over each quarter of positions
    (when there are >= QUARTER_POSITIONS): the worst, and where. A step whose rounding
    grows with position (RoPE angles in low precision) hides in a whole-tap average.
    r, c may be given as per-row squared errors with `rows` (the oracle's _RowErrors)."""
    if rows is None:
        rows = _RowErrors(o)
        r, c = rows.sq(r), rows.sq(c)

    def ratio(sel):
        return rows.rel(c, sel) / (m * rows.rel(r, sel) + floor)
    best, where = ratio(slice(None)), "whole tap"
    distinct = np.unique(pos)
    if len(distinct) >= QUARTER_POSITIONS:
        edges = distinct[np.linspace(0, len(distinct), 5).astype(int)[1:-1]]
        quarter = np.searchsorted(edges, pos, side="right")
        for q in range(4):
            x = ratio(quarter == q)
            if x > best:
                lo, hi = pos[quarter == q].min(), pos[quarter == q].max()
                best, where = x, f"positions {lo}-{hi}"
    return best, where


def classify(tap, ref, cand, oracle, cand64, mask, policy: Policy, keeps_f32: bool,
             context=None, hidden: int | None = None) -> TapVerdict:
    """The ladder for one tap; arrays are [B, T, ...], mask [B, T] selects real positions.

    context (optional): {"pre": (cand64_pre, oracle_pre)} at q_rope/k_rope taps (the q/k
    before RoPE), {"qkv": (q_rope, k_rope, v)} of the oracle at attn_ctx: they let the
    structure analysis name RoPE and attention-convention differences."""
    layer, component = tapnames.layer_of(tap), tapnames.component_of(tap)
    r, c, o, c64 = (np.asarray(a)[mask] for a in (ref, cand, oracle, cand64))
    bad = nonfinite(r) + nonfinite(c)
    rows = _RowErrors(o)
    sq_r, sq_c = rows.sq(r), rows.sq(c)
    err_ref, err_cand, err64 = rows.rel(sq_r), rows.rel(sq_c), rows.rel(rows.sq(c64))
    if bad or not all(math.isfinite(e) for e in (err_ref, err_cand, err64)):
        kind = "semantic" if nonfinite(c64) else "precision"
        return TapVerdict(tap, layer, component, kind, err_ref, err_cand, err64, bad,
                          f"NaN/Inf: {nonfinite(r)} in the reference, {nonfinite(c)} in the "
                          f"candidate ({nonfinite(c64)} at fp64)")
    if np.array_equal(r, c):
        return TapVerdict(tap, layer, component, "exact", err_ref, err_cand, err64, 0, "bitwise equal")
    floor64 = F32_STEPS_FLOOR if keeps_f32 else FP64_FLOOR
    gate = STRUCT_F32_FLOOR if keeps_f32 else FP64_FLOOR
    if err64 > gate:
        found = _findings(tap, cand64, oracle, mask, keeps_f32, context or {})
        if err64 > floor64 or found:
            why = structure_hint(found) if found else "no simple structure"
            return TapVerdict(tap, layer, component, "semantic", err_ref, err_cand, err64, 0,
                              f"differs at fp64 (rel L2 {err64:.1e}"
                              + (f" > {floor64:.0e}" if err64 > floor64 else
                                 f", structured above {gate:.0e}")
                              + f"): a difference in the math, not rounding; {why}")
    pos = positions_from_mask(np.asarray(mask))[np.asarray(mask, bool)]
    m = drift_factor(policy)
    ratio, where = precision_ratio(sq_r, sq_c, None, pos, precision_floor(policy, hidden), m, rows)
    if ratio > 1:
        step = _PRECISION_STEP.get(tapnames.parse(tap)[1], "a step computed in lower precision "
                                   "(matmul accumulation, norm, softmax, RoPE tables)")
        times = f"{err_cand / err_ref:.1f}x" if err_ref else "more than"
        return TapVerdict(tap, layer, component, "precision", err_ref, err_cand, err64, 0,
                          f"the candidate loses {times} the reference's precision here "
                          f"({err_cand:.1e} vs {err_ref:.1e}; {ratio:.1f}x the drift bound "
                          f"{m:g}x + {FLOOR_ULPS} ulp over the {where}) while fp64 agrees: {step}",
                          ratio)
    return TapVerdict(tap, layer, component, "drift", err_ref, err_cand, err64, 0,
                      f"rounding: {err_cand:.1e} vs the reference's own {err_ref:.1e} "
                      f"(within {m:g}x + {FLOOR_ULPS} ulp)", ratio)


def _context(tap, c64, o) -> dict:
    layer, kind = tapnames.parse(tap)
    p = f"layers.{layer}."
    norm_in = {"attn_norm": "embed" if not layer else f"layers.{layer - 1}.out",
               "mlp_norm": p + "resid_mid",
               "final_norm": max((t for t in o if t.endswith(".out")), default=None,
                                 key=lambda t: tapnames.layer_of(t))}.get(kind)
    if norm_in in o:
        return {"norm_input": o[norm_in]}
    if kind in ("q_rope", "k_rope") and p + kind[0] in c64 and p + kind[0] in o:
        return {"pre": (c64[p + kind[0]], o[p + kind[0]])}
    if kind == "attn_ctx" and all(p + t in o for t in ("q_rope", "k_rope", "v")):
        return {"qkv": (o[p + "q_rope"], o[p + "k_rope"], o[p + "v"])}
    return {}


class JsonResult:
    """to_dict / to_json for the result dataclasses (Report, probes.ProbeResult)."""

    def to_dict(self) -> dict:
        return _jsonable(dataclasses.asdict(self))

    def to_json(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path


@dataclasses.dataclass
class Report(JsonResult):
    reference: str
    candidate: str
    policy: dict
    verdict: str
    first_divergence: Divergence | None
    taps: list[TapVerdict]
    local: list[dict]       # per layer: local error of each side with oracle inputs forced
    logits: dict = dataclasses.field(default_factory=dict)        # metrics.logits_agreement
    environment: dict = dataclasses.field(default_factory=dict)   # compare.environment

    def to_html(self, path) -> Path:
        from .html import write_html
        return write_html(self, path)

    def summary(self) -> str:
        lines = [f"{self.candidate} vs {self.reference} at {self.policy['name']}: {self.verdict}"]
        if self.first_divergence:
            d = self.first_divergence
            lines.append(f"first {d.kind} at {d.tap} (layer {d.layer}, {d.component}): {d.hint}")
            if d.evidence:
                lines.append(d.evidence)
        return "\n".join(lines)


def _jsonable(x):
    """JSON-safe copy: non-finite floats as strings, numpy scalars as Python numbers."""
    if isinstance(x, (np.floating, np.integer)):
        return _jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def run_ladder(ref: Side, cand: Side, ids, mask, policy: Policy, teacher_forcing=True,
               progress=lambda msg: None) -> Report:
    taps = tuple(t for t in ref.taps if t in set(cand.taps))
    real = np.asarray(mask, bool)
    progress(f"reference {ref.name} at {policy.name}")
    _, r = ref.at_policy.capture(ids, mask, taps)
    progress(f"candidate {cand.name} at {policy.name}")
    _, c = cand.at_policy.capture(ids, mask, taps)
    progress("oracle: reference at fp64")
    _, o = ref.at_fp64.capture(ids, mask, ref.taps)   # all of them: context for the hints
    progress("candidate at fp64 (semantic rung)")
    _, c64 = cand.at_fp64.capture(ids, mask, taps)
    keeps_f32 = ref.keeps_f32 or cand.keeps_f32
    hidden = np.shape(o["embed"])[-1] if "embed" in o else None
    verdicts = [classify(t, r[t], c[t], o[t], c64[t], real, policy, keeps_f32,
                         _context(t, c64, o), hidden) for t in taps]
    for v in verdicts:
        v.metrics = pair_metrics(c[v.tap][real], r[v.tap][real], tapnames.dtype_of(v.tap, policy))
    logits = (logits_agreement(r["logits"], c["logits"], o["logits"], real)
              if "logits" in taps else {})
    worst = max(verdicts, key=lambda v: KINDS.index(v.kind)).kind
    first = next((v for v in verdicts if v.kind == worst), None) if worst not in ("exact", "drift") \
        else None
    divergence = None
    if first is not None:
        hint = first.hint
        # Where a difference starts says what sits there; for the embedding and the lm_head
        # (a table and one matrix) that is the best hint whatever pattern the values show.
        if first.component in _COMPONENT_HINT and (
                "no simple structure" in hint or first.component in ("embed", "lm_head")):
            hint += f"; it starts in {_COMPONENT_HINT[first.component]}"
        divergence = Divergence(first.tap, first.layer, first.component, first.kind, hint)
    local = []
    if teacher_forcing:
        progress("teacher forcing: every layer fed the oracle's input")
        local = _local_errors(ref, cand, ids, mask, o, real, divergence, policy, keeps_f32)
        _amplification(local, verdicts)
    uses_jax = "jaxmodel" in (ref.name, cand.name) or any(
        type(m).__module__.startswith("jaxmodel") for m in (ref.at_policy, cand.at_policy))
    return Report(ref.name, cand.name, policy.to_dict(), worst, divergence, verdicts, local,
                  logits, environment(policy, uses_jax))


def _amplification(rows: list[dict], verdicts: list[TapVerdict]) -> None:
    """Per layer and side: full-run error of the layer's output over that of its input (the
    previous layer's output; the embedding for layer 0, where it is None when the embedding
    is exact). > 1: the layer magnifies what it inherits (local error included)."""
    full = {v.tap: v for v in verdicts}
    for row in rows:
        i = row["layer"]
        out, inp = full.get(f"layers.{i}.out"), full.get("embed" if i == 0 else f"layers.{i - 1}.out")
        for key, attr in (("ref", "err_ref"), ("cand", "err_cand")):
            e_in = getattr(inp, attr) if inp else 0.0
            row[f"{key}_amplification"] = (getattr(out, attr) / e_in if out and e_in else None)


def _local_errors(ref: Side, cand: Side, ids, mask, oracle, real, divergence=None,
                  policy: Policy | None = None, keeps_f32=False) -> list[dict]:
    """Feed every layer the oracle's input (one call per side) and measure what each layer
    adds on its own; inherited = full-run error, local = forced-run error.

    With a divergence, the same forced runs also measure the divergence's tap in every
    layer (at fp64 for a semantic one, at P for a precision one) and say whether the
    first layer that adds the difference on its own is the divergence's layer."""
    n = sum(1 for t in oracle if t.endswith(".out"))
    if n == 0 or "embed" not in oracle:
        return []
    inject = {0: oracle["embed"], **{i: oracle[f"layers.{i - 1}.out"] for i in range(1, n)}}
    outs = [f"layers.{i}.out" for i in range(n)]
    kind = tapnames.parse(divergence.tap)[1] if divergence else None
    at = [f"layers.{i}.{kind}" for i in range(n)] if divergence and divergence.layer is not None \
        else outs
    at = [t for t in at if t in oracle]
    rows = [{"layer": i} for i in range(n)]
    forced = {}
    for side, key in ((ref, "ref"), (cand, "cand")):
        _, forced[key] = side.at_policy.capture(ids, mask, list(dict.fromkeys(outs + at)),
                                                inject=inject)
        for i, t in enumerate(outs):
            rows[i][f"{key}_local"] = rel_l2(forced[key][t][real], oracle[t][real])
    if divergence and divergence.kind == "precision":
        pos = positions_from_mask(np.asarray(mask))[real]
        for t in at:
            row = rows[tapnames.layer_of(t)]
            fr, fc, o = forced["ref"][t][real], forced["cand"][t][real], oracle[t][real]
            row["ref_tap_local"], row["cand_tap_local"] = rel_l2(fr, o), rel_l2(fc, o)
            row["tap_local_ratio"] = precision_ratio(fr, fc, o, pos, precision_floor(policy, oracle["embed"].shape[-1]),
                                                     drift_factor(policy))[0]
    if divergence and divergence.kind == "semantic":
        _, forced = cand.at_fp64.capture(ids, mask, list(dict.fromkeys(outs + at)), inject=inject)
        for t in at:
            rows[tapnames.layer_of(t)]["cand64_tap_local"] = rel_l2(forced[t][real], oracle[t][real])
    if divergence:
        _confirm(divergence, rows, at, policy, keeps_f32)
    return rows


def _confirm(d: Divergence, rows, at, policy, keeps_f32) -> None:
    """Teacher forcing's confirmation of the divergence's layer (DESIGN: localisation)."""
    what = tapnames.parse(d.tap)[1] if d.layer is not None else "out"
    if d.kind == "semantic":
        gate = STRUCT_F32_FLOOR if keeps_f32 else FP64_FLOOR
        local = {r["layer"]: r.get("cand64_tap_local") for r in rows}
        adds = [i for i, e in local.items() if e is not None and not e <= gate]
        rule = f"fp64 local error of layers.i.{what} > {gate:.0e}"
    else:
        local = {r["layer"]: (r.get("ref_tap_local"), r.get("cand_tap_local")) for r in rows}
        adds = [r["layer"] for r in rows if r.get("tap_local_ratio", 0) > 1]
        rule = (f"local error of layers.i.{what} > {drift_factor(policy):g}x the reference's "
                f"+ {FLOOR_ULPS} ulp")
    first = adds[0] if adds else None
    if d.layer is None:
        d.confirmed = first is None
        d.evidence = (f"teacher forcing: no layer adds the difference on its own ({rule}), so it "
                      f"starts outside the layers, in {d.component}" if first is None else
                      f"teacher forcing: layer {first} adds a difference on its own ({rule})")
        return
    d.confirmed = first == d.layer
    if d.kind == "semantic":
        e = rows[d.layer].get("cand64_tap_local")
        nums = f"{e:.1e} there" + (f", {rows[d.layer - 1]['cand64_tap_local']:.1e} in layer "
                                   f"{d.layer - 1}" if d.layer > 0 and
                                   rows[d.layer - 1].get("cand64_tap_local") is not None else "")
    else:
        e_r, e_c = local[d.layer]
        nums = (f"{e_c:.1e} vs the reference's {e_r:.1e} there, "
                f"{rows[d.layer].get('tap_local_ratio', float('nan')):.1f}x the bound")
    d.evidence = (f"teacher forcing (oracle input forced into every layer): layer {first} is the "
                  f"first to add it on its own ({rule}; {nums})" if first is not None else
                  f"teacher forcing: no layer adds it on its own ({rule}); the difference is "
                  "inherited or too small to isolate")


# The default input: one chat prompt of 258 tokens with SmolLM2's tokenizer (the issue's
# "256-token prompt"), long enough for position-dependent bugs (RoPE, masks) to show a
# trend and for softmaxes over many keys, short enough for the fp64 rung to stay cheap.
BUILTIN_PROMPTS = [
    "Read the following notes and answer the question at the end.\n\n"
    "Floating-point addition is not associative: (a + b) + c can differ from a + (b + c) in the "
    "last bits, because every operation rounds its exact result to the nearest number the format "
    "can hold. A float32 number keeps 24 bits of significand, a bfloat16 number only 8, so the "
    "same sum computed in a different order lands on a neighbouring value. Inside a language "
    "model these tiny differences pass through dozens of layers of matrix products. Most of the "
    "time they stay at the level of the rounding itself. A real bug looks different: a rotary "
    "embedding applied to the wrong pairs of dimensions, a normalisation with the wrong epsilon, "
    "or a mask that lets a token see its future changes the numbers even when every step is "
    "computed in double precision, and it changes them in a pattern that follows positions, "
    "heads or rows rather than looking like noise.\n\n"
    "Question: why can two correct implementations of the same model give different answers, "
    "and how would you tell that apart from a bug?",
]


def _inputs(inputs, checkpoint):
    """None -> built-in prompts; list[str] -> chat-encoded; int array [B, T] (or (ids, mask)).

    Text batches are right-padded: transformers' eager float64 attention turns a
    left-padded row into NaN (hf_adapter.EAGER_F64_LEFT_PADDING), and positions come from
    the mask in every implementation, so the padding side does not change the math.
    """
    if inputs is None or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str)):
        from llamaspec.tokenizer import Tokenizer
        tok = Tokenizer.from_pretrained(checkpoint)
        return tok.batch_encode(list(inputs or BUILTIN_PROMPTS), chat=True, padding_side="right")
    if isinstance(inputs, tuple) and len(inputs) == 2:
        return np.asarray(inputs[0]), np.asarray(inputs[1])
    ids = np.asarray(inputs)
    return ids, np.ones(ids.shape, np.int64)


def compare_models(reference="torchref", candidate="jaxmodel", checkpoint=None, inputs=None,
                   policy="fp32", teacher_forcing=True, progress=lambda msg: None) -> Report:
    """Runs the ladder for `candidate` against `reference` on one checkpoint (the public API)."""
    if checkpoint is None:
        raise ValueError("checkpoint is required (a Hugging Face Llama folder; "
                         "`llama-parity fetch-smollm2` prints the default one)")
    policy = Policy.get(policy)
    ids, mask = _inputs(inputs, checkpoint)
    progress(f"loading {reference if isinstance(reference, str) else type(reference).__name__} "
             f"and {candidate if isinstance(candidate, str) else type(candidate).__name__}")
    ref = resolve_side(reference, checkpoint, policy)
    cand = resolve_side(candidate, checkpoint, policy)
    return run_ladder(ref, cand, ids, mask, policy, teacher_forcing, progress)


def assert_parity(reference, candidate, checkpoint, policy="fp32", inputs=None, allow=("exact", "drift"),
                  **kw) -> Report:
    """For users' own pytest suites: fails with the report's summary unless the verdict is
    in `allow` (by default: exact or drift, i.e. no precision or semantic difference)."""
    report = compare_models(reference, candidate, checkpoint, inputs=inputs, policy=policy, **kw)
    if report.verdict not in allow:
        worst = [v for v in report.taps if v.kind == report.verdict][:5]
        lines = [report.summary()] + [f"  {v.tap}: {v.kind}, cand {v.err_cand:.2e} vs ref "
                                      f"{v.err_ref:.2e}, fp64 {v.err_fp64:.2e}" for v in worst]
        raise AssertionError("\n".join(lines))
    return report
