"""Prefill and decode speed of torchref, jaxmodel and transformers (sdpa and eager), side by
side in one run, each as a ratio to transformers sdpa.

    .venv/bin/python -m bench.bench_models [--checkpoint DIR] [--policy fp32 bf16]
        [--prefill 128 512 2048] [--decode-batch 1 8] [--decode-steps 32] [--repeats 5]
        [--impl torchref jaxmodel sdpa eager] [--out FILE]

Every model is loaded once, then each case (prefill of T tokens at batch 1: the last
position's logits and a filled KV cache; decode at batch B: ms per greedy step after a
128-token prefill) runs once per policy and implementation in turn, `repeats` rounds, so that
a slow phase of the machine hits every implementation and policy alike (interleaved), each
round starting one model later (no model keeps the first place); the table shows the median.
Each case's first call is timed apart ("first s": JAX's compile, or its load from the
persistent compilation cache, plus the first run; torch's allocator warm-up) and left out of
the median. x sdpa = transformers sdpa's median at the same policy /
this one's (above 1: faster); / fp32 = this one's median / the same implementation's fp32
median (on a CPU without bf16 instructions bf16 should stay within 1.2x of fp32).

Under an instruction-set cap (the libraries' own switches, as `make test-cap-avx2` sets
them): `make bench-cap-avx2`. The CPU and the caps in force are printed with the table and
saved in the JSON (bench/results/models-<time>.json unless --out).

--first-forward: also measures what a second process pays before its first jaxmodel
forward and prefill (the compilation cache): one process runs them, a second one runs them
again, and a third prefills another prompt length of the same shape bucket.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from compare.environment import environment
from llamaspec.files import atomic_write

IMPLS = ("torchref", "jaxmodel", "sdpa", "eager")
DECODE_PROMPT = 128      # the prompt a decode case starts from


class Ours:
    """A loaded torchref / jaxmodel model: prefill(ids, mask, total) and decode(cache, ids), as
    generate uses them."""

    def __init__(self, model):
        self.m = model

    def prefill(self, ids, total: int):
        logits, cache = self.m.prefill(ids, np.ones_like(ids), total)
        return np.asarray(logits), cache

    def step(self, cache, nxt):
        logits, cache = self.m.decode(cache, nxt)
        return np.asarray(logits), cache


class Transformers:
    """LlamaForCausalLM at the policy's param dtype with one attention implementation."""

    def __init__(self, folder, policy: str, attn: str):
        import torch
        from transformers import LlamaForCausalLM

        from llamaspec import Policy
        from torchref.dtypes import dt
        self.torch = torch
        # transformers follows torch's global fp32 matmul mode; pinned as our policies pin it
        torch.backends.cuda.matmul.fp32_precision = "tf32" if policy == "tf32" else "ieee"
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.hf = LlamaForCausalLM.from_pretrained(folder, dtype=dt(Policy.get(policy).param_dtype),
                                                   attn_implementation=attn).eval().to(self.device)
        # transformers 5 names the KV cache argument `cache` (past_key_values before)
        self.cache_arg = ("cache" if "cache" in inspect.signature(self.hf.model.forward).parameters
                          else "past_key_values")

    def _sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def prefill(self, ids, total: int):
        from transformers import DynamicCache
        with self.torch.inference_mode():
            kv = DynamicCache(config=self.hf.config)    # filled in place, then decoded on
            out = self.hf(self.torch.from_numpy(ids).to(self.device), use_cache=True, logits_to_keep=1,
                          **{self.cache_arg: kv})
            self._sync()
            return out.logits[:, -1].float().cpu().numpy(), kv

    def step(self, kv, nxt):
        with self.torch.inference_mode():
            x = self.torch.from_numpy(np.asarray(nxt).reshape(-1, 1)).to(self.device)
            out = self.hf(x, use_cache=True, **{self.cache_arg: kv})
            self._sync()
            return out.logits[:, -1].float().cpu().numpy(), kv


def load(impl: str, folder, policy: str):
    if impl in ("torchref", "jaxmodel"):
        import importlib
        return Ours(importlib.import_module(impl).from_pretrained(folder, policy=policy))
    return Transformers(folder, policy, impl)


def prefill_case(model, ids) -> float:
    t0 = time.perf_counter()
    model.prefill(ids, ids.shape[1] + 1)
    return time.perf_counter() - t0


