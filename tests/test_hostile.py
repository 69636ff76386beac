"""Hostile files and faults (docs/threat-model.md): one row per case the hostile-input review
tried, with the class it had before the fix ("bad": silently wrong, data lost or a security
hole; "poor": refused with a traceback, a wrong exit code or a misleading message) and the
message it must show now. Each plant(tmp, request) returns a function that runs the case,
asserts what must hold (files untouched, nothing written outside) and returns the text
to match."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from compare import capture, compare_models
from compare.adapters import Checked, PortError, inject_support
from compare.adapters.dump import Dump, DumpError
from compare.adapters.ours import OurModel
from llama_parity.cli import main
from llamaspec import LlamaConfig, Policy
from llamaspec import fixed_order as fo
from llamaspec.errors import CheckpointError, ConfigError, InvarianceError
from llamaspec.files import WriteError, atomic_write, printable, safe_name

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 54321      # a user that is not us (we may be root: os.chown makes files theirs)


def inputs(B=2, T=8, vocab=96, seed=0):
    return np.random.default_rng(seed).integers(3, vocab, (B, T)), np.ones((B, T), np.int64)


@pytest.fixture(scope="module")
def dumped(tiny_dir, tmp_path_factory):
    """A torchref fp32 capture of a tiny checkpoint (layer outputs and logits), and the checkpoint."""
    ck = tiny_dir("gqa")
    out = capture(ck, "torchref", "fp32", inputs=inputs(), out=tmp_path_factory.mktemp("dump") / "d",
                  taps=["embed", "layers.*.out", "logits"])
    return ck, out


def _copy(request, tmp) -> tuple[Path, Path]:
    ck, out = request.getfixturevalue("dumped")
    return ck, Path(shutil.copytree(out, tmp / "work" / "d"))


def _edit_manifest(d: Path, change) -> None:
    m = json.loads((d / "manifest.json").read_text())
    change(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _raises(exc, fn) -> str:
    with pytest.raises(exc) as info:
        fn()
    return str(info.value)


def _cli(request, argv, cwd=None) -> tuple[int, str, str]:
    if cwd is not None:
        request.getfixturevalue("monkeypatch").chdir(cwd)
    capsys = request.getfixturevalue("capsys")
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ----------------------------------------------------------------------- bad 1: names from a dump

def _dump_names_the_report(field, value, expect_stem):
    def plant(tmp, request):
        ck, d = _copy(request, tmp)
        _edit_manifest(d, lambda m: m["implementation"].update(name=value) if field == "impl"
                       else m["policy"].update(name=value))

        def run():
            reports = tmp / "work" / "reports"
            rc, out, err = _cli(request, ["compare", ck, "--candidate-dump", d, "--out-dir", reports,
                                          "--no-teacher-forcing"], cwd=tmp / "work")
            assert rc == 0, err
            assert not (tmp / "escaped").exists() and not (tmp / "work" / "escaped").exists()
            names = sorted(os.listdir(reports))
            assert names == [f"{expect_stem}.html", f"{expect_stem}.json"], names
            return " ".join(names)
        return run
    return plant


# ----------------------------------------------------------------------- bad 2: the kernel cache

def _planted_library(tmp: Path) -> Path:
    """A real shared library whose constructor leaves tmp/ran (the code a plant would run)."""
    src = tmp / "plant.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void ran(void) {{ '
                   f'FILE *f = fopen("{tmp / "ran"}", "w"); if (f) fclose(f); }}\n')
    lib = tmp / "plant.so"
    subprocess.run([os.environ.get("CC") or "gcc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    return lib


def _kernel_plant(owner=None, mode=None, folder_mode=None):
    def plant(tmp, request):
        if shutil.which(os.environ.get("CC") or "gcc") is None or shutil.which(os.environ.get("CXX") or "g++") is None:
            pytest.skip("no C compiler")
        mp = request.getfixturevalue("monkeypatch")
        mp.setenv("LLAMA_PARITY_CACHE", str(tmp / "cache"))
        target = fo.library_path("fixed_order", [fo.SOURCE])
        lib = _planted_library(tmp)
        shutil.copyfile(lib, target)
        sidecar = target.with_name(target.name + ".sha256")
        sidecar.write_text(fo._sha256(target) + "\n")      # a matching sidecar: damage checks pass
        for p in (target, sidecar):
            if owner is not None:
                os.chown(p, owner, owner)
            if mode is not None:
                os.chmod(p, mode)
        if folder_mode is not None:
            os.chmod(target.parent, folder_mode)

        def run():
            message = _raises(InvarianceError, lambda: fo.load("fixed_order", [fo.SOURCE]))
            assert not (tmp / "ran").exists(), "the planted library's constructor ran"
            return message
        return run
    return plant


# ----------------------------------------------------------------------- bad 3, 4: capture's folder

def _force_through_symlink(tmp, request):
    ck, d = _copy(request, tmp)
    precious = tmp / "precious.txt"
    precious.write_text("the user's file\n")
    os.symlink(precious, d / "manifest.json.tmp")

    def run():
        capture(ck, "torchref", "fp32", inputs=inputs(), out=d, taps="layers.*.out", force=True)
        assert precious.read_text() == "the user's file\n"
        names = sorted(os.listdir(d))
        assert not any((d / n).is_symlink() for n in names), names
        Dump(d, checkpoint=ck)
        return " ".join(names)
    return run


def _two_captures_one_folder(tmp, request):
    ck = request.getfixturevalue("tiny_dir")("gqa")
    d = tmp / "new"

    def run():
        capture(ck, "torchref", "fp32", inputs=inputs(seed=1), out=d, taps="layers.*.out")
        # the second capture checked the folder while it was still empty, before the first finished
        request.getfixturevalue("monkeypatch").setattr("compare.capturing._prepare_folder", lambda out, force: False)
        message = _raises(DumpError, lambda: capture(ck, "torchref", "fp32", inputs=inputs(seed=2), out=d,
                                                     taps="layers.*.out"))
        held = Dump(d, checkpoint=ck)         # one run's manifest and its own files
        assert np.array_equal(held.inputs[0], inputs(seed=1)[0])
        assert not [p for p in tmp.iterdir() if p.name.startswith(".new.")], "a staging folder was left"
        return message
    return run


# ----------------------------------------------------------------------- bad 5, 6, 7: report files

@pytest.fixture(scope="module")
def report(tiny_dir):
    return compare_models("torchref", "torchref", tiny_dir("gqa"), inputs=inputs(), policy="fp32",
                          teacher_forcing=False)


def _full_disk_html(tmp, request):
    rep = request.getfixturevalue("report")
    path = tmp / "r.html"
    old = rep.to_html(path).read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    def run():
        request.getfixturevalue("monkeypatch").setattr("llamaspec.files.os.fsync", full)
        message = _raises(WriteError, lambda: rep.to_html(path))
        assert path.read_bytes() == old and os.listdir(tmp) == ["r.html"]
        return message
    return run


def _kill_while_rewriting(tmp, request):
    path = tmp / "r.json"
    path.write_text('{"verdict": "exact", "old": true}')
    script = textwrap.dedent(f"""
        import time
        from llamaspec.files import atomic_write
        def slow(f):
            f.write(b"x" * 100000)
            f.flush()
            print("half", flush=True)
            time.sleep(60)
        atomic_write({str(path)!r}, slow)
    """)

    def run():
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "half"
        proc.kill()
        proc.wait(timeout=30)
        return path.read_text()
    return run


def _fifo_and_stdout(tmp, request):
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    script = textwrap.dedent(f"""
        import threading
        from llama_parity.checks import output_file
        from llamaspec.files import atomic_write
        got = []
        output_file({str(fifo)!r}, "--json")           # checked without being read
        reader = threading.Thread(target=lambda: got.append(open({str(fifo)!r}).read()))
        reader.start()
        atomic_write({str(fifo)!r}, '{{"verdict": "exact"}}')
        reader.join()
        output_file("/dev/stdout", "--json")
        atomic_write("/dev/stdout", "to stdout " + got[0])
    """)

    def run():
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert fifo.is_fifo()
        return done.stdout
    return run


# ----------------------------------------------------------------------- bad 8: make-checkpoint

def _make_checkpoint_over_user_folder(force):
    def plant(tmp, request):
        folder = tmp / "mine"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"the user's trained weights")
        (folder / "notes.txt").write_text("do not lose\n")

        def run():
            rc, _, err = _cli(request, ["make-checkpoint", "--shape", "smollm2-135m", "--layers", "1", folder,
                                        *(["--force"] if force else [])])
            assert rc == 2
            assert (folder / "model.safetensors").read_bytes() == b"the user's trained weights"
            assert sorted(os.listdir(folder)) == ["model.safetensors", "notes.txt"]
            return err
        return run
    return plant


# ----------------------------------------------------------------------- bad 9: an edited tap file

def _edited_tap_file(tmp, request):
    ck, d = _copy(request, tmp)
    tensors = load_file(d / "layer-0001.safetensors")
    tensors["layers.1.out"] = tensors["layers.1.out"] * 2
    save_file(tensors, str(d / "layer-0001.safetensors"))
    return lambda: _raises(DumpError, lambda: Dump(d, checkpoint=ck))


# ----------------------------------------------------------------------- poor: ports

class _Port:
    """torchref behind the protocol, with its capture's inject handling chosen."""

    def __init__(self, ck, policy="fp32", inject="param"):
        self.m = OurModel.load("torchref", ck, Policy.get(policy))
        self.ck, self.policy_name, self.inject = ck, policy, inject
        self.name, self.taps = "my-port", self.m.taps

    def float64(self):
        return type(self)(self.ck, "fp64", self.inject)


