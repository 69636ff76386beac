"""What the command line checks before it loads a model: argument values, the checkpoint
folder, and every output path, so that a typo costs a second and a finished run is never
lost to a path that cannot be written."""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

from llamaspec import LlamaParityError
from llamaspec.budget import read_bounded


class UsageError(LlamaParityError):
    """A bad argument, path or input: exit code 2, one line, no traceback."""


# ----- argparse types (argparse turns ArgumentTypeError into "error: argument X: ...", exit 2)

def _int_at_least(text: str, low: int, rule: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} must be {rule}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "at least 1")


def count(text: str) -> int:
    """A non-negative integer (0 allowed: 'none of these')."""
    return _int_at_least(text, 0, "0 or more")


def positive_ints(text: str) -> list[int]:
    """'2,3,8' -> [2, 3, 8]: a comma list of positive integers, at least one."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of positive integers, e.g. 2,4,8")
    return [positive_int(p) for p in parts]


def shape(text: str) -> tuple[int, int]:
    """'2x64' -> (2, 64): batch rows x tokens, both at least 1."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not BxT (rows x tokens), e.g. 2x64")
    b, t = int(m.group(1)), int(m.group(2))
    if b < 1 or t < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: rows and tokens must both be at least 1")
    return b, t


# ----- the checkpoint folder ------------------------------------------------------------

def checkpoint_folder(path, need_tokenizer: str | None = None) -> str:
    """The folder, checked: it exists, is a folder and holds config.json (and tokenizer.json
    when `need_tokenizer` says why one is needed)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"checkpoint {p}: no such folder")
    if not p.is_dir():
        raise UsageError(f"checkpoint {p}: is a file, not a folder (give the folder that holds "
                         "config.json and the .safetensors files)")
    # lexists, not is_file: a FIFO, a device or a dangling link is present, and its reader
    # names it ("not a regular file") instead of this check calling it absent
    if not os.path.lexists(p / "config.json"):
        raise UsageError(f"checkpoint {p}: no config.json in this folder (not a Hugging Face model folder)")
    if need_tokenizer and not os.path.lexists(p / "tokenizer.json"):
        raise UsageError(f"checkpoint {p}: no tokenizer.json, which {need_tokenizer}")
    return str(p)


# ----- output paths ---------------------------------------------------------------------

def _ours(path: Path) -> bool:
    """A file this tool wrote: a JSON report (ladder, probes or sweep) or one of its HTML pages.
    Read within MAX_JSON_BYTES (a larger or unreadable file, a FIFO: not ours)."""
    from compare.report.page import GENERATOR
    try:
        if path.suffix.lower() in (".html", ".htm"):
            return f"content='{GENERATOR}'" in path.read_bytes()[:4096].decode("utf-8", "replace")
        doc = json.loads(read_bounded(path, LlamaParityError))
    except (OSError, ValueError, LlamaParityError):
        return False
    if not isinstance(doc, dict):
        return False
    report = "verdict" in doc and ({"reference", "candidate"} <= set(doc) or "results" in doc)
    sweep = {"impl", "policies", "rows", "environment"} <= set(doc)      # compare.sweep.SweepResult
    return report or sweep


def _writable_folder(folder: Path, what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{what}: {folder} exists and is not a folder") from None
    except OSError as e:
        raise UsageError(f"{what}: cannot create the folder {folder}: {e.strerror}") from None
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UsageError(f"{what}: cannot write in {folder}: {e.strerror}") from None


def output_file(path, what: str, force: bool = False, say=print) -> Path:
    """A file the run will write, checked before the run: not a folder, its folder created
    and writable. An existing file is overwritten when this tool wrote it (said so), and
    otherwise only with force."""
    from llamaspec.files import is_regular_or_absent
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{what} {p}: is a folder; give a file path, e.g. {p / ('report' + (p.suffix or '.json'))}")
    if not is_regular_or_absent(p):     # a pipe, FIFO or /dev/stdout: written to, never read (it would block)
        return p
    _writable_folder(p.parent, f"{what} {p}")
    if p.exists():
        if not force and not _ours(p):
            raise UsageError(f"{what} {p}: the file exists and was not written by llama-parity; pass "
                             "--force to overwrite it, or choose another path")
        say(f"{what}: {p} exists; it will be overwritten")
    _CHECKED[str(p)] = _state(p)
    return p


_CHECKED: dict[str, tuple | None] = {}   # output path -> (inode, mtime, size) when output_file checked it


def _state(p: Path) -> tuple | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def unchanged_or_beside(path, say=print) -> Path:
    """Where to write a report output_file checked: `path` when nobody wrote it since the
    check; else (another run wrote it meanwhile) a sibling name with this process's id, said
    so, so that neither run's report is silently lost."""
    p = Path(path)
    if str(p) not in _CHECKED or _CHECKED[str(p)] == _state(p) or not p.is_file():
        return p
    import os
    other = p.with_name(f"{p.stem}.{os.getpid()}{p.suffix}")
    say(f"warning: {p} was written by another run while this one ran; this run's report goes to {other}")
    return other


def output_folder(path, what: str) -> Path:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{what} {p}: is a file, not a folder")
    _writable_folder(p, f"{what} {p}")
    return p


def check_target_folder(folder: Path, force: bool) -> None:
    """make-checkpoint's folder: new, empty, or a checkpoint llama-parity wrote (its
    llamaspec.shapes.MARKER file) and --force; a folder holding anything else (a user's
    weights and notes) is refused even with --force, naming what is there."""
    from llamaspec.shapes import MARKER
    folder = Path(folder)
    if not folder.is_dir():
        return
    present = sorted(p.name for p in folder.iterdir())
    if not present:
        return
    if not (folder / MARKER).is_file():
        raise UsageError(f"{folder}: the folder is not empty ({', '.join(present[:5])}"
                         f"{', ...' if len(present) > 5 else ''}) and llama-parity did not write it (no {MARKER}); "
                         "choose a new or empty folder")
    if not force:
        try:
            complete = json.loads((folder / MARKER).read_text()).get("complete", True)
        except (OSError, ValueError, AttributeError):
            complete = True
        what = "a checkpoint" if complete else "an unfinished checkpoint (a run cut short)"
        raise UsageError(f"{folder}: holds {what} already; pass --force to write it again")


def check_token_budget(batch: int, length: int, max_positions: int, vocab: int) -> None:
    """--random-tokens BxT checked before anything is allocated (llamaspec.budget.check_tokens: T
    within the model's max_position_embeddings, one float64 logits array [B, T, vocab] within
    this machine's memory)."""
    from llamaspec.budget import check_tokens
    check_tokens(batch, length, max_positions, vocab, f"--random-tokens {batch}x{length}", UsageError)
