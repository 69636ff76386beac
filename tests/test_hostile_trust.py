"""Issue 58, classes 4, 5 and 8 (docs/threat-model.md): who may plant a cache folder, what a
port may do to the inputs it is handed, and what SIGTERM may leave behind. Table-driven: each
row plants a case and says what must happen, with the message's key words."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from compare import capture
from compare.adapters import JaxFunction, PortError, TorchModule, resolve_side
from llamaspec import fixed_order as fo
from llamaspec.cache_trust import UntrustedFolder, private_folder
from llamaspec.errors import InvarianceError
from llamaspec.interrupts import new_scratch, run_child, sweep_scratch

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 54321      # a user that is not us (as root, os.chown makes files theirs)
ME = os.geteuid()

as_root = pytest.mark.skipif(ME != 0, reason="planting another user's folders needs os.chown, so root "
                             "(these tests run as root in CI's container)")


def _give(path: Path, uid=OTHER_UID, mode=None) -> Path:
    if mode is not None and not path.is_symlink():
        os.chmod(path, mode)
    os.chown(path, uid, uid, follow_symlinks=False)
    return path


def _dir(path: Path, mode=0o700, uid=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    return _give(path, uid) if uid is not None else path


def _link(path: Path, to: Path, uid=None) -> Path:
    os.symlink(to, path)
    return _give(path, uid) if uid is not None else path


# ----------------------------------------------------------------------- class 4: cache trust

@dataclasses.dataclass
class Trust:
    id: str
    use: str            # "compile" (jaxmodel's compile cache), "kernels", or "rule" (root/a/b/c)
    plant: object       # plant(root, private, cpu) builds the folders
    expect: str         # regex: the accepted folder (relative to root), or the refusal's message
    accepted: bool = False


def _cpu():
    from jaxmodel.compile_cache import cpu_fingerprint
    return cpu_fingerprint()


TRUST = [
    # the case: another user owns jax-compile/ and points the per-CPU entry at our private
    # folder; this user goes to its own jax-compile-uid<uid>/ instead and never writes there
    Trust("compile-foreign-folder-links-cpu-entry-to-private", "compile",
          lambda r, p, cpu: _link(_dir(r / "jax-compile", 0o755, OTHER_UID) / cpu, p, OTHER_UID),
          rf"jax-compile-uid{ME}/\w+$", accepted=True),
    Trust("compile-foreign-owned-intermediate", "compile",
          lambda r, p, cpu: (_dir(r / "jax-compile", 0o755, OTHER_UID),
                             _dir(r / f"jax-compile-uid{ME}", 0o700, OTHER_UID)),
          rf"jax-compile-uid{ME}: the folder is owned by uid {OTHER_UID}, not by this user \(uid {ME}\) or root "
          r"\(mode 0700\)"),
    Trust("compile-group-writable-intermediate", "compile",
          lambda r, p, cpu: _dir(r / "jax-compile", 0o775),
          rf"jax-compile: the folder is writable by group or others \(mode 0775\) \(owner uid {ME}, mode 0775\)"),
    Trust("compile-cpu-entry-symlinked-to-private", "compile",
          lambda r, p, cpu: _link(_dir(r / "jax-compile") / cpu, p),
          rf"jax-compile/\w+: is a symlink \(never followed in the cache\), owned by uid {ME}"),
    Trust("compile-intermediate-symlinked", "compile",
          lambda r, p, cpu: (_dir(r.parent / "elsewhere" / cpu), _link(r / "jax-compile", r.parent / "elsewhere")),
          r"jax-compile: is a symlink \(never followed in the cache\)"),
    Trust("compile-sticky-root-own-entries", "compile",
          lambda r, p, cpu: (_give(r, OTHER_UID, 0o1777), _dir(r / "jax-compile")),
          r"jax-compile/\w+$", accepted=True),
    Trust("compile-sticky-root-foreign-cpu-entry", "compile",
          lambda r, p, cpu: (_give(r, OTHER_UID, 0o1777), _dir(r / "jax-compile" / cpu, 0o700, OTHER_UID)),
          rf"jax-compile/\w+: the folder is owned by uid {OTHER_UID}"),
    Trust("compile-sticky-root-foreign-link-as-our-entry", "compile",
          lambda r, p, cpu: (_give(r, OTHER_UID, 0o1777), _dir(r / "jax-compile", 0o755, OTHER_UID),
                             _link(r / f"jax-compile-uid{ME}", p, OTHER_UID)),
          rf"jax-compile-uid{ME}: is a symlink \(never followed in the cache\), owned by uid {OTHER_UID}"),
    Trust("kernels-foreign-root", "kernels", lambda r, p, cpu: _give(r, OTHER_UID, 0o755),
          rf"cache: the folder is owned by uid {OTHER_UID}, not by this user .*nothing is loaded from it"),
    Trust("kernels-group-writable-root", "kernels", lambda r, p, cpu: _give(r, ME, 0o775),
          r"cache: the folder is writable by group or others \(mode 0775\), so a library in it could be "
          r"someone else's code"),
    Trust("kernels-folder-symlinked-to-private", "kernels", lambda r, p, cpu: _link(r / "kernels", p),
          r"kernels: is a symlink \(never followed in the cache\).*nothing is loaded"),
    Trust("kernels-sticky-root-foreign-link-as-our-entry", "kernels",
          lambda r, p, cpu: (_give(r, OTHER_UID, 0o1777), _link(r / "kernels", p, OTHER_UID),
                             _link(r / f"kernels-uid{ME}", p, OTHER_UID)),
          rf"kernels-uid{ME}: is a symlink .*owned by uid {OTHER_UID}"),
    Trust("kernels-sticky-root-own-entries", "kernels",
          lambda r, p, cpu: (_give(r, OTHER_UID, 0o1777), _dir(r / "kernels", 0o700, OTHER_UID)),
          rf"kernels-uid{ME}$", accepted=True),
    Trust("rule-foreign-deep-intermediate", "rule",
          lambda r, p, cpu: (_dir(r / "a" / "b" / "c"), _give(r / "a" / "b", OTHER_UID)),
          rf"a/b: the folder is owned by uid {OTHER_UID}"),
    Trust("rule-others-writable-deep-intermediate", "rule",
          lambda r, p, cpu: (_dir(r / "a" / "b" / "c"), os.chmod(r / "a", 0o757)),
          r"cache/a: the folder is writable by group or others \(mode 0757\)"),
    Trust("rule-file-in-the-path", "rule", lambda r, p, cpu: (_dir(r / "a"), (r / "a" / "b").write_text("")),
          r"a/b: is not a folder"),
    Trust("rule-sticky-intermediate-of-ours", "rule",
          lambda r, p, cpu: (_dir(r / "a", 0o1777), _dir(r / "a" / "b")), r"a/b/c$", accepted=True),
]


class _JaxConfig:
    jax_compilation_cache_dir = None

    def update(self, key, value):
        setattr(self, key, value)


@as_root
@pytest.mark.parametrize("case", TRUST, ids=[c.id for c in TRUST])
def test_cache_trust(case: Trust, tmp_path, monkeypatch, capsys):
    """Every folder from the cache root down is this user's (or root's), not writable by
    others and not a symlink; a sticky root may be anyone's. The compile cache falls back to
    none (a warning naming the folder, its owner and mode), the kernels refuse (exit 2)."""
    from jaxmodel import compile_cache
    root, private = _dir(tmp_path / "cache"), _dir(tmp_path / "private")
    monkeypatch.setenv("LLAMA_PARITY_CACHE", str(root))
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    case.plant(root, private, _cpu())
    if case.use == "compile":
        config = _JaxConfig()
        got = compile_cache.enable(config)
        text = str(got) if got else capsys.readouterr().err
        assert (got is not None) == case.accepted, text
        assert config.jax_compilation_cache_dir == (str(got) if got else None)
        if not case.accepted:
            assert "compilation cache off" in text and "(owner uid" in text, text
    elif case.use == "kernels":
        try:
            got, text = fo.kernel_dir(), None
        except InvarianceError as e:
            got, text = None, str(e)
        assert (got is not None) == case.accepted, text
        text = text or str(got)
    else:
        try:
            got, text = private_folder(root, ["a", "b", "c"]), None
        except UntrustedFolder as e:
            got, text = None, str(e)
        assert (got is not None) == case.accepted, text
        text = text or str(got)
    assert re.search(case.expect, text), f"{case.id}: {text!r}"
    if got is not None:
        assert got.resolve().is_relative_to(root.resolve()) and got.lstat().st_uid == ME
        assert not any(p.is_symlink() for p in [got, *got.parents] if p.is_relative_to(root) and p != root)
    assert os.listdir(private) == [], "something was written into the private folder"


# ----------------------------------------------------------------------- class 5: a port's inputs

def _write(t):
    t.add_(1)


class _Tiny:
    """A torch port: embedding and head; `writes` says which of its inputs it changes in place."""

    def __new__(cls, writes):
        import torch

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed, self.head = torch.nn.Embedding(96, 8), torch.nn.Linear(8, 96)

            def forward(self, input_ids, attention_mask=None, position_ids=None):
                _write({"ids": input_ids, "mask": attention_mask, "positions": position_ids}[writes]) \
                    if writes else None
                return self.head(self.embed(input_ids))
        return Tiny()


class _NumpyPort:
    """A user's port object (the protocol by hand) that changes what it is handed."""
    taps = ("layers.0.out",)

    def __init__(self, change):
        self.name, self.change = f"numpy-port-{change}", change

    def capture(self, tokens, attention_mask, taps, inject=None):
        if self.change == "ids":
            tokens[0, 0] = 1
        elif self.change == "mask":
            attention_mask[:, -1] = 0
        elif self.change == "writeable":
            tokens.flags.writeable = True
            tokens[0, 0] = 1
        elif self.change == "torch-from-numpy":
            import torch
            torch.from_numpy(tokens).add_(1)          # torch ignores numpy's read-only flag
        B, T = np.shape(tokens)
        return np.zeros((B, T, 96), np.float32), {t: np.zeros((B, T, 32), np.float32) for t in taps}


