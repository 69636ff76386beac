"""The batch / padding / first-generated-step / sharding tables (docs/where.md): `probe where` on
SmolLM2 for each implementation and policy, one table row per group of comparisons, the CPU named.

    .venv/bin/python bench/where_tables.py                        # the full matrix
    .venv/bin/python bench/where_tables.py --impls torchref --policies bf16 --circumstances batch
    .venv/bin/python bench/where_tables.py --impls jaxmodel --circumstances sharding --modes default,invariant

sharding (jaxmodel only): one device vs every mesh the model allows on 8 forced host devices
(tensor=3 and data=2 for SmolLM2's 9 heads / 3 KV heads / 1536 MLP columns), in each --modes.

Under an instruction-set cap, prefix the Makefile's CAP_<name> variables (make test-cap-%
lists them). Prints markdown tables and saves every result's JSON (bench/results/, or
--out). Target: the chat-templated prompt "What is the capital of France?" (37 tokens for
SmolLM2), batches of 8 (rows 0, 4, 7), 5 pad slots: the settings of docs/where.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IMPLS = {"torchref": ("torchref", {}), "jaxmodel": ("jaxmodel", {}),
         "transformers sdpa": ("transformers", {"attn_implementation": "sdpa"}),
         "transformers eager": ("transformers", {"attn_implementation": "eager"})}
NAMES = {"batch": "batch of 8", "decode": "first generated step"}     # the combined table's column names
CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "LLAMA_PARITY_KERNEL_ISA",
            "XLA_FLAGS")
SHARD_HEADER = ("| policy, mode | mesh | verdict | taps bitwise equal | first difference (op): max ulp there | "
                "logit values bitwise equal | B vs A at the logits (rel / max abs) | max err_b / bound | "
                "twin: B vs A, max | first beyond drift |")
HEADER = ("| implementation, policy | comparison | verdict | taps bitwise equal | first difference (op) | "
          "B vs A at the last layer's out | B vs A at the logits (rel / max abs) | max err_b / bound | "
          "twin: B vs A, max | first beyond drift |")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cap() -> str:
    """The instruction-set caps in the environment (a host-device count in XLA_FLAGS is none)."""
    env = {k: os.environ[k] for k in CAP_VARS if k in os.environ}
    if "XLA_FLAGS" in env:
        env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split()
                                    if not f.startswith("--xla_force_host_platform_device_count"))
    set_ = [f"{k}={v}" for k, v in env.items() if v]
    return " ".join(set_) if set_ else "none (the CPU's own instruction set)"


def _g(x, spec=".1e") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _group(c) -> str:
    """Comparisons that differ only in the target's row share a table row."""
    return re.sub(r", row \d+", "", c.name)


def rows_of(label: str, result) -> list[str]:
    groups: dict = {}
    for c in result.comparisons:
        groups.setdefault(_group(c), []).append(c)
    out = []
    for name, comps in groups.items():
        c = max(comps, key=lambda x: (("exact", "drift", "precision", "semantic").index(x.verdict),
                                      -sum(d.bitwise_equal for d in x.taps)))
        by = {d.tap: d for d in c.taps}
        outs = [d for d in c.taps if d.tap.endswith(".out")]
        last, logits = (outs[-1] if outs else None), by.get("logits")
        fd, fb = c.first_difference, c.first_beyond
        rows = [x.b_row for x in comps]
        where = f"{name} (rows {', '.join(map(str, rows))})" if len(comps) > 1 else c.name
        twins = [d.twin_rel for d in c.taps if d.twin_rel is not None]
        out.append(" | ".join([
            f"| {label}", where, c.verdict, f"{sum(d.bitwise_equal for d in c.taps)}/{len(c.taps)}",
            "-" if fd is None else f"{fd.tap} ({fd.op.name})", _g(last.rel_l2 if last else None),
            "-" if logits is None else f"{_g(logits.rel_l2)} / {_g(logits.max_abs, '.2g')}",
            _g(max(d.ratio for d in c.taps), ".2f"), _g(max(twins) if twins else None),
            "-" if fb is None else f"{fb.tap} ({fb.kind})"]) + " |")
    return out


def shard_rows(label: str, result) -> list[str]:
    """One row per mesh: how the sharded run's target row compares with the one-device run."""
    out = []
    for c in result.comparisons:
        by = {d.tap: d for d in c.taps}
        logits, fd, fb = by.get("logits"), c.first_difference, c.first_beyond
        twins = [d.twin_rel for d in c.taps if d.twin_rel is not None]
        out.append(" | ".join([
            f"| {label}", c.b_run, c.verdict, f"{sum(d.bitwise_equal for d in c.taps)}/{len(c.taps)}",
            "-" if fd is None else f"{fd.tap} ({fd.op.name}): {by[fd.tap].max_ulp:.0f}",
            "-" if logits is None else f"{logits.equal_fraction:.1%}",
            "-" if logits is None else f"{_g(logits.rel_l2)} / {_g(logits.max_abs, '.2g')}",
            _g(max(d.ratio for d in c.taps), ".2f"), _g(max(twins) if twins else None),
            "-" if fb is None else f"{fb.tap} ({fb.kind})"]) + " |")
    return out


def cell(result) -> str:
    """One circumstance of one model in a few words: the worst comparison's verdict, where it
    starts, and how close to the bound the largest difference comes."""
    if result.verdict == "exact":
        return "bitwise equal"
    c = result.worst
    ratio = max(d.ratio for x in result.comparisons for d in x.taps)
    fd, fb = c.first_difference, c.first_beyond
    text = f"{c.verdict} from {fd.tap} ({fd.op.name})"
    if fb is not None:
        text += f", beyond drift at {fb.tap}"
    return text + f"; <= {ratio:.2f} of the bound"


