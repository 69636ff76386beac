"""fp8 quantization as one deterministic rounding (llamaspec.quant, torchref.quant, jaxmodel.quant):
the same bits in numpy (ml_dtypes), torch, jax and jax under jit, checked against an independent
round-to-nearest-even over the table of every fp8 value; the special values; what widening fp8 to
float32 keeps exact (a product always, a dot product only while its partial sums fit 24 bits);
errors that name the field. docs/fp8.md says what these guarantee."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import jaxmodel  # noqa: F401  (x64 on: jaxmodel's float64 arrays)
from jaxmodel import quant as jq
from jaxmodel.dtypes import compiler_options
from llamaspec import PolicyError
from llamaspec import quant as nq
from llamaspec.checkpoint import numpy_dtype
from llamaspec.quant import FORMATS, Scaling
from torchref import quant as tq
from torchref.dtypes import from_numpy, to_numpy

FRAMEWORKS = ("numpy", "torch", "jax", "jax-jit")
E4M3, E5M2 = FORMATS["float8_e4m3fn"], FORMATS["float8_e5m2"]


# ----- helpers: run each framework on numpy in, numpy (ml_dtypes) out --------------------------

def _np(t):
    """A torch tensor as numpy, fp8 and bf16 as ml_dtypes (no conversion of values)."""
    if t.dtype in tq.FP8.values():
        return t.view(torch.uint8).numpy().view(FORMATS[str(t.dtype).removeprefix("torch.")].dtype)
    return to_numpy(t)


def quantize(fw, x, spec):
    if fw == "numpy":
        return nq.quantize(x, spec)
    if fw == "torch":
        return tuple(_np(t) for t in tq.quantize(from_numpy(x), spec))
    fn = functools.partial(jq.quantize, scaling=spec)
    return tuple(np.asarray(a) for a in (jax.jit(fn) if fw == "jax-jit" else fn)(x))


def dequantize(fw, q, scales, spec, dtype):
    if fw == "numpy":
        return nq.dequantize(q, scales, spec, dtype)
    if fw == "torch":
        qt = torch.from_numpy(q.view(np.uint8)).view(tq.FP8[q.dtype.name])
        return _np(tq.dequantize(qt, from_numpy(scales), spec, dtype))
    fn = functools.partial(jq.dequantize, scaling=spec, dtype=dtype)
    return np.asarray((jax.jit(fn) if fw == "jax-jit" else fn)(q, scales))


def round_to_fp8(fw, y, fmt):
    if fw == "numpy":
        return nq.round_to_fp8(y, fmt)
    if fw == "torch":
        return _np(tq.round_to_fp8(torch.from_numpy(y), fmt))
    fn = functools.partial(jq.round_to_fp8, fmt=fmt)
    return np.asarray((jax.jit(fn) if fw == "jax-jit" else fn)(y))


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    diff = np.flatnonzero(bits(a) != bits(b))
    assert diff.size == 0, (f"{what}: {diff.size} of {a.size} differ, first at flat index {diff[0]}: "
                            f"{a.flat[diff[0]]!r} vs {b.flat[diff[0]]!r}")


# ----- an independent rounding: nearest fp8 value by table, ties to the even code ----------------

@functools.cache
def table(fmt):
    """(values, codes) of every positive finite fp8 value (and +0), ascending."""
    codes = np.arange(256, dtype=np.uint8)
    vals = codes.view(fmt.dtype).astype(np.float64)
    keep = np.isfinite(vals) & (codes < 0x80)
    order = np.argsort(vals[keep])
    return vals[keep][order], codes[keep][order]


def rne(y, fmt):
    """float32 y -> fp8 bytes by search over the table: saturating at +-max, ties to the even
    code, the sign of y kept (also on a zero result), NaN -> fmt.nan_bits."""
    vals, codes = table(fmt)
    y = np.asarray(y, np.float32)
    mag = np.minimum(np.abs(y.astype(np.float64)), fmt.max)
    hi = np.clip(np.searchsorted(vals, mag), 1, len(vals) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - vals[lo], vals[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    out = np.where(pick_hi, codes[hi], codes[lo]) | np.where(np.signbit(y), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(y), fmt.nan_bits, out).astype(np.uint8)


def fp8(values, fmt):
    """Exactly representable values (float) as fp8 bytes via ml_dtypes."""
    return bits(np.asarray(values, np.float32).astype(fmt.dtype))


# ----- the formats and the spec strings --------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_formats_are_the_libraries_formats(fmt):
    fi = ml_dtypes.finfo(fmt.dtype)
    assert (float(fi.max), float(fi.smallest_normal), float(fi.smallest_subnormal), fi.nmant, fi.nexp) == (
        fmt.max, fmt.smallest_normal, fmt.smallest_subnormal, fmt.mantissa_bits, fmt.exponent_bits)
    for lib in (torch.finfo(tq.FP8[fmt.name]), jnp.finfo(jnp.dtype(fmt.name))):
        assert (float(lib.max), float(lib.smallest_normal)) == (fmt.max, fmt.smallest_normal)
    every = np.arange(256, dtype=np.uint8).view(fmt.dtype)
    assert tuple(np.flatnonzero(np.isnan(every))) == fmt.nan_codes
    assert bool(np.isinf(every).any()) == fmt.has_inf
    assert int(bits(np.array([np.nan], np.float32).astype(fmt.dtype))[0]) == fmt.nan_bits
    assert fmt.min_scale * fmt.smallest_subnormal == 2.0 ** -126


@pytest.mark.parametrize("spec, fields", [
    ("e4m3:block128", ("float8_e4m3fn", "block", 128, "float32")),
    ("float8_e5m2:channel:bfloat16", ("float8_e5m2", "channel", None, "bfloat16")),
    ("e4m3fn:tensor:bf16", ("float8_e4m3fn", "tensor", None, "bfloat16")),
    ("e5m2:block1:f32", ("float8_e5m2", "block", 1, "float32")),
])
def test_spec_strings_round_trip(spec, fields):
    s = Scaling.parse(spec)
    assert (s.format, s.granularity, s.block, s.scale_dtype) == fields
    assert Scaling.parse(str(s)) == s == Scaling(*fields) == Scaling.get(s)
    assert Scaling("e4m3", "block", 128, "bf16") == Scaling.parse("e4m3:block128:bfloat16")


@pytest.mark.parametrize("make, words", [
    (lambda: Scaling.parse("e3m4:tensor"), "format='e3m4'"),
    (lambda: Scaling.parse("e4m3:block0"), "block=0 must be a positive integer"),
    (lambda: Scaling.parse("e4m3:block"), "'block' needs the block side N"),
    (lambda: Scaling.parse("e4m3:block-8"), "'block-8' needs the block side N"),
    (lambda: Scaling.parse("e4m3:row"), "granularity='row'"),
    (lambda: Scaling.parse("e4m3:tensor:float16"), "scale_dtype='float16'"),
    (lambda: Scaling.parse("e4m3"), "FORMAT:GRANULARITY[:SCALE_DTYPE]"),
    (lambda: Scaling.parse("e4m3:tensor:float32:x"), "FORMAT:GRANULARITY[:SCALE_DTYPE]"),
    (lambda: Scaling.get(8), "not int"),
    (lambda: Scaling("e4m3", "tensor", block=4), "block=4 is only for granularity 'block'"),
    (lambda: Scaling("e4m3", "block", block=True), "block=True must be a positive integer"),
    (lambda: Scaling("e4m3", "block", block=2.0), "block=2.0 must be a positive integer"),
    (lambda: Scaling(["e4m3"], "tensor"), "format=['e4m3']"),
    (lambda: nq.round_to_fp8(np.zeros(2, np.float32), "fp8"), "unknown fp8 format 'fp8'"),
])
def test_bad_scalings_name_the_field(make, words):
    with pytest.raises(PolicyError) as e:
        make()
    assert words in str(e.value), str(e.value)


BAD_TENSORS = [
    ("e4m3:channel", np.ones(5, np.float32), "granularity 'channel' needs a 2-D [out, in] tensor, got shape (5,)"),
    ("e4m3:block128", np.ones((2, 3, 4), np.float32), "granularity 'block' needs a 2-D"),
    ("e4m3:tensor", np.ones((0, 4), np.float32), "cannot quantize a tensor of shape (0, 4)"),
    ("e4m3:tensor", np.float32(3.0), "cannot quantize a tensor of shape ()"),
    ("e5m2:tensor", np.ones((2, 2), np.int32), "x has dtype int32"),
]


@pytest.mark.parametrize("fw", FRAMEWORKS[:3])
@pytest.mark.parametrize("spec, x, words", BAD_TENSORS, ids=[w[:24] for _, _, w in BAD_TENSORS])
def test_bad_tensors_name_shape_and_dtype(fw, spec, x, words):
    x = np.asarray(x)
    arg = {"numpy": x, "torch": torch.from_numpy(x), "jax": jnp.asarray(x)}[fw]
    quant = {"numpy": nq, "torch": tq, "jax": jq}[fw]
    with pytest.raises(PolicyError) as e:
        quant.quantize(arg, spec)
    assert words in str(e.value) and spec in str(e.value), str(e.value)


@pytest.mark.parametrize("fw", FRAMEWORKS[:3])
def test_bad_dequantize_arguments_are_named(fw):
    q, s = nq.quantize(np.ones((4, 6), np.float32), "e4m3:block4")
    cases = [(q, s, "e5m2:block4", "float32", "q has dtype float8_e4m3fn, expected float8_e5m2"),
             (q, np.ones((2, 1), np.float32), "e4m3:block4", "float32",
              "scales are float32[2, 1]; q of shape (4, 6) needs float32[1, 2]"),
             (q, s.astype(ml_dtypes.bfloat16), "e4m3:block4", "float32", "scales are bfloat16[1, 2]"),
             (q, s, "e4m3:block4", "float8", "dequantize dtype='float8'")]
    for qq, ss, spec, dtype, words in cases:
        with pytest.raises(PolicyError) as e:
            if fw == "numpy":
                nq.dequantize(qq, ss, spec, dtype)
            elif fw == "torch":
                tq.dequantize(torch.from_numpy(qq.view(np.uint8)).view(torch.float8_e4m3fn), from_numpy(ss),
                              spec, dtype)
            else:
                jq.dequantize(qq, ss, spec, dtype)
        assert words in str(e.value), str(e.value)


# ----- the same bits everywhere, and the definition's bits -------------------------------------

def weights(shape, seed):
    """Rows of very different magnitudes (as a real weight's channels), some exact zeros and
    values far below the row's amax (fp8 subnormals and underflow to zero)."""
    rng = np.random.default_rng(seed)
    rows = shape[0] if len(shape) > 1 else 1
    mag = np.exp(rng.normal(0, 3, (rows,) + (1,) * (len(shape) - 1)))
    x = rng.standard_normal(shape) * mag * np.exp(rng.normal(0, 2, shape))
    x.flat[::7] = 0.0
    x.flat[3::11] *= -1e-4
    return x.astype(np.float32)


def expected(x, scaling):
    """The definition, written with explicit loops over the groups and the table rounding."""
    fmt, group = scaling.fmt, scaling.group_shape(x.shape)
    x = np.where(np.abs(x) < 2.0 ** -126, x * 0, x.astype(np.float32))
    scales = np.empty(scaling.scale_shape(x.shape), np.float32)
    full = np.empty_like(x)
    for idx in np.ndindex(scales.shape):
        where = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, group))
        amax = np.abs(x[where]).max()
        s = np.float32(np.float32(amax) / np.float32(fmt.max))
        s = np.float32(np.asarray(s).astype(ml_dtypes.bfloat16)) if scaling.scale_dtype == "bfloat16" else s
        s = np.float32(1) if amax == 0 else max(s, np.float32(fmt.min_scale))
        scales[idx] = s
        full[where] = s
    return rne(x / full, fmt), scales.astype(numpy_dtype(scaling.scale_dtype))


