"""Teacher forcing: every layer fed the oracle's input, so each layer's own error shows.

One extra capture per side gives each layer's local error (against the oracle, with the
oracle's input forced) next to the inherited one of the full run; with a divergence, the
same runs say which layer is the first to add it on its own, which confirms (or not) the
layer the ladder names.
"""

from __future__ import annotations

import numpy as np

from llamaspec import Policy, positions_from_mask
from llamaspec import taps as tapnames

from ..adapters import Side, forced_capture
from ..evidence import FORCED, FP64_NOISE, SAME_LAYER, Forcing, Inherited
from ..explain import ladder as explain
from ..judge.verdicts import ROUNDING_PATTERNS, Divergence, TapVerdict, classify, context_for, precision_ratio
from ..metrics import rel_l2
from ..vocabulary import FP64_FLOOR, KINDS, STRUCT_F32_FLOOR, drift_factor, precision_floor

FINDINGS = ("precision", "semantic")


def amplification(rows: list[dict], verdicts: list[TapVerdict]) -> None:
    """Per layer and side: full-run error of the layer's output over that of its input (the
    previous layer's output; the embedding for layer 0, where it is None when the embedding
    is exact). > 1: the layer magnifies what it inherits (local error included)."""
    full = {v.tap: v for v in verdicts}
    for row in rows:
        i = row["layer"]
        out, inp = full.get(f"layers.{i}.out"), full.get(tapnames.input_tap(i))
        for key, attr in (("ref", "err_ref"), ("cand", "err_cand")):
            e_in = getattr(inp, attr) if inp else 0.0
            row[f"{key}_amplification"] = (getattr(out, attr) / e_in if out and e_in else None)


class ForcedRuns:
    """One comparison's teacher-forced captures (every layer fed the oracle's input), per side:
    "ref" and "cand" at the policy, "cand64" the candidate's twin. Made once and shared by
    inherit's local verdicts and local_errors: an ask for taps a held capture has reuses it;
    for others, that side is captured again (and the new capture held)."""

    def __init__(self, ref: Side, cand: Side, ids, mask, oracle):
        n = sum(1 for t in oracle if t.endswith(".out"))
        self.layers, self.ids, self.mask = n, ids, mask
        self.inject = tapnames.layer_inputs(oracle, n) if n and "embed" in oracle else None
        self.impls = {"ref": ref.at_policy, "cand": cand.at_policy, "cand64": cand.at_fp64}
        self.held: dict = {}

    def get(self, key: str, taps) -> dict:
        taps = list(dict.fromkeys(taps))
        have = self.held.get(key)
        if have is None or not all(t in have for t in taps):
            _, have = forced_capture(self.impls[key], self.ids, self.mask, taps, self.inject)
            self.held[key] = have
        return have


def local_errors(ref: Side, cand: Side, ids, mask, oracle, real, divergence=None,
                 policy: Policy | None = None, keeps_f32=False, forced: ForcedRuns | None = None) -> list[dict]:
    """Feed every layer the oracle's input (one call per side) and measure what each layer
    adds on its own; inherited = full-run error, local = forced-run error.

    With a divergence, the same forced runs also measure the divergence's tap in every
    layer (at fp64 for a semantic one, at P for a precision one) and say whether the
    first layer that adds the difference on its own is the divergence's layer. forced: the
    comparison's ForcedRuns, when inherit's judgement already made some of them."""
    runs = forced or ForcedRuns(ref, cand, ids, mask, oracle)
    if runs.inject is None:
        return []
    n = runs.layers
    outs = [f"layers.{i}.out" for i in range(n)]
    kind = tapnames.tap(divergence.tap).kind if divergence else None
    at = [f"layers.{i}.{kind}" for i in range(n)] if divergence and divergence.layer is not None \
        else outs
    at = [t for t in at if t in oracle]
    rows = [{"layer": i} for i in range(n)]
    forced = {}
    for key in ("ref", "cand"):
        forced[key] = runs.get(key, outs + at)
        for i, t in enumerate(outs):
            rows[i][f"{key}_local"] = rel_l2(forced[key][t][real], oracle[t][real])
    # Without the candidate's twin a semantic divergence is judged at P (classify_without_twin),
    # and so is its confirmation.
    at_policy = divergence and (not fp64_rule(divergence) or cand.at_fp64 is None)
    if at_policy:
        pos = positions_from_mask(np.asarray(mask))[real]
        for t in at:
            row = rows[tapnames.tap(t).layer]
            fr, fc, o = forced["ref"][t][real], forced["cand"][t][real], oracle[t][real]
            row["ref_tap_local"], row["cand_tap_local"] = rel_l2(fr, o), rel_l2(fc, o)
            row["tap_local_ratio"] = precision_ratio(fr, fc, o, pos, precision_floor(policy, oracle["embed"].shape[-1]),
                                                     drift_factor(policy))[0]
    if divergence and fp64_rule(divergence) and not at_policy:
        f64 = runs.get("cand64", outs + at)
        for t in at:
            rows[tapnames.tap(t).layer]["cand64_tap_local"] = rel_l2(f64[t][real], oracle[t][real])
    if divergence:
        _confirm(divergence, rows, at, policy, keeps_f32, at_policy)
    return rows


