"""Hostile inputs that one way of reading took and another refused, or that were judged
without naming their cause (issue 58, classes 3 and 7): every reader of a checkpoint refuses
a bad one with the same error (llamaspec.checkpoint.validated), config fields that make NaN
are named, a port that is not deterministic is named, refusals never echo file contents, and
every JSON report is strict JSON."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from llamaspec.checkpoint import Checkpoint
from llamaspec.errors import CheckpointError
from llamaspec.files import atomic_write

IDS = np.array([[5, 7, 9, 11, 13, 17]])
MASK = np.ones_like(IDS)


# ------------------------------------------------------------- class 3: one validation path

def _tensors(folder) -> dict:
    ck = Checkpoint(folder)
    return {k: np.array(ck.get(k)) for k in ck.keys()}


def _write(src: Path, dst: Path, change, config=None, shards=1) -> Path:
    """dst: src's config (updated by `config`) and its tensors changed by change(tensors)."""
    dst.mkdir(parents=True)
    cfg = {**json.loads((src / "config.json").read_text()), **(config or {})}
    atomic_write(dst / "config.json", json.dumps(cfg))
    tensors = _tensors(src)
    change(tensors)
    if shards == 1:
        _save(tensors, dst / "model.safetensors")
    else:
        keys, weight_map = list(tensors), {}
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            _save({k: tensors[k] for k in keys[s::shards]}, dst / name)
            weight_map.update({k: name for k in keys[s::shards]})
        atomic_write(dst / "model.safetensors.index.json", json.dumps({"weight_map": weight_map}))
    return dst


def _save(tensors, path) -> None:
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))


def _set(key, index, value):
    def change(t):
        t[key] = np.array(t[key])
        t[key][index] = value
    return change


