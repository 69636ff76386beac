"""Fresh-process runner of `probe where` (rerun in a fresh process; the device circumstance's
side under an instruction-set cap): python -m compare.probes.where_worker JOB.json

JOB.json: {"spec": ModelSpec fields, "ids", "mask": .npy paths, "rows": [row, ...],
"taps": [tap, ...], "out": a folder, "twin": bool, "cap": a name of llamaspec.caps.CAPS or
null}. Loads the model from its spec, captures every tap and saves the asked rows in
out/model.npz ("row|tap" keys; 16-bit floats widened to float32, exact) with their dtypes
(out/model.json); with "twin", the same for the model's float64 twin (fp64_twin: the same
rounded weights computing in float64, on the same device) in out/twin.npz, captured here too
(under a cap, a bug that shows only there is then in the fp64 rung); and this process's record
in out/side.json (compare.environment: the CPU, the caps in force, the model's plan).

A capped job's process starts with the cap's variables in its environment (fresh_capture hands
them to run_job: the libraries read them once, when they load); the worker only checks that
they are in force, before anything loads, and refuses otherwise.

fresh_capture() is the other end: it writes the job, starts the process and reads the rows.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from llamaspec import caps
from llamaspec.files import atomic_write

from ..adapters import as_implementation
from ..environment import environment
from ..metrics import resolve_dtype
from .models import ModelSpec, fp64_twin
from .worker import run_job

MODULE = "compare.probes.where_worker"


def check_under(cap: str, env: Mapping[str, str]) -> None:
    """That `env` (this process's environment, as it started) holds every variable of cap `cap`
    as the table says (XLA's flag among XLA_FLAGS): a RuntimeError naming what is missing
    otherwise (the cap would not act on this process's libraries)."""
    caps.check(cap)
    want = caps.in_force(dict(caps.cap(cap).variables))
    lacking = [v for v in want if v not in caps.in_force(env)]
    if lacking:
        raise RuntimeError(f"where worker: started without the cap {cap!r} in force (missing {', '.join(lacking)}); "
                           "the process must start with it (run_job's env=)")


def _save(impl, job: dict, name: str) -> None:
    _, acts = impl.capture(np.load(job["ids"]), np.load(job["mask"]), job["taps"])
    rows, dtypes = {}, {}
    for t in job["taps"]:
        a = np.asarray(acts[t])
        dtypes[t] = str(a.dtype)
        for r in job["rows"]:
            rows[f"{r}|{t}"] = a[r].astype(np.float32) if a.dtype.itemsize < 4 else a[r]
    out = Path(job["out"])
    atomic_write(out / f"{name}.npz", lambda f: np.savez(f, **rows), "captured rows")
    atomic_write(out / f"{name}.json", json.dumps(dtypes), "tap dtypes")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {MODULE} JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    if job.get("cap"):
        check_under(job["cap"], os.environ)
    spec = ModelSpec(**job["spec"])
    model = spec.load()
    impl = as_implementation(model, spec.checkpoint)
    _save(impl, job, "model")
    if job.get("twin"):
        twin = fp64_twin(model)
        if twin is None:
            raise TypeError(f"{spec.impl}: no float64 twin (float64()) to capture in this process")
        _save(as_implementation(twin), job, "twin")
    env = environment(spec.policy, uses_jax=getattr(impl, "package", None) == "jaxmodel", sides={"model": impl})
    atomic_write(Path(job["out"]) / "side.json", json.dumps(env, default=str), "the process's record")
    return 0


def _rows(out: Path, name: str, rows, taps) -> dict:
    kinds = json.loads((out / f"{name}.json").read_text())
    with np.load(out / f"{name}.npz") as z:
        return {int(r): {t: z[f"{r}|{t}"].astype(resolve_dtype(kinds[t])) for t in taps} for r in rows}


def fresh_capture(spec: ModelSpec, run, rows, taps, cap: str | None = None, timeout: float = 900) -> tuple[dict, dict]:
    """The target rows of `run` captured by spec's model, and by its float64 twin where run.twin,
    in a fresh Python process (under instruction-set cap `cap` where given: checked here first, a
    cap this CPU cannot honour is a llamaspec.caps.DeviceError; the process starts with the
    table's variables): ({(twin?, row): {tap: array}}, that process's record (compare.environment))."""
    env = None
    if cap is not None:
        env = caps.environ(caps.check(cap).name, os.environ)
    what = f"where: the second process under cap {cap}" if cap else f"where: the fresh process for '{run.key}'"
    with tempfile.TemporaryDirectory(prefix="llama-parity-where-") as tmp:
        tmp = Path(tmp)
        np.save(tmp / "ids.npy", run.ids)
        np.save(tmp / "mask.npy", run.mask)
        job = {"spec": spec.to_dict(), "ids": str(tmp / "ids.npy"), "mask": str(tmp / "mask.npy"),
               "rows": [int(r) for r in rows], "taps": list(taps), "out": str(tmp), "twin": bool(run.twin),
               "cap": cap}
        run_job(MODULE, job, tmp, timeout, what, env=env)
        got = {(twin, r): acts for twin in ((False, True) if run.twin else (False,))
               for r, acts in _rows(tmp, "twin" if twin else "model", rows, taps).items()}
        return got, json.loads((tmp / "side.json").read_text())


if __name__ == "__main__":
    sys.exit(main())
