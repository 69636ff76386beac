"""The instruction-set caps: one machine running the code paths other users' CPUs take.

Each cap is a set of environment variables that the libraries read when they start (torch's
ATen kernels, oneDNN, MKL, the fixed-order kernels, XLA:CPU), so it acts on a process that
starts with them set. This table is the one place they are written: the Makefile's
`test-cap-%` and `bench-cap-%` ask `python -m llamaspec.caps NAME` for them, and `probe where
--circumstance device --device-cap NAME` starts its second process with them.

    python -m llamaspec.caps avx2     # ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ...
    check("avx512")                    # DeviceError where this CPU lacks AVX-512
    environ("avx2", os.environ)        # a child process's environment under the cap
"""

from __future__ import annotations

import dataclasses
import platform
import sys
from collections.abc import Mapping

from . import cpuinfo
from .errors import LlamaParityError

XLA_CAP_FLAG = "--xla_cpu_max_isa="


class DeviceError(LlamaParityError, ValueError):
    """An instruction-set cap this CPU cannot honour (or that does not exist), or a device this
    machine does not have."""


@dataclasses.dataclass(frozen=True)
class Cap:
    name: str
    machine: str                           # the CPU it stands for
    variables: tuple[tuple[str, str], ...]  # (name, value), in the order a shell line gives them
    needs: tuple[str, ...]                 # the /proc/cpuinfo flags a CPU must report to run its code paths

    def line(self) -> str:
        """`NAME=value ...`, as `env` takes them."""
        return " ".join(f"{k}={v}" for k, v in self.variables)


CAPS: dict[str, Cap] = {c.name: c for c in (
    Cap("avx512", "an AVX-512 server without BF16 or AMX",
        (("ATEN_CPU_CAPABILITY", "avx512"), ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE"),
         ("MKL_ENABLE_INSTRUCTIONS", "AVX512"), ("LLAMA_PARITY_KERNEL_ISA", "avx512"),
         ("XLA_FLAGS", XLA_CAP_FLAG + "AVX512")),
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")),
    Cap("avx2", "an AVX2 laptop",
        (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
         ("LLAMA_PARITY_KERNEL_ISA", "avx2"), ("XLA_FLAGS", XLA_CAP_FLAG + "AVX2")),
        ("avx2", "fma", "f16c")),
    # XLA at AVX, not SSE4.2: there XLA:CPU fails to compile an fp16 rsqrt fusion ("Failed to
    # materialize symbols")
    Cap("baseline", "torch, oneDNN and MKL without AVX, the fixed-order kernels' scalar path, XLA at AVX",
        (("ATEN_CPU_CAPABILITY", "default"), ("ONEDNN_MAX_CPU_ISA", "SSE41"), ("MKL_ENABLE_INSTRUCTIONS", "SSE4_2"),
         ("LLAMA_PARITY_KERNEL_ISA", "scalar"), ("XLA_FLAGS", XLA_CAP_FLAG + "AVX")),
        ("sse4_2", "avx")),
)}
DEFAULT = "avx2"
# Every variable a cap sets (XLA's cap is one flag among XLA_FLAGS).
VARIABLES = tuple(dict.fromkeys(k for c in CAPS.values() for k, _ in c.variables))
# This CPU's own level, the best first: a name of its widest code path, for the reports' labels.
_LEVELS = (("amx_bf16", ("amx_bf16",)), ("avx512_bf16", ("avx512_bf16",)), *((c.name, c.needs) for c in CAPS.values()))


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def cap(name: str) -> Cap:
    """The table's entry; an unknown name is a DeviceError that lists the known ones."""
    if name not in CAPS:
        raise DeviceError(f"unknown instruction-set cap {name!r} (one of {', '.join(CAPS)})")
    return CAPS[name]


def missing(name: str, flags=None) -> tuple[str, ...]:
    """The flags cap `name` needs that the CPU (its /proc/cpuinfo flags, or `flags`) lacks."""
    have = cpuinfo.name_and_flags()[1] if flags is None else frozenset(flags)
    return tuple(f for f in cap(name).needs if f not in have)


def check(name: str, flags=None) -> Cap:
    """Cap `name` where this CPU can honour it: a DeviceError naming the cap and what the CPU
    lacks otherwise (capping to a code path the CPU has not is not a cap: the libraries would fall
    back to another path, or end the process on an illegal instruction)."""
    c = cap(name)
    if flags is None and not x86():
        raise DeviceError(f"instruction-set cap {name!r}: the caps are x86 code paths and this machine is "
                          f"{platform.machine() or 'of an unknown architecture'}")
    lacks = missing(name, flags)
    if lacks:
        cpu = cpuinfo.name_and_flags()[0] if flags is None else "this CPU"
        raise DeviceError(f"instruction-set cap {name!r} ({c.machine}): {cpu} lacks {', '.join(lacks)}, so it "
                          f"cannot run that code path; caps it can honour: {', '.join(honoured(flags)) or 'none'}")
    return c


def honoured(flags=None) -> list[str]:
    """The caps this CPU (or `flags`) can run."""
    return [n for n in CAPS if not missing(n, flags)]


def level(flags=None) -> str:
    """This CPU's (or `flags`') widest code path among the caps' and the 16-bit extensions:
    amx_bf16, avx512_bf16, avx512, avx2, baseline; "below baseline" under all of them."""
    have = cpuinfo.name_and_flags()[1] if flags is None else frozenset(flags)
    return next((n for n, needs in _LEVELS if all(f in have for f in needs)), "below baseline")


def in_force(env: Mapping[str, str]) -> list[str]:
    """The cap variables set in `env` ("NAME=value"; XLA's as its --xla_cpu_max_isa flag)."""
    out = [f"{k}={env[k]}" for k in VARIABLES if k != "XLA_FLAGS" and k in env]
    return out + [f for f in env.get("XLA_FLAGS", "").split() if f.startswith(XLA_CAP_FLAG)]


def this_cpu(env: Mapping[str, str]) -> str:
    """This CPU as a report names a side: its widest code path (its architecture off x86), and the
    caps in force in `env` (this process's environment) where any are: "this CPU (avx512_bf16)"."""
    what = level() if x86() else (platform.machine() or "unknown architecture")
    capped = in_force(env)
    return f"this CPU ({what}{', under ' + ' '.join(capped) if capped else ''})"


def environ(name: str, base: Mapping[str, str]) -> dict[str, str]:
    """`base` (a process's environment) with cap `name`'s variables set: XLA's cap replaces any
    --xla_cpu_max_isa among base's XLA_FLAGS and keeps the other flags."""
    out = dict(base)
    for k, v in cap(name).variables:
        if k == "XLA_FLAGS":
            kept = [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith(XLA_CAP_FLAG)]
            v = " ".join([*kept, v])
        out[k] = v
    return out


def main(argv=None) -> int:
    """`python -m llamaspec.caps NAME`: the cap's variables as one `env` line (exit 2, naming the
    caps, for an unknown one or one this CPU cannot honour)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m llamaspec.caps NAME ({', '.join(CAPS)})", file=sys.stderr)
        return 2
    try:
        print(check(argv[0]).line())
    except DeviceError as e:
        print(f"llamaspec.caps: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
