"""The policy sweep: several precision policies of one implementation on one text, each judged
against the float64 oracle (the same implementation at fp64 over the checkpoint's own values)
and, where asked, against each other, with the measures of compare.sweep.measures.

    res = sweep("torchref", folder, ["fp32", "bf16", "fp16", "bf16w-f32"], window=512, max_tokens=8192)
    print("\\n".join(table(res))); res.to_json("sweep.json")

The text is cut into non-overlapping windows of `window` tokens; each window is one fresh
context (no state carried over), every position that has a next token inside the window is
scored. Per window, the oracle and each policy run once, their log-probabilities feed the
accumulators and are dropped: memory holds one window's logits per model in use, not the text's.
The greedy divergence index (the first generated token where a policy's greedy continuation
parts from the oracle's) is measured on M prompts cut from the text's first windows.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from llamaspec import LlamaConfig, Policy
from llamaspec.budget import MAX_TEXT_BYTES, check_tokens, read_bounded
from llamaspec.errors import InputError
from llamaspec.files import repo_root
from llamaspec.tokenizer import Tokenizer

from ..adapters import OurModel
from ..environment import environment
from ..results import JsonResult
from .measures import Accumulator, Measures, log_probs

IMPLS = ("torchref", "jaxmodel")
ORACLE = "fp64"
DEFAULT_TEXT = "docs/method.md"


@dataclasses.dataclass(frozen=True)
class Row:
    """One (candidate, base) pair's measures over the text."""
    candidate: str
    base: str
    measures: Measures


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Greedy divergence of one policy from the oracle: per prompt, the index (0-based) of the
    first generated token that differs, or None when all `new_tokens` agree."""
    policy: str
    indices: list
    new_tokens: int

    @property
    def parted(self) -> int:
        return sum(i is not None for i in self.indices)


@dataclasses.dataclass(frozen=True)
class SweepResult(JsonResult):
    impl: str
    checkpoint: str
    text: str                   # where the tokens came from
    window: int
    tokens: int                 # tokens of the text used (after max_tokens)
    windows: int
    policies: list
    rows: list                  # [Row]
    greedy: list                # [Divergence]; empty when prompts=0
    greedy_prompt_tokens: int
    seconds: dict               # "total", and per model the seconds of its forward calls
    environment: dict


def read_text(path, error=InputError) -> str:
    """A text file read within MAX_TEXT_BYTES (llamaspec.budget.read_bounded) and decoded as UTF-8;
    `error` names the file and the byte where the decoding failed."""
    data = read_bounded(path, error, MAX_TEXT_BYTES, "text file", "MAX_TEXT_BYTES")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start} of {len(data)}); give a UTF-8 text file") from None


def text_tokens(checkpoint, text: str | None) -> tuple[np.ndarray, str]:
    """The text's token ids (the checkpoint's tokenizer, no special tokens) and where they came
    from; None: the project's own docs/method.md (offline)."""
    source = f"the text given ({len(text)} characters)" if text is not None else DEFAULT_TEXT
    if text is None:
        text = read_text(repo_root() / DEFAULT_TEXT)
    ids = np.asarray(Tokenizer.from_pretrained(checkpoint).encode(text), np.int64)
    return ids, source


def windows_of(ids: np.ndarray, window: int) -> list[np.ndarray]:
    """Non-overlapping windows of `window` tokens; a last shorter one kept when it has a target."""
    return [ids[a:a + window] for a in range(0, len(ids), window) if len(ids[a:a + window]) >= 2]


