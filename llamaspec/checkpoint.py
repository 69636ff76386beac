"""Reading Hugging Face-layout safetensors checkpoints, lazily, one tensor at a time.

We parse the safetensors header ourselves (8-byte little-endian length, JSON header,
raw bytes) instead of going through a framework, for two reasons: every corruption
(truncated file, overlapping or out-of-range offsets, unknown dtype, shape that does
not match the byte span) gets an error naming the file and tensor key; and the result
is a numpy array (bf16 via ml_dtypes) that either framework can take without copies
of the whole file.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from pathlib import Path, PurePosixPath

import ml_dtypes
import numpy as np

from .budget import MAX_HEADER_BYTES, load_json, parse_json
from .config import LlamaConfig
from .errors import CheckpointError

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
FLOAT_STORAGE = ("F32", "BF16", "F16", "F64")


class _SafetensorsFile:
    """One .safetensors file: validated header, memory-mapped payload."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, "
                                          "no header)")
                (n,) = struct.unpack("<Q", raw)
                if n > MAX_HEADER_BYTES or 8 + n > size:
                    # never the length itself: it is the file's first 8 bytes (a symlink's target's)
                    beyond = "the end of the file" if n <= MAX_HEADER_BYTES else f"the {MAX_HEADER_BYTES}-byte limit"
                    raise CheckpointError(f"{path}: corrupt or truncated safetensors header "
                                          f"(header length field beyond {beyond}, file size {size})")
                header_bytes = f.read(n)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e})") from None
        try:
            header = parse_json(header_bytes, f"{path}: corrupt safetensors header", CheckpointError,
                                _no_duplicate_keys, sep=", ", not_json="not JSON")
        except _DuplicateKey as e:
            raise CheckpointError(f"{path}: corrupt safetensors header, tensor '{e}' appears twice") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        payload = size - self.data_start
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            try:
                dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
                if not all(_is_count(v) for v in (*shape, begin, end)) or not isinstance(dtype_name, str):
                    raise TypeError
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor '{key}' has a malformed header entry (it needs 'dtype', a "
                                      "name, 'shape', a list of counts, and 'data_offsets', two counts)") from None
            if dtype_name not in _DTYPES:
                raise CheckpointError(f"{path}: tensor '{key}' has unsupported dtype {dtype_name}")
            dtype = _DTYPES[dtype_name]
            count = math.prod(shape)    # exact: numpy's int64 product wraps on hostile dimensions
            if not 0 <= begin <= end or end - begin != count * dtype.itemsize:
                raise CheckpointError(f"{path}: tensor '{key}' byte range [{begin}, {end}) does not "
                                      f"match shape {list(shape)} x {dtype_name}")
            if end > payload:
                raise CheckpointError(f"{path}: truncated: tensor '{key}' ends at byte {end} but the "
                                      f"payload has only {payload} bytes")
            self.entries[key] = (dtype, tuple(int(s) for s in shape), begin, end)
        self._check_coverage(payload)
        self.size = size
        self._mmap: mmap.mmap | None = None

    def _check_coverage(self, payload: int) -> None:
        """The tensors must tile the payload exactly, as the safetensors format requires:
        no two share a byte (a tensor would silently alias another), no byte is left over
        between or after them (a file that was appended to, or written by a broken tool)."""
        spans = sorted((begin, end, key) for key, (_, _, begin, end) in self.entries.items() if end > begin)
        cursor, last = 0, None
        for begin, end, key in spans:
            if begin < cursor:
                raise CheckpointError(f"{self.path}: tensors '{last}' and '{key}' overlap (byte ranges "
                                      f"[{self.entries[last][2]}, {cursor}) and [{begin}, {end}) of the payload)")
            if begin > cursor:
                raise CheckpointError(f"{self.path}: file not fully covered: payload bytes [{cursor}, {begin}) "
                                      f"before tensor '{key}' belong to no tensor")
            cursor, last = end, key
        if cursor != payload:
            raise CheckpointError(f"{self.path}: file not fully covered: {payload - cursor} trailing bytes after "
                                  f"the last tensor (payload {payload} bytes, tensors end at {cursor})")

    def read(self, key: str) -> np.ndarray:
        """Returns a read-only view into the memory map (no copy)."""
        dtype, shape, begin, end = self.entries[key]
        if self._mmap is None:
            try:
                with open(self.path, "rb") as f:
                    if os.fstat(f.fileno()).st_size != self.size:
                        raise CheckpointError(f"{self.path}: file changed size since its header was read "
                                              f"({self.size} bytes then, {os.fstat(f.fileno()).st_size} now)")
                    self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:
                raise CheckpointError(f"{self.path}: cannot read ({e})") from None
        buf = memoryview(self._mmap)[self.data_start + begin:self.data_start + end]
        return np.frombuffer(buf, dtype=dtype).reshape(shape)

    def read_rows(self, key: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor (all of it by default) as a new array, read with a
        plain file read: no memory map keeps the pages in this process's resident set, so a
        caller that reads a model piece by piece holds only the pieces it keeps."""
        dtype, shape, begin, end = self.entries[key]
        rows = shape[0] if shape else 1
        stop = rows if stop is None else min(stop, rows)
        row_bytes = (end - begin) // rows if rows else 0
        out = np.empty((max(stop - start, 0), *shape[1:]) if shape else (), dtype)
        want = out.nbytes
        try:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + begin + start * row_bytes)
                got = f.readinto(memoryview(out.reshape(-1).view(np.uint8))) if want else 0
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read tensor '{key}' ({e})") from None
        if got != want:
            raise CheckpointError(f"{self.path}: truncated: tensor '{key}' rows [{start}, {stop}) need {want} "
                                  f"bytes, the file gave {got}")
        return out


def storage_name(dtype: np.dtype) -> str:
    """A numpy dtype as safetensors names it ("F32", "BF16", ...)."""
    return next((name for name, d in _DTYPES.items() if d == dtype), str(dtype))


def safetensors_file(path) -> _SafetensorsFile:
    """One .safetensors file's header read and checked (bounded, offsets, dtypes, shapes against
    byte spans, the payload tiled exactly, so the file's size is what its tensors need), no
    tensor data read: for readers of safetensors files that are not a checkpoint's (dumps)."""
    return _SafetensorsFile(Path(path))


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class Checkpoint:
    """A Hugging Face model folder: config.json plus one or more safetensors files.

    Tensors are read on demand with `get(key)`; nothing is loaded up front.
    """

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: checkpoint folder not found")
        self.folder = folder
        self.config = LlamaConfig.from_file(folder / "config.json")
        self._files: dict[str, _SafetensorsFile] = {}
        self._where: dict[str, str] = {}  # tensor key -> file name
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self._open_sharded(index)
        else:
            names = sorted(p.name for p in folder.glob("*.safetensors"))
            if not names:
                raise CheckpointError(f"{folder}: no *.safetensors file (and no "
                                      "model.safetensors.index.json)")
            for name in names:
                f = self._open(name)
                for key in f.entries:
                    if key in self._where:
                        raise CheckpointError(f"{folder}: tensor '{key}' appears in both "
                                              f"{self._where[key]} and {name}")
                    self._where[key] = name

    def _open(self, name: str, index: Path | None = None, key: str | None = None) -> _SafetensorsFile:
        if name not in self._files:
            path = self.folder / name
            named = "" if index is None else f" (named by {index.name} for tensor '{key}')"
            if path.exists() and not path.is_file():    # a folder, or a symlink to /dev/zero: not "not found"
                target = f" (a symlink to {os.readlink(path)})" if path.is_symlink() else ""
                raise CheckpointError(f"{path}: not a regular file{target}, so not a safetensors file{named}")
            if not path.is_file():
                raise CheckpointError(f"{path}: safetensors shard not found{named}")
            self._files[name] = _SafetensorsFile(path)
        return self._files[name]

    def _open_sharded(self, index: Path) -> None:
        doc = load_json(index, CheckpointError, what="safetensors index")
        try:
            weight_map = doc["weight_map"]
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index, needs a 'weight_map' ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object mapping tensor names "
                                  f"to shard files, got {type(weight_map).__name__}")
        for key, name in weight_map.items():
            self._check_shard_name(index, key, name)
            f = self._open(name, index, key)
            if key not in f.entries:
                raise CheckpointError(f"{index}: tensor '{key}' is mapped to {name}, which does "
                                      "not contain it")
            self._where[key] = name
        # A tensor in a shard but not in the index is refused, not ignored: index and shards
        # disagree, so which file holds the model's tensors is ambiguous (a half-rewritten
        # checkpoint), and transformers, which loads whole shards, may see a different set.
        for name, f in self._files.items():
            stray = sorted(set(f.entries) - set(weight_map))
            if stray:
                raise CheckpointError(f"{self.folder / name}: tensors {stray} are not listed in "
                                      f"{index.name}")

    def _check_shard_name(self, index: Path, key: str, name) -> None:
        """Shard names are file names inside the checkpoint folder: an absolute path or a
        '..' would read another model's weights. (A shard that is a symlink is followed:
        the Hugging Face hub cache links every file of a snapshot to a blob outside it.)"""
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{index}: tensor '{key}' is mapped to {name!r}, not a shard file name")
        parts = PurePosixPath(name.replace("\\", "/")).parts
        if PurePosixPath(name).is_absolute() or Path(name).is_absolute() or ".." in parts:
            raise CheckpointError(f"{index}: tensor '{key}' is mapped to '{name}', outside the checkpoint "
                                  f"folder {self.folder}; shard names must be files inside it")

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._files[self._where[key]].entries[key][1]

    def storage_dtype(self, key: str) -> np.dtype:
        return self._files[self._where[key]].entries[key][0]

    def exact_in(self, dtype: str) -> bool:
        """Whether every stored tensor converts to `dtype` (a policy's dtype name: "float32",
        "bfloat16", ...) without rounding: bf16 or f32 storage in float32, not f32 in bfloat16."""
        target = numpy_dtype(dtype)
        return all(np.can_cast(self.storage_dtype(k), target, "safe") for k in self.keys())

    def get(self, key: str) -> np.ndarray:
        """One tensor as a read-only numpy array in its storage dtype."""
        if key not in self._where:
            raise CheckpointError(f"{self.folder}: tensor '{key}' not in checkpoint")
        return self._files[self._where[key]].read(key)

    def read_rows(self, key: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of one tensor (all of it by default) as a new array in its
        storage dtype, read without a memory map (_SafetensorsFile.read_rows)."""
        if key not in self._where:
            raise CheckpointError(f"{self.folder}: tensor '{key}' not in checkpoint")
        return self._files[self._where[key]].read_rows(key, start, stop)

    def file_of(self, key: str) -> Path:
        return self.folder / self._where[key]


def numpy_dtype(name: str) -> np.dtype:
    """A policy's dtype name ("float32", "bfloat16", ...) as a numpy dtype (bf16 via ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, with its shape (the family's norms,
    q/k norms and biases: llamaspec.config)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    qk_norm = {"head": (hd, hd), "projection": (nq, nkv)}.get(cfg.qk_norm)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + name + ".weight": (d,) for name in cfg.norm_modules.values()})
        shapes.update({
            p + "self_attn.q_proj.weight": (nq, d),
            p + "self_attn.k_proj.weight": (nkv, d),
            p + "self_attn.v_proj.weight": (nkv, d),
            p + "self_attn.o_proj.weight": (d, nq),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })
        if qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (qk_norm[0],), p + "self_attn.k_norm.weight": (qk_norm[1],)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                           p + "self_attn.v_proj.bias": (nkv,)})
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,),
                           p + "mlp.down_proj.bias": (d,)})
    return shapes


