"""Where llama-parity keeps what it makes outside the repository: the dequantised model
and the compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$LLAMA_PARITY_CACHE, else $XDG_CACHE_HOME/llama-parity, else ~/.cache/llama-parity."""
    explicit = os.environ.get("LLAMA_PARITY_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "llama-parity"
