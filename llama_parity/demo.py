"""`llama-parity demo`: the problem this project exists for, told with this machine's numbers.

Per policy: both models answer the prompts greedily, each prompt alone and all of them in
one left-padded batch (compare.probes.greedy_trace: the tokens and the top two logits at
every step; a run stops once every row has produced EOS). Then every pair of answers that
differ is explained with the tool's own machinery:

    a prompt alone vs in the batch (one model)  -> the step, both tokens, each run's margin,
        the fp64 oracle's choice, and drift vs bug by the invariance probes' rule (a flip is
        rounding when the margin is within 2 x the model's own rounding threshold,
        compare.probes.compare_completion); then the same prompt in the batch-invariant mode,
        alone and batched
    torchref vs jaxmodel, a prompt alone        -> compare.ladder.greedy.run_greedy on the
        answers already generated: the step, both tokens, the margin, the cause (near tie /
        the ladder's finding), plus the oracle
    torchref vs jaxmodel in the batch           -> the two above together

Where nothing differs it says so and shows the nearest tie it found (the smallest top-1 /
top-2 margin of any answer), so the output is true on every CPU. Last, the ladder's verdict
per layer and component (run_ladder on the batch, whole captures: both models are loaded
already), and what each step cost. The float64 models (the oracle, the fp64 rung, and the
probes' twin where the policy rounds no weight) are loaded once for all policies, and their
runs on the same inputs are kept (KeptRuns): the second policy's ladder reads the first's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import numpy as np

IMPLS = ("torchref", "jaxmodel")


@dataclasses.dataclass
class Runs:
    """One model's greedy runs at one policy: the batch, and each prompt alone."""
    impl: str
    batched: object             # compare.probes.Trace [B, N]
    alone: list                 # one Trace [1, N] per prompt
    pm: object                  # the ProbeModel (its fp64 twin judges rounding)


class Clock:
    """Seconds per named step, printed as they finish and summed at the end."""

    def __init__(self, say):
        self.say, self.steps = say, []

    def run(self, label, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        self.steps.append((label, time.perf_counter() - t0))
        self.say(f"  [{self.steps[-1][1]:5.1f} s] {label}")
        return out


def _alone(ids, mask, i):
    real = np.asarray(mask[i], bool)
    return np.asarray(ids[i][real], np.int64)[None], np.ones((1, int(real.sum())), np.int64)


def greedy_runs(pm, ids, mask, new_tokens: int, eos) -> Runs:
    """Each run stops once every row has answered (EOS): no answer reads past its EOS."""
    from compare.probes import greedy_trace
    batched = greedy_trace(pm, ids, mask, new_tokens, eos)
    alone = [greedy_trace(pm, *_alone(ids, mask, i), new_tokens, eos) for i in range(len(ids))]
    return Runs(pm.impl, batched, alone, pm)


def _tokens(trace, row, eos) -> list:
    from llamaspec.generate import until_eos
    return until_eos(trace.tokens[row], eos)


def _first_difference(a: list, b: list):
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), None if len(a) == len(b) else n)


def print_answers(say, tok, prompts, runs: dict, eos) -> None:
    """Per prompt (numbered from 1): the four answers (two models, alone and batched), merged where equal."""
    for i, p in enumerate(prompts):
        say(f"  {i + 1}> {p}")
        answers = {}
        for impl, r in runs.items():
            for where, tr, row in (("alone", r.alone[i], 0), ("in the batch", r.batched, i)):
                answers.setdefault(tuple(_tokens(tr, row, eos)), []).append(f"{impl} {where}")
        for toks, who in answers.items():
            mark = "" if len(answers) == 1 else f"   ({len(toks)} tokens)"
            say(f"    {' = '.join(who) if len(who) < 4 else 'all four'}: {tok.decode(list(toks))!r}{mark}")


def oracle_choice(ref_side, prefix, a: int, b: int) -> dict:
    """The fp64 oracle (the reference computing in float64) on the prefix: its logits for
    tokens a and b at the last position, and its own top token."""
    logits, _ = ref_side.at_fp64.capture(prefix, np.ones_like(prefix), ("logits",))
    x = np.asarray(logits, np.float64)[0, -1]
    return {"a": float(x[a]), "b": float(x[b]), "top": int(x.argmax())}