def check_sweep(impl, policies, pairs, window, cfg: LlamaConfig, arg=lambda name: name) -> list[tuple[str, str]]:
    """The sweep's arguments checked before any model loads (InputError naming each by
    arg(name): the API's "policies", "pair", "window"; the CLI's flags): the (candidate, base)
    pairs to measure, every policy against the oracle first."""
    if impl not in IMPLS:
        raise InputError(f"{arg('impl')} {impl}: unknown implementation (one of {', '.join(IMPLS)})")
    if not policies:
        raise InputError(f"{arg('policies')}: no policies to sweep")
    if ORACLE in policies:
        raise InputError(f"{arg('policies')} {', '.join(policies)}: '{ORACLE}' is the oracle every policy is "
                         "measured against; leave it out")
    if len(set(policies)) != len(policies):
        raise InputError(f"{arg('policies')} {', '.join(policies)}: a policy named twice")
    out = [(p, ORACLE) for p in policies]
    for cand, base in pairs:
        for side in (cand, base):
            if side not in policies and side != ORACLE:
                raise InputError(f"{arg('pair')} {cand}:{base}: '{side}' is not among the swept policies "
                                 f"({', '.join(policies)}) or {ORACLE}")
        if cand == base:
            raise InputError(f"{arg('pair')} {cand}:{base}: a policy against itself")
        if (cand, base) not in out:
            out.append((cand, base))
    if window < 2:
        raise InputError(f"{arg('window')} {window}: a window needs at least 2 tokens (a position and its next)")
    check_tokens(1, window, cfg.max_position_embeddings, cfg.vocab_size, f"{arg('window')} {window}")
    return out


