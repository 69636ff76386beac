"""Batch-invariant mode: its cost against the default mode, and whether it holds.

    .venv/bin/python -m bench.bench_invariant [--checkpoint DIR] [--policy fp32 bf16]
        [--impl torchref jaxmodel] [--prompt-len 128] [--batch 1 8] [--decode 16]
        [--repeats 2] [--check] [--probe] [--out FILE]

Timing (default): prefill of [B, prompt_len] prompts and decode ms/token (B rows, greedy
steps after a prefill), default and invariant mode taking turns in each repeat, median of repeats after
a warm-up (which includes JAX compilation); the ratio invariant/default per row.
--check: one target prompt alone vs inside batches of 2, 8 and 32 with random companions
of mixed lengths, left and right padding: the fraction of its logits that are bitwise
equal to the alone run, default vs invariant mode.
--probe: one row's result at each row count for the libraries' kernels and for the
fixed-order ones (docs/invariance.md: why the invariant mode does not rely on the former).
Prints tables and writes JSON (default bench/results/invariant-<time>.json).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.bench_models import decode_seconds_per_token
from compare.environment import environment


def time_modes(models, ids, n_decode, repeats):
    """{mode: (prefill seconds, decode seconds per token)}, medians of `repeats` after a
    warm-up of each model (JAX compiles then). The modes take turns within each repeat, so
    a slow spell of the machine falls on both instead of on whichever ran then."""
    mask, total = np.ones_like(ids), ids.shape[1] + n_decode

    def prefill(m):
        t0 = time.perf_counter()
        m.prefill(ids, mask, total)
        return time.perf_counter() - t0

    for m in models.values():
        prefill(m), decode_seconds_per_token(m, ids, n_decode)
    times = {mode: ([], []) for mode in models}
    for _ in range(repeats):
        for mode, m in models.items():
            times[mode][0].append(prefill(m))
            times[mode][1].append(decode_seconds_per_token(m, ids, n_decode))
    return {mode: (statistics.median(p), statistics.median(d)) for mode, (p, d) in times.items()}


def run_timing(args, folder, vocab):
    rows = []
    for policy in args.policy:
        for impl in args.impl:
            module = importlib.import_module(impl)
            models = {mode: module.from_pretrained(folder, policy=policy, batch_invariant=mode == "invariant")
                      for mode in ("default", "invariant")}
            for B in args.batch:
                ids = np.random.default_rng(0).integers(3, vocab, (B, args.prompt_len))
                print(f"  {policy:>5} {impl:<9} B={B:<3} ...", end="", flush=True)
                got = time_modes(models, ids, args.decode, args.repeats)
                print("".join(f" {mode}: prefill {p * 1e3:.1f} ms, decode {d * 1e3:.1f} ms/token;"
                              for mode, (p, d) in got.items()), flush=True)
                (p0, d0), (p1, d1) = got["default"], got["invariant"]
                rows.append({"policy": policy, "impl": impl, "batch": B,
                             "prefill_ms": {"default": p0 * 1e3, "invariant": p1 * 1e3, "ratio": p1 / p0},
                             "decode_ms_per_token": {"default": d0 * 1e3, "invariant": d1 * 1e3,
                                                     "ratio": d1 / d0}})
    cpu = environment("fp32")
    print(f"\nprefill [B, {args.prompt_len}] and decode ms/token ({args.decode} steps), median of "
          f"{args.repeats}; ratio = invariant / default; CPU: {cpu['cpu']} ({cpu['cpu isa']}; caps: "
          f"{cpu['isa caps']}); GPU: {cpu.get('gpu', 'none')}")
    print(f"{'policy':<7}{'impl':<10}{'B':>3}{'prefill ms':>12}{'inv':>10}{'ratio':>7}"
          f"{'decode ms':>11}{'inv':>9}{'ratio':>7}")
    for r in rows:
        p, d = r["prefill_ms"], r["decode_ms_per_token"]
        print(f"{r['policy']:<7}{r['impl']:<10}{r['batch']:>3}{p['default']:>12.1f}{p['invariant']:>10.1f}"
              f"{p['ratio']:>7.2f}{d['default']:>11.1f}{d['invariant']:>9.1f}{d['ratio']:>7.2f}")
    return rows


def _bits(x):
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def run_check(args, folder, vocab, target_len=21, width=48):
    """Fraction of the target's logits bitwise equal to its alone run, per batching."""
    rng = np.random.default_rng(0)
    target = rng.integers(3, vocab, target_len)
    rows = []
    for policy in args.policy:
        for impl in args.impl:
            module = importlib.import_module(impl)
            for mode in ("default", "invariant"):
                m = module.from_pretrained(folder, policy=policy, batch_invariant=mode == "invariant")
                alone = _bits(m(target[None]))[0]
                for B in (2, 8, 32):
                    for padding in ("left", "right"):
                        r = np.random.default_rng(B)
                        ids = r.integers(3, vocab, (B, width))
                        lengths = r.integers(1, width + 1, B)
                        row = int(r.integers(B))
                        lengths[row] = target_len
                        mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int64)
                        ids[row, :target_len] = target
                        if padding == "left":
                            ids = np.stack([np.roll(ids[b], width - n) for b, n in enumerate(lengths)])
                            mask = np.stack([np.roll(mask[b], width - n) for b, n in enumerate(lengths)])
                        got = _bits(m(ids, mask))[row][mask[row].astype(bool)]
                        frac = float((got == alone).mean())
                        rows.append({"policy": policy, "impl": impl, "mode": mode, "batch": B,
                                     "padding": padding, "bitwise_equal_fraction": frac})
                        print(f"  {policy:>5} {impl:<9} {mode:<9} B={B:<3} {padding:<5} "
                              f"bitwise-equal fraction {frac:.4f}", flush=True)
    return rows


