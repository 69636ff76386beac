"""Issue 58, class 2 (and the template part of class 6): a checkpoint's chat template and
tokenizer files are untrusted data (docs/threat-model.md). A template runs in jinja's
immutable sandbox with a deadline and size caps (llamaspec.chat_template); every tokenizer
file is read bounded, regular files only (llamaspec.tokenizer.read_bytes). Each hostile case
must end, within seconds, as a TokenizerError naming the checkpoint's file and the bound (exit
2 from the CLI), never quoting the file; a real template renders exactly as before."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from llama_parity.cli import main
from llamaspec import chat_template as ct
from llamaspec import tokenizer as tk
from llamaspec.errors import TokenizerError
from llamaspec.tokenizer import Tokenizer

MARK = "SECRET-MARK-58"          # planted in hostile files: must never appear in a message
USER = [{"role": "user", "content": "hi"}]


def _backend():
    """A tiny word-level tokenizer.json (no training): a few words and the special tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hi", "hello", "user", "assistant", ":", "a", "b"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend


def _folder(tmp_path: Path, template: str | None = None, *, in_config: bool = False) -> Path:
    """A tokenizer folder: tokenizer.json, tokenizer_config.json, the template as
    chat_template.jinja (or in tokenizer_config.json's chat_template field)."""
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    _backend().save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if template is not None and in_config:
        config["chat_template"] = template
    elif template is not None:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# ---------------------------------------------------------------------- hostile templates

