"""Where jaxmodel's prefill spends its time, op by op, named by jaxmodel's own source.

    .venv/bin/python -m bench.profile_ops [--checkpoint DIR] [--policy fp32] [--tokens 2048]
        [--batch 1] [--top 20] [--out FILE]

A prefill of `tokens` random tokens is compiled, timed three times, then run once more under
jax.profiler. Every XLA:CPU op in the trace (a thunk: a fusion, a library product, a copy) is
looked up in the compiled program's HLO, whose metadata carries the Python call stack that
built it; the op's time is charged to

  part: the first jaxmodel frame under Block.__call__ (RMSNorm.__call__, Attention.__call__,
        MLP.__call__ ...), else under Llama.__call__ (embedding, final norm, lm_head), else
        the innermost jaxmodel function (the cache's set-up, the mask);
  site: the innermost jaxmodel frame, function:line (ops.attention:142, ops._matmul:272 ...).

A fusion runs the ops of several lines in one pass: it is charged to the line its metadata
names (its last op's, usually), and the table lists the other lines fused into it ("fused
with"): a product's rounding to bf16 runs together with the residual add or SiLU that reads it.

Two times per row. wall: each moment of the traced call split among the ops running then
(XLA:CPU runs independent ops on two threads at once), so the rows add up to the time some op
ran and an op that runs beside another is not charged as if alone; thread: the ops' summed
durations (more than the wall time when ops overlap). Tracing costs a few µs per op run, so
sites of many short runs (a loop's steps) read high; the header compares the traced run with
the untraced ones. jax.profiler
keeps at most a million events: when the trace lacks ops the program ran, the table says so.
An op whose metadata has no call stack takes the one of the instruction that calls it or of
its inputs (instructions() says how); one with none at all is counted as "(no call stack)".
The CPU is named with the table; the JSON goes to bench/results/profile-<time>.json unless
--out.

CPU only: the attribution reads XLA:CPU's thunk names; on another backend it stops with an
error rather than print an empty table. It reads the HLO text's StackFrames tables (jaxlib
0.10); if a jaxlib prints none, it says so.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import importlib.util
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from compare.environment import environment
from llamaspec.files import atomic_write

# jaxmodel's folder, wherever it is imported from (found without importing it)
PACKAGE_DIR = Path(importlib.util.find_spec("jaxmodel").origin).resolve().parent
NO_STACK = "(no call stack)"
# Ops whose trace event spans other ops' (a loop's body runs as ops of its own, traced apart):
# left out of the sums, which would count their bodies twice.
CONTAINERS = ("while", "conditional", "call")
# Instructions that are no op of their own at run time (no thunk, no trace event).
NOT_RUN = ("parameter", "constant", "get-tuple-element", "bitcast", "tuple")


# ----- the compiled program's call stacks --------------------------------------------------

def _table(text: str, name: str) -> dict[int, str]:
    """One of the HLO text's index tables ("FileNames", "StackFrames" ...): {id: rest of line}."""
    m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
    if m is None:
        return {}
    rows = (line.split(" ", 1) for line in m.group(1).splitlines() if line.strip())
    return {int(k): v for k, v in rows}


