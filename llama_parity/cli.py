"""The `llama-parity` command line.

    llama-parity fetch-smollm2         cache the real default model, print its folder
    llama-parity demo [CHECKPOINT]     both models side by side on the real model
    llama-parity compare [CHECKPOINT]  verdict per layer and component: exact / drift /
                                       precision / semantic (exit 1 on precision/semantic)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .fetch import resolve_checkpoint

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]


def say(msg: str) -> None:
    print(msg, flush=True)


def cmd_fetch(args) -> int:
    from .fetch import main as fetch_main
    return fetch_main(["--cache-dir", args.cache_dir] if args.cache_dir else [])


def cmd_demo(args) -> int:
    from pathlib import Path

    import jaxmodel
    import torchref
    from compare import compare_models
    from llamaspec.tokenizer import Tokenizer

    folder = resolve_checkpoint(args.checkpoint)
    say(f"checkpoint: {folder}")
    tok = Tokenizer.from_pretrained(folder)
    prompts = args.prompt or DEFAULT_PROMPTS
    ids, mask = tok.batch_encode(prompts, chat=True, padding_side="left")
    say(f"{len(prompts)} prompts, batch {ids.shape[0]} x {ids.shape[1]} tokens (left padded)\n")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    verdicts = {}
    for policy in args.policy:
        say(f"=== policy {policy} ===")
        outs = {}
        for name, module in (("torchref", torchref), ("jaxmodel", jaxmodel)):
            t0 = time.perf_counter()
            m = module.from_pretrained(folder, policy=policy)
            outs[name] = m.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens)
            say(f"  {name}: loaded, {args.max_new_tokens} greedy tokens x {len(prompts)} prompts "
                f"in {time.perf_counter() - t0:.1f} s")
            del m
        print_answers(tok, prompts, outs)
        t0 = time.perf_counter()
        say("  drift or bug? jaxmodel against torchref on these prompts, fp64 oracle and teacher forcing:")
        report = compare_models("torchref", "jaxmodel", folder, inputs=(ids, mask), policy=policy,
                                progress=lambda m: say(f"  [{time.perf_counter() - t0:5.1f}s] {m}"))
        print_verdict_table(report, colour=sys.stdout.isatty())
        say(report.summary())
        verdicts[policy] = (report.verdict, report.to_html(out_dir / f"demo-jaxmodel-vs-torchref-{policy}.html"))
        say("")
    for policy, (verdict, html) in verdicts.items():
        say(f"{policy}: {verdict}; report {html}")
    return 0


def print_answers(tok, prompts, outs) -> None:
    from llamaspec.generate import until_eos
    (na, a), (nb, b) = outs.items()
    for i, p in enumerate(prompts):
        ta, tb = until_eos(a[i], tok.eos_ids), until_eos(b[i], tok.eos_ids)
        say(f"  > {p}")
        if ta == tb:
            say(f"    {na} = {nb}: {tok.decode(ta)!r}")
        else:
            step = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            say(f"    {na}: {tok.decode(ta)!r}")
            say(f"    {nb}: {tok.decode(tb)!r}   (differs from step {step})")




def _peer(name: str, folder: str, policy):
    """'torchref' / 'jaxmodel' as names; 'transformers' as an eager LlamaForCausalLM instance
    loaded at the policy's param dtype (it is then run as transformers runs it)."""
    if name != "transformers":
        return name
    from transformers import LlamaForCausalLM

    from torchref.dtypes import dt
    return LlamaForCausalLM.from_pretrained(folder, dtype=dt(policy.param_dtype),
                                            attn_implementation="eager").eval()


def cmd_compare(args) -> int:
    from compare import compare_models
    from compare.vocabulary import KINDS
    from llamaspec import Policy

    folder = resolve_checkpoint(args.checkpoint)
    policy = Policy.get(args.policy)
    t0 = time.perf_counter()
    inputs = args.prompt
    if args.random_tokens:
        import json
        from pathlib import Path
        B, T = (int(x) for x in args.random_tokens.lower().split("x"))
        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        inputs = np.random.default_rng(0).integers(0, vocab, (B, T))
    report = compare_models(_peer(args.reference, folder, policy), _peer(args.candidate, folder, policy),
                            folder, inputs=inputs, policy=policy,
                            teacher_forcing=not args.no_teacher_forcing,
                            progress=lambda m: say(f"[{time.perf_counter() - t0:5.1f}s] {m}"))
    print_verdict_table(report, colour=sys.stdout.isatty() and not args.no_colour)
    say(report.summary())
    env = report.environment
    say(f"measured on: {env.get('cpu')} ({env.get('cpu isa')}; caps: {env.get('isa caps')}); "
        f"GPU: {env.get('gpu', 'none')}")
    json_path, html_path = _report_paths(args)
    if json_path:
        say(f"JSON report: {report.to_json(json_path)}")
    if html_path:
        say(f"HTML report: {report.to_html(html_path)}")
    say(f"done in {time.perf_counter() - t0:.1f} s")
    return 0 if KINDS.index(report.verdict) <= KINDS.index("drift") else 1


