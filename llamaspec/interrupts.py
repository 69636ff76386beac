"""Ending cleanly when asked to stop: SIGTERM unwinds like Ctrl-C, child processes end with
us, and scratch folders are removed, by this run or by the next.

- sigterm_as_interrupt(): SIGTERM raises Terminated (a KeyboardInterrupt) in the main thread,
  so every `finally` and `with` that cleans up after Ctrl-C runs for SIGTERM too (the CLI's
  `run` and `fetch-smollm2` install it; the exit code is 128 + the signal: 143).
- run_child(): a compiler or worker process in its own process group, ended whole (its own
  children included: cc1plus, as, ld) when this process is interrupted or the timeout passes.
- scratch_folder() / sweep_scratch(): private temp folders named <prefix><pid>@<host>-<random>,
  so that the next run can remove those a kill -9 left: only folders of that name, owned by
  this user, not symlinks, whose process is gone (same host) or untouched for an hour.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

STALE_AFTER_S = 3600.0


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM; unwinds as Ctrl-C does. exit_code: 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signum}")
        self.exit_code = 128 + signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside the with-block SIGTERM raises Terminated (main thread only; elsewhere nothing
    changes); the previous handler is put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_child(cmd, timeout: float | None = None, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check) with the
    child in a new session (its own process group): when this process is interrupted (Ctrl-C,
    SIGTERM), or the timeout passes, the whole group is ended (SIGTERM, SIGKILL 2 s later)
    before the exception goes on."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            end_group(proc)
            raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def end_group(proc: subprocess.Popen) -> None:
    """Ends the process group `proc` leads (SIGTERM, then SIGKILL) and reaps `proc`; a second
    SIGTERM or Ctrl-C meanwhile waits until this is done."""
    blocked = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait)
                if sig == signal.SIGTERM:
                    # the leader is gone; its children may not be: end what is left of the group
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    break
            except subprocess.TimeoutExpired:
                continue
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def new_scratch(parent: Path, prefix: str) -> Path:
    """A new private (0700) folder parent/<prefix><pid>@<host>-<random>."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}@{_host_tag()}-", dir=parent))


@contextlib.contextmanager
def scratch_folder(parent: Path, prefix: str):
    """new_scratch(), removed when the with-block ends (however it ends)."""
    folder = new_scratch(parent, prefix)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def sweep_scratch(parent: Path, prefix_re: str, grace_s: float = STALE_AFTER_S, say=None) -> list[Path]:
    """Removes the scratch folders in `parent` whose name is <prefix_re><pid>@<host>-<random>
    (prefix_re a regular expression) that a killed run left: this user's own folders only,
    never a symlink, when that process is gone (same host) or nothing in the folder changed for
    grace_s. Returns them (and says each through `say`)."""
    pattern = re.compile(f"(?:{prefix_re})(\\d+)@([0-9a-f]{{8}})-[A-Za-z0-9_]+")
    host, now, removed = _host_tag(), time.time(), []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if not m:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue        # a symlink, a file or someone else's: never ours to remove
        pid = int(m.group(1))
        if m.group(2) == host and pid != os.getpid() and not process_alive(pid):
            why = f"left by process {pid}, which is gone"
        elif now - _newest(entry.path, st.st_mtime) > grace_s:
            why = f"untouched for {(now - _newest(entry.path, st.st_mtime)) / 3600:.1f} h"
        else:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)     # fd-based: never follows a symlink inside
        removed.append(Path(entry.path))
        if say is not None:
            say(f"removed {entry.path} ({why}: an interrupted run's scratch folder)")
    return removed


def _newest(path: str, mtime: float) -> float:
    try:
        return max([mtime, *(e.stat(follow_symlinks=False).st_mtime for e in os.scandir(path))])
    except OSError:
        return mtime


def process_alive(pid: int) -> bool:
    """Whether process `pid` (on this host) still runs: another user's counts as running, a
    zombie nobody reaped as ended."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True         # someone else's process
    try:                    # a zombie nobody reaped has finished all the same
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
