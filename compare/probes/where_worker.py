"""Fresh-process runner of `probe where` (rerun in a fresh process):
python -m compare.probes.where_worker JOB.json

JOB.json: {"spec": ModelSpec fields, "ids", "mask": .npy paths, "rows": [row, ...],
"taps": [tap, ...], "out": .npz path}. Loads the model from its spec, captures every tap
and saves the asked rows ("row|tap" keys; 16-bit floats widened to float32, exact) and
their dtypes (dtypes.json next to it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from llamaspec.files import atomic_write

from ..adapters import as_implementation
from .models import ModelSpec


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m compare.probes.where_worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    spec = ModelSpec(**job["spec"])
    impl = as_implementation(spec.load(), spec.checkpoint)
    _, acts = impl.capture(np.load(job["ids"]), np.load(job["mask"]), job["taps"])
    out, dtypes = {}, {}
    for t in job["taps"]:
        a = np.asarray(acts[t])
        dtypes[t] = str(a.dtype)
        for r in job["rows"]:
            out[f"{r}|{t}"] = a[r].astype(np.float32) if a.dtype.itemsize < 4 else a[r]
    atomic_write(Path(job["out"]), lambda f: np.savez(f, **out), "captured rows")
    atomic_write(Path(job["out"]).parent / "dtypes.json", json.dumps(dtypes), "tap dtypes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
