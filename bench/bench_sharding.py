"""What sharding costs jaxmodel: one device vs each mesh, the cross-shard sums in shard order
(the default: bitwise the same in one process or several) vs XLA's all-reduce, and the
batch-invariant mode on a mesh. Forward passes of one batch, the variants interleaved,
median of N, compile time apart; the CPU named.

    .venv/bin/python bench/bench_sharding.py                    # SmolLM2, tensor=3, fp32 and bf16
    .venv/bin/python bench/bench_sharding.py --checkpoint DIR --tensor 2,4 --batch 4 --length 128

On a CPU the devices are forced host devices (XLA_FLAGS, set here before JAX starts) sharing
the machine's cores, so a mesh cannot be faster than one device: the table shows what the
partitioning, the collectives and the fixed order add. On a multi-GPU host the same script
measures real tensor parallelism. Saves JSON (bench/results/bench_sharding.json, or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="HF folder (default: the cached SmolLM2)")
    p.add_argument("--policies", default="fp32,bf16")
    p.add_argument("--tensor", default=None, help="tensor sizes (default: every size up to 8 the model allows)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_sharding.json"))
    args = p.parse_args(argv)

    from jaxmodel.sharding import host_devices
    host_devices(8)
    import jax
    import numpy as np

    import jaxmodel
    from bench.where_tables import cpu_name
    from compare.probes.where import default_meshes
    from llama_parity.fetch import default_model_dir
    from llamaspec import load_weights
    from llamaspec.files import atomic_write
    folder = args.checkpoint or str(default_model_dir())
    cfg, weights = load_weights(folder)
    sizes = ([int(t) for t in args.tensor.split(",")] if args.tensor else
             [m["tensor"] for m in default_meshes(cfg, len(jax.devices())) if "tensor" in m])
    if not sizes:
        print(f"{len(jax.devices())} {jax.devices()[0].platform} device(s): no tensor size above 1 fits this model "
              "here; measuring one device only", file=sys.stderr)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (args.batch, args.length))
    mask = np.ones_like(ids)
    device = jax.devices()[0]
    print(f"CPU: {cpu_name()}; JAX {jax.__version__} on {device.platform} ({len(jax.devices())} devices); "
          f"{Path(folder).name}, batch {args.batch} x {args.length} tokens, median of {args.repeats}", file=sys.stderr)
    rows = []
    for policy in args.policies.split(","):
        variants = {"one device": dict()}
        for t in sizes:
            variants[f"tensor={t}, shard-order sums"] = dict(mesh={"tensor": t})
            variants[f"tensor={t}, all-reduce"] = dict(mesh={"tensor": t}, shard_sums="all-reduce")
        if device.platform == "cpu":
            variants["invariant, one device"] = dict(batch_invariant=True)
            for t in sizes:
                variants[f"invariant, tensor={t}"] = dict(batch_invariant=True, mesh={"tensor": t})
        models, compile_s, logits = {}, {}, {}
        for name, kw in variants.items():
            m = jaxmodel.from_weights(cfg, weights, policy, **kw)
            t0 = time.perf_counter()
            logits[name] = np.asarray(m(ids, mask))
            compile_s[name] = time.perf_counter() - t0
            models[name] = m
        times = {name: [] for name in variants}
        for _ in range(args.repeats):               # interleaved: each round runs every variant once
            for name, m in models.items():
                t0 = time.perf_counter()
                np.asarray(m(ids, mask))
                times[name].append(time.perf_counter() - t0)
        base = {False: statistics.median(times["one device"]),
                True: statistics.median(times["invariant, one device"]) if "invariant, one device" in times else None}
        for name in variants:
            med = statistics.median(times[name])
            ref = base[name.startswith("invariant")]
            ref_logits = logits["invariant, one device" if name.startswith("invariant") else "one device"]
            rows.append({"policy": policy, "variant": name, "median_s": med, "x_one_device": med / ref,
                         "first_call_s": compile_s[name],
                         "logits_bitwise_one_device": bool(np.array_equal(logits[name], ref_logits))})
            print(f"  {policy} {name}: {med * 1e3:.0f} ms", file=sys.stderr, flush=True)
        del models
    print(f"\n{Path(folder).name}, forward of {args.batch} x {args.length} tokens; CPU: {cpu_name()}, "
          f"{len(jax.devices())} {device.platform} devices; median of {args.repeats}, interleaved\n")
    print("| policy | variant | forward ms | x one device (same mode) | first call s (compile) | "
          "logits bitwise = one device |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['variant']} | {r['median_s'] * 1e3:.0f} | {r['x_one_device']:.2f} | "
              f"{r['first_call_s']:.1f} | {'yes' if r['logits_bitwise_one_device'] else 'no'} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps({"cpu": cpu_name(), "platform": device.platform, "checkpoint": folder,
                                  "batch": args.batch, "length": args.length, "rows": rows}, indent=1))
    print(f"\nsaved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
