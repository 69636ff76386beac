"""Fresh-process runner for the determinism probe: python -m compare.probes.worker JOB.json

JOB.json: {"spec": ModelSpec fields, "ids": path.npy, "mask": path.npy, "out": path.npy}.
Loads the model from its spec, runs one forward pass and saves the logits (16-bit
floats widened to float32, which is exact: np.save has no bfloat16).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from llamaspec.files import atomic_write
from llamaspec.interrupts import run_child

from .models import ModelSpec, ProbeModel


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m compare.probes.worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(open(argv[0]).read())
    spec = ModelSpec(**job["spec"])
    pm = ProbeModel(spec.load(), spec=spec)
    out = pm.logits(np.load(job["ids"]), np.load(job["mask"]))
    if out.dtype.itemsize < 4:
        out = out.astype(np.float32)
    np.save(job["out"], out)
    return 0


def run_job(module: str, job: dict, folder: Path, timeout: float, what: str,
            env: Mapping[str, str] | None = None) -> None:
    """Runs `python -m <module> JOB.json` in a fresh Python process with the repository first on
    its path; `job` is written to folder/job.json (temp name, rename). env: variables the process
    starts with, over this one's (an instruction-set cap's: llamaspec.caps.environ; the libraries
    read them once, when they load). A failure is a RuntimeError naming `what`, with the tail of
    the process's stderr; subprocess.TimeoutExpired past `timeout`. The process (and any it
    started) ends when this one is interrupted."""
    root = str(Path(__file__).resolve().parents[2])
    child = {**os.environ, **(env or {})}
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child.get("PYTHONPATH")]))
    path = atomic_write(Path(folder) / "job.json", json.dumps(job), "probe job")
    # its own process group, ended whole on Ctrl-C, SIGTERM or the timeout (llamaspec.interrupts)
    proc = run_child([sys.executable, "-m", module, str(path)], timeout=timeout, env=child, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")


if __name__ == "__main__":
    sys.exit(main())
