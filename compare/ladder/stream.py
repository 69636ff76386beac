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

The reading and the runs are compare.adapters.streaming's (LayerReader, LayerRun, lm_head),
shared with probe where. CheckpointModel (defined there, imported here for its users) is
what prepare() makes of "torchref" / "jaxmodel": the Implementation that loads its whole
model only when asked for more than the ladder (capture, decode...).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from llamaspec import LlamaConfig, Policy, check_tokens, positions_from_mask
from llamaspec import taps as tapnames

from ..adapters import Side
from ..adapters.streaming import HEAD_CHUNK_BYTES, CheckpointModel, LayerReader, lm_head, malloc_trim
from ..judge.verdicts import classify, context_for, first_divergence, precision_ratio, settle_conventions
from ..metrics import logits_agreement, pair_metrics, rel_l2
from ..vocabulary import drift_factor, precision_floor
from .teacher import amplification, confirm_divergence, forced_taps, fp64_rule, inherit, judge_forced, suspects


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


def stream_capture(impl: CheckpointModel, ids, mask, taps=("layers.*.out",),
                   head_chunk_bytes: int = HEAD_CHUNK_BYTES) -> tuple[np.ndarray, dict]:
    """One implementation's capture(ids, mask, taps), walked layer by layer (the tests hold
    it bitwise equal to the loaded model's capture); the lm_head in chunks of head_chunk_bytes."""
    cfg = impl.cfg
    names = set(tapnames.resolve(taps, cfg))
    ids, mask = check_tokens(cfg, ids, mask)
    reader, run = LayerReader([impl.checkpoint], head_chunk_bytes), impl.layer_run(ids, mask)
    out = {}
    h = run("embed", reader.embedding(run.folder, ids))
    out["embed"] = h
    for i in range(cfg.num_hidden_layers):
        acts = run("block", i, reader.layer(run.folder, i), h, [t for t in names if tapnames.layer_of(t) == i])
        h = acts[f"layers.{i}.out"]
        out.update(acts)
    x = run("final_norm", reader.norm(run.folder), h)
    out["final_norm"] = x
    out["logits"] = logits = lm_head({"run": run}, {"run": x}, reader)["run"]
    return logits, {t: out[t] for t in tapnames.resolve(taps, cfg)}


class _Judge:
    """classify each tap as it comes, in execution order, carrying the dtype noise."""

    def __init__(self, policy: Policy, real, keeps_f32: bool, taps, cfg=None):
        self.policy, self.real, self.keeps_f32, self.cfg = policy, real, keeps_f32, cfg   # cfg: context_for's
        self.taps = set(taps)
        self.verdicts, self.noise_from, self.hidden = [], None, None
        self.local = {}     # teacher forcing's local verdicts of the suspects (teacher.judge_forced)
        self.seconds = 0.0

    def __call__(self, names, r, c, o, c64, o_context=None):
        context_o = {**(o_context or {}), **o}
        for t in names:
            if t in self.taps:
                v = self.verdict(t, r[t], c[t], o[t], c64[t], context_for(t, c64, context_o, cfg=self.cfg))
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
                    progress=lambda msg: None, head_chunk_bytes: int = HEAD_CHUNK_BYTES) -> Streamed:
    """The ladder of engine.run_ladder for two streamable sides (streamable), layer by layer;
    the lm_head in chunks of head_chunk_bytes."""
    cfg = ref.at_policy.cfg
    ids, mask = check_tokens(cfg, ids, mask)
    real = np.asarray(mask, bool)
    taps = tuple(t for t in ref.taps if t in set(cand.taps))
    keeps_f32 = ref.keeps_f32 or cand.keeps_f32
    impls = {"r": ref.at_policy, "c": cand.at_policy, "o": ref.at_fp64, "c64": cand.at_fp64}
    reader = LayerReader((impl.checkpoint for impl in impls.values()), head_chunk_bytes)
    runs = {k: impl.layer_run(ids, mask) for k, impl in impls.items()}
    judge = _Judge(policy, real, keeps_f32, taps, cfg)
    for k, run in runs.items():
        run.h = run("embed", reader.embedding(run.folder, ids))
    judge.hidden = runs["o"].h.shape[-1]
    judge(["embed"], *({"embed": runs[k].h} for k in ("r", "c", "o", "c64")))
    rows, last_o, last_forced = _layers(runs, reader, judge, cfg, real, teacher_forcing, progress)
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


