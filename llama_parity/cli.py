"""llama-parity: is the difference between two Llama implementations floating-point drift or a bug?

examples, one per verb (`llama-parity VERB --help`: its flags and more examples):
    llama-parity demo                                  # the problem on the real model, explained
    llama-parity compare MY_HF_FOLDER --policy bf16    # jaxmodel vs torchref on your checkpoint
    llama-parity probe batch --policy bf16 --mode default,invariant
    llama-parity capture --impl jaxmodel --policy bf16 --out /tmp/jax-bf16
    llama-parity repro parity-report/REPORT.json --out case   # its first divergent unit, for upstream
    llama-parity sweep --policies fp32,bf16,fp16 --max-tokens 4096   # what each policy costs on a text
    llama-parity fetch-smollm2                         # prints the cached model's folder
    llama-parity fetch-gemma3                          # Gemma 3 270M, a second real model (tests)
    llama-parity make-checkpoint --shape llama-3.2-1b --layers 2

Exit codes: 0 exact or drift; 1 a precision or semantic finding; 2 a usage error or bad
input (one line naming the argument, file or field; checked before any model loads);
3 an internal error (one line; rerun with --debug for the traceback); 130 interrupted (Ctrl-C);
143 ended by SIGTERM (cleaned up as after Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from llamaspec.files import printable, refuse_inside, safe_name
from llamaspec.plan import check_xla_flags

from .checks import (
    UsageError,
    check_target_folder,
    check_token_budget,
    checkpoint_folder,
    count,
    output_file,
    output_folder,
    positive_int,
    shape,
    unchanged_or_beside,
)
from .fetch import resolve_checkpoint

EXIT_OK, EXIT_FINDING, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

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
    argv = ["--cache-dir", args.cache_dir] if args.cache_dir else []
    return fetch_main(argv + (["--verify"] if args.verify else []), model=args.model)


def cmd_make_checkpoint(args) -> int:
    """A synthetic checkpoint of a real shape (llamaspec.shapes: Llama's and its relatives') with
    SmolLM2's tokenizer where the shape's vocabulary holds its ids, in the cache unless a folder
    is given (never inside this repository)."""
    from llamaspec import LlamaConfig
    from llamaspec.cache import cache_root
    from llamaspec.files import atomic_write
    from llamaspec.shapes import SHAPES, shape_config, write_checkpoint
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(args.dtype, args.dtype)
    shape_config(args.shape, args.layers)     # --layers within the shape's depth, before anything is written
    name = f"{args.shape}-{args.dtype}" + (f"-{args.layers}layers" if args.layers else "") + f"-seed{args.seed}"
    folder = Path(args.folder) if args.folder else cache_root() / "checkpoints" / name
    refuse_inside(folder, "checkpoint folder", f"synthetic weights go to the cache (default "
                  f"{cache_root() / 'checkpoints'}) or a folder outside it", UsageError)
    check_target_folder(folder, args.force)
    output_folder(folder, "checkpoint folder")
    tokenizer = resolve_checkpoint(None)
    # SmolLM2's tokenizer gives ids up to its vocabulary: a shape with fewer tokens (Mistral's
    # 32000) would be handed ids it has no row for, so it gets no tokenizer (--random-tokens)
    tokens, vocab = LlamaConfig.from_file(tokenizer).vocab_size, SHAPES[args.shape]["vocab_size"]
    t0 = time.perf_counter()
    write_checkpoint(folder, args.shape, dtype, args.layers, args.seed,
                     progress=lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", file=sys.stderr, flush=True))
    if tokens <= vocab:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(tokenizer) / f).is_file():
                atomic_write(folder / f, (Path(tokenizer) / f).read_bytes(), "tokenizer file")
    with_tokenizer = ("with SmolLM2's tokenizer" if tokens <= vocab else
                      f"without a tokenizer (SmolLM2's has {tokens} tokens, {args.shape} {vocab}: give the "
                      "commands --random-tokens)")
    say(f"{args.shape} ({args.dtype}{f', {args.layers} layers' if args.layers else ''}, seed {args.seed}) "
        f"{with_tokenizer}, in {time.perf_counter() - t0:.1f} s:")
    say(str(folder))
    return EXIT_OK


def cmd_demo(args) -> int:
    """The problem and its explanation on the real model, with this machine's numbers (llama_parity.demo)."""
    check_xla_flags()     # XLA would end the process on a bad flag: named here, exit 2
    from .demo import run as run_demo
    folder = checkpoint_folder(resolve_checkpoint(args.checkpoint), need_tokenizer="the demo's prompts need")
    out_dir = output_folder(args.out_dir, "--out-dir")
    run_demo(folder, args.prompt or DEFAULT_PROMPTS, args.policy, args.max_new_tokens, out_dir,
             lambda report: print_verdict_table(report, colour=sys.stdout.isatty()), say)
    return EXIT_OK


def _peer(name: str, folder: str, policy):
    """'torchref' / 'jaxmodel' as names; 'transformers' as transformers' eager class for the
    folder's model_type (LlamaForCausalLM, Qwen2ForCausalLM, Gemma2ForCausalLM...) loaded at the
    policy's param dtype (it is then run as transformers runs it), wrapped as the compare
    adapter wraps it (compare.adapters.transformers.TransformersModel.from_pretrained)."""
    if name != "transformers":
        return name     # a name, or a Dump
    from compare.adapters.transformers import TransformersModel  # lazy: imports torch and transformers
    return TransformersModel.from_pretrained(folder, policy, attn_implementation="eager")


