"""rowdot.cc as a JAX op: x [M, K] @ w [N, K]^T in f32 with one fixed summation order per
output, whatever M, on XLA:CPU.

Why: XLA:CPU multiplies a single row with its own matrix-vector code and 2+ rows with
YNNPACK, in different orders, and YNNPACK takes no 1-row products (it rejects vectors).
The batch-invariant mode used to pad one-token-per-sequence calls (decode) to 2 rows,
which costs 2x: YNNPACK repacks the weights on every call. This kernel reads the weights
once per call at any row count, so a decode step gives each sequence the same bits
alone or in a batch, at about the cost of the default mode's matrix-vector product.

The C++ source is compiled on first use (g++ or $CXX, -mavx2; a few seconds) into the
llama-parity cache (llama_parity.fetch.cache_root()/kernels, one file per source and
jaxlib version) and registered as an XLA FFI target. Where that is impossible (no AVX2,
no compiler, not x86-64) `available()` is False, says why once, and callers keep XLA's
own dots.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

SOURCE = Path(__file__).with_name("rowdot.cc")
TARGET = "llama_parity_row_dot"
FLAGS = ("-O3", "-mavx2", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")


def row_dot(x, w):
    """x [M, K] @ w [N, K]^T, f32 in and out (call only when available())."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32), w.astype(jnp.float32))


@functools.cache
def available() -> bool:
    """Whether row_dot can run here: builds and registers the kernel once per process."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not _has_avx2():
        return _unavailable("it needs an x86-64 CPU with AVX2")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return _unavailable("no C++ compiler found (g++, c++ or $CXX)")
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(cxx)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.RowDot), platform="cpu")
    except (OSError, subprocess.CalledProcessError, AttributeError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        return _unavailable(f"building {SOURCE.name} failed: {detail.strip()[-2000:]}")
    return True


def state() -> str:
    """What batch-invariant decode uses in this process, for run records; never builds."""
    if available.cache_info().currsize == 0:
        return "not asked for yet in this process"
    return "rowdot.cc fixed-order kernel" if available() else "XLA dot padded to 2 rows"


def _build(cxx: str) -> Path:
    """The compiled library, from the cache when this source, jaxlib and compiler built it."""
    from llama_parity.fetch import cache_root
    key = hashlib.sha256("\n".join([SOURCE.read_text(), jax.__version__, jax.ffi.include_dir(),
                                    cxx, *FLAGS]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"rowdot-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(built)],
                           check=True, capture_output=True, text=True)
            os.replace(built, target)  # atomic: a concurrent build never loads half a file
    return target


def _has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags


def _unavailable(why: str) -> bool:
    warnings.warn(f"jaxmodel: the fixed-order row kernel is not available ({why}); batch-invariant "
                  "decode pads to 2 rows instead (same invariance, about 2x slower at batch 1)")
    return False
