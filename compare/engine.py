"""The oracle ladder (DESIGN.md, "Telling drift from bugs"): one verdict per tap.

Four captures of the same inputs, all numpy:
    ref  = reference at the working policy P      cand   = candidate at P
    oracle = reference at fp64                    cand64 = candidate at fp64
Per tap, in this order:
    exact      cand is bitwise equal to ref;
    semantic   cand64 differs from oracle beyond fp64 rounding (or the floor of a side
               that keeps f32 steps inside its fp64 run), or the difference is
               structured (structure.analyse): a difference in the math;
    precision  err(cand) > M * err(ref) + floor at P, errors measured against the
               oracle: the candidate loses more precision than the reference;
    drift      anything else: rounding, as much as the reference's own.
This first version works on whole taps; teacher forcing gives each layer's local error.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from pathlib import Path

import numpy as np

from llamaspec import Policy, taps as tapnames

from .metrics import nonfinite, rel_l2, unit_roundoff
from .structure import analyse, hint as structure_hint

KINDS = ("exact", "drift", "precision", "semantic")
M = 3.0                 # measured: err(jaxmodel)/err(torchref) <= 2.5 on SmolLM2 at every preset
FLOOR_ULPS = 8          # floor of the precision check, in unit roundoffs of compute_dtype
FP64_FLOOR = 1e-12      # measured fp64 noise between our two models: <= 7.4e-15 on SmolLM2
F32_STEPS_FLOOR = 300 * 2.0 ** -24   # a side that keeps f32 steps in its fp64 run


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


@dataclasses.dataclass
class Divergence:
    tap: str
    layer: int | None
    component: str
    kind: str
    hint: str


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


def _transformers(model) -> Side:
    import torch

    from .hf_adapter import HFAdapter, copy_at
    adapter = HFAdapter(model)
    fp64 = HFAdapter(copy_at(model, torch.float64))
    return Side(adapter.name, adapter, fp64, True, tuple(adapter.available_taps))


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
        return _transformers(spec)
    raise TypeError(f"cannot compare a {type(spec).__name__}: pass 'torchref', 'jaxmodel' or a "
                    "transformers LlamaForCausalLM")


def classify(tap, ref, cand, oracle, cand64, mask, policy: Policy, keeps_f32: bool) -> TapVerdict:
    """The ladder for one tap; arrays are [B, T, ...], mask [B, T] selects real positions."""
    layer, component = tapnames.layer_of(tap), tapnames.component_of(tap)
    r, c, o, c64 = (np.asarray(a)[mask] for a in (ref, cand, oracle, cand64))
    bad = nonfinite(r) + nonfinite(c)
    err_ref, err_cand, err64 = rel_l2(r, o), rel_l2(c, o), rel_l2(c64, o)
    if bad or not all(math.isfinite(e) for e in (err_ref, err_cand, err64)):
        kind = "semantic" if nonfinite(c64) else "precision"
        return TapVerdict(tap, layer, component, kind, err_ref, err_cand, err64, bad,
                          f"NaN/Inf: {nonfinite(r)} in the reference, {nonfinite(c)} in the "
                          f"candidate ({nonfinite(c64)} at fp64)")
    if np.array_equal(r, c):
        return TapVerdict(tap, layer, component, "exact", err_ref, err_cand, err64, 0, "bitwise equal")
    floor64 = F32_STEPS_FLOOR if keeps_f32 else FP64_FLOOR
    if err64 > floor64:
        per_head = tapnames.parse(tap)[1] in ("q", "k", "v", "q_rope", "k_rope")
        found = analyse(np.asarray(cand64, np.float64), np.asarray(oracle, np.float64), mask,
                        per_head=per_head, floor=floor64)
        why = structure_hint(found) if found else "no simple structure"
        return TapVerdict(tap, layer, component, "semantic", err_ref, err_cand, err64, 0,
                          f"differs at fp64 (rel L2 {err64:.1e} > {floor64:.0e}): a difference in "
                          f"the math, not rounding; {why}")
    floor = FLOOR_ULPS * unit_roundoff(policy.compute_dtype)
    if err_cand > M * err_ref + floor:
        return TapVerdict(tap, layer, component, "precision", err_ref, err_cand, err64, 0,
                          f"the candidate loses {err_cand / max(err_ref, 1e-300):.1f}x the "
                          f"reference's precision here ({err_cand:.1e} vs {err_ref:.1e}) while "
                          "fp64 agrees: a step computed in lower precision (softmax, RoPE "
                          "tables, norm, accumulation)")
    return TapVerdict(tap, layer, component, "drift", err_ref, err_cand, err64, 0,
                      f"rounding: {err_cand:.1e} vs the reference's own {err_ref:.1e} "
                      f"(within {M:g}x + {FLOOR_ULPS} ulp)")


@dataclasses.dataclass
class Report:
    reference: str
    candidate: str
    policy: dict
    verdict: str
    first_divergence: Divergence | None
    taps: list[TapVerdict]
    local: list[dict]       # per layer: local error of each side with oracle inputs forced

    def to_dict(self) -> dict:
        return _jsonable(dataclasses.asdict(self))

    def to_json(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def to_html(self, path) -> Path:
        from .html import write_html
        return write_html(self, path)

    def summary(self) -> str:
        lines = [f"{self.candidate} vs {self.reference} at {self.policy['name']}: {self.verdict}"]
        if self.first_divergence:
            d = self.first_divergence
            lines.append(f"first {d.kind} at {d.tap} (layer {d.layer}, {d.component}): {d.hint}")
        return "\n".join(lines)


def _jsonable(x):
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
    _, o = ref.at_fp64.capture(ids, mask, taps)
    progress("candidate at fp64 (semantic rung)")
    _, c64 = cand.at_fp64.capture(ids, mask, taps)
    keeps_f32 = ref.keeps_f32 or cand.keeps_f32
    verdicts = [classify(t, r[t], c[t], o[t], c64[t], real, policy, keeps_f32) for t in taps]
    worst = max(verdicts, key=lambda v: KINDS.index(v.kind)).kind
    first = next((v for v in verdicts if v.kind == worst), None) if worst not in ("exact", "drift") \
        else None
    divergence = None if first is None else Divergence(first.tap, first.layer, first.component,
                                                       first.kind, first.hint)
    if teacher_forcing:
        progress("teacher forcing: every layer fed the oracle's input")
    local = _local_errors(ref, cand, ids, mask, o, real) if teacher_forcing else []
    return Report(ref.name, cand.name, policy.to_dict(), worst, divergence, verdicts, local)


def _local_errors(ref: Side, cand: Side, ids, mask, oracle, real) -> list[dict]:
    """Feed every layer the oracle's input (one call per side) and measure what each layer
    adds on its own; inherited = full-run error, local = forced-run error."""
    n = sum(1 for t in oracle if t.endswith(".out"))
    if n == 0 or "embed" not in oracle:
        return []
    inject = {0: oracle["embed"], **{i: oracle[f"layers.{i - 1}.out"] for i in range(1, n)}}
    outs = [f"layers.{i}.out" for i in range(n)]
    rows = [{"layer": i} for i in range(n)]
    for side, key in ((ref, "ref"), (cand, "cand")):
        _, forced = side.at_policy.capture(ids, mask, outs, inject=inject)
        for i, t in enumerate(outs):
            rows[i][f"{key}_local"] = rel_l2(forced[t][real], oracle[t][real])
    return rows


BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about floating-point numbers.",
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
    """Runs the ladder for `candidate` against `reference` on one checkpoint (DESIGN.md API)."""
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