def short_cell(d: dict) -> str:
    """cell() in a few characters, from a saved result's dict: "bitwise", or the verdict, the
    first tap that differs and the largest err_b / bound."""
    from compare.report.where import worst
    if d["verdict"] == "exact":
        return "bitwise"
    c = worst(d)
    ratio = max((t["ratio"] if t.get("ratio") is not None else t["err_b"] / t["bound"] if t["bound"] else 0.0)
                for x in d["comparisons"] for t in x["taps"])
    beyond = c.get("first_beyond")
    return f"{c['verdict']} from {c['first_difference']['tap']} ({ratio:.2f})" + \
        (f", beyond at {beyond['tap']}" if beyond else "")


def combined(paths: list[str]) -> str:
    """One markdown table from several saved runs (one per instruction-set cap): a row per
    implementation and policy, a column per circumstance and cap."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    cols, rows = [], {}
    for doc in docs:
        isa = "own ISA" if doc["cap"].startswith("none") else doc["cap"].split("ONEDNN_MAX_CPU_ISA=")[1].split()[0]
        for run in doc["runs"]:
            col = f"{NAMES.get(run['circumstance'], run['circumstance'])}, {isa}"
            if col not in cols:
                cols.append(col)
            rows.setdefault(f"{run['impl']} {run['policy']}", {})[col] = short_cell(run["result"])
    order = sorted(cols, key=lambda c: (c.split(",")[0] != NAMES["batch"], c.split(",")[0] != "padding"))
    lines = ["| implementation, policy | " + " | ".join(order) + " |", "|" + "---|" * (len(order) + 1)]
    lines += [f"| {who} | " + " | ".join(cells.get(c, "-") for c in order) + " |" for who, cells in rows.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated of: {', '.join(IMPLS)}")
    p.add_argument("--policies", default="fp32,bf16")
    p.add_argument("--circumstances", default="batch,padding,decode")
    p.add_argument("--modes", default="default", help="default,invariant (the batch-invariant mode: jaxmodel and "
                   "torchref)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "where_tables.json"))
    p.add_argument("--combine", nargs="+", metavar="JSON",
                   help="print one table from saved runs (one per cap) and exit; nothing is run")
    args = p.parse_args(argv)
    if args.combine:
        print(combined(args.combine))
        return 0

    if "sharding" in args.circumstances.split(","):
        from jaxmodel.sharding import host_devices
        host_devices(8)      # before JAX starts: 8 host devices for the meshes

    import numpy as np

    from compare.probes import load_model
    from compare.probes.where import probe_where
    from llama_parity.fetch import default_model_dir
    from llama_parity.probe_cli import DEFAULT_PROMPT, target_tokens
    from llamaspec.files import atomic_write
    folder = default_model_dir()
    if not (Path(folder) / "config.json").is_file():
        print(f"no SmolLM2 at {folder}: `make model` fetches it", file=sys.stderr)
        return 2
    target, how = target_tokens(folder, DEFAULT_PROMPT, 24, 0)
    target = np.asarray(target, np.int64)[None]
    options = {"batch": {"batch_sizes": (8,)}, "padding": {"pad": 5}, "decode": {"batch_sizes": (8,)}, "sharding": {}}
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; instruction-set cap: {cap()}; target: {how}")
    tables: dict = {c: [] for c in args.circumstances.split(",")}
    summary: dict = {}
    saved = []
    for label in args.impls.split(","):
        impl, kw = IMPLS[label]
        for policy in args.policies.split(","):
            for mode in args.modes.split(","):
                for circ in tables:
                    if circ == "sharding" and impl != "jaxmodel":
                        continue
                    t0 = time.perf_counter()
                    model = impl if mode == "default" else load_model(impl, folder, policy, batch_invariant=True)
                    r = probe_where(model, circ, target, checkpoint=folder, policy=policy,
                                    **(kw if mode == "default" else {}), **options[circ])
                    took = time.perf_counter() - t0
                    tables[circ] += (shard_rows(f"{policy}, {mode}", r) if circ == "sharding" else rows_of(r.model, r))
                    who = f"{label} {policy}" + ("" if mode == "default" else " invariant")
                    summary.setdefault(who, {})[circ] = cell(r)
                    saved.append({"impl": label, "policy": policy, "mode": mode, "circumstance": circ,
                                  "seconds": round(took, 1), "result": r.to_dict()})
                    print(f"  {who} {circ}: {r.verdict} in {took:.1f} s", file=sys.stderr, flush=True)
    circs = list(tables)
    print(f"\n#### summary (CPU: {cpu_name()}; cap: {cap()})\n\n| implementation, policy | "
          + " | ".join(circs) + " |\n|" + "---|" * (len(circs) + 1))
    for who, cells in summary.items():
        print(f"| {who} | " + " | ".join(cells.get(c, "-") for c in circs) + " |")
    for circ, rows in tables.items():
        print(f"\n#### {circ}\n\n{SHARD_HEADER if circ == 'sharding' else HEADER}\n|{'---|' * 10}")
        print("\n".join(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"cpu": cpu_name(), "cores": os.cpu_count(), "cap": cap(), "target": how, "runs": saved}
    atomic_write(out, json.dumps(doc, indent=1, default=str))
    print(f"\nsaved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