def _input_folder(args, checkpoint) -> str:
    """The checkpoint folder, checked, for the --prompt / --random-tokens flags (which
    exclude each other): prompts need its tokenizer."""
    if args.prompt and args.random_tokens:
        raise UsageError("--prompt and --random-tokens exclude each other: give one")
    return checkpoint_folder(resolve_checkpoint(checkpoint), need_tokenizer=None if args.random_tokens else
                             "the prompts need (for a folder without one, pass --random-tokens BxT)")


def _inputs(args, folder):
    """What --prompt / --random-tokens ask for, as compare_models takes inputs (None: the built-in prompt)."""
    if not args.random_tokens:
        return args.prompt
    from llamaspec import LlamaConfig
    B, T = args.random_tokens
    cfg = LlamaConfig.from_file(Path(folder) / "config.json")
    check_token_budget(B, T, cfg.max_position_embeddings, cfg.vocab_size)    # before allocating them
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T))


def _steps_budget(args, folder) -> None:
    """--generate N and --decode N checked before the ladder runs: a generation of N new tokens
    within max_position_embeddings (the rule greedy applies at its start), and the float64 KV
    cache of a decode of N steps ([layers, 2, B, T + N, kv heads, head_dim]) within this
    machine's memory (llamaspec.budget)."""
    if not (args.decode or args.generate):
        return
    from llamaspec import LlamaConfig
    from llamaspec.budget import check_bytes
    cfg = LlamaConfig.from_file(Path(folder) / "config.json")
    B, T = args.random_tokens or (len(args.prompt or DEFAULT_PROMPTS[:1]), 1)
    if args.generate and args.generate > cfg.max_position_embeddings:
        raise UsageError(f"--generate {args.generate}: more new tokens than the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    if args.decode:
        slots = B * (T + args.decode)
        check_bytes(cfg.num_hidden_layers * 2 * slots * cfg.num_key_value_heads * cfg.head_dim * 8,
                    f"--decode {args.decode}: the float64 KV cache of {B} rows x {T + args.decode} positions",
                    UsageError)


def _dumps(args):
    """--reference-dump / --candidate-dump opened (and checked), with what they exclude refused."""
    from compare.adapters.dump import Dump
    given = {"reference": args.reference_dump, "candidate": args.candidate_dump}
    for side, path in given.items():
        if path and getattr(args, side):
            raise UsageError(f"--{side} and --{side}-dump exclude each other: the dump is the {side}")
    dumps = {side: Dump(path) for side, path in given.items() if path}
    if dumps:
        if args.prompt or args.random_tokens:
            raise UsageError("--prompt/--random-tokens: a dump fixes the inputs (the ones it was captured on)")
        if args.decode or args.generate:
            raise UsageError("--decode/--generate: a dump holds one forward pass, not a decode or a generation")
    return dumps


def cmd_compare(args) -> int:
    check_xla_flags()     # XLA would end the process on a bad flag: named here, exit 2
    from compare.adapters.dump import bind_dumps
    from compare.ladder.engine import prepare, run_ladder
    from compare.vocabulary import KINDS
    from llamaspec import Policy

    dumps = _dumps(args)
    checkpoint = _dump_checkpoint(args.checkpoint, dumps)
    folder = _input_folder(args, checkpoint) if not dumps else checkpoint_folder(checkpoint)
    ref_spec = dumps.get("reference") or args.reference or "torchref"
    cand_spec = dumps.get("candidate") or args.candidate or "jaxmodel"
    mesh = _mesh(args.mesh, folder, ref_spec, cand_spec)
    # a dump fixes the inputs and the policy, and the checkpoint must match its fingerprint
    folder, inputs, policy = bind_dumps(ref_spec, cand_spec, folder, None, args.policy)
    inputs = inputs if dumps else _inputs(args, folder)
    _steps_budget(args, folder)
    policy = Policy.get(policy or "fp32")
    args.reference, args.candidate, args.policy = _label(ref_spec), _label(cand_spec), policy.name
    _say_dumps(dumps)
    json_path, html_path = _report_paths(args)
    repro_dir = _repro_folder(args.repro, "--repro") if args.repro else None
    decode_json = (output_file(json_path.with_name(json_path.stem + "-decode.json"), "--json", args.force, say)
                   if args.decode and json_path else None)
    greedy_json = (output_file(json_path.with_name(json_path.stem + "-greedy.json"), "--json", args.force, say)
                   if args.generate and json_path else None)
    t0 = time.perf_counter()

    def progress(m):
        say(f"[{time.perf_counter() - t0:5.1f}s] {m}")
    # the two sides (and their float64 twins) are loaded once for the ladder, --decode and --generate
    ref, cand, ids, mask, policy = prepare(_peer(ref_spec, folder, policy), _peer(cand_spec, folder, policy),
                                           folder, inputs, policy, progress, mesh)
    report = run_ladder(ref, cand, ids, mask, policy, not args.no_teacher_forcing, progress,
                        stream=False if getattr(args, "no_stream", False) else None)
    print_verdict_table(report, colour=sys.stdout.isatty() and not args.no_colour)
    say(report.summary())
    env = report.environment
    say(f"measured on: {env.get('cpu')} ({env.get('cpu isa')}; caps: {env.get('isa caps')}); "
        f"GPU: {env.get('gpu', 'none')}")
    if json_path:
        say(f"JSON report: {report.to_json(unchanged_or_beside(json_path, say))}")
    if html_path:
        say(f"HTML report: {report.to_html(unchanged_or_beside(html_path, say))}")
    verdict, repro_of = report.verdict, report
    if args.decode:
        from compare.ladder.decode import run_decode
        from llamaspec.inputs import left_align
        decoded = run_decode(ref, cand, *left_align(np.asarray(ids, np.int64), np.asarray(mask, np.int64)), policy,
                             args.decode, progress=progress)
        say(decoded.summary())
        if decode_json:
            say(f"decode JSON report: {decoded.to_json(decode_json)}")
        if KINDS.index(decoded.verdict) > KINDS.index(verdict):     # the decode found worse: its step's case
            repro_of = decoded
        verdict = max(verdict, decoded.verdict, key=KINDS.index)
    if repro_dir is not None:
        _write_repro(repro_of, ref, cand, folder, repro_dir, (ids, mask), policy, progress)
    finding = KINDS.index(verdict) > KINDS.index("drift")
    if args.generate:
        from compare.ladder.greedy import run_greedy
        greedy = run_greedy(ref, cand, ids, mask, policy, args.generate, progress)
        say(greedy.summary())
        if greedy_json:
            say(f"greedy JSON report: {greedy.to_json(greedy_json)}")
        finding = finding or greedy.verdict not in ("exact", "drift")
    say(f"done in {time.perf_counter() - t0:.1f} s")
    return EXIT_FINDING if finding else EXIT_OK


def _mesh(text, folder, *specs):
    """--mesh data=N,tensor=M as a dict (None without it), for a side named jaxmodel, checked
    against the checkpoint's config; then, on a CPU, it asks XLA for N x M host devices before
    JAX starts (jaxmodel/sharding.py)."""
    if text is None:
        return None
    if "jaxmodel" not in specs:
        raise UsageError("--mesh shards jaxmodel: give it as the reference or the candidate")
    import math

    from jaxmodel.sharding import check_mesh, host_devices, parse_mesh
    from llamaspec import LlamaConfig
    sizes = parse_mesh(text)
    check_mesh(sizes, LlamaConfig.from_file(Path(folder) / "config.json"))
    host_devices(math.prod(sizes.values()))
    return sizes


def _dump_checkpoint(checkpoint, dumps):
    """The checkpoint given, else (with a dump) the one the dump recorded, which must be a folder here."""
    if dumps and checkpoint is None:
        checkpoint = next(iter(dumps.values())).recorded_checkpoint()
        if checkpoint is None or not Path(checkpoint).is_dir():
            raise UsageError(f"give the checkpoint: the dump's recorded one ({checkpoint}) is not a folder here")
    return checkpoint


def _say_dumps(dumps) -> None:
    """One line per dump side; the manifest's strings with control characters escaped."""
    for side, d in dumps.items():
        env = d.manifest.get("environment") or {}
        say(printable(f"{side}: dump {d.path}, {d.implementation} at {d.policy.name}, captured "
                      f"{d.manifest.get('created', '?')} on {env.get('cpu', '?')} "
                      f"({env.get('jax backend', env.get('torch cuda', '?'))})"))


def _label(spec) -> str:
    """A side's name in report file names: 'jaxmodel', or 'jaxmodel-dump' for a dump of it."""
    return spec if isinstance(spec, str) else f"{safe_name(spec.implementation)}-dump"


def cmd_capture(args) -> int:
    """One implementation's taps on the given inputs, written as a dump (compare.capture)."""
    check_xla_flags()     # XLA would end the process on a bad flag: named here, exit 2
    from compare.capturing import capture
    folder = _input_folder(args, args.checkpoint)
    out = Path(args.out)
    refuse_inside(out, "--out", "dumps go to a folder outside it", UsageError)
    t0 = time.perf_counter()
    capture(folder, args.impl, args.policy, inputs=_inputs(args, folder), out=out, taps=args.taps or "*",
            batch_invariant=args.batch_invariant, teacher_forcing=args.teacher_forcing, force=args.force,
            progress=lambda m: say(f"[{time.perf_counter() - t0:5.1f}s] {m}"))
    say(str(out))
    return EXIT_OK


def _repro_folder(path, what: str) -> Path:
    """A repro case's folder, checked before anything runs: new, empty, or an earlier case
    (compare.repro.case_folder)."""
    from compare.repro import ReproError, case_folder
    try:
        return case_folder(path)
    except ReproError as e:
        raise UsageError(f"{what}: {e}") from None


def _write_repro(report, ref, cand, folder, out, inputs, policy, progress) -> None:
    from compare.repro import write_repro
    _said(write_repro(report, ref, cand, folder, out, inputs=inputs, policy=policy, progress=progress))


def _said(case) -> None:
    """What a written repro case is and how to run it."""
    for note in case.notes:
        say(f"repro: {printable(note)}")
    at = "" if case.step is None else f" at decode step {case.step.step}"
    say(f"repro case of {case.unit.name}{at} ({len(case.taps)} taps): {case.folder}")
    say(f"  run it anywhere with Python 3 and numpy: python {case.folder / 'repro.py'}")


def _remade(role: str, name: str, dump):
    """How a JSON report's side is made again (compare.repro.recipe), or a UsageError that says why
    it cannot be: a Python object (a port, a patched model) is not in a report."""
    from compare.repro import recipe
    r = recipe(name)
    if r is None:
        raise UsageError(f"the report's {role} is {printable(name)}: not an implementation the command line can make "
                         "again (torchref, jaxmodel, transformers[eager|sdpa, dtype], or a dump given with "
                         f"--{role}-dump). "
                         "A Python object (your port, a patched model) cannot be re-created from a JSON report: call "
                         "compare.write_repro(report, reference, candidate, checkpoint, out) with the objects "
                         "themselves (docs/repro.md)")
    if r.kind == "dump":
        if dump is None:
            raise UsageError(f"the report's {role} is a dump ({printable(name)}): give its folder with --{role}-dump")
        if dump.name != name:
            raise UsageError(f"--{role}-dump {dump.path} holds {dump.name}; the report's {role} is {printable(name)}")
        return dump
    if dump is not None:
        raise UsageError(f"--{role}-dump: the report's {role} is {printable(name)}, not a dump")
    return r


def _made(spec, folder, policy):
    """A side for write_repro from _remade's answer: a Dump as it is, torchref / jaxmodel by name
    (their reference backend where the report's name says so), transformers' class at its dtype."""
    from compare.adapters.dump import Dump
    if isinstance(spec, Dump):
        return spec
    if spec.kind == "transformers":
        from compare.adapters.transformers import TransformersModel  # lazy: imports torch and transformers
        attn, preset = spec.detail
        return TransformersModel.from_pretrained(folder, preset, attn_implementation=attn)
    from compare.ladder.stream import checkpoint_side
    return checkpoint_side(spec.kind, folder, policy, spec.detail[0])


def _unit(text):
    """--unit: a layer index, layers.N, embed or head (compare.repro.unit_of checks it on the model)."""
    return int(text) if text.isdigit() else text


def cmd_repro(args) -> int:
    """A JSON report's first divergent unit as a standalone case (compare.repro.write_repro), its
    sides made again by name; the report holds no token ids, so the inputs are given again (the
    compare run's --prompt / --random-tokens, or its dumps)."""
    check_xla_flags()     # XLA would end the process on a bad flag: named here, exit 2
    from compare.repro import ReproError, summarize, write_repro
    from llamaspec.budget import load_json
    doc = load_json(args.report, UsageError, what="report")
    try:
        summary = summarize(doc)
    except ReproError as e:
        raise UsageError(f"{args.report}: {e}") from None
    out = _repro_folder(args.out, "--out")
    dumps = _dumps(args)
    specs = {role: _remade(role, getattr(summary, role), dumps.get(role)) for role in ("reference", "candidate")}
    checkpoint = _dump_checkpoint(args.checkpoint, dumps)
    folder = _input_folder(args, checkpoint) if not dumps else checkpoint_folder(checkpoint)
    inputs = None if dumps else _inputs(args, folder)
    t0 = time.perf_counter()
    say(f"{args.report}: {summary.verdict}" + (f", first divergence {summary.divergence.tap}" if summary.divergence
                                              else "") + f"; {summary.candidate} vs {summary.reference} at "
        f"{summary.policy.name}")
    sides = [_made(specs[role], folder, summary.policy) for role in ("reference", "candidate")]
    try:
        case = write_repro(doc, *sides, folder, out, inputs=inputs, unit=args.unit, step=args.step,
                           progress=lambda m: say(f"[{time.perf_counter() - t0:5.1f}s] {m}"))
    except ReproError as e:
        raise UsageError(f"{args.report}: {e}") from None
    _said(case)
    return EXIT_OK


SWEEP_POLICIES = "fp32,bf16,fp16,bf16w-f32"
KEEP_WIDE = 2
SENSITIVITY_WINDOWS, WIDE_POLICY = 2, "fp32"      # compare.sweep.run's (a test holds them equal)


SWEEP_FLAGS = {"impl": "--impl", "policies": "--policies", "pair": "--pair", "window": "--window",
               "keep_wide": "--keep-wide", "wide_policy": "--wide-policy",
               "sensitivity_windows": "--sensitivity-windows", "stream": "--stream"}


def _sweep_pairs(values) -> list[tuple[str, str]]:
    """--pair CAND:BASE (repeatable) -> [(cand, base)]; which names may stand there is
    compare.sweep.check_sweep's to say."""
    out = []
    for v in values or []:
        cand, sep, base = v.partition(":")
        if not sep or not cand or not base:
            raise UsageError(f"--pair {v!r}: give CANDIDATE:BASE, e.g. bf16:fp16")
        out.append((cand, base))
    return out


def cmd_sweep(args) -> int:
    """Each policy against the fp64 oracle over a text (compare.sweep): the table, --json and
    --html. Every argument is checked before a model loads (compare.sweep.check_sweep, its errors
    naming the flags)."""
    from compare.sweep import check_sweep, read_text, sweep, table
    from llamaspec import InputError, LlamaConfig, Policy, PolicyError
    try:
        policies = [Policy.get(p.strip()).name for p in args.policies.split(",") if p.strip()]
    except PolicyError as e:
        raise UsageError(f"--policies: {e}") from None
    pairs = _sweep_pairs(args.pair)
    if args.text and args.random_tokens:
        raise UsageError("--text and --random-tokens exclude each other: give one")
    try:     # bounded and UTF-8, before any model loads
        text = read_text(args.text) if args.text else None
    except InputError as e:
        raise UsageError(f"--text {e}") from None
    folder = checkpoint_folder(resolve_checkpoint(args.checkpoint), need_tokenizer=None if args.random_tokens
                               else "the text needs (for a folder without one, pass --random-tokens N)")
    cfg = LlamaConfig.from_file(Path(folder) / "config.json")
    if args.keep_wide is None:     # the default, within a small model's layers
        args.keep_wide = min(KEEP_WIDE, cfg.num_hidden_layers) if args.sensitivity_windows else 0
    try:
        check_sweep(args.impl, policies, pairs, args.window, cfg, SWEEP_FLAGS.get, args.keep_wide, args.wide_policy,
                    args.sensitivity_windows, args.stream)
    except InputError as e:
        raise UsageError(str(e)) from None
    tokens = None
    if args.random_tokens:
        from llamaspec.budget import check_bytes
        check_bytes(args.random_tokens * 8, f"--random-tokens {args.random_tokens}: the token ids", UsageError)
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, args.random_tokens)
    json_path = output_file(args.json, "--json", args.force, say) if args.json else None
    html_path = output_file(args.html, "--html", args.force, say) if args.html else None
    t0 = time.perf_counter()
    res = sweep(args.impl, folder, policies, text=text, window=args.window, max_tokens=args.max_tokens,
                progress=lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", file=sys.stderr, flush=True),
                tokens=tokens, pairs=pairs, prompts=args.prompts, new_tokens=args.new_tokens,
                keep_wide=args.keep_wide, wide_policy=args.wide_policy, sensitivity_windows=args.sensitivity_windows,
                stream=args.stream)
    for line in table(res):
        say(line)
    if json_path:
        say(f"JSON: {res.to_json(unchanged_or_beside(json_path, say))}")
    if html_path:
        say(f"HTML: {res.to_html(unchanged_or_beside(html_path, say))}")
    return EXIT_OK


