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
import functools
import os
import re
import subprocess
import sys

from .budget import MAX_HOST_DEVICES
from .errors import PolicyError

# reference: the policy's arithmetic, one plain path per op. fast: every speed path (kernels and
# library paths chosen for this machine), judged against the reference by the ladder.
# invariant: batch-invariant by construction (the fixed-order kernels; docs/invariance.md).
BACKENDS = ("reference", "fast", "invariant")

# The invariant backend's two implementations: "kernels" (llamaspec/fixed_order.h through ctypes /
# XLA's FFI: CPU code, the faster one where it builds) and "portable" (llamaspec.portable's element
# programs and products at one fixed shape: any device torch or XLA runs on). auto: kernels on a CPU
# where they build, portable elsewhere. Each model's plan reads it (setting()) and records its choice.
INVARIANT_ENV = "LLAMA_PARITY_INVARIANT"
INVARIANT_PATHS = ("auto", "kernels", "portable")

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


def declines(policy) -> str | None:
    """What of `policy` the fast and invariant backends do not take, in words (fp8 and KV-cache
    knobs, per-layer overrides: the reference computes them), or None; both models' plans read it."""
    what = [k for k in ("weight_fp8", "act_fp8", "kv_cache") if getattr(policy, k)]
    what += [f"{k} (layers[{sel}])" for sel, p in policy.layers for k in ("weight_fp8", "act_fp8", "kv_cache")
             if getattr(p, k)]
    if policy.layers:
        what.append("per-layer overrides")
    return ", ".join(what) or None


# The family features (llamaspec.config) the backends' ops take as they are: projections with
# biases, and a sliding window (a mask, which every backend's attention reads). Any other feature
# changes an op's arithmetic: the fast backend runs that op by the reference (family_declines),
# the invariant backend refuses the model (invariant_refuses).
_BACKEND_FEATURES = ("attention_bias", "o_bias", "mlp_bias", "sliding_window")


def family_declines(cfg) -> dict[str, str]:
    """{op: the family features of `cfg` its backend implementation does not take, in words}: on
    such a model that op runs the reference's function and the plan says why. The family's own
    steps (soft-caps, GELU, the embedding scale, q/k norms' placement) are reference functions in
    every backend; the ops they feed are listed here (the final soft-cap: final_cap_note)."""
    out = {}
    norm, attention, mlp = [], [], []
    if cfg.norm_offset:
        norm.append(f"the ({cfg.norm_offset:g} + weight) norm")
    if cfg.qk_norm:
        norm.append(f"q/k norm over the {cfg.qk_norm}")
    if cfg.attn_softcap is not None:
        attention.append(f"attention soft-capping ({cfg.attn_softcap:g})")
    if cfg.query_scale is not None:
        attention.append("a query scale other than 1/sqrt(head_dim)")
    if cfg.activation != "silu":
        mlp.append(f"the {cfg.activation} activation")
    for op, what in (("norm", norm), ("attention", attention), ("mlp", mlp)):
        if what:
            out[op] = ", ".join(what)
    return out


def final_cap_note(cfg) -> str:
    """What a plan adds to its logits op where the family soft-caps the logits ("" elsewhere)."""
    if cfg.final_softcap is None:
        return ""
    return f"; then final logit soft-capping ({cfg.final_softcap:g}) by the reference"


def describe_family(cfg) -> str:
    """A config's family and the features that differ from Llama's, in one line for a plan."""
    features = cfg.features()
    if "sliding_window" in features:        # one entry per layer: the windows and their layers
        windows = features["sliding_window"]
        features["sliding_window"] = ", ".join(f"{w} on {sum(x == w for x in windows)} of {len(windows)} layers"
                                               for w in sorted({x for x in windows if x is not None}))
    if "local_rope" in features:
        features["local_rope"] = f"theta {features['local_rope'].theta:g} ({features['local_rope'].type})"
    return cfg.model_type + "".join(f"; {k}={v}" for k, v in features.items())


def invariant_refuses(cfg) -> str | None:
    """The family features of `cfg` the invariant backend does not take (its ops are built for
    Llama's arithmetic; a reference op in their place would not be batch-invariant), or None."""
    what = sorted(set(cfg.features()) - set(_BACKEND_FEATURES))
    return ", ".join(what) or None


def check_family(cfg, backend: str) -> None:
    """A PolicyError naming the family features of `cfg` (None: Llama's) the invariant backend does
    not take, when that backend is asked for; both models' plans call it before deciding anything."""
    refused = None if cfg is None else invariant_refuses(cfg)
    if refused and backend == "invariant":
        raise PolicyError(f"model_type {cfg.model_type!r}: the invariant backend does not take {refused} "
                          "(its ops are Llama's; backend='reference' or 'fast' compute this family)")