def _lm_head_not_embedding(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"] * 1.5


def _lm_head_one_value_off(t):
    t["lm_head.weight"] = np.array(t["model.embed_tokens.weight"])
    t["lm_head.weight"][95, 31] += 1.0       # a row no input here uses, the last value


def _lm_head_wrong_shape(t):
    t["lm_head.weight"] = np.array(t["model.embed_tokens.weight"][:, :16])


def _lm_head_int(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"].astype(np.int32)


def _drop(key):
    def change(t):
        del t[key]
    return change


def _reshape(key, shape):
    def change(t):
        t[key] = np.zeros(shape, t[key].dtype)
    return change


def _as(key, dtype):
    def change(t):
        t[key] = t[key].astype(dtype)
    return change


# (id, base tiny config, config change, tensor change, shards, words the message must hold)
BAD = [
    ("tied-lm-head-differs", "gqa", {"tie_word_embeddings": True}, _lm_head_not_embedding, 1,
     ["tie_word_embeddings is true", "lm_head.weight", "differs from model.embed_tokens.weight"]),
    ("tied-lm-head-one-unused-value-off", "gqa", {"tie_word_embeddings": True}, _lm_head_one_value_off, 1,
     ["tie_word_embeddings is true", "lm_head.weight", "differs"]),
    ("tied-lm-head-other-shard", "gqa", {"tie_word_embeddings": True}, _lm_head_not_embedding, 3,
     ["tie_word_embeddings is true", "lm_head.weight", "differs"]),
    ("tied-lm-head-wrong-shape", "gqa", {"tie_word_embeddings": True}, _lm_head_wrong_shape, 1,
     ["tie_word_embeddings is true", "[96, 16]", "differs"]),
    ("tied-lm-head-int-storage", "gqa", {"tie_word_embeddings": True}, _lm_head_int, 1,
     ["tie_word_embeddings is true", "int32", "differs"]),
    ("missing-layer-tensor", "gqa", None, _drop("model.layers.1.self_attn.v_proj.weight"), 1,
     ["missing tensors", "model.layers.1.self_attn.v_proj.weight"]),
    ("missing-lm-head-untied", "gqa", None, _drop("lm_head.weight"), 1, ["missing tensors", "lm_head.weight"]),
    ("wrong-shape", "gqa", None, _reshape("model.layers.0.mlp.up_proj.weight", (64, 16)), 1,
     ["wrongly shaped", "model.layers.0.mlp.up_proj.weight", "expected [64, 32]", "[64, 16]"]),
    ("nan-in-layer-weight", "gqa", None, _set("model.layers.1.mlp.down_proj.weight", (3, 4), np.nan), 1,
     ["tensor 'model.layers.1.mlp.down_proj.weight' has 1 NaN/Inf"]),
    ("inf-in-norm-weight", "gqa", None, _set("model.layers.0.input_layernorm.weight", 2, np.inf), 1,
     ["tensor 'model.layers.0.input_layernorm.weight' has 1 NaN/Inf"]),
    ("nan-in-lm-head", "gqa", None, _set("lm_head.weight", (90, 0), np.nan), 1,
     ["tensor 'lm_head.weight' has 1 NaN/Inf"]),
    # a row of the embedding no input here reads: the streamed runs read only the rows used
    ("nan-in-unused-embedding-row", "gqa", None, _set("model.embed_tokens.weight", (90, 3), np.nan), 1,
     ["tensor 'model.embed_tokens.weight' has 1 NaN/Inf"]),
    ("nan-in-bf16-bias", "bias", None,
     lambda t: (_as("model.layers.0.self_attn.k_proj.bias", ml_dtypes.bfloat16)(t),
                _set("model.layers.0.self_attn.k_proj.bias", 1, np.nan)(t)), 1,
     ["tensor 'model.layers.0.self_attn.k_proj.bias' has 1 NaN/Inf"]),
    ("non-float-storage", "gqa", None, _as("model.layers.0.self_attn.q_proj.weight", np.int32), 1,
     ["model.layers.0.self_attn.q_proj.weight", "storage dtype int32 is not a float type"]),
]


def _stream(package):
    def read(folder):
        from compare.ladder.stream import CheckpointModel, stream_capture
        return stream_capture(CheckpointModel(package, folder, "fp32"), IDS, MASK)
    return read


def _compare(stream):
    def read(folder):
        from compare import compare_models
        return compare_models("torchref", "jaxmodel", folder, inputs=(IDS, MASK), stream=stream,
                              teacher_forcing=False)
    return read


def _where(package):
    def read(folder):
        from compare.probes.where import probe_where
        return probe_where(package, "batch", checkpoint=folder, policy="fp32", batch_sizes=(2,), kinds=("equal",),
                           length=6)
    return read


def _load_weights(folder):
    from llamaspec import load_weights
    return load_weights(folder)


def _from_pretrained(package):
    def read(folder):
        import importlib
        return importlib.import_module(package).from_pretrained(folder, policy="fp32")
    return read


def _transformers(folder):
    pytest.importorskip("transformers")
    from compare.adapters.transformers import TransformersModel
    return TransformersModel.from_pretrained(folder)


# Every way the project reads a checkpoint's weights (grep: validated, load_weights, from_pretrained, Checkpoint().
READERS = {
    "load_weights": _load_weights,
    "torchref.from_pretrained": _from_pretrained("torchref"),
    "jaxmodel.from_pretrained": _from_pretrained("jaxmodel"),
    "stream-capture-torchref": _stream("torchref"),
    "stream-capture-jaxmodel": _stream("jaxmodel"),
    "compare-streamed": _compare(True),
    "compare-whole": _compare(False),
    "probe-where-streamed-torchref": _where("torchref"),
    "transformers.from_pretrained": _transformers,
}


@pytest.fixture(scope="module")
def bad_checkpoints(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    return {case[0]: _write(tiny_dir(case[1]), root / case[0], case[3], case[2], case[4]) for case in BAD}


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_every_reader_refuses_a_bad_checkpoint_with_the_same_error(case, bad_checkpoints):
    name, *_, words = case
    folder = bad_checkpoints[name]
    messages = {}
    for reader, read in READERS.items():
        with pytest.raises(CheckpointError) as info:
            read(folder)
        messages[reader] = str(info.value)
    for w in words:
        assert w in messages["load_weights"], messages["load_weights"]
    assert {r: m for r, m in messages.items() if m != messages["load_weights"]} == {}, messages["load_weights"]


CLI_BAD = ["tied-lm-head-differs", "nan-in-unused-embedding-row", "wrong-shape"]


@pytest.mark.parametrize("stream", [[], ["--no-stream"]], ids=["streamed", "whole"])
@pytest.mark.parametrize("name", CLI_BAD)
def test_the_cli_refuses_a_bad_checkpoint_with_exit_2_streamed_or_whole(name, stream, bad_checkpoints, capsys):
    """The same checkpoints through `compare` (streamed by default, and --no-stream): exit 2 and
    the validated() message, never a verdict (the streamed path said 'drift', exit 0, for the
    first row)."""
    from llama_parity.cli import main
    words = next(c[-1] for c in BAD if c[0] == name)
    capsys.readouterr()
    rc = main(["compare", str(bad_checkpoints[name]), "--random-tokens", "1x6", "--no-files",
               "--no-teacher-forcing", *stream])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert all(w in err for w in words) and "internal error" not in err, err


@pytest.mark.parametrize("reader", list(READERS), ids=list(READERS))
def test_a_tied_checkpoint_with_its_embedding_copied_as_lm_head_is_read_by_every_reader(reader, tiny_dir,
                                                                                         tmp_path):
    """Some exporters write lm_head.weight beside a tied embedding: a bitwise copy is fine."""
    folder = _write(tiny_dir("gqa"), tmp_path / "copy", lambda t: t.update(
        {"lm_head.weight": np.array(t["model.embed_tokens.weight"])}), {"tie_word_embeddings": True})
    READERS[reader](folder)


# ------------------------------------------- class 7: config fields that make NaN / Inf are named

def _cli(argv, capsys) -> tuple[int, str]:
    from llama_parity.cli import main
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
# (id, config fields, words the refusal must hold): each made NaN/Inf (or lost the value) in the
# float32 RoPE tables or norms before, and was judged "precision" on the candidate
NUMERIC_FIELDS = [
    ("rope-theta-tiny", {"rope_theta": 1e-300}, ["'rope_theta' = 1e-300", "above 1"]),
    ("rope-theta-below-one", {"rope_theta": 0.5}, ["'rope_theta' = 0.5", "above 1"]),
    ("rope-theta-beyond-float32", {"rope_theta": 1e39}, ["'rope_theta' = 1e+39", "float32"]),
    ("rope-parameters-theta-tiny", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e-40}},
     ["'rope_theta' = 1e-40"]),
    ("linear-factor-tiny", {"rope_scaling": {"rope_type": "linear", "factor": 1e-300}}, ["factor", "1e-300", "linear"]),
    ("dynamic-factor-huge", {"rope_scaling": {"rope_type": "dynamic", "factor": 1e300}}, ["factor", "1e+300",
                                                                                         "dynamic"]),
    ("llama3-factor-tiny", {"rope_scaling": {**LLAMA3, "factor": 1e-30}}, ["factor", "1e-30", "llama3"]),
    ("rms-norm-eps-zero-in-float32", {"rms_norm_eps": 1e-300}, ["'rms_norm_eps' = 1e-300", "float32"]),
    ("rms-norm-eps-subnormal", {"rms_norm_eps": 1e-40}, ["'rms_norm_eps' = 1e-40"]),
    ("max-position-past-float32-integers", {"max_position_embeddings": 2 ** 24 + 1},
     ["'max_position_embeddings' = 16777217", "2**24"]),
    ("two-fields-at-once", {"rope_theta": 1e-300, "rms_norm_eps": 1e-300}, ["'rope_theta'", "'rms_norm_eps'"]),
]


@pytest.mark.parametrize("fields,words", [c[1:] for c in NUMERIC_FIELDS], ids=[c[0] for c in NUMERIC_FIELDS])
def test_config_fields_that_make_nan_are_refused_by_name(fields, words, tiny_dir, tmp_path, capsys):
    src = tiny_dir("gqa")
    folder = _write(src, tmp_path / "ck", lambda t: None, fields)
    rc, text = _cli(["compare", folder, "--random-tokens", "1x6", "--no-files", "--no-teacher-forcing"], capsys)
    assert rc == 2, text
    assert "config.json" in text and all(w in text for w in words), text


@pytest.mark.parametrize("fields", [{"rope_theta": 1e6}, {"rope_theta": 1.5}, {"rms_norm_eps": 1e-12},
                                    {"rope_scaling": {"rope_type": "linear", "factor": 1.0}},
                                    {"rope_scaling": {**LLAMA3, "factor": 32.0}}, {"max_position_embeddings": 2 ** 24}],
                         ids=["theta-1e6", "theta-1.5", "eps-1e-12", "linear-factor-1", "llama3-factor-32",
                              "max-position-2**24"])
def test_sane_numeric_fields_still_load(fields):
    from llamaspec import LlamaConfig
    from llamaspec.testing import TINY
    LlamaConfig.from_dict({**TINY, **fields})


# --------------------------------------------------------- class 7: strict JSON in every report

NAN, INF = float("nan"), float("inf")


def _strict(text: str):
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def _ladder_report(tmp):
    from compare.ladder.engine import Report
    r = Report("torchref", "jaxmodel", {"name": "fp32"}, "precision", None, [], [{"layer": 0, "cand_local": NAN}],
               logits={"top1_agreement": NAN, "max_abs": np.float32(INF)}, run={"seconds": {"x": -INF}})
    return r.to_json(tmp / "report.json")


def _probe_result(tmp):
    from compare.probes.invariance import ProbeResult
    r = ProbeResult("batch", "torchref fp32 default", "torchref", "fp32", "default", "drift", "hint",
                    NAN, INF, NAN, 0, NAN, np.float64(NAN), NAN, NAN, [], {"margin": NAN})
    return r.to_json(tmp / "probe.json")


def _probes_report(tmp):
    from compare.report.probes import write_json
    return write_json([{"probe": "batch", "verdict": "drift", "max_abs": NAN, "cases": [{"max_ulp": INF}]}],
                      tmp / "probes.json", {"seconds": NAN})


def _where_report(tmp):
    from compare.report.where import write_json
    return write_json({"verdict": "drift", "comparisons": [{"rel": NAN, "ratio": -INF}]}, tmp / "where.json",
                      {"seconds": np.float32(NAN)})


def _demo_summary(tmp):
    from llama_parity.demo import write_json
    return write_json(tmp / "demo.json", {"splits": [{"margin": NAN, "oracle_margin": INF}],
                                          "seconds": [("ladder", NAN)], "tie": np.float32(NAN)})


# every writer of a JSON report, fed a NaN and an Inf
JSON_WRITERS = {"ladder-report": _ladder_report, "probe-result": _probe_result, "probes-report": _probes_report,
                "where-report": _where_report, "demo-json": _demo_summary}


@pytest.mark.parametrize("writer", list(JSON_WRITERS), ids=list(JSON_WRITERS))
def test_every_json_report_is_strict_json_with_nan_and_inf_as_strings(writer, tmp_path):
    text = Path(JSON_WRITERS[writer](tmp_path)).read_text()
    assert "NaN" not in text and "Infinity" not in text, text
    doc = _strict(text)
    flat = json.dumps(doc)
    assert '"nan"' in flat and ('"inf"' in flat or '"-inf"' in flat), flat


def test_json_text_is_the_one_rule():
    from llamaspec.files import json_text
    assert _strict(json_text({"a": [NAN, -INF, np.float32(INF), np.array([1.0, NAN])], "b": (np.int64(2),)})) == \
        {"a": ["nan", "-inf", "inf", [1.0, "nan"]], "b": [2]}


# ------------------------------------------- class 7: a port that does not repeat itself is named

class _Port:
    """torchref behind the protocol; `spoil(call, tap, array)` changes what a call returns."""

    def __init__(self, ck, policy="fp32", spoil=None, name="my-port"):
        from compare.adapters.ours import OurModel
        from llamaspec import Policy
        self.m = OurModel.load("torchref", ck, Policy.get(policy))
        self.ck, self.policy_name, self.spoil, self.name, self.taps = ck, policy, spoil, name, self.m.taps
        self.calls = 0

    def float64(self):
        return _Port(self.ck, "fp64", None, self.name)

    def capture(self, tokens, attention_mask, taps, inject=None):
        self.calls += 1
        logits, acts = self.m.capture(tokens, attention_mask, taps, inject=inject)
        if self.spoil is None:
            return logits, acts
        acts = {t: self.spoil(self.calls, t, np.array(a)) for t, a in acts.items()}
        return self.spoil(self.calls, "logits (returned)", np.array(logits)), acts


def _noise_everywhere(call, tap, a):
    """A different random perturbation at every call (threaded sums, an unseeded dropout)."""
    return a + np.random.default_rng().standard_normal(a.shape).astype(a.dtype) * np.float32(1e-6) * np.abs(a).max()


def _from(tap_kind):
    def spoil(call, tap, a):
        return a * np.float32(1 + 1e-6 * call) if tap.endswith(tap_kind) else a
    return spoil


def _padding_only(call, tap, a):
    a = np.array(a)
    if a.ndim >= 2 and a.shape[1] == 8:
        a[1, -2:] = call          # slots the mask marks as padding
    return a


class _ReusesBuffers:
    """Deterministic numbers, but the arrays of one call are overwritten by the next."""

    def __init__(self, ck):
        self.inner, self.kept = _Port(ck), {}
        self.name, self.taps = "buffer-port", self.inner.taps

    def float64(self):
        return self.inner.float64()

    def capture(self, tokens, attention_mask, taps, inject=None):
        logits, acts = self.inner.capture(tokens, attention_mask, taps, inject=inject)
        for t, a in acts.items():
            buf = self.kept.setdefault(t, np.empty_like(a))
            buf[...] = a + (np.float32(self.inner.calls) if t == "layers.1.mlp_out" else 0)
        return logits, {t: self.kept[t] for t in acts}


def _ids_with_padding():
    ids = np.random.default_rng(1).integers(3, 96, (2, 8))
    mask = np.ones_like(ids)
    mask[1, -2:] = 0
    return ids, mask


# (id, side the port is on, the port, words the refusal holds)
NOT_DETERMINISTIC = [
    ("noise-at-every-call", "candidate", lambda ck: _Port(ck, spoil=_noise_everywhere),
     ["my-port: not deterministic", "first at tap 'embed'"]),
    ("from-a-later-layer", "candidate", lambda ck: _Port(ck, spoil=_from("layers.1.up")),
     ["my-port: not deterministic", "first at tap 'layers.1.up'"]),
    # the logits tap is the returned logits (a change after the lm_head's product is judged there)
    ("only-the-returned-logits", "candidate", lambda ck: _Port(ck, spoil=_from("logits (returned)")),
     ["not deterministic", "first at tap 'logits'"]),
    ("on-the-reference-side", "reference", lambda ck: _Port(ck, spoil=_from("attn_out"), name="ref-port"),
     ["ref-port: not deterministic", "first at tap 'layers.0.attn_out'"]),
    ("reuses-its-output-buffers", "candidate", _ReusesBuffers,
     ["buffer-port: not deterministic", "reuses its output buffers", "'layers.1.mlp_out'"]),
]


@pytest.mark.parametrize("side,make,words", [c[1:] for c in NOT_DETERMINISTIC], ids=[c[0] for c in NOT_DETERMINISTIC])
def test_a_port_that_does_not_repeat_itself_is_named_before_it_is_judged(side, make, words, tiny_dir):
    from compare import compare_models
    from compare.ladder.engine import NotDeterministic
    ck = tiny_dir("gqa")
    port = make(ck)
    sides = {"reference": "torchref", "candidate": "torchref", side: port}
    with pytest.raises(NotDeterministic) as info:
        compare_models(sides["reference"], sides["candidate"], ck, inputs=_ids_with_padding(), policy="fp32",
                       teacher_forcing=False)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("make", [lambda ck: _Port(ck), lambda ck: _Port(ck, spoil=_padding_only)],
                         ids=["deterministic", "differs-only-in-padding"])
def test_a_port_that_repeats_itself_is_judged(make, tiny_dir):
    from compare import compare_models
    ck = tiny_dir("gqa")
    port = make(ck)
    rep = compare_models("torchref", port, ck, inputs=_ids_with_padding(), policy="fp32", teacher_forcing=False)
    assert rep.verdict in ("exact", "drift") and port.calls >= 3    # policy, again, capture check


def test_check_determinism_false_skips_the_extra_capture(tiny_dir):
    from compare import compare_models
    ck = tiny_dir("gqa")
    port = _Port(ck, spoil=_from("layers.1.up"))
    rep = compare_models("torchref", port, ck, inputs=_ids_with_padding(), policy="fp32", teacher_forcing=False,
                         check_determinism=False)
    assert rep.verdict in KINDS_JUDGED


KINDS_JUDGED = ("exact", "drift", "precision", "semantic")


# ------------------------------------ class 7: NaN/Inf in a comparison: the first tap and its cause

def _zero_row_checkpoint(src: Path, dst: Path, **config) -> Path:
    """src's weights with token 5's embedding all zeros (a pad token's often is), config changed."""
    return _write(src, dst, _set("model.embed_tokens.weight", 5, 0.0), config)


def _nan_from(tap_kind):
    def spoil(call, tap, a):
        if tap.endswith(tap_kind) or (tap_kind != "logits" and _after(tap, tap_kind)):
            a = np.array(a)
            a[0, 2] = np.nan
        return a
    return spoil


def _after(tap, kind):
    from llamaspec import taps as tapnames
    order = [t for t in tapnames.all_taps(2)]
    first = next(t for t in order if t.endswith(kind))
    return tap in order and order.index(tap) > order.index(first)


NAN_ROWS = [
    # (id, stream, how the comparison is set up, words the summary holds, Report.nonfinite's cause or None)
    ("eps-zero-in-float16-norm-streamed", True, "eps",
     ["NaN/Inf first at layers.0.attn_norm", "rms_norm_eps = 1e-08", "is 0 in float16", "both sides"],
     "config field 'rms_norm_eps'"),
    ("eps-zero-in-float16-norm-whole", False, "eps", ["NaN/Inf first at layers.0.attn_norm", "rms_norm_eps"],
     "config field 'rms_norm_eps'"),
    ("port-nan-from-layer-1", False, "port", ["NaN/Inf first at layers.1.mlp_out", "in the candidate only",
                                              "no config field explains it"], None),
]


@pytest.mark.parametrize("stream,how,words,cause", [c[1:] for c in NAN_ROWS], ids=[c[0] for c in NAN_ROWS])
def test_nan_in_a_comparison_names_its_first_tap_and_the_config_field(stream, how, words, cause, tiny_dir, tmp_path):
    from compare import compare_models
    from llamaspec import Policy
    ids = np.array([[7, 5, 9, 11, 13, 17]])
    inputs = (ids, np.ones_like(ids))
    if how == "eps":
        ck = _zero_row_checkpoint(tiny_dir("gqa"), tmp_path / "ck", rms_norm_eps=1e-8)
        rep = compare_models("torchref", "jaxmodel", ck, inputs=inputs, policy=Policy.get("fp32", norm_dtype="float16"),
                             stream=stream, teacher_forcing=False)
    else:
        ck = tiny_dir("gqa")
        rep = compare_models("torchref", _Port(ck, spoil=_nan_from("layers.1.mlp_out")), ck, inputs=inputs,
                             policy="fp32", teacher_forcing=False, check_determinism=False)
    text = rep.summary()
    assert all(w in text for w in words), text
    assert rep.nonfinite.get("cause") == cause and rep.nonfinite["tap"] in text
    assert _strict(Path(rep.to_json(tmp_path / "r.json")).read_text())["nonfinite"]["tap"] == rep.nonfinite["tap"]


# (id, tap, config fields, policy knobs, max position, the cause named or None)
CAUSES = [
    ("eps-zero-in-float16", "layers.3.mlp_norm", {"rms_norm_eps": 1e-9}, {"norm_dtype": "float16"}, 8,
     "config field 'rms_norm_eps'"),
    ("eps-fine-in-float32", "layers.0.attn_norm", {"rms_norm_eps": 1e-9}, {}, 8, None),
    ("eps-at-a-later-tap-is-not-the-norm", "layers.0.q", {"rms_norm_eps": 1e-9}, {"norm_dtype": "float16"}, 8, None),
    ("theta-inf-in-float16-rope", "layers.0.q_rope", {"rope_theta": 1e5}, {"rope_dtype": "float16"}, 8,
     "config field 'rope_theta'"),
    ("linear-factor-inf-in-float16", "layers.1.k_rope", {"rope_scaling": {"rope_type": "linear", "factor": 65536.0}},
     {"rope_dtype": "float16"}, 8, "config field 'rope factor'"),
    ("positions-past-float16", "layers.0.k_rope", {"max_position_embeddings": 131072}, {"rope_dtype": "float16"},
     70000, "the input's positions"),
    ("rope-fine-in-float32", "layers.0.q_rope", {"rope_theta": 1e5}, {}, 70000, None),
]


@pytest.mark.parametrize("tap,fields,knobs,pos,cause", [c[1:] for c in CAUSES], ids=[c[0] for c in CAUSES])
def test_the_config_field_behind_a_nan_is_named(tap, fields, knobs, pos, cause):
    from compare.judge.verdicts import nonfinite_cause
    from llamaspec import LlamaConfig, Policy
    from llamaspec.testing import TINY
    got = nonfinite_cause(tap, LlamaConfig.from_dict({**TINY, **fields}), Policy.get("fp32", **knobs), pos)
    assert (got and got[0]) == cause, got


# -------------------------------------------- class 7: refusals never echo what a file holds

SECRETS = {
    "text": b"hunter2-SECRET-PASSPHRASE-0123456789\n" * 4,
    "binary": b"PK\x03\x04\x14\x00\x08\x00SECRETBYTES\xff\xfe" * 8,
    "json": json.dumps({"api_key": "hunter2-SECRET", "weight_map": "hunter2-SECRET", "nested": [1, 2]}).encode(),
    "small-length": (40).to_bytes(8, "little") + b"hunter2-SECRET-IN-A-HEADER" * 4,   # a length inside the file
}


def _leaks(text: str, secret: bytes) -> list[str]:
    """Traces of the secret: its words, its first bytes as the integers a header length would
    print, their hex."""
    first = secret[:8]
    traces = ["hunter2", "SECRET", "api_key", first.hex(), str(int.from_bytes(first, "little")),
              str(int.from_bytes(first, "big"))]
    return [t for t in traces if t in text]


def _plant(rel):
    def plant(folder: Path, secret: Path) -> Path:
        (folder / rel).unlink(missing_ok=True)
        (folder / rel).symlink_to(secret)
        return folder
    return plant


def _dump_folder(tiny_dir, tmp):
    from compare import capture
    ck = tiny_dir("gqa")
    ids = np.random.default_rng(0).integers(3, 96, (1, 6))
    return ck, Path(capture(ck, "torchref", "fp32", inputs=(ids, np.ones_like(ids)), out=tmp / "dump",
                            taps=["embed", "layers.*.out", "logits"]))


# (id, what is planted, how it is read: "compare", "compare-tokenizer", "dump", "capture")
SYMLINKED = [
    ("config-json", "config.json", "compare"),
    ("weights", "model.safetensors", "compare"),
    ("index", "model.safetensors.index.json", "compare"),
    ("tokenizer", "tokenizer.json", "compare-tokenizer"),
    ("weights-fingerprinted-by-capture", "model.safetensors", "capture"),
    ("dump-manifest", "manifest.json", "dump"),
    ("dump-tap-file", "layer-0001.safetensors", "dump"),
]


@pytest.mark.parametrize("secret", list(SECRETS), ids=list(SECRETS))
@pytest.mark.parametrize("rel,how", [c[1:] for c in SYMLINKED], ids=[c[0] for c in SYMLINKED])
def test_a_refused_file_is_named_and_its_contents_never_echoed(rel, how, secret, tiny_dir, tmp_path, capsys):
    import shutil
    secret_file = tmp_path / "secret"
    atomic_write(secret_file, SECRETS[secret])
    if how == "dump":
        ck, dump = _dump_folder(tiny_dir, tmp_path)
        _plant(rel)(dump, secret_file)
        argv = ["compare", ck, "--candidate-dump", dump, "--no-files", "--no-teacher-forcing"]
    else:
        folder = Path(shutil.copytree(tiny_dir("gqa"), tmp_path / "ck"))
        _plant(rel)(folder, secret_file)
        argv = {"compare": ["compare", folder, "--random-tokens", "1x6", "--no-files", "--no-teacher-forcing"],
                "compare-tokenizer": ["compare", folder, "--prompt", "hi", "--no-files", "--no-teacher-forcing"],
                "capture": ["capture", folder, "--out", tmp_path / "out", "--random-tokens", "1x6"]}[how]
    rc, text = _cli(argv, capsys)
    assert rc == 2 and rel in text, text
    assert _leaks(text, SECRETS[secret]) == [], text


def test_no_reader_of_weights_goes_around_validated():
    """The readers above are all there are: outside llamaspec/checkpoint.py no module opens a
    Checkpoint itself, and every module that reads tensor rows got its Checkpoint from
    validated() (check_checkpoint, which reads no tensor data, gives only config and storage)."""
    import re
    root = Path(__file__).resolve().parents[1]
    opened, unvalidated = [], []
    for pkg in ("llamaspec", "compare", "jaxmodel", "torchref", "llama_parity"):
        for path in sorted((root / pkg).rglob("*.py")):
            rel, text = str(path.relative_to(root)), path.read_text()
            if rel == "llamaspec/checkpoint.py":
                continue
            if re.search(r"\bCheckpoint\(", text):
                opened.append(rel)
            if ".read_rows(" in text and "validated(" not in text:
                unvalidated.append(rel)
    assert opened == [] and unvalidated == []
