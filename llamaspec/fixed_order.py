"""The fixed-order kernels (fixed_order.h) for the batch-invariant mode, through ctypes.

Each result is defined by a scalar program: a matrix product sums every output as one
fused multiply-add chain over k in ascending order (bf16 by bf16: k in pairs, the odd one
first, denormals flushed, which is what AVX-512-BF16's vdpbf16ps computes); row sums likewise; exp is one fixed
polynomial program per element. The AVX-512, AVX2+FMA and scalar code paths compute
that program exactly, so a row's result cannot depend on the row count, the other rows,
the thread count or the CPU. Why the batch-invariant mode needs this, and what it costs:
docs/invariance.md.

The C++ source is compiled on first use with g++ (or $CXX) into the llama-parity cache
(cache_root()/kernels, created 0700, one file per source, compiler and flags, with its
sha256 beside it: a damaged file is rebuilt, never loaded; a file or folder another user
owns or can write is refused before dlopen, docs/threat-model.md). $LLAMA_PARITY_KERNEL_ISA = scalar | avx2 |
avx512 | avx512_bf16 caps the code path (auto: the widest this CPU runs), so one machine can run every
path; the results are the same bits on all of them.

Framework-neutral: functions take numpy arrays or raw pointers (torchref passes its
tensors' data pointers; jaxmodel compiles the same header into an XLA FFI target).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

from .cache import cache_hint, cache_root
from .cache_trust import UntrustedFolder, private_folder
from .errors import CacheError, InvarianceError
from .interrupts import run_child, scratch_folder, sweep_scratch

HERE = Path(__file__).parent
SOURCE = HERE / "fixed_order.cc"
HEADER = HERE / "fixed_order.h"
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c++17", "-shared", "-fPIC", "-pthread")
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3}
ISA_NAMES = {level: name for name, level in ISAS.items()}
WTYPES = {"float32": 0, "bfloat16": 1, "float16": 2, "float64": 3}
BF16_PAIRS = 4  # bf16 weights packed for the pair program (x bf16 too): vdpbf16ps's order
PANEL = 16


class NoCompiler(InvarianceError):
    """No C++ compiler to build the fixed-order kernels with (the message names the one tried)."""


_WITHOUT = ("the fixed-order kernels (llamaspec/fixed_order.cc) are compiled on first use; without them the fast "
            "backends run their framework's ops and the invariant backends their portable path")


def compiler() -> str:
    """$CXX when set (a name on PATH or a path), else g++ or c++ on PATH: NoCompiler naming what
    was tried when it is not an executable file."""
    given = os.environ.get("CXX")
    if given:
        if shutil.which(given) is None:
            raise NoCompiler(f"no C++ compiler: CXX={given} is not an executable file ({_WITHOUT}; set CXX to a "
                             "C++17 compiler, or unset it to use g++ or c++ from PATH)")
        return given
    found = shutil.which("g++") or shutil.which("c++")
    if found is None:
        raise NoCompiler(f"no C++ compiler: CXX is not set and neither g++ nor c++ is on PATH ({_WITHOUT}; install "
                         "g++ or set CXX)")
    return found


@functools.cache
def kernels_unavailable(error: str) -> None:
    """The one warning of a process whose kernels cannot be had, whichever model asked first
    (each plan records the reason as its kernel_error)."""
    said = "" if _WITHOUT in error else f" ({_WITHOUT})"
    warnings.warn(f"llama-parity: the fixed-order kernels are not available: {error}{said}; each model's plan "
                  "records this as its kernel_error, in every report", RuntimeWarning, stacklevel=2)


def kernel_dir() -> Path:
    """cache_root()/kernels, created 0700: only this user may put a library there. When that
    folder belongs to another user (two users sharing one LLAMA_PARITY_CACHE), this user's
    libraries go to cache_root()/kernels-uid<uid> instead; neither user loads the other's.
    Every folder from the cache root down is checked by llamaspec.cache_trust (owned by this
    user or root, writable by nobody else, no symlink; a sticky 1777 root may be shared)."""
    try:
        return private_folder(cache_root(), ["kernels"], per_user=True)
    except UntrustedFolder as e:
        raise InvarianceError(f"{e}, so a library in it could be someone else's code; nothing is loaded from it "
                              f"({e.owner_and_mode()}; remove it, or chmod go-w it if it is yours); "
                              + cache_hint()) from None
    except CacheError as e:
        raise InvarianceError(f"{e}; " + cache_hint()) from None


def _untrusted(st: os.stat_result, what: str) -> str | None:
    """Why a kernel library or its sidecar (lstat / fstat) could hold code this user did not
    build: not a regular file, another owner, or writable by group or others. None when only
    this user can have written it. (Folders: llamaspec.cache_trust.)"""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a symlink or a device)"
    if st.st_uid != os.geteuid():
        return f"the {what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"the {what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def build(name: str, sources: list[Path], extra_flags: tuple[str, ...] = (), key_parts: tuple[str, ...] = (),
          rebuild: bool = False) -> Path:
    """Compiles `sources` (plus fixed_order.h) into kernel_dir()/<name>-<key>.so once; the
    key covers the sources, compiler, flags and key_parts. The file's sha256 is kept beside
    it, and the file is checked before every load (load_checked): owned by this user and
    writable by nobody else (trust), that sha256 and an ELF layout whose segments all lie
    inside the file (damage: dlopen would map a truncated file and die on it with SIGBUS).
    A damaged library is rebuilt, with one warning; a foreign one is an error. Writes are
    atomic (a private temp folder in the same folder, then os.replace)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise InvarianceError(f"the fixed-order kernels are written for x86-64; this machine is "
                              f"{platform.machine()}")
    try:
        cxx = compiler()
    except NoCompiler as e:
        _FAILED["compiler"] = e     # for state(); cheap to find again, so not cached
        raise
    target = library_path(name, sources, extra_flags, key_parts)
    if str(target) in _FAILED and not rebuild:      # tried once in this process: not again at every load
        raise _FAILED[str(target)]
    try:
        return _build(cxx, target, sources, extra_flags, rebuild)
    except InvarianceError as e:
        _FAILED[str(target)] = e
        raise


