"""A checkpoint's chat template, rendered as the untrusted program it is (docs/threat-model.md).

transformers renders chat templates in jinja's ImmutableSandboxedEnvironment, which keeps a
template away from Python's internals and from mutating our objects; it puts no bound on
what a template may cost: `{{ 'a' * 10**10 }}` allocates 10 GB, two nested loops over
range(100000) run for hours. Here the same environment (same settings, helpers and
variables, so the text is the same) renders under three bounds, each a constant below:

- time: a deadline, checked at every loop step, call, operator, attribute or item read,
  output piece and joined buffer;
- size: every string or list that an operator, call, filter, `~` or `{% set %}` block makes,
  and the output, at most MAX_TEXT; the operations that multiply sizes in one step (`*`,
  `**`, `%` and format widths, center/indent/replace/join...) are checked BEFORE they run,
  the others after (they can at most double what was already checked);
- range() at most MAX_RANGE items, the template source at most MAX_TEMPLATE_CHARS.

A template that passes a bound, or fails (syntax error, undefined name, raise_exception,
a sandbox refusal, a Python error), is a TokenizerError naming the file and the line, never
quoting the template: a template is file contents. (raise_exception's own message, the
reason the template gives, is shown, escaped and at most 200 characters.)
"""

from __future__ import annotations

import json
import re
import string
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache, wraps
from types import TracebackType

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from .errors import TokenizerError
from .files import printable

MAX_TEMPLATE_CHARS = 128 * 1024   # source; the largest real ones (tool calling: gpt-oss, Command R) are ~20-30 KB
MAX_RENDER_SECONDS = 2.0          # wall time per render; real templates (Llama 3 with tools included) take milliseconds
MAX_TEXT = 4_000_000              # chars of output or of any string/list made: ~a million tokens, past any context
MAX_RANGE = 100_000               # items in one range(): jinja's own sandbox limit; templates count messages
MAX_INT_BITS = 1 << 16            # an int a template computes (~20,000 digits); templates count and index
MAX_JSON_INDENT = 1024            # tojson(indent=...): real templates indent by 2 or 4


class _Bound(Exception):
    """Raised inside a render when a bound is passed; becomes a TokenizerError. Not a
    ValueError or TypeError, so that no jinja filter's `except` swallows it."""


_state = threading.local()   # the render in progress on this thread: deadline, weights seen