def fp64_rule(d: Divergence) -> bool:
    """Whether teacher forcing confirms `d` on the candidate's fp64 twin (its local error
    beyond the fp64 gate): a semantic divergence, and a precision one that the fp64 rung found
    (a step hard-coded to a narrower dtype rounds in the twin too); else at the policy."""
    return d.kind == "semantic" or (d.record is not None and d.record.reason == FP64_NOISE)


def _confirm(d: Divergence, rows, at, policy, keeps_f32, at_policy=False) -> None:
    """Teacher forcing's confirmation of the divergence's layer (docs/method.md, "Localisation");
    at_policy: judged by the forced runs at P (precision, or no float64 twin)."""
    what = tapnames.tap(d.tap).kind if d.layer is not None else "out"
    if fp64_rule(d) and not at_policy:
        gate = STRUCT_F32_FLOOR if keeps_f32 else FP64_FLOOR
        adds = [r["layer"] for r in rows if r.get("cand64_tap_local") is not None and not r["cand64_tap_local"] <= gate]
        measured = dict(rule="fp64", gate=gate)
        if d.layer is not None:
            before = rows[d.layer - 1].get("cand64_tap_local") if d.layer > 0 else None
            measured.update(here=rows[d.layer].get("cand64_tap_local"), before=before)
    else:
        adds = [r["layer"] for r in rows if r.get("tap_local_ratio", 0) > 1]
        measured = dict(rule="policy", m=drift_factor(policy))
        if d.layer is not None:
            row = rows[d.layer]
            measured.update(ref_local=row.get("ref_tap_local"), cand_local=row.get("cand_tap_local"),
                            ratio=row.get("tap_local_ratio", float("nan")))
    first = adds[0] if adds else None
    d.confirmed = first is None if d.layer is None else first == d.layer
    d.forcing = Forcing(first, what=what, layer=d.layer, component=d.component, **measured)
    d.explain()


def confirm_divergence(d: Divergence, rows, at, policy, keeps_f32) -> None:
    """Sets d.confirmed and d.evidence from per-layer rows as local_errors fills them (the
    streamed ladder, compare.ladder.stream, measures them its own way)."""
    _confirm(d, rows, at, policy, keeps_f32)


# ----- inherited taps ----------------------------------------------------------------------------
# After the first divergence, every later tap carries its difference, and the rungs read that
# inherited difference as findings of their own (dtype noise at the fp64 rung, structure of the
# bug's propagated error). Teacher forcing says which are: a tap fed the oracle's input to its
# layer that is within drift adds nothing of its own, so its difference is inherited.

def _origin(verdicts: list[TapVerdict]) -> TapVerdict | None:
    """Where the candidate first parts from the oracle beyond rounding: the first finding, or
    the first tap whose fp64 difference is a dtype's noise (a step the policy rounds anyway at
    that tap, bitwise equal or within drift there, whose rounding later taps carry)."""
    return next((v for v in verdicts if v.kind in FINDINGS or v.noise_dtype is not None), None)


def _same_layer(v: TapVerdict, origin: TapVerdict, last: int | None) -> bool:
    """v follows the origin inside its layer (or after the layers, the origin in the last one or
    after it too), where forcing the layers' inputs cannot separate the two, and claims nothing the origin
    does not: no more severe, or semantic only by patterns that rounding itself makes
    (verdicts.ROUNDING_PATTERNS: a one-sided or position-growing error is what a rounded step
    carried through a norm or a softmax can look like) after an origin that is rounding."""
    inside = v.layer == origin.layer or (v.layer is None and origin.layer == last)
    if not inside:
        return False
    if KINDS.index(v.kind) <= KINDS.index(origin.kind):
        return True
    rounding_only = v.record is not None and bool(v.record.findings) and all(
        f.kind in ROUNDING_PATTERNS for f in v.record.findings)
    return origin.kind != "semantic" and rounding_only