_FAILED: dict[str, InvarianceError] = {}     # library path (or "compiler") -> why this process could not build it


def _build(cxx: str, target: Path, sources: list[Path], extra_flags: tuple[str, ...], rebuild: bool) -> Path:
    digest = target.with_name(target.name + ".sha256")
    if not rebuild:
        problem = _cached_problem(target, digest)
        if problem is None:
            return target
        if problem:
            warnings.warn(f"{target}: {problem}; rebuilding it", RuntimeWarning, stacklevel=2)
    # once per machine and version, seconds: say so, or a first call looks hung
    print(f"llama-parity: compiling {', '.join(p.name for p in sources)} into {target.parent} (once)",
          file=sys.stderr, flush=True)
    # a build killed with -9 leaves its .build-<pid>@<host>-* folder: removed once its process is gone
    sweep_scratch(target.parent, r"\.build-")
    try:
        with scratch_folder(target.parent, ".build-") as tmp:
            built = Path(tmp) / target.name
            # in its own process group, ended whole (cc1plus, as, ld too) if this process is interrupted
            run_child([cxx, *FLAGS, *extra_flags, "-I", str(HERE), *map(str, sources), "-o", str(built)], check=True)
            os.chmod(built, 0o700)
            sha = _sha256(built)
            (Path(tmp) / "sha").write_text(sha + "\n")
            # The sidecar first: a reader that finds the new sidecar next to no file (or
            # the old, damaged one) rebuilds; the library itself appears in one rename.
            os.replace(Path(tmp) / "sha", digest)
            os.replace(built, target)
            _BUILT[str(target)] = sha
    except subprocess.CalledProcessError as e:
        errors = [line for line in e.stderr.splitlines() if any(w in line for w in ("error", "No space", "fatal"))]
        raise InvarianceError(f"compiling {', '.join(p.name for p in sources)} with {cxx} failed:\n"
                              + "\n".join((errors or e.stderr.splitlines()[-20:])[:20])) from None
    except FileNotFoundError as e:
        if e.filename == cxx:       # the compiler went away after compiler() found it
            raise NoCompiler(f"no C++ compiler: {cxx} cannot be run ({e.strerror}; {_WITHOUT})") from None
        raise InvarianceError(f"{target.parent}: cannot write the compiled kernel there ({e}); "
                              + cache_hint()) from None
    except OSError as e:
        raise InvarianceError(f"{target.parent}: cannot write the compiled kernel there ({e}); "
                              + cache_hint()) from None
    return target


def library_path(name: str, sources: list[Path], extra_flags: tuple[str, ...] = (),
                 key_parts: tuple[str, ...] = ()) -> Path:
    """kernel_dir()/<name>-<key>.so, the key a sha256 of the sources, compiler and flags."""
    texts = [p.read_text() for p in (*sources, HEADER)]
    key = hashlib.sha256("\n".join([*texts, compiler(), *FLAGS, *extra_flags, *key_parts]).encode()).hexdigest()[:16]
    return kernel_dir() / f"{name}-{key}.so"


