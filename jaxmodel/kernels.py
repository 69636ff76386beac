"""llamaspec/fixed_order.h's kernels as JAX ops (XLA FFI custom calls on the CPU): the
batch-invariant mode's products, row sums and exp, one fixed order per result whatever
the row count, the thread count or the instruction set, the same programs torchref runs;
and the fast backend's fused CPU attention (attention.h) on the same tiles.

fixed_order_ffi.cc is compiled on first use (g++ or $CXX, with jaxlib's FFI headers) into
the llama-parity cache by llamaspec.fixed_order.load, which checks the file before
loading it (a damaged one is rebuilt), and registered once per process.
$LLAMA_PARITY_KERNEL_ISA caps its code path as for torchref.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from llamaspec import fixed_order as fo
from llamaspec.errors import InvarianceError

SOURCE = Path(__file__).with_name("fixed_order_ffi.cc")
ATTENTION = Path(__file__).with_name("attention.h")
TARGETS = {"gemm": "FoGemm", "gemm_batched": "FoGemmBatched", "row_sums": "FoRowSums", "exp": "FoExp",
           "attention": "FoAttention"}
PREFIX = "llama_parity_fo_"


@functools.cache
def library() -> ctypes.CDLL:
    """Builds, loads and registers the FFI targets once per process, on the code path
    $LLAMA_PARITY_KERNEL_ISA asks for."""
    if jax.default_backend() != "cpu":
        raise InvarianceError(f"batch_invariant=True runs on the CPU only (its fixed-order kernels are CPU "
                              f"code); JAX's backend is {jax.default_backend()}")
    lib = fo.load("fixed_order_ffi", [SOURCE], ("-I", jax.ffi.include_dir()),
                  (jax.__version__, jax.ffi.include_dir(), ATTENTION.read_text()))
    for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(PREFIX + name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    fo.select_isa(lib)
    return lib


def state() -> str:
    """What jaxmodel's invariant mode uses in this process, for run records; never builds."""
    if library.cache_info().currsize == 0:
        return "not loaded in this process"
    return f"fixed_order FFI ({fo.ISA_NAMES[library().fo_isa()]} path)"


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data"],
                   meta_fields=["n", "k", "wtype", "x_dtype", "acc"])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [n, k] weight packed by llamaspec.fixed_order.pack_for (data is a flat array)."""
    data: jax.Array
    n: int
    k: int
    wtype: int
    x_dtype: str
    acc: str

    @staticmethod
    def widening(w: np.ndarray) -> "PackedWeight":
        """A bf16 or f16 w [n, k] packed in its own dtype, for gemm with an f32 x: the kernel
        widens each weight exactly and sums the f32 products in f32 (fast.Fast.kernel_matvecs)."""
        name = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float16): "float16"}.get(np.dtype(w.dtype))
        if name is None:
            raise ValueError(f"PackedWeight.widening takes bf16 or f16 weights, not {w.dtype}")
        return PackedWeight(jnp.asarray(fo.pack(np.asarray(w)).reshape(-1)), int(w.shape[0]), int(w.shape[1]),
                            fo.WTYPES[name], "float32", "float32")

    @staticmethod
    def of(w: np.ndarray, compute: str, accum: str) -> "PackedWeight":
        packed, wtype, x_dtype, acc = fo.pack_for(np.asarray(w), compute, accum)
        return PackedWeight(jnp.asarray(packed.reshape(-1)), int(w.shape[0]), int(w.shape[1]), wtype,
                            x_dtype, acc)


def gemm(x, w: PackedWeight):
    """x [M, k] (in w.x_dtype) @ w^T -> [M, n] in w.acc."""
    library()
    out = jax.ShapeDtypeStruct((x.shape[0], w.n), jnp.dtype(w.acc))
    return jax.ffi.ffi_call(PREFIX + "gemm", out)(x, w.data, n=np.int64(w.n), wtype=np.int32(w.wtype))


def gemm_batched(x, w, w_kn: bool):
    """x [P, Qx, M, K] (Qx 1 or Q) @ w[p, q]^T for w [P, Q, N, K] (or [P, Q, K, N] when
    w_kn) -> [P, Q, M, N]; all f32 or all f64."""
    library()
    P, Q = w.shape[:2]
    N = w.shape[3] if w_kn else w.shape[2]
    out = jax.ShapeDtypeStruct((P, Q, x.shape[2], N), x.dtype)
    return jax.ffi.ffi_call(PREFIX + "gemm_batched", out)(x, w, w_kn=np.int32(w_kn))


def row_sums(x, squares: bool = False):
    """Sum over the last axis (of x or x^2), one fma chain per row; f32 or f64."""
    library()
    out = jax.ShapeDtypeStruct(x.shape[:-1], x.dtype)
    return jax.ffi.ffi_call(PREFIX + "row_sums", out)(x, squares=np.int32(squares))


def exp(x):
    """exp by fixed_order's program; f32 or f64."""
    library()
    return jax.ffi.ffi_call(PREFIX + "exp", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def attention(q, k, v, allowed, scale: float, early: bool):
    """attention.h's program: q [B, T, Hkv, G, D] in the compute dtype (f32, bf16 or f64; scaled
    already when early), k and v [B, S, Hkv, D] in q's dtype (or f32 copies of bf16 values),
    allowed [B, T, S] bool -> [B, T, Hkv, G, D] in q's dtype."""
    library()
    return jax.ffi.ffi_call(PREFIX + "attention", jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k, v, allowed, scale=np.float64(scale), early=np.int32(early))
