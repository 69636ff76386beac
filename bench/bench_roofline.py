"""Prefill and decode against the device's roofline: how far each implementation is from what
the hardware allows, on a model of a given shape with random weights.

    python -m bench.bench_roofline [--shape llama-3.2-1b|smollm2-135m|...|tiny] [--checkpoint DIR] [--policy bf16]
        [--prefill 2048] [--decode-batch 1 8] [--decode-prompt 512] [--decode-steps 32]
        [--repeats 5] [--impl torchref jaxmodel sdpa] [--peak-tflops X] [--hbm-gbs Y] [--out FILE]

The roofline of a case is the least time the device could take for it:
- prefill (batch 1, T tokens, logits at the last position, as bench_models runs it): its
  floating-point work at the device's peak rate for the policy's products (bf16 tensor-core
  peak, dense). The work counted is what a prompt needs: every weight matrix times every
  token, causal attention (query t with keys 0..t, scores and weighted sums) and the lm_head
  for the last position; implementations that compute masked scores do more than this.
- decode (batch B, one token per row per step): the bytes a step must read from device memory
  at the memory's bandwidth: every weight matrix and the lm_head once, and each row's keys and
  values over its context (the mean context over the steps).
`x roofline` = roofline / measured (1.0 would be the hardware's limit).

Peaks: known GPUs by name (DEVICES: datasheet bf16 dense tensor TFLOP/s and HBM GB/s of the SXM
parts); any other device needs --peak-tflops and --hbm-gbs, else only the times are printed.
Timing is bench_models': each implementation in turn per round, median of the rounds, the
first call apart. Without --checkpoint a checkpoint of --shape is written with random weights
(stored in the policy's param dtype) to a temporary folder: the questions asked here do not
depend on trained values.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_models import IMPLS, decode_case, prefill_case, run_policy
from llamaspec import LlamaConfig, Policy, shapes
from llamaspec.checkpoint import numpy_dtype
from llamaspec.files import atomic_write

# The real models' shapes (llamaspec.shapes, as `llama-parity make-checkpoint` writes them), and
# llamaspec.testing's tiny one for a quick run on a CPU.
SHAPES = (*shapes.SHAPES, "tiny")

# name fragment -> (bf16 dense tensor-core TFLOP/s, HBM GB/s): NVIDIA's datasheets, SXM parts
DEVICES = {"H200": (989.5, 4800.0), "H100": (989.5, 3350.0), "A100": (312.0, 2039.0)}


def matrix_params(cfg: LlamaConfig) -> int:
    """Weights multiplied by every token: the blocks' projections (embedding and lm_head apart)."""
    d, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * cfg.intermediate_size
    return cfg.num_hidden_layers * per_layer