_BUILT: dict[str, str] = {}   # library path -> sha256 of what this process compiled there


def load(name: str, sources: list[Path], extra_flags: tuple[str, ...] = (), key_parts: tuple[str, ...] = ()
         ) -> ctypes.CDLL:
    """build(), then dlopen of the checked file. A checked file that still fails to load is
    rebuilt once (one warning); a fresh build that fails to load is an InvarianceError, never
    a crash."""
    path = build(name, sources, extra_flags, key_parts)
    try:
        return load_checked(path)
    except OSError as e:
        warnings.warn(f"{path}: cannot be loaded ({e}); rebuilding it", RuntimeWarning, stacklevel=2)
    path = build(name, sources, extra_flags, key_parts, rebuild=True)
    try:
        return load_checked(path)
    except OSError as e:
        raise InvarianceError(f"{path}: freshly built, but cannot be loaded ({e})") from None


def load_checked(path: Path) -> ctypes.CDLL:
    """dlopen of `path` through a file descriptor opened without following symlinks and
    checked (fstat) before: the bytes loaded are those of the file whose owner, mode and
    sha256 were checked, whatever happens to the name meanwhile. InvarianceError for a
    library someone else could have written (never loaded); OSError from dlopen."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        problem = _untrusted(os.fstat(fd), "library")
        expected = _BUILT.get(str(path)) or _sidecar(path)
        if problem is None and hashlib.sha256(_read_fd(fd)).hexdigest() != expected:
            problem = f"its sha256 is not the one recorded when it was built ({path.name}.sha256)"
        if problem:
            raise InvarianceError(f"{path}: {problem}; not loaded (only a library this user built is run)")
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path))
    except BaseException:
        os.close(fd)
        raise
    # The descriptor stays open: dlopen knows the library by the name /proc/self/fd/<fd>, and
    # a later library opened on a reused number would be taken for this one.
    _LOADED_FDS.append(fd)
    return lib


_LOADED_FDS: list[int] = []


def _read_fd(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _sidecar(path: Path) -> str | None:
    """The sha256 recorded beside `path`, when the sidecar is this user's and nobody else's to write."""
    digest = path.with_name(path.name + ".sha256")
    try:
        fd = os.open(digest, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if _untrusted(os.fstat(fd), "library") is not None:
            return None
        return _read_fd(fd).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def _cached_problem(target: Path, digest: Path) -> str | None:
    """None when the cached library can be loaded; "" when it must be built (absent, or
    from before sha256 sidecars); else what is wrong with it. A library or sidecar that is
    not this user's alone is an InvarianceError: rebuilding over it would hide the plant."""
    try:
        if not os.path.lexists(target) or not os.path.lexists(digest):
            return ""
        for p, what in ((target, "library"), (digest, "sidecar")):
            problem = _untrusted(p.lstat(), what)
            if problem:
                raise InvarianceError(f"{p}: {problem}; not loaded (only a library this user built is run): "
                                      f"remove it, or give LLAMA_PARITY_CACHE a folder of your own")
        size = target.stat().st_size
        if digest.read_text().strip() != _sha256(target):
            return f"sha256 differs from the one in {digest.name} (damaged or truncated: {size} bytes)"
        return _elf_problem(target, size)
    except OSError as e:
        return f"cannot be read ({e})"


