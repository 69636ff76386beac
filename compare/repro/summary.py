"""What a repro takes from a report: a ladder Report, or its JSON (untrusted: every field read is
checked, names and numbers only; nothing read from it ever names a file).

The sides a JSON report's names stand for, when the command line can make them again
(recreatable): torchref, jaxmodel (their reference backends too), transformers' class at a
dtype, a dump. A user's port or a patched model is an object, not a name: it must be handed to
write_repro itself.
"""

from __future__ import annotations

import dataclasses
import math
import re

from llamaspec import LlamaParityError, Policy, PolicyError
from llamaspec import taps as tapnames
from llamaspec.files import printable

from ..evidence import INFERRED, REFUSED
from ..vocabulary import KINDS


class ReproError(LlamaParityError, ValueError):
    """A repro that cannot be written: a report field that is not what a report holds, a side
    that cannot be made again, a unit outside the model, a policy whose oracle it cannot hold."""


_TAP = re.compile(r"^(embed|final_norm|logits|layers\.(\d{1,6})\.([a-z_]{1,20}))$")
_TEXT_LIMIT = 2000
# The environment lines a case's README repeats from the report (the rest is the report's).
ENV_KEYS = ("cpu", "cpu isa", "isa caps", "gpu", "python", "platform", "numpy", "torch", "jax", "jaxlib", "flax",
            "transformers")


@dataclasses.dataclass(frozen=True)
class Divergence:
    tap: str
    layer: int | None
    component: str
    kind: str
    hint: str


@dataclasses.dataclass(frozen=True)
class Summary:
    """The report as the repro reads it."""
    verdict: str
    divergence: Divergence | None
    reference: str
    candidate: str
    policy: Policy
    ratios: tuple[tuple[str, float], ...]   # (tap, precision ratio) where the report rated one
    twin_refused: str | None                # the ladder's note when it refused the candidate's twin
    keeps_f32_inferred: bool                # the ladder found f32 steps in the candidate's twin
    environment: dict                       # ENV_KEYS that the report has, as printable strings
    decode: "Decoded | None" = None         # a decode report's steps (compare.ladder.decode.DecodeReport)
    inputs: dict | None = None              # the report's inputs record (compare.results.inputs_record)


@dataclasses.dataclass(frozen=True)
class Decoded:
    """What a decode report says about its steps: the prompt's width T (left-aligned), the tokens
    fed at steps 1..N ([B, N]), the first step with the worst verdict (None: no finding) and the
    step whose taps it lists (the nearest a finding when there is none)."""
    prompt_tokens: int
    tokens: tuple               # B tuples of N token ids
    first_step: int | None
    taps_step: int


def summarize(report) -> Summary:
    """A Summary of a Report (compare.Report) or of its to_dict() / JSON document."""
    doc = report if isinstance(report, dict) else report.to_dict() if hasattr(report, "to_dict") else None
    if not isinstance(doc, dict):
        raise ReproError(f"report: a compare Report or its JSON object, not a {type(report).__name__}")
    verdict = doc.get("verdict")
    if verdict not in KINDS:
        raise ReproError(f"report: 'verdict' is {_shown(verdict)}, not one of {', '.join(KINDS)}")
    twin = doc.get("twin") if isinstance(doc.get("twin"), dict) else {}
    return Summary(verdict, _divergence(doc.get("first_divergence")), _name(doc, "reference"),
                   _name(doc, "candidate"), _policy(doc.get("policy")), _ratios(doc.get("taps")),
                   _text(twin.get("note"), "twin note") if twin.get("status") == REFUSED else None,
                   twin.get("status") == INFERRED, _environment(doc.get("environment")),
                   _decoded(doc) if "prompt_tokens" in doc else None, _inputs(doc.get("inputs")))


def _shown(x) -> str:
    return printable(repr(x))[:80]


def _text(x, what: str) -> str:
    if not isinstance(x, str):
        raise ReproError(f"report: {what} is {_shown(x)}, not text")
    return printable(x)[:_TEXT_LIMIT]


def _name(doc: dict, role: str) -> str:
    name = doc.get(role)
    if not isinstance(name, str) or not name or len(name) > 200:
        raise ReproError(f"report: '{role}' is {_shown(name)}, not an implementation's name")
    return printable(name)


def check_tap(name, what: str = "tap") -> str:
    """A tap name of the shared vocabulary (llamaspec.taps), checked as text: embed, final_norm,
    logits or layers.<i>.<step>; whether the model has it is the caller's to check."""
    m = _TAP.match(name) if isinstance(name, str) else None
    if not m or (m.group(3) is not None and m.group(3) not in tapnames.STEPS):
        raise ReproError(f"{what} {_shown(name)} is not a tap name (embed, layers.<i>.<step>, final_norm, logits)")
    return name


