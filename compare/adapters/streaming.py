"""torchref and jaxmodel walked over a checkpoint folder one layer at a time: the one layer
streamer of the streamed ladder (compare.ladder.stream) and of probe where
(compare.probes.where_sources).

A LayerReader validates each folder once (as from_pretrained validates it) and reads what a
step needs: a layer's tensors, the embedding rows the batch uses, the final norm, the lm_head
in vocabulary chunks. A LayerRun is one forward pass made piece by piece by the model's public
LayerRunner (start, embed, block, final_norm, logits), with its hidden state and its time.
lm_head() hands each chunk of the lm_head to every run of its folder. Only one layer's
weights are held at a time, so memory does not grow with depth (bench/stream_memory.py).

CheckpointModel is "torchref" / "jaxmodel" at a policy over a folder, not loaded: the
Implementation that makes LayerRuns, and loads its whole model only when asked for more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import importlib
import time
from pathlib import Path

import numpy as np

from llamaspec import LlamaConfig, Policy
from llamaspec import taps as tapnames
from llamaspec.checkpoint import check_checkpoint, validated

from .ours import OurModel

# The lm_head is multiplied in one piece when its widest copy (float64 for the oracle)
# fits in this many bytes, else in vocabulary chunks that do. One piece is bitwise the
# full run's product; a chunked float64 product may differ from it in the last bits
# (torch's float64 matmul sums in another order for another width; docs/streaming.md).
HEAD_CHUNK_BYTES = 256 << 20

EMBED_KEY, NORM_KEY = "model.embed_tokens.weight", "model.norm.weight"


def head_chunk(cfg: LlamaConfig, chunk_bytes: int = HEAD_CHUNK_BYTES) -> int:
    """Rows of the lm_head per chunk: as many float64 rows as fit in chunk_bytes (at least one)."""
    return max(1, min(cfg.vocab_size, chunk_bytes // (8 * cfg.hidden_size)))


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def malloc_trim() -> None:
    """Hands freed heap memory back to the system (glibc's malloc_trim; elsewhere nothing).
    Each layer frees arrays of the same few sizes, and glibc keeps freed chunks below its
    (growing) mmap threshold in the heap, so without this the resident size creeps up."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class LayerReader:
    """The checkpoint folders of the runs, each validated first as from_pretrained validates it
    (llamaspec.checkpoint.validated: tensor set, tied lm_head, NaN/Inf, read in chunks), then
    each step's tensors read once per folder, as new arrays (no memory map left resident).
    head_chunk_bytes: the lm_head's chunk size (head_chunk). seconds: the time spent reading."""

    def __init__(self, folders, head_chunk_bytes: int = HEAD_CHUNK_BYTES):
        self.seconds = 0.0
        self.head_chunk_bytes = head_chunk_bytes
        self.ckpts = self._timed(lambda: {f: validated(f) for f in dict.fromkeys(str(Path(f)) for f in folders)})

    def _timed(self, fn):
        t = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds += time.perf_counter() - t

    def _ckpt(self, folder):
        return self.ckpts[str(Path(folder))]

    def config(self, folder) -> LlamaConfig:
        return self._ckpt(folder).config

    def tensors(self, folder, keys) -> dict:
        ckpt = self._ckpt(folder)
        return self._timed(lambda: {k: ckpt.read_rows(k) for k in keys})

    def layer(self, folder, i: int) -> dict:
        """Layer i's tensors, by checkpoint key."""
        prefix = f"model.layers.{i}."
        return self.tensors(folder, [k for k in self._ckpt(folder).keys() if k.startswith(prefix)])

    def norm(self, folder) -> np.ndarray:
        """The final norm's weight."""
        return self.tensors(folder, [NORM_KEY])[NORM_KEY]

    def embedding(self, folder, ids: np.ndarray) -> np.ndarray:
        """The embedding table's rows of ids ([B, T, hidden]), reading only the rows used."""
        ckpt = self._ckpt(folder)

        def read():
            used = np.unique(ids)
            table = np.stack([ckpt.read_rows(EMBED_KEY, int(t), int(t) + 1)[0] for t in used])
            return table[np.searchsorted(used, ids)]
        return self._timed(read)

    def head_rows(self, folder) -> int:
        """Rows of the lm_head per chunk (the whole vocabulary: one piece)."""
        return head_chunk(self.config(folder), self.head_chunk_bytes)

    def head(self, folder):
        """(start, rows) chunks of the lm_head (the embedding table when tied)."""
        cfg, ckpt = self.config(folder), self._ckpt(folder)
        key = EMBED_KEY if cfg.tie_word_embeddings else "lm_head.weight"
        step = self.head_rows(folder)
        for start in range(0, cfg.vocab_size, step):
            yield start, self._timed(lambda: ckpt.read_rows(key, start, start + step))


class LayerRun:
    """One forward pass made piece by piece: a LayerRunner (patched, if at all, before this
    starts it on ids and mask), the checkpoint folder it reads, its hidden state between
    layers and the seconds spent in its calls. run("block", i, weights, h, taps) calls the
    runner's method; after each call the young generations are collected: a framework may
    leave a layer's arrays in a reference cycle (flax's nnx.merge keeps the state it
    flattens in one), and Python's full collection counts objects, not bytes: left to it,
    several layers' weights were held at once and the peak grew with depth."""

    def __init__(self, runner, folder, ids, mask, label: str):
        self.runner, self.folder, self.ids, self.mask, self.label = runner, folder, ids, mask, label
        runner.start(ids, mask)
        self.h = None
        self.seconds = 0.0

    def __call__(self, method: str, *args):
        t = time.perf_counter()
        try:
            return getattr(self.runner, method)(*args)
        finally:
            gc.collect(1)     # the two young generations: well under a millisecond
            self.seconds += time.perf_counter() - t


def lm_head(runs: dict, x: dict, reader: LayerReader) -> dict:
    """Each run's logits [..., vocab] from x[k] (its final norm's output for the rows wanted):
    the lm_head read once per folder, in the reader's chunks, each chunk handed to the runs of
    its folder in the order of `runs` (put the float64 ones first: fewer logits held then);
    a run's copy of a chunk is dropped after use. One chunk: the run's product as it is."""
    out = {}
    for folder in dict.fromkeys(run.folder for run in runs.values()):
        vocab = reader.config(folder).vocab_size
        for start, head_rows in reader.head(folder):
            for k, run in runs.items():
                if run.folder != folder:
                    continue
                part = run("logits", x[k], head_rows)
                if part.shape[-1] == vocab:
                    out[k] = part
                    continue
                if k not in out:
                    out[k] = np.empty((*part.shape[:-1], vocab), part.dtype)
                out[k][..., start:start + part.shape[-1]] = part
                malloc_trim()
            del head_rows
    return out


class CheckpointModel(OurModel):
    """torchref or jaxmodel at a policy over a checkpoint folder, not loaded: the streamed
    ladder reads the folder layer by layer (layer_run), and anything else (capture, decode,
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
        self.taps = tuple(tapnames.all_taps(self._cfg))
        self._model = self._plan = None
        self._weights = self._ckpt = None      # OurModel.weight_sources' reads, on first use

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
        # the checkpoint's values at float64; under weight_fp8, rounded and quantized as the policy
        # does (the same fp8 values and scales: the twin is the same model in exact arithmetic)
        twin = self._policy.weight_twin() if self._policy.quantizes_weights else "fp64"
        return CheckpointModel(self.package, self.checkpoint, twin, self.backend)

    def runner(self):
        """The model's LayerRunner at this policy (and backend)."""
        kw = {} if self.backend is None else {"backend": self.backend}
        return importlib.import_module(f"{self.package}.model").LayerRunner(self._cfg, self._policy, **kw)

    def layer_run(self, ids, mask) -> LayerRun:
        """A LayerRun of this model on (ids, mask) over its checkpoint."""
        return LayerRun(self.runner(), self.checkpoint, ids, mask, f"{self.name} at {self.policy.name}")