def _report_paths(args):
    """--json/--html where given; otherwise both go to --out-dir (default ./parity-report/,
    git-ignored), named after the comparison, unless --no-files. Checked before the run."""
    json_path, html_path = args.json, args.html
    if not args.no_files:
        # names from a dump's manifest: one safe file-name component, never a path
        stem = safe_name(f"{args.candidate}-vs-{args.reference}-{args.policy}")
        if not (json_path and html_path):
            out = output_folder(args.out_dir, "--out-dir")
            json_path, html_path = json_path or out / f"{stem}.json", html_path or out / f"{stem}.html"
    return (output_file(json_path, "--json", args.force, say) if json_path else None,
            output_file(html_path, "--html", args.force, say) if html_path else None)


def print_verdict_table(report, colour: bool) -> None:
    """One row per (layer, component): the worst kind among its taps (a tap that inherits the
    first divergence shows as "inherited", below any finding) and the largest errors."""
    from compare.vocabulary import TAP_KINDS, ansi
    rows: dict = {}
    for v in report.taps:
        key = (v.layer, v.component)
        r = rows.setdefault(key, {"kind": "exact", "err_ref": 0.0, "err_cand": 0.0, "err_fp64": 0.0})
        if TAP_KINDS.index(v.kind) > TAP_KINDS.index(r["kind"]):
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


