"""Prefill and decode speed of torchref, jaxmodel and transformers, side by side, one run.

    .venv/bin/python -m bench.bench_models [--checkpoint DIR] [--policy fp32 bf16]
                                           [--prompt-len 256] [--decode 32] [--repeats 3]

Prefill: one forward over a [1, prompt_len] prompt (last-position logits), median of
repeats after one warm-up (which includes JAX compilation). Decode: ms per token over
`decode` greedy steps after a prefill, with a KV cache in every implementation.
Prints a table and writes JSON to bench/results/models-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from compare.environment import environment


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: compilation, allocator, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_ours(module, folder, policy, ids, n_decode, repeats):
    return time_prefill_decode(module.from_pretrained(folder, policy=policy), ids, n_decode,
                               repeats)


def time_prefill_decode(m, ids, n_decode, repeats):
    """(prefill seconds, decode seconds per token) of a loaded model of ours: medians of
    `repeats` runs after a warm-up (which includes JAX compilation)."""
    prefill = _median_time(lambda: m.prefill(ids, np.ones_like(ids), ids.shape[1] + n_decode), repeats)
    decode_seconds_per_token(m, ids, n_decode)
    decode = statistics.median(decode_seconds_per_token(m, ids, n_decode) for _ in range(repeats))
    return prefill, decode


def decode_seconds_per_token(m, ids, n_decode) -> float:
    """One prefill of ids (untimed), then n_decode greedy steps: seconds per step."""
    logits, cache = m.prefill(ids, np.ones_like(ids), ids.shape[1] + n_decode)
    t0 = time.perf_counter()
    for _ in range(n_decode):
        logits, cache = m.decode(cache, np.asarray(logits).argmax(-1))
    return (time.perf_counter() - t0) / n_decode


def bench_transformers(folder, policy, ids, n_decode, repeats):
    import torch
    from transformers import LlamaForCausalLM

    from llamaspec import Policy
    from torchref.dtypes import dt
    dtype = dt(Policy.get(policy).param_dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # transformers follows torch's global fp32 matmul mode; pin it like our policies do.
    torch.backends.cuda.matmul.fp32_precision = "tf32" if policy == "tf32" else "ieee"
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval().to(device)
    x = torch.from_numpy(ids).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    @torch.inference_mode()
    def prefill_run():
        out = hf(x, use_cache=True, logits_to_keep=1)
        sync()
        return out

    prefill = _median_time(prefill_run, repeats)

    @torch.inference_mode()
    def decode_run():
        out = hf(x, use_cache=True, logits_to_keep=1)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(n_decode):
            out = hf(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        return (time.perf_counter() - t0) / n_decode

    decode_run()
    decode = statistics.median(decode_run() for _ in range(repeats))
    return prefill, decode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--policy", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impl", nargs="+", default=["torchref", "jaxmodel", "transformers"],
                    choices=["torchref", "jaxmodel", "transformers"])
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/models-<time>.json)")
    args = ap.parse_args(argv)

    import jaxmodel
    import torchref
    from llama_parity.fetch import resolve_checkpoint

    folder = resolve_checkpoint(args.checkpoint)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    ids = np.random.default_rng(0).integers(3, vocab, (1, args.prompt_len))
    runners = {
        "torchref": lambda p: bench_ours(torchref, folder, p, ids, args.decode, args.repeats),
        "jaxmodel": lambda p: bench_ours(jaxmodel, folder, p, ids, args.decode, args.repeats),
        "transformers": lambda p: bench_transformers(folder, p, ids, args.decode, args.repeats),
    }
    impls = [(name, runners[name]) for name in args.impl]

    rows = []
    for policy in args.policy:
        for name, run in impls:
            print(f"  {policy:>5} {name:<12} ...", end="", flush=True)
            prefill, decode = run(policy)
            print(f" prefill {prefill * 1e3:8.1f} ms, decode {decode * 1e3:7.1f} ms/token", flush=True)
            rows.append({"policy": policy, "impl": name, "prefill_ms": prefill * 1e3,
                         "decode_ms_per_token": decode * 1e3})

    env = environment("fp32")
    print(f"\nprefill {args.prompt_len} tokens (batch 1) and decode ms/token ({args.decode} steps), "
          f"median of {args.repeats}; CPU: {env['cpu']} ({env['cpu isa']}; caps: {env['isa caps']}); "
          f"GPU: {env.get('gpu', 'none')}")
    print(f"{'policy':<7}{'impl':<14}{'prefill ms':>12}{'decode ms/tok':>15}")
    for r in rows:
        print(f"{r['policy']:<7}{r['impl']:<14}{r['prefill_ms']:>12.1f}{r['decode_ms_per_token']:>15.1f}")

    out = Path(args.out) if args.out else Path(__file__).parent / "results" / \
        f"models-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"checkpoint": str(folder), "prompt_len": args.prompt_len,
                               "decode_steps": args.decode, "repeats": args.repeats,
                               "environment": env, "results": rows}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
