"""The invariance lab: is batched inference batch-, padding- and run-invariant, and what
does batch-invariant mode buy? One run, one table (on demand, not a test).

    .venv/bin/python -m bench.invariance_lab                       # the acceptance table
    .venv/bin/python -m bench.invariance_lab --quick               # minutes: small settings
    .venv/bin/python -m bench.invariance_lab --impl torchref --policy bf16 --completions 20

For each implementation (torchref, jaxmodel; transformers as a peer, default mode only)
at each policy (fp32, bf16) and mode (default, batch-invariant), on SmolLM2:
  batch        bitwise-equal fraction of the target's logits alone vs in batches of
               1..32 (equal-length and mixed-length companions, target at rows 0, B/2, B-1)
  padding      bitwise-equal fraction under right/left padding, one appended token,
               last-token readout, a fully padded neighbour
  run-to-run   bitwise-equal fraction over in-process repeats and fresh processes
and at bf16 (--greedy-policy) the greedy experiment: `completions` completions of
`new_tokens` tokens of one prompt under varied batchings (divergence_plan: about half
of each batch is target copies at random rows, the rest companions of random lengths,
with varying extra left padding), distinct completions per model and mode, and the
cross-framework divergence jaxmodel vs torchref. Prints a table and writes JSON + HTML
to bench/results/invariance-<time>.{json,html}.

Cost (2-core CPU): bf16 greedy dominates. 100 completions x 64 tokens with the default
divergence batch sizes (6, 16, 32, 48) take 9 prefill+decode loops per model and mode.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from compare import probes
from compare.environment import environment
from compare.probes import load_model
from compare.report.probes import write_html, write_json

ROOT = Path(__file__).resolve().parents[1]

PROMPT = "What is the capital of France?"


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="HF folder (default: cached SmolLM2)")
    p.add_argument("--impl", default="torchref,jaxmodel,transformers")
    p.add_argument("--policy", default="fp32,bf16")
    p.add_argument("--mode", default="default,invariant")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--batch-sizes", default="1,2,3,4,5,8,12,16,24,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--greedy-policy", default="bf16", help="policy of the greedy experiment ('' to skip)")
    p.add_argument("--completions", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--divergence-batch-sizes", default="6,16,32,48")
    p.add_argument("--quick", action="store_true", help="small settings that prove the pipeline: "
                   "batch sizes 1,2,5,8; 1 repeat, 1 process; 12 completions of 8 tokens")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.repeats, args.processes = "1,2,5,8", 1, 1
        args.completions, args.new_tokens, args.divergence_batch_sizes = 12, 8, "4,8"
    return args


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    from llama_parity.fetch import resolve_checkpoint
    from llama_parity.probe_cli import target_tokens
    folder = resolve_checkpoint(args.checkpoint, say)
    has_tok = (Path(folder) / "tokenizer.json").is_file()
    target, how = target_tokens(folder, args.prompt if has_tok else None, 24, 0)
    impls, policies, modes = (args.impl.split(","), args.policy.split(","), args.mode.split(","))
    say(f"checkpoint {folder}; target {how}")

    results, skipped, rows = [], [], []
    greedy_pol = args.greedy_policy
    for policy in dict.fromkeys(policies + ([greedy_pol] if greedy_pol else [])):
        for mode in modes:
            loaded = {}
            for impl in impls:
                try:
                    say(f"loading {impl} {policy} {mode}")
                    loaded[impl] = load_model(impl, folder, policy, batch_invariant=mode == "invariant")
                except NotImplementedError as e:
                    skipped.append(f"{impl} {policy} {mode}: {e}")
                    say(f"  skipped: {e}")
            for impl, pm in loaded.items():
                row = {"impl": impl, "policy": policy, "mode": mode}
                if policy in policies:
                    r = probes.probe_batch(pm, target, batch_sizes=_ints(args.batch_sizes), progress=say)
                    results.append(r)
                    for g in ("equal", "mixed"):
                        cs = [c for c in r.cases if c.group == g]
                        row[f"batch_{g}"] = sum(c.bitwise_equal for c in cs) / len(cs)
                    row["batch_verdict"] = r.verdict
                    r = probes.probe_padding(pm, target, progress=say)
                    results.append(r)
                    row["padding"], row["padding_verdict"] = r.bitwise_equal_frac, r.verdict
                    r = probes.probe_determinism(pm, target, repeats=args.repeats,
                                                 processes=args.processes, progress=say)
                    results.append(r)
                    row["run_to_run"], row["run_verdict"] = r.bitwise_equal_frac, r.verdict
                if policy == greedy_pol:
                    r = probes.probe_divergence(pm, target, completions=args.completions,
                                                new_tokens=args.new_tokens,
                                                batch_sizes=_ints(args.divergence_batch_sizes), progress=say)
                    results.append(r)
                    row["distinct"] = f"{r.details['distinct_completions']}/{r.details['completions']}"
                    flips = [c for c in r.cases if c.first_diff_step is not None]
                    row["first_step"] = min((c.first_diff_step for c in flips), default=None)
                    row["max_flip_margin"] = max((c.margin for c in flips), default=None)
                    row["greedy_verdict"] = r.verdict
                rows.append(row)
                say(f"{impl} {policy} {mode}: {row}")
            if policy == greedy_pol and {"jaxmodel", "torchref"} <= set(loaded):
                r = probes.probe_cross_greedy(loaded["jaxmodel"], loaded["torchref"],
                                              new_tokens=args.new_tokens, progress=say)
                results.append(r)
                rows.append({"impl": "jaxmodel vs torchref", "policy": policy, "mode": mode,
                             "distinct": f"{r.details['same_completions']}/{r.details['prompts']} same",
                             "first_step": min((c.first_diff_step for c in r.cases
                                                if c.first_diff_step is not None), default=None),
                             "greedy_verdict": r.verdict})
            del loaded
            gc.collect()

    table = format_rows(rows)
    env = environment(policies[0])
    print(table)
    print(f"CPU: {env.get('cpu')} ({env.get('cpu isa')}; caps: {env.get('isa caps')}); GPU: {env.get('gpu', 'none')}")
    for s in skipped:
        print(f"skipped {s}")
    out = Path(args.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"checkpoint": folder, "target": how, "settings": vars(args), "table": rows,
            "skipped": skipped, "seconds": round(time.perf_counter() - t0, 1), "environment": env}
    print(f"JSON: {write_json(results, out / f'invariance-{stamp}.json', meta)}")
    print(f"HTML: {write_html(results, out / f'invariance-{stamp}.html', meta)}")
    return 1 if any(r.verdict == "semantic" for r in results) else 0


def _pct(x) -> str:
    return "" if x is None else f"{x:.0%}"


def format_rows(rows) -> str:
    """The acceptance table: bitwise-equal fractions and greedy distinct completions."""
    head = (f"{'implementation':<22} {'policy':<6} {'mode':<9} | {'batch eq':>8} {'batch mix':>9} "
            f"{'padding':>7} {'run-run':>7} | {'greedy distinct':>16} {'1st flip':>8} {'max margin':>10}"
            f" | verdicts (batch/pad/run/greedy)")
    lines = [head, "-" * len(head)]
    for r in rows:
        m = r.get("max_flip_margin")
        verdicts = "/".join(r.get(k, "-") for k in ("batch_verdict", "padding_verdict", "run_verdict",
                                                    "greedy_verdict"))
        lines.append(f"{r['impl']:<22} {r['policy']:<6} {r['mode']:<9} | {_pct(r.get('batch_equal')):>8} "
                     f"{_pct(r.get('batch_mixed')):>9} {_pct(r.get('padding')):>7} "
                     f"{_pct(r.get('run_to_run')):>7} | {r.get('distinct', ''):>16} "
                     f"{'' if r.get('first_step') is None else r['first_step']:>8} "
                     f"{'' if m is None else format(m, '.2e'):>10} | {verdicts}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
