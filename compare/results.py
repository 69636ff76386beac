"""The JSON form of every result the package returns (the ladder's Report, the probes'
ProbeResult): dataclasses written as plain JSON, non-finite floats as strings."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np


def jsonable(x):
    """JSON-safe copy: non-finite floats as strings, numpy scalars as Python numbers."""
    if isinstance(x, (np.floating, np.integer)):
        return jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


class JsonResult:
    """to_dict / to_json for the result dataclasses."""

    def to_dict(self) -> dict:
        return jsonable(dataclasses.asdict(self))

    def to_json(self, path) -> Path:
        from llamaspec.files import atomic_write
        return atomic_write(Path(path), json.dumps(self.to_dict(), indent=1), "JSON report")
