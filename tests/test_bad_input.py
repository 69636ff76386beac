"""Bad input as a new user gives it, one row per case: the exit code (2 = usage or bad
input, before any model loads) and a message that names the argument, path or field.

The CLI rows run `llama_parity.cli.main` in-process on a tiny checkpoint without a
tokenizer (`B`); `{B}`, `{tmp}` in a row are filled in per test."""

from __future__ import annotations

import re

import numpy as np
import pytest

from llama_parity.cli import main

# (id, argv, exit code, regex the stderr must match)
CLI_CASES = [
    ("no-such-folder", "compare {tmp}/does-not-exist", 2, r"checkpoint .*does-not-exist: no such folder"),
    ("a-file-not-a-folder", "compare {B}/config.json", 2, r"config\.json: is a file, not a folder"),
    ("folder-without-config", "compare {tmp}", 2, r"no config\.json in this folder"),
    ("compare-without-tokenizer", "compare {B}", 2, r"no tokenizer\.json.*--random-tokens"),
    ("demo-without-tokenizer", "demo {B}", 2, r"no tokenizer\.json, which the demo's prompts need"),
    ("random-tokens-not-BxT", "compare {B} --random-tokens abc", 2, r"--random-tokens: 'abc' is not BxT"),
    ("random-tokens-negative", "compare {B} --random-tokens 2x-3", 2, r"--random-tokens: '2x-3' is not BxT"),
    ("random-tokens-zero", "compare {B} --random-tokens 0x8", 2, r"--random-tokens: '0x8': rows and tokens"),
    ("prompt-and-random-tokens", "compare {B} --random-tokens 1x8 --prompt hi", 2, r"exclude each other"),
    ("unknown-policy", "compare {B} --random-tokens 1x8 --policy fp12", 2, r"unknown precision policy 'fp12'"),
    ("unknown-reference", "compare {B} --reference flax", 2, r"--reference: invalid choice: 'flax'"),
    ("demo-max-new-tokens-0", "demo {B} --max-new-tokens 0", 2, r"--max-new-tokens: 0 must be at least 1"),
    ("json-is-a-folder", "compare {B} --random-tokens 1x8 --json {tmp}", 2, r"--json .*: is a folder"),
    ("json-in-a-file", "compare {B} --random-tokens 1x8 --json {B}/config.json/r.json", 2,
     r"--json .*config\.json.*exists and is not a folder"),
    ("out-dir-is-a-file", "compare {B} --random-tokens 1x8 --out-dir {B}/config.json", 2,
     r"--out-dir .*config\.json: is a file, not a folder"),
    ("html-over-a-foreign-file", "compare {B} --random-tokens 1x8 --html {tmp}/notes.html", 2,
     r"--html .*notes\.html: the file exists and was not written by llama-parity; pass --force"),
    ("json-over-a-foreign-file", "compare {B} --random-tokens 1x8 --json {tmp}/notes.json", 2,
     r"--json .*notes\.json: the file exists and was not written by llama-parity"),
    ("probe-batch-sizes-letters", "probe batch {B} --batch-sizes a,b", 2, r"--batch-sizes: 'a' is not an integer"),
    ("probe-batch-sizes-negative", "probe batch {B} --batch-sizes -2", 2, r"--batch-sizes: -2 must be at least 1"),
    ("probe-batch-sizes-empty", "probe batch {B} --batch-sizes ,", 2, r"--batch-sizes: ',': give a comma list"),
    ("probe-completions-0", "probe divergence {B} --completions 0", 2, r"--completions: 0 must be at least 1"),
    ("probe-new-tokens-0", "probe divergence {B} --new-tokens 0", 2, r"--new-tokens: 0 must be at least 1"),
    ("probe-repeats-0", "probe determinism {B} --repeats 0", 2, r"--repeats: 0 must be at least 1"),
    ("probe-processes-negative", "probe determinism {B} --processes -1", 2, r"--processes: -1 must be 0 or more"),
    ("probe-unknown-impl", "probe batch {B} --impl foo", 2, r"unknown implementation 'foo' \(one of torchref"),
    ("probe-unknown-mode", "probe batch {B} --mode fast", 2, r"unknown mode 'fast'"),
    ("probe-prompt-without-tokenizer", "probe batch {B} --prompt hi --impl torchref", 2,
     r"no tokenizer\.json, which --prompt needs"),
    ("probe-json-is-a-folder", "probe batch {B} --json {tmp}", 2, r"--json .*: is a folder"),
    ("json-on-a-read-only-file-system", "compare {B} --random-tokens 1x8 --json /sys/lp.json --no-files", 2,
     r"--json /sys/lp\.json: cannot write in /sys"),
    ("probe-html-on-a-read-only-file-system", "probe batch {B} --html /sys/lp.html", 2,
     r"--html /sys/lp\.html: cannot write in /sys"),
    # The control of the guard below: a valid call does read weights, and an unexpected
    # exception is an internal error (3) with a one-line cause and the --debug hint.
    ("guard-control-valid-call", "compare {B} --random-tokens 1x8 --no-files", 3,
     r"internal error: AssertionError: a usage error must be found before any weights .*rerun with --debug"),
]


