"""The plan: how a loaded model computes, decided once at load and held by the model.

A model's reference (torchref/ops.py, jaxmodel/ops.py) is one plain path per op and reads
nothing about the machine. Speed lives in backends beside it (`fast`, `invariant`); which
one runs, and what each of its ops does on this machine, is decided once, by the model's
plan module (torchref/plan.py, jaxmodel/plan.py): the only code that reads environment
variables, CPU flags and the libraries' caps. The result is this frozen record, the same
fields in both models, written into every report (compare.environment).

    m = torchref.from_pretrained(folder, policy="bf16", backend="fast")
    m.plan.backend            # "fast"
    m.plan.op("attention")    # e.g. "fixed-order kernel (prompts and decode steps)"
    m.plan.record()           # flat {name: value} for a report
"""

from __future__ import annotations

import dataclasses
import os

from .errors import PolicyError

# reference: the policy's arithmetic, one plain path per op. fast: every speed path (kernels and
# library paths chosen for this machine), judged against the reference by the ladder.
# invariant: batch-invariant by construction (the fixed-order kernels; docs/invariance.md).
BACKENDS = ("reference", "fast", "invariant")

# The ops a plan says something about, in both models (a backend's choice for each, or
# "reference" where it runs the reference's).
OPS = ("products", "logits", "attention", "rope", "norm", "mlp", "cache")

# The instruction-set extensions that change which kernels the libraries pick.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")


def backend_name(backend: str | None, batch_invariant: bool) -> str:
    """The backend from_pretrained's arguments ask for: `backend`, or `invariant` for
    batch_invariant=True (the older spelling), `fast` when neither is given; a clear error for
    an unknown name or a contradiction."""
    if backend is None:
        return "invariant" if batch_invariant else "fast"
    if backend not in BACKENDS:
        raise PolicyError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    if batch_invariant and backend != "invariant":
        raise PolicyError(f"batch_invariant=True asks for the invariant backend, backend={backend!r} for another")
    return backend


def read_settings(names) -> tuple[tuple[str, str], ...]:
    """(name, value) for each environment variable in `names` that is set, as the plan read it."""
    return tuple((n, os.environ[n]) for n in names if n in os.environ)


@dataclasses.dataclass(frozen=True)
class Plan:
    backend: str                          # one of BACKENDS
    framework: str                        # "torch" | "jax"
    device: str                           # "cpu", "cuda", "gpu", ... (the model's)
    policy: str                           # the policy's name
    cpu: str                              # the CPU's model name
    cpu_vendor: str                       # /proc/cpuinfo's vendor_id ("" where unknown)
    cpu_flags: tuple[str, ...]            # the ISA_FLAGS this CPU reports
    kernel_isa: str | None                # the fixed-order kernels' code path, None where not used or not built
    kernel_error: str | None              # why they could not be built (None: built, or not asked for)
    settings: tuple[tuple[str, str], ...]  # every environment variable the plan read that was set
    libraries: tuple[tuple[str, str], ...]  # library states the plan read (torch's BLAS, oneDNN, XLA's ISA cap)
    ops: tuple[tuple[str, str], ...]      # (op, how it runs) for each of OPS

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise PolicyError(f"plan: backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        missing = set(OPS) - {op for op, _ in self.ops}
        if missing:
            raise PolicyError(f"plan: no choice for {', '.join(sorted(missing))}")

    def op(self, name: str) -> str:
        """How op `name` (one of OPS) runs: "reference", or the backend's way."""
        return dict(self.ops)[name]

    def record(self) -> dict:
        """Flat {name: value}, JSON-safe, for a report's environment."""
        out = {"backend": self.backend, "framework": self.framework, "device": self.device,
               "policy": self.policy, "cpu": self.cpu, "cpu vendor": self.cpu_vendor or "unknown",
               "cpu isa": " ".join(self.cpu_flags) or "unknown",
               "fixed-order kernels": self.kernel_isa or (f"unavailable: {self.kernel_error}" if self.kernel_error
                                                          else "not used"),
               "settings": ", ".join(f"{k}={v}" for k, v in self.settings) or "none"}
        out.update({f"library {k}": v for k, v in self.libraries})
        out.update({f"op {k}": v for k, v in self.ops})
        return out
