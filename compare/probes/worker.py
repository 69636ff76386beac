"""Fresh-process runner for the determinism probe: python -m compare.probes.worker JOB.json

JOB.json: {"spec": ModelSpec fields, "ids": path.npy, "mask": path.npy, "out": path.npy}.
Loads the model from its spec, runs one forward pass and saves the logits (16-bit
floats widened to float32, which is exact: np.save has no bfloat16).
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m compare.probes.worker JOB.json", file=sys.stderr)
        return 2
    from .models import ModelSpec, ProbeModel
    job = json.loads(open(argv[0]).read())
    spec = ModelSpec(**job["spec"])
    pm = ProbeModel(spec.load(), spec=spec)
    out = pm.logits(np.load(job["ids"]), np.load(job["mask"]))
    if out.dtype.itemsize < 4:
        out = out.astype(np.float32)
    np.save(job["out"], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