def _oracle_words(tok, o, a, b, side_a, side_b) -> str:
    pick = a if o["a"] >= o["b"] else b
    agrees = side_a if pick == a else side_b
    return (f"the fp64 oracle has {tok.decode([a])!r} {o['a']:.3f}, {tok.decode([b])!r} {o['b']:.3f}: "
            f"it sides with {agrees}" + ("" if o["top"] in (a, b) else
                                         f" (its own top token is {tok.decode([o['top']])!r})"))


def explain_batching(say, tok, ref_side, r: Runs, i, ids, mask, eos) -> dict | None:
    """Prompt i's answer alone vs in the batch for one model: None when the same tokens."""
    from compare.probes import compare_completion, make_judge
    alone, inb = _tokens(r.alone[i], 0, eos), _tokens(r.batched, i, eos)
    s = _first_difference(alone, inb)
    if s is None:
        return None
    one, _ = _alone(ids, mask, i)
    judge = make_judge(r.pm, one, r.pm.logits(one, np.ones_like(one))[0])
    case = compare_completion(f"prompt {i}", "batching", len(ids), r.batched.row(i), r.alone[i].row(0), eos,
                              judge.threshold, r.batched.dtype)
    if s >= min(len(alone), len(inb)):
        say(f"    {r.impl}: the same tokens alone and in the batch, but one stops at token {s + 1} (EOS)")
        return {"impl": r.impl, "prompt": i, "step": s + 1, "kind": case.kind}
    a, b = alone[s], inb[s]
    m_alone = r.alone[i].top1[0, s] - r.alone[i].top2[0, s]
    m_batch = r.batched.top1[i, s] - r.batched.top2[i, s]
    prefix = np.concatenate([one[0], np.asarray(alone[:s], np.int64)])[None]
    o = oracle_choice(ref_side, prefix, a, b)
    rule = (f"{case.margin:.3f} <= 2 x {judge.threshold:.3f}" if case.kind == "drift" else
            f"{case.margin:.3f} > 2 x {judge.threshold:.3f}")
    say(f"    {r.impl}, prompt {i + 1}: batching changed the answer at token {s + 1}: alone {tok.decode([a])!r} "
        f"(top-1 {r.alone[i].top1[0, s]:.3f}, margin {m_alone:.3f}), in the batch {tok.decode([b])!r} "
        f"(top-1 {r.batched.top1[i, s]:.3f}, margin {m_batch:.3f})")
    say(f"      {_oracle_words(tok, o, a, b, 'the answer alone', 'the batched one')}")
    say(f"      {case.kind}: " + ("a near tie flipped by batch-dependent rounding (a flip is rounding when the "
                                  f"margin is within 2 x {r.impl}'s own rounding threshold: {rule})"
                                  if case.kind == "drift" else
                                  f"the model was sure ({rule}): batching changed the math (mask, positions, cache)"))
    return {"impl": r.impl, "prompt": i, "step": s + 1, "alone_token": a, "batched_token": b, "kind": case.kind,
            "margin_alone": float(m_alone), "margin_batched": float(m_batch), "threshold": judge.threshold,
            "oracle": o}


def invariant_check(say, tok, folder, policy, impl, prompts_i, ids, mask, new_tokens, eos) -> dict:
    """The batch-invariant mode of impl: the flipped prompts' answers alone and in the batch.
    Each prompt alone first: the batch then runs only as many steps as the longest of those
    answers (its EOS included), the steps compared; the other rows' later tokens are not needed."""
    from compare.probes import greedy_trace, load_model
    pm = load_model(impl, folder, policy.name, batch_invariant=True)
    runs = {i: greedy_trace(pm, *_alone(ids, mask, i), new_tokens, eos) for i in prompts_i}
    steps = {i: len(_tokens(trace, 0, eos)) for i, trace in runs.items()}     # the answer's steps, EOS included
    batched = greedy_trace(pm, ids, mask, max(steps.values()), eos)
    out = {}
    for i in prompts_i:
        alone, n = runs[i], steps[i]
        same = all(np.array_equal(x[i, :n], y[0, :n]) for x, y in ((batched.tokens, alone.tokens),
                                                                   (batched.top1, alone.top1),
                                                                   (batched.top2, alone.top2)))
        out[i] = same
        say(f"    {impl} batch_invariant=True, prompt {i + 1}: alone and in the batch "
            f"{'bitwise the same (tokens and top logits)' if same else 'DIFFER'}: "
            f"{tok.decode(_tokens(alone, 0, eos))!r}")
    return out