def prefill_flops(cfg: LlamaConfig, T: int) -> int:
    """A T-token prompt's work at batch 1: 2 flops per weight per token, causal attention
    (query t reads t + 1 keys: scores and weighted sums, 2 flops each per head dimension), the
    lm_head at the last position."""
    attention = 2 * 2 * cfg.num_attention_heads * cfg.head_dim * (T * (T + 1) // 2)
    return 2 * matrix_params(cfg) * T + cfg.num_hidden_layers * attention + 2 * cfg.vocab_size * cfg.hidden_size


def decode_bytes(cfg: LlamaConfig, policy: Policy, B: int, context: float) -> float:
    """What one decode step must read: every matrix and the lm_head once (param dtype), each
    row's keys and values over `context` slots (compute dtype)."""
    weight, cache = numpy_dtype(policy.param_dtype).itemsize, numpy_dtype(policy.compute_dtype).itemsize
    weights = (matrix_params(cfg) + cfg.vocab_size * cfg.hidden_size) * weight
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * context * B * cache
    return weights + kv


def device_peaks(name: str | None, peak_tflops: float | None, hbm_gbs: float | None):
    """(FLOP/s, bytes/s) from the flags, else from DEVICES by the device's name, else (None, None)."""
    known = next((v for k, v in DEVICES.items() if name and k in name), (None, None))
    tflops = peak_tflops if peak_tflops is not None else known[0]
    gbs = hbm_gbs if hbm_gbs is not None else known[1]
    return (None if tflops is None else tflops * 1e12), (None if gbs is None else gbs * 1e9)


def with_roofline(rows: list[dict], ideal: dict[str, float]) -> list[dict]:
    """Each row with roofline_s (its case's least time, or None) and x_roofline = roofline / measured."""
    for r in rows:
        r["roofline_s"] = ideal.get(r["case"])
        r["x_roofline"] = None if r["roofline_s"] is None else r["roofline_s"] / r["median_s"]
    return rows


def table(rows: list[dict], device: str) -> str:
    lines = [f"device: {device}",
             f"{'policy':<7}{'case':<30}{'impl':<10}{'median':>12}{'first s':>9}{'roofline':>12}{'x roofline':>12}"]
    for r in rows:
        unit = "ms" if r["unit"] == "s" else "ms/t"
        roof = "" if r["roofline_s"] is None else f"{r['roofline_s'] * 1e3:.2f} {unit}"
        x = "" if r["x_roofline"] is None else f"{r['x_roofline']:.2f}"
        lines.append(f"{r['policy']:<7}{r['case']:<30}{r['impl']:<10}{r['median_s'] * 1e3:>9.2f} {unit:<3}"
                     f"{r['first_s']:>8.2f}{roof:>12}{x:>12}")
    return "\n".join(lines)


def run_one(args, policy: Policy, scratch: str, flops_s, bytes_s, rng, say) -> list[dict]:
    """Every case at one policy, on --checkpoint or on a random checkpoint of --shape written
    under scratch; rows with their rooflines."""
    from llamaspec.testing import make_checkpoint
    folder = args.checkpoint
    if folder is None:
        t0 = time.perf_counter()
        folder = Path(scratch) / f"{args.shape}-shaped"
        if args.shape == "tiny":
            make_checkpoint(folder, dtype=policy.param_dtype, seed=0)
        else:
            shapes.write_checkpoint(folder, args.shape, dtype=policy.param_dtype, seed=0)
        say(f"  {args.shape}-shaped random checkpoint ({policy.param_dtype}) written in "
            f"{time.perf_counter() - t0:.1f} s")
    cfg = LlamaConfig.from_dict(json.loads((Path(folder) / "config.json").read_text()))
    cases, ideal = [], {}
    for T in args.prefill:
        ids = rng.integers(3, cfg.vocab_size, (1, T))
        name = f"prefill {T}"
        cases.append({"name": name, "unit": "s", "run": lambda m, ids=ids: prefill_case(m, ids)})
        if flops_s:
            ideal[name] = prefill_flops(cfg, T) / flops_s
    for B in args.decode_batch:
        ids = rng.integers(3, cfg.vocab_size, (B, args.decode_prompt))
        name = f"decode batch {B} (prompt {args.decode_prompt})"
        cases.append({"name": name, "unit": "s/token",
                      "run": lambda m, ids=ids: decode_case(m, ids, args.decode_steps)})
        if bytes_s:
            context = args.decode_prompt + (args.decode_steps + 1) / 2
            ideal[name] = decode_bytes(cfg, policy, B, context) / bytes_s
    return with_roofline(run_policy(folder, policy.name, args.impl, cases, args.repeats, say), ideal)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    ap.add_argument("--checkpoint", default=None, help="an HF folder instead of random weights of --shape")
    ap.add_argument("--policy", nargs="+", default=["bf16"])
    ap.add_argument("--prefill", nargs="+", type=int, default=[2048])
    ap.add_argument("--decode-batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impl", nargs="+", default=["torchref", "jaxmodel", "sdpa"], choices=IMPLS)
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak for the products")
    ap.add_argument("--hbm-gbs", type=float, default=None, help="the device memory's bandwidth, GB/s")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/roofline-<time>.json)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    import torch

    from compare.environment import environment
    say = lambda msg: print(msg, flush=True)  # noqa: E731
    on_gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    flops_s, bytes_s = device_peaks(device if on_gpu else None, args.peak_tflops, args.hbm_gbs)
    rows, rng = [], np.random.default_rng(0)
    for policy_name in args.policy:
        policy = Policy.get(policy_name)
        with tempfile.TemporaryDirectory() as scratch:    # the random checkpoint, removed after
            rows += run_one(args, policy, scratch, flops_s, bytes_s, rng, say)

    peaks = ("no roofline: unknown device peaks (--peak-tflops, --hbm-gbs)" if not (flops_s or bytes_s) else
             f"peaks: {flops_s and flops_s / 1e12} TFLOP/s (prefill), {bytes_s and bytes_s / 1e9} GB/s (decode)")
    print(f"\n{args.shape} shape; {peaks}; median of {args.repeats} interleaved rounds, first call apart")
    print(table(rows, device))
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / \
        f"roofline-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps({"shape": args.shape, "checkpoint": str(args.checkpoint), "device": device,
                                  "peak_flops_s": flops_s, "hbm_bytes_s": bytes_s,
                                  "decode_prompt": args.decode_prompt, "decode_steps": args.decode_steps,
                                  "environment": environment(args.policy[0], True), "results": rows},
                                 indent=1), "roofline results")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
