"""Local (or network-mounted) filesystem backend.

Atomic writes are written by hand: fsspec's local ``autocommit=False`` stages in the system temp
folder and moves without fsync, which is neither atomic across filesystems nor durable. Here a
file goes to a temporary name in the same folder, is fsynced, renamed over the target, and the
folder is fsynced, so after a crash a reader sees the old file or the new one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from typing import Any

from ..errors import DiskFullError, StorageAccessError
from .base import FileInfo, Storage

__all__ = ["LocalStorage", "exchange_paths", "fsync_dir", "open_regular", "translate_os_error"]

_FULL = {errno.ENOSPC, errno.EDQUOT}


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV}
_renameat2: Any = None


def exchange_paths(a: str, b: str) -> bool:
    """Swap two existing paths on one filesystem in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the system or the filesystem has no such swap (the caller
    then does without), OSError for any other failure.

    Why by hand (ctypes): Python's ``os`` has no ``renameat2``, and no maintained library wraps it.
    It lets a new checkpoint take the place of an old one of the same step with no moment at
    which that step has none (a rename cannot replace a folder that is not empty).
    """
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):  # not glibc 2.28+ (macOS, musl before 1.2.5...)
            _renameat2 = False
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(_strip(a)), _AT_FDCWD, os.fsencode(_strip(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), a)


def fsync_dir(path: str) -> None:
    """Make a folder's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def translate_os_error(path: str) -> Iterator[None]:
    """Turn a full disk into DiskFullError and a permission problem into StorageAccessError."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _FULL:
            raise DiskFullError(
                exc.errno,
                f"the disk is full while writing {exc.filename or path}; free space or choose another "
                "save folder (checkpoints already saved were not touched)",
            ) from exc
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise StorageAccessError(
                f"no permission to write {exc.filename or path} ({exc.strerror}); fix the folder's "
                "permissions or choose another save folder"
            ) from exc
        raise


def open_regular(path: str, follow_links: bool = False) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (OSError otherwise).

    A FIFO or device would block a read forever and a folder cannot be read; both are refused
    before any read. Without ``follow_links`` a symlink is refused too.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _strip(path: str) -> str:
    return path.removeprefix("file://")


class LocalStorage(Storage):
    """Plain files; folders are renamed atomically, so checkpoints commit by rename."""

    supports_rename = True

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(_strip(base), *(p.strip("/") for p in parts))

    def local_path(self, path: str) -> str:
        return _strip(path)

    def exists(self, path: str) -> bool:
        return os.path.isfile(_strip(path))

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(_strip(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def normalise(self, path: str) -> str:
        return os.path.normpath(os.path.abspath(_strip(path)))

    def walk(self, prefix: str) -> Iterator[FileInfo]:
        # Regular files only: a symlink inside a checkpoint (to a file or a folder) is never
        # followed, so a checkpoint that holds one is simply missing that file. scandir's entries
        # carry their own lstat and the relative path is built as we go: a folder of a thousand
        # ranks' files lists in milliseconds (os.walk + relpath took several times longer).
        def scan(folder: str, rel: str) -> Iterator[FileInfo]:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:  # gone, not a folder, unreadable: nothing to list (as os.walk)
                return
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    yield from scan(entry.path, f"{rel}{entry.name}/")
                elif stat.S_ISREG(st.st_mode):
                    yield FileInfo(f"{rel}{entry.name}", st.st_size)

        yield from scan(_strip(prefix), "")

    def size(self, path: str) -> int:
        return os.path.getsize(_strip(path))

    def read_bytes(self, path: str) -> bytes:
        with os.fdopen(open_regular(_strip(path), follow_links=True), "rb") as f:
            return f.read()

    def read_range(self, path: str, start: int, length: int) -> bytes:
        fd = open_regular(_strip(path), follow_links=True)
        try:
            return os.pread(fd, max(length, 0), start)
        finally:
            os.close(fd)

    def _write_temp(self, path: str, data: bytes) -> str:
        target = _strip(path)
        folder = os.path.dirname(target) or "."
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(target)}.{uuid.uuid4().hex[:8]}.part")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return tmp

    def write_bytes(self, path: str, data: bytes) -> None:
        with translate_os_error(path):
            tmp = self._write_temp(path, data)
            os.replace(tmp, _strip(path))
            fsync_dir(os.path.dirname(_strip(path)) or ".")

    def create_exclusive(self, path: str, data: bytes) -> None:
        with translate_os_error(path):
            tmp = self._write_temp(path, data)
            try:
                # link() fails when the target exists: an atomic create-only publish.
                os.link(tmp, _strip(path))
            finally:
                os.unlink(tmp)
            fsync_dir(os.path.dirname(_strip(path)) or ".")

    def upload(self, local_path: str, path: str) -> None:
        with translate_os_error(path):
            target = _strip(path)
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            tmp = f"{target}.{uuid.uuid4().hex[:8]}.part"
            shutil.copyfile(local_path, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)

    def download(self, path: str, local_path: str) -> None:
        shutil.copyfile(_strip(path), local_path)

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_strip(path))
            fsync_dir(os.path.dirname(_strip(path)) or ".")

    def remove_tree(self, prefix: str) -> int:
        root = _strip(prefix)
        n = sum(len(files) for _, _, files in os.walk(root))
        shutil.rmtree(root, ignore_errors=True)
        return n

    def rename_dir(self, src: str, dst: str) -> None:
        with translate_os_error(dst):
            os.rename(_strip(src), _strip(dst))
            fsync_dir(os.path.dirname(_strip(dst)) or ".")

    def check_access(self, path: str) -> None:
        root = _strip(path)
        probe = root
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if probe and probe != root and not os.path.isdir(probe):
            raise StorageAccessError(
                f"cannot create save folder {root}: {probe} is a file, not a folder; choose another path"
            )
        if probe and not os.access(probe, os.W_OK):
            raise StorageAccessError(
                f"cannot write to save folder {root}: {probe} is not writable; fix its permissions"
            )
        if os.path.exists(root) and not os.path.isdir(root):
            raise StorageAccessError(f"save folder {root} exists but is a file; choose a folder path")