@pytest.fixture
def tmp(tmp_path):
    (tmp_path / "notes.html").write_text("<html>my notes</html>")
    (tmp_path / "notes.json").write_text('{"mine": true}')
    return tmp_path


def run_cli(argv: list[str]) -> int:
    """main()'s exit code, argparse's own (SystemExit) included."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("argv,code,message", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(argv, code, message, tiny_dir, tmp, capsys, monkeypatch):
    import llamaspec.checkpoint

    def no_loading(*a, **k):
        raise AssertionError("a usage error must be found before any weights are read")
    monkeypatch.setattr(llamaspec.checkpoint.Checkpoint, "__init__", no_loading)
    rc = run_cli(argv.format(B=tiny_dir("gqa"), tmp=tmp).split())
    err = capsys.readouterr().err
    assert rc == code, err
    assert re.search(message, err), err


def test_report_folders_that_do_not_exist_yet_are_made_before_the_run(tiny_dir, tmp_path, capsys):
    out = tmp_path / "nodir" / "sub" / "r.json"
    assert run_cli(["compare", str(tiny_dir("gqa")), "--random-tokens", "1x8", "--json", str(out), "--no-files"]) == 0
    assert out.is_file() and '"verdict"' in out.read_text()


# ----- the API -------------------------------------------------------------------------------

def _hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()


def _mismatch(field, value):
    def call(tiny_dir):
        import compare
        other = tiny_dir("gqa", **{field: value})
        return compare.compare_models("torchref", _hf(other), tiny_dir("gqa"), inputs=[[1, 2, 3]])
    return call


def _compare_inputs(inputs):
    def call(tiny_dir):
        import compare
        return compare.compare_models("torchref", "torchref", tiny_dir("gqa"), inputs=inputs)
    return call


# (id, call(tiny_dir), exception type, regex the message must match)
API_CASES = [
    ("vocab-differs", _mismatch("vocab_size", 128), "ConfigError", r"vocab_size: 96 \(reference torchref\) vs 128"),
    ("layers-differ", _mismatch("num_hidden_layers", 3), "ConfigError",
     r"num_hidden_layers: 2 \(reference torchref\) vs 3"),
    ("hidden-differs", _mismatch("intermediate_size", 96), "ConfigError", r"intermediate_size: 64 .* vs 96"),
    ("inputs-ragged", _compare_inputs([[1, 2, 3], [4, 5]]), "InputError",
     r"inputs: rows of different lengths \(3, 2\)"),
    ("inputs-all-padding", _compare_inputs((np.ones((2, 4), int), np.array([[1, 1, 0, 0], [0, 0, 0, 0]]))),
     "InputError", r"inputs: row\(s\) \[1\] have no real token"),
    ("inputs-floats", _compare_inputs(np.ones((1, 4))), "InputError", r"inputs: expected integer token ids"),
    ("inputs-1d", _compare_inputs(np.arange(4)), "InputError", r"inputs: .*\[batch, tokens\].*shape \(4,\)"),
    ("inputs-mask-shape", _compare_inputs((np.ones((2, 4), int), np.ones((2, 3), int))), "InputError",
     r"inputs: the mask's shape \(2, 3\) is not the ids' \(2, 4\)"),
    ("inputs-text-without-tokenizer", _compare_inputs("hello"), "FileNotFoundError", r"tokenizer"),
]


@pytest.mark.parametrize("call,error,message", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_bad_input(call, error, message, tiny_dir):
    with pytest.raises(Exception) as got:
        call(tiny_dir)
    assert type(got.value).__name__ == error, repr(got.value)
    assert re.search(message, str(got.value)), str(got.value)


def test_value_fields_that_differ_are_reported_not_refused(tiny_dir):
    """A port that drops the config's epsilon is what the ladder must show, not refuse."""
    import compare
    hf = _hf(tiny_dir("gqa", rms_norm_eps=1e-3))
    report = compare.compare_models("torchref", hf, tiny_dir("gqa"), inputs=[[1, 2, 3, 4]], teacher_forcing=False)
    assert report.config_differences == ["rms_norm_eps: 1e-05 (reference) vs 0.001 (candidate)"]
    assert report.verdict == "semantic" and "the configs differ: rms_norm_eps" in report.summary()