def _divergence(d) -> Divergence | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ReproError(f"report: 'first_divergence' is {_shown(d)}, not an object or null")
    tap = check_tap(d.get("tap"), "report: first_divergence.tap")
    kind, component = d.get("kind"), d.get("component")
    if kind not in KINDS:
        raise ReproError(f"report: first_divergence.kind is {_shown(kind)}, not one of {', '.join(KINDS)}")
    if component != tapnames.component_of(tap):
        raise ReproError(f"report: first_divergence.component {_shown(component)} is not tap {tap}'s "
                         f"({tapnames.component_of(tap)})")
    if d.get("layer") != tapnames.layer_of(tap):
        raise ReproError(f"report: first_divergence.layer {_shown(d.get('layer'))} is not tap {tap}'s")
    return Divergence(tap, tapnames.layer_of(tap), component, kind, _text(d.get("hint", ""), "first_divergence.hint"))


def _count(x, what: str, low: int, high: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not low <= x <= high:
        raise ReproError(f"report: {what} is {_shown(x)}, not a whole number in {low}..{high}")
    return x


def _decoded(doc: dict) -> Decoded:
    """A decode report's steps, checked: T, tokens [B, N] of whole numbers, the steps within 1..N."""
    tokens = doc.get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(r, list) and r for r in tokens) \
            or len({len(r) for r in tokens}) != 1:
        raise ReproError(f"report: 'tokens' is {_shown(tokens)}, not the decoded tokens [rows][steps]")
    rows = tuple(tuple(_count(t, "a decoded token", 0, 2 ** 31 - 1) for t in r) for r in tokens)
    n = len(rows[0])
    first = doc.get("first_step")
    return Decoded(_count(doc.get("prompt_tokens"), "'prompt_tokens'", 1, 2 ** 31 - 1), rows,
                   None if first is None else _count(first, "'first_step'", 1, n),
                   _count(doc.get("taps_step", 1), "'taps_step'", 1, n))


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _inputs(d) -> dict | None:
    """The inputs record (rows, tokens, real_tokens, sha256), checked; None where the report has
    none (a report written before it was recorded)."""
    if d is None or d == {}:
        return None
    if not isinstance(d, dict) or not isinstance(d.get("sha256"), str) or not _SHA256.match(d["sha256"]):
        raise ReproError(f"report: 'inputs' is {_shown(d)}, not the inputs' shape and SHA-256")
    return {"sha256": d["sha256"], **{k: _count(d.get(k), f"inputs.{k}", 0, 2 ** 40) for k in
                                      ("rows", "tokens", "real_tokens")}}


def _policy(d) -> Policy:
    try:
        return Policy.from_dict(d)
    except (PolicyError, TypeError, ValueError) as e:
        raise ReproError(f"report: 'policy' is not a policy's knobs ({printable(e)[:200]})") from None


def _ratios(taps) -> tuple:
    """(tap, precision ratio) of the report's rated taps; a list that is not a report's is an error."""
    if taps is None:
        return ()
    if not isinstance(taps, list):
        raise ReproError(f"report: 'taps' is {_shown(taps)}, not a list")
    out = []
    for v in taps:
        if not isinstance(v, dict):
            raise ReproError(f"report: an entry of 'taps' is {_shown(v)}, not an object")
        x = v.get("precision_ratio")
        if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
            out.append((check_tap(v.get("tap"), "report: taps[].tap"), float(x)))
    return tuple(out)


def _environment(env) -> dict:
    if not isinstance(env, dict):
        return {}
    return {k: printable(str(env[k]))[:200] for k in ENV_KEYS if isinstance(env.get(k), (str, int, float))}


# ----- names the command line can make again ------------------------------------------------------

_TRANSFORMERS = re.compile(r"^transformers\[(eager|sdpa), (float32|bfloat16|float16|float64)\]$")
_DTYPE_PRESET = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to make a report's side again: ("torchref" | "jaxmodel", backend) or ("transformers",
    attention implementation, the preset of its dtype) or ("dump", implementation name)."""
    kind: str
    detail: tuple = ()


def recipe(name: str) -> Recipe | None:
    """The Recipe for a side's name in a report, or None for one that is not a name the command
    line can make again (a port, a patched model, a sharded jaxmodel)."""
    for package in ("torchref", "jaxmodel"):
        if name == package:
            return Recipe(package, (None,))
        if name == f"{package} (reference backend)":
            return Recipe(package, ("reference",))
    m = _TRANSFORMERS.match(name)
    if m:
        return Recipe("transformers", (m.group(1), _DTYPE_PRESET[m.group(2)]))
    if name.endswith(" (dump)"):
        return Recipe("dump", (name.removesuffix(" (dump)"),))
    return None