def spread(scales, scaling, shape):
    """Each group's scale at every position of its group."""
    rows, cols = (np.arange(n) // b for n, b in zip(shape, scaling.group_shape(shape)))
    return scales[np.ix_(rows, cols)] if len(shape) == 2 else np.broadcast_to(scales, shape)


SHAPES = [(1, 1), (3, 5), (17, 300), (130, 257), (256, 128)]
SPECS = [f"{f}:{g}{s}" for f in ("e4m3", "e5m2") for g in ("tensor", "channel", "block128", "block16")
         for s in ("", ":bfloat16")]


@pytest.mark.parametrize("spec", SPECS)
def test_every_framework_gives_the_definitions_bits(spec):
    """q and scales bit for bit in numpy, torch, jax and jax under jit, equal to the definition
    (explicit group loops, the table's rounding) and so to ml_dtypes' conversion; partial blocks
    (block128 on 130 x 257, block16 on 17 x 300) included. Dequantized weights too, per dtype."""
    scaling = Scaling.parse(spec)
    for i, shape in enumerate(SHAPES):
        x = weights(shape, seed=i)
        q_ref, s_ref = expected(x, scaling)
        frameworks = FRAMEWORKS if shape in ((3, 5), (130, 257)) else FRAMEWORKS[:3]   # jit: two shapes
        for fw in frameworks:
            q, s = quantize(fw, x, spec)
            assert_same_bits(s, s_ref, f"{fw} {spec} {shape}: scales")
            assert q.dtype == scaling.fmt.dtype and s.shape == scaling.scale_shape(shape)
            assert_same_bits(bits(q), q_ref, f"{fw} {spec} {shape}: q")
        q, s = nq.quantize(x, spec)
        exact = q.astype(np.float64) * spread(s.astype(np.float64), scaling, shape)
        for dtype in ("float64", "float32", "bfloat16", "float16"):
            ref = nq.dequantize(q, s, spec, dtype)
            for fw in frameworks[1:]:
                assert_same_bits(dequantize(fw, q, s, spec, dtype), ref, f"{fw} {spec} {shape} dequantize {dtype}")
        assert np.array_equal(nq.dequantize(q, s, spec, "float64"), exact)          # float64: exact
        assert np.array_equal(nq.dequantize(q, s, spec, "float32"), exact.astype(np.float32))  # one rounding
        # ml_dtypes' own conversion of the same scaled values (NaN-free here)
        full = spread(s.astype(np.float32), scaling, shape)
        assert np.array_equal(bits(np.clip(x / full, -scaling.fmt.max, scaling.fmt.max).astype(scaling.fmt.dtype)),
                              q_ref)


def test_jit_with_the_models_compiler_options():
    """Under the options jaxmodel compiles with (no excess precision, classic emitters) too."""
    x = weights((130, 257), seed=4)
    for spec in ("e4m3:channel", "e5m2:block128:bfloat16", "e4m3:tensor"):
        fn = jax.jit(functools.partial(jq.quantize, scaling=spec), compiler_options=compiler_options())
        q, s = (np.asarray(a) for a in fn(x))
        q_ref, s_ref = nq.quantize(x, spec)
        assert_same_bits(q, q_ref, f"{spec}: q")
        assert_same_bits(s, s_ref, f"{spec}: scales")


@pytest.mark.parametrize("shape", [(7,), (2, 3, 40)])
def test_tensor_scaling_takes_any_rank(shape):
    x = weights(shape, seed=3)
    for spec in ("e4m3:tensor", "e5m2:tensor:bfloat16"):
        q_ref, s_ref = expected(x, Scaling.parse(spec))
        for fw in FRAMEWORKS:
            q, s = quantize(fw, x, spec)
            assert s.shape == (1,) * len(shape)
            assert_same_bits(s, s_ref, f"{fw} {spec} {shape}: scales")
            assert_same_bits(bits(q), q_ref, f"{fw} {spec} {shape}: q")
            assert_same_bits(dequantize(fw, q, s, spec, "float32"), nq.dequantize(q, s, spec, "float32"),
                             f"{fw} {spec} {shape}: dequantize")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_input_dtypes_are_read_as_float32(dtype):
    x = weights((40, 72), seed=7)
    x_in = x.astype(numpy_dtype(dtype)) if dtype != "float64" else x.astype(np.float64) * (1 + 2.0 ** -30)
    ref = nq.quantize(x_in.astype(np.float32), "e4m3:block32:bfloat16")
    for fw in FRAMEWORKS:
        q, s = quantize(fw, x_in, "e4m3:block32:bfloat16")
        assert_same_bits(q, ref[0], f"{fw} {dtype}: q")
        assert_same_bits(s, ref[1], f"{fw} {dtype}: scales")


# ----- special values ---------------------------------------------------------------------------

T = 2.0 ** -9   # e4m3fn's smallest subnormal
SPECIAL = {
    # (input, expected value or "nan")
    "float8_e4m3fn": [
        (448, 448), (464, 448), (465, 448), (479, 448), (480, 448), (1e6, 448), (3e38, 448),
        (np.inf, 448), (-np.inf, -448), (-500, -448), (np.nan, "nan"), (-np.nan, "nan"),
        (T, T), (T / 2, 0.0), (-T / 2, -0.0), (3 * T / 2, 2 * T), (5 * T / 2, 2 * T), (T / 4, 0.0),
        (2.0 ** -6, 2.0 ** -6), (2.0 ** -6 - T / 2, 2.0 ** -6), (0.0, 0.0), (-0.0, -0.0), (1e-30, 0.0),
        (1 + 1 / 16, 1.0), (1 + 3 / 16, 1.25), (-(1 + 3 / 16), -1.25), (17, 16), (19, 20), (240, 240),
        (232, 224), (248, 256),
    ],
    "float8_e5m2": [
        (57344, 57344), (61439, 57344), (61440, 57344), (65536, 57344), (1e6, 57344),
        (np.inf, 57344), (-np.inf, -57344), (np.nan, "nan"), (-np.nan, "nan"),
        (2.0 ** -16, 2.0 ** -16), (2.0 ** -17, 0.0), (-(2.0 ** -17), -0.0), (3 * 2.0 ** -17, 2.0 ** -15),
        (0.0, 0.0), (-0.0, -0.0), (1 + 1 / 8, 1.0), (1 + 3 / 8, 1.5), (40960, 40960), (45056, 49152),
        (53248, 49152),
    ],
}


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", list(SPECIAL))
def test_special_values(fw, name):
    """Saturation at and beyond max and at +-Inf, NaN (any sign) as the format's one NaN, fp8
    subnormals and underflow to a signed zero, exact ties to the even neighbour."""
    fmt = FORMATS[name]
    y = np.array([v for v, _ in SPECIAL[name]], np.float32)
    want = np.array([fmt.nan_bits if e == "nan" else fp8([e], fmt)[0] for _, e in SPECIAL[name]], np.uint8)
    got = bits(round_to_fp8(fw, y, fmt))
    assert np.array_equal(rne(y, fmt), want)      # the table rounding agrees with the hand-written list
    for v, g, w in zip(y, got, want):
        assert g == w, f"{fw} {name}: {v!r} -> {g:#04x}, expected {w:#04x}"


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_midpoint_and_its_neighbours(name):
    """For every pair of adjacent fp8 values (both signs): the midpoint (a tie) and the float32
    values one and a few ulps either side; plus random float32 bit patterns over the whole finite
    range. A cast that rounded twice (float32 -> float16 -> fp8) would fail next to the midpoints."""
    fmt = FORMATS[name]
    vals, _ = table(fmt)
    mid = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)          # exact: positive, adjacent
    near = [mid] + [(mid.view(np.int32) + k).view(np.float32) for k in (1, -1, 2, -2, 17, -17, 4096, -4096)]
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2 ** 31, 20000, dtype=np.int64).astype(np.uint32).view(np.float32)
    rand = rand[np.abs(rand) <= 2 * fmt.max]
    y = np.concatenate(near + [rand])
    y = np.concatenate([y, -y])
    want = rne(y, fmt)
    for fw in FRAMEWORKS:
        got = bits(round_to_fp8(fw, y, fmt))
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{fw} {name}: {bad.size} wrong, e.g. {y[bad[0]]!r} -> {got[bad[0]]:#04x}"


def _groups(fw, x, spec):
    q, s = quantize(fw, x, spec)
    return q, s, dequantize(fw, q, s, spec, "float32")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_special_groups(fw):
    """amax 0 -> scale 1 (signed zeros kept); a NaN or an Inf makes its own block's scale NaN or
    Inf and that block NaN when dequantized, and leaves the other blocks as they were alone."""
    x = np.zeros((4, 6), np.float32)
    x[0, 0] = -0.0
    q, s, w = _groups(fw, x, "e4m3:tensor")
    assert s.tolist() == [[1.0]] and np.array_equal(bits(q), fp8(x, E4M3)) and np.signbit(w[0, 0])
    rng = np.random.default_rng(3)
    base = rng.standard_normal((4, 6)).astype(np.float32)
    q0, s0, w0 = _groups(fw, base, "e4m3:block2")
    for bad in (np.nan, np.inf, -np.inf):
        x = base.copy()
        x[1, 3] = bad
        q, s, w = _groups(fw, x, "e4m3:block2")
        block = (slice(0, 2), slice(2, 4))
        assert (np.isnan(s[0, 1]) if np.isnan(bad) else np.isinf(s[0, 1]) and s[0, 1] > 0), (bad, s)
        assert np.isnan(w[block]).all(), (bad, w[block])
        assert bits(q)[1, 3] == E4M3.nan_bits
        rest = np.ones((4, 6), bool)
        rest[block] = False
        assert np.array_equal(bits(q)[rest], bits(q0)[rest]) and np.array_equal(w[rest], w0[rest])
        s_rest = np.ones(s.shape, bool)
        s_rest[0, 1] = False
        assert np.array_equal(s[s_rest], s0[s_rest])
        if np.isinf(bad):   # finite values of the block: +-0, so q x Inf is NaN
            assert np.all(q[block].astype(np.float32)[np.isfinite(x[block])] == 0)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_tiny_groups_no_flush_to_zero_dependence(fw):
    """float32 subnormals read as signed zeros; a group of them has scale 1; a group whose amax
    sits far below 1 gets the format's smallest scale, so every dequantized value is a normal
    float32 in all frameworks (XLA flushes subnormals on CPU, numpy and torch do not)."""
    sub = np.float32(2.0 ** -130)
    x = np.array([[sub, -sub, 0.0, 3 * sub],                        # row 0: only subnormals
                  [2.0 ** -120, 2.0 ** -127, -(2.0 ** -126), 2.0 ** -128]], np.float32)

    q, s, w = _groups(fw, x, "e4m3:channel")
    assert s[0, 0] == 1 and np.array_equal(bits(q)[0], fp8([0.0, -0.0, 0.0, 0.0], E4M3))
    assert s[1, 0] == E4M3.min_scale                                    # 2^-120 / 448 < 2^-117
    assert q[1].astype(np.float32).tolist() == [2.0 ** -3, 0.0, -(2.0 ** -9), 0.0]
    assert np.signbit(q[0, 1].astype(np.float32))
    assert w[1, 0] == 2.0 ** -120 and w[1, 2] == -(2.0 ** -126)
    for spec, scale_dtype in (("e5m2:tensor:bfloat16", ml_dtypes.bfloat16), ("e5m2:tensor", np.float32)):
        q, s, w = _groups(fw, np.array([1e-35, 3e-37], np.float32), spec)
        assert s.dtype == scale_dtype and float(s[0]) == E5M2.min_scale and np.all(w[w != 0] >= 2.0 ** -126)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_bfloat16_scale_rounded_down_saturates(fw):
    """amax / 448 rounds down to a bfloat16 scale of 1, so amax / scale = 449.75 > 448: saturated."""
    amax = np.float32(448 * (1 + 2.0 ** -8 - 2.0 ** -16))
    x = np.array([[amax, -amax, 1.0]], np.float32)
    q, s = quantize(fw, x, "e4m3:tensor:bfloat16")
    assert float(s[0, 0]) == 1.0 and amax / np.float32(s[0, 0]) > 448
    assert q.astype(np.float32).tolist() == [[448.0, -448.0, 1.0]]


def test_ties_after_a_true_division():
    """x / scale lands exactly on a midpoint between two fp8 values (rounded to the even one),
    where x times a rounded 1 / scale (what XLA would compute for a division by a broadcast)
    lands beside it and rounds the other way: every framework divides."""
    rng = np.random.default_rng(11)
    fmt, vals = E4M3, table(E4M3)[0]
    mids = ((vals[:-1] + vals[1:]) / 2)[8:-2].astype(np.float32)         # normal range, below max
    rows = []
    while len(rows) < 16:
        amax = np.float32(rng.uniform(1, 100))
        s = np.float32(amax / np.float32(fmt.max))
        r = np.float32(np.float32(1) / s)
        x = (mids * s).astype(np.float32)
        hit = (x / s == mids) & (rne(x * r, fmt) != rne(mids, fmt)) & (np.abs(x) < amax)
        if hit.any():
            rows.append(np.concatenate([[amax], x[hit][:7], np.zeros(7 - min(7, hit.sum()), np.float32)]))
    x = np.array(rows, np.float32)
    want, _ = expected(x, Scaling.parse("e4m3:channel"))
    s = (x[:, :1] / np.float32(fmt.max)).astype(np.float32)
    assert (rne(x * (np.float32(1) / s), fmt) != want).sum() >= 16      # the reciprocal differs
    for fw in FRAMEWORKS:
        q, _ = quantize(fw, x, "e4m3:channel")
        assert_same_bits(bits(q), want, f"{fw}: ties after division")


# ----- products: what widening fp8 to float32 keeps exact --------------------------------------

def finite_values(fmt):
    every = np.arange(256, dtype=np.uint8).view(fmt.dtype)
    return every[np.isfinite(every.astype(np.float32))]


@pytest.mark.parametrize("a_name, b_name", [("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2"),
                                            ("float8_e4m3fn", "float8_e5m2")])
def test_every_fp8_product_is_exact_in_float32(a_name, b_name):
    """Every finite value x every finite value: the product of the float32-widened operands is
    the exact (float64) product, in each framework: 4 x 4 significant bits fit float32's 24, and
    the smallest product (2^-9 x 2^-9, or 2^-16 x 2^-16) is a normal float32."""
    a, b = finite_values(FORMATS[a_name]), finite_values(FORMATS[b_name])
    exact = np.multiply.outer(a.astype(np.float64), b.astype(np.float64))
    assert np.all((exact == 0) | (np.abs(exact) >= 2.0 ** -126))
    got = {
        "numpy": np.multiply.outer(a.astype(np.float32), b.astype(np.float32)),
        "torch": (torch.from_numpy(a.view(np.uint8)).view(tq.FP8[a_name]).float()[:, None]
                  * torch.from_numpy(b.view(np.uint8)).view(tq.FP8[b_name]).float()[None, :]).numpy(),
        "jax": np.asarray(jax.jit(lambda u, v: u.astype(jnp.float32)[:, None] * v.astype(jnp.float32)[None, :])(a, b)),
    }
    for fw, p in got.items():
        assert p.dtype == np.float32 and np.array_equal(p.astype(np.float64), exact), fw


def _dots(a, b):
    """a @ b with float32-widened fp8 operands: numpy, torch, jax (each library's own order), and
    the fp8 x fp8 -> float32 products torch and jax take directly on a CPU."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    ta = torch.from_numpy(a.view(np.uint8)).view(tq.FP8[a.dtype.name])
    tb = torch.from_numpy(b.view(np.uint8)).view(tq.FP8[b.dtype.name])
    one = torch.tensor(1.0)
    out = {
        "numpy": a32 @ b32,
        "torch": (torch.from_numpy(a32) @ torch.from_numpy(b32)).numpy(),
        "jax": np.asarray(jnp.dot(a32, b32, precision="highest")),
        "jax fp8 dot": np.asarray(jnp.dot(a, b, preferred_element_type=jnp.float32, precision="highest")),
        "torch._scaled_mm": torch._scaled_mm(ta, tb, scale_a=one, scale_b=one, out_dtype=torch.float32).numpy(),
    }
    return out


def test_dot_products_exact_while_partial_sums_fit_24_bits():
    """A K-term sum of fp8 products is exact in float32, in any order and with or without FMA,
    when sum |a_i b_i| <= 2^24 g, g the largest power of two dividing every product (every partial
    sum is then a multiple of g below 2^24 g). Over e4m3fn's whole range g can be 2^-18 and the
    bound is 64: 32 + 2^-18 is exact, 64 + 2^-18 is not (25 bits). Values within one binade keep
    g = 2^-6 for products of [1, 2) values, so K = 4096 of them stay exact."""
    f8 = E4M3.dtype
    rng = np.random.default_rng(5)
    # within one binade: every |value| in [1, 2), random signs: g = 2^-6, sum |p| < 4K = 2^14 <= 2^18
    K = 4096
    a = (rng.choice(8, (16, K)) / 8 + 1) * rng.choice([-1, 1], (16, K))
    b = (rng.choice(8, (K, 16)) / 8 + 1) * rng.choice([-1, 1], (K, 16))
    a, b = a.astype(np.float32).astype(f8), b.astype(np.float32).astype(f8)
    exact = a.astype(np.float64) @ b.astype(np.float64)     # exact: multiples of 2^-6 below 2^20
    for name, got in _dots(a, b).items():
        assert np.array_equal(got.astype(np.float64), exact), name
    # the edge: 2 terms
    for big, is_exact in ((32.0, True), (64.0, False)):
        a = np.array([[big, T]] * 16, np.float32).astype(f8)
        b = np.array([[1.0] * 16, [T] * 16], np.float32).astype(f8)
        exact = big + T * T
        for name, got in _dots(a, b).items():
            assert (got.astype(np.float64) == exact).all() == is_exact, (name, big, got[0, 0])
            assert is_exact or (got == np.float32(big)).all()          # 64 + 2^-18 rounds to 64
    # the whole range, K = 256: the float32 sum is in general not the exact one
    a = rng.choice(finite_values(E4M3), (16, 256))
    b = rng.choice(finite_values(E4M3), (256, 16))
    exact = np.array([[math.fsum(a[i].astype(np.float64) * b[:, j].astype(np.float64)) for j in range(16)]
                      for i in range(16)])
    assert (_dots(a, b)["numpy"].astype(np.float64) != exact).mean() > 0.5
