"""The layer-streamed comparison's memory: no whole model loaded, and a peak that does not grow
with depth (bench/stream_memory.py)."""

import json

import numpy as np
import pytest

from compare import compare_models
from compare.ladder import stream


def test_streamed_comparison_never_loads_a_whole_model(tiny_dir, monkeypatch):
    """Everything a streamed Report holds (its plans in the environment included) comes from the
    LayerRunners: asking a CheckpointModel for its loaded model is an error here."""
    def whole(self):
        raise AssertionError(f"{self.package} at {self.policy.name} loaded whole in a streamed comparison")
    monkeypatch.setattr(stream.CheckpointModel, "model", property(whole))
    ids = np.random.default_rng(0).integers(3, 90, (1, 12))
    report = compare_models("torchref", "jaxmodel", tiny_dir(), inputs=ids, policy="bf16", stream=True)
    assert report.run["path"] == "streamed"
    assert any(k.startswith("candidate plan") for k in report.environment)


@pytest.mark.slow
def test_streamed_peak_does_not_grow_with_depth(tmp_path):
    """Llama-3.2-1B's layer shape at 2 and 6 layers, each comparison in its own process: the
    deeper one's peak RSS within 1.1x the shallower one's, on each backend that streams."""
    from bench import stream_memory
    out = tmp_path / "memory.json"
    assert stream_memory.main(["--depths", "2", "6", "--backends", "fast", "reference", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert not [r for r in data["results"] if "error" in r], data["results"]
    assert set(data["ratios"]) == {"fast", "reference"}
    for backend, ratio in data["ratios"].items():
        assert ratio <= stream_memory.LIMIT, (backend, data["results"])