# ----- config.json values and model API arguments ---------------------------------------------

def _config_row(**changes):
    """A call that loads a tiny checkpoint whose config.json has `changes` (None deletes)."""
    def call(tiny_dir, tmp_path):
        import json
        import shutil

        import torchref
        folder = tmp_path / "ck"
        shutil.copytree(tiny_dir("gqa"), folder)
        cfg = json.loads((folder / "config.json").read_text())
        for k, v in changes.items():
            cfg.pop(k, None) if v is None else cfg.__setitem__(k, v)
        (folder / "config.json").write_text(json.dumps(cfg))
        return torchref.from_pretrained(folder)
    return call


def _whole_config(edit):
    """A call that loads a tiny checkpoint whose config.json text is edit(text)."""
    def call(tiny_dir, tmp_path):
        import shutil

        import torchref
        folder = tmp_path / "ck"
        shutil.copytree(tiny_dir("gqa"), folder)
        (folder / "config.json").write_text(edit((folder / "config.json").read_text()))
        return torchref.from_pretrained(folder)
    return call


def _model_call(fn):
    def call(tiny_dir, tmp_path):
        import torchref
        return fn(torchref.from_pretrained(tiny_dir("gqa")))
    return call


def _policy(**knobs):
    def call(tiny_dir, tmp_path):
        from llamaspec import Policy
        return Policy.get("bf16", **knobs)
    return call


ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}
CONFIG_CASES = [
    ("hidden-size-float", _config_row(hidden_size=32.9),
     "ConfigError", r"config\.json: field 'hidden_size' = 32\.9 must be a positive integer"),
    ("hidden-size-bool", _config_row(hidden_size=True),
     "ConfigError", r"'hidden_size' = True must be a positive integer"),
    ("kv-heads-zero", _config_row(num_key_value_heads=0),
     "ConfigError", r"'num_key_value_heads' = 0 must be a positive integer"),
    ("kv-heads-negative", _config_row(num_key_value_heads=-2),
     "ConfigError", r"'num_key_value_heads' = -2 must be a positive"),
    ("head-dim-negative", _config_row(head_dim=-16), "ConfigError", r"'head_dim' = -16 must be a positive integer"),
    ("eps-infinite", _whole_config(lambda t: re.sub(r'"rms_norm_eps": [^,}]+', '"rms_norm_eps": 1e400', t)),
     "ConfigError", r"'rms_norm_eps' = inf must be a finite positive number"),
    ("eos-outside-vocab", _config_row(eos_token_id=500),
     "ConfigError", r"'eos_token_id' = 500 must be a token id in \[0, vocab_size=96\)"),
    ("eos-a-string", _config_row(eos_token_id="</s>"), "ConfigError", r"'eos_token_id' = '</s>' must be a token id"),
    ("pad-negative", _config_row(pad_token_id=-5), "ConfigError", r"'pad_token_id' = -5 must be a token id"),
    ("tie-a-string", _config_row(tie_word_embeddings="false"),
     "ConfigError", r"'tie_word_embeddings' = 'false' must be a JSON boolean"),
    ("bias-a-string", _config_row(attention_bias="false"),
     "ConfigError", r"'attention_bias' = 'false' must be a JSON boolean"),
    ("config-a-list", _whole_config(lambda t: "[1, 2]"), "ConfigError", r"config\.json: must hold a JSON object"),
    ("rope-scaling-a-string", _config_row(rope_scaling="linear"),
     "ConfigError", r"'rope_scaling' = 'linear' must be a JSON object"),
    ("rope-scaling-a-list", _config_row(rope_scaling=["linear", 2]),
     "ConfigError", r"'rope_scaling' = \['linear', 2\] must be a JSON object"),
    ("rope-factor-a-string", _config_row(rope_scaling={"rope_type": "linear", "factor": "two"}), "ConfigError",
     r"'factor' = 'two' must be a finite positive number"),
    ("llama3-original-max-a-string", _config_row(rope_scaling={**ROPE, "original_max_position_embeddings": "big"}),
     "ConfigError", r"'original_max_position_embeddings' = 'big' must be a positive integer"),
    ("vocab-float", _config_row(vocab_size=96.5), "ConfigError", r"'vocab_size' = 96\.5 must be a positive integer"),
    ("no-model-type", _config_row(model_type=None), "ConfigError", r"field 'model_type' is missing"),
    ("mistral-architecture", _config_row(architectures=["MistralForCausalLM"]), "ConfigError",
     r"architectures \['MistralForCausalLM'\] names no Llama class"),
    ("policy-bool-as-string", _policy(norm_cast_before_weight="False"), "PolicyError",
     r"norm_cast_before_weight='False' must be True or False"),
    ("ragged-token-list", _model_call(lambda m: m([[1, 2, 3], [4, 5]])), "InputError",
     r"tokens: rows of different lengths \(3, 2\)"),
    ("max-new-tokens-float", _model_call(lambda m: m.generate([[1, 2, 3]], max_new_tokens=2.5)), "InputError",
     r"max_new_tokens=2\.5 must be an integer >= 1"),
    ("max-new-tokens-string", _model_call(lambda m: m.generate([[1, 2, 3]], max_new_tokens="4")), "InputError",
     r"max_new_tokens='4' must be an integer >= 1"),
    ("top-k-float", _model_call(lambda m: m.generate([[1, 2, 3]], do_sample=True, top_k=2.5)), "InputError",
     r"top_k=2\.5 must be an integer >= 1"),
    ("generate-pad-negative", _model_call(lambda m: m.generate([[1, 2, 3]], pad_token_id=-5)), "InputError",
     r"pad_token_id=-5 must be a token id in \[0, vocab_size=96\)"),
]


@pytest.mark.parametrize("call,error,message", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_config_and_model_api_bad_input(call, error, message, tiny_dir, tmp_path):
    with pytest.raises(Exception) as got:
        call(tiny_dir, tmp_path)
    assert type(got.value).__name__ == error, repr(got.value)
    assert re.search(message, str(got.value)), str(got.value)


def test_an_interrupted_compare_exits_130_with_one_line(tiny_dir, monkeypatch, capsys):
    import compare.ladder.engine

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(compare.ladder.engine, "run_ladder", interrupted)
    assert run_cli(["compare", str(tiny_dir("gqa")), "--random-tokens", "1x8", "--no-files"]) == 130
    assert capsys.readouterr().err.strip() == "llama-parity: interrupted"