# (id, template, words the message must hold). Each one unbounded runs for hours, fills the
# memory, or ends as a bare jinja/Python error (exit 3).
HOSTILE_TEMPLATES = [
    ("string-times-billions", "{{ 'a' * 10**10 }}", ["MAX_TEXT", "repeated"]),
    ("string-times-billions-by-variable", "{% set n = 10**5 %}{{ ('" + MARK + "' * n) * n }}", ["MAX_TEXT"]),
    ("list-times-billions", "{% set x = [0] * 10**10 %}{{ x|length }}", ["MAX_TEXT", "repeated"]),
    ("list-of-strings-times", "{{ (['x' * 1000000] * 100)|join }}", ["MAX_TEXT"]),
    ("huge-power", "{{ 7 ** (10 ** 9) }}", ["MAX_INT_BITS"]),
    ("squaring-loop", "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
                      "{% endfor %}{{ ns.x }}", ["MAX_INT_BITS"]),
    ("range-a-billion", "{% for i in range(10**9) %}{{ i }}{% endfor %}", ["MAX_RANGE"]),
    ("range-beyond-ssize-t", "{{ range(10**30)|length }}", ["MAX_RANGE"]),
    ("nested-loops-silent", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     ["MAX_RENDER_SECONDS", "time limit"]),
    ("nested-loops-over-lists", "{% set xs = range(100000)|list %}{% for i in xs %}{% for j in xs %}"
                                "{% if i == j and i < 0 %}x{% endif %}{% endfor %}{% endfor %}",
     ["MAX_RENDER_SECONDS"]),
    ("nested-loops-printing", "{% for i in range(100000) %}{% for j in range(100000) %}ab{% endfor %}{% endfor %}",
     ["MAX_TEXT", "output"]),
    ("macro-infinite-recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
     ["RecursionError"]),
    ("macro-exponential-calls", "{% macro f(n) %}{% if n > 0 %}{% set a = f(n-1) %}{% set b = f(n-1) %}"
                                "{% endif %}{% endmacro %}{{ f(64) }}", ["MAX_RENDER_SECONDS"]),
    ("macro-doubling-output", "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='ab') %}"
                              "{% for i in range(64) %}{% set ns.s = d(ns.s) %}{% endfor %}", ["MAX_TEXT"]),
    ("namespace-doubling-tilde", "{% set ns = namespace(s='a') %}{% for i in range(64) %}"
                                 "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}", ["MAX_TEXT"]),
    ("namespace-doubling-block-set", "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s %}"
                                     "{{ ns.s }}{{ ns.s }}{% endset %}{% endfor %}", ["MAX_TEXT"]),
    ("block-set-loop-of-a-big-string", "{% set ns = namespace(s='a' * 1000000) %}{% set x %}"
                                       "{% for i in range(100000) %}{{ ns.s }}{% endfor %}{% endset %}{{ x }}",
     ["MAX_TEXT"]),
    ("shared-list-doubling-printed", "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}"
                                     "{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}", ["MAX_TEXT"]),
    ("shared-namespace-doubling", "{% set ns = namespace(x=1) %}{% for i in range(64) %}"
                                  "{% set ns.x = namespace(a=ns.x, b=ns.x) %}{% endfor %}{{ ns.x }}", ["MAX_TEXT"]),
    ("center-ten-billion", "{{ 'a'|center(10**10) }}", ["MAX_TEXT", "center"]),
    ("ljust-method-ten-billion", "{{ 'a'.ljust(10**10) }}", ["MAX_TEXT", "ljust"]),
    ("indent-wide", "{{ ('\n' * 1000000)|indent(1000) }}", ["MAX_TEXT", "indent"]),
    ("replace-empty-with-big", "{% set s = 'a' * 1000000 %}{{ s.replace('', s) }}", ["MAX_TEXT", "replace"]),
    ("replace-filter-growth", "{% set s = 'a' * 1000000 %}{{ s|replace('a', s) }}", ["MAX_TEXT", "replace"]),
    ("format-method-width", "{{ '{:>10000000000}'.format(1) }}", ["MAX_TEXT", "format"]),
    ("format-method-nested-width", "{{ '{:{}}'.format(1, 10**10) }}", ["MAX_TEXT", "format"]),
    ("percent-width", "{{ '%10000000000d' % 1 }}", ["MAX_TEXT"]),
    ("percent-star-width", "{{ '%*d' % (10**10, 1) }}", ["MAX_TEXT"]),
    ("format-filter-width", "{{ '%.10000000000f'|format(1.5) }}", ["MAX_TEXT"]),
    ("map-center-join", "{{ range(100000)|map('center', 3000000)|join }}", ["MAX_TEXT"]),
    ("tojson-indent-billion", "{{ [[[[1]]]]|tojson(indent=10**9) }}", ["MAX_JSON_INDENT"]),
    ("sum-of-lists-quadratic", "{{ (range(3000)|batch(1)|list)|sum(start=[])|length }}"
                               "{{ ((range(50000)|list * 40)|batch(1)|list)|sum(start=[])|length }}", ["MAX_TEXT"]),
    ("dict-fromkeys-big", "{{ dict.fromkeys(range(100000), 'a' * 1000000) }}", ["MAX_TEXT"]),
    ("deep-nesting-blocks", "{% if true %}" * 400 + MARK + "{% endif %}" * 400, ["nested", "compiled"]),
    ("deep-nesting-parentheses", "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", ["nested", "compiled"]),
    ("python-internals-mro", "{{ ''.__class__.__mro__[1].__subclasses__() }}", ["SecurityError"]),
    ("python-internals-globals", "{{ raise_exception.__globals__['os'] }}", ["SecurityError"]),
    ("cycler-internals", "{{ cycler.__init__.__globals__.os }}", ["SecurityError"]),
    ("mutate-messages", "{% set _ = messages.append({'role': 'x'}) %}{{ messages|length }}", ["SecurityError"]),
    ("namespace-underscore-attribute", "{% set ns = namespace() %}{% set ns._x = 1 %}", ["SecurityError"]),
    ("syntax-error", "{% for m in messages %}{{ m.content }}{% " + MARK + " %}", ["syntax error", "line 1"]),
    ("syntax-error-unclosed", "{% if messages %}\n{{ " + MARK, ["syntax error"]),
    ("undefined-attribute", "{{ messages[0].content }}\n{{ " + MARK.replace("-", "_") + ".x }}",
     ["undefined", "line 2"]),
    ("undefined-call", "{{ no_such_function() }}", ["undefined"]),
    ("type-error", "{{ messages + 1 }}", ["TypeError"]),
    ("zero-division", "{{ 1 // 0 }}", ["ZeroDivisionError"]),
    ("int-too-long-for-str", "{{ (10 ** 5000)|string }}", ["ValueError"]),
    ("lipsum-removed", "{{ lipsum(10**9) }}", ["undefined"]),
    ("template-over-size-cap", "{# " + "x" * (ct.MAX_TEMPLATE_CHARS + 1) + " #}", ["MAX_TEMPLATE_CHARS"]),
]