def explain_models(say, tok, ref, cand, runs: dict, ids, mask, policy, new_tokens, eos) -> list:
    """torchref vs jaxmodel where a prompt's answers alone differ: compare.ladder.greedy's
    run_greedy on that prompt (the step, both tokens, margins, cause), plus the oracle."""
    from compare.ladder.greedy import run_greedy
    found = []
    for i in range(len(ids)):
        a, b = (_tokens(runs[impl].alone[i], 0, eos) for impl in IMPLS)
        if _first_difference(a, b) is None:
            continue
        one, ones = _alone(ids, mask, i)
        row = run_greedy(ref, cand, one, ones, policy, new_tokens,
                         generations=[runs[impl].alone[i].tokens for impl in IMPLS], stream=False).rows[0]
        if row.step is None:
            say(f"    prompt {i + 1} alone: torchref and jaxmodel part only at EOS")
            continue
        ta, tc = row.reference_token, row.candidate_token
        prefix = np.concatenate([one[0], np.asarray(row.reference_tokens[:row.step - 1], np.int64)])[None]
        o = oracle_choice(ref, prefix, ta, tc)
        say(f"    prompt {i + 1} alone: torchref and jaxmodel part at token {row.step}: torchref "
            f"{tok.decode([ta])!r}, jaxmodel {tok.decode([tc])!r}; torchref's margin {row.reference_margin:.3f}, "
            f"jaxmodel's {row.candidate_margin:.3f}, their logits differ by {row.logit_difference:.3f} there")
        say(f"      {_oracle_words(tok, o, ta, tc, 'torchref', 'jaxmodel')}")
        say(f"      {row.kind} ({row.cause}): {row.explanation}")
        found.append({"prompt": i, "step": row.step, "torchref_token": ta, "jaxmodel_token": tc,
                      "kind": row.kind, "cause": row.cause, "margin": row.reference_margin,
                      "logit_difference": row.logit_difference, "oracle": o})
    return found


def nearest_tie(say, tok, runs: dict, ids, mask, eos) -> dict:
    """No answer differs: the smallest top-1 / top-2 margin of any answer alone, what batching
    moved that top logit by, and how far it is from a flip by the probes' rule."""
    from compare.probes import make_judge
    best = None
    for impl, r in runs.items():
        for i, tr in enumerate(r.alone):
            n = len(_tokens(tr, 0, eos))
            m = tr.top1[0, :n] - tr.top2[0, :n]
            s = int(m.argmin())
            if best is None or m[s] < best[0]:
                best = (float(m[s]), impl, i, s)
    margin, impl, i, s = best
    r = runs[impl]
    moved = abs(float(r.batched.top1[i, s] - r.alone[i].top1[0, s]))
    one, _ = _alone(ids, mask, i)
    judge = make_judge(r.pm, one, r.pm.logits(one, np.ones_like(one))[0])
    token = int(r.alone[i].tokens[0, s])
    say(f"    no answer differs: batching changed no token here. The nearest tie: {impl}, prompt {i + 1}, "
        f"token {s + 1}, {tok.decode([token])!r} leads by {margin:.4f}; batching moved that logit by {moved:.2e}; "
        f"a flip needs a margin within 2 x {impl}'s rounding threshold ({2 * judge.threshold:.4f}), "
        f"{margin / (2 * judge.threshold):.1f}x away")
    return {"impl": impl, "prompt": i, "step": s + 1, "token": token, "margin": margin, "batching_moved": moved,
            "threshold": judge.threshold}