class _NoInjectParam(_Port):
    def capture(self, tokens, attention_mask, taps):
        return self.m.capture(tokens, attention_mask, taps)


class _InjectNotImplemented(_Port):
    def capture(self, tokens, attention_mask, taps, inject=None):
        if inject:
            raise NotImplementedError("no layer hooks in this port")
        return self.m.capture(tokens, attention_mask, taps)


class _WrongShape(_Port):
    def capture(self, tokens, attention_mask, taps, inject=None):
        logits, acts = self.m.capture(tokens, attention_mask, taps, inject=inject)
        return logits, {**acts, "layers.0.out": acts["layers.0.out"][..., :-1]}


def _port_teacher_forcing(cls):
    def plant(tmp, request):
        ck = request.getfixturevalue("tiny_dir")("gqa")

        def run():
            rep = compare_models("torchref", cls(ck), ck, inputs=inputs(), policy="fp32")
            assert rep.verdict in ("exact", "drift") and rep.local == []
            return rep.summary()
        return run
    return plant


def _port_wrong_shape_in_a_comparison(tmp, request):
    ck = request.getfixturevalue("tiny_dir")("gqa")
    return lambda: _raises(PortError, lambda: compare_models("torchref", _WrongShape(ck), ck, inputs=inputs(),
                                                             policy="fp32", teacher_forcing=False))