def _jax_port(numpy_write: bool):
    def fn(params, ids, mask, positions):
        import jax.numpy as jnp
        if numpy_write:
            ids[0, 0] = 1                             # numpy in place, inside a "JAX" function
        ids = jnp.asarray(ids).at[0, 0].set(1)       # immutable: a new array, the port's own business
        return jnp.zeros((*ids.shape, 96)), {"embed": jnp.zeros((*ids.shape, 32)) + ids[..., None]}
    return JaxFunction(fn, {}, name="jax-port-numpy-write" if numpy_write else "jax-port", taps=("embed",))


@dataclasses.dataclass
class Port:
    id: str
    make: object
    taps: tuple
    error: str | None     # regex of the PortError, None: accepted


PORTS = [
    Port("torch-module-writes-input-ids", lambda: TorchModule(_Tiny("ids"), {"logits": "head"}, name="tiny-torch"),
         ("logits",), r"tiny-torch: changed input_ids in place: a port must not change the inputs it is given"),
    Port("torch-module-writes-mask", lambda: TorchModule(_Tiny("mask"), {"logits": "head"}, name="tiny-torch"),
         ("logits",), r"tiny-torch: changed attention_mask in place"),
    Port("torch-module-writes-positions", lambda: TorchModule(_Tiny("positions"), {"logits": "head"},
                                                              name="tiny-torch"),
         ("logits",), r"tiny-torch: changed position_ids in place"),
    Port("torch-module-reads-only", lambda: TorchModule(_Tiny(None), {"logits": "head"}, name="tiny-torch"),
         ("logits",), None),
    Port("jax-function-returns-modified-ids", lambda: _jax_port(False), ("embed",), None),
    Port("jax-function-writes-numpy-ids", lambda: _jax_port(True), ("embed",),
         r"jax-port-numpy-write: wrote into a read-only array \(assignment destination is read-only\)"),
    Port("numpy-port-writes-ids", lambda: _NumpyPort("ids"), ("layers.0.out",),
         r"numpy-port-ids: wrote into a read-only array .*must not change the inputs it is given"),
    Port("numpy-port-writes-mask", lambda: _NumpyPort("mask"), ("layers.0.out",),
         r"numpy-port-mask: wrote into a read-only array"),
    Port("numpy-port-sets-writeable-back", lambda: _NumpyPort("writeable"), ("layers.0.out",),
         r"numpy-port-writeable: wrote into a read-only array \(cannot set WRITEABLE flag"),
    Port("port-writes-through-torch-from-numpy", lambda: _NumpyPort("torch-from-numpy"), ("layers.0.out",),
         r"numpy-port-torch-from-numpy: changed tokens in place"),
]


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("case", PORTS, ids=[c.id for c in PORTS])
def test_port_cannot_change_what_it_is_handed(case: Port):
    """A port gets read-only copies (torch: fresh tensors) at the engine's seam (resolve_side
    wraps it in Checked); the caller's arrays never change, and a port that writes into its
    inputs is a PortError naming it (exit 2), not a wrong verdict blamed on the other side."""
    ids = np.random.default_rng(0).integers(3, 96, (2, 8))
    mask = np.ones((2, 8), np.int64)
    mask[1, :2] = 0
    before = ids.copy(), mask.copy()
    side = resolve_side(case.make(), None, "fp32")
    if case.error is None:
        side.at_policy.capture(ids, mask, case.taps)
    else:
        with pytest.raises(PortError, match=case.error):
            side.at_policy.capture(ids, mask, case.taps)
    assert np.array_equal(ids, before[0]) and np.array_equal(mask, before[1]), "the caller's arrays changed"
    assert ids.flags.writeable and mask.flags.writeable, "the caller's own arrays were frozen"


