"""Batch-invariant mode: its cost against the default mode, and whether it holds.

    .venv/bin/python -m bench.bench_invariant [--checkpoint DIR] [--policy fp32 bf16]
        [--impl torchref jaxmodel] [--modes default kernels portable] [--prompt-len 128]
        [--batch 1 8] [--decode 16] [--repeats 2] [--check] [--probe] [--out FILE]

Modes: default (the fast backend) and the invariant backend's two implementations, kernels (the
fixed-order kernels, CPU code) and portable (products at one fixed shape, every other sum written
out: runs wherever torch or XLA runs), each model's plan choosing between them from
$LLAMA_PARITY_INVARIANT, which this script sets for each load (the plan reads it once, there) and
checks against the plan's record.
Timing (default): prefill of [B, prompt_len] prompts and decode ms/token (B rows, greedy
steps after a prefill), the modes taking turns in each repeat, median of repeats after
a warm-up (which includes JAX compilation); the ratio of each mode to the default one per row.
--check: one target prompt alone vs inside batches of 2, 8 and 32 with random companions
of mixed lengths, left and right padding: the fraction of its logits that are bitwise
equal to the alone run, per mode.
--probe: one row's result at each row count for the libraries' kernels and for the
fixed-order ones (docs/invariance.md: why the invariant mode does not rely on the former).
Prints tables and writes JSON (default bench/results/invariant-<time>.json).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
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


MODES = ("default", "kernels", "portable")


def load_mode(module, folder, policy: str, mode: str):
    """`module`'s model in `mode`: default (the fast backend), or the invariant backend through its
    `mode` implementation ($LLAMA_PARITY_INVARIANT set for this load only; the plan reads it once,
    at load). A plan that records another implementation is an error naming both."""
    from llamaspec.plan import INVARIANT_ENV
    if mode == "default":
        return module.from_pretrained(folder, policy=policy)
    before = os.environ.get(INVARIANT_ENV)
    os.environ[INVARIANT_ENV] = mode
    try:
        m = module.from_pretrained(folder, policy=policy, backend="invariant")
    finally:
        if before is None:
            os.environ.pop(INVARIANT_ENV, None)
        else:
            os.environ[INVARIANT_ENV] = before
    path = m.plan.op("products")
    if path.startswith("portable") != (mode == "portable"):
        raise RuntimeError(f"{module.__name__} {policy}: {INVARIANT_ENV}={mode} loaded a model whose plan says "
                           f"products: {path!r}")
    return m


def timing_row(models: dict, ids, n_decode: int, repeats: int) -> dict:
    """time_modes as a JSON row: prefill ms and decode ms/token per mode, and each mode's ratio to
    the "default" mode's (above 1: slower)."""
    got = time_modes(models, ids, n_decode, repeats)
    p0, d0 = got["default"]
    return {"prefill_ms": {mode: p * 1e3 for mode, (p, _) in got.items()},
            "decode_ms_per_token": {mode: d * 1e3 for mode, (_, d) in got.items()},
            "ratio": {mode: {"prefill": p / p0, "decode": d / d0} for mode, (p, d) in got.items() if mode != "default"}}


def run_timing(args, folder, vocab):
    rows = []
    for policy in args.policy:
        for impl in args.impl:
            module = importlib.import_module(impl)
            models, skipped = {}, {}
            for mode in args.modes:
                try:
                    models[mode] = load_mode(module, folder, policy, mode)
                except Exception as e:  # noqa: BLE001 - a mode that cannot load here is a row that says so
                    skipped[mode] = f"{type(e).__name__}: {e}"
                    print(f"  {policy:>5} {impl:<9} {mode}: not run ({skipped[mode]})", flush=True)
            paths = {mode: m.plan.op("products") for mode, m in models.items()}
            for B in args.batch:
                ids = np.random.default_rng(0).integers(3, vocab, (B, args.prompt_len))
                print(f"  {policy:>5} {impl:<9} B={B:<3} ...", end="", flush=True)
                row = timing_row(models, ids, args.decode, args.repeats)
                print("".join(f" {mode}: prefill {row['prefill_ms'][mode]:.1f} ms, decode "
                              f"{row['decode_ms_per_token'][mode]:.1f} ms/token;" for mode in models), flush=True)
                rows.append({"policy": policy, "impl": impl, "batch": B, **row, "paths": paths, "skipped": skipped})
    cpu = environment("fp32")
    print(f"\nprefill [B, {args.prompt_len}] and decode ms/token ({args.decode} steps), median of "
          f"{args.repeats}; x = mode / default; CPU: {cpu['cpu']} ({cpu['cpu isa']}; caps: "
          f"{cpu['isa caps']}); GPU: {cpu.get('gpu', 'none')}")
    print(timing_table(rows, args.modes))
    return rows


def timing_table(rows: list[dict], modes) -> str:
    lines = [f"{'policy':<7}{'impl':<10}{'B':>3}  {'mode':<9}{'prefill ms':>11}{'x':>7}{'decode ms/t':>13}{'x':>7}"]
    for r in rows:
        for mode in modes:
            if mode not in r["prefill_ms"]:
                lines.append(f"{r['policy']:<7}{r['impl']:<10}{r['batch']:>3}  {mode:<9}  not run: "
                             f"{r['skipped'].get(mode, '')[:80]}")
                continue
            x = r["ratio"].get(mode, {"prefill": 1.0, "decode": 1.0})
            lines.append(f"{r['policy']:<7}{r['impl']:<10}{r['batch']:>3}  {mode:<9}{r['prefill_ms'][mode]:>11.1f}"
                         f"{x['prefill']:>7.2f}{r['decode_ms_per_token'][mode]:>13.1f}{x['decode']:>7.2f}")
    return "\n".join(lines)


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
            for mode in args.modes:
                m = load_mode(module, folder, policy, mode)
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
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
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
