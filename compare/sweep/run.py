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

Before the windows, on the first `sensitivity_windows` windows, every policy's local error per
layer (teacher forcing, compare.sweep.layers) ranks its layers; with keep_wide=K, each policy
that is not already as wide as `wide` gets a row of its own: the policy with its K most sensitive
layers computed by `wide`, measured over the text like the others.

stream=True (compare.sweep.stream): no model is loaded; every model is a CheckpointModel and each
window is one walk over the checkpoint's layers for all of them (one layer's weights held at a
time), the local errors a walk of their own per measured window, and the greedy continuations
one walk per new token (no KV cache). The same numbers as the loaded path (tests/test_sweep_stream.py).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from llamaspec import LlamaConfig, Policy
from llamaspec.budget import MAX_TEXT_BYTES, check_bytes, check_tokens, read_bounded
from llamaspec.errors import InputError, PolicyError
from llamaspec.files import repo_root
from llamaspec.plan import declines
from llamaspec.tokenizer import Tokenizer

from ..adapters import OurModel
from ..adapters.streaming import CheckpointModel
from ..environment import environment
from ..report.sweep import write_html
from ..results import JsonResult
from .layers import LayerAccumulator, LayerErrors, OracleWindow, suggest
from .measures import Accumulator, Measures, log_probs
from .stream import Streamer, streamer

IMPLS = ("torchref", "jaxmodel")
ORACLE = "fp64"
DEFAULT_TEXT = "docs/method.md"
SENSITIVITY_WINDOWS = 2    # each window alone ranks the layers; a second shows whether the ranking holds
WIDE_POLICY = "fp32"


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
    layers: list = dataclasses.field(default_factory=list)     # [LayerErrors], swept then suggested
    suggested: list = dataclasses.field(default_factory=list)  # [Suggestion]; their rows are in rows
    keep_wide: int = 0
    wide_policy: str = WIDE_POLICY
    sensitivity_windows: int = 0    # windows the local errors were measured on
    stream: bool = False            # every model walked layer by layer over the checkpoint, none loaded

    def to_html(self, path) -> Path:
        """The HTML page (compare.report.sweep), written atomically."""
        return write_html(self, path)


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


def check_sweep(impl, policies, pairs, window, cfg: LlamaConfig, arg=lambda name: name, keep_wide: int = 0,
                wide=WIDE_POLICY, sensitivity_windows: int = SENSITIVITY_WINDOWS,
                stream: bool = False) -> list[tuple[str, str]]:
    """The sweep's arguments checked before any model loads (InputError naming each by
    arg(name): the API's "policies", "pair", "window", "keep_wide", "wide_policy",
    "sensitivity_windows", "stream"; the CLI's flags): the (candidate, base) pairs to measure, every
    policy against the oracle first. policies: names (presets, policy strings) or Policy objects."""
    if impl not in IMPLS:
        raise InputError(f"{arg('impl')} {impl}: unknown implementation (one of {', '.join(IMPLS)})")
    if not policies:
        raise InputError(f"{arg('policies')}: no policies to sweep")
    chosen = [_policy(p, arg("policies")) for p in policies]
    policies = [p.name for p in chosen]
    if ORACLE in policies:
        raise InputError(f"{arg('policies')} {', '.join(policies)}: '{ORACLE}' is the oracle every policy is "
                         "measured against; leave it out")
    if len(set(policies)) != len(policies):
        raise InputError(f"{arg('policies')} {', '.join(policies)}: a policy named twice")
    n = cfg.num_hidden_layers
    for p in chosen:
        try:
            p.check_layers(n)
        except PolicyError as e:
            raise InputError(f"{arg('policies')}: {e}") from None
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
    _check_layers_args(keep_wide, wide, sensitivity_windows, n, arg)
    _check_stream(stream, len(policies), keep_wide > 0, window, cfg, arg)
    return out


