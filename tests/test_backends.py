"""The project's ladder judges its own backends: each model's `fast` and `invariant` backends
against the same model's plain reference (backend="reference"), on the same checkpoint, inputs
and policy. The ladder must say exact or drift at every tap: the backends may sum in other orders
(their kernels, torch's and XLA's library paths), never compute other math or lose precision.

These tests replace the speed paths' own tests of which internal path ran: what a user needs is
that whatever path the plan picks on their CPU (and under `make test-caps`, the paths of other
CPUs) computes the reference's function. A planted bug in a backend's op shows the check can fail.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
from pathlib import Path

import numpy as np
import pytest

import compare
from compare.adapters import OurModel, Side
from llamaspec.plan import BACKENDS, OPS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torchref", "jaxmodel")
CLEAN = ("exact", "drift")


def _tokens(vocab: int, B: int = 2, T: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, (B, T))


def _judged(package, folder, policy, backend, tokens, plant=None):
    """The ladder's report: package at `backend` (candidate) against package's reference. plant: a
    function that wraps a backend namespace, applied to the candidate and its float64 twin as they
    load (a planted bug; the controls plant theirs in both too)."""
    mod = importlib.import_module(package)
    ref = OurModel(mod.from_pretrained(folder, policy=policy, backend="reference"), folder)
    if plant is None:
        cand = OurModel(mod.from_pretrained(folder, policy=policy, backend=backend), folder)
    else:
        with _planted(package, plant):
            at_p, twin = (OurModel(mod.from_pretrained(folder, policy=p, backend=backend), folder)
                          for p in (policy, "fp64"))
        cand = Side(at_p.name + "+bug", at_p, twin, False, at_p.taps)
    return compare.compare_models(reference=ref, candidate=cand, checkpoint=folder, inputs=tokens, policy=policy)


@contextlib.contextmanager
def _planted(package, plant):
    """While it lasts, every model of `package` loads with its backend namespace wrapped by plant
    (torchref.model takes it from plan.make_backend, jaxmodel.model from plan.load)."""
    owner, name = (importlib.import_module("torchref.model"), "make_backend") if package == "torchref" else \
        (importlib.import_module("jaxmodel.plan"), "load")
    original = getattr(owner, name)

    def wrapped(*args, **kw):
        plan, ops = original(*args, **kw)
        return plan, plant(ops)
    setattr(owner, name, wrapped)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _assert_clean(report, what: str) -> None:
    bad = [(v.tap, v.kind) for v in report.taps if v.kind not in CLEAN]
    assert report.verdict in CLEAN and not bad, f"{what}: {report.verdict}, first {report.first_divergence}, {bad[:5]}"
    assert {v.kind for v in report.taps} <= set(CLEAN) and len(report.taps) > 10


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16", "bf16w-f32"])
def test_fast_backend_is_the_reference_within_drift(package, policy, tiny_dir):
    folder = tiny_dir("gqa", max_position_embeddings=512)
    # 300 tokens: long enough for the attention paths of long prompts (query blocks, fused kernels)
    report = _judged(package, folder, policy, "fast", _tokens(96, 2, 300))
    _assert_clean(report, f"{package} fast at {policy}")


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("config", ["head_dim", "bias", "dynamic", "mqa"])
def test_fast_backend_is_the_reference_within_drift_across_configs(package, config, tiny_dir):
    folder = tiny_dir(config)
    report = _judged(package, folder, "bf16", "fast", _tokens(96))
    _assert_clean(report, f"{package} fast, {config}, bf16")


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_invariant_backend_is_the_reference_within_drift(package, policy, tiny_dir):
    folder = tiny_dir("gqa")
    report = _judged(package, folder, policy, "invariant", _tokens(96))
    _assert_clean(report, f"{package} invariant at {policy}")


@pytest.mark.smollm2
@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_fast_backend_on_smollm2(package, policy, smollm2):
    report = _judged(package, smollm2, policy, "fast", _tokens(49152, 1, 160, seed=1))
    _assert_clean(report, f"{package} fast on SmolLM2 at {policy}")


class _TenfoldEps:
    """A backend namespace whose rms_norm adds 1e4 times the epsilon: a planted bug."""

    def __init__(self, base):
        self.base = base

    def __getattr__(self, name):
        return getattr(self.base, name)

    def rms_norm(self, x, weight, eps, policy):
        return self.base.rms_norm(x, weight, eps * 1e4, policy)


@pytest.mark.parametrize("package", PACKAGES)
def test_a_bug_planted_in_the_fast_backend_is_caught(package, tiny_dir):
    """The check above can fail: the fast backend's norm with a far larger epsilon is a semantic
    difference, first at layer 0's attn_norm."""
    folder = tiny_dir("gqa", rms_norm_eps=1e-2)
    report = _judged(package, folder, "fp32", "fast", _tokens(96), plant=_TenfoldEps)
    assert report.verdict == "semantic", report.verdict
    assert report.first_divergence.tap == "layers.0.attn_norm", report.first_divergence