@pytest.mark.parametrize("template,words", [c[1:] for c in HOSTILE_TEMPLATES],
                         ids=[c[0] for c in HOSTILE_TEMPLATES])
def test_hostile_template_is_refused_in_bounded_time(tmp_path, template, words):
    folder = _folder(tmp_path, template)
    tok = Tokenizer.from_pretrained(folder)
    start = time.monotonic()
    with pytest.raises(TokenizerError) as info:
        tok.encode_chat("hi")
    took = time.monotonic() - start
    message = str(info.value)
    assert str(folder / "chat_template.jinja") in message
    for word in words:
        assert word in message, message
    assert MARK not in message and MARK.replace("-", "_") not in message
    # the bound is the deadline plus one step: never the minutes an unbounded render takes
    assert took < ct.MAX_RENDER_SECONDS + 8, took


def test_raise_exception_is_an_input_error_with_the_templates_reason_escaped(tmp_path):
    """raise_exception is how a template says the messages do not fit it: its reason is
    shown (escaped, shortened), the error is both a TokenizerError and jinja's TemplateError."""
    import jinja2

    folder = _folder(tmp_path, "{{ raise_exception('roles must alternate\x1b]0;pwned\x07' + 'x' * 5000) }}")
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_pretrained(folder).encode_chat("hi")
    message = str(info.value)
    assert isinstance(info.value, jinja2.TemplateError)
    assert "roles must alternate" in message and "raise_exception" in message
    assert "\x1b" not in message and "\x07" not in message
    assert "x" * 300 not in message


def test_template_in_tokenizer_config_is_named_by_its_field(tmp_path):
    folder = _folder(tmp_path, "{{ 'a' * 10**10 }}", in_config=True)
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json \(field chat_template\).*MAX_TEXT"):
        Tokenizer.from_pretrained(folder).encode_chat("hi")


def test_bounded_render_is_refused_in_the_middle_not_after(tmp_path):
    """The deadline stops a render that would run for hours: the time taken is the deadline
    (a little more on a busy machine), measured here rather than assumed."""
    silent_loops = dict((c[0], c[1]) for c in HOSTILE_TEMPLATES)["nested-loops-silent"]
    tok = Tokenizer.from_pretrained(_folder(tmp_path, silent_loops))
    start = time.monotonic()
    with pytest.raises(TokenizerError, match="MAX_RENDER_SECONDS"):
        tok.apply_chat_template(USER)
    assert ct.MAX_RENDER_SECONDS <= time.monotonic() - start < ct.MAX_RENDER_SECONDS + 8


# ---------------------------------------------------------------------- through the CLI