def _layers(runs: dict, reader: LayerReader, judge: _Judge, cfg: LlamaConfig, real, teacher_forcing: bool,
            progress):
    """Every layer on every run, judged on the spot (one layer's weights held at a time), each with
    its family's steps (cfg.layer_steps);
    with teacher forcing, each side's layer also fed the oracle's input: its local error.
    (rows of local errors per layer, the oracle's last layer output as context for the final norm,
    the last layer's forced runs: {"in": the oracle's input to it, run key: its forced output})"""
    prev_o = {"embed": runs["o"].h}
    rows = []     # teacher forcing's local errors, per layer
    last = {}
    t_start = t_first = time.perf_counter()
    n = cfg.num_hidden_layers
    for i in range(n):
        layer_taps = [f"layers.{i}.{k}" for k in cfg.layer_steps]
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
                                                judge.keeps_f32, judge.hidden, judge.cfg))
            last = {"in": forced_in, **{k: f[t] for k, f in forced.items()}}
        for k, run in runs.items():
            run.h = acts[k][f"layers.{i}.out"]
        prev_o = {f"layers.{i}.out": runs["o"].h}
        del weights, acts
        malloc_trim()
        now = time.perf_counter()
        if i == 0:      # the first layer's time includes compiling (jaxmodel): the estimate starts after it
            t_first, per = now, now - t_start
        else:
            per = (now - t_first) / i
        progress(f"layer {i + 1}/{n} done ({per:.1f} s per layer, about {per * (n - i - 1):.0f} s left)")
    return rows, prev_o, last


def _head(runs: dict, reader: LayerReader, judge: _Judge, cfg: LlamaConfig, real, logits_tap: bool, last_o,
          progress) -> tuple[dict, dict, np.ndarray]:
    """The final norm and the lm_head on every run, judged; (logits_agreement's metrics, the
    policy runs' logits at the real positions in their own dtype, for the capture check, the
    oracle's final norm output, for teacher forcing's look at the final taps)."""
    norm, acts = {}, {}
    for k, run in runs.items():
        if run.folder not in norm:
            norm[run.folder] = reader.norm(run.folder)
        acts[k] = {"final_norm": run("final_norm", norm[run.folder], run.h)}
    judge(["final_norm"], acts["r"], acts["c"], acts["o"], acts["c64"], last_o)
    chunk = reader.head_rows(runs["r"].folder)
    progress("final norm and lm_head" + (f" in chunks of {chunk} rows" if chunk < cfg.vocab_size else ""))
    logits = _logits(runs, reader, {k: acts[k]["final_norm"] for k in runs})
    captured = {k: logits[k][real] for k in ("r", "c")}
    agreement = {}
    if logits_tap:    # each copy dropped as soon as the last step that reads it is done
        v = judge.verdict("logits", logits["r"], logits["c"], logits["o"], logits.pop("c64"), {})
        judge.metrics(v, logits["r"], logits["c"])
        # logits_agreement's own selection of the real positions, made here one side at a time
        real_rows = {k: np.asarray(logits.pop(k)[real] if not real.all() else logits.pop(k), np.float64)
                     .reshape(1, -1, cfg.vocab_size) for k in ("r", "c", "o")}
        malloc_trim()
        agreement = logits_agreement(real_rows["r"], real_rows["c"], real_rows["o"])
    del logits
    return agreement, captured, acts["o"]["final_norm"]


def _final_local(runs: dict, reader: LayerReader, judge: _Judge, cfg: LlamaConfig, last: dict, o: dict,
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
            norm[run.folder] = reader.norm(run.folder)
        h = last[k] if k in last else run("block", n - 1, reader.layer(run.folder, n - 1), last["in"], [out])[out]
        forced[k] = {"final_norm": run("final_norm", norm[run.folder], h)}
    o = dict(o)
    if any(v.tap == "logits" for v in suspect):
        logits = _logits({k: runs[k] for k in (*keys, "o")}, reader,
                         {**{k: forced[k]["final_norm"] for k in keys}, "o": o["final_norm"]})
        for k in keys:
            forced[k]["logits"] = logits[k]
        o["logits"] = logits["o"]
    judge.local.update(judge_forced([v.tap for v in suspect], forced["r"], forced["c"], o, forced["c64"],
                                    judge.real, judge.policy, judge.keeps_f32, judge.hidden, judge.cfg))


def _logits(runs: dict, reader: LayerReader, x: dict) -> dict:
    """Each run's logits [B, T, vocab] from its final_norm output x[k] (streaming.lm_head), the
    float64 runs first, while fewer logits are held."""
    return lm_head({k: runs[k] for k in sorted(runs, key=lambda k: k not in ("o", "c64"))}, x, reader)


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
    h = o("embed", reader.embedding(o.folder, o.ids))
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
        malloc_trim()
    confirm_divergence(divergence, rows, at, policy, keeps_f32)
