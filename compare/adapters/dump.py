"""Dumps: one implementation's taps captured elsewhere, judged here (docs/dumps.md).

A dump is a folder: manifest.json (inputs, policy, config, tap list, file map, environment,
tool version, checkpoint fingerprint) and safetensors files holding the taps [B, T, ...],
one file per layer. `Dump` reads one back as an Implementation: its capture returns the
stored arrays for the stored inputs only; it takes inject only when it holds a teacher-forced
run fed the same oracle inputs; its float64 twin is our implementation built here from the
checkpoint when the dump names torchref or jaxmodel as its package.
`compare.capture` writes dumps; this module holds the format, the fingerprint and the checks.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open

from llamaspec import LlamaConfig, LlamaParityError, Policy
from llamaspec import taps as tapnames
from llamaspec.budget import MAX_HEADER_BYTES, check_bytes, load_json, parse_json, read_bounded
from llamaspec.checkpoint import safetensors_file, storage_name
from llamaspec.files import printable

from ..metrics import rel_l2, unit_roundoff
from .ours import PACKAGES, OurModel

# version 2: the manifest's field 'sha256' binds every file of the dump (version 1 had none)
FORMAT, FORMAT_VERSION, MANIFEST = "llama-parity-dump", 2, "manifest.json"
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
MANIFEST_FIELDS = ("format", "format_version", "implementation", "policy", "config", "inputs", "taps", "files",
                   "checkpoint", "sha256")


class DumpError(LlamaParityError, ValueError):
    """A dump that is malformed, or that does not match the checkpoint, inputs or policy
    it is judged with."""


def file_for(tap: str) -> str:
    """The file a tap goes to in the layout `capture` writes: embed.safetensors,
    layer-0000.safetensors ..., head.safetensors (final_norm, logits)."""
    t = tapnames.tap(tap)
    if t.layer is not None:
        return f"layer-{t.layer:04d}.safetensors"
    return "embed.safetensors" if t.kind == "embed" else "head.safetensors"


def expected_shape(tap: str, cfg: LlamaConfig, batch: int, length: int) -> tuple[int, ...]:
    """The shape every implementation gives `tap` (llamaspec.taps): [B, T, ...]."""
    kind = tapnames.tap(tap).kind
    tail = {"q": (cfg.num_attention_heads, cfg.head_dim), "q_rope": (cfg.num_attention_heads, cfg.head_dim),
            "q_norm": (cfg.num_attention_heads, cfg.head_dim), "k_norm": (cfg.num_key_value_heads, cfg.head_dim),
            "k": (cfg.num_key_value_heads, cfg.head_dim), "k_rope": (cfg.num_key_value_heads, cfg.head_dim),
            "v": (cfg.num_key_value_heads, cfg.head_dim), "attn_ctx": (cfg.num_attention_heads * cfg.head_dim,),
            "gate": (cfg.intermediate_size,), "up": (cfg.intermediate_size,), "act": (cfg.intermediate_size,),
            "logits": (cfg.vocab_size,)}.get(kind, (cfg.hidden_size,))
    return (batch, length, *tail)


# ----- checkpoint fingerprint -------------------------------------------------------------

FINGERPRINT_BLOCK = 1 << 16
FINGERPRINT_METHOD = ("v1: sha256 of config.json and of model.safetensors.index.json; per *.safetensors file its "
                      "size, the sha256 of its header bytes, and one sha256 over, for every tensor in "
                      "data-offset order, its whole byte span when <= 3 x 65536 bytes, else the 65536 bytes "
                      "at its start, middle ((length - 65536) // 2) and end")


def _sha256(path: Path) -> str:
    """sha256 of a JSON file of the checkpoint (config.json, the index), read within its bound."""
    return hashlib.sha256(read_bounded(path, DumpError, what="JSON file")).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in blocks (tap files can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_fingerprint(path: Path) -> dict:
    """FINGERPRINT_METHOD for one *.safetensors file (any in the folder, stray ones included): its
    header length bounded (MAX_HEADER_BYTES) before it is read, the header parsed as JSON with
    every failure named, the sampled blocks read within the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if n < 0 or n > MAX_HEADER_BYTES or 8 + n > size:
                # never the length itself: it is the file's first 8 bytes (a symlink's target's)
                raise DumpError(f"{path}: not a safetensors file (header length field beyond the end of the file "
                                f"or the limit, file size {size}; a header "
                                f"holds at most {MAX_HEADER_BYTES} bytes)")
            header = f.read(n)
            entries = parse_json(header, f"{path}: corrupt safetensors header", DumpError, sep=", ",
                                 not_json="not JSON")
            spans = _spans(path, entries)
            content, block = hashlib.sha256(), FINGERPRINT_BLOCK
            if spans:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    start = 8 + n
                    for b, e in spans:
                        if e - b <= 3 * block:
                            content.update(data[start + b:start + e])
                        else:
                            for at in (b, b + (e - b - block) // 2, e - block):
                                content.update(data[start + at:start + at + block])
    except OSError as e:
        raise DumpError(f"{path}: cannot read ({e.strerror or e})") from None
    return {"size": size, "header_sha256": hashlib.sha256(header).hexdigest(), "sampled_sha256": content.hexdigest()}


def _spans(path: Path, entries) -> list[tuple[int, int]]:
    """The tensors' [begin, end) data offsets, sorted: non-negative integers, begin <= end."""
    try:
        spans = sorted((e["data_offsets"][0], e["data_offsets"][1])
                       for k, e in entries.items() if k != "__metadata__")
    except (AttributeError, KeyError, TypeError, IndexError) as e:
        raise DumpError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for span in spans for v in span) or \
            any(b > e for b, e in spans):
        raise DumpError(f"{path}: corrupt safetensors header (data_offsets must be [begin, end] byte counts, "
                        "begin <= end)")
    return spans