# Keys a checkpoint may carry that hold no weights of the forward pass.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(folder: str | Path, check_finite: bool = True
                 ) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """The checkpoint validated (validated: tensor set, tied lm_head, NaN/Inf unless
    check_finite=False) and its forward pass's tensors as lazy numpy views."""
    ckpt = validated(folder, check_finite)
    return ckpt.config, {k: ckpt.get(k) for k in expected_shapes(ckpt.config)}


# validated() reads tensors in row chunks of at most this many bytes (the streamed readers'
# memory promise: validating never holds a whole embedding table).
_SCAN_BYTES = 64 << 20


def validated(folder: str | Path, check_finite: bool = True) -> Checkpoint:
    """The one validation every reader of a checkpoint goes through (load_weights, so torchref's
    and jaxmodel's from_pretrained; the streamed ladder's and `probe where`'s layer readers;
    transformers' adapter): check_checkpoint's tensor set (missing, unexpected, wrongly shaped,
    non-float tensors, all listed in one error); with tie_word_embeddings, an lm_head.weight
    that is not the embedding refused; with check_finite, NaN/Inf in any tensor of the forward
    pass refused, naming the file and tensor. Tensors are read in chunks (_SCAN_BYTES)."""
    ckpt = check_checkpoint(folder)
    if ckpt.config.tie_word_embeddings and "lm_head.weight" in ckpt.keys():
        _check_tied(ckpt)
    if check_finite:
        for key in expected_shapes(ckpt.config):
            bad = sum(int(np.size(rows) - np.isfinite(rows).sum()) for rows in _row_chunks(ckpt, key))
            if bad:
                raise CheckpointError(f"{ckpt.file_of(key)}: tensor '{key}' has {bad} NaN/Inf values")
    return ckpt