class _StepPort:
    """A port with the decode protocol (prefill, decode_capture) that writes into one input."""
    taps = ("layers.0.out",)

    def __init__(self, writes: str | None):
        self.writes, self.name = writes, f"step-port-{writes}"

    def capture(self, tokens, attention_mask, taps, inject=None):
        B, T = np.shape(tokens)
        return np.zeros((B, T, 96), np.float32), {t: np.zeros((B, T, 32), np.float32) for t in taps}

    def prefill(self, ids, mask, total_len, inject=None):
        if self.writes == "prefill-ids":
            ids[:, 0] = 1
        if self.writes == "prefill-mask":
            mask[:, 0] = 0
        return {"length": ids.shape[1]}, np.zeros((*ids.shape, 96), np.float32)

    def decode_capture(self, cache, next_ids, taps, inject=None):
        if self.writes == "decode-next-ids":
            next_ids[0] = 1
        cache["length"] += 1      # the cache is the port's own: it may change it
        B = len(next_ids)
        return cache, np.zeros((B, 1, 96), np.float32), {t: np.zeros((B, 1, 32), np.float32) for t in taps}


@pytest.mark.parametrize("writes", ["prefill-ids", "prefill-mask", "decode-next-ids", None])
def test_decode_protocol_calls_hand_over_read_only_inputs(writes):
    """prefill / decode_capture get read-only copies as capture does; the port's cache stays its own."""
    ids, mask, step = np.full((2, 4), 7), np.ones((2, 4), np.int64), np.array([5, 6])
    before = ids.copy(), mask.copy(), step.copy()
    port = resolve_side(_StepPort(writes), None, "fp32").at_policy

    def run():
        cache, _ = port.prefill(ids, mask, 8)
        cache, _, _ = port.decode_capture(cache, step, ("layers.0.out",))
        return cache
    if writes is None:
        assert run() == {"length": 5}
    else:
        with pytest.raises(PortError, match=rf"step-port-{writes}: wrote into a read-only array"):
            run()
    assert all(np.array_equal(a, b) for a, b in zip((ids, mask, step), before)), "the caller's arrays changed"


