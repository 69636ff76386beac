"""Fresh-process runner of `probe where` (rerun in a fresh process; the device circumstance's
side under an instruction-set cap): python -m compare.probes.where_worker JOB.json

JOB.json: {"spec": ModelSpec fields, "ids", "mask": .npy paths, "rows": [row, ...],
"taps": [tap, ...], "out": .npz path}. Loads the model from its spec, captures every tap
and saves the asked rows ("row|tap" keys; 16-bit floats widened to float32, exact) and
their dtypes (dtypes.json next to it). A capped job adds "cap": a name of llamaspec.caps.CAPS,
whose variables this process sets before any framework starts (the libraries read them once,
when they load), "twin_out": the same for the model's float64 twin, captured here too (so a bug
that shows only under the cap is in the fp64 rung), and "side": where this process's record goes
(compare.environment: the CPU, the caps in force, the model's plan).

capped_capture() is the other end: it writes the job, starts the process and reads the rows.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from llamaspec import caps
from llamaspec.files import atomic_write

from ..adapters import as_implementation
from ..environment import environment
from ..metrics import resolve_dtype
from .models import ModelSpec, fp64_twin
from .worker import run_job

FRAMEWORKS = ("torch", "jax", "jaxlib")


def start_under(cap: str) -> None:
    """This process's environment under `cap` (llamaspec.caps.environ), before any framework
    starts: a framework loaded already has read its variables, and the cap would not act on it."""
    caps.check(cap)
    started = [m for m in FRAMEWORKS if m in sys.modules]
    if started:
        raise RuntimeError(f"where worker: {', '.join(started)} started before the cap {cap!r} was set, so the cap "
                           "would not act on it")
    os.environ.update(caps.environ(cap, os.environ))


def _save(impl, job: dict, out: str, dtypes_path: Path) -> None:
    _, acts = impl.capture(np.load(job["ids"]), np.load(job["mask"]), job["taps"])
    rows, dtypes = {}, {}
    for t in job["taps"]:
        a = np.asarray(acts[t])
        dtypes[t] = str(a.dtype)
        for r in job["rows"]:
            rows[f"{r}|{t}"] = a[r].astype(np.float32) if a.dtype.itemsize < 4 else a[r]
    atomic_write(Path(out), lambda f: np.savez(f, **rows), "captured rows")
    atomic_write(dtypes_path, json.dumps(dtypes), "tap dtypes")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m compare.probes.where_worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    if job.get("cap"):
        start_under(job["cap"])
    spec = ModelSpec(**job["spec"])
    model = spec.load()
    impl = as_implementation(model, spec.checkpoint)
    _save(impl, job, job["out"], Path(job["out"]).parent / "dtypes.json")
    if job.get("twin_out"):
        twin = fp64_twin(model)
        if twin is None:
            raise TypeError(f"{spec.impl}: no float64 twin (float64()) to capture in this process")
        _save(as_implementation(twin), job, job["twin_out"], Path(job["twin_out"] + ".dtypes.json"))
    if job.get("side"):
        env = environment(spec.policy, uses_jax=getattr(impl, "package", None) == "jaxmodel", sides={"model": impl})
        atomic_write(Path(job["side"]), json.dumps(env, default=str), "the process's record")
    return 0


def _rows(npz: Path, dtypes: Path, rows, taps) -> dict:
    kinds = json.loads(dtypes.read_text())
    with np.load(npz) as z:
        return {int(r): {t: z[f"{r}|{t}"].astype(resolve_dtype(kinds[t])) for t in taps} for r in rows}


def capped_capture(spec: ModelSpec, run, rows, taps, cap: str, timeout: float = 900) -> tuple[dict, dict]:
    """The target rows of `run` captured by spec's model and by its float64 twin in a fresh
    Python process started under instruction-set cap `cap` (checked here first: a cap this CPU
    cannot honour is a llamaspec.caps.DeviceError): ({(twin?, row): {tap: array}}, that process's
    record (compare.environment))."""
    caps.check(cap)
    with tempfile.TemporaryDirectory(prefix="llama-parity-where-") as tmp:
        tmp = Path(tmp)
        np.save(tmp / "ids.npy", run.ids)
        np.save(tmp / "mask.npy", run.mask)
        job = {"spec": spec.to_dict(), "ids": str(tmp / "ids.npy"), "mask": str(tmp / "mask.npy"),
               "rows": [int(r) for r in rows], "taps": list(taps), "out": str(tmp / "rows.npz"),
               "twin_out": str(tmp / "twin.npz"), "cap": cap, "side": str(tmp / "side.json")}
        run_job("compare.probes.where_worker", job, tmp, timeout, f"where: the second process under cap {cap}")
        got = {(False, r): acts for r, acts in _rows(tmp / "rows.npz", tmp / "dtypes.json", rows, taps).items()}
        got.update({(True, r): acts for r, acts in
                    _rows(tmp / "twin.npz", tmp / "twin.npz.dtypes.json", rows, taps).items()})
        return got, json.loads((tmp / "side.json").read_text())


if __name__ == "__main__":
    sys.exit(main())
