"""llamaspec.fixed_order: the kernels under the batch-invariant mode.

What they guarantee, checked here without assuming any machine's rounding: every code
path (AVX-512, AVX2+FMA, scalar) computes the documented scalar program bit for bit; the
scalar program is an fma chain over k in ascending order (checked against exact rational
arithmetic); a row's result does not depend on the rows around it or the thread count.
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from llamaspec import fixed_order as fo
from llamaspec.errors import InvarianceError

PATHS = fo.code_paths(fo.library())


def code_path(name: str):
    return fo.code_path(fo.library(), name)


def _round_f32(q: Fraction) -> np.float32:
    """q rounded to the nearest float32, ties to even (exact: no double rounding)."""
    c = np.float32(float(q))
    best = None
    for v in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        d = abs(Fraction(float(v)) - q)
        even = int(np.asarray(v).view(np.uint32)) % 2 == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, v)
    return best[1]


def _fma32(a, b, acc) -> np.float32:
    """fma in float32: a * b + acc in exact arithmetic, rounded once."""
    return _round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(acc)))


def _reference(x: np.ndarray, w: np.ndarray, order, flush=lambda v: v) -> np.ndarray:
    """A documented program in exact arithmetic: for each output, acc = flush(fma(flush(x),
    flush(w), acc)) over k in `order(K)`, starting from 0."""
    xs, ws = x.astype(np.float32), w.astype(np.float32)
    y = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for m in range(x.shape[0]):
        for n in range(w.shape[0]):
            acc = np.float32(0)
            for k in order(x.shape[1]):
                acc = flush(_fma32(flush(xs[m, k]), flush(ws[n, k]), acc))
            y[m, n] = acc
    return y


def _fma_chain_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The f32 program: one chain over k ascending."""
    return _reference(x, w, range)


def test_scalar_path_is_the_documented_fma_chain():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 13)).astype(np.float32)
    w = rng.standard_normal((5, 13)).astype(np.float32)
    with code_path("scalar"):
        got = fo.gemm(x, fo.pack(w), 5)
    assert np.array_equal(got.view(np.uint32), _fma_chain_f32(x, w).view(np.uint32))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.float64])
def test_every_code_path_gives_the_scalar_programs_bits(path, dtype):
    rng = np.random.default_rng(2)
    acc = np.float64 if dtype == np.float64 else np.float32
    for M, N, K in [(1, 1, 1), (1, 37, 19), (9, 16, 64), (70, 33, 7), (5, 100, 300), (17, 48, 576)]:
        x = rng.standard_normal((M, K)).astype(dtype).astype(acc)
        w = (rng.standard_normal((N, K)) * 3).astype(dtype)
        packed = fo.pack(w)
        with code_path("scalar"):
            want = fo.gemm(x, packed, N)
        with code_path(path):
            got = fo.gemm(x, packed, N)
        assert np.array_equal(got, want), (path, M, N, K)


def _ftz(v: np.float32) -> np.float32:
    return np.float32(np.copysign(0, v)) if abs(v) < np.finfo(np.float32).tiny else v


def _pair_order(K: int) -> list[int]:
    """k in pairs (2i, 2i+1), the odd one first."""
    return [k for i in range(0, K, 2) for k in (i + 1, i) if k < K]