def _fields(row: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", row)}


def call_stacks(hlo_text: str) -> dict[int, list[tuple[str, str, int]]]:
    """{stack_frame_id: [(file, function, line), ...] innermost first} from the HLO text's
    FileNames / FunctionNames / FileLocations / StackFrames tables. A frame's parent_frame_id
    is one more than the parent's id (0: none), as XLA prints it."""
    files = {k: v.strip().strip('"') for k, v in _table(hlo_text, "FileNames").items()}
    funcs = {k: v.strip().strip('"') for k, v in _table(hlo_text, "FunctionNames").items()}
    locs = {k: _fields(v) for k, v in _table(hlo_text, "FileLocations").items()}
    frames = {k: _fields(v) for k, v in _table(hlo_text, "StackFrames").items()}
    if not frames:
        raise ValueError("the compiled program's HLO text has no StackFrames table (this jaxlib prints "
                         "none): ops cannot be traced back to jaxmodel's source")
    stacks = {}
    for fid in frames:
        chain, seen, cur = [], set(), fid
        while cur in frames and cur not in seen:
            seen.add(cur)
            loc = locs[frames[cur]["file_location_id"]]
            chain.append((files[loc["file_name_id"]], funcs[loc["function_name_id"]], loc["line"]))
            cur = frames[cur]["parent_frame_id"] - 1
        stacks[fid] = chain
    return stacks


def instructions(hlo_text: str) -> dict[str, dict]:
    """{instruction name: {"kind" (fusion kind or opcode), "op_name" (the jax primitive),
    "frame" (its stack_frame_id), "opcode", "calls", "operands", "entry" (in the entry
    computation)}} for every instruction of the program.

    XLA leaves the call stack off some instructions: a library fusion takes the stack of the
    first instruction inside it that has one (a dot's first); an instruction of a loop's body
    or any other called computation without one takes its caller's (a scatter that XLA:CPU
    runs as a loop: every step's ops are the scatter's); what is still without one takes its
    first operand's that has one (XLA drops the metadata of some dots it rewrites: attention's
    products then count where their queries and keys were made)."""
    out, comp_of, inside, caller, current, in_entry = {}, {}, collections.defaultdict(list), {}, None, False
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            current, in_entry = head.group(2), bool(head.group(1))
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (?:\(.*?\)|\S+) ([\w\-]+)\(", line)   # shape: one, or a tuple
        if not m:
            continue
        name, opcode = m.groups()
        kind = re.search(r'"kind":"(\w+)"', line) or re.search(r"kind=(k\w+)", line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        out[name] = {"kind": kind.group(1).strip("_") if kind else opcode,
                     "op_name": op_name.group(1).rsplit("/", 1)[-1] if op_name else "",
                     "frame": int(frame.group(1)) if frame else None,
                     "calls": calls.group(1) if calls else None, "opcode": opcode, "entry": in_entry,
                     "operands": re.findall(r"%([\w.\-]+)", line[m.end():].split(")", 1)[0])}
        comp_of[name] = current
        for called in re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", line):
            caller.setdefault(called, name)
        if frame:
            inside[current].append((opcode != "dot", int(frame.group(1)), out[name]["op_name"]))
    for op in out.values():
        op["fused_frames"] = sorted({f for _, f, _ in inside.get(op["calls"], ())})
        if op["frame"] is None and inside.get(op["calls"]):
            _, op["frame"], inner = min(inside[op["calls"]], key=lambda x: x[0])
            op["op_name"] = op["op_name"] or inner
    for name, op in out.items():
        seen, comp = set(), comp_of[name]
        while op["frame"] is None and comp in caller and comp not in seen:
            seen.add(comp)
            up = out[caller[comp]]
            op["frame"], op["op_name"] = up["frame"], op["op_name"] or up["op_name"]
            comp = comp_of[caller[comp]]
    for _ in range(4):          # still none: its first operand's that has one (a rewritten dot's inputs)
        for op in out.values():
            if op["frame"] is None:
                op["frame"] = next((out[a]["frame"] for a in op["operands"] if a in out and out[a]["frame"]), None)
    return out


def _ours(chain):
    """The frames of a call stack that lie in a jaxmodel/ folder (this checkout's or, for a program
    from the compilation cache, the one that compiled it: compiled_from), innermost first."""
    return [(Path(f).stem, fn, line) for f, fn, line in chain if Path(f).parent.name == PACKAGE_DIR.name]


def attribute(chain) -> tuple[str, str]:
    """(part, site) for one op's call stack (module docstring)."""
    ours = _ours(chain)
    if not ours:
        return "(outside jaxmodel)", "(outside jaxmodel)"
    outer_first = ours[::-1]
    names = [fn for _, fn, _ in outer_first]
    part = None
    for anchor in ("Block.__call__", "Llama.__call__"):
        if anchor in names:
            i = len(names) - 1 - names[::-1].index(anchor)
            part = names[i + 1] if i + 1 < len(names) else anchor
            break
    module, fn, line = ours[0]
    return part or fn, f"{module}.{fn}:{line}"


# ----- the trace -------------------------------------------------------------------------

def trace_events(trace_dir: Path) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of every complete event in the perfetto trace."""
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"{trace_dir}: jax.profiler wrote no perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(files[-1].read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [(float(e.get("ts", 0.0)), float(e.get("dur", 0.0)), e.get("name", "")) for e in events
            if e.get("ph") == "X"]


def wall_shares(events) -> collections.Counter:
    """{name: µs} splitting each moment of the traced span among the events running then
    (two ops at once: half each), so that the sum is the time some op ran, and an op that runs
    beside another, on the second thread, is not charged as if it ran alone."""
    edges = sorted([(ts, 1, i) for i, (ts, _, _) in enumerate(events)]
                   + [(ts + d, -1, i) for i, (ts, d, _) in enumerate(events)])
    share, active, last = collections.Counter(), set(), None
    for t, step, i in edges:
        if active and last is not None and t > last:
            part = (t - last) / len(active)
            for j in active:
                share[events[j][2]] += part
        (active.add if step > 0 else active.discard)(i)
        last = t
    return share


def breakdown(events, ops: dict[str, dict], stacks) -> dict:
    """Per part and per (part, site), in ms: thread time (the ops' summed durations) and wall
    time (wall_shares: each moment split among the ops running then), from the trace's events
    of the program's instructions (the runtime's and Python's events are left out)."""
    mine = [e for e in events if e[2] in ops and ops[e[2]]["opcode"] not in CONTAINERS]
    if not mine:
        raise ValueError(f"the trace's {len(events)} events name none of the program's {len(ops)} "
                         "instructions (does this jaxlib trace XLA:CPU's ops under other names?)")
    wall = wall_shares(mine)
    keys, unknown = {}, collections.Counter()
    thread, walls, counts, runs = (collections.Counter() for _ in range(4))
    kinds, fused_with = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    others = {}      # op name -> the other sites fused into it (once per op, not per run)
    for _, us, name in mine:
        op = ops[name]
        if name not in keys:
            keys[name] = attribute(stacks.get(op["frame"], [])) if op["frame"] else (NO_STACK, NO_STACK)
            others[name] = {attribute(stacks.get(f, []))[1] for f in op["fused_frames"]} - {keys[name][1]}
            counts[keys[name]] += 1
        key, ms = keys[name], us / 1e3
        thread[key] += ms
        runs[key] += 1
        kinds[key][op["kind"] + (f" {op['op_name']}" if op["op_name"] else "")] += ms
        for other in others[name]:
            fused_with[key][other] += ms
        if op["frame"] is None:
            unknown[name] += ms
    for name, key in keys.items():
        walls[key] += wall[name] / 1e3
    total_thread, total_wall = sum(thread.values()), sum(walls.values())

    def row(ms_thread, ms_wall):
        return {"thread_ms": ms_thread, "thread_share": ms_thread / total_thread,
                "wall_ms": ms_wall, "wall_share": ms_wall / total_wall}
    parts = collections.defaultdict(lambda: [0.0, 0.0])
    for (p, site), ms in thread.items():
        parts[p][0] += ms
        parts[p][1] += walls[p, site]
    ran = {name for _, _, name in mine}
    expected = [n for n, op in ops.items() if op["entry"] and op["opcode"] not in NOT_RUN + CONTAINERS]
    return {"thread_ms": total_thread, "busy_wall_ms": total_wall, "events": len(mine),
            "entry_ops": len(expected), "entry_ops_traced": sum(n in ran for n in expected),
            "parts": sorted(({"part": p, **row(*v)} for p, v in parts.items()), key=lambda r: -r["wall_ms"]),
            "sites": sorted(({"site": s, "part": p, **row(ms, walls[p, s]), "ops": counts[p, s],
                              "runs": runs[p, s],
                              "kinds": [k for k, _ in kinds[p, s].most_common(3)],
                              "fused_with": [k for k, _ in fused_with[p, s].most_common(4)]}
                             for (p, s), ms in thread.items()), key=lambda r: -r["wall_ms"]),
            "no_call_stack": [{"op": n, "thread_ms": ms} for n, ms in unknown.most_common(20)]}


# ----- one prefill, traced ----------------------------------------------------------------

def profile_prefill(folder, policy: str, tokens: int, batch: int = 1, seed: int = 0) -> dict:
    """Traces one jaxmodel prefill and returns breakdown() plus the wall time of the traced call
    and the median of three untraced ones before it (after a first that compiles)."""
    import jax

    import jaxmodel
    if jax.default_backend() != "cpu":
        raise RuntimeError(f"bench.profile_ops reads XLA:CPU's op names; JAX's backend is {jax.default_backend()}")
    model = jaxmodel.from_pretrained(folder, policy=policy)
    vocab = model.cfg.vocab_size
    ids = np.random.default_rng(seed).integers(min(3, vocab - 1), vocab, (batch, tokens))
    mask = np.ones_like(ids)
    times = []
    for _ in range(4):          # the first compiles (or loads the program)
        t0 = time.perf_counter()
        model.prefill(ids, mask, tokens + 1)
        times.append(time.perf_counter() - t0)
    untraced = float(np.median(times[1:]))
    with tempfile.TemporaryDirectory(prefix="llama-parity-profile-") as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t0 = time.perf_counter()
            model.prefill(ids, mask, tokens + 1)
            traced = time.perf_counter() - t0
        events = trace_events(Path(d))
    hlo = model.prefill_program_text(ids, mask, tokens + 1)
    result = breakdown(events, instructions(hlo), call_stacks(hlo))
    return {"policy": policy, "tokens": tokens, "batch": batch, "wall_ms": untraced * 1e3,
            "traced_wall_ms": traced * 1e3, "compiled_from": compiled_from(hlo), **result}


def compiled_from(hlo_text: str) -> list[str]:
    """The jaxmodel folders the program's call stacks name. A program loaded from the persistent
    compilation cache carries the stacks of the process that compiled it: another checkout's
    folder, and its line numbers (LLAMA_PARITY_JAX_CACHE=0 compiles afresh)."""
    files = (v.strip().strip('"') for v in _table(hlo_text, "FileNames").values())
    return sorted({str(Path(f).parent) for f in files if Path(f).parent.name == PACKAGE_DIR.name})


def lost(r: dict) -> list[str]:
    """A warning line when the trace lacks ops the program ran once each (jax.profiler keeps at
    most a million events; a program of many short loop steps fills them): the shares are then
    of what it holds."""
    missing = r["entry_ops"] - r["entry_ops_traced"]
    if not missing:
        return []
    return [f"WARNING: the trace lacks {missing} of the program's {r['entry_ops']} top-level ops "
            f"({r['events']} op runs traced: the profiler dropped events); the shares are of what it holds"]


def elsewhere(r: dict) -> list[str]:
    """A note when the program's call stacks name another checkout's jaxmodel than this one's."""
    other = [d for d in r["compiled_from"] if Path(d).resolve() != PACKAGE_DIR]
    if not other:
        return []
    return [f"note: the program came from the compilation cache, compiled from {', '.join(other)}: its line "
            f"numbers are that checkout's (LLAMA_PARITY_JAX_CACHE=0 compiles afresh)"]


def tables(r: dict, env: dict, top: int) -> str:
    lines = [f"jaxmodel prefill, {r['policy']}, batch {r['batch']} x {r['tokens']} tokens: "
             f"{r['wall_ms']:.0f} ms wall (median of 3; {r['traced_wall_ms']:.0f} ms traced, ops running "
             f"{r['busy_wall_ms']:.0f} ms of it), {r['thread_ms']:.0f} ms of thread time in ops",
             f"CPU: {env.get('cpu')} ({env.get('cpu isa')}; caps: {env.get('isa caps')})",
             "wall: each moment split among the ops running then; thread: their summed durations; ops: "
             "distinct ops, runs: their executions (a loop's ops run once a step)",
             f"traced run {r['traced_wall_ms'] - r['wall_ms']:+.0f} ms against the untraced median, "
             f"{r['events']} op runs: sites of many short runs read high", *lost(r), *elsewhere(r), "",
             f"{'part':28s} {'wall ms':>8s} {'share':>6s} {'thread ms':>10s} {'share':>6s}"]
    lines += [f"{p['part']:28s} {p['wall_ms']:8.1f} {p['wall_share']:6.1%} {p['thread_ms']:10.1f} "
              f"{p['thread_share']:6.1%}" for p in r["parts"]]
    lines += ["", f"{'site (function:line)':32s} {'part':20s} {'wall ms':>8s} {'share':>6s} {'thread ms':>10s} "
              f"{'ops':>5s} {'runs':>7s}  kinds"]
    for s in r["sites"][:top]:
        lines.append(f"{s['site']:32s} {s['part']:20s} {s['wall_ms']:8.1f} {s['wall_share']:6.1%} "
                     f"{s['thread_ms']:10.1f} {s['ops']:5d} {s['runs']:7d}  " + "; ".join(s["kinds"])
                     + (f" (fused with {', '.join(s['fused_with'])})" if s["fused_with"] else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--policy", default="fp32")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/profile-<time>.json)")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.batch < 1:
        ap.error("--tokens and --batch must be >= 1")
    from llama_parity.fetch import resolve_checkpoint
    folder = resolve_checkpoint(args.checkpoint)
    r = profile_prefill(folder, args.policy, args.tokens, args.batch)
    env = environment(args.policy, True)
    print(tables(r, env, args.top))
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / \
        f"profile-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps({"checkpoint": str(folder), "environment": env, **r}, indent=1), "profile")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
