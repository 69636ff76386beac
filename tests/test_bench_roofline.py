"""bench/bench_roofline.py: the work and bytes it counts, and a run on CPU with given peaks
(the GPU check runs it on a lent GPU with the device's own)."""

import json

import numpy as np
import pytest

from bench import bench_roofline as roof
from llamaspec import LlamaConfig, Policy, expected_shapes
from llamaspec.shapes import shape_config
from llamaspec.testing import TINY


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "smollm2-135m", "tiny"])
def test_counted_work_and_bytes_follow_the_checkpoint_shapes(shape):
    """matrix_params counted another way: every 2-D block weight of the checkpoint's own
    shapes (llamaspec.expected_shapes), embedding and lm_head apart; the 1B shape is Llama 3.2
    1B (1.24e9 parameters with its tied embedding)."""
    cfg = LlamaConfig.from_dict(TINY if shape == "tiny" else shape_config(shape))
    shapes = expected_shapes(cfg)
    blocks = sum(int(np.prod(s)) for k, s in shapes.items() if len(s) == 2 and ".layers." in k)
    assert roof.matrix_params(cfg) == blocks
    if shape == "llama-3.2-1b":
        assert abs(sum(int(np.prod(s)) for s in shapes.values()) - 1.2358e9) < 1e6
    T = 64
    causal_pairs = T * (T + 1) // 2
    expected = (2 * blocks * T + 2 * cfg.vocab_size * cfg.hidden_size
                + cfg.num_hidden_layers * 4 * cfg.num_attention_heads * cfg.head_dim * causal_pairs)
    assert roof.prefill_flops(cfg, T) == expected
    bf16 = Policy.get("bf16")
    kv_per_slot = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    weights = (blocks + cfg.vocab_size * cfg.hidden_size) * 2
    assert roof.decode_bytes(cfg, bf16, 4, 100) == weights + kv_per_slot * 100 * 4
    assert roof.decode_bytes(cfg, Policy.get("fp32"), 4, 100) == 2 * (weights + kv_per_slot * 100 * 4)


def test_device_peaks_by_name_or_flags():
    assert roof.device_peaks("NVIDIA H200", None, None) == (989.5e12, 4800e9)
    assert roof.device_peaks("NVIDIA H200", 500.0, None) == (500e12, 4800e9)
    assert roof.device_peaks(None, None, None) == (None, None)
    assert roof.device_peaks("Some GPU", None, 100.0) == (None, 100e9)


def test_a_run_on_cpu_reports_each_case_against_its_roofline(tmp_path, capsys):
    out = tmp_path / "roof.json"
    assert roof.main(["--shape", "tiny", "--policy", "fp32", "--prefill", "16", "--decode-batch", "2",
                      "--decode-prompt", "8", "--decode-steps", "2", "--repeats", "1",
                      "--impl", "torchref", "jaxmodel", "--peak-tflops", "1", "--hbm-gbs", "10",
                      "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["results"]
    assert {(r["case"], r["impl"]) for r in rows} == {
        (c, i) for c in ("prefill 16", "decode batch 2 (prompt 8)") for i in ("torchref", "jaxmodel")}
    cfg = LlamaConfig.from_dict(TINY)
    for r in rows:
        want = (roof.prefill_flops(cfg, 16) / 1e12 if r["case"].startswith("prefill")
                else roof.decode_bytes(cfg, Policy.get("fp32"), 2, 8 + 3 / 2) / 10e9)
        assert r["roofline_s"] == pytest.approx(want, rel=1e-12)
        assert r["median_s"] > 0 and r["x_roofline"] == pytest.approx(r["roofline_s"] / r["median_s"])
    assert "x roofline" in capsys.readouterr().out


def test_bench_models_interleaves_policies_and_compares_with_fp32(tiny_dir):
    """bench_models.run_policies: one row per (policy, case, impl), every policy's models run
    in the same rounds (each case once per round and model), x_sdpa against sdpa at the same
    policy, x_fp32 the median over the same implementation's fp32 median (none at fp32)."""
    from bench import bench_models as bm
    folder = tiny_dir("gqa")
    ids = np.arange(3, 13)[None]
    calls = []

    def run(m):
        calls.append(id(m))
        return bm.prefill_case(m, ids)
    cases = [{"name": "prefill 10", "unit": "s", "run": run}]
    rows = bm.run_policies(folder, ["fp32", "bf16"], ["torchref", "sdpa"], cases, 2, lambda msg: None)
    assert [(r["policy"], r["impl"]) for r in rows] == [("fp32", "torchref"), ("fp32", "sdpa"),
                                                       ("bf16", "torchref"), ("bf16", "sdpa")]
    # the first calls, then each round runs all four models (both policies): not a policy's
    # rounds before the other's; each round starts one model later than the one before
    assert len(calls) == 4 * 3 and len(set(calls[:4])) == 4
    assert calls[4:8] == calls[:4] and calls[8:] == calls[1:4] + calls[:1]
    by = {(r["policy"], r["impl"]): r for r in rows}
    for (policy, impl), r in by.items():
        assert len(r["all_s"]) == 2 and r["median_s"] == float(np.median(r["all_s"]))
        assert len(r["minor_faults"]) == 2 and all(isinstance(f, int) and f >= 0 for f in r["minor_faults"])
        assert r["x_sdpa"] == pytest.approx(by[(policy, "sdpa")]["median_s"] / r["median_s"])
        if policy == "fp32":
            assert r["x_fp32"] is None
        else:
            assert r["x_fp32"] == pytest.approx(r["median_s"] / by[("fp32", impl)]["median_s"])
    assert "/ fp32" in bm.table(rows, {}) and "faults" in bm.table(rows, {})
