"""The invariance probes (invariance.py: batch, padding, determinism, greedy divergence,
cross-framework greedy), the models as they see them (models.py) and the fresh-process
worker of the determinism probe (worker.py); probe where (where.py: the layerwise
circumstance comparison, its plans, sources and sentences in where_*.py)."""

from .invariance import (
    DEFAULT_LENGTH,
    PROBES,
    TWIN_SUSPECT_UNITS,
    Case,
    Judge,
    ProbeResult,
    Trace,
    compare_case,
    compare_completion,
    divergence_plan,
    greedy_trace,
    make_judge,
    probe_batch,
    probe_cross_greedy,
    probe_determinism,
    probe_divergence,
    probe_padding,
    run_fresh,
    run_probe,
)
from .models import IMPLS, ModelSpec, ProbeModel, as_probe_model, fp64_twin, load_model
from .where import WhereResult, probe_where
from .where_text import explain_where

__all__ = ["DEFAULT_LENGTH", "IMPLS", "PROBES", "TWIN_SUSPECT_UNITS", "Case", "Judge", "ModelSpec", "ProbeModel",
           "ProbeResult", "Trace", "as_probe_model", "compare_case", "compare_completion", "divergence_plan",
           "fp64_twin", "greedy_trace", "load_model", "make_judge", "probe_batch", "probe_cross_greedy",
           "probe_determinism", "probe_divergence", "probe_padding", "run_fresh", "run_probe"]
__all__ += ["WhereResult", "explain_where", "probe_where"]
