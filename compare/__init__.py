"""compare: run two Llama implementations on the same inputs and measure where they differ.

This package grows into the full drift-vs-bug engine (DESIGN.md); today it holds the
metrics and the per-layer summary used by `llama-parity demo`.
"""

from .layers import Row, layer_summary
from .metrics import max_abs, nonfinite, rel_l2

__all__ = ["Row", "layer_summary", "max_abs", "nonfinite", "rel_l2"]