def _add_input_flags(p) -> None:
    p.add_argument("--prompt", action="append",
                   help="a prompt (repeatable); default: one built-in 258-token prompt")
    p.add_argument("--random-tokens", metavar="BxT", type=shape, help="random token ids instead of prompts "
                   "(for checkpoints without a tokenizer), e.g. 2x64")


def _verb(sub, common, name: str, summary: str, description: str, examples: str):
    """A verb's parser: its one-line summary in `llama-parity --help`, a description and
    examples in `llama-parity NAME --help`."""
    return sub.add_parser(name, parents=[common], help=summary, description=description,
                          epilog="examples:\n" + examples, formatter_class=_formatter)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Raw descriptions and examples; each verb's summary on its name's line (argparse sizes
    the help column by the options alone, so make-checkpoint's summary would wrap)."""

    def add_argument(self, action):
        super().add_argument(action)
        for verb in getattr(action, "_get_subactions", list)():
            self._action_max_length = max(self._action_max_length, len(verb.dest) + self._current_indent + 2)


def _formatter(prog):
    return _Formatter(prog, max_help_position=32)


def _add_fetch_parser(sub, common) -> None:
    """One verb per real model of llama_parity.fetch.MODELS: fetch-smollm2, fetch-gemma3."""
    from .fetch import MODELS, SMOLLM2
    for model in MODELS.values():
        verb = f"fetch-{model.key}"
        later = "Every later command finds it there." if model is SMOLLM2 else \
            "Commands use it when given that folder."
        p = _verb(sub, common, verb, f"cache {model.name}; prints its folder",
                  f"Downloads {model.summary}\nfrom {model.origin},\nchecks the GGUF's sha256, "
                  "dequantizes it to Hugging Face safetensors in the cache\n(~/.cache/llama-parity, or "
                  f"$LLAMA_PARITY_CACHE), and prints the folder as the last line.\n{later}",
                  f"  llama-parity {verb}\n  llama-parity {verb} --verify      # check every cached byte")
        p.add_argument("--cache-dir", default=None)
        p.add_argument("--verify", action="store_true", help="check the sha256 of every cached file (fetch again "
                       "on a mismatch)")
        p.set_defaults(func=cmd_fetch, model=model.key)


def _add_make_checkpoint_parser(sub, common) -> None:
    from llamaspec.shapes import SHAPES
    p = _verb(sub, common, "make-checkpoint", "random weights of a real model shape (scale tests)",
              "Writes the real config of a model shape (Llama, Qwen2.5, Qwen3, Mistral, Gemma 2/3, OLMo 2) with\n"
              "random weights and SmolLM2's tokenizer (none where the shape has fewer tokens), one tensor\n"
              "at a time, into the cache's checkpoints/ folder (never this repository).",
              "  llama-parity make-checkpoint --shape llama-3.2-1b --layers 2")
    p.add_argument("folder", nargs="?", default=None, help="where (default: the cache's checkpoints/ folder)")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default: the real depth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="write over a checkpoint already in the folder")
    p.set_defaults(func=cmd_make_checkpoint)