def decode_case(model, ids, steps: int) -> float:
    """Seconds per greedy step after an (untimed) prefill of ids."""
    logits, cache = model.prefill(ids, ids.shape[1] + steps)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, cache = model.step(cache, logits.argmax(-1))
    return (time.perf_counter() - t0) / steps


def decode_seconds_per_token(m, ids, n_decode) -> float:
    """decode_case for a loaded torchref / jaxmodel LlamaModel (bench_invariant uses it)."""
    return decode_case(Ours(m), np.asarray(ids), n_decode)


def run_policies(folder, policies, impls, cases, repeats, say) -> list[dict]:
    """Every case for every implementation at every policy: each model loaded once, its first
    call apart, then `repeats` rounds in which each case runs every (policy, implementation) in
    turn, so that a slow phase of the machine hits them all alike, the policies too (a bf16 time
    and the fp32 one it is compared with come from the same rounds); round r starts with the r-th
    model, so that each takes every place in the round in turn. Returns one row per
    (policy, case, impl): x_sdpa (transformers sdpa's median at the same policy over this one's)
    and, for a policy other than fp32 when fp32 runs too, x_fp32 (this one's median over the same
    implementation's fp32 median: above 1 is slower than fp32)."""
    keys = [(policy, impl) for policy in policies for impl in impls]
    models = {}
    for policy, impl in keys:
        t0 = time.perf_counter()
        models[(policy, impl)] = load(impl, folder, policy)
        say(f"  {policy} {impl}: loaded in {time.perf_counter() - t0:.1f} s")
    first = {(c["name"], *key): c["run"](models[key]) for c in cases for key in keys}
    times = {key: [] for key in first}
    faults = {key: [] for key in first}
    for r in range(repeats):
        for c in cases:
            # each round starts with the next model: a place in the round has its own cost (SmolLM2's
            # capped bf16 decode, the same torchref loaded twice: 0.8 ms a step slower in first place
            # than in second, bench/results/2026-12-05-torchref-prefill-page-faults.json), so no model keeps one place
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                before = _minor_faults()
                times[(c["name"], *key)].append(c["run"](models[key]))
                faults[(c["name"], *key)].append(_minor_faults() - before)
            # each round's times as they come, so that a run stopped early still says something
            say(f"  round {r + 1}/{repeats} {c['name']}: " + ", ".join(
                f"{policy} {impl} {times[(c['name'], policy, impl)][-1] * 1e3:.1f} ms" for policy, impl in keys))
    del models
    med = {key: statistics.median(t) for key, t in times.items()}
    rows = []
    for policy in policies:
        for c in cases:
            base = med.get((c["name"], policy, "sdpa"))
            for impl in impls:
                m = med[(c["name"], policy, impl)]
                fp32 = med.get((c["name"], "fp32", impl)) if policy != "fp32" else None
                rows.append({"policy": policy, "case": c["name"], "unit": c["unit"], "impl": impl,
                             "median_s": m, "first_s": first[(c["name"], policy, impl)],
                             "all_s": times[(c["name"], policy, impl)],
                             "minor_faults": faults[(c["name"], policy, impl)],
                             "x_sdpa": None if base is None else base / m,
                             "x_fp32": None if fp32 is None else m / fp32})
    return rows


def _minor_faults() -> int:
    """The process's minor page faults so far (0 where the OS does not count them). A run's
    count says how much memory it touched fresh from the system: pages the allocator had
    returned and took back (glibc's heap top, torchref.ops.times tells the story)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_policy(folder, policy, impls, cases, repeats, say) -> list[dict]:
    """run_policies at one policy."""
    return run_policies(folder, [policy], impls, cases, repeats, say)


FIRST_FORWARD = r"""
import json, sys, time
import numpy as np
t0 = time.perf_counter()
import jaxmodel
folder, T, policy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
m = jaxmodel.from_pretrained(folder, policy=policy)
ids = (np.arange(T)[None] % 1000 + 3).astype(np.int64)
out = {"import_and_load_s": time.perf_counter() - t0}
for what, fn in (("forward", lambda: np.asarray(m(ids))),
                 ("prefill", lambda: m.prefill(ids, np.ones_like(ids), T + 32)[0])):
    t = time.perf_counter(); fn(); first = time.perf_counter() - t
    t = time.perf_counter(); fn(); again = time.perf_counter() - t
    out[what] = {"first_s": first, "again_s": again, "overhead_s": first - again}