class _Returns:
    name, taps = "bad-port", ("embed", "layers.0.out", "logits")

    def __init__(self, make):
        self.make = make

    def capture(self, tokens, attention_mask, taps, inject=None):
        return self.make()


def _port_returns(make):
    def plant(tmp, request):
        cfg = LlamaConfig.from_file(request.getfixturevalue("tiny_dir")("gqa") / "config.json")
        port = Checked(_Returns(make), cfg)
        return lambda: _raises(PortError, lambda: port.capture(*inputs(), ["embed"]))
    return plant


def _grad_tensor():
    torch = pytest.importorskip("torch")
    return None, {"embed": torch.ones(2, 8, 32, requires_grad=True)}


# ----------------------------------------------------------------------- poor: exit codes, paths, sizes

def _fetch_into_a_file(tmp, request):
    (tmp / "a-file").write_text("not a folder\n")
    request.getfixturevalue("monkeypatch").setenv("LLAMA_PARITY_CACHE", str(tmp / "a-file"))

    def run():
        rc, _, err = _cli(request, ["fetch-smollm2"])
        assert rc == 2
        return err
    return run


def _cli_rc2(argv_of):
    def plant(tmp, request):
        ck = request.getfixturevalue("tiny_dir")("gqa")

        def run():
            rc, _, err = _cli(request, argv_of(ck, tmp))
            assert rc == 2, err
            return err
        return run
    return plant