class KeptRuns:
    """An implementation whose captures are kept by their inputs, tap names and injected states,
    so a second identical call reads the first one's arrays (made read-only, so that no reader can
    change what the next one gets); everything else (the plain forward, attributes) goes to the
    implementation. For float64 runs, which repeat bitwise on the same inputs in one process: the
    demo's second policy asks the ladder's oracle, fp64 rung and the fp64 rung's teacher-forced
    run (fed the oracle's layer inputs) for exactly the first one's runs."""

    def __init__(self, impl):
        self.impl, self._kept = impl, {}

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        ids = np.asarray(tokens)
        mask = None if attention_mask is None else np.asarray(attention_mask).tobytes()
        fed = hashlib.sha256()
        for layer, h in sorted((inject or {}).items()):
            h = np.ascontiguousarray(h)
            fed.update(f"{layer} {h.dtype} {h.shape}".encode())
            fed.update(h.data)
        key = (ids.shape, ids.tobytes(), mask, tuple(taps), fed.hexdigest())
        if key not in self._kept:
            logits, acts = self.impl.capture(tokens, attention_mask, taps, inject=inject)
            for a in (logits, *acts.values()):
                if isinstance(a, np.ndarray):
                    a.setflags(write=False)
            self._kept[key] = (logits, acts)
        logits, acts = self._kept[key]
        return logits, dict(acts)

    def __call__(self, tokens, attention_mask=None):
        return self.impl(tokens, attention_mask=attention_mask)

    def __getattr__(self, name):
        return getattr(self.impl, name)


def write_json(path: Path, data: dict) -> Path:
    """Strict JSON (llamaspec.files.json_text: a NaN margin or error as the string "nan"), through
    the atomic writer (a temp file in the same folder, renamed)."""
    from llamaspec.files import atomic_write, json_text
    return atomic_write(path, json_text(data, indent=1, default=str), "demo summary")


def _splits(say, tok, ref, cand, runs, ids, mask, policy, new_tokens, eos, clock) -> dict:
    """Every pair of differing answers explained (module docstring); the nearest tie if none."""
    say("  where the answers differ, and why:")
    batching = clock.run("alone vs batched: each split judged (the model's own fp64 twin, the oracle)",
                         lambda: [f for impl in IMPLS for i in range(len(ids))
                                  if (f := explain_batching(say, tok, ref, runs[impl], i, ids, mask, eos))])
    models = clock.run("torchref vs jaxmodel alone: greedy divergence and its cause (compare --generate)",
                       explain_models, say, tok, ref, cand, runs, ids, mask, policy, new_tokens, eos)
    for i in range(len(ids)):
        a, b = (_tokens(runs[impl].batched, i, eos) for impl in IMPLS)
        if _first_difference(a, b) is not None:
            why = [f["impl"] for f in batching if f["prompt"] == i]
            say(f"    prompt {i + 1} in the batch: torchref and jaxmodel differ"
                + (f" because batching changed {' and '.join(why)}'s answer (above)" if why else
                   " as they do alone (above)"))
    out = {"batching": batching, "models": models, "invariant": {}}
    if not batching and not models:
        out["nearest_tie"] = clock.run("the nearest tie: its rounding threshold (the fp64 twin)", nearest_tie,
                                       say, tok, runs, ids, mask, eos)
    for impl in IMPLS:
        flipped = [f["prompt"] for f in batching if f["impl"] == impl]
        if flipped:
            out["invariant"][impl] = clock.run(
                f"{impl} in the batch-invariant mode: the flipped prompts alone and batched",
                invariant_check, say, tok, ref.at_policy.checkpoint, policy, impl, flipped, ids, mask,
                new_tokens, eos)
    return out


