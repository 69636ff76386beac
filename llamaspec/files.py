"""How llama-parity writes files and names them (docs/threat-model.md).

atomic_write: every file the tool writes (reports, dumps' manifests, checkpoints, caches)
goes to a fresh temp name in the target's folder (O_EXCL | O_NOFOLLOW, so a planted
symlink is never followed), is fsynced and renamed over the target: a reader sees the old
file or the new one, never half of one, and a full disk or a kill leaves the old file in
place. A target that exists and is not a regular file (a FIFO, /dev/stdout, a pipe) is
written directly, never read or renamed.

safe_name: a string from a file (a dump's implementation or policy name) reduced to one
file-name component, so no path is built from file contents.

printable: an untrusted string with its control characters escaped, for the terminal.

refuse_inside: the one check that weights, dumps and checkpoints are never written into
the llama-parity repository (they would get committed).

json_text: the one way a report becomes JSON: strict (no NaN / Infinity tokens, which strict
parsers reject), a non-finite float written as the string "nan", "inf" or "-inf".
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np

from .errors import LlamaParityError


class WriteError(LlamaParityError, OSError):
    """A file could not be written (full disk, permissions); the message names the final path."""


def _is_special(path: Path) -> bool:
    """True for an existing target that is not a regular file (FIFO, character device, socket)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def is_regular_or_absent(path) -> bool:
    """False for a FIFO, device or socket (which must be written, never read)."""
    return not _is_special(Path(path))


def atomic_write(path, data: bytes | str | Callable[[BinaryIO], None], what: str = "file",
                 mode: int = 0o666) -> Path:
    """Writes `data` (bytes, text as UTF-8, or a function writing to a binary file) to
    `path` through a temp file in the same folder, then os.replace. On an OSError (ENOSPC,
    EACCES) the temp file is removed and a WriteError names `path`. `mode` is masked by the
    umask, as open() does. Returns the path."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    write = data if callable(data) else (lambda f: f.write(data))
    if _is_special(path):
        try:
            with open(path, "wb") as f:   # a pipe or device: written as it is, never renamed
                write(f)
        except OSError as e:
            raise WriteError(f"{what} {path}: cannot be written ({e.strerror or e})") from None
        return path
    tmp = None
    try:
        fd, tmp = _create_temp(path, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        reason = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise WriteError(f"{what} {path}: cannot be written ({reason}); nothing was left at that path") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return path


def _create_temp(path: Path, mode: int) -> tuple[int, str]:
    """A new file beside `path`, created exclusively (never an existing name or a symlink)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, f"no free temp name beside {path}")


_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def safe_name(text, fallback: str = "unnamed", limit: int = 80) -> str:
    """One file-name component from an untrusted string: runs of anything but letters,
    digits, '.', '_', '+', '-' become '-', as do runs of dots; leading dots and dashes are
    dropped (no '..', no hidden file, no option-like name); at most `limit` characters."""
    name = re.sub(r"-{2,}", "-", re.sub(r"\.{2,}", "-", _UNSAFE.sub("-", str(text))))   # no "..", no "--"
    name = name.lstrip(".-")[:limit].rstrip(".-")
    return name or fallback


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text) -> str:
    """`text` with control characters (ESC, BEL, CR, bidi overrides...) escaped as \\xNN /
    \\uNNNN, so that a string from a file cannot move the cursor, retitle the terminal or
    clear it. Newlines and tabs are kept."""
    return _CONTROL.sub(lambda m: (f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                                   else f"\\u{ord(m.group()):04x}"), str(text))


def repo_root() -> Path:
    """The llama-parity source tree (where llamaspec/ lives)."""
    return Path(__file__).resolve().parents[1]


def inside_repo(path) -> bool:
    """True when `path` (resolved, symlinks followed) lies in a git checkout of llama-parity."""
    repo = repo_root()
    return (repo / ".git").exists() and Path(path).resolve().is_relative_to(repo)


def refuse_inside(path, what: str, where_instead: str, error=LlamaParityError) -> None:
    """Raises `error` naming `path` when it lies inside the repository: weights, dumps and
    synthetic checkpoints written there would get committed."""
    if inside_repo(path):
        raise error(f"{what} {path}: inside the llama-parity repository ({repo_root()}); {where_instead}")


def json_safe(x):
    """A JSON-safe copy of x: non-finite floats as the strings "nan", "inf", "-inf" (every
    report's one rule; compare.report.page reads them back), numpy scalars and arrays as
    Python numbers and lists, tuples as lists."""
    if isinstance(x, (np.generic, np.ndarray)):
        # ml_dtypes' floats (bfloat16, fp8) are numpy's kind "V": read as float64
        return json_safe(np.asarray(x, np.float64).tolist() if x.dtype.kind == "V" else x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def json_text(obj, indent: int | None = None, default: Callable | None = None) -> str:
    """obj as strict JSON (json.dumps with allow_nan=False after json_safe); default, as
    json.dumps', turns other objects into JSON values (its results made safe too)."""
    safe_default = None if default is None else (lambda o: json_safe(default(o)))
    return json.dumps(json_safe(obj), indent=indent, default=safe_default, allow_nan=False)