def _add_demo_parser(sub, common) -> None:
    p = _verb(sub, common, "demo", "the problem on the real model, explained",
              "Both models answer the prompts greedily at each policy, each prompt alone and all in one\n"
              "batch; where two answers differ it says why (the step, both tokens, the margin, the fp64\n"
              "oracle, drift or bug) and, where batching changed one, shows the batch-invariant mode;\n"
              "where none differ, the nearest tie. Then the ladder's verdict table and what each step cost.\n"
              "Reports and a JSON summary go to --out-dir.",
              "  llama-parity demo\n  llama-parity demo --policy bf16 --prompt 'What is 2 + 2?' --max-new-tokens 16")
    p.add_argument("checkpoint", nargs="?", default=None, help="HF folder (default: cached SmolLM2)")
    p.add_argument("--policy", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: four built-ins")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--out-dir", default="parity-report", help="where the HTML reports and demo.json go")
    p.set_defaults(func=cmd_demo)


def _add_compare_parser(sub, common) -> None:
    p = _verb(sub, common, "compare", "drift or bug: per-tap verdicts, two implementations",
              "Runs the reference and the candidate at the policy, the fp64 oracle and the candidate at\n"
              "fp64 on the same inputs, captures every tap, and says per layer and component whether the\n"
              "difference is exact, drift, precision or semantic, where it starts (teacher forcing), and\n"
              "why. Writes JSON and HTML reports; exit code 1 on a precision or semantic finding.",
              "  llama-parity compare                                  # jaxmodel vs torchref, SmolLM2, fp32\n"
              "  llama-parity compare MY_HF_FOLDER --candidate transformers --policy bf16\n"
              "  llama-parity compare --policy bf16 --generate 16 --prompt 'What is the capital of France?'\n"
              "  llama-parity compare --candidate-dump DIR              # a dump captured elsewhere\n"
              "  llama-parity compare --mesh tensor=3                   # jaxmodel tensor-parallel over 3 devices")
    p.add_argument("checkpoint", nargs="?", default=None, help="HF folder (default: cached SmolLM2, or the one a "
                   "dump recorded)")
    impls = ["torchref", "jaxmodel", "transformers"]
    p.add_argument("--reference", default=None, choices=impls, help="default: torchref")
    p.add_argument("--candidate", default=None, choices=impls, help="default: jaxmodel")
    p.add_argument("--reference-dump", metavar="DIR", help="a dump (llama-parity capture, docs/dumps.md) as the "
                   "reference: its inputs and policy are used, the checkpoint must match its fingerprint")
    p.add_argument("--candidate-dump", metavar="DIR", help="a dump as the candidate (as --reference-dump)")
    p.add_argument("--policy", default=None, help="preset (fp64 fp32 tf32 bf16 fp16 bf16w-f32 fp64-hf) or a policy "
                   "string, e.g. bf16+kv_cache=e4m3:channel (docs/fp8.md; default: fp32, or a dump's)")
    _add_input_flags(p)
    p.add_argument("--json", help="write the JSON report here (default: in --out-dir)")
    p.add_argument("--html", help="write the HTML report here (default: in --out-dir)")
    p.add_argument("--out-dir", default="parity-report",
                   help="folder for the JSON and HTML reports not given a path (default: %(default)s)")
    p.add_argument("--no-files", action="store_true", help="write only the reports given a path")
    p.add_argument("--force", action="store_true", help="overwrite report paths that hold files llama-parity "
                   "did not write")
    p.add_argument("--no-teacher-forcing", action="store_true")
    p.add_argument("--no-stream", action="store_true",
                   help="capture whole runs instead of walking the checkpoint layer by layer (more memory)")
    p.add_argument("--repro", metavar="DIR", help="also write the first divergent unit (a layer, the embedding or "
                   "the head) as a standalone case runnable with numpy alone (docs/repro.md)")
    p.add_argument("--mesh", metavar="AXES", help="run jaxmodel sharded on a JAX mesh, e.g. tensor=3 or "
                   "data=2,tensor=3 (on a CPU: as many host devices; docs/sharding.md)")
    _add_compare_extras(p)
    p.set_defaults(func=cmd_compare)


