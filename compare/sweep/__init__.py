"""What a precision policy costs on real text: several policies of one implementation against
the float64 oracle over a text, in windows (run.sweep), with llama.cpp's KL-divergence measures
(measures.Accumulator), the layers each policy hurts most (teacher forcing, layers) and a mixed
policy keeping them wide. docs/sweep.md."""

from .layers import LayerErrors, Suggestion
from .measures import Accumulator, Estimate, Measures, log_probs
from .run import Divergence, Row, SweepResult, check_sweep, read_text, sweep, table

__all__ = ["Accumulator", "Divergence", "Estimate", "LayerErrors", "Measures", "Row", "Suggestion", "SweepResult",
           "check_sweep", "log_probs", "read_text", "sweep", "table"]
