"""Framework-neutral text I/O: a Hugging Face ``tokenizer.json`` plus its chat template.

Both model implementations and the comparison engine need the same token ids
for the same prompt, so tokenization lives here, on top of the ``tokenizers``
library and ``jinja2`` only (no transformers, no torch, no jax). Chat templates
are rendered the way transformers renders them (same jinja settings, same
helper functions, same variables), so ids match ``AutoTokenizer`` exactly, but within
bounds of time and size (llamaspec.chat_template).

Every file read here is checkpoint data (docs/threat-model.md): opened without blocking
(a FIFO never hangs us), refused unless a regular file (a symlink is followed, as the
Hugging Face cache needs, but to a regular file only: not /dev/zero), and its size
checked on the open descriptor before a byte is read (a symlink to a 1 TB sparse file
is refused, not read). Errors are TokenizerErrors naming the file, never quoting it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from . import chat_template as templates
from .budget import parse_json, read_bounded
from .errors import InputError, TokenizerError

SPECIAL_ROLES = ("bos", "eos", "pad", "unk")

MAX_TOKENIZER_BYTES = 128 * 1024 * 1024   # tokenizer.json; the largest real ones (Gemma 3's 262k vocabulary) are ~33 MB
MAX_JSON_BYTES = 16 * 1024 * 1024         # tokenizer_config.json and the rest; thousands of added tokens make ~2 MB


class Tokenizer:
    """Encode/decode text and render chat prompts for one checkpoint."""

    def __init__(
        self,
        backend,
        *,
        special_tokens: dict[str, str | None] | None = None,
        eos_ids: Sequence[int] = (),
        chat_template: str | None = None,
        source: str | None = None,
        chat_template_file: str | None = None,
    ):
        """``backend`` is a ``tokenizers.Tokenizer``; ``special_tokens`` maps
        'bos'/'eos'/'pad'/'unk' to token strings (None when the checkpoint has none);
        ``chat_template_file`` names where the template came from, for its errors."""
        self.backend = backend
        self.special_tokens = {role: (special_tokens or {}).get(role) for role in SPECIAL_ROLES}
        self.chat_template = chat_template
        self.source = source
        self.chat_template_file = chat_template_file or f"{source or 'this tokenizer'} (chat template)"
        ids = {role: self._id_of(token, role) for role, token in self.special_tokens.items()}
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (ids[r] for r in SPECIAL_ROLES)
        # Every id that ends generation: the tokenizer's eos plus any the model config lists.
        merged = ([self.eos_id] if self.eos_id is not None else []) + [int(i) for i in eos_ids]
        self.eos_ids = tuple(dict.fromkeys(merged))

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "Tokenizer":
        """Load ``<folder>/tokenizer.json`` and whatever metadata sits next to it."""
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        path = folder / "tokenizer.json"
        text = read_text(path, MAX_TOKENIZER_BYTES, "MAX_TOKENIZER_BYTES")
        if text is None:
            raise FileNotFoundError(f"no tokenizer in {folder}: {path} does not exist")
        backend = _load_backend(Backend, path, text)

        tok_config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        model_config = _read_json(folder / "config.json")
        generation_config = _read_json(folder / "generation_config.json")
        _check_vocab_fits(backend, path, model_config, folder / "config.json")

        special: dict[str, str | None] = {}
        config_eos: list[int] = []
        for role in SPECIAL_ROLES:
            special[role] = _token_string(tok_config, special_map, role, folder)
            for config, name in ((model_config, "config.json"), (generation_config, "generation_config.json")):
                where = f"{folder / name}: field {role}_token_id"
                ids = _id_list(config.get(f"{role}_token_id"), where)
                if role == "eos":
                    config_eos += ids
                if special[role] is None and ids:
                    # Only a model config knows this token: take its string from the vocab.
                    in_vocab = 0 <= ids[0] < backend.get_vocab_size(with_added_tokens=True)
                    special[role] = backend.id_to_token(ids[0]) if in_vocab else None
                    if special[role] is None:
                        raise TokenizerError(f"{where}: {ids[0]} is outside the vocabulary")
        template, template_file = _chat_template(folder, tok_config)
        return cls(
            backend,
            special_tokens=special,
            eos_ids=config_eos,
            chat_template=template,
            source=str(folder),
            chat_template_file=template_file,
        )

    def _id_of(self, token: str | None, role: str) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{self.source or 'tokenizer'}: {role}_token {token!r} is not in the vocabulary")
        return token_id

    # ------------------------------------------------------------------ basic I/O

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        flat = np.asarray(list(ids) if not hasattr(ids, "shape") else ids, dtype=np.int64)
        if flat.ndim != 1:
            raise ValueError(f"decode() takes one sequence of ids, got shape {flat.shape}; decode rows one by one")
        return self.backend.decode(flat.tolist(), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the checkpoint's template, as transformers would, within
        llamaspec.chat_template's bounds (a TokenizerError naming the template's file)."""
        if not self.chat_template:
            raise ValueError(f"{self.source or 'this tokenizer'} has no chat template")
        if not messages:
            raise ValueError("apply_chat_template needs at least one message")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
        # transformers drops None-valued keys before rendering; templates test
        # for key presence, so doing the same keeps the text identical.
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        # Like transformers, expose only the special tokens that exist.
        tokens = {f"{role}_token": tok for role, tok in self.special_tokens.items() if tok is not None}
        return templates.render(
            self.chat_template,
            self.chat_template_file,
            messages=cleaned,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **tokens,
        )

    def encode_prompt(self, text: str) -> list[int]:
        """A plain (non-chat) prompt: special tokens added as tokenizer.json says (e.g. BOS)."""
        _reject_empty(text)
        ids = self.encode(text, add_special_tokens=True)
        if not ids:
            raise InputError(f"empty prompt: {text!r} encodes to zero tokens")
        return ids

    def encode_chat(self, user_text: str, system: str | None = None) -> list[int]:
        """One user turn (optionally after a system message), ready for generation.

        Uses the chat template when the checkpoint has one; otherwise the text is
        encoded as a plain prompt, with ``system`` (if any) as a leading paragraph.
        """
        _reject_empty(user_text)
        if not self.chat_template:
            return self.encode_prompt(user_text if system is None else f"{system}\n\n{user_text}")
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": user_text})
        # The template already writes the special tokens, so none are added on top
        # (transformers' apply_chat_template(tokenize=True) does the same).
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    # ------------------------------------------------------------------ batches

    def batch_encode(
        self,
        texts: Sequence[str],
        chat: bool = True,
        padding_side: str = "left",
        pad_id: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Encode and pad to the longest prompt: (ids int64 [B, T], mask int64 [B, T]).

        Left padding is the default because generation appends on the right.
        Padded positions get mask 0 and ``pad_id`` (default: the checkpoint's
        pad token, else eos, else 0; the value should not matter to a model
        that honours the mask).
        """
        if isinstance(texts, str):
            raise TypeError("batch_encode takes a list of prompts, not one string")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        texts = list(texts)
        if not texts:
            raise InputError("batch_encode needs at least one prompt")
        rows = [self.encode_chat(t) if chat else self.encode_prompt(t) for t in texts]
        fill = self._pad_value(pad_id)
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), fill, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for b, row in enumerate(rows):
            span = slice(width - len(row), width) if padding_side == "left" else slice(0, len(row))
            ids[b, span] = row
            mask[b, span] = 1
        return ids, mask

    def _pad_value(self, pad_id: int | None) -> int:
        for candidate in (pad_id, self.pad_id, self.eos_id):
            if candidate is not None:
                return int(candidate)
        return 0

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab={self.vocab_size}, bos={self.bos_id}, "
            f"eos={self.eos_id}, pad={self.pad_id}, chat_template={self.has_chat_template})"
        )


# ---------------------------------------------------------------------- helpers


def _reject_empty(text: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"a prompt must be a str, got {type(text).__name__}")
    if text == "":
        raise InputError("empty prompt: the prompt text is an empty string")


def _load_backend(backend_cls, path: Path, text: str):
    """tokenizers.Tokenizer.from_str on the text we read (bounded, see read_text), with its
    bare errors ("EOF while parsing ...") turned into one naming the file and saying what is
    wrong with it."""
    try:
        return backend_cls.from_str(text)
    except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # serde quotes the values it could not use ("invalid type: string \"...\""): file contents, masked
    reason = re.sub(r'"(?:[^"\\]|\\.)*"', '"..."', reason)[:200]
    size = len(text.encode("utf-8"))
    _parse_json(path, text)
    raise TokenizerError(f"{path}: valid JSON, but the tokenizers library cannot load it: {reason} ({size} bytes)")


def _check_vocab_fits(backend, path: Path, model_config: dict, config_path: Path) -> None:
    """Every id the tokenizer can produce must have an embedding row: a tokenizer with more
    ids than config.json's vocab_size belongs to another model (and its extra ids would
    index past the embedding)."""
    vocab_size = model_config.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        return
    ids = backend.get_vocab(with_added_tokens=True).values()
    n = max(ids) + 1 if ids else 0
    if n > vocab_size:
        raise TokenizerError(f"{path}: the tokenizer has ids up to {n - 1} ({n} ids) but {config_path} has "
                             f"vocab_size {vocab_size}: a tokenizer of another model?")


def read_bytes(path: Path, limit: int, limit_name: str) -> bytes | None:
    """The bytes of the checkpoint file `path`, or None when it does not exist: the one bounded
    reader (llamaspec.budget.read_bounded), its refusals TokenizerErrors."""
    return read_bounded(path, TokenizerError, limit, Path(path).name, limit_name, missing_ok=True)


def read_text(path: Path, limit: int, limit_name: str) -> str | None:
    """read_bytes, decoded as UTF-8 (a TokenizerError naming the file if it is not)."""
    data = read_bytes(path, limit, limit_name)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not a {Path(path).name}, not even text (not UTF-8 at byte {e.start} of "
                             f"{len(data)})") from None


def _parse_json(path: Path, text: str):
    """json.loads, every failure a TokenizerError naming the file (llamaspec.budget.parse_json)."""
    return parse_json(text, str(path), TokenizerError)


def _read_json(path: Path) -> dict:
    """The file's JSON object, or {} when the file is absent (bounded: read_bytes)."""
    text = read_text(path, MAX_JSON_BYTES, "MAX_JSON_BYTES")
    if text is None:
        return {}
    data = _parse_json(path, text)
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_string(tok_config: dict, special_map: dict, role: str, folder: Path) -> str | None:
    """``<role>_token`` from tokenizer_config.json or special_tokens_map.json.

    Values are either plain strings or serialized AddedToken dicts ({"content": ...}).
    """
    for name, source in (("tokenizer_config.json", tok_config), ("special_tokens_map.json", special_map)):
        value = source.get(f"{role}_token")
        if value is None:
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if not isinstance(value, str):
            raise TokenizerError(f"{folder / name}: field {role}_token should be a string or {{'content': str}}")
        return value
    return None


