"""Peak memory of the layer-streamed comparison against depth: it must not grow with the
number of layers (compare/ladder/stream.py holds one layer's weights at a time).

    .venv/bin/python -m bench.stream_memory [--depths 2 6] [--backends default]
        [--policy bf16] [--tokens 64] [--vocab 4096] [--no-teacher-forcing] [--out FILE]

For each depth, a random checkpoint with Llama-3.2-1B's layer shape (hidden 2048,
intermediate 8192, 32 heads, 8 KV heads, head_dim 64, its RoPE scaling; bf16 storage) is
written by llamaspec.testing.make_checkpoint into a temporary folder, with a small
vocabulary (--vocab, 4096 by default: the layers are what is measured, and a small head
keeps the lm_head and the logits metrics out of the peak). Then torchref vs jaxmodel at the
policy, streamed (compare_models(..., stream=True), the oracle and teacher forcing included),
runs in a fresh interpreter per depth and backend; its peak RSS is that child's ru_maxrss
(os.wait4). Linux carries a process's peak across fork and exec, so the checkpoints are
written by a child too: this parent stays small and its peak cannot become a child's. The
child also samples its resident size after each streamed layer (the ladder's progress
lines), which shows where growth starts.

--backends: "default" runs compare_models as a user would; a backend name
(llamaspec.plan.BACKENDS) streams both sides on that backend (stream.checkpoint_side's
backend). The table gives peak RSS per depth and the ratio of the deepest to the shallowest
(the acceptance: within 1.1). The CPU and the commit are printed and saved in the JSON
(bench/results/stream-memory-<time>.json unless --out).

Run under another tree (an older commit): PYTHONPATH=<tree> .venv/bin/python bench/stream_memory.py;
the children import `compare` from there (the JSON names the folder it came from).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Llama-3.2-1B's decoder layer (llamaspec/shapes.py "llama-3.2-1b"), any depth, a small vocabulary.
LAYER_SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
                   tie_word_embeddings=True,
                   rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))
LIMIT = 1.1     # the acceptance: peak at the deepest / at the shallowest


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _child(spec: dict) -> dict:
    """One streamed comparison in this process (the subprocess side): its numbers and the
    resident size after each layer of the ladder's first pass."""
    import numpy as np

    import compare
    from compare import compare_models
    from llamaspec import Policy
    t0 = time.perf_counter()
    inputs = np.random.default_rng(0).integers(3, spec["vocab"], (1, spec["tokens"]))
    after_layer = []

    def progress(msg: str) -> None:
        m = re.match(r"layer (\d+)/\d+ done", msg)
        if m:
            after_layer.append(round(_rss_mb()))

    if spec["backend"] == "default":
        report = compare_models("torchref", "jaxmodel", spec["checkpoint"], inputs=inputs, policy=spec["policy"],
                                teacher_forcing=spec["teacher_forcing"], progress=progress, stream=True)
    else:
        from compare.ladder.engine import run_ladder
        from compare.ladder.stream import checkpoint_side
        policy = Policy.get(spec["policy"])
        ref, cand = (checkpoint_side(p, spec["checkpoint"], policy, backend=spec["backend"])
                     for p in ("torchref", "jaxmodel"))
        report = run_ladder(ref, cand, inputs, np.ones_like(inputs), policy, spec["teacher_forcing"], progress,
                            stream=True)
    return {"wall_s": round(time.perf_counter() - t0, 2), "verdict": report.verdict, "path": report.run.get("path"),
            "rss_after_layer_mb": after_layer, "rss_end_mb": round(_rss_mb()),
            "compare_from": str(Path(compare.__file__).resolve().parent.parent),
            "cpu": report.environment.get("cpu")}


def write_checkpoint(folder: Path, layers: int, vocab: int, seed: int = 0) -> None:
    from llamaspec.testing import make_checkpoint
    make_checkpoint(folder, dtype="bfloat16", seed=seed, vocab_size=vocab, num_hidden_layers=layers,
                    bos_token_id=1, eos_token_id=2, pad_token_id=None, **LAYER_SHAPE)


