"""Per-layer error summary: two implementations at a working policy vs an fp64 oracle.

This is the first, small piece of the comparison engine: for each layer output it
reports each side's relative L2 error against the oracle and their distance to each
other. The full drift/precision/semantic verdicts build on it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .metrics import nonfinite, rel_l2


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
