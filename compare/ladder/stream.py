"""The ladder walked one layer at a time, for torchref and jaxmodel over checkpoint folders.

The full ladder (engine.run_ladder) captures four whole runs and keeps every tap of every
layer. Here each layer's tensors are read from the safetensors files once and handed to
every run (reference and candidate at the policy, the oracle, the candidate at fp64, and
the teacher-forced runs of the two sides at the policy on the oracle's input), each
rounding its copy to its own dtype (the models' LayerRunner); the layer's taps are judged
on the spot (verdicts.classify, context_for) and only numbers and the four hidden states
are carried to the next layer. The embedding reads only the batch's rows; the lm_head
goes in vocabulary chunks when its widest copy exceeds HEAD_CHUNK_BYTES. Memory does not
grow with depth (bench/stream_memory.py measures it). The verdicts, local errors and logits
metrics are the full ladder's (tests/test_stream.py holds the two to the same numbers).

CheckpointModel is what prepare() makes of "torchref" / "jaxmodel": the Implementation
that loads its whole model only when asked for more than the ladder (capture, decode...).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import importlib
import time
from pathlib import Path

import numpy as np

from llamaspec import LlamaConfig, Policy, check_tokens, positions_from_mask
from llamaspec import taps as tapnames
from llamaspec.checkpoint import check_checkpoint, validated

from ..adapters import OurModel, Side
from ..judge.verdicts import classify, context_for, first_divergence, precision_ratio, settle_conventions
from ..metrics import logits_agreement, pair_metrics, rel_l2
from ..vocabulary import drift_factor, precision_floor
from .teacher import amplification, confirm_divergence, forced_taps, fp64_rule, inherit, judge_forced, suspects

# The lm_head is multiplied in one piece when its widest copy (float64 for the oracle)
# fits in this many bytes, else in vocabulary chunks that do. One piece is bitwise the
# full run's product; a chunked float64 product may differ from it in the last bits
# (torch's float64 matmul sums in another order for another width; docs/streaming.md).
HEAD_CHUNK_BYTES = 256 << 20


def _trim() -> None:
    """Hands freed heap memory back to the system (glibc's malloc_trim; elsewhere nothing).
    Each layer frees arrays of the same few sizes, and glibc keeps freed chunks below its
    (growing) mmap threshold in the heap, so without this the resident size creeps up."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def _collect_young() -> None:
    """Frees the reference cycles a call just made (Python's two young generations: well under a
    millisecond). A framework may leave a layer's arrays in such a cycle (flax's nnx.merge keeps
    the state it flattens in one: a recursive closure of traversals.flatten_to_sequence), and
    Python runs its full collection by counts of objects, not bytes: left to it, several layers'
    weights were held at once, and the peak grew with depth."""
    gc.collect(1)


class CheckpointModel(OurModel):
    """torchref or jaxmodel at a policy over a checkpoint folder, not loaded: the streamed
    ladder reads the folder layer by layer (runner()), and anything else (capture, decode,
    generate) loads the whole model on first use. Its structure is checked at once.
    backend: llamaspec.plan.BACKENDS' name (None: from_pretrained's and LayerRunner's default);
    the plan is its LayerRunner's, made without loading the model."""

    def __init__(self, package: str, checkpoint, policy, backend: str | None = None):
        if package not in ("torchref", "jaxmodel"):
            raise ValueError(f"unknown implementation '{package}' (torchref or jaxmodel)")
        self.package = self.name = package
        self._backend = backend
        if backend == "reference":     # the plain reference, said where it is not the default (as OurModel)
            self.name += " (reference backend)"
        self.checkpoint = checkpoint
        self._policy = Policy.get(policy)
        self._cfg = check_checkpoint(checkpoint).config
        self.taps = tuple(tapnames.all_taps(self._cfg.num_hidden_layers))
        self._model = self._plan = None

    @property
    def model(self):
        if self._model is None:
            kw = {} if self.backend is None else {"backend": self.backend}
            self._model = importlib.import_module(self.package).from_pretrained(self.checkpoint, policy=self._policy,
                                                                                **kw)
        return self._model

    @property
    def backend(self) -> str | None:
        """The backend asked for (None: the default); OurModel's reads the loaded model's plan."""
        return self._backend

    @property
    def plan(self):
        """The plan the streamed runs compute by (the LayerRunner's), for the report's environment:
        asking it must not load the whole model (compare.environment.plan_of reads `plan` first)."""
        if self._plan is None:
            self._plan = getattr(self.runner(), "plan", None)
        return self._plan

    @property
    def cfg(self) -> LlamaConfig:
        return self._cfg

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def batch_invariant(self) -> bool:
        return False

    def float64(self, rounded_weights: bool = False) -> OurModel:
        if rounded_weights:
            return super().float64(rounded_weights)
        return CheckpointModel(self.package, self.checkpoint, "fp64", self.backend)

    def runner(self):
        """The model's LayerRunner at this policy (and backend)."""
        kw = {} if self.backend is None else {"backend": self.backend}
        return importlib.import_module(f"{self.package}.model").LayerRunner(self._cfg, self._policy, **kw)


def checkpoint_side(package: str, checkpoint, policy, backend: str | None = None) -> Side:
    at_policy = CheckpointModel(package, checkpoint, policy, backend)
    return Side(package, at_policy, at_policy.float64(), False, at_policy.taps)


def streamable(ref: Side, cand: Side) -> bool:
    """Both sides are CheckpointModels (at the policy and at fp64)."""
    return all(isinstance(x, CheckpointModel) for s in (ref, cand) for x in (s.at_policy, s.at_fp64))


@dataclasses.dataclass
class Streamed:
    """What the streamed ladder hands engine.run_ladder for its Report."""
    verdicts: list
    worst: str
    divergence: object
    local: list
    logits: dict
    seconds: dict      # wall time per run and for reading and judging
    captured: dict     # {"r", "c": the logits of that capturing run at the real positions} (capture_check)


class _Reader:
    """The checkpoint folders of the runs, each validated first as from_pretrained validates it
    (llamaspec.checkpoint.validated: tensor set, tied lm_head, NaN/Inf, read in chunks), then
    each layer's tensors read once per folder, as new arrays (no memory map left resident)."""

    def __init__(self, folders):
        self.seconds = 0.0
        self.ckpts = self._timed(lambda: {f: validated(f) for f in dict.fromkeys(str(Path(f)) for f in folders)})

    def _timed(self, fn):
        t = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds += time.perf_counter() - t

    def tensors(self, folder, keys) -> dict:
        ckpt = self.ckpts[str(Path(folder))]

        def read():
            return {k: ckpt.read_rows(k) for k in keys}
        return self._timed(read)

    def layer(self, folder, i: int) -> dict:
        prefix = f"model.layers.{i}."
        return self.tensors(folder, [k for k in self.ckpts[str(Path(folder))].keys() if k.startswith(prefix)])

    def rows(self, folder, key: str, ids: np.ndarray) -> np.ndarray:
        """table[ids] for a [vocab, hidden] tensor, reading only the rows used."""
        ckpt = self.ckpts[str(Path(folder))]

        def read():
            used = np.unique(ids)
            table = np.stack([ckpt.read_rows(key, int(t), int(t) + 1)[0] for t in used])
            return table[np.searchsorted(used, ids)]
        return self._timed(read)

    def head(self, folder, cfg: LlamaConfig, rows_per_chunk: int):
        """(start, rows) chunks of the lm_head (the embedding table when tied)."""
        key = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        ckpt = self.ckpts[str(Path(folder))]
        for start in range(0, cfg.vocab_size, rows_per_chunk):
            yield start, self._timed(lambda: ckpt.read_rows(key, start, start + rows_per_chunk))


class _Run:
    """One run of the ladder: a LayerRunner, its checkpoint folder, its hidden state."""

    def __init__(self, impl: CheckpointModel, ids, mask):
        self.label = f"{impl.name} at {impl.policy.name}"
        self.folder, self.ids, self.mask = impl.checkpoint, ids, mask
        self.runner = impl.runner()
        self.runner.start(ids, mask)
        self.h = None
        self.seconds = 0.0

    def __call__(self, method, *args):
        t = time.perf_counter()
        try:
            return getattr(self.runner, method)(*args)
        finally:
            _collect_young()
            self.seconds += time.perf_counter() - t


def _head_chunk(cfg: LlamaConfig) -> int:
    return max(1, min(cfg.vocab_size, HEAD_CHUNK_BYTES // (8 * cfg.hidden_size)))


def stream_capture(impl: CheckpointModel, ids, mask, taps=("layers.*.out",)) -> tuple[np.ndarray, dict]:
    """One implementation's capture(ids, mask, taps), walked layer by layer (the tests hold
    it bitwise equal to the loaded model's capture)."""
    cfg = impl.cfg
    names = set(tapnames.resolve(taps, cfg.num_hidden_layers))
    ids, mask = check_tokens(cfg, ids, mask)
    reader, run = _Reader([impl.checkpoint]), _Run(impl, ids, mask)
    out = {}
    h = run("embed", reader.rows(run.folder, "model.embed_tokens.weight", ids))
    out["embed"] = h
    for i in range(cfg.num_hidden_layers):
        acts = run("block", i, reader.layer(run.folder, i), h, [t for t in names if tapnames.layer_of(t) == i])
        h = acts[f"layers.{i}.out"]
        out.update(acts)
    x = run("final_norm", reader.tensors(run.folder, ["model.norm.weight"])["model.norm.weight"], h)
    out["final_norm"] = x
    logits = np.concatenate([run("logits", x, rows) for _, rows in reader.head(run.folder, cfg, _head_chunk(cfg))], -1)
    out["logits"] = logits
    return logits, {t: out[t] for t in tapnames.resolve(taps, cfg.num_hidden_layers)}


class _Judge:
    """classify each tap as it comes, in execution order, carrying the dtype noise."""

    def __init__(self, policy: Policy, real, keeps_f32: bool, taps):
        self.policy, self.real, self.keeps_f32 = policy, real, keeps_f32
        self.taps = set(taps)
        self.verdicts, self.noise_from, self.hidden = [], None, None
        self.local = {}     # teacher forcing's local verdicts of the suspects (teacher.judge_forced)
        self.seconds = 0.0

    def __call__(self, names, r, c, o, c64, o_context=None):
        context_o = {**(o_context or {}), **o}
        for t in names:
            if t in self.taps:
                v = self.verdict(t, r[t], c[t], o[t], c64[t], context_for(t, c64, context_o))
                self.metrics(v, r[t], c[t])

    def verdict(self, t, r, c, o, c64, context):
        t0 = time.perf_counter()
        v = classify(t, r, c, o, c64, self.real, self.policy, self.keeps_f32, context, self.hidden, self.noise_from)
        if v.noise_dtype and self.noise_from is None:
            self.noise_from = v
        self.verdicts.append(v)
        self.seconds += time.perf_counter() - t0
        return v

    def metrics(self, v, r, c) -> None:
        t0 = time.perf_counter()
        v.metrics = pair_metrics(c[self.real], r[self.real], tapnames.dtype_of(v.tap, self.policy))
        self.seconds += time.perf_counter() - t0


def streamed_ladder(ref: Side, cand: Side, ids, mask, policy: Policy, teacher_forcing=True,
                    progress=lambda msg: None) -> Streamed:
    """The ladder of engine.run_ladder for two streamable sides (streamable), layer by layer."""
    cfg = ref.at_policy.cfg
    ids, mask = check_tokens(cfg, ids, mask)
    real = np.asarray(mask, bool)
    taps = tuple(t for t in ref.taps if t in set(cand.taps))
    keeps_f32 = ref.keeps_f32 or cand.keeps_f32
    impls = {"r": ref.at_policy, "c": cand.at_policy, "o": ref.at_fp64, "c64": cand.at_fp64}
    reader = _Reader(impl.checkpoint for impl in impls.values())
    runs = {k: _Run(impl, ids, mask) for k, impl in impls.items()}
    judge = _Judge(policy, real, keeps_f32, taps)
    for k, run in runs.items():
        run.h = run("embed", reader.rows(run.folder, "model.embed_tokens.weight", ids))
    judge.hidden = runs["o"].h.shape[-1]
    judge(["embed"], *({"embed": runs[k].h} for k in ("r", "c", "o", "c64")))
    rows, last_o, last_forced = _layers(runs, reader, judge, cfg.num_hidden_layers, real, teacher_forcing, progress)
    agreement, captured, o_final = _head(runs, reader, judge, cfg, real, "logits" in taps, last_o, progress)
    verdicts = judge.verdicts
    settle_conventions(verdicts)     # before inherit picks the first finding
    if teacher_forcing:
        _final_local(runs, reader, judge, cfg, last_forced, {**last_o, "final_norm": o_final}, progress)
        inherit(verdicts, judge.local)
    worst, divergence = first_divergence(verdicts)
    if teacher_forcing:
        progress("teacher forcing: done with the layers (every layer was also fed the oracle's input)")
        _localise(divergence, rows, runs, reader, cfg, real, policy, keeps_f32, progress)
        amplification(rows, verdicts)
    seconds = {f"{k} ({impls[k].name} at {impls[k].policy.name})": round(run.seconds, 3) for k, run in runs.items()}
    seconds.update({"reading": round(reader.seconds, 3), "judging": round(judge.seconds, 3)})
    return Streamed(verdicts, worst, divergence, rows, agreement, seconds, captured)


def _layers(runs: dict, reader: _Reader, judge: _Judge, n: int, real, teacher_forcing: bool, progress):
    """Every layer on every run, judged on the spot (one layer's weights held at a time);
    with teacher forcing, each side's layer also fed the oracle's input: its local error.
    (rows of local errors per layer, the oracle's last layer output as context for the final norm,
    the last layer's forced runs: {"in": the oracle's input to it, run key: its forced output})"""
    prev_o = {"embed": runs["o"].h}
    rows = []     # teacher forcing's local errors, per layer
    last = {}
    t_start = t_first = time.perf_counter()
    for i in range(n):
        layer_taps = [f"layers.{i}.{k}" for k in tapnames.LAYER_TAPS]
        weights = {}
        acts, forced_in = {}, runs["o"].h
        for k, run in runs.items():
            if run.folder not in weights:
                weights[run.folder] = reader.layer(run.folder, i)
            acts[k] = run("block", i, weights[run.folder], run.h, layer_taps)
        judge(layer_taps, acts["r"], acts["c"], acts["o"], acts["c64"], prev_o)
        if teacher_forcing:
            row, t = {"layer": i}, f"layers.{i}.out"
            suspect = [v for v in suspects(judge.verdicts) if v.layer == i]
            wanted = list(dict.fromkeys([t] + forced_taps(suspect, layer_taps)))
            forced = {}
            for key, k in (("ref", "r"), ("cand", "c")):
                forced[k] = runs[k]("block", i, weights[runs[k].folder], forced_in, wanted)
                row[f"{key}_local"] = rel_l2(forced[k][t][real], acts["o"][t][real])
            rows.append(row)
            if suspect:     # are the later findings here the first one's, carried? (teacher.inherit)
                forced["c64"] = runs["c64"]("block", i, weights[runs["c64"].folder], forced_in, wanted)
                judge.local.update(judge_forced([v.tap for v in suspect], forced["r"], forced["c"],
                                                {**prev_o, **acts["o"]}, forced["c64"], real, judge.policy,
                                                judge.keeps_f32, judge.hidden))
            last = {"in": forced_in, **{k: f[t] for k, f in forced.items()}}
        for k, run in runs.items():
            run.h = acts[k][f"layers.{i}.out"]
        prev_o = {f"layers.{i}.out": runs["o"].h}
        del weights, acts
        _trim()
        now = time.perf_counter()
        if i == 0:      # the first layer's time includes compiling (jaxmodel): the estimate starts after it
            t_first, per = now, now - t_start
        else:
            per = (now - t_first) / i
        progress(f"layer {i + 1}/{n} done ({per:.1f} s per layer, about {per * (n - i - 1):.0f} s left)")
    return rows, prev_o, last


def _head(runs: dict, reader: _Reader, judge: _Judge, cfg: LlamaConfig, real, logits_tap: bool, last_o,
          progress) -> tuple[dict, dict, np.ndarray]:
    """The final norm and the lm_head on every run, judged; (logits_agreement's metrics, the
    policy runs' logits at the real positions in their own dtype, for the capture check, the
    oracle's final norm output, for teacher forcing's look at the final taps)."""
    norm, acts = {}, {}
    for k, run in runs.items():
        if run.folder not in norm:
            norm[run.folder] = reader.tensors(run.folder, ["model.norm.weight"])["model.norm.weight"]
        acts[k] = {"final_norm": run("final_norm", norm[run.folder], run.h)}
    judge(["final_norm"], acts["r"], acts["c"], acts["o"], acts["c64"], last_o)
    progress("final norm and lm_head" + (f" in chunks of {_head_chunk(cfg)} rows" if _head_chunk(cfg) < cfg.vocab_size
                                         else ""))
    logits = _logits(runs, reader, cfg, {k: acts[k]["final_norm"] for k in runs})
    captured = {k: logits[k][real] for k in ("r", "c")}
    agreement = {}
    if logits_tap:    # each copy dropped as soon as the last step that reads it is done
        v = judge.verdict("logits", logits["r"], logits["c"], logits["o"], logits.pop("c64"), {})
        judge.metrics(v, logits["r"], logits["c"])
        # logits_agreement's own selection of the real positions, made here one side at a time
        real_rows = {k: np.asarray(logits.pop(k)[real] if not real.all() else logits.pop(k), np.float64)
                     .reshape(1, -1, cfg.vocab_size) for k in ("r", "c", "o")}
        _trim()
        agreement = logits_agreement(real_rows["r"], real_rows["c"], real_rows["o"])
    del logits
    return agreement, captured, acts["o"]["final_norm"]


def _final_local(runs: dict, reader: _Reader, judge: _Judge, cfg: LlamaConfig, last: dict, o: dict,
                 progress) -> None:
    """The local verdicts of final_norm / logits when they are findings after the first one
    (teacher.suspects): as in the full ladder's forced runs, the last layer fed the oracle's
    input (_layers kept its forced outputs; the twin's is run here if it was not), then the
    final norm and (if needed) the lm_head on each run's forced output."""
    suspect = [v for v in suspects(judge.verdicts) if v.layer is None]
    if not suspect:
        return
    progress("teacher forcing: the final norm and lm_head after the last layer fed the oracle's input")
    n, keys = cfg.num_hidden_layers, ("r", "c", "c64")
    out, norm = f"layers.{n - 1}.out", {}
    forced = {}
    for k in keys:
        run = runs[k]
        if run.folder not in norm:
            norm[run.folder] = reader.tensors(run.folder, ["model.norm.weight"])["model.norm.weight"]
        h = last[k] if k in last else run("block", n - 1, reader.layer(run.folder, n - 1), last["in"], [out])[out]
        forced[k] = {"final_norm": run("final_norm", norm[run.folder], h)}
    o = dict(o)
    if any(v.tap == "logits" for v in suspect):
        logits = _logits({k: runs[k] for k in (*keys, "o")}, reader, cfg,
                         {**{k: forced[k]["final_norm"] for k in keys}, "o": o["final_norm"]})
        for k in keys:
            forced[k]["logits"] = logits[k]
        o["logits"] = logits["o"]
    judge.local.update(judge_forced([v.tap for v in suspect], forced["r"], forced["c"], o, forced["c64"],
                                    judge.real, judge.policy, judge.keeps_f32, judge.hidden))


def _logits(runs: dict, reader: _Reader, cfg: LlamaConfig, x: dict) -> dict:
    """Each run's logits [B, T, vocab] from its final_norm output x[k], the lm_head read once
    per folder, in chunks of _head_chunk rows; each run's copy of a chunk is dropped after use.
    The float64 runs go first, while fewer logits are held."""
    out = {k: None for k in runs}
    order = sorted(runs, key=lambda k: k not in ("o", "c64"))
    rows_per = _head_chunk(cfg)
    for folder in dict.fromkeys(run.folder for run in runs.values()):
        for start, head_rows in reader.head(folder, cfg, rows_per):
            for k in order:
                run = runs[k]
                if run.folder == folder:
                    part = run("logits", x[k], head_rows)
                    if rows_per >= cfg.vocab_size:
                        out[k] = part
                        continue
                    if out[k] is None:
                        out[k] = np.empty((*part.shape[:-1], cfg.vocab_size), part.dtype)
                    out[k][..., start:start + part.shape[-1]] = part
                    _trim()
            del head_rows
    return out


def _localise(divergence, rows, runs, reader, cfg, real, policy, keeps_f32, progress) -> None:
    """teacher.local_errors' divergence part: the divergence's tap kind in every layer (the
    layer's output when it starts outside the layers) fed the oracle's input, at P for a
    precision divergence (reference and candidate), at fp64 for a semantic one (the
    candidate's twin); then teacher.confirm_divergence. The tap kind is known only now, so
    this is one more pass over the layers, with the oracle giving each layer's input."""
    if divergence is None:
        return
    kind = tapnames.tap(divergence.tap).kind if divergence.layer is not None else "out"
    at = [f"layers.{i}.{kind}" for i in range(cfg.num_hidden_layers)]
    at_policy = not fp64_rule(divergence)
    forced = ("r", "c") if at_policy else ("c64",)
    progress(f"teacher forcing for the {divergence.kind} divergence: layers.i.{kind} of "
             f"{' and '.join(runs[k].label for k in forced)} fed the oracle's input, layer by layer")
    o = runs["o"]
    pos = positions_from_mask(np.asarray(o.mask))[real]
    floor, m = precision_floor(policy, cfg.hidden_size), drift_factor(policy)
    h = o("embed", reader.rows(o.folder, "model.embed_tokens.weight", o.ids))
    for i, t in enumerate(at):
        weights = {o.folder: reader.layer(o.folder, i)}
        for k in forced:
            if runs[k].folder not in weights:
                weights[runs[k].folder] = reader.layer(runs[k].folder, i)
        oracle = o("block", i, weights[o.folder], h, [t])
        got = {k: runs[k]("block", i, weights[runs[k].folder], h, [t])[t][real] for k in forced}
        ot = oracle[t][real]
        if at_policy:
            rows[i]["ref_tap_local"], rows[i]["cand_tap_local"] = rel_l2(got["r"], ot), rel_l2(got["c"], ot)
            rows[i]["tap_local_ratio"] = precision_ratio(got["r"], got["c"], ot, pos, floor, m)[0]
        else:
            rows[i]["cand64_tap_local"] = rel_l2(got["c64"], ot)
        h = oracle[f"layers.{i}.out"]
        del weights, oracle, got
        _trim()
    confirm_divergence(divergence, rows, at, policy, keeps_f32)