def _add_compare_extras(p) -> None:
    """compare's --decode / --generate and --no-colour."""
    p.add_argument("--decode", metavar="N", type=positive_int, default=None,
                   help="also decode N tokens through each side's KV cache and judge every step against the "
                   "oracle's full recompute (first divergent step, tap, layer, component)")
    p.add_argument("--generate", metavar="N", type=positive_int, default=None,
                   help="also generate N tokens greedily on both sides; where they part: the step, both tokens, "
                   "the reference's top-1/top-2 margin and the cause (near tie, drift / the ladder's finding on "
                   "the common prefix)")
    p.add_argument("--no-colour", action="store_true")


def _add_repro_parser(sub, common) -> None:
    p = _verb(sub, common, "repro", "a report's first divergent unit as a case to hand upstream",
              "Writes the first divergent unit of a compare report (a decoder layer, the embedding, or the head)\n"
              "as a standalone case: its weights, the oracle's input to it, both sides' outputs at every tap\n"
              "inside it, and repro.py, which recomputes the unit in float64 with numpy alone and shows where\n"
              "the candidate leaves the reference's rounding (docs/repro.md). The sides are made again from the\n"
              "report's names (torchref, jaxmodel, transformers, a dump); a Python port needs\n"
              "compare.write_repro. The report holds no token ids, only their digest: give the compare run's\n"
              "inputs again (others are refused). A decode report (compare --decode N --json r.json writes\n"
              "r-decode.json) gives the unit at its first divergent step, decoded through each side's cache.",
              "  llama-parity compare --candidate transformers --json r.json && llama-parity repro r.json --out case\n"
              "  llama-parity repro r-decode.json --out case --step 2\n"
              "  llama-parity repro r.json MY_HF_FOLDER --random-tokens 2x64 --out case --unit layers.3\n"
              "  python case/repro.py")
    p.add_argument("report", help="a compare JSON report (--json), or its decode report (-decode.json)")
    p.add_argument("checkpoint", nargs="?", default=None, help="the HF folder it compared (default: cached SmolLM2, "
                   "or the one a dump recorded)")
    p.add_argument("--out", required=True, metavar="DIR", help="the case's folder (new, empty, or an earlier case)")
    _add_input_flags(p)
    p.add_argument("--reference-dump", metavar="DIR", help="the report's reference, when it was a dump")
    p.add_argument("--candidate-dump", metavar="DIR", help="the report's candidate, when it was a dump")
    p.add_argument("--unit", type=_unit, default=None, help="another unit than the first divergence's: a layer "
                   "index, layers.N, embed or head")
    p.add_argument("--step", type=positive_int, default=None, help="a decode report's step (default: its first "
                   "divergent step, else the step it lists)")
    p.set_defaults(func=cmd_repro, reference=None, candidate=None, decode=None, generate=None)


