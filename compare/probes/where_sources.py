"""Where `probe where` gets its activations: stage by stage (embed, each layer, final norm
and logits), the target rows of every run, at the policy and from the float64 twin.

StreamSource walks torchref / jaxmodel over a checkpoint folder on the layer streamer that
compare.ladder.stream walks too (compare.adapters.streaming): each layer's tensors are read
once and handed to every run; only the runs' hidden states and the target rows of the
current stage are held, so memory does not grow with depth.
CaptureSource runs anything under the Implementation protocol (ours loaded, transformers,
a port, the batch-invariant mode) one whole capture per run, keeping the target rows and
the layer inputs of the runs that teacher forcing may need.

Both give rows(stage) -> {(run key, twin?, row): {tap: the row at every slot}} and
force(run key, twin?, layer, h) -> the layer's taps of that run with its input replaced by
h [B, W, hidden] (the protocol's inject), as {tap: [B, W, ...]}.
"""

from __future__ import annotations

import importlib
import time

import numpy as np

from llamaspec import taps as tapnames
from llamaspec.taps import input_tap

from ..adapters import fp64_policy, inject_support
from ..adapters.streaming import HEAD_CHUNK_BYTES, LayerReader, LayerRun, lm_head, malloc_trim
from .where_worker import fresh_capture


def stages(num_layers: int) -> list:
    return ["embed", *range(num_layers), "final"]


def stage_taps(stage, available) -> list[str]:
    """The tap names of one stage, in execution order, that the implementation gives."""
    if stage == "embed":
        names = ["embed"]
    elif stage == "final":
        names = ["final_norm", "logits"]
    else:
        names = [f"layers.{stage}.{k}" for k in tapnames.STEPS]
    have = set(available)
    return [n for n in names if n in have]