def run_case(spec: dict) -> dict:
    """spec in a fresh interpreter; its result plus the child's peak RSS (MB)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec), "--child-out", out.name]
        print(f"  {spec['layers']} layers, backend {spec['backend']} ...", end="", flush=True)
        proc = subprocess.Popen(cmd)
        _, status, usage = os.wait4(proc.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        row = {k: spec[k] for k in ("layers", "backend", "policy", "tokens", "vocab", "teacher_forcing")}
        row["peak_rss_mb"] = round(usage.ru_maxrss / 1024)
        if code:
            row["error"] = f"exit {code}"
        else:
            row.update(json.loads(Path(out.name).read_text()))
    print(f" {row.get('wall_s', float('nan')):.1f} s, peak RSS {row['peak_rss_mb']} MB"
          + (f" ({row['error']})" if "error" in row else f", {row['verdict']}"), flush=True)
    return row


def _commit(folder: str) -> str:
    try:
        return subprocess.run(["git", "-C", folder, "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 6])
    ap.add_argument("--backends", nargs="+", default=["default"],
                    help="'default' (compare_models as a user calls it) and/or llamaspec.plan.BACKENDS names")
    ap.add_argument("--policy", default="bf16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--no-teacher-forcing", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/stream-memory-<time>.json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--write", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        from llamaspec.files import atomic_write  # a temp name, then renamed (as every file the project writes)
        atomic_write(args.child_out, json.dumps(_child(json.loads(args.child))), "stream memory child result")
        return 0
    if args.write:
        write_checkpoint(Path(args.write[0]), int(args.write[1]), int(args.write[2]))
        return 0

    rows = []
    with tempfile.TemporaryDirectory(prefix="stream-memory-") as tmp:
        for n in args.depths:
            folder = Path(tmp) / f"L{n}"
            print(f"writing {folder} (Llama-3.2-1B layer shape, {n} layers, vocabulary {args.vocab}, bf16)", flush=True)
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--write", str(folder), str(n),
                            str(args.vocab)], check=True)
            for backend in args.backends:
                rows.append(run_case({"checkpoint": str(folder), "layers": n, "backend": backend,
                                      "policy": args.policy, "tokens": args.tokens, "vocab": args.vocab,
                                      "teacher_forcing": not args.no_teacher_forcing}))
            for f in folder.iterdir():    # each depth's checkpoint gone before the next is written
                f.unlink()

    from compare.environment import cpu
    where = next((r["compare_from"] for r in rows if "compare_from" in r), str(Path(__file__).resolve().parents[1]))
    env = {**cpu(), "commit": _commit(where), "tree": where, "cores": os.cpu_count(),
           "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "(unset)")}
    print(f"\nCPU: {env.get('cpu')}; {env['cores']} cores; tree {where} at {env['commit']}")
    print(f"torchref vs jaxmodel streamed, policy {args.policy}, {args.tokens} random tokens, Llama-3.2-1B layer "
          f"shape, vocabulary {args.vocab}, teacher forcing {'off' if args.no_teacher_forcing else 'on'}")
    print(f"{'backend':<12}{'layers':>7}{'peak RSS MB':>13}{'wall s':>8}  RSS after each layer (MB)")
    for r in rows:
        print(f"{r['backend']:<12}{r['layers']:>7}{r['peak_rss_mb']:>13}{r.get('wall_s', float('nan')):>8.1f}  "
              f"{' '.join(map(str, r.get('rss_after_layer_mb', []))) or r.get('error', '')}")
    ratios = {}
    for backend in args.backends:
        ok = sorted((r for r in rows if r["backend"] == backend and "error" not in r), key=lambda r: r["layers"])
        if len(ok) > 1:
            ratio = ok[-1]["peak_rss_mb"] / ok[0]["peak_rss_mb"]
            ratios[backend] = round(ratio, 3)
            print(f"{backend}: peak at {ok[-1]['layers']} layers / at {ok[0]['layers']} = {ratio:.2f} "
                  f"({'within' if ratio <= LIMIT else 'ABOVE'} {LIMIT})")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / \
        f"stream-memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from llamaspec.files import atomic_write
    record = {"date": time.strftime("%Y-%m-%d"), "environment": env, "layer_shape": LAYER_SHAPE,
              "results": rows, "ratios": ratios, "limit": LIMIT}
    atomic_write(out, json.dumps(record, indent=1), "stream memory results")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