def _elf_problem(path: Path, size: int) -> str | None:
    """A 64-bit little-endian ELF whose program headers, loaded segments and section
    headers all lie inside the file; else why not. dlopen maps segments without checking
    the file's length, and touching a page past the end kills the process (SIGBUS)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return f"not a 64-bit ELF shared library ({size} bytes)"
        phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
        if phentsize < 56 or phoff + phnum * phentsize > size:
            return f"truncated: its program headers end past the file's {size} bytes"
        f.seek(phoff)
        table = f.read(phnum * phentsize)
    for i in range(phnum):
        p_type, = struct.unpack_from("<I", table, i * phentsize)
        p_offset, = struct.unpack_from("<Q", table, i * phentsize + 8)
        p_filesz, = struct.unpack_from("<Q", table, i * phentsize + 32)
        if p_type == 1 and p_offset + p_filesz > size:  # PT_LOAD
            return f"truncated: a loaded segment ends at byte {p_offset + p_filesz}, the file has {size}"
    if shoff + shnum * shentsize > size:
        return f"truncated: its section headers end at byte {shoff + shnum * shentsize}, the file has {size}"
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class KernelSettingError(InvarianceError, ValueError):
    """$LLAMA_PARITY_KERNEL_ISA set to a code path that does not exist: a bad setting, never
    "the kernels are not available" (the plans refuse it rather than run without them)."""


def requested_isa() -> str:
    """$LLAMA_PARITY_KERNEL_ISA, checked ('auto' when unset)."""
    from .plan import setting
    return setting("LLAMA_PARITY_KERNEL_ISA", ("auto", *ISAS), error=KernelSettingError)


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernels, on the code path $LLAMA_PARITY_KERNEL_ISA asks for."""
    lib = load("fixed_order", [SOURCE])
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.fo_pack.argtypes = [ptr, c_int, i64, i64, i64, i64, ptr]
    lib.fo_gemm.argtypes = [i64, i64, i64, ptr, i64, ptr, c_int, ptr, i64, c_int]
    lib.fo_gemm_batched.argtypes = [i64, i64, i64, i64, i64, ptr, i64, i64, i64, ptr, c_int, i64, i64,
                                    i64, i64, ptr, i64, i64, i64, c_int]
    lib.fo_row_sums.argtypes = [i64, i64, ptr, i64, c_int, c_int, ptr, c_int]
    lib.fo_exp.argtypes = [i64, ptr, c_int, ptr, c_int]
    lib.fo_aten_dots.argtypes = [i64, i64, ptr, ptr, i64, c_int, c_int, ptr, c_int]
    lib.fo_packed_elements.argtypes = [i64, i64, c_int]
    lib.fo_packed_elements.restype = i64
    lib.fo_use_openmp.argtypes = [ptr]
    f32 = ctypes.c_float
    lib.fo_attention.argtypes = [i64, i64, i64, i64, i64, i64, ptr, c_int, i64, i64, i64, f32, ptr, c_int, i64, i64,
                                 i64, ptr, c_int, i64, i64, i64, ptr, i64, i64, f32, ptr, c_int]
    lib.fo_rope_bf16.argtypes = [i64, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, i64, ptr, i64, ptr, i64, i64,
                                 i64, ptr, ptr, i64, i64, ptr, c_int]
    select_isa(lib)
    return lib


def select_isa(lib: ctypes.CDLL) -> None:
    """Sets a loaded kernel library (this one, or jaxmodel's FFI build of the same header)
    to the code path $LLAMA_PARITY_KERNEL_ISA asks for; a path the CPU lacks is an error."""
    best, want = lib.fo_max_isa(), requested_isa()
    if lib.fo_set_isa(best if want == "auto" else ISAS[want]) < 0:
        raise InvarianceError(f"LLAMA_PARITY_KERNEL_ISA={want}: this CPU runs at most {ISA_NAMES[best]}")


def code_paths(lib: ctypes.CDLL) -> list[str]:
    """The code paths a loaded kernel library (this one, or jaxmodel's FFI build) can take on
    this CPU, scalar first."""
    return [name for name, level in ISAS.items() if level <= lib.fo_max_isa()]


@contextlib.contextmanager
def code_path(lib: ctypes.CDLL, name: str):
    """`lib` on code path `name` inside the with-block, then back (tests compare the paths)."""
    before = lib.fo_isa()
    if lib.fo_set_isa(ISAS[name]) != ISAS[name]:
        raise InvarianceError(f"code path {name}: this CPU runs at most {ISA_NAMES[lib.fo_max_isa()]}")
    try:
        yield
    finally:
        lib.fo_set_isa(before)