class _Timed:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    def timed(self, what: str, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - t


class StreamSource:
    """torchref / jaxmodel (package) at `policy` over `folder`, layer by layer, for every run
    and its float64 twin (the same rounded weights computing in float64), on the one layer
    streamer (compare.adapters.streaming: LayerReader, LayerRun, lm_head; the lm_head in
    chunks of head_chunk_bytes). patch(runner), when given, is applied to each LayerRunner at
    the policy (a planted op on its modules' .ops namespace) before it starts. seconds: each
    run's (LayerRun.seconds: teacher forcing on it included, as in the streamed ladder)."""

    def __init__(self, package: str, folder, policy, runs, rows_of: dict, patch=None,
                 head_chunk_bytes: int = HEAD_CHUNK_BYTES):
        self.reader = LayerReader([folder], head_chunk_bytes)
        self.validate_seconds = self.reader.seconds
        self.folder, self.cfg = folder, self.reader.config(folder)
        self.runs = {r.key: r for r in runs}
        self.rows_of = rows_of
        mod = importlib.import_module(f"{package}.model")
        self.layer_runs, self.h_in = {}, {}
        for r in runs:
            for twin in ((False, True) if r.twin else (False,)):
                runner = mod.LayerRunner(self.cfg, fp64_policy(policy) if twin else policy)
                if patch is not None and not twin:
                    patch(runner)
                self.layer_runs[(r.key, twin)] = LayerRun(runner, folder, r.ids, r.mask, _label((r.key, twin)))
        self.taps = tuple(tapnames.all_taps(self.cfg))
        self.weights: dict = {}

    @property
    def seconds(self) -> dict:
        return {run.label: run.seconds for run in self.layer_runs.values()}

    @property
    def read_seconds(self) -> float:
        """Seconds spent reading tensors after the folder's validation (probe_where counts
        these inside its walk)."""
        return self.reader.seconds - self.validate_seconds

    def _rows(self, acts_by_run: dict) -> dict:
        out = {}
        for (key, twin), acts in acts_by_run.items():
            for row in self.rows_of[key]:
                out[(key, twin, row)] = {t: a[row] for t, a in acts.items()}
        return out

    def rows(self, stage) -> dict:
        acts = {}
        if stage == "embed":
            for k, run in self.layer_runs.items():
                run.h = run("embed", self.reader.embedding(self.folder, run.ids))
                acts[k] = {"embed": run.h}
        elif stage == "final":
            return self._final()
        else:
            self.weights = self.reader.layer(self.folder, stage)
            names = stage_taps(stage, self.taps)
            for k, run in self.layer_runs.items():
                self.h_in[k] = run.h
                acts[k] = run("block", stage, self.weights, run.h, names)
                run.h = acts[k][f"layers.{stage}.out"]
            malloc_trim()
        return self._rows(acts)

    def _final(self) -> dict:
        self.weights = {}
        norm = self.reader.norm(self.folder)
        xs = {k: run("final_norm", norm, run.h) for k, run in self.layer_runs.items()}
        for run in self.layer_runs.values():
            run.h = None
        logits = lm_head(self.layer_runs, {k: xs[k][self.rows_of[k[0]]] for k in self.layer_runs}, self.reader)
        out = {}
        for k in self.layer_runs:
            for j, row in enumerate(self.rows_of[k[0]]):
                out[(k[0], k[1], row)] = {"final_norm": xs[k][row], "logits": logits[k][j]}
        return out

    def layer_input(self, key, twin, layer) -> np.ndarray:
        return self.h_in[(key, twin)]

    def force(self, key, twin, layer, h) -> dict:
        names = stage_taps(layer, self.taps)
        return self.layer_runs[(key, twin)]("block", layer, self.weights, h, names)

    def can_force(self, key, twin) -> bool:
        return (key, twin) in self.layer_runs


def _label(k) -> str:
    return f"{k[0]}{' (fp64 twin)' if k[1] else ''}"


def impl_key(model: str, twin: bool) -> str:
    """The impls entry a run of `model` uses: main's twin is "twin", another model's (a sharded
    one) "<model> twin"; the invariant-mode model has none (its runs are judged against A's)."""
    if not twin:
        return model
    return "twin" if model == "main" else f"{model} twin"


class CaptureSource(_Timed):
    """Whole captures of an Implementation (and of its float64 twin, of `other` for runs of
    the other model), target rows kept per stage. A fresh run is captured with its float64
    twin in a fresh process rebuilt from `spec` (where_worker.fresh_capture; under
    instruction-set cap `cap` where given: the device circumstance's capped side); records:
    {run key: that process's compare.environment record}."""

    def __init__(self, impls: dict, runs, rows_of: dict, taps, spec=None, forced_rows=(), progress=None,
                 cap: str | None = None):
        super().__init__()
        self.impls, self.runs, self.rows_of, self.taps = impls, {r.key: r for r in runs}, rows_of, tuple(taps)
        self.kept: dict = {}      # (key, twin, row) -> {tap: row}
        self.inputs: dict = {}    # (key, twin) -> {layer input tap: [B, W, hidden]}, for teacher forcing
        self.records: dict = {}   # fresh run key -> its process's compare.environment record
        for r in runs:
            if r.fresh:
                self._fresh(r, spec, cap, progress)
                continue
            for twin in ((False, True) if r.twin else (False,)):
                if progress:
                    progress(f"where: capturing {_label((r.key, twin))} ({r.rows} x {r.width})")
                impl = impls[impl_key(r.model, twin)]
                _, acts = self.timed(_label((r.key, twin)), impl.capture, r.ids, r.mask, list(self.taps))
                for row in rows_of[r.key]:
                    self.kept[(r.key, twin, row)] = {t: np.asarray(a)[row] for t, a in acts.items()}
                if (r.key, twin) in forced_rows:
                    self.inputs[(r.key, twin)] = {t: np.asarray(a) for t, a in acts.items()
                                                  if tapnames.is_layer_input(t)}
                del acts

    def _fresh(self, r, spec, cap, progress) -> None:
        what = f"{r.key}{' and its fp64 twin' if r.twin else ''}, {'a second' if cap else 'a fresh'} process"
        if progress:
            progress(f"where: capturing {what} ({r.rows} x {r.width})")
        got, self.records[r.key] = self.timed(what, fresh_capture, spec, r, self.rows_of[r.key], self.taps, cap)
        self.kept.update({(r.key, twin, row): acts for (twin, row), acts in got.items()})

    def rows(self, stage) -> dict:
        names = stage_taps(stage, self.taps)
        return {k: {t: acts[t] for t in names if t in acts} for k, acts in self.kept.items()}

    def layer_input(self, key, twin, layer) -> np.ndarray:
        return self.inputs[(key, twin)][input_tap(layer)]

    def can_force(self, key, twin) -> bool:
        return (key, twin) in self.inputs and input_tap(0) in self.inputs[(key, twin)]

    def force(self, key, twin, layer, h) -> dict:
        r = self.runs[key]
        impl = self.impls[impl_key(r.model, twin)]
        names = stage_taps(layer, self.taps)
        _, acts = self.timed("teacher forcing", impl.capture, r.ids, r.mask, names, {layer: h})
        return acts


# A decode run's cache has this many slots beyond the prompt and the step (a server's cache is
# rarely exactly full; a slot computed wrongly per row then lands on a real slot or a spare one).
DECODE_SLACK = 8


class ReplayDiffers(Exception):
    """Teacher forcing of a decode run first replays the run with its own layer inputs; when
    that replay is not the run bitwise, forcing cannot tell the layer from the replay."""



class DecodeSource(_Timed):
    """The first generated step of each decode run (where_plan.plan_decode): the
    Implementation's prefill of (ids, mask) into a cache, then one decode_capture with the
    run's step tokens, and the same on its float64 twin; the step's one new position is kept
    per target row.

    Teacher forcing replaces a layer's input in the prompt (prefill's inject) and at the step
    (decode_capture's inject), so the target row's cached keys and values are A's too. The
    prompt's layer inputs are the prefill's own where the implementation has prefill_capture
    (ours, TransformersModel), else from a capture of (ids, mask), which may round otherwise
    (a cache of other width, another compiled program). Either way force() first replays the
    run with its own inputs and raises ReplayDiffers unless that replay is the run bitwise:
    a forced run that cannot reproduce the unforced one cannot isolate a layer."""

    def __init__(self, impls: dict, runs, rows_of: dict, taps, progress=None):
        super().__init__()
        self.impls, self.runs, self.rows_of, self.taps = impls, {r.key: r for r in runs}, rows_of, tuple(taps)
        self.kept: dict = {}      # (key, twin, row) -> {tap: [1, ...]}
        self.steps: dict = {}     # (key, twin) -> {layer input tap: [B, 1, hidden]} at the step
        self.prompt: dict = {}    # (key, twin) -> {layer input tap: [B, W, hidden]}, captured when forcing asks
        self.replayed: set = set()    # (key, twin, layer) whose replay with its own inputs was the run bitwise
        for r in runs:
            for twin in ((False, True) if r.twin else (False,)):
                impl = self._impl(r, twin)
                for method in ("prefill", "decode_capture"):
                    if not callable(getattr(impl, method, None)):
                        raise TypeError(f"{getattr(impl, 'name', type(impl).__name__)}: the decode circumstance "
                                        "needs prefill(ids, mask, total_len) and decode_capture(cache, next_ids, "
                                        "taps) (compare.ladder.decode's protocol)")
                if progress:
                    progress(f"where: prefill + the first generated step, {_label((r.key, twin))} ({r.rows} x "
                             f"{r.width})")
                acts, prompt = self.timed(_label((r.key, twin)), self._step, impl, r, list(self.taps), None,
                                          [t for t in self.taps if tapnames.is_layer_input(t)])
                self.steps[(r.key, twin)] = {t: a for t, a in acts.items() if tapnames.is_layer_input(t)}
                if prompt:
                    self.prompt[(r.key, twin)] = prompt
                for row in rows_of[r.key]:
                    self.kept[(r.key, twin, row)] = {t: a[row] for t, a in acts.items()}

    def _impl(self, r, twin):
        return self.impls["twin" if twin else r.model]

    def _step(self, impl, r, taps, inject, prompt_taps=()) -> tuple[dict, dict]:
        """({tap: [B, 1, ...]} of the step after prefilling r, {tap: [B, W, ...]} of the prompt
        for prompt_taps as the prefill computed them ({} without prefill_capture)); inject
        {layer: [B, W + 1, hidden]} (prompt slots, then the step). A float64 copy that runs
        padded batches row by row (TransformersModel.unpadded_rows) decodes each row on its
        real tokens (the prompt's taps then come from a capture)."""
        if getattr(impl, "unpadded_rows", False) and not r.mask.all():
            rows = []
            for b in range(r.rows):
                cols = np.flatnonzero(r.mask[b])
                one = type(r)(r.key, r.ids[b:b + 1, cols], r.mask[b:b + 1, cols], step=r.step[b:b + 1])
                rows.append(self._step(impl, one, taps, None if inject is None else
                                       {i: h[b:b + 1, np.append(cols, r.width)] for i, h in inject.items()})[0])
            return {t: np.concatenate([x[t] for x in rows]) for t in rows[0]}, {}
        W = r.width
        pre = {} if inject is None else {"inject": {i: h[:, :W] for i, h in inject.items()}}
        prompt, cache = {}, None
        if prompt_taps and callable(getattr(impl, "prefill_capture", None)):
            try:
                _, cache, prompt = impl.prefill_capture(r.ids, r.mask, W + 1 + DECODE_SLACK, list(prompt_taps), **pre)
            except NotImplementedError:     # the batch-invariant mode: no taps in its prefill
                prompt, cache = {}, None
        if cache is None:
            _, cache = impl.prefill(r.ids, r.mask, W + 1 + DECODE_SLACK, **pre)
        at = {} if inject is None else {"inject": {i: h[:, W:] for i, h in inject.items()}}
        _, _, acts = impl.decode_capture(cache, r.step, taps, **at)
        return {t: np.asarray(a) for t, a in acts.items()}, {t: np.asarray(a) for t, a in prompt.items()}

    def rows(self, stage) -> dict:
        names = stage_taps(stage, self.taps)
        return {k: {t: acts[t] for t in names if t in acts} for k, acts in self.kept.items()}

    def layer_input(self, key, twin, layer) -> np.ndarray:
        """Layer `layer`'s input for every row of the run at every prompt slot and the step
        [B, W + 1, hidden] (the prompt's from one capture of the run, made on first use)."""
        if (key, twin) not in self.prompt:
            r = self.runs[key]
            names = [t for t in self.taps if tapnames.is_layer_input(t)]
            _, acts = self.timed("teacher forcing", self._impl(r, twin).capture, r.ids, r.mask, names)
            self.prompt[(key, twin)] = {t: np.asarray(a) for t, a in acts.items()}
        tap = input_tap(layer)
        step = self.steps[(key, twin)][tap]
        return np.concatenate([self.prompt[(key, twin)][tap].astype(step.dtype), step], 1)

    def can_force(self, key, twin) -> bool:
        r = self.runs[key]
        return (key, twin) in self.steps and input_tap(0) in self.steps[(key, twin)] and \
            inject_support(self._impl(r, twin), ("capture", "prefill", "decode_capture")) is None

    def force(self, key, twin, layer, h) -> dict:
        r, impl = self.runs[key], self._impl(self.runs[key], twin)
        names = stage_taps(layer, self.taps)
        if (key, twin, layer) not in self.replayed:     # once per run and layer, whatever asks
            own = {layer: self.layer_input(key, twin, layer)}
            replay = self.timed("teacher forcing", self._step, impl, r, names, own)[0]
            for row in self.rows_of[key]:
                kept = self.kept[(key, twin, row)]
                if not all(np.array_equal(replay[t][row], kept[t]) for t in names):
                    raise ReplayDiffers(f"{_label((key, twin))}: layer {layer} replayed with its own inputs differs")
            self.replayed.add((key, twin, layer))
        return self.timed("teacher forcing", self._step, impl, r, names, {layer: h})[0]