def _check_stream(stream, policies: int, suggested: bool, window: int, cfg: LlamaConfig, arg) -> None:
    """stream a bool; streamed, one window's logits of every model at once (the oracle, the
    policies and, where suggested, as many mixed ones) within this machine's memory, as float64."""
    if not isinstance(stream, bool):
        raise InputError(f"{arg('stream')} {stream!r}: True or False")
    if stream:
        models = 1 + policies * (2 if suggested else 1)
        check_bytes(models * window * cfg.vocab_size * 8,
                    f"{arg('stream')} with {arg('window')} {window} and {models} models (fp64, the policies"
                    f"{' and their suggested rows' if suggested else ''}): one window's logits of every model, "
                    "held at once by a streamed walk, counted as float64", InputError)


def _policy(p, what: str) -> Policy:
    try:
        return Policy.get(p)
    except PolicyError as e:
        raise InputError(f"{what}: {e}") from None


def _check_layers_args(keep_wide, wide, sensitivity_windows, n: int, arg) -> Policy:
    """keep_wide in [0, layers], the wide policy one a layer can take, sensitivity_windows >= 0 (and
    > 0 when layers are kept wide)."""
    if not isinstance(keep_wide, int) or not 0 <= keep_wide <= n:
        raise InputError(f"{arg('keep_wide')} {keep_wide}: keep between 0 (none) and the model's {n} layers wide")
    if not isinstance(sensitivity_windows, int) or sensitivity_windows < 0:
        raise InputError(f"{arg('sensitivity_windows')} {sensitivity_windows}: a number of windows, 0 or more")
    if keep_wide and not sensitivity_windows:
        raise InputError(f"{arg('keep_wide')} {keep_wide} with {arg('sensitivity_windows')} 0: the layers to keep "
                         "wide are the ones the local errors rank first; measure them on a window at least")
    w = _policy(wide, arg("wide_policy"))
    if w.layers:
        raise InputError(f"{arg('wide_policy')} {w.name}: a layer's policy has no per-layer overrides of its own")
    return w


