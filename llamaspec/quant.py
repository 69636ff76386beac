"""fp8 quantization: the formats, the scalings, and the one rounding both models apply.

A Scaling names an fp8 format, which values share a scale (the granularity) and the scale's own
dtype, as a spec string or as fields:

    Scaling.parse("e4m3:block128")           # DeepSeek-V3's weights: 128 x 128 blocks, f32 scales
    Scaling.parse("e5m2:channel:bfloat16")   # one bf16 scale per output row of a [out, in] weight
    Scaling("float8_e4m3fn", "tensor")       # one scale for the whole tensor

quantize(x, scaling) -> (q, scales) and dequantize(q, scales, scaling, dtype) below are the
definition, in numpy with ml_dtypes' fp8 types; torchref/quant.py and jaxmodel/quant.py compute the
same bits with the same names (tests/test_fp8.py). Step by step:

1. x is read as float32 (exact from bfloat16, float16 and float32; float64 rounds to nearest even
   first), and float32 subnormals (|x| < 2^-126) count as zeros of their sign: XLA on CPU flushes
   them in every arithmetic operation, numpy and torch do not, so all three flush them here.
2. Groups. "tensor": the whole tensor (any rank) is one group; "channel": each row of a 2-D
   [out, in] weight; "block": N x N tiles of a 2-D tensor from its top-left corner, the last row
   and column of tiles cut short where N does not divide the shape. scales holds one value per
   group, shape scale_shape(x.shape): all ones for "tensor", [out, 1] for "channel",
   [ceil(out / N), ceil(in / N)] for "block".
3. scale = amax / fmt.max over the group (one float32 division), rounded to nearest even in
   scale_dtype, and at least fmt.min_scale (2^-126 / the format's smallest subnormal: every
   nonzero q x scale is then a normal float32, which no framework's flush-to-zero changes);
   a group whose amax is 0 gets scale 1.
4. q = round_to_fp8(x / scale): one float32 division per value (IEEE, as numpy and torch compute
   it; XLA would multiply by a rounded reciprocal, jaxmodel/quant.py prevents that), clipped to
   [-fmt.max, fmt.max], rounded to nearest even (fp8 subnormals included).
   The clip makes saturation explicit because the libraries disagree beyond max: torch 2.13
   saturates e4m3fn (finite and Inf alike) to +-448, ml_dtypes and XLA give NaN; all three give
   +-Inf for e5m2. With the clip all three give +-max. With a bfloat16 scale rounded down, the
   group's largest value lands up to 2^-8 above max before the clip; it becomes +-max.

Non-finite values. round_to_fp8 writes every NaN as the format's NaN fmt.nan_bits (0x7F for
e4m3fn, 0x7E for e5m2: what ml_dtypes writes for float32's NaN; torch writes 0x7F for e5m2),
whatever its sign or payload, and saturates +-Inf to +-max. In quantize a NaN or Inf makes its
group's amax non-finite, so the group's scale is NaN or Inf and the whole group dequantizes to
NaN (finite values become q = +-0, the non-finite ones NaN, and q x scale is NaN for both):
nothing non-finite is hidden by saturation, as in the amax-based recipes (DeepSeek-V3's act_quant,
torchao's float8), and other groups are untouched. A NaN scale's sign and payload are unspecified.

dequantize: q x scale, in float64 for dtype "float64" (always exact: 4 x 24 significant bits),
in float32 otherwise, then rounded once to dtype. The float32 product is exact when the scale has
at most 24 - 4 = 20 significant bits (e4m3fn; 21 for e5m2): every bfloat16 scale and every power
of two. A float32 scale in general makes it one rounding to nearest even, the same in all three
frameworks, so a float32 model's quantized weight is the fp64 twin's exact one, rounded once.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from .checkpoint import numpy_dtype
from .errors import PolicyError

TINY32 = 2.0 ** -126      # float32's smallest normal: quantize reads anything smaller as zero
INPUT_DTYPES = ("float64", "float32", "bfloat16", "float16")
OUTPUT_DTYPES = INPUT_DTYPES
SCALE_DTYPES = ("float32", "bfloat16")
GRANULARITIES = ("tensor", "channel", "block")


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """One fp8 format, as data (tests/test_fp8.py checks every number against ml_dtypes, torch
    and jax). The name is the dtype's name in all three libraries."""
    name: str
    exponent_bits: int
    mantissa_bits: int
    max: float                  # largest finite value
    smallest_normal: float
    smallest_subnormal: float
    has_inf: bool               # e5m2 encodes +-Inf (0x7C, 0xFC); e4m3fn ("finite") has none
    nan_bits: int               # every NaN is written as this byte (positive, quiet)
    nan_codes: tuple[int, ...]  # every byte that reads as NaN (e4m3fn: S.1111.111 only)

    @property
    def dtype(self) -> np.dtype:
        """The ml_dtypes numpy dtype."""
        return np.dtype(getattr(ml_dtypes, self.name))

    @property
    def min_scale(self) -> float:
        """The smallest scale quantize uses: smallest_subnormal x min_scale = 2^-126, float32's
        smallest normal, so a dequantized nonzero value is never a float32 subnormal."""
        return TINY32 / self.smallest_subnormal

    @property
    def nan(self) -> np.ndarray:
        """The format's NaN (nan_bits), a 0-d array of self.dtype."""
        return np.array(self.nan_bits, np.uint8).view(self.dtype)


