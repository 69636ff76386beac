"""Where llama-parity keeps what it makes outside the repository: the dequantised model
and the compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CacheError


def cache_root() -> Path:
    """$LLAMA_PARITY_CACHE, else $XDG_CACHE_HOME/llama-parity, else ~/.cache/llama-parity.
    LLAMA_PARITY_CACHE must be an absolute path (after ~): a relative one would move with the
    working directory, into a repository included; a relative XDG_CACHE_HOME is ignored, as
    the XDG specification says."""
    explicit = os.environ.get("LLAMA_PARITY_CACHE")
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_absolute():
            raise CacheError(f"LLAMA_PARITY_CACHE={explicit!r}: expected an absolute path (or unset: "
                             "$XDG_CACHE_HOME/llama-parity, else ~/.cache/llama-parity)")
        return path
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).expanduser().is_absolute() else Path.home() / ".cache"
    return base / "llama-parity"


def cache_hint() -> str:
    """Which setting chose the cache folder, and how to choose another (for error messages)."""
    explicit = os.environ.get("LLAMA_PARITY_CACHE")
    if explicit:
        return f"the cache folder comes from LLAMA_PARITY_CACHE={explicit}; point it at a writable folder"
    return f"the cache folder is the default {cache_root()}; set LLAMA_PARITY_CACHE to a writable folder"


def ensure_dir(path: Path, chosen_by: str | None = None) -> Path:
    """Creates `path` (a cache folder) and checks that it takes files; a CacheError naming
    the path and the setting that chose it (chosen_by, else $LLAMA_PARITY_CACHE or the
    default) otherwise, instead of a FileExistsError or PermissionError traceback."""
    hint = f"it comes from {chosen_by}" if chosen_by else cache_hint()
    try:
        path.mkdir(parents=True, exist_ok=True)
        _probe_write(path)
    except OSError as e:
        reason = e.strerror or str(e)
        culprit = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if culprit is not None:
            reason = f"{culprit} is a file, not a folder"
        raise CacheError(f"{path}: cannot use it as a cache folder ({reason}); {hint}") from None
    return path


def _probe_write(folder: Path) -> None:
    # a fresh random name (O_EXCL): a planted ".write-test-<pid>" symlink is never followed
    import tempfile
    with tempfile.TemporaryFile(dir=folder):
        pass
