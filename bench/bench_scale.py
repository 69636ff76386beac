"""Memory and time of the ladder at scale: the full path against the layer-streamed one,
depth sweeps and real model shapes, side by side in one run.

    .venv/bin/python -m bench.bench_scale [--cases smollm2 depth 1b 8b] [--tokens 64]
                                          [--scale-dir ~/.cache/llama-parity/scale]

Cases (each comparison runs in a subprocess of its own: its peak RSS is that process's
maximum resident set, from os.wait4):
  smollm2  SmolLM2-135M, the default comparison (torchref vs jaxmodel, fp32, the built-in
           258-token prompt) on the full path and streamed; the two Reports' numbers compared
  depth    one shape (--depth-shape, SmolLM2's by default) with 4, 8, 16 and 30 layers (bf16
           storage, --tokens random tokens, policy bf16), streamed: peak RSS against depth
  1b       the Llama-3.2-1B shape at its real depth (16 layers), bf16, streamed
  8b       the Llama-3.1-8B shape (32 layers, 16 GB of bf16), bf16, streamed
Synthetic checkpoints are written by `llama-parity make-checkpoint` into --scale-dir (never
the repository) when missing; the 8B one only when the disk has room. Wall time is split
by run (Report.run["seconds"]). Prints a table, writes bench/results/scale-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEPTHS = (4, 8, 16, 30)


def _child(spec: dict) -> dict:
    """Runs one comparison in this process (the subprocess side) and returns its numbers."""
    import numpy as np

    from compare import compare_models
    t0 = time.perf_counter()
    inputs = None
    if spec.get("tokens"):
        vocab = json.loads((Path(spec["checkpoint"]) / "config.json").read_text())["vocab_size"]
        inputs = np.random.default_rng(0).integers(0, vocab, (1, spec["tokens"]))
    report = compare_models("torchref", "jaxmodel", spec["checkpoint"], inputs=inputs, policy=spec["policy"],
                            stream=spec["stream"])
    wall = time.perf_counter() - t0
    if spec.get("report"):
        report.to_json(spec["report"])
    return {"wall_s": round(wall, 2), "verdict": report.verdict, "path": report.run.get("path"),
            "seconds": report.run.get("seconds", {}), "cpu": report.environment.get("cpu")}


def run_case(name: str, spec: dict) -> dict:
    """spec in a fresh interpreter; its result plus the child's peak RSS (MB)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "bench.bench_scale", "--child", json.dumps(spec), "--child-out", out.name]
        print(f"  {name} ...", end="", flush=True)
        proc = subprocess.Popen(cmd, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        row = {"case": name, **{k: v for k, v in spec.items() if k in ("policy", "stream", "tokens")},
               "checkpoint": spec["checkpoint"], "peak_rss_mb": round(usage.ru_maxrss / 1024)}
        if proc.returncode:
            row["error"] = f"exit {proc.returncode}"
        else:
            row.update(json.loads(Path(out.name).read_text()))
    print(f" {row.get('path', '?')}: {row.get('wall_s', float('nan')):.1f} s, peak RSS {row['peak_rss_mb']} MB"
          + (f" ({row['error']})" if "error" in row else f", {row['verdict']}"), flush=True)
    return row


def ensure_checkpoint(folder: Path, shape: str, layers: int | None, need_gb: float) -> str | None:
    """The synthetic checkpoint's folder (made when missing), or why it cannot be."""
    if (folder / "config.json").is_file():
        return None
    free = shutil.disk_usage(folder.parent).free / 2**30
    if free < need_gb + 2:
        return f"{folder}: {free:.0f} GB free, the checkpoint needs {need_gb:.0f} GB"
    cmd = [str(REPO / ".venv/bin/llama-parity"), "make-checkpoint", "--shape", shape, "--dtype", "bf16", str(folder)]
    if layers:
        cmd[-1:-1] = ["--layers", str(layers)]
    print(f"  writing {folder} ...", flush=True)
    subprocess.run(cmd, check=True)
    return None


def _numbers(path) -> dict:
    d = json.loads(Path(path).read_text())
    d.pop("run", None), d.pop("environment", None)
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["smollm2", "depth", "1b", "8b"],
                    choices=["smollm2", "depth", "1b", "8b"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--depth-shape", default="smollm2-135m")
    ap.add_argument("--scale-dir", default=str(Path.home() / ".cache/llama-parity/scale"))
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/scale-<time>.json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(_child(json.loads(args.child))))
        return 0

    from compare.environment import environment
    scale = Path(args.scale_dir).expanduser()
    scale.mkdir(parents=True, exist_ok=True)
    rows, notes = [], []
    bf16 = {"policy": "bf16", "stream": None, "tokens": args.tokens}
    if "smollm2" in args.cases:
        from llama_parity.fetch import resolve_checkpoint
        smol = str(resolve_checkpoint(None))
        with tempfile.TemporaryDirectory() as tmp:
            for stream in (False, None):
                spec = {"checkpoint": smol, "policy": "fp32", "stream": stream,
                        "report": f"{tmp}/{'streamed' if stream is None else 'full'}.json"}
                rows.append(run_case("smollm2 default", spec))
            if all("error" not in r for r in rows[-2:]):
                same = _numbers(f"{tmp}/full.json") == _numbers(f"{tmp}/streamed.json")
                notes.append(f"SmolLM2 default comparison: full and streamed Reports' numbers "
                             f"{'identical' if same else 'DIFFER'} (every tap, local errors, logits metrics)")
    for n in DEPTHS if "depth" in args.cases else ():
        folder = scale / f"{args.depth_shape}-L{n}"
        why = ensure_checkpoint(folder, args.depth_shape, n, 1.0)
        if why:
            notes.append(why)
            continue
        rows.append(run_case(f"{args.depth_shape}, {n} layers", {"checkpoint": str(folder), **bf16}))
    if "1b" in args.cases:
        folder = scale / "llama-3.2-1b-L16"
        why = ensure_checkpoint(folder, "llama-3.2-1b", 16, 2.6)
        if why:
            notes.append(why)
        else:
            rows.append(run_case("1B shape (16 layers)", {"checkpoint": str(folder), **bf16}))
    if "8b" in args.cases:
        folder = scale / "llama-3.1-8b"
        why = ensure_checkpoint(folder, "llama-3.1-8b", None, 16.1)
        if why:
            notes.append(why)
        else:
            rows.append(run_case("8B shape (32 layers)", {"checkpoint": str(folder), **bf16}))

    env = environment("fp32")
    print(f"\nCPU: {env['cpu']} ({env['cpu isa']}; caps: {env['isa caps']}); GPU: {env.get('gpu', 'none')}; "
          f"{os.cpu_count()} cores")
    print(f"{args.tokens} random tokens where not said otherwise; seconds by run: r/c reference/candidate at the "
          "policy (with their teacher-forced runs), o the oracle, c64 the candidate at fp64")
    print(f"{'case':<30}{'policy':<7}{'path':<10}{'wall s':>8}{'peak RSS MB':>13}  seconds by run")
    for r in rows:
        split = ", ".join(f"{k.split(' (')[0]} {v:.0f}" for k, v in r.get("seconds", {}).items())
        print(f"{r['case']:<30}{r['policy']:<7}{r.get('path', '?'):<10}{r.get('wall_s', float('nan')):>8.1f}"
              f"{r['peak_rss_mb']:>13}  {split}{' ' + r['error'] if 'error' in r else ''}")
    sweep = [r for r in rows if r["case"].startswith(f"{args.depth_shape},") and "error" not in r]
    if len(sweep) > 1:
        lo, hi = min(r["peak_rss_mb"] for r in sweep), max(r["peak_rss_mb"] for r in sweep)
        notes.append(f"peak RSS over depths {[int(r['case'].split(', ')[1].split()[0]) for r in sweep]}: "
                     f"{lo}-{hi} MB, spread {100 * (hi - lo) / lo:.1f}%")
    for n in notes:
        print(n)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / \
        f"scale-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokens": args.tokens, "environment": env, "cores": os.cpu_count(),
                               "results": rows, "notes": notes}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
