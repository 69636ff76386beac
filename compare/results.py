"""The JSON form of every result the package returns (the ladder's Report, the probes'
ProbeResult): dataclasses written as plain JSON, non-finite floats as strings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from llamaspec.files import atomic_write, json_safe, json_text


def jsonable(x):
    """JSON-safe copy: non-finite floats as strings, numpy scalars as Python numbers
    (llamaspec.files.json_safe, the rule of every JSON the tool writes)."""
    return json_safe(x)


class JsonResult:
    """to_dict / to_json for the result dataclasses."""

    def to_dict(self) -> dict:
        return jsonable(dataclasses.asdict(self))

    def to_json(self, path) -> Path:
        return atomic_write(Path(path), json_text(self.to_dict(), indent=1), "JSON report")