def _add_capture_parser(sub, common) -> None:
    p = _verb(sub, common, "capture", "one side's taps as a dump, judged later by compare",
              "Runs one implementation on the inputs and writes every tap (or those asked for) per layer as\n"
              "safetensors with a manifest (inputs, policy, environment, checkpoint fingerprint), so that\n"
              "`compare --candidate-dump DIR` can judge it later, on another machine (docs/dumps.md).",
              "  llama-parity capture --impl jaxmodel --policy bf16 --out /tmp/jax-bf16\n"
              "  llama-parity compare --candidate-dump /tmp/jax-bf16")
    p.add_argument("checkpoint", nargs="?", default=None, help="HF folder (default: cached SmolLM2)")
    p.add_argument("--impl", default="jaxmodel", choices=["torchref", "jaxmodel"])
    p.add_argument("--policy", default="bf16", help="preset (fp64 fp32 tf32 bf16 fp16 bf16w-f32 fp64-hf) or a policy "
                   "string, e.g. bf16+weight_fp8=e4m3:block128 (docs/fp8.md)")
    _add_input_flags(p)
    p.add_argument("--taps", action="append", help="a tap name or glob (repeatable), e.g. 'layers.*.out'; "
                   "default: every tap")
    p.add_argument("--batch-invariant", action="store_true", help="capture the batch-invariant mode")
    p.add_argument("--teacher-forcing", action="store_true", help="also capture the run with every layer fed the "
                   "oracle's input (torchref at fp64), so that compare can localise with this dump")
    p.add_argument("--out", required=True, help="the dump's folder (new or empty)")
    p.add_argument("--force", action="store_true", help="replace a dump already in --out")
    p.set_defaults(func=cmd_capture)