def fingerprint(checkpoint) -> dict:
    """What identifies a checkpoint folder, cheaply (FINGERPRINT_METHOD): about 200 KB read
    per tensor, so well under a second for a 16 GB checkpoint. It tells apart the mistakes a
    dump can meet (another model, another fine-tune or seed, another conversion or storage
    dtype: every tensor differs almost everywhere, or the headers do); it is not a defence
    against an edit placed between the sampled blocks."""
    folder = Path(checkpoint)
    if not (folder / "config.json").is_file():
        raise DumpError(f"checkpoint {folder}: no config.json (not a Hugging Face model folder)")
    out = {"method": FINGERPRINT_METHOD, "config.json": _sha256(folder / "config.json")}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        out["model.safetensors.index.json"] = _sha256(index)
    out["files"] = {p.name: _file_fingerprint(p) for p in sorted(folder.glob("*.safetensors"))}
    if not out["files"]:
        raise DumpError(f"checkpoint {folder}: no *.safetensors file")
    return out


def fingerprint_differences(recorded: dict, now: dict) -> list[str]:
    """What differs between two fingerprints, one phrase each ([] when they match)."""
    if recorded.get("method") != now["method"]:
        return [f"the fingerprint method (the dump's {recorded.get('method')!r}, this version's {now['method']!r})"]
    out = [f"{name} (sha256 {recorded.get(name)} in the dump, {now.get(name)} here)"
           for name in ("config.json", "model.safetensors.index.json") if recorded.get(name) != now.get(name)]
    rec, cur = recorded.get("files") or {}, now["files"]
    for name in sorted(set(rec) | set(cur)):
        if name not in cur:
            out.append(f"{name} (in the dump's checkpoint, not in this one)")
        elif name not in rec:
            out.append(f"{name} (in this checkpoint, not in the dump's)")
        else:
            what = [f"{k.replace('_sha256', '')}" + (f" {rec[name].get(k)} vs {cur[name][k]}" if k == "size" else "")
                    for k in ("size", "header_sha256", "sampled_sha256") if rec[name].get(k) != cur[name][k]]
            if what:
                out.append(f"{name} ({', '.join(what)} differ)")
    return out


