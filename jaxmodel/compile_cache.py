"""JAX's persistent compilation cache, pointed at llama-parity's cache folder.

Without it every process compiles jaxmodel's forward and decode step again (on 2 cores,
seconds per shape: most of the demo's jaxmodel time). With it a second process loads the
compiled programs from disk. LLAMA_PARITY_JAX_CACHE=0 turns it off; a cache folder chosen
by the user for JAX itself (JAX_COMPILATION_CACHE_DIR / jax.config) is left alone.

The cached files are machine code that JAX loads, so the folder is made 0700 and used only
when it and every folder above it up to the cache root belong to this user (or root), nobody
else can write to them and none is a symlink (llamaspec.cache_trust: a sticky 1777 root may
be shared; another user's jax-compile/ sends this user to jax-compile-uid<uid>/); and it is one folder per CPU
(model and instruction-set flags), since XLA:CPU's cache key names the platform, not the CPU,
and a program compiled for AMX must not be loaded on an AVX2 laptop sharing the same home
folder. XLA_FLAGS (an --xla_cpu_max_isa cap included) are part of JAX's own key.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

ENV = "LLAMA_PARITY_JAX_CACHE"


def cpu_fingerprint() -> str:
    """A short hash of the CPU's model name and feature flags (Linux /proc/cpuinfo; the
    platform string elsewhere)."""
    text = ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        text = "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        pass
    import platform
    text += platform.machine() + platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_folder() -> Path:
    """<cache root>/jax-compile/<cpu fingerprint> (jax-compile-uid<uid>/ when another user owns
    jax-compile/ in a shared root), every folder from the root down checked by
    llamaspec.cache_trust.private_folder; CacheError (UntrustedFolder) when one fails."""
    from llamaspec.cache import cache_root
    from llamaspec.cache_trust import private_folder
    return private_folder(cache_root(), ["jax-compile", cpu_fingerprint()], per_user=True)


def enable(jax_config=None) -> Path | None:
    """Points jax.config's compilation cache at cache_folder() (created 0700) and caches every
    program, however small or quick to compile. Returns the folder, or None when it is off
    (LLAMA_PARITY_JAX_CACHE=0, a cache dir the user set for JAX, or an unusable folder: then
    a one-line warning on stderr and JAX compiles as without it)."""
    from llamaspec.plan import setting
    if setting(ENV, ("1", "on", "true", "yes", "0", "off", "false", "no"), default="1") in ("0", "off", "false", "no"):
        return None
    if jax_config is None:
        import jax
        jax_config = jax.config
    if jax_config.jax_compilation_cache_dir:
        return None
    from llamaspec.cache_trust import UntrustedFolder
    from llamaspec.errors import CacheError
    try:
        folder = cache_folder()
    except CacheError as e:
        why = f"{e} ({e.owner_and_mode()}), so a program in it could be someone else's" \
            if isinstance(e, UntrustedFolder) else str(e)
        print(f"jaxmodel: compilation cache off: {why} (set {ENV}=0 to silence this)", file=sys.stderr)
        return None
    jax_config.update("jax_compilation_cache_dir", str(folder))
    jax_config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax_config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return folder