@pytest.mark.parametrize("package", PACKAGES)
def test_the_plan_is_made_once_and_recorded(package, tiny_dir):
    mod = importlib.import_module(package)
    folder = tiny_dir("gqa")
    for backend in BACKENDS:
        model = mod.from_pretrained(folder, policy="bf16", backend=backend)
        plan = model.plan
        assert plan.backend == backend and plan.policy == "bf16"
        assert {op for op, _ in plan.ops} == set(OPS)
        if backend == "reference":
            assert all(how == "reference" for _, how in plan.ops), plan.ops
        record = plan.record()
        assert record["backend"] == backend and all(isinstance(v, (str, int, float, bool)) for v in record.values())
    with pytest.raises(Exception, match="backend"):
        mod.from_pretrained(folder, policy="bf16", backend="fastest")
    with pytest.raises(Exception, match="batch_invariant"):
        mod.from_pretrained(folder, policy="bf16", backend="fast", batch_invariant=True)


def test_a_comparison_records_both_sides_plans(tiny_dir):
    folder = tiny_dir("gqa")
    report = _judged("torchref", folder, "fp32", "fast", _tokens(96, 1, 12))
    env = report.environment
    assert env["reference plan backend"] == "reference" and env["candidate plan backend"] == "fast"
    assert env["candidate plan op attention"] and env["reference plan op attention"] == "reference"


# ----- the reference reads nothing about the machine ------------------------------------------

REFERENCE_FILES = [f"{p}/{f}" for p in PACKAGES for f in ("ops.py", "model.py", "dtypes.py")]
# what the reference may not read or import: environment variables, CPU flags, library caps and
# states, kernel libraries (all of that is the plan's: <package>/plan.py)
FORBIDDEN_NAMES = {"environ", "getenv", "putenv", "cpuinfo", "fixed_order", "kernels", "platform",
                   "_set_mkldnn_enabled", "_get_mkldnn_enabled", "XLA_FLAGS"}
FORBIDDEN_MODULES = {"os", "platform", "llamaspec.cpuinfo", "llamaspec.fixed_order", "sysconfig"}


def _reads(tree: ast.AST, backends=frozenset({"fast", "plan", "invariant"})) -> list[str]:
    """Each read of the machine in a module's syntax tree, and each import of a backend module
    named in `backends`, as "line N: what"."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES | {"backends", "_C"}:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("LLAMA_PARITY_"):
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name in FORBIDDEN_MODULES or a.name.split(".")[-1] in FORBIDDEN_NAMES]
        elif isinstance(node, ast.ImportFrom):
            module, names = node.module or "", {a.name for a in node.names}
            last = module.split(".")[-1]
            if module in FORBIDDEN_MODULES or names & FORBIDDEN_NAMES or last in FORBIDDEN_NAMES \
                    or (node.level and (last in backends or (not module and names & backends))):
                found.append(f"line {node.lineno}: from {'.' * node.level}{module} import {', '.join(sorted(names))}")
    return found


@pytest.mark.parametrize("path", REFERENCE_FILES)
def test_the_reference_reads_no_environment_cpu_flag_or_kernel(path):
    """torchref's and jaxmodel's reference path (ops, model, dtypes) reads no environment variable,
    CPU flag or library state and imports no kernel library: one path per op whatever the
    machine. ops.py and dtypes.py import no backend and no plan; model.py reaches the backends
    only through its plan module (from_pretrained asks it once for the namespace) and keeps the
    invariant mode's layout constants, never the fast backend itself."""
    tree = ast.parse((ROOT / path).read_text())
    backends = frozenset({"fast"}) if path.endswith("model.py") else frozenset({"fast", "plan", "invariant"})
    assert not _reads(tree, backends), f"{path} reads the machine: {_reads(tree, backends)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_the_reference_ops_module_is_short(package):
    """A reference a reader checks against transformers' modeling_llama.py in minutes."""
    lines = (ROOT / package / "ops.py").read_text().count("\n")
    assert lines <= 320, f"{package}/ops.py has {lines} lines"


def test_the_planted_reads_are_found():
    """_reads finds each kind of read it is for (so the tests above can fail)."""
    src = ("import os\nfrom llamaspec import cpuinfo\nx = os.environ.get('A')\ny = torch.backends.mkldnn.enabled\n"
           "z = 'LLAMA_PARITY_ATTENTION'\nfrom . import fast\n")
    assert len(_reads(ast.parse(src))) >= 6


def _identity_checks(tree: ast.AST) -> list[str]:
    """`x is ops.f` / `... __func__ is ...`: a path that changes with whether a seam was replaced."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            for side in (node.left, *node.comparators):
                text = ast.unparse(side)
                if text.startswith("ops.") or ".ops." in text or "__func__" in text or "_OWN_" in text:
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_the_model_takes_no_path_by_whether_a_seam_was_replaced(package):
    """A control replaces an op on one layer (compare/controls); the model calls that layer's op
    whatever it is, and no backend asks whether it was replaced."""
    for name in ("model.py", "fast.py"):
        path = ROOT / package / name
        if path.exists():
            found = _identity_checks(ast.parse(path.read_text()))
            assert not found, f"{package}/{name}: {found}"
    assert _identity_checks(ast.parse("if self.ops.apply_rope is ops.apply_rope: pass"))
