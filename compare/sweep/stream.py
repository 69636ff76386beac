"""The sweep for models bigger than memory: every model (the oracle, each policy, each suggested
mixed policy) a CheckpointModel over the checkpoint folder, never loaded whole.

One walk runs every model at once, layer by layer, through the project's one layer streamer
(compare.adapters.streaming): layer i's tensors read once (LayerReader), each model's block run
on its own hidden state (a LayerRun each), then the final norm and the lm_head in chunks for all
(streaming.lm_head). Held at a time: one layer's weights, each model's hidden state and one
window's logits, flat in the text's length and in the model's depth.

- window(chunk): one walk, every model's logits of the window.
- layer_sums(names, chunk): the local errors' sums of squares (compare.sweep.layers) in a walk of
  their own: the oracle's walk gives layer i's input h_o; per residual dtype among the policies,
  h_o rounded to it (as the loaded path rounds what it injects) is fed to the oracle's block and
  to each such policy's block: the loaded path's forced captures, layer by layer.
- greedy(names, starts, new_tokens): each step one walk of every (prompt, model) on its own
  sequence (no KV cache: the whole sequence again), the last position's logits only; new_tokens
  walks in all.
"""

from __future__ import annotations

import numpy as np

from llamaspec.checkpoint import numpy_dtype
from llamaspec.generate import Sampling, choose

from ..adapters.streaming import HEAD_CHUNK_BYTES, CheckpointModel, LayerReader, LayerRun, lm_head, malloc_trim
from .layers import layer_sums, layer_taps_of, oracle_terms

GREEDY = Sampling()


class Streamer:
    """CheckpointModels by name (the oracle first) over one checkpoint folder, walked together.
    seconds: per model, the seconds of its calls; reader.seconds: the time spent reading."""

    def __init__(self, checkpoint, models: dict, head_chunk_bytes: int = HEAD_CHUNK_BYTES):
        self.checkpoint = str(checkpoint)
        self.reader = LayerReader([self.checkpoint], head_chunk_bytes)
        self.models: dict[str, CheckpointModel] = {}
        self.seconds: dict[str, float] = {}
        self._runners: dict = {}
        for name, model in models.items():
            self.add(name, model)

    def add(self, name: str, model: CheckpointModel) -> None:
        """One more model over the same folder (a suggested mixed policy)."""
        if str(model.checkpoint) != self.checkpoint:
            raise ValueError(f"{name}: over {model.checkpoint}, the streamer reads {self.checkpoint}")
        self.models[name] = model
        self.seconds.setdefault(name, 0.0)

    @property
    def layers(self) -> int:
        return next(iter(self.models.values())).cfg.num_hidden_layers

    def _run(self, key, name: str, ids: np.ndarray) -> LayerRun:
        """A LayerRun of model `name` on ids [1, T]; one LayerRunner per key, made once (the runner
        holds the contexts of the sequence it was last started on)."""
        model = self.models[name]
        if key not in self._runners:
            self._runners[key] = model.runner()
        return LayerRun(self._runners[key], model.checkpoint, ids, np.ones_like(ids),
                        f"{model.name} at {model.policy.name}")

    def _walk(self, runs: dict, names: dict, last_only: bool = False) -> dict:
        """Every run embedded, through every layer (each layer's tensors read once for all) and
        the lm_head; {key: logits}, the last position's only when last_only. names[key]: the model
        whose seconds the run adds to."""
        for run in runs.values():
            run.h = run("embed", self.reader.embedding(run.folder, run.ids))
        for i in range(self.layers):
            weights = self.reader.layer(self.checkpoint, i)
            for run in runs.values():
                run.h = run("block", i, weights, run.h)[f"layers.{i}.out"]
            del weights
            malloc_trim()
        norm, x = self.reader.norm(self.checkpoint), {}
        for k, run in runs.items():
            x[k] = run("final_norm", norm, run.h[:, -1:] if last_only else run.h)
            run.h = None
        logits = lm_head(runs, x, self.reader)
        for k, run in runs.items():
            self.seconds[names[k]] += run.seconds
        return logits

    def window(self, chunk: np.ndarray) -> dict:
        """Every model's logits [1, T, vocab] of one window (one walk)."""
        ids = chunk[None, :]
        runs = {name: self._run(name, name, ids) for name in self.models}
        return self._walk(runs, {name: name for name in runs})

    def layer_sums(self, oracle: str, names, chunk: np.ndarray) -> dict[str, list]:
        """Per policy of `names`, per layer, layers.layer_sums of its block and the oracle's, both
        from the oracle's input rounded to the policy's residual dtype (one walk)."""
        ids = chunk[None, :]
        runs = {name: self._run(name, name, ids) for name in (oracle, *names)}
        o = runs[oracle]
        by_dtype: dict[str, list] = {}
        for name in names:
            by_dtype.setdefault(self.models[name].policy.residual_dtype, []).append(name)
        rows = {name: [] for name in names}
        h = o("embed", self.reader.embedding(o.folder, ids))
        for i in range(self.layers):
            taps = layer_taps_of(i)
            weights = self.reader.layer(self.checkpoint, i)
            for dtype, group in sorted(by_dtype.items()):
                x = h.astype(numpy_dtype(dtype))
                out_o, update_o = oracle_terms(o("block", i, weights, x, taps), i)
                for name in group:
                    rows[name].append(layer_sums(runs[name]("block", i, weights, x, taps), i, out_o, update_o))
                del x, out_o, update_o
            h = o("block", i, weights, h)[f"layers.{i}.out"]
            del weights
            malloc_trim()
        for name, run in runs.items():
            self.seconds[name] += run.seconds
        return rows

    def greedy(self, names, starts, new_tokens: int, tick=lambda step: None) -> dict[str, list]:
        """Per model of `names`, per prompt of `starts`, its greedy continuation ([new_tokens] ids;
        EOS does not stop it): each step one walk of every (prompt, model) on its own sequence."""
        seqs = {(p, name): np.asarray(s, np.int64)[None, :] for p, s in enumerate(starts) for name in names}
        for step in range(new_tokens):
            runs = {key: self._run(("greedy", *key), key[1], ids) for key, ids in seqs.items()}
            logits = self._walk(runs, {key: key[1] for key in runs}, last_only=True)
            for key in seqs:
                nxt = choose(logits.pop(key)[:, -1], GREEDY, None)
                seqs[key] = np.concatenate([seqs[key], nxt[:, None]], axis=1)
            tick(step + 1)
        width = {p: len(s) for p, s in enumerate(starts)}
        return {name: [seqs[(p, name)][0, width[p]:] for p in range(len(starts))] for name in names}


def streamer(impl: str, checkpoint, policies: dict, head_chunk_bytes: int = HEAD_CHUNK_BYTES,
             backend: str | None = None) -> Streamer:
    """A Streamer of `impl` over the checkpoint at each policy of {name: Policy}, the oracle first,
    each on `backend` (None: the default)."""
    return Streamer(checkpoint, {name: CheckpointModel(impl, checkpoint, p, backend) for name, p in policies.items()},
                    head_chunk_bytes)