CLI_TEMPLATES = [
    ("string-times-billions", "{{ 'a' * 10**10 }}", "MAX_TEXT"),
    ("nested-loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "MAX_RENDER_SECONDS"),
    ("syntax-error", "{% for %}", "syntax error"),
    ("undefined", "{{ " + MARK.replace("-", "_") + ".x }}", "undefined"),
    ("security", "{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("raise-exception", "{{ raise_exception('no system role') }}", "no system role"),
]


@pytest.mark.parametrize("template,word", [c[1:] for c in CLI_TEMPLATES], ids=[c[0] for c in CLI_TEMPLATES])
def test_cli_exit_2_for_a_hostile_template(tmp_path, tiny_dir, capsys, template, word):
    """`probe` reads the tokenizer first: a bad template is bad input (exit 2), not an
    internal error (exit 3), and the message names the file."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir("gqa"), folder)
    shutil.copytree(_folder(tmp_path, template), folder, dirs_exist_ok=True)
    code = main(["probe", "determinism", str(folder), "--impl", "torchref"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(folder / "chat_template.jinja") in err and word in err, err
    assert "internal error" not in err and MARK not in err


# ---------------------------------------------------------------------- hostile tokenizer files


def _symlink_to_sparse(path: Path, tmp: Path, size: int):
    target = tmp / "sparse.bin"
    with open(target, "wb") as f:
        f.truncate(size)                      # a terabyte claimed, no block written
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def _fifo(path: Path, tmp: Path):
    path.unlink(missing_ok=True)
    os.mkfifo(path)                           # opening it for reading would wait for a writer forever


def _dev_zero(path: Path, tmp: Path):
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def _folder_in_place(path: Path, tmp: Path):
    path.unlink(missing_ok=True)
    path.mkdir()


def _oversize(limit_name: str):
    def plant(path: Path, tmp: Path):
        limit = getattr(tk, limit_name) if hasattr(tk, limit_name) else 4 * ct.MAX_TEMPLATE_CHARS
        with open(path, "wb") as f:           # a real regular file, one byte over (sparse: no disk used)
            f.write(b'{"' + MARK.encode() + b'": 1}')
            f.truncate(limit + 1)
    return plant


def _json_bomb(path: Path, tmp: Path):
    depth = 200_000
    path.write_text("[" * depth + '"' + MARK + '"' + "]" * depth)


def _dict_bomb(path: Path, tmp: Path):
    depth = 100_000
    path.write_text('{"a":' * depth + '"' + MARK + '"' + "}" * depth)


def _broken_link(path: Path, tmp: Path):
    path.unlink(missing_ok=True)
    path.symlink_to(tmp / "nowhere" / "tokenizer.json")


def _not_utf8(path: Path, tmp: Path):
    path.write_bytes(b"\xff\xfe" + MARK.encode())


def _json_not_a_tokenizer(path: Path, tmp: Path):
    path.write_text(json.dumps({"version": "1.0", "model": {"type": MARK, "vocab": {MARK: 0}}}))


def _long_integer(path: Path, tmp: Path):
    path.write_text('{"x": ' + "9" * 10_000 + "}")


def _token_id_not_an_int(path: Path, tmp: Path):
    path.write_text(json.dumps({"eos_token_id": {"nested": MARK}}))


def _token_id_out_of_range(path: Path, tmp: Path):
    path.write_text(json.dumps({"bos_token_id": -5}))


HOSTILE_FILES = [
    # (id, file, plant, words the message must hold)
    ("tokenizer-json-symlink-to-sparse-terabyte", "tokenizer.json",
     lambda p, t: _symlink_to_sparse(p, t, 1 << 40), ["MAX_TOKENIZER_BYTES", "a symlink to"]),
    ("tokenizer-json-fifo", "tokenizer.json", _fifo, ["not a regular file", "FIFO"]),
    ("tokenizer-json-dev-zero", "tokenizer.json", _dev_zero, ["not a regular file", "/dev/zero"]),
    ("tokenizer-json-a-folder", "tokenizer.json", _folder_in_place, ["not a regular file", "folder"]),
    ("tokenizer-json-oversize", "tokenizer.json", _oversize("MAX_TOKENIZER_BYTES"), ["MAX_TOKENIZER_BYTES"]),
    ("tokenizer-json-nested-bomb", "tokenizer.json", _json_bomb, ["nested too deeply"]),
    ("tokenizer-json-broken-symlink", "tokenizer.json", _broken_link, ["broken symlink"]),
    ("tokenizer-json-not-utf8", "tokenizer.json", _not_utf8, ["not UTF-8"]),
    ("tokenizer-json-valid-json-not-a-tokenizer", "tokenizer.json", _json_not_a_tokenizer, ["cannot load it"]),
    ("tokenizer-config-fifo", "tokenizer_config.json", _fifo, ["not a regular file", "FIFO"]),
    ("tokenizer-config-dev-zero", "tokenizer_config.json", _dev_zero, ["not a regular file"]),
    ("tokenizer-config-sparse-terabyte", "tokenizer_config.json",
     lambda p, t: _symlink_to_sparse(p, t, 1 << 40), ["MAX_JSON_BYTES"]),
    ("tokenizer-config-oversize", "tokenizer_config.json", _oversize("MAX_JSON_BYTES"), ["MAX_JSON_BYTES"]),
    ("tokenizer-config-nested-bomb", "tokenizer_config.json", _dict_bomb, ["nested too deeply"]),
    ("tokenizer-config-long-integer", "tokenizer_config.json", _long_integer, ["not readable as JSON"]),
    ("special-tokens-map-fifo", "special_tokens_map.json", _fifo, ["not a regular file"]),
    ("special-tokens-map-nested-bomb", "special_tokens_map.json", _json_bomb, ["nested too deeply"]),
    ("chat-template-jinja-fifo", "chat_template.jinja", _fifo, ["not a regular file"]),
    ("chat-template-jinja-dev-zero", "chat_template.jinja", _dev_zero, ["not a regular file"]),
    ("chat-template-jinja-sparse-terabyte", "chat_template.jinja",
     lambda p, t: _symlink_to_sparse(p, t, 1 << 40), ["MAX_TEMPLATE_CHARS"]),
    ("chat-template-jinja-oversize", "chat_template.jinja", _oversize("none"), ["MAX_TEMPLATE_CHARS"]),
    ("config-json-dev-zero", "config.json", _dev_zero, ["not a regular file"]),
    ("config-json-eos-id-not-an-id", "config.json", _token_id_not_an_int, ["eos_token_id", "not a token id"]),
    ("generation-config-id-out-of-range", "generation_config.json", _token_id_out_of_range,
     ["bos_token_id", "outside the vocabulary"]),
]


@pytest.mark.parametrize("name,plant,words", [c[1:] for c in HOSTILE_FILES], ids=[c[0] for c in HOSTILE_FILES])
def test_hostile_tokenizer_file_is_refused_unread(tmp_path, name, plant, words):
    folder = _folder(tmp_path, "{{ messages[0].content }}")
    if name != "tokenizer_config.json":
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))   # no bos: config.json's
    plant(folder / name, tmp_path)
    start = time.monotonic()
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_pretrained(folder).encode_chat("hi")
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert str(folder / name) in message, message
    for word in words:
        assert word in message, message
    assert MARK not in message


# The CLI's presence check (os.path.lexists) leaves a FIFO or a device to the reader, which names
# it "not a regular file" (an is_file() check called it absent: "no tokenizer.json").
CLI_FILES = {"symlink-to-sparse-terabyte": lambda p, t: _symlink_to_sparse(p, t, 1 << 40),
             "oversize": _oversize("MAX_TOKENIZER_BYTES"), "nested-bomb": _json_bomb,
             "fifo": _fifo, "dev-zero": _dev_zero}


@pytest.mark.parametrize("plant", list(CLI_FILES))
def test_cli_exit_2_for_a_hostile_tokenizer_json(tmp_path, tiny_dir, capsys, plant):
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir("gqa"), folder)
    shutil.copytree(_folder(tmp_path), folder, dirs_exist_ok=True)
    path = folder / "tokenizer.json"
    CLI_FILES[plant](path, tmp_path)
    code = main(["probe", "determinism", str(folder), "--impl", "torchref", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(path) in err and "internal error" not in err, err
    if plant in ("fifo", "dev-zero"):
        assert "not a regular file" in err, err


def test_symlinked_regular_files_are_read_as_the_hub_cache_needs(tmp_path):
    """The Hugging Face cache links each file of a snapshot to a blob: followed when the
    target is a regular file within the bounds."""
    folder = _folder(tmp_path, "{{ messages[0].content }}!")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).rename(blobs / name)
        (folder / name).symlink_to(blobs / name)
    tok = Tokenizer.from_pretrained(folder)
    assert tok.apply_chat_template(USER) == "hi!"


# ---------------------------------------------------------------------- real templates, same text


def _unbounded_render(template: str, **variables) -> str:
    """How the tokenizer rendered before the bounds (and transformers still does): the plain
    immutable sandbox with transformers' settings and helpers."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(**variables)


# Templates written in the style of real ones (ChatML, Llama 3 with tools, Mistral, Gemma):
# loops, namespaces, loop.last, tojson with indent, macros, `~`, filters, %-format, .format.
LIKE_REAL = {
    "chatml": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% endif %}",
    "llama3-tools": (
        "{{- bos_token }}\n{%- if messages[0]['role'] == 'system' %}{%- set system_message = "
        "messages[0]['content']|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' "
        "%}{%- endif %}\n{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools is not none %}"
        "{{- 'Environment: ipython\\n' }}{%- endif %}{{- 'Cutting Knowledge Date: December 2023\\n\\n' }}"
        "{%- if tools is not none %}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
        "{%- endif %}{{- system_message }}{{- '<|eot_id|>' }}\n{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
        "'<|eot_id|>' }}{%- endfor %}\n{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"),
    "mistral-namespace": (
        "{%- set ns = namespace(sys='', n=0) %}{%- for m in messages %}{%- if m.role == 'system' %}"
        "{%- set ns.sys = m.content %}{%- else %}{%- set ns.n = ns.n + 1 %}{%- endif %}{%- endfor %}"
        "{{ bos_token }}{%- for m in messages if m.role != 'system' %}{%- if m.role == 'user' %}"
        "{%- if loop.last and ns.sys %}{{ '[INST] ' ~ ns.sys ~ '\\n\\n' ~ m.content ~ ' [/INST]' }}"
        "{%- else %}{{ '[INST] %s [/INST]' % m.content }}{%- endif %}{%- elif m.role == 'assistant' %}"
        "{{ ' ' + m.content + eos_token }}{%- else %}{{ raise_exception('roles: user/assistant') }}{%- endif %}"
        "{%- endfor %}{{ '{} turns'.format(ns.n) }}"),
    "gemma-macro": (
        "{% macro turn(role, text) %}<start_of_turn>{{ role }}\n{{ text | trim | indent(2) }}<end_of_turn>\n"
        "{% endmacro %}{{ bos_token }}{% for m in messages %}{{ turn('model' if m.role == 'assistant' else m.role, "
        "m.content) }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
        "{{ messages|map(attribute='role')|join(',')|upper|center(40) }}{{ (messages|length * 'x')|wordwrap(3) }}"),
}

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": "Explain RoPE.\nIn a line."},
     {"role": "assistant", "content": "It rotates."}, {"role": "user", "content": "Ünïcödé ✓ 日本語 🙂 %s {}"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather at a place",
                                           "parameters": {"type": "object", "properties": {
                                               "place": {"type": "string", "enum": ["Paris", "Zürich"]}}}}}]