def run_probe():
    """One fixed row through a matmul at each row count M: how many distinct results."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax import lax

    import jaxmodel  # noqa: F401 (x64)
    from jaxmodel import kernels
    from jaxmodel.dtypes import compiler_options

    out = {}
    rng = np.random.default_rng(0)
    counts = [1, 2, 3, 4, 5, 8, 13, 16, 64, 100, 256, 1024]
    w = rng.standard_normal((1536, 576)).astype(np.float32)
    x = rng.standard_normal(576).astype(np.float32)
    dot = jax.jit(lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST),
                  compiler_options=compiler_options())
    ffi_gemm = jax.jit(kernels.gemm)
    packed_w = kernels.PackedWeight.of(w, "float32", "float32")
    red = jax.jit(lambda a: jnp.sum(a, -1), compiler_options=compiler_options())

    def softmax(a):  # rows of 9 x 64 scores, as attention's [heads, keys]
        a = a.reshape(a.shape[0], 9, 64)
        e = jnp.exp(a - jnp.max(a, -1, keepdims=True))
        return (e / jnp.sum(e, -1, keepdims=True)).reshape(a.shape[0], -1)
    smx = {mode: jax.jit(softmax, compiler_options=compiler_options(mode == "invariant"))
           for mode in ("default", "invariant")}
    from llamaspec import fixed_order
    packed = fixed_order.pack(w)
    for name, fn in {
        "torch f32 linear": lambda X: torch.nn.functional.linear(torch.from_numpy(X), torch.from_numpy(w)).numpy(),
        "fixed_order f32 gemm": lambda X: fixed_order.gemm(X, packed, w.shape[0]),
        "torch bf16 linear": lambda X: torch.nn.functional.linear(
            torch.from_numpy(X).bfloat16(), torch.from_numpy(w).bfloat16()).float().numpy(),
        "xla f32 dot": lambda X: np.asarray(dot(X, w)),
        "xla f32 fixed_order FFI gemm": lambda X: np.asarray(ffi_gemm(X, packed_w)),
        "xla f32 row sum": lambda X: np.asarray(red(X))[:, None],
        "xla f32 softmax, default options": lambda X: np.asarray(smx["default"](X)),
        "xla f32 softmax, invariant options": lambda X: np.asarray(smx["invariant"](X)),
    }.items():
        seen, where = [], []
        for M in counts:
            X = rng.standard_normal((M, 576)).astype(np.float32)
            for i in sorted({0, M - 1}):
                X[i] = x
                y = fn(X)[i]
                k = next((j for j, s in enumerate(seen) if np.array_equal(s, y)), None)
                if k is None:
                    seen.append(y)
                    k = len(seen) - 1
                where.append(f"{M}/{i}:{k}")
        out[name] = where
        print(f"  {name:<34} result class per (rows/row index): {' '.join(where)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--policy", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--impl", nargs="+", default=["torchref", "jaxmodel"], choices=["torchref", "jaxmodel"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="invariance fractions instead of timing")
    ap.add_argument("--probe", action="store_true", help="kernel measurements instead of timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from llama_parity.fetch import resolve_checkpoint
    folder = resolve_checkpoint(args.checkpoint)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    kind = "probe" if args.probe else "check" if args.check else "timing"
    run = {"probe": run_probe, "check": functools.partial(run_check, args, folder, vocab),
           "timing": functools.partial(run_timing, args, folder, vocab)}[kind]
    results = run()
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / \
        f"invariant-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"checkpoint": str(folder), "kind": kind, "args": vars(args),
                               "environment": environment("fp32"), "results": results}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
