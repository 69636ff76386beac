"""The invariance probes (invariance.py: batch, padding, determinism, greedy divergence,
cross-framework greedy), the models as they see them (models.py) and the fresh-process
worker of the determinism probe (worker.py)."""

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

__all__ = ["DEFAULT_LENGTH", "IMPLS", "PROBES", "TWIN_SUSPECT_UNITS", "Case", "Judge", "ModelSpec", "ProbeModel",
           "ProbeResult", "Trace", "as_probe_model", "compare_case", "compare_completion", "divergence_plan",
           "fp64_twin", "greedy_trace", "load_model", "make_judge", "probe_batch", "probe_cross_greedy",
           "probe_determinism", "probe_divergence", "probe_padding", "run_fresh", "run_probe"]