def _id_list(value: Any, where: str) -> list[int]:
    # Configs store one id, a list of ids (several eos tokens), or null.
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{where}: not a token id or a list of token ids (a {type(value).__name__})")
    return [int(v) for v in values]


def _chat_template(folder: Path, tok_config: dict) -> tuple[str | None, str | None]:
    """(template, the file it came from): chat_template.jinja wins (transformers loads it
    over the config field), then tokenizer_config.json's chat_template (a string, or a list
    of named templates). The .jinja file is read bounded (read_bytes), the template's length
    capped (chat_template.MAX_TEMPLATE_CHARS) when it is compiled."""
    jinja_file = folder / "chat_template.jinja"
    limit = 4 * templates.MAX_TEMPLATE_CHARS   # bytes: up to 4 per character in UTF-8
    text = read_text(jinja_file, limit, "4 x chat_template.MAX_TEMPLATE_CHARS")
    if text is not None:
        return text, str(jinja_file)
    config_file = folder / "tokenizer_config.json"
    where = f"{config_file} (field chat_template)"
    template = tok_config.get("chat_template")
    if template is None or isinstance(template, str):
        return (template or None), where
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" in named:
            return named["default"], f"{config_file} (field chat_template, template 'default')"
        raise TokenizerError(f"{config_file}: chat_template lists {len(named)} templates but none is named 'default'")
    raise TokenizerError(f"{config_file}: chat_template should be a string or a list, not a {type(template).__name__}")