def sweep(impl: str, checkpoint, policies, text: str | None = None, window: int = 512,
          max_tokens: int | None = None, progress=None, tokens=None, pairs=(), prompts: int = 4,
          prompt_tokens: int = 32, new_tokens: int = 32, keep_wide: int = 0, wide_policy=WIDE_POLICY,
          sensitivity_windows: int = SENSITIVITY_WINDOWS, stream: bool = False) -> SweepResult:
    """Each policy of `impl` ("torchref" or "jaxmodel") against the fp64 oracle, and each
    (candidate, base) of `pairs` (policy names) against each other, over a text (the module
    docstring). policies: preset names, policy strings ("bf16+kv_cache=e4m3:channel") or Policy
    objects (e.g. Policy.get("bf16w-f32", param_dtype="float16", name="f16w-f32")), each named once.

    text: the text itself (None: docs/method.md); tokens: token ids instead (a checkpoint
    without a tokenizer); max_tokens: the text cut to its first tokens; progress(msg): a line per
    window with an ETA; prompts: greedy divergence over that many prompts of `prompt_tokens`
    tokens (the starts of the first windows), `new_tokens` each (0 prompts: none).
    sensitivity_windows: the local error per layer measured on that many first windows (0: not
    measured); keep_wide: per policy, a row for it with its that many most sensitive layers
    computed by `wide_policy` (0: none). stream: no model loaded, every one walked layer by layer
    over the checkpoint (compare.sweep.stream; the greedy part then costs new_tokens walks)."""
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    checkpoint = str(checkpoint)
    cfg = LlamaConfig.from_file(Path(checkpoint) / "config.json")
    given = [Policy.get(p) for p in policies]     # a PolicyError names an unknown preset
    pairs = check_sweep(impl, given, [tuple(p) for p in pairs], window, cfg, keep_wide=keep_wide, wide=wide_policy,
                        sensitivity_windows=sensitivity_windows, stream=stream)
    chosen = {p.name: p for p in given}
    policies = list(chosen)
    wide = Policy.get(wide_policy)
    ids, source = _token_ids(checkpoint, cfg, text, tokens)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    chunks = windows_of(ids, window)
    if not chunks:
        raise InputError(f"{source}: {len(ids)} token(s), fewer than the 2 a window needs")
    backend = sweep_backend(given, keep_wide)
    walker = _streamer(impl, checkpoint, {ORACLE: Policy.get(ORACLE), **chosen}, say, backend) if stream else None
    models = walker.models if stream else {}
    for name in () if stream else (ORACLE, *policies):
        say(f"loading {impl} at {name}" + ("" if backend is None else f" ({backend} backend)"))
        models[name] = OurModel.load(impl, checkpoint, chosen.get(name, name), backend=backend)
    measured = chunks[:sensitivity_windows]
    layers = _sensitivity(models, policies, measured, max(keep_wide, 3), say, walker) if measured else {}
    suggested = _suggested(impl, checkpoint, chosen, layers, keep_wide, wide, models, walker, say,
                           backend) if measured else []
    if suggested:
        layers.update(_sensitivity(models, [s.name for s in suggested], measured, max(keep_wide, 3), say, walker))
    direct = [(p, ORACLE) for name in policies for p in (name, *(s.name for s in suggested if s.policy == name))]
    pairs = direct + pairs[len(policies):]
    swept = [p for p, _ in direct]
    t1 = time.perf_counter()
    accs, secs = _windows(models, chunks, pairs, len(direct), lambda done, w: say(
        f"window {w}/{len(chunks)}: {done}/{len(ids)} tokens, {time.perf_counter() - t0:.0f} s, "
        f"ETA {(time.perf_counter() - t1) / done * (len(ids) - done):.0f} s"), walker)
    greedy = _greedy(models, swept, chunks, prompts, prompt_tokens, new_tokens, say, walker)
    rows = [Row(c, b, accs[(c, b)].result()) for c, b in pairs]
    secs = {"total": time.perf_counter() - t0, **{f"{n} forward": s for n, s in secs.items()}}
    if stream:
        secs["reading"] = walker.reader.seconds
    env = environment(ORACLE, uses_jax=impl == "jaxmodel", sides=models)
    return SweepResult(impl, checkpoint, source, window, len(ids), len(chunks), list(policies), rows, greedy,
                       min(prompt_tokens, window) if greedy else 0, secs, env,
                       [layers[p] for p in swept if p in layers], suggested, keep_wide, wide.name, len(measured),
                       stream)


def sweep_backend(policies, keep_wide: int) -> str | None:
    """One backend for every policy a sweep compares (None: the default, fast). The fast backend
    declines per-layer overrides and the fp8 / KV-cache knobs (llamaspec.plan.declines: the
    reference computes them), so a sweep holding such a policy, or suggesting mixed ones
    (keep_wide), runs every policy on the reference backend: a difference between two policies'
    layers is then the policies', not the backends' (on an AMX Xeon the fast backend's bf16
    products are not the reference's bits, where on a Zen 4 they were)."""
    return "reference" if keep_wide or any(declines(p) for p in policies) else None


def _suggested(impl, checkpoint, chosen: dict, layers: dict, keep_wide: int, wide: Policy, models: dict,
               walker: Streamer | None, say, backend: str | None = None) -> list:
    """Per policy its suggested mixed policy (layers.suggest), loaded into `models` (or added to the
    walker); the Suggestions made."""
    out = []
    for name, policy in chosen.items():
        made = suggest(policy, layers[name], keep_wide, wide)
        if made and made[0].name not in models:
            what = f"{made[0].name} (its {len(made[0].kept)} most sensitive layers at {wide.name})"
            say(f"{'streaming' if walker else 'loading'} {impl} at {what}")
            if walker is not None:
                walker.add(made[0].name, CheckpointModel(impl, checkpoint, made[1], backend))
            else:
                models[made[0].name] = OurModel.load(impl, checkpoint, made[1], backend=backend)
            out.append(made[0])
    return out


def _streamer(impl, checkpoint, policies: dict, say, backend: str | None = None) -> Streamer:
    say(f"streaming {impl} at {', '.join(policies)}: no model loaded, each walked layer by layer over "
        f"{checkpoint}" + ("" if backend is None else f" ({backend} backend)"))
    return streamer(impl, checkpoint, policies, backend=backend)