def _pair_program(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The bf16 pair program: pairs odd first, one rounding per step, denormal inputs read
    as zero and denormal results flushed."""
    return _reference(x, w, _pair_order, _ftz)


def test_bf16_pairs_scalar_path_is_the_documented_pair_program():
    # Products of bf16 numbers have 16 significant bits: sums of similar magnitudes are
    # exact in f32 in any order. A wide spread of exponents makes the order show.
    rng = np.random.default_rng(6)
    spread = lambda shape: rng.standard_normal(shape) * 2.0 ** rng.integers(-14, 15, shape)  # noqa: E731
    x = spread((3, 31)).astype(ml_dtypes.bfloat16)
    w = spread((5, 31)).astype(ml_dtypes.bfloat16)
    w[1, 3] = np.float32(3e-39)  # a bf16 denormal: read as zero
    with code_path("scalar"):
        got = fo.gemm_pairs(x, fo.pack_pairs(w), 5)
    want = _pair_program(x, w)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # the data tells the documented order from its neighbours (so the check above can fail)
    even_first = _reference(x, w, lambda K: [k for i in range(0, K, 2) for k in (i, i + 1) if k < K], _ftz)
    assert not np.array_equal(want, even_first) and not np.array_equal(want, _reference(x, w, range, _ftz))


@pytest.mark.parametrize("path", PATHS)
def test_every_code_path_gives_the_bf16_pair_programs_bits(path):
    """Where the CPU has AVX-512-BF16, this checks vdpbf16ps against the program too."""
    rng = np.random.default_rng(7)
    spread = lambda shape: rng.standard_normal(shape) * 2.0 ** rng.integers(-14, 15, shape)  # noqa: E731
    # one row of 100 and 200 columns: the emulated paths' tiles of 4 panels, then 2, then 1 (a partial one)
    for M, N, K in [(1, 1, 1), (1, 37, 19), (1, 100, 301), (1, 200, 64), (9, 16, 64), (70, 33, 7), (5, 100, 301),
                    (17, 48, 576)]:
        x = spread((M, K)).astype(ml_dtypes.bfloat16)   # a wide spread: the order shows in the sums
        w = spread((N, K)).astype(ml_dtypes.bfloat16)
        x[0, 0], w[0, -1] = np.float32(1e-39), np.float32(-2e-39)     # denormals
        if M > 1:
            x[1] *= np.float32(1e-30).astype(ml_dtypes.bfloat16)      # tiny sums flush
        packed = fo.pack_pairs(w)
        with code_path("scalar"):
            want = fo.gemm_pairs(x, packed, N)
        with code_path(path):
            got = fo.gemm_pairs(x, packed, N)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (path, M, N, K)


@pytest.mark.parametrize("path", PATHS)
def test_a_row_gives_the_same_bits_alone_in_any_batch_and_thread_count(path):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((200, 96)).astype(np.float32)
    packed = fo.pack(w)
    x = rng.standard_normal((300, 96)).astype(np.float32)
    with code_path(path):
        alone = np.concatenate([fo.gemm(x[i:i + 1], packed, 200) for i in range(0, 300, 7)])
        for rows, threads in [(2, 1), (3, 2), (8, 2), (70, 1), (300, 2), (300, 3)]:
            got = fo.gemm(x[:rows], packed, 200, threads)
            assert np.array_equal(got[::7], alone[:len(got[::7])]), (rows, threads)


@pytest.mark.parametrize("path", PATHS)
def test_every_code_path_gives_the_scalar_row_sums(path):
    x = np.random.default_rng(8).standard_normal((300, 577)).astype(np.float32)
    for squares in (False, True):
        with code_path("scalar"):
            want = fo.row_sums(x, squares)
        with code_path(path):
            got = fo.row_sums(x, squares)
        assert np.array_equal(got, want)


def test_row_sums_are_one_fma_chain_per_row():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 50)).astype(np.float32)
    for squares in (False, True):
        got = fo.row_sums(x, squares)
        for m in range(4):
            acc = np.float32(0)
            for v in x[m]:
                acc = _fma32(v, v if squares else 1, acc)
            assert got[m] == acc
        # a row's sum does not depend on how many rows are summed at once
        assert np.array_equal(fo.row_sums(x[1:2], squares), got[1:2])


@pytest.mark.parametrize("path", PATHS)
def test_every_code_path_gives_the_scalar_exp_bits(path):
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-110, 95, 100003), [np.nan, np.inf, -np.inf, 0.0, -0.0]]).astype(np.float32)
    with code_path("scalar"):
        want = fo.exp(x)
    with code_path(path):
        got = fo.exp(x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_is_accurate_and_elementwise(dtype):
    x = np.concatenate([np.linspace(-120, 90, 20001), [0.0, -0.0, 1e-30, -1e-30, 700, -800]]).astype(dtype)
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64))
        got = fo.exp(x).astype(np.float64)
    finite = (want < np.finfo(dtype).max) & (want > np.finfo(dtype).tiny)
    eps = np.finfo(dtype).eps
    assert np.all(np.abs(got[finite] - want[finite]) <= 2 * eps * want[finite])
    with np.errstate(over="ignore"):
        assert np.array_equal(np.isinf(got), np.isinf(want.astype(dtype)))
    special = fo.exp(np.array([np.nan, np.inf, -np.inf, np.finfo(dtype).min], dtype))
    assert np.isnan(special[0]) and special[1] == np.inf and special[2] == 0 and special[3] == 0
    # the same element gives the same bits at any position of any array
    assert np.array_equal(fo.exp(x[5:6]), fo.exp(x)[5:6])
    assert np.array_equal(fo.exp(x[3:40007]), fo.exp(x)[3:40007])


def test_a_damaged_cached_library_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_PARITY_CACHE", str(tmp_path))
    first = fo.build("fixed_order", [fo.SOURCE])
    size = first.stat().st_size
    with open(first, "r+b") as f:
        f.truncate(4000)
    again = fo.build("fixed_order", [fo.SOURCE])
    assert again == first and again.stat().st_size == size


def test_an_unknown_or_unsupported_isa_cap_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("LLAMA_PARITY_KERNEL_ISA", "avx1024")
    with pytest.raises(InvarianceError, match="LLAMA_PARITY_KERNEL_ISA='avx1024'"):
        fo.requested_isa()