@pytest.mark.parametrize("change", ["ids", "mask"])
def test_capture_and_compare_name_a_port_that_writes_its_inputs(change, tiny_dir, tmp_path):
    """The issue's case end to end: a candidate that writes into the token array it receives
    used to change what the reference's oracle saw next ("capturing changes torchref's
    numbers"); now the comparison and a capture stop with a PortError naming the port, and the
    caller's arrays (and the folder) are as they were."""
    from compare import compare_models
    ck = tiny_dir("gqa")
    ids = np.random.default_rng(1).integers(3, 96, (2, 8))
    mask = np.ones((2, 8), np.int64)
    before = ids.copy(), mask.copy()
    port = _NumpyPort(change)
    with pytest.raises(PortError, match=rf"{port.name}: wrote into a read-only array"):
        compare_models("torchref", port, ck, inputs=(ids, mask), policy="fp32", teacher_forcing=False)
    with pytest.raises(PortError, match=rf"{port.name}: wrote into a read-only array"):
        capture(ck, port, "fp32", inputs=(ids, mask), out=tmp_path / "d", taps=["layers.0.out"])
    assert np.array_equal(ids, before[0]) and np.array_equal(mask, before[1])
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)


# ----------------------------------------------------------------------- class 8: SIGTERM, kill -9