def demo_policy(say, tok, folder, prompts, ids, mask, policy_name, new_tokens, out_dir, print_table,
                fp64: dict) -> dict:
    """One policy: answers, their splits explained, the ladder's verdict, the seconds. fp64: the
    float64 model of each implementation (KeptRuns), shared by every policy (run's docstring)."""
    from compare.ladder.engine import prepare, run_ladder
    from compare.probes import as_probe_model
    from llamaspec.checkpoint import check_checkpoint
    say(f"=== policy {policy_name} ===")
    clock = Clock(say)
    ref, cand, ids, mask, policy = prepare("torchref", "jaxmodel", folder, (ids, mask), policy_name)
    ref, cand = (dataclasses.replace(side, at_fp64=fp64[side.name]) for side in (ref, cand))
    # the probes' fp64 twin computes over the weights as the policy rounds them: where it rounds
    # none, that is the shared float64 model (else the probes make their own, on first use)
    twin = check_checkpoint(folder).exact_in(policy.param_dtype)
    eos = tuple(tok.eos_ids)
    runs = {impl: clock.run(f"{impl}: loaded, up to {new_tokens} greedy tokens x {len(ids)} prompts, in the batch "
                            "and each alone",
                            lambda s=side: greedy_runs(as_probe_model(s.at_policy.model,
                                                                      oracle=fp64[s.name] if twin else None),
                                                       ids, mask, new_tokens, eos))
            for impl, side in (("torchref", ref), ("jaxmodel", cand))}
    print_answers(say, tok, prompts, runs, eos)
    splits = _splits(say, tok, ref, cand, runs, ids, mask, policy, new_tokens, eos, clock)
    say("  drift or bug? jaxmodel against torchref on the batch, fp64 oracle and teacher forcing:")
    t0 = time.perf_counter()
    report = clock.run("the ladder: jaxmodel vs torchref, every tap, fp64 oracle, teacher forcing", run_ladder,
                       ref, cand, ids, mask, policy, True,
                       lambda m: say(f"  [{time.perf_counter() - t0:5.1f}s] {m}"),
                       stream=False)   # both models are loaded whole already (the greedy runs)
    print_table(report)
    say(report.summary())
    html = report.to_html(out_dir / f"demo-jaxmodel-vs-torchref-{policy_name}.html")
    say(f"  cost at {policy_name}: " + ", ".join(f"{label.split(':')[0]} {sec:.1f} s" for label, sec in clock.steps)
        + f"; {sum(sec for _, sec in clock.steps):.1f} s in all\n")
    return {"policy": policy_name, "answers": {impl: {"alone": [_tokens(tr, 0, eos) for tr in r.alone],
                                                      "batched": [_tokens(r.batched, i, eos) for i in range(len(ids))]}
                                               for impl, r in runs.items()},
            **splits, "verdict": report.verdict, "html": str(html),
            "seconds": [[label, round(sec, 2)] for label, sec in clock.steps]}



def run(folder, prompts, policies, new_tokens: int, out_dir: Path, print_table, say=print) -> dict:
    """The whole demo (module docstring); returns what it printed as data, also written to
    out_dir/demo.json."""
    from compare.environment import environment
    from llamaspec.tokenizer import Tokenizer
    t0 = time.perf_counter()
    tok = Tokenizer.from_pretrained(folder)
    ids, mask = tok.batch_encode(prompts, chat=True, padding_side="left")
    env = environment(policies[0])
    say(f"checkpoint: {folder}")
    say(f"on: {env.get('cpu')} ({env.get('cpu isa')}; caps: {env.get('isa caps')})")
    say(f"{len(prompts)} prompts, each alone and together in one batch of {ids.shape[0]} x {ids.shape[1]} "
        "tokens (left padded)\n")
    # one float64 model per implementation for the whole demo, its captures kept (KeptRuns): the
    # ladder's oracle and fp64 rungs are the same runs at every policy (checkpoint values, inputs).
    # They hold about 0.5 GB per all-tap capture of SmolLM2 on the demo's 4 x 40 batch.
    from compare.ladder.stream import CheckpointModel
    fp64 = {impl: KeptRuns(CheckpointModel(impl, folder, "fp64")) for impl in IMPLS}
    results = [demo_policy(say, tok, folder, prompts, ids, mask, p, new_tokens, out_dir, print_table, fp64)
               for p in policies]
    for r in results:
        flips = ", ".join(f"{f['impl']} prompt {f['prompt'] + 1} ({f['kind']})" for f in r["batching"]) or "none"
        parts = ", ".join(f"prompt {f['prompt'] + 1} ({f['cause']})" for f in r["models"]) or "none"
        say(f"{r['policy']}: batching changed: {flips}; torchref vs jaxmodel alone part: {parts}; "
            f"ladder: {r['verdict']}; report {r['html']}")
    total = time.perf_counter() - t0
    data = {"checkpoint": str(folder), "prompts": list(prompts), "new_tokens": new_tokens, "policies": results,
            "environment": env, "seconds": round(total, 1)}
    say(f"demo summary: {write_json(out_dir / 'demo.json', data)}; {total:.1f} s in all")
    return data
