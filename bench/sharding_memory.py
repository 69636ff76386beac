"""Per-device parameter memory of jaxmodel on a mesh: the Llama-3.1-8B shape (its first layers,
from `llama-parity make-checkpoint`), loaded at tensor = 1, 2, 4, 8 on 8 forced host devices.

    .venv/bin/python bench/sharding_memory.py                 # 2 layers, bf16
    .venv/bin/python bench/sharding_memory.py --layers 4 --policy fp32

Prints a markdown table (bytes per device, the ratio to tensor=1, the host process's resident
memory after loading: the weights go from the memory-mapped files to the devices shard by shard,
never as a whole host copy) and saves JSON (bench/results/sharding_memory.json, or --out).
The CPU is named; each size is loaded in a process of its own, so resident memory is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status_mb() -> dict:
    """RssAnon (the process's own memory: on a CPU the host devices' buffers live there) and
    RssFile (pages of mapped files: the checkpoint's memory map, which the kernel may drop)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def one(folder: str, policy: str, tensor: int, batch_invariant: bool) -> dict:
    """Runs in the child process: loads, measures, returns the row."""
    import jaxmodel
    from jaxmodel.sharding import per_device_bytes
    before = _status_mb()
    m = jaxmodel.from_pretrained(folder, policy=policy, batch_invariant=batch_invariant, check_finite=False,
                                 mesh=None if tensor == 1 else {"tensor": tensor})
    per = per_device_bytes(m.state)
    after = _status_mb()
    return {"tensor": tensor, "devices": len(per), "bytes_per_device": max(per.values()),
            "min_bytes_per_device": min(per.values()), "total_bytes": sum(per.values()),
            # the process's own memory beyond the device buffers it holds (a CPU's devices are host memory)
            "host_anon_beyond_devices_mb": after["RssAnon"] - before["RssAnon"] - sum(per.values()) / 2**20,
            "rss_file_mb": after["RssFile"], "peak_rss_mb": after["VmHWM"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--policy", default="bf16")
    p.add_argument("--tensor", default="1,2,4,8")
    p.add_argument("--invariant", action="store_true", help="the batch-invariant mode (packed weights)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sharding_memory.json"))
    p.add_argument("--child", nargs=2, metavar=("FOLDER", "TENSOR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(one(args.child[0], args.policy, int(args.child[1]), args.invariant)))
        return 0

    from bench.where_tables import cpu_name
    from llamaspec.cache import cache_root
    from llamaspec.files import atomic_write
    from llamaspec.shapes import write_checkpoint
    folder = cache_root() / "checkpoints" / f"llama-3.1-8b-bf16-{args.layers}layers-seed0"
    if not (folder / "config.json").is_file():
        print(f"writing the llama-3.1-8b shape, {args.layers} layers, to {folder}", file=sys.stderr)
        write_checkpoint(folder, "llama-3.1-8b", "bfloat16", args.layers, 0)
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")}
    rows = []
    for t in map(int, args.tensor.split(",")):
        cmd = [sys.executable, __file__, "--policy", args.policy, "--child", str(folder), str(t)]
        done = subprocess.run(cmd + (["--invariant"] if args.invariant else []), capture_output=True, text=True,
                              env=env, timeout=1800)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  tensor={t}: {rows[-1]['bytes_per_device'] / 2**20:.0f} MiB per device", file=sys.stderr)
    base = rows[0]["bytes_per_device"]
    mode = "batch-invariant" if args.invariant else "default"
    print(f"\nllama-3.1-8b shape, first {args.layers} layers + embedding + lm_head, {args.policy}, {mode} mode; "
          f"CPU: {cpu_name()}, 8 forced host devices\n")
    print("| tensor | parameter MiB per device | x tensor=1 | all devices MiB | host memory beyond the devices' "
          "MiB | mapped file pages MiB | peak RSS MiB |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tensor']} | {r['bytes_per_device'] / 2**20:.0f} | {r['bytes_per_device'] / base:.3f} | "
              f"{r['total_bytes'] / 2**20:.0f} | {r['host_anon_beyond_devices_mb']:.0f} | {r['rss_file_mb']:.0f} | "
              f"{r['peak_rss_mb']:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps({"cpu": cpu_name(), "layers": args.layers, "policy": args.policy, "mode": mode,
                                  "rows": rows}, indent=1))
    print(f"\nsaved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
