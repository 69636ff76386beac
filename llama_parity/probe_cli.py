"""`llama-parity probe {batch,padding,determinism,divergence,all}`: invariance probes.

    llama-parity probe batch --impl torchref,jaxmodel --policy fp32,bf16 --mode default,invariant
    llama-parity probe all --checkpoint DIR --json probes.json --html probes.html

Progress goes to stderr, the table to stdout. Exit code 1 when a probe finds a
semantic problem (a padding, mask, position or cache error, or NaN/Inf), 2 on a usage
error (checked before any model loads) or when nothing could run, 3 on an internal
error, 0 otherwise (exact or drift).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from compare.environment import environment
from compare.probes import IMPLS, load_model, probe_cross_greedy, probe_where, run_probe
from compare.probes.where import resolve_device
from compare.probes.where_plan import CIRCUMSTANCES, GPU, check_budget, circumstance
from compare.report import probes as probes_report
from compare.report import where as where_report
from llamaspec import LlamaConfig, Policy, caps
from llamaspec.budget import MAX_RUNS, check_count, check_tokens
from llamaspec.files import atomic_write, json_text
from llamaspec.plan import check_xla_flags
from llamaspec.tokenizer import Tokenizer

from .checks import UsageError, checkpoint_folder, count, output_file, positive_int, positive_ints
from .fetch import resolve_checkpoint

PROBE_KINDS = ("batch", "padding", "determinism", "divergence", "all")
WHERE = "where"   # the layerwise circumstance comparison (cmd_where), not part of "all"
# The flags that set a plan option shaping probe where's largest call (named in the budget's message).
SIZE_FLAGS = {"batch_sizes": "--batch-sizes", "pad": "--pad"}
DEFAULT_PROMPT = "What is the capital of France?"


def _list(values, default, allowed=None, what="value") -> list[str]:
    """Repeatable and comma-separated options -> a de-duplicated list, in order."""
    out = []
    for v in values or [default]:
        for x in str(v).split(","):
            x = x.strip()
            if x and x not in out:
                if allowed and x not in allowed:
                    raise UsageError(f"unknown {what} '{x}' (one of {', '.join(allowed)})")
                out.append(x)
    return out


def add_parser(sub, common) -> None:
    p = sub.add_parser("probe", parents=[common],
                       help="invariance: batch, padding, run-to-run, greedy; where",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=(*PROBE_KINDS, WHERE))
    p.add_argument("checkpoint_pos", nargs="?", default=None, metavar="CHECKPOINT",
                   help="HF folder (or --checkpoint); default: cached SmolLM2, fetched if missing")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--impl", action="append", help="torchref, jaxmodel, transformers (repeatable or "
                   "comma list; default torchref,jaxmodel)")
    p.add_argument("--policy", action="append", help="preset(s) or policy strings (bf16+kv_cache=e4m3:channel), "
                   "repeatable or comma list (default fp32)")
    p.add_argument("--mode", action="append", help="default, invariant (repeatable or comma list)")
    p.add_argument("--batch-invariant", action="store_true", help="same as --mode invariant")
    p.add_argument("--prompt", default=None, help=f"target prompt (default {DEFAULT_PROMPT!r}; random "
                   "tokens when the checkpoint has no tokenizer)")
    p.add_argument("--length", type=positive_int, default=24, help="random target length (no tokenizer)")
    p.add_argument("--batch-sizes", type=positive_ints, default="2,3,4,8,16,32")
    p.add_argument("--completions", type=positive_int, default=24, help="greedy completions per model")
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens per greedy completion")
    p.add_argument("--divergence-batch-sizes", type=positive_ints, default="4,8,16")
    p.add_argument("--repeats", type=positive_int, default=2, help="in-process repeats (determinism)")
    p.add_argument("--processes", type=count, default=1, help="fresh processes (determinism)")
    p.add_argument("--no-cross", action="store_true", help="skip jaxmodel-vs-torchref greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write all results here")
    p.add_argument("--html", help="write the HTML report here")
    p.add_argument("--force", action="store_true", help="overwrite --json/--html files llama-parity did not write")
    p.add_argument("--no-colour", action="store_true")
    w = p.add_argument_group("probe where (layer by layer: the first tap where two circumstances part)")
    w.add_argument("--circumstance", default="batch", choices=tuple(CIRCUMSTANCES),
                   help="; ".join(f"{c.name}: {c.help}" for c in CIRCUMSTANCES.values()))
    w.add_argument("--attn", default="eager", choices=("eager", "sdpa"), help="transformers' attention")
    w.add_argument("--hf-positions", default="mask", choices=("mask", "default"),
                   help="transformers' position ids: from the mask, or its own default (arange: left padding shifts)")
    w.add_argument("--pad", type=positive_int, default=5, help="pad slots (padding)")
    w.add_argument("--no-stream", action="store_true", help="capture whole runs instead of layer by layer")
    w.add_argument("--mesh", action="append", metavar="AXES", help="sharding: a mesh to compare with one device, "
                   "e.g. tensor=3 or data=2 (repeatable; default: every tensor size up to 8 the model allows, "
                   "and data=2; jaxmodel only)")
    w.add_argument("--other-device", choices=(GPU, "cap"), default=None,
                   help="device: what this CPU is compared with: gpu (the model on the GPU, in this process; torchref) "
                   "or cap (this CPU capped to an older instruction set, --device-cap, in a second process); "
                   f"default: the GPU where the implementation's framework reports one, else cap {caps.DEFAULT}")
    w.add_argument("--device-cap", choices=tuple(caps.CAPS), default=None,
                   help="device: the instruction-set cap of the second process ("
                   + "; ".join(f"{c.name}: {c.machine}" for c in caps.CAPS.values())
                   + f"; llamaspec/caps.py lists the variables; default {caps.DEFAULT}); implies --other-device cap")
    p.set_defaults(func=cmd_probe)


def _log(t0):
    def say(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
    return say


def target_tokens(folder, prompt, length, seed):
    """Token ids of the target and how they were made."""
    if os.path.lexists(Path(folder) / "tokenizer.json"):   # present: its reader refuses what is not a file
        tok = Tokenizer.from_pretrained(folder)
        text = prompt or DEFAULT_PROMPT
        ids = tok.encode_chat(text) if tok.has_chat_template else tok.encode_prompt(text)
        return np.asarray(ids, np.int64), f"prompt {text!r} ({len(ids)} tokens)"
    if prompt:
        raise UsageError(f"checkpoint {folder}: no tokenizer.json, which --prompt needs; drop --prompt "
                         "(random tokens are used)")
    cfg = LlamaConfig.from_file(Path(folder) / "config.json")
    check_tokens(1, length, cfg.max_position_embeddings, cfg.vocab_size, f"--length {length}", UsageError)
    vocab = cfg.vocab_size
    ids = np.random.default_rng(seed).integers(0, vocab, length)
    return ids.astype(np.int64), f"{length} random tokens (no tokenizer)"


def run_probes(kinds, models, target, args, say) -> list:
    """Runs the probes on each loaded model; cross-framework greedy when both ours are there."""
    sizes, dsizes = args.batch_sizes, args.divergence_batch_sizes
    out = []
    for pm in models:
        for kind in kinds:
            kw = dict(seed=args.seed, progress=say)
            if kind == "batch":
                kw["batch_sizes"] = sizes
            elif kind == "determinism":
                kw.update(repeats=args.repeats, processes=args.processes)
            elif kind == "divergence":
                kw.update(completions=args.completions, new_tokens=args.new_tokens, batch_sizes=dsizes)
            r = run_probe(kind, pm, ids=target, **kw)
            say(f"{r.probe} [{r.model}]: {r.verdict}")
            out.append(r)
    by_impl = {pm.impl: pm for pm in models}
    if "divergence" in kinds and not args.no_cross and {"jaxmodel", "torchref"} <= set(by_impl):
        r = probe_cross_greedy(by_impl["jaxmodel"], by_impl["torchref"], new_tokens=args.new_tokens,
                               seed=args.seed, progress=say)
        say(f"{r.probe} [{r.model}]: {r.verdict}")
        out.append(r)
    return out


def cmd_probe(args) -> int:
    check_xla_flags()     # XLA would end the process on a bad flag: named here, exit 2
    if args.kind == WHERE:
        return cmd_where(args)
    if args.mesh:
        raise UsageError(f"--mesh {args.mesh[0]}: only probe where --circumstance sharding uses a mesh; probe "
                         f"{args.kind} runs each model on one device")
    t0 = time.perf_counter()
    say = _log(t0)
    impls = _list(args.impl, "torchref,jaxmodel", IMPLS, "implementation")
    policies = [Policy.get(p).name for p in _list(args.policy, "fp32")]
    modes = _list(args.mode, "invariant" if args.batch_invariant else "default",
                  ("default", "invariant"), "mode")
    if args.batch_invariant and "invariant" not in modes:
        modes.append("invariant")
    kinds = list(PROBE_KINDS[:-1]) if args.kind == "all" else [args.kind]
    json_path = output_file(args.json, "--json", args.force, say) if args.json else None
    html_path = output_file(args.html, "--html", args.force, say) if args.html else None
    folder = checkpoint_folder(resolve_checkpoint(args.checkpoint or args.checkpoint_pos, say))
    target, how = target_tokens(folder, args.prompt, args.length, args.seed)
    _probe_budget(args, kinds, folder, target.size)
    say(f"checkpoint {folder}; target: {how}")

    results, skipped, env = [], [], {}
    for policy in policies:
        for mode in modes:
            models = []
            for impl in impls:
                say(f"loading {impl} at {policy} ({mode} mode)")
                try:
                    models.append(load_model(impl, folder, policy, batch_invariant=mode == "invariant"))
                except NotImplementedError as e:
                    skipped.append(f"{impl} {policy} {mode}: {e}")
                    say(f"  skipped: {e}")
            # the record with the plans of the models loaded (the backend, device and path each chose),
            # made while they are loaded: "<impl> <policy> <mode> plan ..." per model
            env.update(environment(policy, sides={pm.name: pm for pm in models}))
            results += run_probes(kinds, models, target, args, say)
            del models
            gc.collect()

    print(probes_report.format_table(results, colour=sys.stdout.isatty() and not args.no_colour))
    for s in skipped:
        print(f"skipped {s}")
    meta = {"checkpoint": folder, "target": how, "probes": kinds, "impls": impls, "policies": policies,
            "modes": modes, "skipped": skipped, "argv": sys.argv[1:], "environment": env}
    if json_path:
        print(f"JSON: {probes_report.write_json(results, json_path, meta)}")
    if html_path:
        print(f"HTML: {probes_report.write_html(results, html_path, meta)}")
    say(f"done: {len(results)} results")
    if not results:
        print("llama-parity probe: nothing ran (every implementation/mode was skipped)", file=sys.stderr)
        return 2
    return 1 if any(r.verdict == "semantic" for r in results) else 0


def _probe_budget(args, kinds, folder, T) -> None:
    """The counts of runs (--completions, --repeats, --processes) within MAX_RUNS, and the largest
    forward call the probes asked for (rows x slots: --batch-sizes, --divergence-batch-sizes,
    --new-tokens and the target's T tokens; companions up to 2T, padding up to 7 slots more)
    within the memory budget of llamaspec.budget.check_tokens, before any model loads."""
    for flag in ("completions", "repeats", "processes"):
        check_count(getattr(args, flag), MAX_RUNS, f"--{flag}", UsageError, "each is a model run")
    cfg = LlamaConfig.from_file(Path(folder) / "config.json")
    calls = {"batch": (max(args.batch_sizes), 2 * T, "--batch-sizes"), "padding": (2, T + 5, "the target"),
             "determinism": (4, 2 * T, "the target"),
             "divergence": (max(args.divergence_batch_sizes), 2 * T + 7 + args.new_tokens,
                            "--divergence-batch-sizes, --new-tokens")}
    for kind in kinds:
        rows, width, flags = calls[kind]
        check_tokens(rows, T, cfg.max_position_embeddings, cfg.vocab_size,
                     f"probe {kind} ({flags}): a target of {T} tokens in calls of {rows} rows x {width} slots",
                     UsageError, width=width)


def where_options(args) -> dict:
    """The options of --circumstance's plan (where_plan.Circumstance.options) that flags set:
    --batch-sizes, --pad, --repeats, --processes, --mesh."""
    options = circumstance(args.circumstance).options
    given = {"batch_sizes": tuple(b for b in args.batch_sizes if b > 1)[:3] or (2,), "pad": args.pad,
             "repeats": args.repeats, "processes": args.processes}
    if args.mesh and "meshes" in options:
        given["meshes"] = _meshes(args)
    if "device" in options:
        given["device"] = _other_device(args)
    return {k: v for k, v in given.items() if k in options}


def _other_device(args) -> str | None:
    """--other-device and --device-cap as probe_where's device= ("gpu", a cap's name, or None: the
    default, resolved per implementation by compare.probes.where.resolve_device)."""
    if args.other_device == GPU:
        if args.device_cap:
            raise UsageError(f"--device-cap {args.device_cap} caps a second process on this CPU; --other-device gpu "
                             "compares with the GPU: give one")
        return GPU
    if args.other_device == "cap" or args.device_cap:
        return args.device_cap or caps.DEFAULT
    return None


def _meshes(args) -> list[dict]:
    """--mesh, each parsed (jaxmodel.sharding.parse_mesh: known axes, each once, sizes bounded);
    the same mesh twice is refused (it would run twice under one name)."""
    # jax: heavy to import; only the sharding circumstance parses meshes
    from jaxmodel.sharding import parse_mesh
    meshes = []
    for text in args.mesh or ():
        mesh = parse_mesh(text)
        if any(m == mesh for m in meshes):
            raise UsageError(f"--mesh {text}: the same mesh is given twice; give each once")
        meshes.append(mesh)
    return meshes


def _where_one(impl, folder, policy, mode, target, args, say, device=None):
    kw = dict(circumstance=args.circumstance, ids=target, seed=args.seed, progress=say, **where_options(args))
    if device is not None:
        kw["device"] = device
    if mode == "invariant":
        return probe_where(load_model(impl, folder, policy, batch_invariant=True), **kw)
    return probe_where(impl, checkpoint=folder, policy=policy, stream=False if args.no_stream else None,
                       attn_implementation=args.attn, hf_positions=args.hf_positions, **kw)


def _sharding_devices(args, impls, folder) -> None:
    """probe where --circumstance sharding: jaxmodel only; each --mesh checked against the
    checkpoint's config; on a CPU, as many host devices as the largest mesh needs (8 by
    default), asked for before JAX starts."""
    # jax: heavy to import; only the sharding circumstance needs it
    from jaxmodel.sharding import check_mesh, host_devices
    if impls != ["jaxmodel"]:
        raise UsageError("probe where --circumstance sharding compares jaxmodel on meshes with one device: "
                         "--impl jaxmodel")
    meshes = _meshes(args)
    cfg = LlamaConfig.from_file(Path(folder) / "config.json")
    for mesh in meshes:
        check_mesh(mesh, cfg)
    host_devices(max([8] + [math.prod(m.values()) for m in meshes]))


def _where_budget(args, folder, T) -> None:
    """The largest forward call of the circumstance's plan (compare.probes.where_plan.check_budget)
    within the budget of --random-tokens, before any model loads."""
    cfg = LlamaConfig.from_file(Path(folder) / "config.json")
    for flag in ("repeats", "processes"):
        check_count(getattr(args, flag), MAX_RUNS, f"--{flag}", UsageError, "each is a model run")
    options = {k: v for k, v in where_options(args).items() if k != "meshes"}
    sized = [flag for k, flag in SIZE_FLAGS.items() if k in circumstance(args.circumstance).options]
    flags = f" ({', '.join(sized)})" if sized else ""
    check_budget(args.circumstance, T, cfg.max_position_embeddings, cfg.vocab_size, error=UsageError,
                 what=f"probe where --circumstance {args.circumstance}{flags}", **options)


def cmd_where(args) -> int:
    """`probe where`: per implementation x policy x mode, the table; --json all, --html one."""
    say = _log(time.perf_counter())
    sharded = circumstance(args.circumstance).sharded
    impls = _list(args.impl, "jaxmodel" if sharded else "torchref", IMPLS, "implementation")
    if args.mesh and not sharded:
        raise UsageError(f"--mesh {args.mesh[0]}: only --circumstance sharding uses a mesh (this is "
                         f"--circumstance {args.circumstance})")
    other_device = circumstance(args.circumstance).other_device
    if (args.other_device or args.device_cap) and not other_device:
        raise UsageError(f"--{'other-device' if args.other_device else 'device-cap'}: only --circumstance device "
                         f"compares devices (this is --circumstance {args.circumstance})")
    policies = [Policy.get(p).name for p in _list(args.policy, "fp32")]
    modes = _list(args.mode, "invariant" if args.batch_invariant else "default", ("default", "invariant"), "mode")
    if args.html and len(impls) * len(policies) * len(modes) > 1:
        raise UsageError("probe where --html draws one result: give one --impl, --policy and --mode (--json "
                         "takes several)")
    json_path = output_file(args.json, "--json", args.force, say) if args.json else None
    html_path = output_file(args.html, "--html", args.force, say) if args.html else None
    folder = checkpoint_folder(resolve_checkpoint(args.checkpoint or args.checkpoint_pos, say))
    if sharded:
        _sharding_devices(args, impls, folder)
    target, how = target_tokens(folder, args.prompt, args.length, args.seed)
    _where_budget(args, folder, target.size)
    # the other device per implementation, checked before any model loads (a GPU this machine
    # lacks, a cap this CPU cannot honour: exit 2, naming what the framework or the CPU says)
    devices = {impl: resolve_device(impl, _other_device(args)) for impl in impls} if other_device else {}
    results, skipped = [], []
    for impl in impls:
        for policy in policies:
            for mode in modes:
                say(f"probe where: {impl} at {policy} ({mode} mode), {args.circumstance}; target: {how}")
                try:
                    results.append(_where_one(impl, folder, policy, mode, target, args, say, devices.get(impl)))
                except NotImplementedError as e:
                    skipped.append(f"{impl} {policy} {mode}: {e}")
                    print(f"skipped {skipped[-1]}")
                    continue
                print(where_report.format_table(results[-1], colour=sys.stdout.isatty() and not args.no_colour))
    # this process's record, with the plan each result's model computed by (probe_where loads the
    # models and records their plans in the result): "<model> plan ..." per result
    env = environment(policies[0], sides={})
    for r in results:
        env.update({f"{r.model} plan {k}": v for k, v in r.details.get("plan", {}).items()})
    meta = {"checkpoint": folder, "target": how, "circumstance": args.circumstance, "argv": sys.argv[1:],
            "skipped": skipped, "environment": env}
    if json_path:
        doc = {"meta": meta, "results": [r.to_dict() for r in results]}
        print(f"JSON: {atomic_write(json_path, json_text(doc, indent=1, default=str), 'probe where JSON')}")
    if html_path and results:
        print(f"HTML: {where_report.write_html(results[0], html_path, meta)}")
    if not results:
        return 2
    return 1 if any(r.verdict == "semantic" for r in results) else 0