print(json.dumps(out))
"""


def first_forward(folder, policy: str, say) -> dict:
    """What a fresh process pays before its first jaxmodel forward / prefill: process 1 (T=100)
    fills the compilation cache, process 2 (T=100 again) and process 3 (T=110: another length in
    the same prefill bucket; a forward of a new length compiles anew) are measured."""
    out = {}
    for label, T in (("process 1, T=100", 100), ("process 2, T=100", 100), ("process 3, T=110", 110)):
        p = subprocess.run([sys.executable, "-c", FIRST_FORWARD, str(folder), str(T), policy],
                           capture_output=True, text=True, check=True)
        out[label] = json.loads(p.stdout.strip().splitlines()[-1])
        r = out[label]
        say(f"  {policy} {label}: forward first call {r['forward']['first_s']:.2f} s (again "
            f"{r['forward']['again_s']:.2f}), prefill first call {r['prefill']['first_s']:.2f} s (again "
            f"{r['prefill']['again_s']:.2f})")
    return out


def table(rows, env) -> str:
    lines = [f"CPU: {env.get('cpu')} ({env.get('cpu isa')}; caps: {env.get('isa caps')}); "
             f"GPU: {env.get('gpu', 'none')}",
             f"{'policy':<7}{'case':<18}{'impl':<10}{'median':>10}{'first s':>9}{'x sdpa':>8}{'/ fp32':>8}"
             f"{'faults':>9}"]
    for r in rows:
        unit = r["unit"]
        med = f"{r['median_s'] * 1e3:.1f} ms" if unit == "s" else f"{r['median_s'] * 1e3:.1f} ms/t"
        ratio = "" if r["x_sdpa"] is None else f"{r['x_sdpa']:.2f}"
        fp32 = "" if r.get("x_fp32") is None else f"{r['x_fp32']:.2f}"
        faults = "" if not r.get("minor_faults") else f"{statistics.median(r['minor_faults']) / 1e3:.1f}k"
        lines.append(f"{r['policy']:<7}{r['case']:<18}{r['impl']:<10}{med:>10}{r['first_s']:>9.2f}{ratio:>8}"
                     f"{fp32:>8}{faults:>9}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--policy", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--prefill", nargs="+", type=int, default=[128, 512, 2048])
    ap.add_argument("--decode-batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--first-forward", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/models-<time>.json)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    from llama_parity.fetch import resolve_checkpoint
    folder = resolve_checkpoint(args.checkpoint)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    cases = []
    for T in args.prefill:
        ids = rng.integers(3, vocab, (1, T))
        cases.append({"name": f"prefill {T}", "unit": "s", "run": lambda m, ids=ids: prefill_case(m, ids)})
    for B in args.decode_batch:
        ids = rng.integers(3, vocab, (B, DECODE_PROMPT))
        cases.append({"name": f"decode batch {B}", "unit": "s/token",
                      "run": lambda m, ids=ids: decode_case(m, ids, args.decode_steps)})

    say = lambda msg: print(msg, flush=True)  # noqa: E731
    env = environment(args.policy[0], True)
    rows = run_policies(folder, args.policy, args.impl, cases, args.repeats, say)
    extra = {p: first_forward(folder, p, say) for p in args.policy} if args.first_forward else {}
    print(f"\nprefill: batch 1, last position's logits and the KV cache; decode: ms per greedy step "
          f"after a {DECODE_PROMPT}-token prefill, {args.decode_steps} steps; median of {args.repeats} "
          "interleaved rounds (every policy and implementation in turn, each round starting one later); "
          "first s: the first call (compile or cache load + first run), apart; / fp32: this time over the "
          "same implementation's fp32 time; faults: the runs' median count of minor page faults (memory "
          "taken fresh from the system)")
    print(table(rows, env))
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / \
        f"models-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps({"checkpoint": str(folder), "repeats": args.repeats,
                                  "decode_steps": args.decode_steps, "decode_prompt": DECODE_PROMPT,
                                  "environment": env, "results": rows, "first_forward": extra}, indent=1),
                 "benchmark results")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
