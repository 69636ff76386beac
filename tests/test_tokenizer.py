"""Tests for llamaspec.tokenizer: a tiny tokenizer built here, plus SmolLM2 vs transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llamaspec.tokenizer import Tokenizer

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a llama is not a camel, but both are mammals",
    "hello world! what is the capital of france?",
    "paris is the capital of france.",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
# A small template in the style of real ones: system turn optional, roles
# checked with raise_exception, generation prompt at the end.
TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _build_backend():
    """A byte-level BPE (exact round trip) that adds <s> when asked for special tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(SENTENCES, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    return backend


def _write_folder(path, *, tok_config=None, config=None, jinja=None, backend=None):
    path.mkdir(parents=True, exist_ok=True)
    (backend or _build_backend()).save(str(path / "tokenizer.json"))
    if tok_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return _write_folder(
        tmp_path_factory.mktemp("chat"),
        tok_config={
            "bos_token": "<s>",
            # transformers sometimes serializes tokens as AddedToken dicts.
            "eos_token": {"content": "</s>", "special": True},
            "pad_token": "<pad>",
            "chat_template": TEMPLATE,
        },
    )


@pytest.fixture(scope="module")
def tok(chat_dir):
    return Tokenizer.from_pretrained(chat_dir)


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    """No tokenizer_config.json: ids come from config.json, no chat template."""
    folder = _write_folder(
        tmp_path_factory.mktemp("plain"), config={"bos_token_id": 1, "eos_token_id": [2, 5], "pad_token_id": None}
    )
    return Tokenizer.from_pretrained(folder)


# ---------------------------------------------------------------------- basics


def test_special_ids_from_tokenizer_config(tok):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert tok.eos_ids == (2,)
    assert tok.has_chat_template


def test_special_ids_from_model_config(plain_tok):
    assert plain_tok.bos_id == 1 and plain_tok.eos_id == 2
    assert plain_tok.eos_ids == (2, 5)  # every listed eos stops generation
    assert plain_tok.pad_id is None
    assert not plain_tok.has_chat_template


@pytest.mark.parametrize("text", ["hello world", "  the lazy llama,\n\tjumps!  ", "unseen: Zürich ✓ 🙂"])
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == text  # arrays work too


def test_special_tokens_added_and_skipped(tok):
    ids = tok.encode("hello world", add_special_tokens=True)
    assert ids[0] == tok.bos_id and ids[1:] == tok.encode("hello world")
    assert tok.decode(ids) == "hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hello world"


def test_decode_rejects_batches(tok):
    with pytest.raises(ValueError, match="one sequence"):
        tok.decode(np.zeros((2, 3), dtype=np.int64))


# ---------------------------------------------------------------------- chat


def test_chat_rendering(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    assert tok.apply_chat_template(msgs) == "<s><|system|>\nbe brief</s>\n<|user|>\nhello world</s>\n<|assistant|>\n"
    assert tok.apply_chat_template(msgs[1:], add_generation_prompt=False) == "<s><|user|>\nhello world</s>\n"


def test_chat_template_raise_exception(tok):
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed(tmp_path):
    import jinja2.exceptions

    folder = _write_folder(tmp_path, jinja="{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}")
    t = Tokenizer.from_pretrained(folder)
    with pytest.raises(jinja2.exceptions.SecurityError):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_wins(tmp_path):
    folder = _write_folder(tmp_path, tok_config={"chat_template": "from config"}, jinja="from file")
    assert Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "from file"


def test_encode_chat_uses_template(tok):
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    )
    ids = tok.encode_chat("hello world", system="be brief")
    assert ids == tok.encode(rendered)
    assert ids.count(tok.bos_id) == 1  # the template's BOS only, none added on top


def test_encode_chat_without_template_is_plain_encode(plain_tok):
    assert plain_tok.encode_chat("hello world") == plain_tok.encode("hello world", add_special_tokens=True)


# ---------------------------------------------------------------------- batches


@pytest.mark.parametrize("side", ["left", "right"])
def test_batch_padding_and_mask(tok, side):
    texts = ["hi", "the quick brown fox jumps over the lazy dog"]
    ids, mask = tok.batch_encode(texts, padding_side=side)
    rows = [tok.encode_chat(t) for t in texts]
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.shape == mask.shape == (2, max(map(len, rows)))
    for b, row in enumerate(rows):
        n_pad = ids.shape[1] - len(row)
        real = slice(n_pad, None) if side == "left" else slice(0, len(row))
        pads = slice(0, n_pad) if side == "left" else slice(len(row), None)
        assert ids[b, real].tolist() == row
        assert mask[b, real].tolist() == [1] * len(row)
        assert mask[b, pads].tolist() == [0] * n_pad
        assert ids[b, pads].tolist() == [tok.pad_id] * n_pad
    assert mask[0].sum() < mask[1].sum()  # the short prompt really was padded


def test_batch_pad_id_override_and_plain(tok, plain_tok):
    ids, mask = tok.batch_encode(["a", "paris is the capital"], chat=False, pad_id=99)
    assert ids[0, 0] == 99 and mask[0, 0] == 0
    assert ids[1].tolist() == tok.encode_prompt("paris is the capital")
    # No pad token in this checkpoint: falls back to eos.
    ids, _ = plain_tok.batch_encode(["a", "paris is the capital"])
    assert ids[0, 0] == plain_tok.eos_id


def test_batch_encode_argument_errors(tok):
    with pytest.raises(TypeError, match="list of prompts"):
        tok.batch_encode("hello")
    with pytest.raises(ValueError, match="padding_side"):
        tok.batch_encode(["hello"], padding_side="middle")
    with pytest.raises(ValueError, match="at least one"):
        tok.batch_encode([])


# ---------------------------------------------------------------------- errors


def test_empty_prompt_raises(tok, plain_tok):
    for t in (tok, plain_tok):
        with pytest.raises(ValueError, match="empty prompt"):
            t.encode_chat("")
        with pytest.raises(ValueError, match="empty prompt"):
            t.batch_encode(["fine", ""])


def test_prompt_encoding_to_zero_tokens_raises(tmp_path):
    from tokenizers import normalizers

    backend = _build_backend()
    backend.post_processor = None  # no BOS either, so whitespace really gives nothing
    backend.normalizer = normalizers.Strip()
    t = Tokenizer.from_pretrained(_write_folder(tmp_path, backend=backend))
    with pytest.raises(ValueError, match="empty prompt.*zero tokens"):
        t.encode_chat("   ")


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_pretrained(tmp_path)


def test_unknown_special_token_is_named(tmp_path):
    folder = _write_folder(tmp_path, tok_config={"eos_token": "<|nope|>"})
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>'"):
        Tokenizer.from_pretrained(folder)


def test_bad_json_names_file(tmp_path):
    folder = _write_folder(tmp_path)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(folder)


# ---------------------------------------------------------------------- real model


def _smollm2_dir():
    from llama_parity.fetch import default_model_dir, is_complete

    folder = default_model_dir()
    if not is_complete(folder):
        pytest.skip(f"SmolLM2 not cached at {folder}; run `llama-parity fetch-smollm2` (python -m llama_parity.fetch)")
    return folder


SMOLLM2_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain RoPE in one line."}],
    [{"role": "user", "content": "Ünïcödé ✓ 日本語 🙂 and\ttabs\n\nnewlines  double  spaces"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write `def f(x): return x**2` in JS."},
    ],
    [{"role": "user", "content": "literal <|im_start|> and <|im_end|> inside, trailing space "}],
]


@pytest.mark.smollm2
@pytest.mark.parametrize("messages", SMOLLM2_CHATS, ids=range(len(SMOLLM2_CHATS)))
def test_smollm2_chat_matches_transformers(messages):
    folder = _smollm2_dir()
    transformers = pytest.importorskip("transformers",
                                       reason="transformers is the reference here (pip install -e .[hf])")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer.from_pretrained(folder)

    text = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ours.encode(text) == list(expected["input_ids"])
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