def _check_tied(ckpt: Checkpoint) -> None:
    """A tied checkpoint may carry lm_head.weight (some exporters write it) only as a copy of
    the embedding: a different one would be run by a reader that unties it and ignored by one
    that ties it."""
    lm, emb = "lm_head.weight", "model.embed_tokens.weight"
    differs = (ckpt.shape(lm) != ckpt.shape(emb)
               or ckpt.storage_dtype(lm) not in (_DTYPES[n] for n in FLOAT_STORAGE)
               or not all(np.array_equal(a, b, equal_nan=True) for a, b in
                          zip(_row_chunks(ckpt, lm, ckpt.storage_dtype(emb)),
                              _row_chunks(ckpt, emb, ckpt.storage_dtype(lm)))))
    if differs:
        raise CheckpointError(f"{ckpt.file_of(lm)}: tie_word_embeddings is true but lm_head.weight differs from "
                              f"{emb} ({list(ckpt.shape(lm))} x {ckpt.storage_dtype(lm)}, {list(ckpt.shape(emb))} x "
                              f"{ckpt.storage_dtype(emb)}); drop lm_head.weight or set tie_word_embeddings to false")


def _row_chunks(ckpt: Checkpoint, key: str, like: np.dtype | None = None):
    """A tensor's rows in chunks of at most _SCAN_BYTES (counted at the wider of its storage and
    `like`, so that the chunks of two tensors of different storage line up)."""
    shape = ckpt.shape(key)
    if not shape:
        yield ckpt.read_rows(key)
        return
    item = max(ckpt.storage_dtype(key).itemsize, like.itemsize if like is not None else 0)
    per = max(1, _SCAN_BYTES // max(1, item * int(np.prod(shape[1:], dtype=np.int64))))
    for start in range(0, shape[0], per):
        yield ckpt.read_rows(key, start, start + per)


def check_checkpoint(folder: str | Path) -> Checkpoint:
    """The checkpoint with its tensor set checked against config.json (names, shapes, float
    storage), reading no tensor data: every problem listed in one CheckpointError."""
    ckpt = Checkpoint(folder)
    cfg = ckpt.config
    _check_depth(ckpt)      # before expected_shapes lists num_hidden_layers' tensors
    want = expected_shapes(cfg)
    have = {k for k in ckpt.keys() if not k.endswith(_IGNORABLE_SUFFIXES)}
    # A tied checkpoint may still carry lm_head.weight; it must then equal the embedding.
    if cfg.tie_word_embeddings:
        have.discard("lm_head.weight")
    problems = []
    missing = sorted(set(want) - have, key=_natural)
    unexpected = sorted(have - set(want), key=_natural)
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    wrong = [f"{k}: expected {list(want[k])}, found {list(ckpt.shape(k))} in "
             f"{ckpt.file_of(k).name}" for k in sorted(have & set(want), key=_natural)
             if ckpt.shape(k) != want[k]]
    if wrong:
        problems.append("wrongly shaped tensors: " + "; ".join(wrong))
    for k in sorted(have & set(want), key=_natural):
        if ckpt.storage_dtype(k) not in (_DTYPES[n] for n in FLOAT_STORAGE):
            problems.append(f"{k}: storage dtype {ckpt.storage_dtype(k)} is not a float type")
    if problems:
        raise CheckpointError(f"{ckpt.folder}: checkpoint does not match config.json "
                              f"({cfg.num_hidden_layers} layers): " + " | ".join(problems))
    return ckpt


def _check_depth(ckpt: Checkpoint) -> None:
    """config.json's num_hidden_layers against the layers the weights hold (model.layers.<i>.*),
    before anything is made per layer: a config claiming 10**9 layers over a 2-layer checkpoint
    is named as such, not listed as 9 x 10**9 missing tensors."""
    present = {int(m.group(1)) for k in ckpt.keys() if (m := _LAYER_KEY.match(k))}
    n = ckpt.config.num_hidden_layers
    if n > len(present):
        holds = f"layers {min(present)}..{max(present)} ({len(present)} layers)" if present else "no layer"
        raise CheckpointError(f"{ckpt.folder / 'config.json'}: field 'num_hidden_layers' = {n}, but the weights "
                              f"hold {holds}")


_LAYER_KEY = re.compile(r"model\.layers\.(\d{1,12})\.")


def _natural(key: str):
    return [int(t) if t.isdigit() else t for t in key.replace(".", " . ").split()]


# The seven projection weights of a block (what weight_fp8 quantizes), by checkpoint key.
PROJECTIONS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def layer_of_key(key: str | None) -> int | None:
    """The layer index of a checkpoint key "model.layers.<i>. ...", else None."""
    m = _LAYER_KEY.match(key or "")
    return int(m.group(1)) if m else None


def is_projection(key: str | None) -> bool:
    """Whether a checkpoint key is one of a block's seven projection weights (weight_fp8's)."""
    m = _LAYER_KEY.match(key or "")
    return m is not None and key[m.end():] in PROJECTIONS