def _tick() -> None:
    deadline = getattr(_state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _Bound(f"ran past the time limit of {MAX_RENDER_SECONDS:g} s (MAX_RENDER_SECONDS)")


def _too_big(size: int, what: str) -> _Bound:
    return _Bound(f"makes {what} of {size:,} items or characters, over the limit of {MAX_TEXT:,} (MAX_TEXT)")


# ---------------------------------------------------------------------- sizes


def _weight(value) -> int:
    """About the length of str(value): characters of strings plus items of containers, with
    a container shared N times counted N times (as its repr would print it), computed once
    per container per render (a list of itself doubled 40 times costs 40 steps, not 2**40)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if not isinstance(value, (list, tuple, dict, set, frozenset, jinja2.utils.Namespace)):
        return 1
    memo = getattr(_state, "weights", None)
    if memo is None:
        memo = {}
    key = id(value)
    if key in memo:
        return memo[key][1]
    memo[key] = (value, 1)             # a container inside itself (a namespace) counts once
    total = 1
    for child in _children(value):
        total += _weight(child)
        if total > MAX_TEXT:
            break
    memo[key] = (value, total)
    return total


def _children(value):
    if isinstance(value, jinja2.utils.Namespace):
        value = getattr(value, "_Namespace__attrs", {})
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield v
    else:
        yield from value


def _checked(value, what: str = "a value"):
    """`value` when it is within the size bounds (MAX_TEXT, MAX_INT_BITS), else _Bound."""
    _tick()
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise _Bound(f"computes an integer of {value.bit_length():,} bits, over the limit of "
                         f"{MAX_INT_BITS:,} (MAX_INT_BITS)")
        return value
    if _weight(value) > MAX_TEXT:
        raise _too_big(_weight(value), what)
    return value


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt: str, args) -> None:
    """`fmt % args` and `fmt|format(...)`: a width or precision over MAX_TEXT is refused
    before Python pads to it."""
    star = False
    for m in _PERCENT_SPEC.finditer(fmt):
        for n in m.groups():
            star |= n == "*"
            if n and n != "*" and int(n) > MAX_TEXT:
                raise _too_big(int(n), "a %-format width")
    values = args if isinstance(args, tuple) else (args,)
    if star:
        for v in values:
            if _is_int(v) and abs(v) > MAX_TEXT:
                raise _too_big(abs(v), "a %-format width")


def _check_format(fmt: str, args, kwargs) -> None:
    """str.format / format_map: a width in a field's spec over MAX_TEXT, or any int argument
    over it when a spec takes its width from an argument (`{:{}}`), is refused."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return                                      # the call itself raises it
    for _, _, spec, _ in fields:
        for n in re.findall(r"\d+", spec or ""):
            if int(n) > MAX_TEXT:
                raise _too_big(int(n), "a format width")
        if spec and "{" in spec:
            for v in (*args, *kwargs.values()):
                if _is_int(v) and abs(v) > MAX_TEXT:
                    raise _too_big(abs(v), "a format width")


def _check_binop(op: str, left, right) -> None:
    """The operators whose result can be far bigger than their operands, before they run."""
    if op == "*":
        seq, n = (left, right) if _is_int(right) else (right, left)
        if _is_int(n) and isinstance(seq, (str, list, tuple)) and n > 0 and _weight(seq) * n > MAX_TEXT:
            raise _too_big(_weight(seq) * n, "a repeated string or list")
        if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _Bound(f"multiplies integers past {MAX_INT_BITS:,} bits (MAX_INT_BITS)")
    elif op == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
        if left.bit_length() * right > MAX_INT_BITS:
            raise _Bound(f"raises an integer to a power past {MAX_INT_BITS:,} bits (MAX_INT_BITS)")
    elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        if _weight(left) + _weight(right) > MAX_TEXT:
            raise _too_big(_weight(left) + _weight(right), "a concatenation")
    elif op == "%" and isinstance(left, str):
        _check_printf(left, right)


# What a call may make, estimated before it runs: the str methods (named "str.<name>")
# and filters that can grow their input many times in one step.
_WIDTH_ARGS = {"str.center", "str.ljust", "str.rjust", "str.zfill", "str.expandtabs", "center", "indent",
               "wordwrap", "truncate", "batch", "slice", "round", "filesizeformat"}


def _estimate(name: str, args: tuple, kwargs: dict) -> int:
    """An upper bound of the result's size for the calls that can grow their input many
    times in one step (0 when `name` is not one of them); args[0] is the string or value."""
    s = args[0] if args else None
    rest = list(args[1:]) + list(kwargs.values())
    if name in ("replace", "str.replace") and isinstance(s, str) and len(rest) >= 2 \
            and isinstance(rest[0], str) and isinstance(rest[1], str):
        old, new = rest[0], rest[1]
        count = len(s) + 1 if not old else len(s) // len(old)
        return len(s) + count * max(0, len(new) - len(old))
    if name == "str.join" and isinstance(s, str) and rest:      # sep.join(items)
        return _weight(rest[0]) * (1 + len(s))
    if name == "join":                                           # items|join(sep)
        sep = rest[0] if rest and isinstance(rest[0], str) else ""
        return _weight(s) * (1 + len(sep))
    if name == "indent" and isinstance(s, str):
        width = rest[0] if rest else 4
        pad = len(width) if isinstance(width, str) else (width if _is_int(width) else 0)
        return len(s) + pad * (s.count("\n") + 1)
    if name == "str.expandtabs" and isinstance(s, str):
        size = rest[0] if rest and _is_int(rest[0]) else 8
        return len(s) + s.count("\t") * size
    if name == "wordwrap" and isinstance(s, str):
        wrap = next((x for x in rest if isinstance(x, str)), "\n")
        return len(s) * (1 + len(wrap))
    if name == "format" and isinstance(s, str):
        _check_printf(s, tuple(args[1:]) or kwargs)
    if name == "sum" and isinstance(kwargs.get("start", args[2] if len(args) > 2 else 0), (list, tuple)):
        return len(s) * _weight(s) if isinstance(s, (list, tuple)) else 0   # each partial sum is copied
    return 0


def _check_call(name: str, args: tuple, kwargs: dict) -> None:
    if name in _WIDTH_ARGS:
        for v in (*args[1:], *kwargs.values()):
            if _is_int(v) and abs(v) > MAX_TEXT:
                raise _too_big(abs(v), f"a width or count ({name})")
    size = _estimate(name, args, kwargs)
    if size > MAX_TEXT:
        raise _too_big(size, f"a string ({name})")


def _materialized(value, what: str):
    """A generator or map argument (`xs|map(...)|join`) as a list, stopped at MAX_TEXT: its
    items are made one by one, so the size is known before a join or a list holds them."""
    if not isinstance(value, Iterator):
        return value
    items, size = [], 0
    for item in value:
        _tick()
        size += _weight(item)
        if size > MAX_TEXT:
            raise _too_big(size, what)
        items.append(item)
    return items


# ---------------------------------------------------------------------- the environment


class _TemplateNamespace(jinja2.utils.Namespace):
    """transformers' TemplateNamespace: no underscore-prefixed attribute may be stored."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)
        memo = getattr(_state, "weights", None)
        if memo:
            memo.clear()                     # a namespace changed: sizes seen before may be stale

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError("an underscore-prefixed namespace attribute")


class _TemplateDict:
    """transformers' TemplateDict: dict() and dict.fromkeys(), nothing of the dict type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _range(*args):
    try:
        r = range(*args)
        n = len(r)
    except OverflowError:
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        raise _Bound(f"asks for a range of more than {MAX_RANGE:,} items (MAX_RANGE)")
    return r


def _iterate(value):
    """Every `{% for %}` loops through this: one clock check per item."""
    _tick()
    for item in value:
        _tick()
        yield item


def _concat(parts) -> str:
    """`a ~ b`: the parts' sizes checked before the join."""
    _tick()
    if sum(_weight(p) for p in parts) > MAX_TEXT:
        raise _too_big(sum(_weight(p) for p in parts), "a `~` concatenation")
    return _checked("".join(str(p) for p in parts))


def _join_buffer(pieces) -> str:
    """Environment.concat: every `{% set %}` block, macro and filter block joins its output
    through this, so none can build more than MAX_TEXT."""
    pieces = list(pieces)
    _tick()
    total = sum(len(p) for p in pieces)
    if total > MAX_TEXT:
        raise _too_big(total, "a block's output")
    return "".join(pieces)


def _finalize(value):
    """Every `{{ ... }}`: its size checked before it becomes text."""
    return _checked(value, "an output")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters, which would change the prompt text
    # (transformers' override, the same arguments); streamed so it stops at MAX_TEXT.
    pad = len(indent) if isinstance(indent, str) else (indent or 0)
    if pad > MAX_JSON_INDENT:
        raise _Bound(f"asks tojson for an indent of {pad:,}, over the limit of {MAX_JSON_INDENT} (MAX_JSON_INDENT)")
    _checked(x, "a tojson input")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return _joined(encoder.iterencode(x), "a tojson output")


def _joined(pieces, what: str) -> str:
    """The pieces of a text made piece by piece, refused past MAX_TEXT as they come (the deadline
    checked at each)."""
    out, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > MAX_TEXT:
            raise _too_big(size, what)
        _tick()
        out.append(piece)
    return "".join(out)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _guard_filter(name: str, f):
    @wraps(f)                    # keeps jinja's pass_context / pass_environment marks
    def guarded(*args, **kwargs):
        _tick()
        at = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0    # after the context
        what = f"the input of |{name}"
        args = (*args[:at], *(_checked(_materialized(v, what), what) for v in args[at:]))
        kwargs = {k: _checked(_materialized(v, what), what) for k, v in kwargs.items()}
        _check_call(name, args[at:], kwargs)
        return _checked(f(*args, **kwargs), f"the output of |{name}")
    return guarded


class _Loops(NodeTransformer):
    """Every for-loop iterates through |_lp_iterate (a clock check per item) and every `~`
    through |_lp_concat (sizes checked before the join)."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_lp_iterate", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        items = nodes.List(node.nodes, lineno=node.lineno)
        return nodes.Filter(items, "_lp_concat", [], [], None, None, lineno=node.lineno)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment whose every call, operator, attribute and item read
    checks the clock and the size of what it made (the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "-", "/", "//", "%"})   # also keeps them out of constant folding
    intercepted_unops = frozenset({"-", "+"})
    concat = staticmethod(_join_buffer)

    def call_binop(self, context, operator, left, right):
        _tick()
        _check_binop(operator, left, right)
        return _checked(super().call_binop(context, operator, left, right), f"the result of `{operator}`")

    def call_unop(self, context, operator, arg):
        _tick()
        return super().call_unop(context, operator, arg)

    def getattr(self, obj, attribute):
        _tick()
        return _checked(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        _tick()
        return _checked(super().getitem(obj, argument))

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        @wraps(wrapper)
        def checked(*args, **kwargs):
            _check_format(fmt, args, args[0] if is_map and args and isinstance(args[0], dict) else kwargs)
            return _checked(wrapper(*args, **kwargs), "a formatted string")
        return checked

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        _tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):                        # 'x'.center(10**10), sep.join(...)
            args = tuple(_materialized(a, "a str method's input") for a in args)
            _check_call(f"str.{getattr(__obj, '__name__', '')}", (owner, *args), kwargs)
        return _checked(super().call(__context, __obj, *args, **kwargs), "a call's result")


def _environment() -> _BoundedSandbox:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                          finalize=_finalize)
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = _guard_filter("tojson", _tojson)
    env.filters["_lp_iterate"] = _iterate
    env.filters["_lp_concat"] = _concat
    env.globals.pop("lipsum", None)          # makes text by the paragraph; no chat template uses it
    env.globals.update(range=_range, raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env


# ---------------------------------------------------------------------- compile and render


def _line(exc: BaseException) -> str:
    """' at line N' of the template where `exc` was raised, from its traceback (jinja maps
    template frames back to template lines, in frames named <template>)."""
    line = getattr(exc, "lineno", None) if isinstance(exc, jinja2.TemplateSyntaxError) else None
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at line {line}" if line else ""


@lru_cache(maxsize=None)
def _error_type(cls: type) -> type:
    """TokenizerError, and also the jinja error class it stands for (SecurityError,
    TemplateSyntaxError...), so that code catching jinja's errors, as it would around
    transformers, still catches it."""
    if not issubclass(cls, jinja2.TemplateError):
        return TokenizerError
    return type(f"ChatTemplate{cls.__name__}", (TokenizerError, cls),
                {"__module__": __name__, "__str__": BaseException.__str__})   # our message, not jinja's


_OWN_WORDS = 200   # characters of a raise_exception message shown (escaped): the template's reason


def _refusal(where: str, exc: BaseException, when: str) -> TokenizerError:
    """The TokenizerError for `exc`: names the file, the line and the kind of failure, never
    the template's text (file contents). The one thing quoted is what the template meant to
    say, raise_exception's message (e.g. "roles must alternate"), escaped and shortened."""
    at = _line(exc)
    if isinstance(exc, _Bound):
        why = str(exc)
    elif isinstance(exc, jinja2.TemplateSyntaxError):
        why = "has a syntax error (TemplateSyntaxError)"
    elif isinstance(exc, jinja2.UndefinedError):
        why = "uses an undefined name or attribute (UndefinedError)"
    elif isinstance(exc, jinja2.exceptions.SecurityError):
        why = "tried something the sandbox forbids (SecurityError)"
    elif type(exc) is jinja2.TemplateError:
        said = printable(str(exc.message or ""))
        said = said if len(said) <= _OWN_WORDS else said[:_OWN_WORDS] + "..."
        why = f'refused these messages with raise_exception, saying "{said}"'
    elif isinstance(exc, (RecursionError, SyntaxError)):
        why = f"is nested or recurses too deeply ({type(exc).__name__})"
    else:
        why = f"failed ({type(exc).__name__})"
    return _error_type(type(exc))(f"{where}: the chat template {why}{at}, {when}; it is checkpoint data, "
                                  "not something llama-parity can fix")


@lru_cache(maxsize=32)
def _compile_source(source: str):
    env = _environment()
    tree = _Loops().visit(env.parse(source))
    tree.set_environment(env)
    return env.from_string(tree)


def compile_template(source: str, where: str):
    """The jinja Template for `source` (a checkpoint's chat template, from the file `where`),
    compiled in the bounded sandbox; a TokenizerError naming `where` if it cannot be."""
    if not isinstance(source, str):
        raise TokenizerError(f"{where}: the chat template is a {type(source).__name__}, not a string")
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TokenizerError(f"{where}: the chat template is {len(source):,} characters long, over the limit of "
                             f"{MAX_TEMPLATE_CHARS:,} (MAX_TEMPLATE_CHARS); it is not compiled")
    _state.deadline = time.monotonic() + MAX_RENDER_SECONDS    # constant folding runs filters
    _state.weights = {}
    try:
        return _compile_source(source)
    except Exception as exc:  # noqa: BLE001 - any failure to compile checkpoint data is bad input
        raise _refusal(where, exc, "when compiled") from None
    finally:
        _state.deadline = _state.weights = None


def render(source: str, where: str, **variables) -> str:
    """`source` rendered with `variables`, within the module's bounds; a TokenizerError
    naming `where` (the checkpoint's file) for any bound passed or any template error."""
    template = compile_template(source, where)
    _state.deadline = time.monotonic() + MAX_RENDER_SECONDS
    _state.weights = {}
    try:
        return _joined(template.generate(**variables), "an output")
    except Exception as exc:  # noqa: BLE001 - whatever the template raised, it is the template's doing
        raise _refusal(where, exc, "when rendered") from None
    finally:
        _state.deadline = _state.weights = None