def _token_ids(checkpoint, cfg, text, tokens) -> tuple[np.ndarray, str]:
    if tokens is None:
        return text_tokens(checkpoint, text)
    ids = np.asarray(tokens, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
        raise InputError(f"token ids must lie in [0, vocab_size={cfg.vocab_size})")
    return ids, f"{np.size(tokens)} token ids given"


def _sensitivity(models, names, chunks, top: int, say, walker: Streamer | None = None) -> dict[str, LayerErrors]:
    """Per policy of `names`, its local error per layer over `chunks` (teacher forcing, per window:
    the oracle's capture, its forced capture per residual dtype and one per policy;
    compare.sweep.layers); with a walker, the same runs layer by layer, one walk per window."""
    n = models[ORACLE].cfg.num_hidden_layers
    names = sorted(names, key=lambda name: models[name].policy.residual_dtype)   # one oracle rerun per dtype
    accs = {name: LayerAccumulator(name, n, top) for name in names}
    t0 = time.perf_counter()
    for w, chunk in enumerate(chunks):
        if walker is not None:
            for name, rows in walker.layer_sums(ORACLE, names, chunk).items():
                accs[name].add_window(rows, len(chunk))
        else:
            oracle = OracleWindow(models[ORACLE], chunk, n)
            for name in names:
                accs[name].add(models[name], oracle)
            del oracle
        took = time.perf_counter() - t0
        what = f"{len(names)} polic{'y' if len(names) == 1 else 'ies'}, teacher forcing"
        say(f"local error per layer, window {w + 1}/{len(chunks)} ({what}): {took:.0f} s, "
            f"ETA {took / (w + 1) * (len(chunks) - w - 1):.0f} s")
    return {name: acc.result() for name, acc in accs.items()}


def _windows(models, chunks, pairs, direct: int, tick, walker: Streamer | None = None):
    """Every model on every window; each window's log-probabilities fed to the pairs' accumulators
    and dropped (the first `direct` pairs are policy vs oracle, the rest kept until the window's
    end). Returns the accumulators and each model's forward seconds; tick(tokens done, window).
    With a walker, one walk per window gives every model's logits, handed out one at a time."""
    accs = {pair: Accumulator() for pair in pairs}
    keep = {side for pair in pairs[direct:] for side in pair}
    secs = dict.fromkeys(models, 0.0)
    before = dict(walker.seconds) if walker is not None else None
    done = 0
    for w, chunk in enumerate(chunks):
        lps = {}
        forward = walker.window(chunk).pop if walker is not None else None
        for name, model in models.items():     # the oracle first
            t = time.perf_counter()
            logits = forward(name) if forward else model(chunk[None, :])
            secs[name] += time.perf_counter() - t
            lps[name] = log_probs(logits[0, :-1])
            del logits
            if name != ORACLE:
                accs[(name, ORACLE)].add(lps[ORACLE], lps[name], chunk[1:])
                if name not in keep:
                    del lps[name]
        for cand, base in pairs[direct:]:
            accs[(cand, base)].add(lps[base], lps[cand], chunk[1:])
        del lps, forward
        done += len(chunk)
        tick(done, w + 1)
    if walker is not None:      # the walks' own time per model
        secs = {name: walker.seconds[name] - before.get(name, 0.0) for name in models}
    return accs, secs


def _greedy(models, policies, chunks, prompts, prompt_tokens, new_tokens, say,
            walker: Streamer | None = None) -> list[Divergence]:
    """Per policy, the first index where its greedy continuation of each prompt parts from the
    oracle's (EOS does not stop a continuation: both run `new_tokens` steps). With a walker, each
    step is one walk of every (prompt, model) over its whole sequence (no KV cache)."""
    starts = [c[:prompt_tokens] for c in chunks[:prompts] if len(c) >= 1]
    if not starts or new_tokens < 1:
        return []
    say(f"greedy: {len(starts)} prompt(s) of {len(starts[0])} tokens, {new_tokens} new tokens each"
        + (f" (streamed: {new_tokens} walks of {len(starts) * (1 + len(policies))} sequences, no KV cache)"
           if walker is not None else ""))
    if walker is not None:
        t0 = time.perf_counter()
        conts = walker.greedy([ORACLE, *policies], starts, new_tokens, lambda step: say(
            f"greedy step {step}/{new_tokens}: {time.perf_counter() - t0:.0f} s, "
            f"ETA {(time.perf_counter() - t0) / step * (new_tokens - step):.0f} s"))
    else:
        conts = {name: [np.asarray(models[name].generate(s[None, :], max_new_tokens=new_tokens, eos_token_ids=[]))[0]
                        for s in starts] for name in (ORACLE, *policies)}
    out = []
    for name in policies:
        idx = []
        for got, ref in zip(conts[name], conts[ORACLE]):
            differ = np.flatnonzero(got != ref)
            idx.append(int(differ[0]) if differ.size else None)
        out.append(Divergence(name, idx, new_tokens))
    return out


def table(res: SweepResult) -> list[str]:
    """The terminal table: a row per (candidate, base), the most sensitive layers per policy,
    then the greedy divergence."""
    w = max([10, *(len(r.candidate) for r in res.rows)])
    head = (f"{'candidate':<{w}} {'base':<10} {'mean KLD':>21} {'p99 KLD':>9} {'p99.9 KLD':>9} {'max KLD':>9} "
            f"{'same top p %':>15} {'PPL ratio':>17} {'RMS Δp %':>13}")
    lines = [f"{res.impl} on {res.checkpoint}: {res.tokens} tokens of {res.text}, {res.windows} window(s) of "
             f"{res.window}, {res.seconds['total']:.0f} s on {res.environment.get('cpu', 'an unnamed CPU')}",
             head]
    for r in res.rows:
        m = r.measures
        lines.append(f"{r.candidate:<{w}} {r.base:<10} {m.kld_mean.value:>10.3e} ± {m.kld_mean.se:<8.1e} "
                     f"{m.kld_percentiles['p99']:>9.2e} {m.kld_percentiles['p99.9']:>9.2e} {m.kld_max:>9.2e} "
                     f"{100 * m.same_top_p.value:>7.3f} ± {100 * m.same_top_p.se:<5.3f} "
                     f"{m.ppl_ratio.value:>8.5f} ± {m.ppl_ratio.se:<6.1e} "
                     f"{100 * m.rms_dp.value:>6.3f} ± {100 * m.rms_dp.se:<4.3f}")
    if res.rows:
        lines.append(f"PPL of the base ({ORACLE}): {res.rows[0].measures.ppl_base.value:.4f} "
                     f"± {res.rows[0].measures.ppl_base.se:.4f}")
    lines += layer_lines(res)
    for g in res.greedy:
        shown = ", ".join("-" if i is None else str(i) for i in g.indices)
        lines.append(f"greedy {g.policy:<{w}} first token parting from {ORACLE} per prompt: {shown} "
                     f"({g.parted}/{len(g.indices)} parted within {g.new_tokens} tokens)")
    return lines


def layer_lines(res: SweepResult, shown: int = 5) -> list[str]:
    """Per policy its most sensitive layers (local error of the update relative to the stream,
    teacher forcing), and which rows keep which layers wide."""
    if not res.layers:
        return []
    w = max(len(e.policy) for e in res.layers)
    lines = [f"most sensitive layers (local error of the layer's update relative to its output, teacher forcing "
             f"over {res.sensitivity_windows} window(s)):"]
    for e in res.layers:
        top = ", ".join(f"{i} ({e.stream[i]:.1e})" for i in e.ranking[:shown])
        lines.append(f"  {e.policy:<{w}} {top}")
    for s in res.suggested:
        lines.append(f"suggested: {s.policy} with layers {', '.join(map(str, s.kept))} at {s.wide}: row {s.name}")
    return lines
