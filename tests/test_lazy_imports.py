"""Imports sit at the top of compare/'s modules, where a reader sees its dependency graph
(tests/test_imports.py checks that graph). An import inside a function is kept only for a
heavy or optional package on HEAVY, or with a `# lazy: <reason>` comment on its line or
just above it (above a run of imports, for all of them); a new stray lazy import of a
project module fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from llamaspec.files import atomic_write

ROOT = Path(__file__).resolve().parents[1]

# Packages a function may import when it needs them, and why not at the top of the module.
HEAVY = {
    "torch": "slow import; the JAX-only paths and `import compare` must not load it",
    "torchref": "imports torch",
    "transformers": "slow import (and torch); only its adapter, controls and ports need it",
    "jax": "slow import, and XLA_FLAGS must be set (and checked) before it loads",
    "jaxlib": "jax's",
    "jaxmodel": "imports jax",
    "flax": "imports jax",
    "matplotlib": "slow import; pyplot only after the Agg backend is chosen (report pages)",
    "keras": "a port's optional dependency; KERAS_BACKEND must be set before it loads",
    "keras_hub": "a port's optional dependency (keras)",
    "litgpt": "a port's optional dependency (torch, lightning)",
    "penzai": "a port's optional dependency (jax)",
    "torchtune": "a port's optional dependency (torch)",
    "nnsight": "a port's optional dependency (torch)",
}

def _module(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import names ("" leads a relative one: always a project module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return ["." * node.level + (node.module or "")]


def _heavy(module: str) -> bool:
    return not module.startswith(".") and module.split(".")[0] in HEAVY


def _reasoned(lines: list[str], node, import_lines: set[int]) -> bool:
    """A `# lazy:` comment on the import's line, or on the line above it or above the run of
    imports it ends (blank lines between groups of imports included)."""
    if "# lazy:" in lines[node.lineno - 1]:
        return True
    i = node.lineno - 1
    while i >= 1 and (i in import_lines or not lines[i - 1].strip()):
        i -= 1
    return i >= 1 and lines[i - 1].strip().startswith("# lazy:")


def stray_lazy_imports(path: Path) -> list[str]:
    """"line: module" for every import inside a function of the file that is neither of a
    HEAVY package nor given a `# lazy:` reason."""
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for fn in ast.walk(ast.parse(text, str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        imports = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
        import_lines = {i for n in imports for i in range(n.lineno, n.end_lineno + 1)}
        for node in imports:
            light = [m for m in _module(node) if not _heavy(m)]
            if light and not _reasoned(lines, node, import_lines):
                found.append(f"{node.lineno}: {', '.join(light)}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def _compare_files() -> dict[str, Path]:
    return {str(p.relative_to(ROOT)): p for p in sorted((ROOT / "compare").rglob("*.py"))}


def test_imports_inside_functions_are_heavy_or_say_why():
    found = [f"{name}:{s}" for name, p in _compare_files().items()
             for s in stray_lazy_imports(p)]
    assert not found, ("imports inside functions: move them to the top of the module, or add the package "
                       "to HEAVY (with why), or say `# lazy: <reason>` (an import cycle):\n" + "\n".join(found))


def test_the_lazy_import_check_sees_what_it_checks(tmp_path):
    probe = tmp_path / "probe.py"
    atomic_write(probe, "\n".join([
        "import os",
        "def f():",
        "    import torch",                              # heavy: kept
        "    import jax.numpy as jnp",
        "    from llamaspec import Policy",              # 5: stray
        "    from ..adapters import as_implementation",  # 6: stray (relative: a project module)
        "    # lazy: an import cycle (the adapters import this module)",
        "    import torch",
        "",
        "    from compare import adapters",              # the comment covers the run of imports
        "    import json  # lazy: a reason on the line itself",
        "    x = 1",
        "    import copy",                               # 13: stray (code between it and the comment)
        "    def inner():",
        "        import numpy",                          # 15: stray, in a nested function
        "    return os",
        "class C:",
        "    def m(self):",
        "        import torch, copy",                    # 19: copy is stray
        "",
    ]), "probe module")
    assert stray_lazy_imports(probe) == ["5: llamaspec", "6: ..adapters", "13: copy", "15: numpy", "19: copy"]
