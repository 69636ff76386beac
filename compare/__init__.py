"""compare: run two Llama implementations on the same inputs and measure where they differ.

Rooms (docs/layout.md has the map):
    vocabulary.py, metrics.py,     shared by both products: verdict kinds and thresholds,
    environment.py, results.py,    error metrics, the run's environment record, JSON results,
    evidence.py                    the typed records every rung of the ladder returns
    explain/                       every sentence a report shows, made from those records, last
    adapters/                      what can be compared: the Implementation protocol, ours,
                                   transformers, ports, dumps
    ladder/                        drift vs bug: per-tap verdicts, teacher forcing, decode, greedy
    probes/                        invariance: batch, padding, determinism, greedy divergence, and
                                   where a circumstance first changes a row (where.py)
    report/                        HTML for both products on one page toolkit
    controls/                      planted bugs and clean runs that calibrate the ladder (never
                                   imported by the engine)
"""

from .adapters import Implementation, as_implementation
from .adapters.dump import Dump, DumpError, fingerprint
from .capturing import capture
from .judge.structure import Finding, analyse, hint
from .ladder.decode import DecodeReport, compare_decode
from .ladder.engine import Report, assert_parity, compare_models
from .ladder.greedy import GreedyReport, compare_greedy
from .ladder.layers import Row, layer_summary
from .metrics import (
    cosine,
    frac_beyond,
    kl_per_position,
    max_abs,
    max_ulp,
    nonfinite,
    nonfinite_report,
    rel_l2,
    tap_metrics,
    top1_agreement,
    top_margin,
    topk_overlap,
    unit_roundoff,
)
from .repro import write_repro
from .vocabulary import KINDS

__all__ = ["KINDS", "DecodeReport", "Dump", "DumpError", "Finding", "GreedyReport", "Implementation", "Report",
           "Row", "analyse", "as_implementation", "assert_parity", "capture", "compare_decode", "compare_greedy",
           "compare_models", "cosine", "fingerprint", "frac_beyond", "hint", "kl_per_position", "layer_summary",
           "max_abs", "max_ulp", "nonfinite", "nonfinite_report", "rel_l2", "tap_metrics", "top1_agreement",
           "top_margin", "topk_overlap", "unit_roundoff", "write_repro"]
