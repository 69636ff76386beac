"""Budgets: every size that comes from outside (a command-line number, a config field, a file
header, a dump's manifest, an environment variable) is checked here, before the allocation,
the device request or the read it governs. One place, so that every such check says the same
thing: the argument, field or file, the size it asks for and the bound it broke.

    check_count(n, MAX_HOST_DEVICES, "--mesh tensor=100000000: host devices", UsageError)
    check_bytes(rows * width * vocab * 8, "--random-tokens 2x64: one float64 logits array", UsageError)
    doc = load_json(path, ConfigError)          # bounded read, every parser failure named

The bounds are sanity bounds, far above any real model: they keep a hostile or mistyped
number from reaching an allocator, a thread pool or a hash of a terabyte, not a large model
from running.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .errors import InputError, LlamaParityError

# A JSON file of fields (config.json, model.safetensors.index.json, a dump's manifest.json):
# SmolLM2's config is 1 KB, a 405B model's index 100 KB, a manifest of 64 x 4096 inputs ~2 MB.
MAX_JSON_BYTES = 100 << 20
# A safetensors header (the JSON before the tensors): the same bound as its reader's.
MAX_HEADER_BYTES = 100 << 20
# A text the policy sweep reads (compare.sweep): 16 MiB of text is ~4M tokens, far beyond a sweep's hours.
MAX_TEXT_BYTES = 16 << 20
# A config's size field (vocab_size, hidden_size, layers, heads, positions, ...): below 2**31,
# so that a product of two is exact in int64 and a size fits every framework's index type.
MAX_SIZE_FIELD = 2**31 - 1
# A config's num_hidden_layers: the deepest Llama has 126; per-layer lists (tap names, expected
# tensors) are made from it before any weight is read.
MAX_LAYERS = 10_000
# Runs a command line asks for by count (probe --completions, --repeats, --processes): each is a
# model run (a fresh process for --processes) and a record kept; more than this is a typo.
MAX_RUNS = 100_000
# XLA:CPU host devices (each has threads of its own; 10**8 of them abort the process while
# XLA allocates their thread-local data, before any mesh is checked).
MAX_HOST_DEVICES = 1024


def memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_count(value: int, limit: int, what: str, error=InputError, why: str = "") -> int:
    """value, or error naming `what` when it exceeds `limit` (why: what the bound is)."""
    if value > limit:
        raise error(f"{what}: {value} is more than {limit}{f' ({why})' if why else ''}")
    return value


def check_bytes(need: int, what: str, error=InputError, limit: int | None = None) -> int:
    """need, or error naming `what` when it exceeds `limit` (default: this machine's memory)."""
    bound = memory_bytes() if limit is None else limit
    if bound is not None and need > bound:
        of = "this machine's memory" if limit is None else "the bound"
        raise error(f"{what} is {_gib(need)} ({need} bytes), more than {of} ({_gib(bound)})")
    return need


def check_tokens(rows: int, length: int, max_positions: int, vocab: int, what: str, error=InputError,
                 width: int | None = None) -> None:
    """A batch of `rows` x `length` tokens checked before anything is allocated: the length within
    the model's max_position_embeddings, and one float64 logits array [rows, width, vocab]
    (width: the call's slots, padding included, default length; a comparison holds several)
    within this machine's memory. what: the argument, e.g. "--random-tokens 2x64"."""
    if length > max_positions:
        raise error(f"{what}: {length} tokens, the model's max_position_embeddings is {max_positions}")
    width = length if width is None else width
    check_bytes(rows * width * vocab * 8, f"{what}: one float64 logits array [{rows}, {width}, {vocab}]", error)


def read_bounded(path, error, limit: int = MAX_JSON_BYTES, what: str = "file", limit_name: str | None = None,
                 missing_ok: bool = False) -> bytes | None:
    """A file's bytes, refused (`error` naming the file, never quoting it) when it is not a regular
    file (a FIFO, a device, a folder; through a symlink or not) or is larger than `limit` (named
    `limit_name` where a constant sets it). Opened non-blocking (a FIFO never hangs), its size
    checked by fstat on that descriptor before any byte is read, and at most limit + 1 bytes read,
    so a file that grows meanwhile is refused too. Symlinks to regular files are followed (the
    Hugging Face cache links every file to a blob). missing_ok: None for a file that is not there
    (a broken symlink is still an error)."""
    path = Path(path)
    link = f" (a symlink to {os.readlink(path)})" if path.is_symlink() else ""
    bound = f"{limit:,} bytes" + (f", {limit_name}" if limit_name else "")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if link:
            raise error(f"{path}: a broken symlink{link}") from None
        if missing_ok:
            return None
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot be opened ({e.strerror or e}){link}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        os.close(fd)     # (before fdopen, which refuses a folder's descriptor with an OSError of its own)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file{link} ({_kind(st.st_mode)}), so not a {what}; it is not read")
        raise error(f"{path}: {st.st_size} bytes{link}, more than a {what} may hold ({bound}); it is not read")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise error(f"{path}: cannot be read ({e.strerror or e}){link}") from None
    if len(data) > limit:
        raise error(f"{path}: more than a {what} may hold ({bound}); it grew while read and is not read further")
    return data


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def parse_json(data: bytes | str, where: str, error, object_pairs_hook=None, sep: str = ": ",
               not_json: str = "not valid JSON"):
    """JSON text parsed, every parser failure on bad input as `error` naming `where` (then sep and
    the reason): not UTF-8, not JSON (`not_json`), nested too deeply (RecursionError), a number
    too long to convert (ValueError), too large to hold (MemoryError)."""
    try:
        return json.loads(data, object_pairs_hook=object_pairs_hook)
    except LlamaParityError:    # the hook's own refusal
        raise
    except UnicodeDecodeError:
        raise error(f"{where}{sep}not UTF-8 text, so {not_json}") from None
    except json.JSONDecodeError as e:    # where, never the text
        cut = (" (cut short: the text ends mid-document)" if not e.doc[e.pos:].strip()
               or e.msg.startswith("Unterminated string") else "")
        raise error(f"{where}{sep}{not_json}{cut} ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{where}{sep}nested too deeply to be read as JSON") from None
    except MemoryError:
        raise error(f"{where}{sep}too large to hold in memory") from None
    except ValueError as e:     # e.g. an integer of more than 4300 digits
        raise error(f"{where}{sep}not readable as JSON ({e})") from None


def load_json(path, error, limit: int = MAX_JSON_BYTES, what: str = "JSON file", object_pairs_hook=None):
    """A JSON file read within `limit` bytes (read_bounded) and parsed (parse_json)."""
    return parse_json(read_bounded(path, error, limit, what), str(path), error, object_pairs_hook)