def _tap_file_named(value, make=None):
    def plant(tmp, request):
        ck, d = _copy(request, tmp)
        if make:
            make(d)
        if value:
            _edit_manifest(d, lambda m: m["files"].update({value: m["files"].pop("layer-0000.safetensors")}))
        return lambda: _raises(DumpError, lambda: Dump(d))
    return plant


def _to_dev_zero(d):
    (d / "layer-0000.safetensors").unlink()
    os.symlink("/dev/zero", d / "layer-0000.safetensors")


def _weights_dev_zero(tmp, request):
    from llamaspec.checkpoint import Checkpoint
    ck = Path(shutil.copytree(request.getfixturevalue("tiny_dir")("gqa"), tmp / "ck"))
    (ck / "model.safetensors").unlink()
    os.symlink("/dev/zero", ck / "model.safetensors")
    return lambda: _raises(CheckpointError, lambda: Checkpoint(ck))


def _make_checkpoint_no_space(tmp, request):
    from llamaspec.shapes import write_checkpoint
    request.getfixturevalue("monkeypatch").setattr("shutil.disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 0))

    def run():
        message = _raises(WriteError, lambda: write_checkpoint(tmp / "ck", "smollm2-135m", layers=1))
        assert not list((tmp / "ck").glob("*.safetensors"))
        return message
    return run


def _make_checkpoint_cut_short(tmp, request):
    """A full disk in the middle of the weights: no partial shard, and the folder is known as
    an unfinished checkpoint of ours (written again with --force, refused without)."""
    from llama_parity.checks import UsageError, check_target_folder
    from llamaspec.shapes import write_checkpoint
    calls = []
    real = os.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:      # the marker went through; the first shard does not
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)
    request.getfixturevalue("monkeypatch").setattr("llamaspec.files.os.fsync", fsync)

    def run():
        _raises(WriteError, lambda: write_checkpoint(tmp / "ck", "smollm2-135m", layers=1))
        assert os.listdir(tmp / "ck") == [".llama-parity-checkpoint"]
        check_target_folder(tmp / "ck", force=True)
        return _raises(UsageError, lambda: check_target_folder(tmp / "ck", force=False))
    return run


def _capture_no_space(tmp, request):
    ck = request.getfixturevalue("tiny_dir")("gqa")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    # capturing imports save_file at its top: patch the name it calls
    request.getfixturevalue("monkeypatch").setattr("compare.capturing.save_file", full)

    def run():
        message = _raises(DumpError, lambda: capture(ck, "torchref", "fp32", inputs=inputs(), out=tmp / "d",
                                                     taps="layers.*.out"))
        assert not (tmp / "d").exists() and os.listdir(tmp) == []
        return message
    return run


def _kernel_link_no_space(tmp, request):
    cxx = tmp / "cxx"
    cxx.write_text("#!/bin/sh\necho 'note: linking' >&2\necho '/usr/bin/ld: final link failed: No space left on "
                   "device' >&2\nexit 1\n")
    cxx.chmod(0o755)
    mp = request.getfixturevalue("monkeypatch")
    mp.setenv("CXX", str(cxx))
    mp.setenv("LLAMA_PARITY_CACHE", str(tmp / "cache"))
    return lambda: _raises(InvarianceError, lambda: fo.build("fixed_order", [fo.SOURCE]))