def config_field_differences(a: dict, b: dict) -> list[str]:
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


# ----- inputs and policies ------------------------------------------------------------------

def input_differences(want_ids, want_mask, ids, mask) -> str | None:
    """None when (ids, mask) equal the wanted ones; else a phrase naming the first difference."""
    want_ids, want_mask = np.asarray(want_ids), np.asarray(want_mask)
    ids = np.asarray(ids)
    mask = np.ones(ids.shape, np.int64) if mask is None else np.asarray(mask)
    for what, a, b in (("token ids", want_ids, ids), ("attention mask", want_mask, mask)):
        if a.shape != b.shape:
            return f"{what}: shape {list(b.shape)} given, the dump's is {list(a.shape)}"
        diff = np.argwhere(a != b)
        if len(diff):
            r, t = (int(x) for x in diff[0])
            return (f"{what}: first difference at row {r}, position {t} ({b[r, t]} given, {a[r, t]} in the dump; "
                    f"{len(diff)} position(s) differ)")
    return None


def policy_of(value, where: str) -> Policy:
    """A manifest's policy: a preset name or a full dict of knobs (Policy.to_dict)."""
    try:
        if isinstance(value, str):
            return Policy.get(value)
        if isinstance(value, dict):
            return Policy(**value)
    except (TypeError, LlamaParityError) as e:
        raise DumpError(f"{where}: field 'policy': {e}") from None
    raise DumpError(f"{where}: field 'policy' must be a preset name or an object of knobs, got {value!r}")


def policy_differences(a: Policy, b: Policy) -> list[str]:
    """Knobs that differ (the name is only a label)."""
    da, db = a.to_dict(), b.to_dict()
    return [f"{k}: {da[k]} vs {db[k]}" for k in da if k != "name" and da[k] != db[k]]


# ----- the dump as an Implementation ----------------------------------------------------------

