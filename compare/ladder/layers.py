"""A per-layer error table without verdicts: each side's relative L2 error against an fp64
oracle and the two sides' distance, for users who want the raw numbers (compare_models
gives the verdicts)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..metrics import nonfinite, rel_l2


@dataclasses.dataclass
class Row:
    tap: str
    ref_err: float      # reference at the working policy vs oracle
    cand_err: float     # candidate at the working policy vs oracle
    cand_vs_ref: float  # candidate vs reference directly
    nonfinite: int      # NaN/Inf count on either side


def layer_summary(oracle, ref, cand, tokens, attention_mask=None, taps=("layers.*.out", "final_norm", "logits")):
    """Rows for every requested tap; padding positions are excluded from the metrics."""
    mask = np.ones(np.shape(tokens), bool) if attention_mask is None else np.asarray(attention_mask, bool)
    _, o = oracle.capture(tokens, attention_mask, taps)
    _, r = ref.capture(tokens, attention_mask, taps)
    _, c = cand.capture(tokens, attention_mask, taps)
    rows = []
    for name in o:
        on, rn, cn = o[name][mask], r[name][mask], c[name][mask]
        rows.append(Row(name, rel_l2(rn, on), rel_l2(cn, on), rel_l2(cn, rn),
                        nonfinite(rn) + nonfinite(cn)))
    return rows