def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def _all_gone(pids: Path) -> bool:
    """Every pid in the file ended (SIGKILL was sent: allow the kernel a moment to deliver it)."""
    deadline = time.monotonic() + 10
    while not all(_gone(int(p)) for p in pids.read_text().split()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(_gone(int(p)) for p in pids.read_text().split())


def _wait_for(path: Path, lines: int, proc, seconds=120.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.is_file() and len(path.read_text().split()) >= lines:
            return
        assert proc.poll() is None, f"exited early ({proc.returncode}): {proc.communicate()[1][-2000:]}"
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"{path} never appeared")


def _slow_capture_script(ck, out, ready) -> str:
    """A capture through the CLI's `run` whose teacher-forced run (after its private folder is
    made) waits: the moment to stop it."""
    return textwrap.dedent(f"""
        import argparse, pathlib, sys, time
        import numpy as np
        from compare import capture
        from compare.adapters import OurModel
        from llama_parity.cli import run
        from llamaspec import Policy

        class Slow:
            name = "slow-port"
            def __init__(self):
                self.inner = OurModel.load("torchref", {str(ck)!r}, Policy.get("fp32"))
                self.taps = self.inner.taps
            def capture(self, tokens, attention_mask, taps, inject=None):
                if inject is not None:
                    pathlib.Path({str(ready)!r}).write_text(str(__import__("os").getpid()))
                    time.sleep(120)
                return self.inner.capture(tokens, attention_mask, taps)

        ids = np.random.default_rng(0).integers(3, 96, (2, 8))
        go = lambda a: capture({str(ck)!r}, Slow(), "fp32", inputs=(ids, np.ones_like(ids)), out={str(out)!r},
                               taps=["layers.*.out", "logits"], teacher_forcing=True) and 0
        sys.exit(run(go, argparse.Namespace(debug=False)))
    """)


def _partials(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_sigterm_during_kernel_build_ends_the_compiler(tiny_dir, tmp_path):
    """SIGTERM while the fixed-order kernels compile: the CLI exits 143 (128 + SIGTERM, as
    fetch-smollm2), the compiler and its children are gone, and neither a build folder nor a
    library nor a dump is left."""
    if sys.platform != "linux" or fo.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the fixed-order kernels are built on x86-64 Linux")
    pids, cxx = tmp_path / "cxx.pid", tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\necho $$ > {pids}\nsleep 120 &\necho $! >> {pids}\nwait\n")
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "LLAMA_PARITY_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "llama_parity.cli", "capture", str(tiny_dir("gqa")),
                             "--impl", "torchref", "--policy", "fp32", "--batch-invariant", "--random-tokens", "2x8",
                             "--out", str(tmp_path / "d")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(pids, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "llama-parity: interrupted (terminated by signal 15)" in err, err
    assert _all_gone(pids), "the compiler (or its child) still runs"
    assert os.listdir(tmp_path / "cache" / "kernels") == [], os.listdir(tmp_path / "cache" / "kernels")
    assert not (tmp_path / "d").exists() and _partials(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm-removes-it", "kill-9-next-run-sweeps"])
def test_stopped_capture_leaves_no_partial_dump(sig, tiny_dir, tmp_path):
    """Stopped while it writes its private folder: SIGTERM unwinds (exit 143) and removes the
    folder at once; after a kill -9 the folder stays, and the next capture into that folder's
    parent removes it (its process is gone), saying so. No dump appears under the final name."""
    ck, out, ready = tiny_dir("gqa"), tmp_path / "d", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _slow_capture_script(ck, out, ready)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(ready, 1, proc)
    left = [p for p in _partials(tmp_path) if p.startswith(".d.capture-")]
    assert left and left[0].startswith(f".d.capture-{proc.pid}@"), _partials(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert not out.exists()
    if sig == signal.SIGTERM:
        assert proc.returncode == 143 and "interrupted" in err, (proc.returncode, err)
        assert _partials(tmp_path) == []
        return
    assert proc.returncode == -signal.SIGKILL and _partials(tmp_path) == left
    said = []
    ids = np.random.default_rng(0).integers(3, 96, (2, 8))
    capture(ck, "torchref", "fp32", inputs=ids, out=tmp_path / "d2", taps=["logits"], progress=said.append)
    assert _partials(tmp_path) == [] and (tmp_path / "d2" / "manifest.json").is_file()
    assert any(re.search(rf"removed .*{re.escape(left[0])} \(left by process {proc.pid}, which is gone", m)
               for m in said), said


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@dataclasses.dataclass
class Stale:
    id: str
    plant: object      # plant(tmp) -> the entry's path
    removed: bool


def _scratch(tmp, prefix=".d.capture-", pid=None, host=None, age_h=0.0, uid=None) -> Path:
    made = new_scratch(tmp, prefix)
    name = made.name
    if pid is not None:
        name = name.replace(f"-{os.getpid()}@", f"-{pid}@", 1)
    if host is not None:
        name = re.sub(r"@[0-9a-f]{8}-", f"@{host}-", name)
    path = made.rename(tmp / name)
    (path / "tap.safetensors").write_text("partial")
    if age_h:
        t = time.time() - age_h * 3600
        for p in (path / "tap.safetensors", path):
            os.utime(p, (t, t))
    if uid is not None:
        _give(path, uid)
    return path


def _symlink_named_like_scratch(tmp):
    target = _dir(tmp / "precious")
    (target / "keep").write_text("mine")
    return _link(tmp / f".d.capture-{_dead_pid()}@{'0' * 8}-abc", target)


STALE = [
    Stale("dead-process-same-host", lambda t: _scratch(t, pid=_dead_pid()), True),
    Stale("old-dump-aside-dead-process", lambda t: _scratch(t, ".d.old-", pid=_dead_pid()), True),
    Stale("build-folder-dead-process", lambda t: _scratch(t, ".build-", pid=_dead_pid()), True),
    Stale("live-process-this-one", lambda t: _scratch(t), False),
    Stale("other-host-fresh", lambda t: _scratch(t, pid=_dead_pid(), host="0" * 8), False),
    Stale("other-host-untouched-2h", lambda t: _scratch(t, pid=_dead_pid(), host="0" * 8, age_h=2), True),
    Stale("symlink-named-like-one", _symlink_named_like_scratch, False),
    Stale("not-our-prefix", lambda t: _scratch(t, ".d.notes-", pid=_dead_pid()), False),
    Stale("visible-name", lambda t: _scratch(t, "d.capture-", pid=_dead_pid()), False),
]


@pytest.mark.parametrize("case", STALE, ids=[c.id for c in STALE])
def test_sweep_removes_only_our_dead_runs_scratch(case: Stale, tmp_path):
    """The next run removes scratch folders of its own name (<prefix><pid>@<host>-*) whose
    process is gone, or that nobody touched for an hour; never a symlink (nor what it points
    to), another prefix, or a live run's."""
    entry = case.plant(tmp_path)
    said = []
    sweep_scratch(tmp_path, r"\..+\.(?:capture|old)-|\.build-", say=said.append)
    assert os.path.lexists(entry) != case.removed, said
    assert bool(said) == case.removed, said
    if case.id.startswith("symlink"):
        assert (tmp_path / "precious" / "keep").read_text() == "mine"


@as_root
def test_sweep_never_removes_another_users_folder(tmp_path):
    entry = _scratch(tmp_path, pid=_dead_pid(), age_h=5, uid=OTHER_UID)
    assert sweep_scratch(tmp_path, r"\..+\.capture-") == [] and entry.is_dir()


def test_child_process_group_ends_on_timeout(tmp_path):
    """run_child (the kernel compiler, probe workers): past its timeout the child and the
    processes it started are ended, not left running."""
    pids = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired):
        run_child(["sh", "-c", f"echo $$ > {pids}; sleep 60 & echo $! >> {pids}; wait"], timeout=2)
    assert len(pids.read_text().split()) == 2 and _all_gone(pids), pids.read_text()