@pytest.mark.parametrize("messages", MESSAGES, ids=["one-turn", "four-turns"])
@pytest.mark.parametrize("name", sorted(LIKE_REAL))
def test_real_style_templates_render_the_same_text_as_before(name, messages):
    variables = dict(messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                     tools=TOOLS if "tools" in name else None, documents=None)
    assert ct.render(LIKE_REAL[name], "like-real", **variables) == _unbounded_render(LIKE_REAL[name], **variables)


@pytest.mark.smollm2
@pytest.mark.parametrize("messages", MESSAGES, ids=["one-turn", "four-turns"])
def test_smollm2_template_renders_the_same_text_as_before(messages):
    from llama_parity.fetch import default_model_dir, is_complete

    folder = default_model_dir()
    if not is_complete(folder):
        pytest.skip(f"SmolLM2 not cached at {folder}; run `llama-parity fetch-smollm2` (python -m llama_parity.fetch)")
    tok = Tokenizer.from_pretrained(folder)
    tokens = {f"{r}_token": t for r, t in tok.special_tokens.items() if t is not None}
    before = _unbounded_render(tok.chat_template, messages=messages, add_generation_prompt=True, tools=None,
                               documents=None, **tokens)
    assert tok.apply_chat_template(messages) == before
    assert tok.chat_template_file == str(folder / "chat_template.jinja")
