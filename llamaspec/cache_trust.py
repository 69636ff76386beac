"""Which cache folders may hold code this process will run: the rule ssh applies to
authorized_keys, for every folder from the cache root down to the entry.

A folder below the cache root is trusted when it and every folder above it (up to the root)
is owned by this user or root and writable by nobody else; a symlink anywhere below the root
is refused (each step is opened with O_NOFOLLOW | O_DIRECTORY from the one above, so what
is checked is what is used). The root itself may be shared when it is sticky (mode 1777,
like /tmp): then another user may create names in it but cannot rename or remove ours, and
only the folders below it must be ours. One function, private_folder(), for the fixed-order
kernels (llamaspec/fixed_order.py) and JAX's compilation cache (jaxmodel/compile_cache.py);
docs/threat-model.md says why.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import CacheError

_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


class UntrustedFolder(CacheError):
    """A folder on the path to a cache entry that someone else could have planted or can
    change: `path`, what is wrong with it, its owner and mode."""

    def __init__(self, path: Path, problem: str, uid: int, mode: int):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem, self.uid, self.mode = path, problem, uid, mode

    def owner_and_mode(self) -> str:
        return f"owner uid {self.uid}, mode {self.mode:04o}"


def private_folder(root: Path, parts, per_user: bool = False) -> Path:
    """root/parts[0]/parts[1]/..., each folder below `root` created 0700 when absent and
    every one checked (with the root): owned by this user or root, not writable by group or
    others, not a symlink; a sticky root may be anyone's and writable by all. per_user:
    when parts[0] exists and is another user's (two users sharing one cache root), this
    user's entry is parts[0] + "-uid<uid>" instead. Returns the path; UntrustedFolder naming
    the first folder that fails, CacheError when one cannot be created or opened."""
    root = Path(root)
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(root, _DIR)
    except OSError as e:
        raise CacheError(f"{root}: cannot use it as the cache root ({e.strerror or e})") from None
    try:
        _judge(root, os.fstat(fd), top=True)
        names, path = list(parts), root
        if per_user and names:
            names[0] = _own_name(fd, names[0])
        for name in names:
            path = path / name
            child = _open_child(fd, name, path)
            os.close(fd)
            fd = child
            _judge(path, os.fstat(fd), top=False)
        return path
    finally:
        os.close(fd)


def _own_name(parent_fd: int, name: str) -> str:
    """`name`, or name-uid<uid> when `name` is there and belongs to another user."""
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return name
    return name if st.st_uid == os.geteuid() else f"{name}-uid{os.geteuid()}"


def _open_child(parent_fd: int, name: str, path: Path) -> int:
    """The folder `name` in the parent (created 0700 when absent), opened without following
    a symlink; UntrustedFolder for a symlink or a non-folder, CacheError for other failures."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    except OSError as e:
        raise CacheError(f"{path}: cannot create the cache folder ({e.strerror or e})") from None
    try:
        return os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise CacheError(f"{path}: cannot open the cache folder ({e.strerror or e})") from None
        st = os.lstat(name, dir_fd=parent_fd)
        what = "a symlink (never followed in the cache)" if stat.S_ISLNK(st.st_mode) else "not a folder"
        raise UntrustedFolder(path, f"is {what}, owned by uid {st.st_uid}", st.st_uid,
                              stat.S_IMODE(st.st_mode)) from None


def _judge(path: Path, st: os.stat_result, top: bool) -> None:
    me, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if top and sticky:
        return          # /tmp-like: others may add names, not touch ours; what is below is checked
    if st.st_uid not in (me, 0):
        raise UntrustedFolder(path, f"the folder is owned by uid {st.st_uid}, not by this user (uid {me}) or root "
                              f"(mode {mode:04o})", st.st_uid, mode)
    if mode & 0o022 and not sticky:
        raise UntrustedFolder(path, f"the folder is writable by group or others (mode {mode:04o})", st.st_uid, mode)
