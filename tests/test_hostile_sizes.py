"""Issue 58, classes 1, 6 and 7 (the mesh): sizes from outside checked before the allocation, the
device request or the read they govern; bad input (nested or huge headers and index files, bad
environment values, unknown XLA flags) as the project's own error, exit 2, naming the argument,
field, file or variable; a repeated or unused --mesh refused. Every budget goes through
llamaspec.budget, every environment choice through llamaspec.plan.setting.

Each case returns the text to match; the table says the exit code (or the exception) expected."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from compare import capture
from compare.adapters import dump as dumpmod
from compare.adapters.dump import Dump, DumpError
from llama_parity.cli import main
from llamaspec import LlamaConfig
from llamaspec import fixed_order as fo
from llamaspec.checkpoint import Checkpoint, load_weights
from llamaspec.errors import CheckpointError, InputError, InvarianceError, LlamaParityError
from llamaspec.files import atomic_write
from llamaspec.plan import SettingError, setting
from llamaspec.testing import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TB = 1 << 40


@dataclasses.dataclass
class Case:
    id: str
    run: Callable          # run(tmp, request) -> message
    message: str           # regex the message must hold
    expect: object = 2     # exit code, or the exception type


def _cli(request, argv) -> tuple[int, str]:
    """(exit code, stderr) of the CLI run in this process."""
    capsys = request.getfixturevalue("capsys")
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def _raises(exc, fn) -> tuple[type, str]:
    """(the exception's type, its message): fn must raise exc, one of the project's errors."""
    with pytest.raises(exc) as info:
        fn()
    assert isinstance(info.value, LlamaParityError), type(info.value)
    return type(info.value), str(info.value)


def _sparse(path: Path, size: int, head: bytes = b"") -> None:
    """A file of `size` bytes (sparse: no disk used) starting with `head`."""
    with open(path, "wb") as f:
        f.write(head)
    try:
        os.truncate(path, size)
    except OSError as e:
        pytest.skip(f"this filesystem holds no sparse file of {size} bytes ({e})")


def _st_header(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def _tiny(tmp, request, **config) -> Path:
    """A private copy of a tiny checkpoint (2 layers, 4 heads, 2 KV heads, vocab 96, 128 positions)."""
    return make_checkpoint(tmp / "ck", **config)


def _edit_config(ck: Path, **fields) -> Path:
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(fields)
    atomic_write(ck / "config.json", json.dumps(cfg))
    return ck


def _compare(*extra):
    def run(tmp, request):
        ck = request.getfixturevalue("tiny_dir")("gqa")
        return _cli(request, ["compare", ck, "--random-tokens", "1x4", "--no-files", *extra])
    return run


def _probe(kind, *extra):
    def run(tmp, request):
        ck = request.getfixturevalue("tiny_dir")("gqa")
        return _cli(request, ["probe", kind, ck, *extra])
    return run


def _config_run(**fields):
    def run(tmp, request):
        ck = _edit_config(_tiny(tmp, request), **fields)
        return _cli(request, ["compare", ck, "--random-tokens", "1x4", "--no-files"])
    return run


def _config_text(text: bytes | str, size: int | None = None):
    def run(tmp, request):
        ck = _tiny(tmp, request)
        data = text.encode() if isinstance(text, str) else text
        if size is None:
            (ck / "config.json").write_bytes(data)
        else:
            _sparse(ck / "config.json", size, data)
        return _cli(request, ["compare", ck, "--random-tokens", "1x4", "--no-files"])
    return run


def _index_text(text: str | bytes | None, size: int | None = None):
    """A sharded tiny checkpoint whose model.safetensors.index.json is `text` (or sparse `size`)."""
    def run(tmp, request):
        ck = make_checkpoint(tmp / "ck", shards=2)
        index = ck / "model.safetensors.index.json"
        if size is None:
            index.write_bytes(text.encode() if isinstance(text, str) else text)
        else:
            _sparse(index, size, b'{"weight_map": {')
        return _raises(CheckpointError, lambda: Checkpoint(ck))
    return run


def _header(header_bytes: bytes, extra_payload: int = 0):
    """A tiny checkpoint whose model.safetensors is replaced by this header (and payload)."""
    def run(tmp, request):
        ck = _tiny(tmp, request)
        (ck / "model.safetensors").write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes
                                               + b"\0" * extra_payload)
        return _raises(CheckpointError, lambda: load_weights(ck))
    return run


# ----- dumps: a torchref fp32 capture of a tiny checkpoint, copied per case

@pytest.fixture(scope="module")
def dumped(tiny_dir, tmp_path_factory):
    ck = tiny_dir("gqa")
    ids = np.random.default_rng(0).integers(3, 96, (1, 4))
    out = capture(ck, "torchref", "fp32", inputs=(ids, np.ones_like(ids)),
                  out=tmp_path_factory.mktemp("dump") / "d", taps=["embed", "layers.*.out", "logits"])
    return ck, out


def _dump_copy(tmp, request) -> tuple[Path, Path]:
    import shutil
    ck, out = request.getfixturevalue("dumped")
    return ck, Path(shutil.copytree(out, tmp / "d"))


def _no_hash_of(request, name: str) -> list:
    """Watches the hashing: the refused file must not be hashed (its size says enough); hashing
    it is an AssertionError at once instead of an hour over a sparse terabyte."""
    hashed = []
    real = dumpmod.file_sha256

    def watched(p):
        hashed.append(Path(p).name)
        assert Path(p).name != name, f"{name} hashed before its size was checked"
        return real(p)
    request.getfixturevalue("monkeypatch").setattr(dumpmod, "file_sha256", watched)
    return hashed


def _tap_file_terabyte(tmp, request):
    ck, d = _dump_copy(tmp, request)
    tap = d / "layer-0000.safetensors"
    head = tap.read_bytes()
    _sparse(tap, TB, head)                      # the real header and tensors, then a terabyte
    hashed = _no_hash_of(request, tap.name)
    out = _cli(request, ["compare", ck, "--candidate-dump", d, "--no-files"])
    assert tap.name not in hashed, hashed
    return out


def _tap_file_claims_terabyte_tensor(tmp, request):
    """The header declares the tap at another, terabyte shape, and the file is that long."""
    ck, d = _dump_copy(tmp, request)
    tap = d / "layer-0000.safetensors"
    n = 1 << 38
    header = {"layers.0.out": {"dtype": "F32", "shape": [1, n], "data_offsets": [0, 4 * n]}}
    _sparse(tap, len(_st_header(header)) + 4 * n, _st_header(header))
    hashed = _no_hash_of(request, tap.name)
    msg = _raises(DumpError, lambda: Dump(d))
    assert tap.name not in hashed, hashed
    return msg


def _manifest_claims_terabyte_taps(tmp, request):
    """A manifest whose config and inputs make the logits tap 2 TB, with a file that size: refused
    by the memory budget before it is hashed (the taps could never be read)."""
    ck, d = _dump_copy(tmp, request)
    m = json.loads((d / "manifest.json").read_text())
    vocab, B, T = 2**31 - 1, 64, 4
    m["config"]["vocab_size"] = vocab
    m["inputs"] = {"input_ids": [[3] * T] * B, "attention_mask": [[1] * T] * B}
    m["taps"], m["files"], m["teacher_forcing"] = ["logits"], {"head.safetensors": ["logits"]}, None
    (d / "manifest.json").write_text(json.dumps(m))
    nbytes = B * T * vocab * 4
    header = _st_header({"logits": {"dtype": "F32", "shape": [B, T, vocab], "data_offsets": [0, nbytes]}})
    _sparse(d / "head.safetensors", len(header) + nbytes, header)
    hashed = _no_hash_of(request, "head.safetensors")
    msg = _raises(DumpError, lambda: Dump(d))
    assert "head.safetensors" not in hashed, hashed
    return msg


def _manifest_huge(tmp, request):
    ck, d = _dump_copy(tmp, request)
    _sparse(d / "manifest.json", TB, b"{")
    return _raises(DumpError, lambda: Dump(d))


def _manifest_text(text: str):
    def run(tmp, request):
        ck, d = _dump_copy(tmp, request)
        (d / "manifest.json").write_text(text)
        return _raises(DumpError, lambda: Dump(d))
    return run


def _stray(head: bytes, size: int | None = None):
    """A stray *.safetensors file in the checkpoint folder, read by the fingerprint (capture)."""
    def run(tmp, request):
        ck = _tiny(tmp, request)
        stray = ck / "stray.safetensors"
        if size is None:
            stray.write_bytes(head)
        else:
            _sparse(stray, size, head)
        return _cli(request, ["capture", ck, "--impl", "torchref", "--random-tokens", "1x4", "--out", tmp / "out"])
    return run


def _setting_cli(var, value, *argv):
    def run(tmp, request):
        mp = request.getfixturevalue("monkeypatch")
        mp.setenv(var, value)
        mp.chdir(tmp)       # a relative path given in a variable lands here, never in the repository
        ck = request.getfixturevalue("tiny_dir")("gqa")
        return _cli(request, [a if a != "CK" else ck for a in argv])
    return run


def _kernel_isa(tmp, request):
    request.getfixturevalue("monkeypatch").setenv("LLAMA_PARITY_KERNEL_ISA", "avx1024")
    # a bad value is a setting error, never "the kernels are not available" (which the plans downgrade)
    return _raises(fo.KernelSettingError, fo.requested_isa)


def _setting_api(value):
    def run(tmp, request):
        return _raises(SettingError, lambda: setting("LLAMA_PARITY_SOMETHING", ("auto", "on"), value))
    return run


def _xla_flags(value):
    """The CLI in a fresh process (this one's JAX has read its flags already): XLA would exit 1."""
    def run(tmp, request):
        ck = request.getfixturevalue("tiny_dir")("gqa")
        env = {**os.environ, "XLA_FLAGS": value, "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, "-m", "llama_parity.cli", "capture", str(ck), "--impl", "torchref",
                            "--random-tokens", "1x4", "--out", str(tmp / "out")], env=env, capture_output=True,
                           text=True, timeout=300)
        assert not (tmp / "out").exists()
        return r.returncode, r.stderr
    return run


CLASS_1_SIZES = [
    # --mesh: the device count bounded and the mesh checked against the model before XLA is asked
    Case("mesh-tensor-1e8", _compare("--mesh", "tensor=100000000"),
         r"--mesh 'tensor=100000000': devices: 100000000 is more than 1024"),
    Case("mesh-data-5000", _compare("--mesh", "data=5000"), r"--mesh 'data=5000': devices: 5000 is more than 1024"),
    Case("mesh-product-4096", _compare("--mesh", "data=64,tensor=64"),
         r"--mesh 'data=64,tensor=64': devices: 4096 is more than 1024"),
    Case("mesh-tensor-not-dividing-heads", _compare("--mesh", "tensor=3"),
         r"--mesh tensor=3 does not fit the model: num_attention_heads 4 does not divide over tensor=3"),
    Case("mesh-tensor-beyond-heads", _compare("--mesh", "tensor=8"),
         r"--mesh tensor=8 does not fit the model: num_attention_heads 4 does not divide over tensor=8"),
    Case("where-mesh-not-fitting", _probe("where", "--circumstance", "sharding", "--mesh", "tensor=3"),
         r"--mesh tensor=3 does not fit the model: num_attention_heads 4"),
    # probe where and the probes: the budget --random-tokens has (llamaspec.budget.check_tokens)
    Case("where-length-beyond-positions", _probe("where", "--length", "1000000000"),
         r"--length 1000000000: 1000000000 tokens, the model's max_position_embeddings is 128"),
    Case("where-batch-sizes-huge", _probe("where", "--batch-sizes", "100000000"),
         r"probe where --circumstance batch \(--batch-sizes\): .*100000000 rows .*more than this machine's memory"),
    Case("where-decode-batch-huge", _probe("where", "--circumstance", "decode", "--batch-sizes", "2,900000000"),
         r"probe where --circumstance decode \(--batch-sizes\): .*900000000 rows .*more than this machine's memory"),
    Case("where-pad-huge", _probe("where", "--circumstance", "padding", "--pad", "100000000000"),
         r"probe where --circumstance padding \(--pad\): .*100000000024 slots.*more than this machine's memory"),
    Case("probe-batch-sizes-huge", _probe("batch", "--batch-sizes", "2,100000000"),
         r"probe batch \(--batch-sizes\): .*100000000 rows.*more than this machine's memory"),
    Case("probe-new-tokens-huge", _probe("divergence", "--new-tokens", "1000000000000"),
         r"probe divergence \(--divergence-batch-sizes, --new-tokens\): .*more than this machine's memory"),
    Case("probe-completions-huge", _probe("divergence", "--completions", "1000000000"),
         r"--completions: 1000000000 is more than 100000"),
    Case("probe-processes-huge", _probe("determinism", "--processes", "10000000"),
         r"--processes: 10000000 is more than 100000"),
    Case("compare-decode-huge", _compare("--decode", "1000000000000"),
         r"--decode 1000000000000: the float64 KV cache .* more than this machine's memory"),
    Case("compare-generate-beyond-positions", _compare("--generate", "1000000"),
         r"--generate 1000000: more new tokens than the model's max_position_embeddings \(128\)"),
    # a config's sizes: against the weights present, and sane bounds, before anything per layer is made
    Case("config-layers-beyond-weights", _config_run(num_hidden_layers=5000),
         r"config\.json: field 'num_hidden_layers' = 5000, but the weights hold layers 0\.\.1 \(2 layers\)"),
    Case("config-layers-1e9", _config_run(num_hidden_layers=10**9),
         r"config\.json: field 'num_hidden_layers': 1000000000 is more than 10000"),
    Case("config-vocab-1e40", _config_run(vocab_size=10**40),
         r"config\.json: field 'vocab_size': 10{40} is more than 2147483647"),
    Case("config-positions-2e40", _config_run(max_position_embeddings=2**40),
         r"config\.json: field 'max_position_embeddings': 1099511627776 is more than 2147483647"),
    Case("config-file-terabyte", _config_text(b'{"a": 1', TB),
         r"config\.json: 1099511627776 bytes, more than a config\.json may hold"),
    Case("index-file-terabyte", _index_text(None, TB),
         r"model\.safetensors\.index\.json: 1099511627776 bytes, more than a safetensors index may hold",
         CheckpointError),
    # dumps: file sizes against the declared shapes before any hashing
    Case("dump-tap-file-terabyte", _tap_file_terabyte,
         r"layer-0000\.safetensors: file not fully covered: \d+ trailing bytes after the last tensor"),
    Case("dump-tap-claims-terabyte-shape", _tap_file_claims_terabyte_tensor,
         r"layer-0000\.safetensors: tensor 'layers\.0\.out' has shape \[1, 274877906944\], expected \[1, 4, 32\]",
         DumpError),
    Case("dump-manifest-taps-beyond-memory", _manifest_claims_terabyte_taps,
         r"head\.safetensors: the taps the manifest lists in it .* is 2048\.0 GiB .*more than this machine's memory",
         DumpError),
    Case("dump-manifest-terabyte", _manifest_huge,
         r"manifest\.json: 1099511627776 bytes, more than a manifest may hold", DumpError),
    # a stray file's header length in the fingerprint: bounded like the checkpoint reader's
    Case("fingerprint-stray-header-1gb", _stray(struct.pack("<Q", 1 << 30) + b"{", 2 << 30),
         r"stray\.safetensors: not a safetensors file \(header length field beyond .*at most 104857600 bytes"),
]

DEEP = "[" * 100_000 + "]" * 100_000
LONG_INT = "1" * 5000

CLASS_6_PARSERS = [
    Case("st-header-nested-deep", _header(DEEP.encode()),
         r"model\.safetensors: corrupt safetensors header, nested too deeply", CheckpointError),
    Case("st-header-shape-overflows-int64", _header(json.dumps(
        {"w": {"dtype": "F32", "shape": [2**40, 2**40, 2**40], "data_offsets": [0, 0]}}).encode()),
         r"tensor 'w' byte range \[0, 0\) does not match shape \[1099511627776, ", CheckpointError),
    Case("st-header-shape-beyond-int64", _header(json.dumps(
        {"w": {"dtype": "F32", "shape": [10**30], "data_offsets": [0, 4]}}).encode(), 4),
         r"tensor 'w' byte range \[0, 4\) does not match shape \[10{30}\]", CheckpointError),
    Case("st-header-long-integer", _header(f'{{"w": {{"dtype": "F32", "shape": [{LONG_INT}]}}}}'.encode()),
         r"model\.safetensors: corrupt safetensors header, not readable as JSON", CheckpointError),
    Case("index-nested-deep", _index_text(DEEP),
         r"model\.safetensors\.index\.json: nested too deeply to be read as JSON", CheckpointError),
    Case("index-long-integer", _index_text(f'{{"weight_map": {LONG_INT}}}'),
         r"model\.safetensors\.index\.json: not readable as JSON", CheckpointError),
    Case("index-not-utf8", _index_text(b'{"weight_map": "\xff"}'),
         r"model\.safetensors\.index\.json: not UTF-8 text", CheckpointError),
    Case("config-nested-deep", _config_text(DEEP), r"config\.json: nested too deeply to be read as JSON"),
    Case("config-not-utf8", _config_text(b'{"vocab_size": "\xff\xfe"}'), r"config\.json: not UTF-8 text"),
    Case("config-long-integer", _config_text(f'{{"vocab_size": {LONG_INT}}}'), r"config\.json: not readable as JSON"),
    Case("manifest-long-integer", _manifest_text(f'{{"format": {LONG_INT}}}'),
         r"manifest\.json: not readable as JSON", DumpError),
    Case("fingerprint-stray-header-deep", _stray(struct.pack("<Q", len(DEEP)) + DEEP.encode()),
         r"stray\.safetensors: corrupt safetensors header, nested too deeply"),
    Case("fingerprint-stray-offsets-floats", _stray(_st_header({"w": {"data_offsets": [0.5, 1.5]}}) + b"\0\0"),
         r"stray\.safetensors: corrupt safetensors header \(data_offsets must be \[begin, end\] byte counts"),
    # environment variables: one reader (llamaspec.plan.setting), exit 2 naming the variable and its values
    Case("env-bf16-dots", _setting_cli("LLAMA_PARITY_BF16_DOTS", "fastest", "compare", "CK", "--random-tokens", "1x4",
                                       "--no-files", "--policy", "bf16"),
         r"LLAMA_PARITY_BF16_DOTS='fastest': expected auto, native, widened"),
    Case("env-attention-torchref", _setting_cli("LLAMA_PARITY_ATTENTION", "flash", "compare", "CK",
                                                "--random-tokens", "1x4", "--no-files", "--candidate", "torchref"),
         r"LLAMA_PARITY_ATTENTION='flash': expected auto, fused, kernel, reference"),
    Case("env-attention-kernel-jaxmodel", _setting_cli("LLAMA_PARITY_ATTENTION", "kernel", "compare", "CK",
                                                       "--random-tokens", "1x4", "--no-files"),
         r"LLAMA_PARITY_ATTENTION='kernel': expected auto, fused, reference \(kernel is torchref's"),
    Case("env-products", _setting_cli("LLAMA_PARITY_PRODUCTS", "1", "compare", "CK", "--random-tokens", "1x4",
                                      "--no-files"), r"LLAMA_PARITY_PRODUCTS='1': expected auto, kernel, reference"),
    Case("env-logits", _setting_cli("LLAMA_PARITY_LOGITS", "yes", "compare", "CK", "--random-tokens", "1x4",
                                    "--no-files"), r"LLAMA_PARITY_LOGITS='yes': expected auto, kernel, reference"),
    Case("env-cache-relative", _setting_cli("LLAMA_PARITY_CACHE", "relative/cache", "make-checkpoint", "--shape",
                                            "smollm2-135m", "--layers", "1"),
         r"LLAMA_PARITY_CACHE='relative/cache': expected an absolute path"),
    Case("env-kernel-isa", _kernel_isa, r"LLAMA_PARITY_KERNEL_ISA='avx1024': expected auto, scalar, avx2",
         InvarianceError),
    Case("env-control-characters", _setting_api("\x1b[31mon"),
         r"LLAMA_PARITY_SOMETHING='\\x1b\[31mon': expected auto, on", SettingError),
    # XLA_FLAGS: caught before XLA ends the process with its own code
    Case("xla-unknown-flag", _xla_flags("--xla_bogus"), r"XLA_FLAGS='--xla_bogus': unknown flag --xla_bogus"),
    Case("xla-bad-value", _xla_flags("--xla_cpu_enable_fast_math=maybe"),
         r"--xla_cpu_enable_fast_math: XLA cannot read the value maybe"),
    Case("xla-not-a-flag-list", _xla_flags("flags.txt"),
         r"XLA_FLAGS='flags\.txt': it does not start with '--', so XLA would read it as the name of a file"),
    Case("xla-device-count-1e8", _xla_flags("--xla_force_host_platform_device_count=100000000"),
         r"--xla_force_host_platform_device_count=100000000 asks for more host devices than 1024"),
]

CLASS_7_MESH = [
    Case("mesh-axis-twice", _compare("--mesh", "data=2,data=4"),
         r"--mesh 'data=2,data=4': axis 'data' is given twice \(data=2 and data=4\)"),
    Case("mesh-axis-twice-same-size", _compare("--mesh", "tensor=2, tensor=2"), r"axis 'tensor' is given twice"),
    Case("mesh-unknown-axis", _compare("--mesh", "model=2"), r"--mesh 'model=2': unknown axis 'model'"),
    Case("mesh-empty", _compare("--mesh", ","), r"--mesh ',': give axis=size parts"),
    Case("mesh-size-zero", _compare("--mesh", "tensor=0"), r"axis 'tensor' has size 0; sizes are at least 1"),
    Case("mesh-unicode-digit", _compare("--mesh", "tensor=\u00b2"), r"each part is axis=size"),
    Case("mesh-unused-by-probe", _probe("batch", "--mesh", "tensor=2"),
         r"--mesh tensor=2: only probe where --circumstance sharding uses a mesh; probe batch"),
    Case("mesh-unused-by-circumstance", _probe("where", "--circumstance", "padding", "--mesh", "tensor=2"),
         r"--mesh tensor=2: only --circumstance sharding uses a mesh \(this is --circumstance padding\)"),
    Case("mesh-same-mesh-twice", _probe("where", "--circumstance", "sharding", "--mesh", "tensor=2",
                                        "--mesh", "tensor=2"), r"--mesh tensor=2: the same mesh is given twice"),
    Case("mesh-without-jaxmodel", _compare("--mesh", "tensor=2", "--candidate", "torchref"),
         r"--mesh shards jaxmodel"),
]


def _check(case, tmp_path, request):
    """case.run returns (the exit code or the exception's type, the message)."""
    outcome, text = case.run(tmp_path, request)
    if isinstance(case.expect, int):
        assert outcome == case.expect, f"{case.id}: exit {outcome}: {text[-2000:]}"
    else:
        assert issubclass(outcome, case.expect), f"{case.id}: {outcome.__name__}: {text}"
    assert re.search(case.message, text, re.S), f"{case.id}: {text!r}"
    assert "Traceback" not in text and "internal error" not in text, text


@pytest.mark.parametrize("case", CLASS_1_SIZES, ids=lambda c: c.id)
def test_sizes_are_checked_before_they_are_used(case, tmp_path, request):
    _check(case, tmp_path, request)


@pytest.mark.parametrize("case", CLASS_6_PARSERS, ids=lambda c: c.id)
def test_bad_input_is_a_named_error(case, tmp_path, request):
    _check(case, tmp_path, request)


@pytest.mark.parametrize("case", CLASS_7_MESH, ids=lambda c: c.id)
def test_mesh_arguments_repeated_or_unused_are_refused(case, tmp_path, request):
    _check(case, tmp_path, request)


def test_budget_bounds_hold_for_real_models():
    """The sanity bounds are far above real models: SmolLM2 and Llama-3.1-405B's config sizes pass."""
    from llamaspec.budget import MAX_HOST_DEVICES, MAX_LAYERS, MAX_SIZE_FIELD
    big = dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
               num_attention_heads=128, num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072)
    cfg = LlamaConfig.from_dict(big)
    assert cfg.num_hidden_layers <= MAX_LAYERS and cfg.vocab_size <= MAX_SIZE_FIELD
    assert MAX_HOST_DEVICES >= 512


@pytest.mark.parametrize("options", [dict(length=1_000_000), dict(length=8, batch_sizes=(2, 10**9))],
                         ids=["length-beyond-positions", "batch-sizes-huge"])
def test_probe_where_library_call_checks_the_budget(tiny_dir, options):
    """probe_where as a library call: the same budget the CLI checks, before the plan's arrays."""
    from compare.probes.where import probe_where
    with pytest.raises(InputError) as info:
        probe_where("torchref", "batch", checkpoint=tiny_dir("gqa"), policy="fp32", **options)
    assert "probe where, batch" in str(info.value), info.value