class Dump:
    """A dump folder as an Implementation (name, taps, capture; float64 when the dump names
    torchref or jaxmodel as its package; supports_inject when it holds a teacher-forced run).
    Everything is checked when it is opened: the manifest's fields, every tap's file, tensor
    key, shape (from the manifest's config and inputs) and dtype.

    checkpoint: the folder to judge it with (checked against the fingerprint); without one,
    the float64 twin is built from the manifest's recorded path, checked the same way."""

    supports_inject = False
    keeps_f32 = False

    def __init__(self, path, checkpoint=None):
        self.path = Path(path)
        where = self.path / MANIFEST
        if not where.is_file():
            raise DumpError(f"dump {self.path}: no {MANIFEST} (not a llama-parity dump folder)")
        m = load_json(where, DumpError, what="manifest")     # bounded, every parser failure a DumpError
        if not isinstance(m, dict):
            raise DumpError(f"{where}: must hold a JSON object")
        if m.get("format") == FORMAT and m.get("format_version") == 1:
            raise DumpError(f"{where}: a version 1 dump, whose manifest holds no checksums of its tap files, so "
                            "they cannot be bound to it; capture it again with this version")
        missing = [f for f in MANIFEST_FIELDS if f not in m]
        if missing:
            raise DumpError(f"{where}: missing field(s) {', '.join(missing)}")
        if m["format"] != FORMAT or m["format_version"] != FORMAT_VERSION:
            raise DumpError(f"{where}: format {m['format']!r} version {m['format_version']!r}; this version reads "
                            f"{FORMAT!r} version {FORMAT_VERSION}")
        self.manifest, self.where = m, where
        self.policy = policy_of(m["policy"], str(where))
        try:
            self.cfg = LlamaConfig.from_dict(m["config"], source=f"{where} field 'config'")
        except TypeError:
            raise DumpError(f"{where}: field 'config' must be the checkpoint's config.json object") from None
        self.inputs = self._read_inputs(m["inputs"])
        impl = m["implementation"]
        self.implementation = impl.get("name") if isinstance(impl, dict) else None
        self.package = impl.get("package") if isinstance(impl, dict) else None
        if not isinstance(self.implementation, str) or not self.implementation:
            raise DumpError(f"{where}: field 'implementation' must be {{\"name\": ..., \"package\": ...}}, "
                            f"got {impl!r}")
        if self.package not in (None, *PACKAGES):
            raise DumpError(f"{where}: field 'implementation.package' is {self.package!r}: one of "
                            f"{', '.join(PACKAGES)} (a dump this tool can rebuild at float64), or null")
        self.name = f"{printable(self.implementation)} (dump)"    # the manifest's string, escaped for terminals
        self.sha256 = self._checksums(m["sha256"])
        self.taps, self.file_of = self._check_taps(m["taps"], m["files"])
        self.supports_inject = m.get("teacher_forcing") is not None
        if self.supports_inject:
            self._check_forced(m["teacher_forcing"])
        self.checkpoint = None
        if checkpoint is not None:
            self.check_checkpoint(checkpoint)

    def _read_inputs(self, inputs):
        try:
            ids = np.asarray(inputs["input_ids"])
            mask = np.asarray(inputs["attention_mask"])
        except (TypeError, KeyError, ValueError) as e:
            raise DumpError(f"{self.where}: field 'inputs' needs 'input_ids' and 'attention_mask' ([B, T] integer "
                            f"lists) ({e})") from None
        for what, a in (("input_ids", ids), ("attention_mask", mask)):
            if a.ndim != 2 or 0 in a.shape or not np.issubdtype(a.dtype, np.integer):
                raise DumpError(f"{self.where}: field 'inputs.{what}' must be a non-empty [B, T] integer array, "
                                f"got {a.dtype} of shape {list(a.shape)}")
        if ids.shape != mask.shape:
            raise DumpError(f"{self.where}: inputs.attention_mask shape {list(mask.shape)} is not inputs.input_ids' "
                            f"{list(ids.shape)}")
        return ids.astype(np.int64), mask.astype(np.int64)

    def _check_taps(self, taps, files, field="") -> tuple[tuple[str, ...], dict]:
        """Every listed tap in its file, under its own name, with the config's shape and a
        float dtype (the policy's dtype for a dump of ours). Returns (taps in execution
        order, {tap: file name}). field: '' or 'teacher_forcing.' (where the lists are)."""
        where = self.where
        if not isinstance(taps, list) or not taps or not isinstance(files, dict):
            raise DumpError(f"{where}: field '{field}taps' must be a non-empty list of tap names and '{field}files' "
                            "an object {file name: [tap names]}")
        try:
            taps = tapnames.resolve([str(t) for t in taps], self.cfg)   # execution order; unknown names refused
        except KeyError as e:
            raise DumpError(f"{where}: field '{field}taps': {e.args[0]}") from None
        listed = {t: name for name, ts in files.items() for t in (ts if isinstance(ts, list) else [])}
        unfiled = [t for t in taps if t not in listed]
        if unfiled:
            raise DumpError(f"{where}: field '{field}files' names no file for tap(s) {', '.join(unfiled[:5])}")
        file_of = {t: listed[t] for t in taps}
        B, T = self.inputs[0].shape
        for name in dict.fromkeys(file_of.values()):
            expect = {}
            for t in (t for t in taps if file_of[t] == name):
                rule = tapnames.dtype_of(t, self.policy) if self.package else None
                expect[t] = (expected_shape(t, self.cfg, B, T), rule,
                             f"{rule} ({self.package} at {self.policy.name})" if rule else None)
            self._check_file(name, expect, f"manifest.json lists it in field '{field}files'")
        return taps, file_of

    def _check_file(self, name: str, expect: dict, listed: str) -> None:
        """expect: {tensor key: (shape, dtype or None for any float, how to say the dtype)}. The file's
        header (bounded and checked by llamaspec's safetensors reader) against these shapes and
        dtypes, and its size against what they need (no byte beyond them, all within this
        machine's memory), before its sha256 is computed over it: a file that claims a terabyte
        is refused by its size, not hashed."""
        path = self._regular(name, f"{listed} for {', '.join(expect)[:200]}")
        B, T = self.inputs[0].shape
        try:
            st = safetensors_file(path)
        except LlamaParityError as e:
            raise DumpError(f"{e} ({listed})") from None
        for key, (want, rule, said) in expect.items():
            if key not in st.entries:
                raise DumpError(f"{path}: no tensor '{key}' ({listed})")
            dtype, shape, _, _ = st.entries[key]
            if shape != want:
                raise DumpError(f"{path}: tensor '{key}' has shape {list(shape)}, expected {list(want)} "
                                f"for this config and inputs ([B, T, ...], B={B}, T={T})")
            code = storage_name(dtype)
            if code not in FLOAT_DTYPES or (rule and FLOAT_DTYPES[code] != rule):
                raise DumpError(f"{path}: tensor '{key}' has dtype {code}, expected "
                                f"{said or 'a float dtype (F64, F32, F16, BF16)'}")
        need = sum(e - b for k, (_, _, b, e) in st.entries.items() if k in expect)
        extra = sorted(k for k, (_, _, b, e) in st.entries.items() if k not in expect and e > b)
        if extra:
            raise DumpError(f"{path}: holds {st.size - st.data_start - need} bytes of tensors the manifest does "
                            f"not list for it ({', '.join(extra[:5])}) ({listed})")
        check_bytes(need, f"{path}: the taps the manifest lists in it ({listed})", DumpError)
        self._check_sha256(name, path, listed)

    def _checksums(self, sums) -> dict:
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise DumpError(f"{self.where}: field 'sha256' must be an object {{file name: sha256 hex}}")
        return sums

    def _regular(self, name, listed: str) -> Path:
        """The dump's file `name`, checked: a plain file name in the dump's folder, a regular
        file (no symlink, no device). Its content is checked by _check_file."""
        path = self.path / str(name)
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise DumpError(f"{self.where}: {name!r} is a path, not a file name in the dump's folder ({listed}); "
                            "a dump's files all lie in its folder")
        if path.is_symlink():
            raise DumpError(f"{path}: is a symlink (to {os.readlink(path)}); a dump's files are its own regular "
                            f"files ({listed})")
        if not path.exists():
            raise DumpError(f"{path}: tap file not found ({listed})")
        if not path.is_file():
            raise DumpError(f"{path}: not a regular file ({listed})")
        return path

    def _check_sha256(self, name: str, path: Path, listed: str) -> None:
        """The file's sha256 against the one the manifest records for it."""
        want = self.sha256.get(name)
        if want is None:
            raise DumpError(f"{self.where}: field 'sha256' holds no checksum for {name} ({listed})")
        got = file_sha256(path)
        if got != want:
            raise DumpError(f"{path}: sha256 {got} differs from {want} in {MANIFEST}: the file was changed after "
                            "the capture (or belongs to another one); capture the dump again")

    def _check_forced(self, forcing) -> None:
        """The optional teacher-forced capture: every layer fed the oracle's input (stored,
        float64), its layer taps stored like the plain ones."""
        if not isinstance(forcing, dict) or not isinstance(forcing.get("inputs_file"), str):
            raise DumpError(f"{self.where}: field 'teacher_forcing' must be an object with 'inputs_file', 'taps' "
                            "and 'files'")
        self.forced_taps, self.forced_file_of = self._check_taps(forcing.get("taps"), forcing.get("files"),
                                                                 "teacher_forcing.")
        n = self.cfg.num_hidden_layers
        outs = [f"layers.{i}.out" for i in range(n)]
        if [t for t in outs if t not in self.forced_file_of] or any(tapnames.layer_of(t) is None
                                                                    for t in self.forced_taps):
            raise DumpError(f"{self.where}: field 'teacher_forcing.taps' must hold layer taps only, "
                            "layers.<i>.out of every layer included")
        B, T = self.inputs[0].shape
        self._check_file(forcing["inputs_file"], {f"layers.{i}.input": ((B, T, self.cfg.hidden_size), "float64",
                                                                         "F64") for i in range(n)},
                         "manifest.json names it in field 'teacher_forcing.inputs_file'")
        self.forced_inputs_file = forcing["inputs_file"]

    # -- the checks against what it is judged with

    def check_checkpoint(self, checkpoint) -> None:
        """Refuses a checkpoint whose fingerprint differs from the one recorded."""
        recorded = (self.manifest["checkpoint"] or {}).get("fingerprint") \
            if isinstance(self.manifest["checkpoint"], dict) else None
        if not isinstance(recorded, dict):
            raise DumpError(f"{self.where}: field 'checkpoint.fingerprint' is missing (compare.adapters.dump."
                            "fingerprint of the checkpoint the taps were captured from)")
        differ = fingerprint_differences(recorded, fingerprint(checkpoint))
        here = load_json(Path(checkpoint) / "config.json", DumpError, what="config.json")
        if not differ and self.manifest["config"] != here:    # the shapes were checked against the manifest's
            differ = ["the manifest's field 'config' is not the checkpoint's config.json"]
        if differ:
            extra = ""
            if self.manifest["config"] != here:
                extra = "; config fields (dump vs here): " + "; ".join(
                    config_field_differences(self.manifest["config"], here)[:6])
            raise DumpError(f"dump {self.path} was captured from another checkpoint than {checkpoint}: "
                            + "; ".join(differ[:6]) + extra)
        self.checkpoint = str(checkpoint)

    def check_policy(self, policy) -> None:
        """Refuses another policy: the ladder's floors and ULPs are the policy's, so a capture
        at bf16 judged as fp32 would read as a precision finding on every tap."""
        differ = policy_differences(self.policy, Policy.get(policy))
        if differ:
            raise DumpError(f"dump {self.path} was captured at policy {self.policy.name}, the comparison asks for "
                            f"{Policy.get(policy).name} ({'; '.join(differ)}); compare at the dump's policy")

    def recorded_checkpoint(self) -> str | None:
        c = self.manifest["checkpoint"]
        return c.get("path") if isinstance(c, dict) else None

    # -- the Implementation protocol

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        """The stored taps (and logits, when stored) for the stored inputs; with inject, the
        teacher-forced run's layer taps, when the injected inputs are the ones it was fed."""
        differ = input_differences(*self.inputs, tokens, attention_mask)
        if differ:
            raise DumpError(f"dump {self.path} holds taps for other inputs than the ones asked for: {differ}; "
                            "compare on the dump's inputs (Dump.inputs)")
        if inject:
            names = tapnames.select(taps, self.cfg, self.forced_taps if self.supports_inject
                                    else self.taps, lambda pattern, t:
                                    f"dump {self.path} holds no teacher-forced '{t}' (asked for as '{pattern}')")
            self._check_inject(inject, names)
            out = self._read(names, self.forced_file_of)
            return None, {t: out[t] for t in names}
        names = tapnames.select(taps, self.cfg, self.taps,
                                lambda pattern, t: f"dump {self.path} holds no tap '{t}' (asked for as '{pattern}')")
        out = self._read(names + (("logits",) if "logits" in self.taps and "logits" not in names else ()),
                         self.file_of)
        return out.get("logits"), {t: out[t] for t in names}   # logits whenever stored, as live models do

    def _read(self, names, file_of) -> dict:
        out = {}
        for name in dict.fromkeys(file_of[t] for t in names):
            with safe_open(self.path / name, "np") as f:
                out.update({t: f.get_tensor(t) for t in names if file_of[t] == name})
        return out

    def _check_inject(self, inject, names) -> None:
        """The stored forced run answers for the layers whose injected input equals the
        stored one to 1e-3 of the policy's unit roundoff (relative L2 over the real
        positions): a layer's taps depend on its input alone, two float64 oracles (another
        implementation, another machine) agree far closer than that, and a difference that
        size cannot move a local error measured at the policy. Every tap asked for must be
        in an injected layer (the stored run fed every layer; one not fed would continue
        from its predecessor's forced output, which is not stored)."""
        if not self.supports_inject:
            raise DumpError(f"dump {self.path}: holds no teacher-forced run (capture it with teacher_forcing=True, "
                            "--teacher-forcing), so it cannot be fed other layer inputs")
        layers = sorted({tapnames.layer_of(t) for t in names})
        outside = [t for t in names if tapnames.layer_of(t) not in inject]
        if outside:
            raise DumpError(f"dump {self.path}: asked for the forced {outside[0]}, but inject feeds layers "
                            f"{sorted(inject)} only; its teacher-forced run answers for the injected layers' taps")
        stored = self._read([f"layers.{i}.input" for i in layers],
                            {f"layers.{i}.input": self.forced_inputs_file for i in layers})
        real, tol = self.inputs[1].astype(bool), 1e-3 * unit_roundoff(self.policy.compute_dtype)
        for i in layers:
            given = np.asarray(inject[i])
            if given.shape != stored[f"layers.{i}.input"].shape:
                raise DumpError(f"dump {self.path}: injected input of layer {i} has shape {list(given.shape)}, the "
                                f"stored one {list(stored[f'layers.{i}.input'].shape)}")
            e = rel_l2(given[real], stored[f"layers.{i}.input"][real])
            if not e <= tol:
                raise DumpError(f"dump {self.path}: the input injected into layer {i} differs from the oracle input "
                                f"its teacher-forced run was fed (relative L2 {e:.1e} > {tol:.1e}); the oracle here "
                                "is not the one of the capture")

    @property
    def float64(self):
        """The dumped implementation built here at float64 from the checkpoint (torchref or
        jaxmodel dumps only: no attribute otherwise, so the ladder judges structure only)."""
        if self.package is None:
            raise AttributeError(f"a dump of {self.implementation} has no float64 twin (only a dump of torchref "
                                 "or jaxmodel loaded by name, implementation.package, is rebuilt here)")
        return self._float64

    def _float64(self) -> OurModel:
        if self.checkpoint is None:
            recorded = self.recorded_checkpoint()
            if recorded is None or not Path(recorded).is_dir():
                raise DumpError(f"dump {self.path}: its float64 twin needs the checkpoint; the recorded path "
                                f"{recorded!r} is not a folder here, so give Dump(..., checkpoint=FOLDER)")
            self.check_checkpoint(recorded)
        return OurModel.load(self.package, self.checkpoint, "fp64")