def _report_paths(args):
    """--json/--html where given; otherwise both go to --out-dir (default ./parity-report/,
    git-ignored), named after the comparison, unless --no-files."""
    if args.no_files:
        return args.json, args.html
    from pathlib import Path
    out = Path(args.out_dir)
    stem = f"{args.candidate}-vs-{args.reference}-{args.policy}"
    if not (args.json and args.html):
        out.mkdir(parents=True, exist_ok=True)
    return args.json or out / f"{stem}.json", args.html or out / f"{stem}.html"


def print_verdict_table(report, colour: bool) -> None:
    """One row per (layer, component): the worst kind among its taps and the largest errors."""
    from compare.vocabulary import KINDS, ansi
    rows: dict = {}
    for v in report.taps:
        key = (v.layer, v.component)
        r = rows.setdefault(key, {"kind": "exact", "err_ref": 0.0, "err_cand": 0.0, "err_fp64": 0.0})
        if KINDS.index(v.kind) > KINDS.index(r["kind"]):
            r["kind"] = v.kind
        for k in ("err_ref", "err_cand", "err_fp64"):
            r[k] = max(r[k], getattr(v, k))
    local = {r["layer"]: r for r in report.local}
    say(f"{'layer':>5} {'component':<11} {'verdict':<10} {'ref err':>9} {'cand err':>9} "
        f"{'fp64 diff':>9} {'cand local':>10}")
    for (layer, comp), r in rows.items():
        kind = r["kind"]
        shown = ansi(kind, f"{kind:<10}") if colour else f"{kind:<10}"
        loc = local.get(layer, {}).get("cand_local") if comp == "mlp" else None
        say(f"{'' if layer is None else layer:>5} {comp:<11} {shown} {r['err_ref']:>9.1e} "
            f"{r['err_cand']:>9.1e} {r['err_fp64']:>9.1e} "
            f"{'' if loc is None else format(loc, '.1e'):>10}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="llama-parity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch-smollm2", help="cache SmolLM2-135M-Instruct as an HF folder; prints it last")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("demo", help="greedy answers and the drift-vs-bug verdicts, torchref vs jaxmodel")
    p.add_argument("checkpoint", nargs="?", default=None, help="HF folder (default: cached SmolLM2)")
    p.add_argument("--policy", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: four built-ins")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out-dir", default="parity-report", help="where the HTML reports go")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("compare", help="drift vs bug: per-tap verdicts of a candidate against a reference")
    p.add_argument("checkpoint", nargs="?", default=None, help="HF folder (default: cached SmolLM2)")
    impls = ["torchref", "jaxmodel", "transformers"]
    p.add_argument("--reference", default="torchref", choices=impls)
    p.add_argument("--candidate", default="jaxmodel", choices=impls)
    p.add_argument("--policy", default="fp32", help="preset: fp64 fp32 tf32 bf16 fp16 bf16w-f32 fp64-hf")
    p.add_argument("--prompt", action="append",
                   help="a prompt (repeatable); default: one built-in 258-token prompt")
    p.add_argument("--random-tokens", metavar="BxT", help="random token ids instead of prompts "
                   "(for checkpoints without a tokenizer), e.g. 2x64")
    p.add_argument("--json", help="write the JSON report here (default: in --out-dir)")
    p.add_argument("--html", help="write the HTML report here (default: in --out-dir)")
    p.add_argument("--out-dir", default="parity-report",
                   help="folder for the JSON and HTML reports not given a path (default: %(default)s)")
    p.add_argument("--no-files", action="store_true", help="write only the reports given a path")
    p.add_argument("--no-teacher-forcing", action="store_true")
    p.add_argument("--no-colour", action="store_true")
    p.set_defaults(func=cmd_compare)

    from .probe_cli import add_parser as add_probe_parser
    add_probe_parser(sub)

    args = parser.parse_args(argv)
    from llamaspec import LlamaParityError
    try:
        return args.func(args)
    except LlamaParityError as e:
        print(f"llama-parity: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