def _terminal_escapes(tmp, request):
    ck, d = _copy(request, tmp)
    _edit_manifest(d, lambda m: m["implementation"].update(name="evil\x1b]0;owned\x07\x1b[2J"))

    def run():
        rc, out, err = _cli(request, ["compare", ck, "--candidate-dump", d, "--no-files", "--no-teacher-forcing"])
        assert rc == 0, err
        assert "\x1b" not in out and "\x07" not in out
        return out
    return run


def _deep_manifest(tmp, request):
    d = tmp / "deep"
    d.mkdir()
    (d / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    return lambda: _raises(DumpError, lambda: Dump(d))


def _two_compares_one_json(tmp, request):
    from llama_parity.checks import output_file, unchanged_or_beside
    path = tmp / "r.json"
    said = []
    output_file(path, "--json", say=said.append)

    def run():
        path.write_text('{"verdict": "drift", "reference": "a", "candidate": "b"}')   # the other run
        other = unchanged_or_beside(path, said.append)
        assert other != path and other.parent == path.parent
        return said[-1]
    return run


def _assert_parity_arg(**kw):
    def plant(tmp, request):
        from compare import assert_parity
        return lambda: _raises((TypeError, ValueError), lambda: assert_parity("torchref", "jaxmodel", **kw))
    return plant


def _cache_probe_symlink(tmp, request):
    """Found beyond the review: the cache's write probe was .write-test-<pid>, a name anyone
    sharing the cache could plant as a symlink to truncate a file of the victim's."""
    from llamaspec.cache import ensure_dir
    victim = tmp / "victim.txt"
    victim.write_text("precious\n")
    root = tmp / "shared"
    root.mkdir()
    os.symlink(victim, root / f".write-test-{os.getpid()}")

    def run():
        ensure_dir(root)
        assert victim.read_text() == "precious\n"
        return victim.read_text()
    return run


def _dump_version_1(tmp, request):
    ck, d = _copy(request, tmp)
    _edit_manifest(d, lambda m: (m.update(format_version=1), m.pop("sha256")))
    return lambda: _raises(DumpError, lambda: Dump(d))


@dataclasses.dataclass
class Case:
    id: str
    before: str        # what the review found: "bad" or "poor"
    plant: object
    message: str       # regex the returned text must match


CASES = [
    # bad 1: a dump chooses where compare writes
    Case("dump-impl-name-dotdot", "bad", _dump_names_the_report("impl", "../../escaped/pwn",
                                                                "escaped-pwn-dump-vs-torchref-fp32"),
         r"escaped-pwn-dump-vs-torchref-fp32\.html escaped-pwn-dump-vs-torchref-fp32\.json"),
    Case("dump-policy-name-absolute", "bad", _dump_names_the_report("policy", "/../../../escaped/evil",
                                                                    "torchref-dump-vs-torchref-escaped-evil"),
         r"torchref-dump-vs-torchref-escaped-evil\.html"),
    # bad 2: a library planted in the kernel cache
    Case("kernel-foreign-owner", "bad", _kernel_plant(owner=OTHER_UID),
         rf"fixed_order-\w+\.so: the library is owned by uid {OTHER_UID}, not by this user .*not loaded"),
    Case("kernel-writable-by-others", "bad", _kernel_plant(mode=0o666),
         r"fixed_order-\w+\.so: the library is writable by group or others \(mode 0666\); not loaded"),
    Case("kernel-folder-writable-by-others", "bad", _kernel_plant(folder_mode=0o777),
         r"kernels: the folder is writable by group or others \(mode 0777\), so a library in it could be "
         r"someone else's code; nothing is loaded from it"),
    # bad 3, 4: capture's folder
    Case("capture-force-planted-tmp-symlink", "bad", _force_through_symlink,
         r"^layer-0000\.safetensors layer-0001\.safetensors manifest\.json$"),
    Case("two-captures-one-new-folder", "bad", _two_captures_one_folder,
         r"--out .*new: another capture wrote into this folder while this one ran .*this run's dump was discarded"),
    # bad 5, 6, 7: report files
    Case("full-disk-html", "bad", _full_disk_html,
         r"HTML report .*r\.html: cannot be written \(the disk is full\); nothing was left at that path"),
    Case("kill-9-while-rewriting", "bad", _kill_while_rewriting, r'^\{"verdict": "exact", "old": true\}$'),
    Case("json-to-fifo-and-stdout", "bad", _fifo_and_stdout, r'^to stdout \{"verdict": "exact"\}$'),
    # bad 8: make-checkpoint over a user's folder
    Case("make-checkpoint-user-folder", "bad", _make_checkpoint_over_user_folder(False),
         r"mine: the folder is not empty \(model\.safetensors, notes\.txt\) and llama-parity did not write it"),
    Case("make-checkpoint-user-folder-force", "bad", _make_checkpoint_over_user_folder(True),
         r"mine: the folder is not empty .*choose a new or empty folder"),
    # bad 9: a tap file edited after capture
    Case("dump-tap-file-edited", "bad", _edited_tap_file,
         r"layer-0001\.safetensors: sha256 [0-9a-f]{64} differs from [0-9a-f]{64} in manifest\.json: the file was "
         r"changed after the capture"),
    # beyond the review
    Case("cache-write-probe-planted-symlink", "bad", _cache_probe_symlink, r"^precious$"),
    Case("dump-format-version-1-no-checksums", "poor", _dump_version_1,
         r"manifest\.json: a version 1 dump, whose manifest holds no checksums of its tap files"),
    # poor: the protocol's escape hatches
    Case("port-capture-without-inject", "poor", _port_teacher_forcing(_NoInjectParam),
         r"teacher forcing not run: my-port takes no inject \(its capture has no inject parameter\)"),
    Case("port-inject-not-implemented", "poor", _port_teacher_forcing(_InjectNotImplemented),
         r"teacher forcing not run: my-port takes no inject \(its capture raised NotImplementedError: no layer "
         r"hooks in this port\)"),
    # poor: a port's capture misbehaves
    Case("port-wrong-shape-in-compare", "poor", _port_wrong_shape_in_a_comparison,
         r"my-port: tap 'layers\.0\.out' has shape \[2, 8, 31\]; expected \[2, 8, 32\]"),
    Case("port-wrong-shape", "poor", _port_returns(lambda: (None, {"embed": np.zeros((2, 8, 33), np.float32)})),
         r"bad-port: tap 'embed' has shape \[2, 8, 33\]; expected \[2, 8, 32\]"),
    Case("port-missing-tap", "poor", _port_returns(lambda: (None, {})), r"bad-port: capture returned no 'embed'"),
    Case("port-list-not-dict", "poor", _port_returns(lambda: (None, [np.zeros((2, 8, 32))])),
         r"bad-port: capture's second value is a list; expected a dict \{tap: array\}"),
    Case("port-dict-without-logits", "poor", _port_returns(lambda: {"embed": np.zeros((2, 8, 32))}),
         r"bad-port: capture returned a dict; the protocol returns a pair \(logits, \{tap: array\}\)"),
    Case("port-tensor-requires-grad", "poor", _port_returns(_grad_tensor),
         r"bad-port: tap 'embed' is a Tensor that numpy cannot convert .*detach\(\)"),
    Case("port-int-dtype", "poor", _port_returns(lambda: (None, {"embed": np.zeros((2, 8, 32), np.int64)})),
         r"bad-port: tap 'embed' has dtype int64; expected a float dtype"),
    Case("port-capture-raises", "poor", _port_returns(lambda: 1 / 0),
         r"bad-port: capture raised ZeroDivisionError: division by zero"),
    # poor: exit codes
    Case("fetch-cache-is-a-file", "poor", _fetch_into_a_file,
         r"a-file: cannot use it as a cache folder \(.*a-file is a file, not a folder\)"),
    Case("capture-tap-beyond-depth", "poor",
         _cli_rc2(lambda ck, tmp: ["capture", ck, "--impl", "torchref", "--random-tokens", "1x4", "--taps",
                                   "layers.9.out", "--out", tmp / "d"]), r"--taps: .*layers\.9\.out"),
    # poor: paths named wrongly
    Case("dump-tap-file-outside", "poor", _tap_file_named("../outside.safetensors"),
         r"'\.\./outside\.safetensors' is a path, not a file name in the dump's folder"),
    Case("dump-tap-file-dev-zero", "poor", _tap_file_named(None, _to_dev_zero),
         r"layer-0000\.safetensors: is a symlink \(to /dev/zero\)"),
    Case("weights-dev-zero", "poor", _weights_dev_zero,
         r"model\.safetensors: not a regular file \(a symlink to /dev/zero\), so not a safetensors file"),
    # poor: resource limits, full disks
    Case("random-tokens-huge", "poor",
         _cli_rc2(lambda ck, tmp: ["compare", ck, "--random-tokens", "100000x100000", "--no-files"]),
         r"--random-tokens 100000x100000: 100000 tokens, the model's max_position_embeddings is 128"),
    Case("make-checkpoint-layers-beyond-shape", "poor",
         _cli_rc2(lambda ck, tmp: ["make-checkpoint", "--shape", "smollm2-135m", "--layers", "100000", tmp / "x"]),
         r"layers=100000: smollm2-135m has 30 decoder layers"),
    Case("make-checkpoint-disk-full", "poor", _make_checkpoint_no_space,
         r"checkpoint folder .*ck: the weights need 0\.\d+ GB, the disk has 0\.00 GB free"),
    Case("make-checkpoint-cut-short", "poor", _make_checkpoint_cut_short,
         r"ck: holds an unfinished checkpoint \(a run cut short\) already; pass --force to write it again"),
    Case("capture-disk-full", "poor", _capture_no_space,
         r"layer-0000\.safetensors: cannot write the tap file \(No space left on device\); the dump was not written"),
    Case("kernel-link-disk-full", "poor", _kernel_link_no_space,
         r"compiling fixed_order\.cc with .*cxx failed:\n/usr/bin/ld: final link failed: No space left on device"),
    # poor: terminal, nesting, races, API arguments
    Case("terminal-escapes-from-manifest", "poor", _terminal_escapes, r"evil\\x1b\]0;owned\\x07\\x1b\[2J"),
    Case("manifest-nested-100000-deep", "poor", _deep_manifest, r"manifest\.json: nested too deeply"),
    Case("two-compares-one-json", "poor", _two_compares_one_json,
         r"warning: .*r\.json was written by another run while this one ran; this run's report goes to "
         r".*r\.\d+\.json"),
    Case("assert-parity-checkpoint-int", "poor", _assert_parity_arg(checkpoint=123),
         r"assert_parity: checkpoint must be a folder path \(str or Path\), got int 123"),
    Case("assert-parity-allow-none", "poor", _assert_parity_arg(checkpoint="x", allow=None),
         r"assert_parity: allow must be a tuple of verdict kinds"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile(case: Case, tmp_path, request):
    import re
    run = case.plant(tmp_path, request)
    text = run()
    assert re.search(case.message, text, re.S | re.M), f"{case.id}: {text!r}"


# ----------------------------------------------------------------------- the threat model's other lines

def test_safe_name_makes_one_component():
    for text in ("../../x", "/abs/evil", "..", ".hidden", "a/b\\c", "-rf", "\x1b[2J", ""):
        name = safe_name(text)
        assert "/" not in name and "\\" not in name and not name.startswith((".", "-")) and name, (text, name)
    assert safe_name("jaxmodel-dump-vs-torchref-bf16") == "jaxmodel-dump-vs-torchref-bf16"


def test_printable_escapes_control_characters_and_keeps_lines():
    assert printable("a\x1b[2Jb\x07\u202e\nnext\tcol") == "a\\x1b[2Jb\\x07\\u202e\nnext\tcol"


def test_atomic_write_never_follows_or_reuses_a_name(tmp_path):
    """The temp file is new (O_EXCL | O_NOFOLLOW) and random: planted names are not touched;
    a target that is a symlink is replaced by the file, the file it pointed to untouched."""
    outside = tmp_path / "outside"
    outside.write_text("keep")
    link = tmp_path / "report.json"
    os.symlink(outside, link)
    atomic_write(link, "new")
    assert outside.read_text() == "keep" and not link.is_symlink() and link.read_text() == "new"


def test_kernel_cache_is_private_and_per_user(tmp_path, monkeypatch):
    """Two users, one LLAMA_PARITY_CACHE: the first user's kernels/ (0700) is never used by
    the second, who gets kernels-uid<uid>; a kernels-uid<uid> planted by someone else is
    refused, not used."""
    monkeypatch.setenv("LLAMA_PARITY_CACHE", str(tmp_path))
    mine = fo.kernel_dir()
    assert mine == tmp_path / "kernels" and (mine.stat().st_mode & 0o777) == 0o700
    os.chown(mine, OTHER_UID, OTHER_UID)          # now kernels/ is the other user's
    assert fo.kernel_dir() == tmp_path / f"kernels-uid{os.geteuid()}"
    os.chown(tmp_path / f"kernels-uid{os.geteuid()}", OTHER_UID, OTHER_UID)
    with pytest.raises(InvarianceError, match=rf"kernels-uid{os.geteuid()}: the folder is owned by uid {OTHER_UID}"):
        fo.kernel_dir()


def test_model_cache_written_by_another_user_is_data_and_checked(tmp_path):
    """The model cache holds data, not code: another user's cached model is read (never
    executed: safetensors and JSON only), and a file changed by anyone is caught by the
    marker's sha256 like a damaged one (tests/test_bad_files.py)."""
    from llama_parity import fetch
    from llamaspec.testing import make_checkpoint
    folder = make_checkpoint(tmp_path / fetch.MODEL_NAME)
    (folder / "tokenizer.json").write_text("{}")
    fetch._write_marker(folder, Path("x.whl"), 18)
    for p in (folder, *folder.iterdir()):
        os.chown(p, OTHER_UID, OTHER_UID)
    fetch.check_cached(folder, full=True)
    assert (folder / fetch.MARKER).stat().st_uid == OTHER_UID


def test_inject_support_reads_the_protocols_two_signals():
    class Plain:
        name, taps = "p", ()

        def capture(self, tokens, attention_mask, taps):
            return None, {}

    class Says(Plain):
        supports_inject = False

        def capture(self, tokens, attention_mask, taps, inject=None):
            return None, {}

    class Takes(Says):
        supports_inject = True

    assert inject_support(Plain()) == "p takes no inject (its capture has no inject parameter)"
    assert inject_support(Says()) == "p takes no inject" and inject_support(Takes()) is None
    assert inject_support(Checked(Plain())) == "p takes no inject (its capture has no inject parameter)"


def test_write_checkpoint_marks_its_folder_and_keeps_to_the_shapes_depth(tmp_path):
    from llamaspec.shapes import MARKER, write_checkpoint
    folder = write_checkpoint(tmp_path / "ck", "smollm2-135m", layers=1)
    assert (folder / MARKER).is_file()
    with pytest.raises(ConfigError, match="layers=31: smollm2-135m has 30 decoder layers"):
        write_checkpoint(folder, "smollm2-135m", layers=31)


def test_two_kernel_libraries_load_side_by_side_through_their_descriptors():
    """Both libraries are dlopen'ed through /proc/self/fd/<fd> of their checked descriptors;
    each descriptor stays open, so the second is never taken for the first (dlopen matches by
    name, and a reused descriptor number would be the same name)."""
    pytest.importorskip("jax")
    if shutil.which(os.environ.get("CXX") or "g++") is None:
        pytest.skip("no C++ compiler")
    script = ("from llamaspec import fixed_order as fo\nfrom jaxmodel import kernels\n"
              "a, b = fo.library(), kernels.library()\nassert a._handle != b._handle\n"
              "b.FoGemm\nprint(a._name, b._name)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.split()
    assert first.startswith("/proc/self/fd/") and second.startswith("/proc/self/fd/") and first != second