def bind_dumps(reference, candidate, checkpoint, inputs, policy):
    """(checkpoint, inputs, policy) for a comparison where either side may be a Dump: the
    dump fixes the inputs and the policy (None takes the dump's; others are refused, naming
    what differs), and the checkpoint (None takes the dump's recorded one) must match the
    dump's fingerprint. Sides that are not dumps pass through."""
    dumps = [d for d in (reference, candidate) if isinstance(d, Dump)]
    for d in dumps:
        if checkpoint is None:
            checkpoint = d.recorded_checkpoint()
            if checkpoint is None or not Path(checkpoint).is_dir():
                raise DumpError(f"dump {d.path}: give the checkpoint (the recorded path {checkpoint!r} is not a "
                                "folder here)")
        d.check_checkpoint(checkpoint)
        if policy is None:
            policy = d.policy
        d.check_policy(policy)
        if inputs is None:
            inputs = d.inputs
        else:
            given = inputs if isinstance(inputs, tuple) and len(inputs) == 2 else (inputs, None)
            if isinstance(given[0], str) or (isinstance(given[0], list) and given[0] and isinstance(given[0][0], str)):
                raise DumpError(f"dump {d.path} fixes the inputs (token ids); pass inputs=None, not prompts")
            differ = input_differences(*d.inputs, *given)
            if differ:
                raise DumpError(f"dump {d.path} was captured on other inputs: {differ}")
    return checkpoint, inputs, policy
