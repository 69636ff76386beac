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
from ..evidence import Forcing
from ..metrics import rel_l2
from ..vocabulary import FP64_FLOOR, STRUCT_F32_FLOOR, drift_factor, precision_floor
from .verdicts import Divergence, TapVerdict, precision_ratio


def amplification(rows: list[dict], verdicts: list[TapVerdict]) -> None:
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


def local_errors(ref: Side, cand: Side, ids, mask, oracle, real, divergence=None,
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
    kind = tapnames.tap(divergence.tap).kind if divergence else None
    at = [f"layers.{i}.{kind}" for i in range(n)] if divergence and divergence.layer is not None \
        else outs
    at = [t for t in at if t in oracle]
    rows = [{"layer": i} for i in range(n)]
    forced = {}
    for side, key in ((ref, "ref"), (cand, "cand")):
        _, forced[key] = forced_capture(side.at_policy, ids, mask, list(dict.fromkeys(outs + at)), inject)
        for i, t in enumerate(outs):
            rows[i][f"{key}_local"] = rel_l2(forced[key][t][real], oracle[t][real])
    # Without the candidate's twin a semantic divergence is judged at P (classify_without_twin),
    # and so is its confirmation.
    at_policy = divergence and (divergence.kind == "precision" or cand.at_fp64 is None)
    if at_policy:
        pos = positions_from_mask(np.asarray(mask))[real]
        for t in at:
            row = rows[tapnames.tap(t).layer]
            fr, fc, o = forced["ref"][t][real], forced["cand"][t][real], oracle[t][real]
            row["ref_tap_local"], row["cand_tap_local"] = rel_l2(fr, o), rel_l2(fc, o)
            row["tap_local_ratio"] = precision_ratio(fr, fc, o, pos, precision_floor(policy, oracle["embed"].shape[-1]),
                                                     drift_factor(policy))[0]
    if divergence and divergence.kind == "semantic" and not at_policy:
        _, forced = forced_capture(cand.at_fp64, ids, mask, list(dict.fromkeys(outs + at)), inject)
        for t in at:
            rows[tapnames.tap(t).layer]["cand64_tap_local"] = rel_l2(forced[t][real], oracle[t][real])
    if divergence:
        _confirm(divergence, rows, at, policy, keeps_f32, at_policy)
    return rows


def _confirm(d: Divergence, rows, at, policy, keeps_f32, at_policy=False) -> None:
    """Teacher forcing's confirmation of the divergence's layer (docs/method.md, "Localisation");
    at_policy: judged by the forced runs at P (precision, or no float64 twin)."""
    what = tapnames.tap(d.tap).kind if d.layer is not None else "out"
    if d.kind == "semantic" and not at_policy:
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
