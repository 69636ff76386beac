"""The CPU this process runs on, as Linux names it: its model name and feature flags
(/proc/cpuinfo's first processor; elsewhere the platform's name and no flags). Read once."""

from __future__ import annotations

import functools
import platform


@functools.cache
def name_and_flags() -> tuple[str, frozenset]:
    name, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return name, flags


def has(flag: str) -> bool:
    """Whether the CPU reports feature `flag` ("amx_bf16", "avx512_bf16", ...)."""
    return flag in name_and_flags()[1]