# The functions (the same names in both models' ops.py) of each op a backend may decline for a family.
DECLINABLE_FUNCTIONS = {"norm": ("rms_norm", "norm_weight"), "attention": ("attention",),
                        "mlp": ("silu", "gelu_tanh")}


def family_ops(described: dict, backend: str, cfg, on_reference: bool) -> dict:
    """A plan's {op: words} for a model of config `cfg` (None: Llama's): the ops its family's
    features make the backend decline say so, unless the whole model runs on the reference already
    (on_reference: its words say why), and the logits op names the final soft-cap."""
    out = dict(described)
    if cfg is None:
        return out
    if not on_reference and backend != "reference":
        out.update({op: f"reference (the {backend} backend declines {what})"
                    for op, what in family_declines(cfg).items()})
    if cfg.final_softcap is not None:
        out["logits"] = out.get("logits", "reference") + final_cap_note(cfg)
    return out


class SettingError(PolicyError):
    """An environment variable set to a value outside the ones it takes (exit 2, naming both)."""


def setting(name: str, allowed: tuple[str, ...], value: str | None = None, default: str = "auto",
            error: type[Exception] = SettingError, note: str = "") -> str:
    """$name (or `value`, its setting read already) as one of `allowed`: the one reader of every
    LLAMA_PARITY_* choice. Case and surrounding blanks are ignored; unset or empty is `default`;
    anything else is `error` naming the variable, the value and the values it takes (note: a
    hint appended)."""
    raw = os.environ.get(name) if value is None else value
    choice = (raw or "").strip().lower() or default
    if choice not in allowed:
        raise error(f"{name}={raw!r}: expected {', '.join(allowed)}{note}")
    return choice


def check_xla_flags(flags: str | None = None) -> None:
    """$XLA_FLAGS (or `flags`) checked before JAX starts its backends: XLA parses them then, and an
    unknown flag, a value it cannot read or a value that is not a flag list (XLA reads it as the
    name of a file of flags) ends the process with XLA's own exit code (1, which this tool's
    callers read as "a finding"). Here each is a SettingError naming the flag: the form and the
    host device count (a count up to llamaspec.budget.MAX_HOST_DEVICES) are checked here, the
    other flags by XLA itself, once per value, in a child process (a fraction of a second). A
    process whose backends have started has had its flags read already: nothing to check."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    if not flags or _backends_started():
        return
    if not flags.lstrip().startswith("--"):
        problem = "it does not start with '--', so XLA would read it as the name of a file of flags"
    else:
        problem = _device_count_problem(flags)
        others = _DEVICE_COUNT.sub("", flags).strip()
        problem = problem or (_xla_verdict(others) if others else None)
    if problem:
        raise SettingError(f"XLA_FLAGS={flags!r}: {problem}; XLA would end the process (it takes flags "
                           "'--xla_name=value' separated by blanks, the ones its build knows)")


_DEVICE_COUNT = re.compile(r"(?<!\S)--xla_force_host_platform_device_count=(\S*)")


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


def _device_count_problem(flags: str) -> str | None:
    """The host device count (the flag this tool sets itself, for meshes) checked here: a count
    within MAX_HOST_DEVICES (10**8 devices abort XLA while it makes their threads)."""
    for value in _DEVICE_COUNT.findall(flags):
        if not re.fullmatch(r"[0-9]{1,12}", value):
            return f"--xla_force_host_platform_device_count={value}: expected a count of devices"
        if int(value) > MAX_HOST_DEVICES:
            return (f"--xla_force_host_platform_device_count={value} asks for more host devices than "
                    f"{MAX_HOST_DEVICES} (each has threads of its own)")
    return None


@functools.cache
def _xla_verdict(flags: str) -> str | None:
    """What XLA says of `flags` in a child process (None: it takes them)."""
    code = "from jaxlib import xla_client; xla_client.make_cpu_client()"
    try:
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "XLA_FLAGS": flags},
                           capture_output=True, text=True, errors="replace", timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None         # cannot ask: JAX will judge them itself
    if r.returncode == 0:
        return None
    said = r.stderr
    said_as = ((r"Unknown flag in XLA_FLAGS: (\S+)", "unknown flag {0}"),
               (r"Couldn't interpret value (.*) for flag (\S+?)\.?$", "--{1}: XLA cannot read the value {0}"),
               (r"Could not open file", "XLA reads a value not starting with '--' as a file of flags"))
    for pattern, what in said_as:
        m = re.search(pattern, said, re.M)
        if m:
            return what.format(*m.groups())
    last = [ln.strip() for ln in said.splitlines() if ln.strip()][-1:] or [f"exit code {r.returncode}"]
    return f"XLA refuses them ({last[0][:300]})"


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
    model: str = ""                       # the model's family and its features (describe_family), "" if not given

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
        if self.model:
            out["model"] = self.model
        out.update({f"library {k}": v for k, v in self.libraries})
        out.update({f"op {k}": v for k, v in self.ops})
        return out