def _add_sweep_parser(sub, common) -> None:
    p = _verb(sub, common, "sweep", "what each precision policy costs on a text (KLD, top-1, PPL)",
              "Runs one implementation at each policy and at fp64 (the oracle) over a text in windows of N\n"
              "tokens and prints, per policy against the oracle (and per --pair against each other), the\n"
              "measures of llama.cpp's perplexity --kl-divergence: mean KLD with its standard error, KLD\n"
              "percentiles and max, same top p, PPL ratio, RMS of the change in the correct token's\n"
              "probability; then the first token where greedy continuations part. Teacher forcing on the\n"
              "first windows ranks each policy's layers by their own error; --keep-wide K adds, per policy,\n"
              "a row with its K most sensitive layers at --wide-policy, measured like the others. --stream\n"
              "loads no model: all of them are walked together layer by layer over the checkpoint (docs/sweep.md).",
              "  llama-parity sweep                                     # SmolLM2 over docs/method.md\n"
              "  llama-parity sweep MY_HF_FOLDER --text corpus.txt --max-tokens 8192 --json sweep.json\n"
              "  llama-parity sweep --policies bf16,fp16 --pair bf16:fp16\n"
              "  llama-parity sweep --policies bf16,bf16+weight_fp8=e4m3:block128 --keep-wide 2 --html sweep.html\n"
              "  llama-parity sweep BIG_HF_FOLDER --policies bf16,fp16 --stream --prompts 1   # bigger than memory")
    p.add_argument("checkpoint", nargs="?", default=None, help="HF folder (default: cached SmolLM2)")
    p.add_argument("--impl", default="torchref", choices=["torchref", "jaxmodel"])
    p.add_argument("--policies", default=SWEEP_POLICIES, help="comma list of presets or policy strings, e.g. "
                   "bf16+kv_cache=e4m3:channel (default: %(default)s)")
    p.add_argument("--pair", action="append", metavar="CAND:BASE", help="also measure CAND against BASE (two "
                   "swept policies, or fp64), e.g. bf16:fp16 (repeatable)")
    p.add_argument("--text", metavar="FILE", help="a UTF-8 text file (default: the project's docs/method.md)")
    p.add_argument("--random-tokens", metavar="N", type=positive_int, help="N random token ids instead of a "
                   "text (for checkpoints without a tokenizer)")
    p.add_argument("--window", type=positive_int, default=512, help="tokens per window (default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="use the text's first N tokens")
    p.add_argument("--prompts", type=count, default=4, help="greedy divergence over this many prompts cut from "
                   "the text (0: none; default: %(default)s)")
    p.add_argument("--new-tokens", type=positive_int, default=32, help="greedy tokens per prompt")
    p.add_argument("--sensitivity-windows", metavar="N", type=count, default=SENSITIVITY_WINDOWS,
                   help="measure each layer's local error (teacher forcing) on the first N windows (0: not; "
                   "default: %(default)s)")
    p.add_argument("--keep-wide", metavar="K", type=int, default=None, help="per policy, also run it with its K "
                   f"most sensitive layers at --wide-policy (0: not; default: {KEEP_WIDE}, 0 with "
                   "--sensitivity-windows 0)")
    p.add_argument("--wide-policy", metavar="POLICY", default=WIDE_POLICY, help="the policy of the layers kept wide "
                   "(default: %(default)s)")
    p.add_argument("--stream", action="store_true", help="load no model: per window one walk over the "
                   "checkpoint's layers runs every policy and the oracle (one layer's weights in memory at a time; "
                   "for models bigger than memory). The greedy part then recomputes each whole sequence per new "
                   "token (no KV cache): --new-tokens walks, each over every prompt and model")
    p.add_argument("--json", metavar="OUT", help="write the result as JSON here")
    p.add_argument("--html", metavar="OUT", help="write the HTML page here (table, KLD per policy, local error "
                   "against depth, sensitivity bars)")
    p.add_argument("--force", action="store_true", help="overwrite a --json or --html file llama-parity did not "
                   "write")
    p.set_defaults(func=cmd_sweep)


def main(argv=None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(prog="llama-parity", description=head, epilog=rest, formatter_class=_formatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an internal error")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an internal error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB")
    for add in (_add_demo_parser, _add_compare_parser, _add_repro_parser, _add_capture_parser, _add_sweep_parser,
                _add_fetch_parser, _add_make_checkpoint_parser):
        add(sub, common)
    from .probe_cli import add_parser as add_probe_parser
    add_probe_parser(sub, common)

    args = parser.parse_args(argv)
    return run(args.func, args)


def run(func, args) -> int:
    """func(args) with the exit codes of the module docstring. SIGTERM unwinds like Ctrl-C
    (llamaspec.interrupts: child processes ended, scratch folders removed), exit 128 + 15."""
    from llamaspec import LlamaParityError
    from llamaspec.interrupts import sigterm_as_interrupt
    try:
        with sigterm_as_interrupt():
            return func(args)
    except LlamaParityError as e:   # UsageError included: bad argument, file, field or input
        print(f"llama-parity: error: {printable(e)}", file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        if args.debug:
            raise
        print(f"llama-parity: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:      # Ctrl-C: 130; SIGTERM (interrupts.Terminated): 143
        print(f"llama-parity: interrupted{f' ({e})' if str(e) else ''}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_INTERRUPTED)
    except Exception as e:  # noqa: BLE001 (the last line of defence: one line and a code)
        if args.debug:
            raise
        where = e.__traceback__
        while where.tb_next:
            where = where.tb_next
        at = f"{Path(where.tb_frame.f_code.co_filename).name}:{where.tb_lineno}"
        print(f"llama-parity: internal error: {type(e).__name__}: {printable(e)} (at {at}); rerun with --debug "
              "for the traceback", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
