"""Every sentence of `probe where`, made from its records (compare.probes.where) and
nothing else: no decision anywhere reads a string made here.

    hint(result)            one line a kernel author can act on
    explain_where(result)   the hint, then one paragraph per comparison
    rerun_settings(record)  what decides a rerun's bits on the record's device (also probe determinism's hint)
"""

from __future__ import annotations

import math

from ..environment import JAX_BACKEND, NO_GPU

FINDINGS = {
    "pad_keys": "the pad keys are attended (B's attention output matches a float64 recompute that attends "
                "the pad slots, not the one that masks them)",
    "positions": "the RoPE positions or tables differ (the projections before RoPE agree)",
    "absorbed": "attention absorbs it (scores see only position differences): the layer's attention output "
                "is back within rounding",
    "rows": "the companions' values reach the target (no padding in this batch): a leak across rows in a "
            "batched op",
    "row_position": "the result depends on the target's row in the batch (other rows of the same call are "
                    "clean): an index computed per row (a cache slot, a key offset) is wrong",
    "later_positions": "a later token is visible to earlier positions (a causal-mask or position error)",
    "inherited": "with A's input the layer agrees: the difference is inherited from earlier drift, amplified "
                 "here",
    "nondeterministic": "the same input gives other bits on another run (atomics, threads, or a setting that "
                        "differs by process)",
}
_FORCED_WHY = {"input_equal": "its input is bitwise equal in A and B",
               "outside_layers": "it is outside the layers",
               "fresh": "B ran in another process",
               "no_inject": "the implementation cannot replace a layer's input (inject)",
               "replay_differs": "B replayed with its own layer inputs (the prompt's from a capture) is not B's "
                                 "run bitwise, so a forced run could not isolate the layer"}
_FAMILY = {"product": "product", "norm": "reduction (mean of squares)", "attention": "scores q.k^T, masked "
           "softmax or P@V (no tap between them)", "rope": "elementwise rotation by position",
           "residual": "elementwise add", "elementwise": "elementwise op", "gather": "table lookup"}


def _g(x, spec=".1e") -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _op(part) -> str:
    op = part.op
    if op.family == "product":
        rows = part.rows_b if part.rows_a == part.rows_b else f"{part.rows_a} vs {part.rows_b}"
        return f"{op.name}, a [{rows} rows, {op.k}] x [{op.k}, {op.n}] product"
    return f"{op.name} ({_FAMILY.get(op.family, op.family)})"


def _forced(f) -> str:
    if f is None:
        return ""
    if not f.ran:
        why = _FORCED_WHY.get(f.reason, f.reason)
        return f"; teacher forcing not needed: {why}" if f.reason == "input_equal" else \
            f"; teacher forcing not run: {why}"
    if f.local:
        return (f"; fed A's input, layer {f.layer} still differs ({f.kind}, {_g(f.rel_l2)} relative): "
                "this layer itself depends on the circumstance")
    return f"; fed A's input, layer {f.layer} agrees ({f.kind}): it only inherits the difference"


def _where_at(c, part) -> str:
    pos = "" if part.position is None else f" (first at target position {part.position})"
    return f"{part.tap} [{part.component}]{pos}, {_op(part)}"


def explain_comparison(c) -> str:
    """One comparison in a few sentences."""
    head = f"{c.name}: {c.verdict}"
    if c.first_difference is None:
        return f"{head}, bitwise equal at all {len(c.taps)} taps."
    fd, fb = c.first_difference, c.first_beyond
    by_tap = {d.tap: d for d in c.taps}
    d = by_tap[fd.tap]
    text = (f"{head}. The first difference is at {_where_at(c, fd)}: {d.kind}, {_g(d.rel_l2)} relative, "
            f"{_g(d.max_ulp, '.0f')} ulp"
            + ("; everything before it is bitwise equal" if fd.before_exact else "") + _forced(fd.forced) + ".")
    if fb is None:
        worst = max(c.taps, key=lambda t: t.ratio)
        return text + (f" Every difference is within drift (largest: {_g(worst.ratio, '.2f')} of the bound at "
                       f"{worst.tap}): another summation order, not a bug.")
    b = by_tap[fb.tap]
    rung = (f"the float64 twin differs too ({_g(b.twin_rel)} relative, floor {_g(b.twin_floor)})"
            if b.twin_rel is not None and not b.twin_rel <= b.twin_floor else
            f"{_g(b.err_b)} error vs the twin against A's {_g(b.err_a)} (bound {_g(b.bound)})")
    if b.twin_rel is None:
        rung += (", judged without a twin of B's circumstance (by size and structure, as a port without "
                 "float64())")
    if fb.tap == fd.tap:
        text += f" That is beyond drift: {rung}."
    else:
        text += f" It goes beyond drift ({fb.kind}) at {_where_at(c, fb)}: {rung}" + _forced(fb.forced) + "."
    return text + "".join(f" Finding: {FINDINGS[f]}." for f in c.findings if f in FINDINGS)