def sweep(impl: str, checkpoint, policies, text: str | None = None, window: int = 512,
          max_tokens: int | None = None, progress=None, tokens=None, pairs=(), prompts: int = 4,
          prompt_tokens: int = 32, new_tokens: int = 32) -> SweepResult:
    """Each policy of `impl` ("torchref" or "jaxmodel") against the fp64 oracle, and each
    (candidate, base) of `pairs` (policy names) against each other, over a text (the module
    docstring). policies: preset names or Policy objects (e.g. Policy.get("bf16w-f32",
    param_dtype="float16", name="f16w-f32")), each named once.

    text: the text itself (None: docs/method.md); tokens: token ids instead (a checkpoint
    without a tokenizer); max_tokens: the text cut to its first tokens; progress(msg): a line per
    window with an ETA; prompts: greedy divergence over that many prompts of `prompt_tokens`
    tokens (the starts of the first windows), `new_tokens` each (0 prompts: none)."""
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    checkpoint = str(checkpoint)
    cfg = LlamaConfig.from_file(Path(checkpoint) / "config.json")
    chosen = {p.name: p for p in map(Policy.get, policies)}    # a PolicyError names an unknown preset
    policies = [Policy.get(p).name for p in policies]
    pairs = check_sweep(impl, policies, [tuple(p) for p in pairs], window, cfg)
    if tokens is not None:
        ids, source = np.asarray(tokens, np.int64).reshape(-1), f"{np.size(tokens)} token ids given"
        if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise InputError(f"token ids must lie in [0, vocab_size={cfg.vocab_size})")
    else:
        ids, source = text_tokens(checkpoint, text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    chunks = windows_of(ids, window)
    if not chunks:
        raise InputError(f"{source}: {len(ids)} token(s), fewer than the 2 a window needs")
    models = {}
    for name in (ORACLE, *policies):
        say(f"loading {impl} at {name}")
        models[name] = OurModel.load(impl, checkpoint, chosen.get(name, name))
    accs, secs = _windows(models, chunks, pairs, len(policies), lambda done, w: say(
        f"window {w}/{len(chunks)}: {done}/{len(ids)} tokens, {time.perf_counter() - t0:.0f} s, "
        f"ETA {(time.perf_counter() - t0) / done * (len(ids) - done):.0f} s"))
    greedy = _greedy(models, policies, chunks, prompts, prompt_tokens, new_tokens, say)
    rows = [Row(c, b, accs[(c, b)].result()) for c, b in pairs]
    secs = {"total": time.perf_counter() - t0, **{f"{n} forward": s for n, s in secs.items()}}
    env = environment(ORACLE, uses_jax=impl == "jaxmodel", sides=models)
    return SweepResult(impl, checkpoint, source, window, len(ids), len(chunks), list(policies), rows, greedy,
                       min(prompt_tokens, window) if greedy else 0, secs, env)


def _windows(models, chunks, pairs, direct: int, tick):
    """Every model on every window; each window's log-probabilities fed to the pairs' accumulators
    and dropped (the first `direct` pairs are policy vs oracle, the rest kept until the window's
    end). Returns the accumulators and each model's forward seconds; tick(tokens done, window)."""
    accs = {pair: Accumulator() for pair in pairs}
    keep = {side for pair in pairs[direct:] for side in pair}
    secs = dict.fromkeys(models, 0.0)
    done = 0
    for w, chunk in enumerate(chunks):
        lps = {}
        for name, model in models.items():     # the oracle first
            t = time.perf_counter()
            logits = model(chunk[None, :])
            secs[name] += time.perf_counter() - t
            lps[name] = log_probs(logits[0, :-1])
            del logits
            if name != ORACLE:
                accs[(name, ORACLE)].add(lps[ORACLE], lps[name], chunk[1:])
                if name not in keep:
                    del lps[name]
        for cand, base in pairs[direct:]:
            accs[(cand, base)].add(lps[base], lps[cand], chunk[1:])
        del lps
        done += len(chunk)
        tick(done, w + 1)
    return accs, secs


def _greedy(models, policies, chunks, prompts, prompt_tokens, new_tokens, say) -> list[Divergence]:
    """Per policy, the first index where its greedy continuation of each prompt parts from the
    oracle's (EOS does not stop a continuation: both run `new_tokens` steps)."""
    starts = [c[:prompt_tokens] for c in chunks[:prompts] if len(c) >= 1]
    if not starts or new_tokens < 1:
        return []
    say(f"greedy: {len(starts)} prompt(s) of {len(starts[0])} tokens, {new_tokens} new tokens each")

    def run(name, ids):
        return np.asarray(models[name].generate(ids[None, :], max_new_tokens=new_tokens, eos_token_ids=[]))[0]

    oracle = [run(ORACLE, s) for s in starts]
    out = []
    for name in policies:
        idx = []
        for s, ref in zip(starts, oracle):
            got = run(name, s)
            differ = np.flatnonzero(got != ref)
            idx.append(int(differ[0]) if differ.size else None)
        out.append(Divergence(name, idx, new_tokens))
    return out


def table(res: SweepResult) -> list[str]:
    """The terminal table: a row per (candidate, base), then the greedy divergence."""
    head = (f"{'candidate':<10} {'base':<10} {'mean KLD':>21} {'p99 KLD':>9} {'p99.9 KLD':>9} {'max KLD':>9} "
            f"{'same top p %':>15} {'PPL ratio':>17} {'RMS Δp %':>13}")
    lines = [f"{res.impl} on {res.checkpoint}: {res.tokens} tokens of {res.text}, {res.windows} window(s) of "
             f"{res.window}, {res.seconds['total']:.0f} s on {res.environment.get('cpu', 'an unnamed CPU')}",
             head]
    for r in res.rows:
        m = r.measures
        lines.append(f"{r.candidate:<10} {r.base:<10} {m.kld_mean.value:>10.3e} ± {m.kld_mean.se:<8.1e} "
                     f"{m.kld_percentiles['p99']:>9.2e} {m.kld_percentiles['p99.9']:>9.2e} {m.kld_max:>9.2e} "
                     f"{100 * m.same_top_p.value:>7.3f} ± {100 * m.same_top_p.se:<5.3f} "
                     f"{m.ppl_ratio.value:>8.5f} ± {m.ppl_ratio.se:<6.1e} "
                     f"{100 * m.rms_dp.value:>6.3f} ± {100 * m.rms_dp.se:<4.3f}")
    if res.rows:
        lines.append(f"PPL of the base ({ORACLE}): {res.rows[0].measures.ppl_base.value:.4f} "
                     f"± {res.rows[0].measures.ppl_base.se:.4f}")
    for g in res.greedy:
        shown = ", ".join("-" if i is None else str(i) for i in g.indices)
        lines.append(f"greedy {g.policy:<10} first token parting from {ORACLE} per prompt: {shown} "
                     f"({g.parted}/{len(g.indices)} parted within {g.new_tokens} tokens)")
    return lines
