"""The storage interface: the few primitives every backend implements.

A checkpoint is committed one of two ways, chosen by the backend's ``supports_rename``:
local disks write into a temporary folder and rename it into place; object stores (which
cannot rename a prefix atomically) upload the data objects first and create the commit
record last, create-only. Everything above this layer speaks only these primitives.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import ConfigurationError

__all__ = ["FileInfo", "Storage", "Upload"]

_COUNT_LOCK = threading.Lock()


@dataclass(frozen=True)
class FileInfo:
    """One file under a prefix: its path relative to that prefix, and its size in bytes."""

    relpath: str
    size: int


class Upload(ABC):
    """One file written as a stream of bytes, visible only once :meth:`close` returns.

    Object stores upload it in parts as it is written (multipart), so a writer holds a few parts
    in memory, never the whole file. ``write`` copies what it is given (the caller may reuse it).
    """

    @abstractmethod
    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` to the file."""

    @abstractmethod
    def close(self) -> None:
        """Finish the upload: the file exists whole afterwards."""

    @abstractmethod
    def abort(self) -> None:
        """Give up: nothing of the file stays (best effort; never raises)."""


class _SpooledUpload(Upload):
    """The default: a temporary local file, uploaded whole on close (backends without streaming)."""

    def __init__(self, storage: Storage, path: str) -> None:
        self._storage, self._path = storage, path
        self._file = tempfile.NamedTemporaryFile(prefix="ckptkeeper-upload-", delete=False)  # noqa: SIM115

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)

    def close(self) -> None:
        self._file.close()
        try:
            self._storage.upload(self._file.name, self._path)
        finally:
            os.unlink(self._file.name)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
            os.unlink(self._file.name)


class Storage(ABC):
    """Where checkpoint bytes live. Paths are full paths or URLs of this backend's scheme."""

    supports_rename: bool = False
    """True where a whole folder can be renamed atomically (local disk)."""

    retries: int = 0
    """Requests retried so far by this backend's client (0 where the client does not report them)."""

    is_remote: bool = False
    """True for URL backends (object stores); the specification's rank-0 rules differ for them."""

    bytes_fetched: int = 0
    """Bytes this object has read from the store so far (reads, downloads and ranged reads)."""

    def count_fetched(self, n: int) -> None:
        """Add ``n`` to :attr:`bytes_fetched` (reads run on several threads at once)."""
        with _COUNT_LOCK:
            self.bytes_fetched += n

    def join(self, base: str, *parts: str) -> str:
        """Join path parts with '/' (every backend here uses '/')."""
        out = base.rstrip("/")
        for p in parts:
            out = f"{out}/{p.strip('/')}"
        return out

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file exists at ``path``."""

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names of the direct children (files and folders) of ``path``; [] when it does not exist."""

    @abstractmethod
    def walk(self, prefix: str) -> Iterator[FileInfo]:
        """Every file below ``prefix`` (recursively), with sizes; nothing when it does not exist."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Size of the file at ``path``; FileNotFoundError when missing."""

    @abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """The whole content of a (small) file; FileNotFoundError when missing."""

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes of the file at ``path`` from ``start`` (fewer only where the file ends).

        Object stores answer with one ranged GET, so a load fetches only the bytes a rank needs.
        """
        data = self.read_bytes(path)[start : start + length]
        return data

    @abstractmethod
    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a file so that readers see the old content or the new, never a part."""

    @abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create a file that must not exist yet (FileExistsError otherwise), atomically."""

    @abstractmethod
    def upload(self, local_path: str, path: str) -> None:
        """Copy a local file to ``path`` (all or nothing)."""

    def open_upload(self, path: str) -> Upload:
        """A file at ``path`` written as a stream (see :class:`Upload`); object stores stream it in parts."""
        return _SpooledUpload(self, path)

    @abstractmethod
    def download(self, path: str, local_path: str) -> None:
        """Copy the file at ``path`` to a local file."""

    @abstractmethod
    def remove_file(self, path: str) -> None:
        """Delete one file; a missing file is not an error."""

    @abstractmethod
    def remove_tree(self, prefix: str) -> int:
        """Delete everything below ``prefix``; returns how many files went."""

    def remove_files(self, paths: list[str]) -> int:
        """Delete exactly these files (missing ones are skipped); returns how many were asked for."""
        for p in paths:
            self.remove_file(p)
        return len(paths)

    def normalise(self, path: str) -> str:
        """``path`` in canonical form; ConfigurationError when it has empty, ``.`` or ``..`` parts.

        Object-store keys are taken literally (``a//b`` and ``a/b`` are different keys), so instead
        of guessing what such a path means, it is refused. Guards judge the canonical form only.
        """
        scheme, sep, rest = path.partition("://")
        if not sep:
            raise ConfigurationError(f"{path!r} is not a URL")
        parts = rest.rstrip("/").split("/")
        if not parts[0] or any(p in ("", ".", "..") for p in parts) or "\\" in rest:
            raise ConfigurationError(
                f"{path!r} has an empty, '.' or '..' part; write the URL as {scheme}://BUCKET/PREFIX with plain parts"
            )
        return f"{scheme}://{'/'.join(parts)}"

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename a folder (only where ``supports_rename``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename folders")

    def local_path(self, path: str) -> str | None:
        """The filesystem path of ``path`` when this backend is a local disk, else None."""
        return None

    def abort_uploads(self, prefix: str, paths: set[str]) -> int:
        """Abort unfinished multipart uploads below ``prefix`` whose target is one of ``paths``.

        Only uploads ckptkeeper announced (in an intent object) are aborted, never anyone else's.
        """
        return 0

    def check_access(self, path: str) -> None:  # noqa: B027 (a no-op is the right default)
        """Raise StorageAccessError when ``path`` cannot be used (missing bucket, bad credentials)."""
