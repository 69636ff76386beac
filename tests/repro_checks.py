"""What the repro tests share (tests/test_repro.py, tests/test_repro_more.py): running a case's
repro.py in a fresh process that cannot import the project, and reading its verdict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llamaspec import taps as tapnames

BLOCKED = ("llamaspec", "compare", "torchref", "jaxmodel", "llama_parity", "torch", "jax", "transformers")
# The bootstrap of the fresh process: none of the project's packages (nor the frameworks) can be
# imported, whatever sys.path holds; then repro.py runs as a script.
BOOTSTRAP = ("import runpy, sys\n"
             f"for name in {BLOCKED!r}:\n"
             "    sys.modules[name] = None\n"
             "script = sys.argv[1]\n"
             "sys.argv = [script]\n"
             "runpy.run_path(script, run_name='__main__')\n")


def run_case(case: Path, cwd: Path) -> subprocess.CompletedProcess:
    """repro.py of `case` in a fresh process that cannot import the project (BOOTSTRAP), isolated
    from PYTHONPATH and the user's site (-I), from `cwd`."""
    return subprocess.run([sys.executable, "-I", "-c", BOOTSTRAP, str(case / "repro.py")], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def first_difference(out: str) -> str | None:
    """The tap repro.py names as the first difference, or None when it says there is none."""
    for line in out.splitlines():
        if line.startswith("first difference at "):
            return line.removeprefix("first difference at ").split(":")[0]
    return None


def unit_name(tap: str) -> str:
    """The unit a tap belongs to: layers.<i>, embed, or head (final_norm, logits)."""
    layer = tapnames.layer_of(tap)
    return f"layers.{layer}" if layer is not None else "embed" if tap == "embed" else "head"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny tensors on one thread: two threads spinning against each other on a shared two-core
    machine made each tiny capture 50-100 times slower (100 ms against 2 ms on 2026-12-07).
    Imported by the repro test files (autouse there)."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
