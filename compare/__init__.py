"""compare: run two Llama implementations on the same inputs and measure where they differ.

The drift-vs-bug ladder (engine.py: compare_models, assert_parity, Report), its shared
vocabulary (vocabulary.py), per-tap metrics, the structure detectors that tell a
systematic (semantic) difference from rounding noise, the capture adapters (ours,
transformers), planted-bug controls, the invariance probes and the reports (terminal,
JSON, HTML). docs/method.md describes the method.
"""

from .engine import KINDS, Report, assert_parity, compare_models
from .layers import Row, layer_summary
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
from .structure import Finding, analyse, hint

__all__ = ["KINDS", "Report", "assert_parity", "compare_models", "Row", "layer_summary", "cosine", "frac_beyond",
           "kl_per_position", "max_abs", "max_ulp", "nonfinite", "nonfinite_report", "rel_l2", "tap_metrics",
           "top1_agreement", "top_margin", "topk_overlap", "unit_roundoff", "Finding",
           "analyse", "hint"]