# What a difference within drift asks of the kernel author, per circumstance (by default the
# batch-invariant mode, which fixes a row's summation order whatever else shares its call)
_DRIFT_ONLY = {
    "device": ("Another device (or instruction set) runs other kernels, with other blockings, vector widths and "
               "fused operations: no mode makes two devices' sums bitwise equal (the batch-invariant mode fixes "
               "the order on one device, not across devices), so a port is judged across devices by the drift "
               "bound, as here."),
    "rerun": ("The same input on the same device gave other bits: a kernel whose order is not fixed from run to run "
              "(atomics, autotuned kernels, threads)."),
}
_DRIFT_ONLY_DEFAULT = "For bitwise invariance use the batch-invariant mode."

# The settings of a determinism_settings record that decide whether the same input gives the same
# bits again on a GPU, for torch (the record has no "jax backend") and for JAX; on a CPU only the
# libraries' thread counts, where the record has them.
_RERUN_GPU_TORCH = ("torch deterministic algorithms", "CUBLAS_WORKSPACE_CONFIG", "torch cudnn deterministic",
                    "torch cudnn benchmark")
_RERUN_GPU_JAX = ("XLA_FLAGS --xla_gpu_deterministic_ops", "XLA_FLAGS --xla_gpu_autotune_level")
_RERUN_CPU = ("torch threads",)


def rerun_settings(record: dict, others: dict | None = None) -> str:
    """What decides a rerun's bits where `record` was made (a compare.environment.determinism_settings
    record): on a GPU those settings with their values; without one, that no GPU setting applies
    (with the thread counts the record has). others: {label: another process's record}: the
    settings that differ there, or that none does."""
    if not record:
        return ""
    if record.get("gpu settings") == NO_GPU:
        names = [k for k in _RERUN_CPU if k in record]
        text = "no GPU here, so no CUDA or XLA:GPU setting decides a rerun"
    else:
        names = [k for k in (_RERUN_GPU_JAX if JAX_BACKEND in record else _RERUN_GPU_TORCH) if k in record]
        text = f"what decides a rerun's bits on {record.get('gpu settings', 'the GPU').removeprefix('apply: ')}"
    text += "".join(f"{', ' if i else ': '}{k}={record[k]}" for i, k in enumerate(names))
    for label, other in (others or {}).items():
        differ = [f"{k} {record[k]} vs {other[k]}" for k in record if k in other and other[k] != record[k]]
        text += f"; in {label}: " + (", ".join(differ) if differ else "the same settings")
    return text

_EXACT = {"device": "the two devices computed the same bits for the target row (at this policy, on these inputs)"}


def hint(result) -> str:
    """The one line for the kernel author: the worst comparison's first parting and why."""
    if result.verdict == "exact":
        return (f"bitwise equal at every tap in all {len(result.comparisons)} comparisons: "
                + _EXACT.get(result.circumstance, f"{result.circumstance} does not reach the target row"))
    c = result.worst
    fd, fb = c.first_difference, c.first_beyond
    settings = ""
    if result.circumstance == "rerun" and result.details.get("determinism settings"):
        text = rerun_settings(result.details["determinism settings"], result.details.get("fresh process settings"))
        settings = f" {text[0].upper()}{text[1:]}."
    if fb is None:
        row = f"row {c.b_row}" if c.b_shape[0] > 1 else "the target"
        return (f"the first difference is at {fd.tap}, {_op(fd)}: its result for {row} changes with the "
                f"circumstance ({c.name}; another blocking or summation order)"
                + ("; everything before it is bitwise equal" if fd.before_exact else "")
                + "; every tap stays within drift. " + _DRIFT_ONLY.get(result.circumstance, _DRIFT_ONLY_DEFAULT)
                + settings)
    why = next((FINDINGS[f] for f in c.findings if f in FINDINGS and f != "absorbed"), None)
    local = fb.forced is not None and fb.forced.ran and fb.forced.local
    return (f"{c.name} changes {fb.tap} beyond rounding ({fb.kind})"
            + ("" if fb.position is None else f" at the target's position {fb.position}")
            + f": {_op(fb)}" + (f"; {why}" if why else "")
            + ("; this layer does it with the same input" if local else "") + "." + settings)


def explain_where(result) -> str:
    """The hint, then a paragraph per comparison (worst first)."""
    order = sorted(result.comparisons, key=lambda c: c is not result.worst)
    lines = [f"probe where [{result.model}], {result.circumstance}: {result.verdict}: {hint(result)}"]
    lines += [explain_comparison(c) for c in order]
    return "\n".join(lines)