def use_openmp(runtime: str | None) -> bool:
    """Runs the kernels' parallel work on the threads of this GNU OpenMP runtime (a path,
    or a library name already loaded; torch's, for torchref) instead of a pool of ours,
    which would compete with the runtime's spinning threads for the cores. False (and our
    pool) when it has no GOMP_parallel."""
    lib = library()
    if runtime is None:
        lib.fo_use_openmp(None)
        return False
    try:
        fn = ctypes.cast(ctypes.CDLL(runtime).GOMP_parallel, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return False
    lib.fo_use_openmp(ctypes.c_void_p(fn))
    return True


def isa() -> str:
    """The code path in use (a key of ISAS)."""
    return ISA_NAMES[library().fo_isa()]


def state() -> str:
    """What the kernels use in this process, for run records; never builds."""
    if library.cache_info().currsize == 0:
        failed = next(iter(_FAILED.values()), None)
        return f"unavailable: {failed}" if failed is not None else "not loaded in this process"
    return f"fixed_order ({isa()} path)"


def threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


# ----- numpy API (tests, jaxmodel's packing, the self-check) ------------------------------

def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def wtype(dtype) -> int:
    name = np.dtype(dtype).name if not str(dtype).startswith("bfloat16") else "bfloat16"
    if name not in WTYPES:
        raise TypeError(f"fixed-order kernels take float32, bfloat16, float16 or float64 weights, not {name}")
    return WTYPES[name]


def pack(w: np.ndarray) -> np.ndarray:
    """w [N, K] (any supported dtype) -> panels [ceil(N/16), K, 16] of the same dtype."""
    w = np.ascontiguousarray(w)
    N, K = w.shape
    out = np.empty((-(-N // PANEL), K, PANEL), dtype=w.dtype)
    library().fo_pack(_ptr(w), wtype(w.dtype), N, K, K, 1, _ptr(out))
    return out


def pack_pairs(w: np.ndarray) -> np.ndarray:
    """bf16 w [N, K] -> panels for the pair program (gemm_pairs)."""
    w = np.ascontiguousarray(w)
    N, K = w.shape
    out = np.empty(library().fo_packed_elements(N, K, BF16_PAIRS), dtype=w.dtype)
    library().fo_pack(_ptr(w), BF16_PAIRS, N, K, K, 1, _ptr(out))
    return out


def gemm_pairs(x: np.ndarray, packed: np.ndarray, n: int, n_threads: int | None = None) -> np.ndarray:
    """bf16 x [M, K] @ w^T (w packed by pack_pairs) by the pair program, f32 out."""
    x = np.ascontiguousarray(x)
    M, K = x.shape
    y = np.empty((M, n), dtype=np.float32)
    library().fo_gemm(M, n, K, _ptr(x), K, _ptr(packed), BF16_PAIRS, _ptr(y), n, n_threads or threads())
    return y


def pack_for(w: np.ndarray, compute: str, accum: str) -> tuple[np.ndarray, int, str, str]:
    """w [N, K] packed for a product at a policy's compute and accum dtypes: the operands
    are w's values rounded to `compute`, summed in f32 (f64 for an f64 accumulation).
    Returns (packed, wtype for gemm, the dtype x goes in, the accumulator dtype). bf16
    operands with an f32 accumulator take the pair program; f32, bf16 and f16 weights are
    otherwise kept in their dtype (widened exactly inside the kernel); f64 sums take f64."""
    import ml_dtypes
    names = {"float32": np.float32, "float16": np.float16, "float64": np.float64,
             "bfloat16": ml_dtypes.bfloat16}
    acc = "float64" if accum == "float64" else "float32"
    wv = np.asarray(w).astype(names[compute])
    if acc == "float32" and compute == "bfloat16":
        return pack_pairs(wv), BF16_PAIRS, "bfloat16", acc
    if acc == "float32" and compute in ("float32", "float16"):
        return pack(wv), WTYPES[compute], "float32", acc
    return pack(wv.astype(np.float64)), WTYPES["float64"], "float64", "float64"


def gemm(x: np.ndarray, packed: np.ndarray, n: int, n_threads: int | None = None) -> np.ndarray:
    """x [M, K] @ w^T for w packed by pack() (n = w's row count). x is float32, or float64
    for float64 weights; the result has x's dtype."""
    acc = np.float64 if packed.dtype == np.float64 else np.float32
    x = np.ascontiguousarray(x, dtype=acc)
    M, K = x.shape
    if packed.shape[1] != K:
        raise ValueError(f"gemm: x has K={K}, the packed weights K={packed.shape[1]}")
    y = np.empty((M, n), dtype=acc)
    library().fo_gemm(M, n, K, _ptr(x), K, _ptr(packed), wtype(packed.dtype), _ptr(y), n,
                      n_threads or threads())
    return y


def row_sums(x: np.ndarray, squares: bool = False) -> np.ndarray:
    """Sum over the last axis (of x or x**2) as one fma chain per row; f32 or f64."""
    x = np.ascontiguousarray(x)
    M, K = int(np.prod(x.shape[:-1])), x.shape[-1]
    s = np.empty(x.shape[:-1], dtype=x.dtype)
    library().fo_row_sums(M, K, _ptr(x), K, int(squares), int(x.dtype == np.float64), _ptr(s), threads())
    return s


def exp(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    library().fo_exp(x.size, _ptr(x), int(x.dtype == np.float64), _ptr(y), threads())
    return y