FORMATS: dict[str, Fp8Format] = {
    "float8_e4m3fn": Fp8Format("float8_e4m3fn", exponent_bits=4, mantissa_bits=3, max=448.0,
                               smallest_normal=2.0 ** -6, smallest_subnormal=2.0 ** -9, has_inf=False,
                               nan_bits=0x7F, nan_codes=(0x7F, 0xFF)),
    "float8_e5m2": Fp8Format("float8_e5m2", exponent_bits=5, mantissa_bits=2, max=57344.0,
                             smallest_normal=2.0 ** -14, smallest_subnormal=2.0 ** -16, has_inf=True,
                             nan_bits=0x7E, nan_codes=(0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF)),
}
ALIASES = {"e4m3": "float8_e4m3fn", "e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_SHORT = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
_SCALE_ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16"}


def _full(aliases: dict, name):
    """name's full form where it is a short one (a non-string is left for the checks to name)."""
    return aliases.get(name, name) if isinstance(name, str) else name


def fp8_format(name: "str | Fp8Format") -> Fp8Format:
    """A format by its name ("float8_e4m3fn") or short name ("e4m3")."""
    if isinstance(name, Fp8Format):
        return name
    full = _full(ALIASES, name)
    if not isinstance(full, str) or full not in FORMATS:
        raise PolicyError(f"unknown fp8 format {name!r} (formats: {', '.join(FORMATS)}; "
                          f"short names: {', '.join(ALIASES)})")
    return FORMATS[full]


@dataclasses.dataclass(frozen=True)
class Scaling:
    """An fp8 format, the granularity of its scales (block: the side N of an N x N block) and
    the scales' dtype. Short names ("e4m3", "bf16") are accepted and stored as the full ones."""
    format: str
    granularity: str
    block: int | None = None
    scale_dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "format", _full(ALIASES, self.format))
        object.__setattr__(self, "scale_dtype", _full(_SCALE_ALIASES, self.scale_dtype))
        problem = _problem(self.format, self.granularity, self.block, self.scale_dtype)
        if problem:
            raise PolicyError(f"fp8 scaling (format={self.format!r}, granularity={self.granularity!r}, "
                              f"block={self.block!r}, scale_dtype={self.scale_dtype!r}): {problem}")

    @property
    def fmt(self) -> Fp8Format:
        return FORMATS[self.format]

    @property
    def spec(self) -> str:
        """The spec string parse() reads back: "e4m3:block128", "e5m2:channel:bfloat16"."""
        g = f"block{self.block}" if self.granularity == "block" else self.granularity
        tail = "" if self.scale_dtype == "float32" else f":{self.scale_dtype}"
        return f"{_SHORT[self.format]}:{g}{tail}"

    def __str__(self) -> str:
        return self.spec

    @staticmethod
    def parse(spec: str) -> "Scaling":
        """"FORMAT:GRANULARITY[:SCALE_DTYPE]": FORMAT e4m3 | e5m2 (or the full names),
        GRANULARITY tensor | channel | block<N>, SCALE_DTYPE float32 (default) | bfloat16."""
        if not isinstance(spec, str):
            raise PolicyError(f"an fp8 scaling spec is a string such as 'e4m3:block128', not {type(spec).__name__}")
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise PolicyError(f"fp8 scaling {spec!r}: expected FORMAT:GRANULARITY[:SCALE_DTYPE] "
                              "(e.g. 'e4m3:block128', 'e5m2:channel:bfloat16')")
        fmt, gran = _full(ALIASES, parts[0]), parts[1]
        scale_dtype = _full(_SCALE_ALIASES, parts[2]) if len(parts) == 3 else "float32"
        block = None
        if gran.startswith("block"):
            digits = gran[len("block"):]
            if not digits.isdigit():
                raise PolicyError(f"fp8 scaling {spec!r}: granularity {gran!r} needs the block side N "
                                  "as digits (e.g. 'block128')")
            gran, block = "block", int(digits)
        problem = _problem(fmt, gran, block, scale_dtype)
        if problem:
            raise PolicyError(f"fp8 scaling {spec!r}: {problem}")
        return Scaling(fmt, gran, block, scale_dtype)

    @staticmethod
    def get(scaling: "str | Scaling") -> "Scaling":
        """A Scaling, or one parsed from its spec string."""
        if isinstance(scaling, Scaling):
            return scaling
        return Scaling.parse(scaling)

    def group_shape(self, shape) -> tuple[int, ...]:
        """The extent of one group along each axis of a tensor of `shape` (checked: "channel" and
        "block" need a 2-D [out, in] tensor; no granularity takes an empty or 0-d one)."""
        shape = tuple(int(n) for n in shape)
        if not shape or 0 in shape:
            raise PolicyError(f"fp8 scaling {self.spec!r}: cannot quantize a tensor of shape {shape} "
                              "(needs at least one axis and no empty one)")
        if self.granularity == "tensor":
            return shape
        if len(shape) != 2:
            raise PolicyError(f"fp8 scaling {self.spec!r}: granularity {self.granularity!r} needs a 2-D "
                              f"[out, in] tensor, got shape {shape}")
        return (1, shape[1]) if self.granularity == "channel" else (self.block, self.block)

    def scale_shape(self, shape) -> tuple[int, ...]:
        """The shape of the scales for a tensor of `shape`: the number of groups along each axis."""
        return tuple(-(-n // b) for n, b in zip(shape, self.group_shape(shape)))

    def check_input(self, dtype: str, shape) -> None:
        """What quantize takes: a float tensor (dtype by name) of a shape this scaling can group."""
        if dtype not in INPUT_DTYPES:
            raise PolicyError(f"fp8 scaling {self.spec!r}: x has dtype {dtype}; quantize takes {INPUT_DTYPES}")
        self.group_shape(shape)

    def check_quantized(self, q_dtype: str, q_shape, scales_dtype: str, scales_shape, dtype: str) -> None:
        """What dequantize takes: q in this format, scales in scale_dtype with scale_shape(q's
        shape), and an output dtype; each mismatch is named."""
        if q_dtype != self.format:
            raise PolicyError(f"fp8 scaling {self.spec!r}: q has dtype {q_dtype}, expected {self.format}")
        want = self.scale_shape(q_shape)
        if scales_dtype != self.scale_dtype or tuple(scales_shape) != want:
            raise PolicyError(f"fp8 scaling {self.spec!r}: scales are {scales_dtype}{list(scales_shape)}; "
                              f"q of shape {tuple(q_shape)} needs {self.scale_dtype}{list(want)}")
        if dtype not in OUTPUT_DTYPES:
            raise PolicyError(f"fp8 scaling {self.spec!r}: dequantize dtype={dtype!r} is not one of {OUTPUT_DTYPES}")


def _problem(fmt, granularity, block, scale_dtype) -> str | None:
    """What is wrong with these Scaling fields (full names), naming the field; None if nothing."""
    if not isinstance(fmt, str) or fmt not in FORMATS:
        return (f"format={fmt!r} is not an fp8 format ({', '.join(FORMATS)}; "
                f"short names {', '.join(ALIASES)})")
    if granularity not in GRANULARITIES:
        return f"granularity={granularity!r} is not one of {GRANULARITIES} (block as 'block128' in a spec)"
    if granularity == "block":
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            return f"block={block!r} must be a positive integer (the side N of the N x N blocks)"
    elif block is not None:
        return f"block={block!r} is only for granularity 'block' (granularity is {granularity!r})"
    if scale_dtype not in SCALE_DTYPES:
        return f"scale_dtype={scale_dtype!r} is not one of {SCALE_DTYPES}"
    return None


# The reference arithmetic, in numpy (float32, ml_dtypes' fp8): the module docstring's steps.

def quantize(x, scaling: "str | Scaling") -> tuple[np.ndarray, np.ndarray]:
    """x (float64/32, bfloat16, float16) -> (q in scaling's fp8 dtype, scales in its scale_dtype,
    shape scaling.scale_shape(x.shape))."""
    scaling, x = Scaling.get(scaling), np.asarray(x)
    scaling.check_input(x.dtype.name, x.shape)
    fmt, group = scaling.fmt, scaling.group_shape(x.shape)
    x = x.astype(np.float32)
    with np.errstate(invalid="ignore"):     # a NaN or Inf makes its group NaN, as said above
        x = np.where(np.abs(x) < TINY32, x * 0, x)                  # float32 subnormals: +-0
        amax = _group_amax(x, group, scaling.scale_shape(x.shape))
        scale = (amax / np.float32(fmt.max)).astype(numpy_dtype(scaling.scale_dtype)).astype(np.float32)
        scale = np.where(amax == 0, np.float32(1), np.maximum(scale, np.float32(fmt.min_scale)))
        q = round_to_fp8(x / _expand(scale, group, x.shape), fmt)
    return q, scale.astype(numpy_dtype(scaling.scale_dtype))


def dequantize(q, scales, scaling: "str | Scaling", dtype: str = "float32") -> np.ndarray:
    """q x scale per value: in float64 for dtype "float64" (exact), else in float32, rounded to dtype."""
    scaling, q, scales = Scaling.get(scaling), np.asarray(q), np.asarray(scales)
    scaling.check_quantized(q.dtype.name, q.shape, scales.dtype.name, scales.shape, dtype)
    wide = np.float64 if dtype == "float64" else np.float32
    with np.errstate(invalid="ignore", over="ignore"):   # 0 x Inf scale: NaN; beyond float16: +-Inf
        w = q.astype(wide) * _expand(scales.astype(wide), scaling.group_shape(q.shape), q.shape)
        return w.astype(numpy_dtype(dtype))


def round_to_fp8(y: np.ndarray, fmt: "str | Fp8Format") -> np.ndarray:
    """float32 y -> fmt: clipped to +-fmt.max (saturation), rounded to nearest even; NaN -> fmt.nan."""
    fmt = fp8_format(fmt)
    q = np.clip(y, -fmt.max, fmt.max).astype(fmt.dtype)
    return np.where(np.isnan(y), fmt.nan, q)


def _group_amax(a: np.ndarray, group, grid) -> np.ndarray:
    """max |a| over each group, shape grid: a is zero-padded to whole groups (a zero never raises
    a maximum; a NaN still wins) and reshaped so that each group spans its own axes."""
    a = np.pad(np.abs(a), [(0, g * b - n) for n, b, g in zip(a.shape, group, grid)])
    tiles = a.reshape([d for g, b in zip(grid, group) for d in (g, b)])
    return tiles.max(axis=tuple(range(1, tiles.ndim, 2)))


def _expand(scale: np.ndarray, group, shape) -> np.ndarray:
    """Each group's scale repeated over its group, cut to `shape`."""
    for axis, b in enumerate(group):
        scale = np.repeat(scale, b, axis=axis)
    return scale[tuple(slice(0, n) for n in shape)]