def _last_layer(verdicts) -> int | None:
    return max((v.layer for v in verdicts if v.layer is not None), default=None)


def suspects(verdicts: list[TapVerdict]) -> list[TapVerdict]:
    """The findings after the origin (_origin) that teacher forcing must judge: all but those
    in the origin's own layer (_same_layer)."""
    origin = _origin(verdicts)
    if origin is None:
        return []
    after = verdicts[verdicts.index(origin) + 1:]
    last = _last_layer(verdicts)
    return [v for v in after if v.kind in FINDINGS and not _same_layer(v, origin, last)]


def forced_taps(suspect: list[TapVerdict], available) -> list[str]:
    """The taps the forced runs must return to judge `suspect` like the full run: each tap and
    its context (the q / k before RoPE at q_rope / k_rope)."""
    out = []
    for v in suspect:
        out.append(v.tap)
        if v.layer is not None and v.tap.endswith(("q_rope", "k_rope")):
            out.append(f"layers.{v.layer}.{v.tap.rsplit('.', 1)[1][0]}")
    return [t for t in dict.fromkeys(out) if t in available]


def judge_forced(taps, fr: dict, fc: dict, o: dict, fc64: dict | None, real, policy: Policy, keeps_f32: bool,
                 hidden, cfg=None) -> dict[str, TapVerdict]:
    """classify on the forced runs (each layer fed the oracle's input): the taps' local verdicts.
    cfg: the reference's llamaspec config (the family's steps, for the structure analysis), or None."""
    out = {}
    for t in taps:
        c64 = None if fc64 is None else fc64[t]
        out[t] = classify(t, fr[t], fc[t], o[t], c64, real, policy, keeps_f32,
                          context_for(t, fc if fc64 is None else fc64, o, cfg=cfg), hidden)
    return out


def local_verdicts(forced: ForcedRuns, oracle, real, verdicts, policy: Policy,
                   keeps_f32: bool, cfg=None) -> dict[str, TapVerdict]:
    """The full ladder's forced runs for the suspects (suspects): ref and cand at P, cand at
    fp64 when it has a twin; their local verdicts. The runs also hold what local_errors reads
    afterwards (every layer's output, and every layer's tap of each kind a finding has: the
    first divergence is one of them), so teacher forcing captures each side once."""
    suspect = suspects(verdicts)
    if not suspect or forced.inject is None:
        return {}
    n = forced.layers
    kinds = {tapnames.tap(v.tap).kind for v in verdicts if v.kind in FINDINGS and v.layer is not None}
    taps = (forced_taps(suspect, oracle) + [f"layers.{i}.out" for i in range(n)]
            + [t for t in (f"layers.{i}.{k}" for k in sorted(kinds) for i in range(n)) if t in oracle])
    fr, fc = forced.get("ref", taps), forced.get("cand", taps)
    fc64 = forced.get("cand64", taps) if forced.impls["cand64"] is not None else None
    hidden = np.shape(oracle["embed"])[-1]
    return judge_forced([v.tap for v in suspect], fr, fc, oracle, fc64, real, policy, keeps_f32, hidden, cfg)


def inherit(verdicts: list[TapVerdict], local: dict[str, TapVerdict]) -> int:
    """Marks the findings after the origin (_origin) that carry its difference: in its own
    layer and no more severe (SAME_LAYER), or within drift when forced (FORCED). Their kind
    becomes "inherited"; the rest keep theirs (a local error of their own). Returns how many."""
    origin = _origin(verdicts)
    if origin is None:
        return 0
    n, last = 0, _last_layer(verdicts)
    for v in verdicts[verdicts.index(origin) + 1:]:
        if v.kind not in FINDINGS:
            continue
        lv = local.get(v.tap)
        v.local = lv.record if lv is not None else None
        if _same_layer(v, origin, last):
            how = SAME_LAYER
        elif lv is not None and lv.kind in ("exact", "drift"):
            how = FORCED
        else:
            continue
        v.inherited = Inherited(origin.tap, how, v.kind)
        v.kind = "inherited"
        v.hint = explain.inherited_hint(v.inherited, v.local)
        n += 1
    return n
