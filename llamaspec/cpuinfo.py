"""The CPU this process runs on, as Linux names it: its model name and feature flags
(/proc/cpuinfo's first processor; elsewhere the platform's name and no flags). Read once."""

from __future__ import annotations

import functools
import platform


@functools.cache
def _first_processor() -> dict[str, str]:
    """/proc/cpuinfo's fields of the first processor, up to its feature flags (empty where the
    file cannot be read: another OS)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if key.strip() in ("flags", "Features"):
                    break
    except OSError:
        pass
    return fields


@functools.cache
def name_and_flags() -> tuple[str, frozenset]:
    fields = _first_processor()
    flags = fields.get("flags", fields.get("Features", ""))
    return fields.get("model name") or platform.processor() or platform.machine(), frozenset(flags.split())


def vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo's vendor_id names it ("GenuineIntel", "AuthenticAMD",
    ...); "" where it does not say (another OS, another architecture)."""
    return _first_processor().get("vendor_id", "")


def has(flag: str) -> bool:
    """Whether the CPU reports feature `flag` ("amx_bf16", "avx512_bf16", ...)."""
    return flag in name_and_flags()[1]


# $LLAMA_PARITY_BF16_DOTS: how both models multiply 16-bit matrices on the CPU. auto: each model's
# rule by the CPU's features and the libraries' instruction-set caps (jaxmodel.ops.native_dots,
# torchref.ops.hardware_products); native or widened: that path on any CPU (the benchmark and the
# tests run both on one machine).
BF16_DOTS_ENV = "LLAMA_PARITY_BF16_DOTS"


def dots_choice(value: str | None = None) -> str:
    """$LLAMA_PARITY_BF16_DOTS (or `value`, its setting read already) as auto, native or
    widened (unset or empty: auto)."""
    from .plan import setting
    return setting(BF16_DOTS_ENV, ("auto", "native", "widened"), value)
