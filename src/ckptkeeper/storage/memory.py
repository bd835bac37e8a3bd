"""An in-memory backend: a public fake with object-store semantics (no rename), for tests and demos.

Its files live in one process-wide dictionary per ``memory://`` namespace, so two Storage
objects for the same URL see the same bytes, as two clients of one bucket would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from .base import FileInfo, Storage, Upload

__all__ = ["MemoryStorage"]

_STORES: dict[str, dict[str, bytes]] = {}
_LOCK = threading.Lock()


class MemoryStorage(Storage):
    """Files in process memory under ``memory://...`` keys; behaves like an object store."""

    is_remote = True

    def __init__(self) -> None:
        with _LOCK:
            self._files = _STORES.setdefault("memory", {})

    @staticmethod
    def _key(path: str) -> str:
        return path.removeprefix("memory://").strip("/")

    def exists(self, path: str) -> bool:
        return self._key(path) in self._files

    def list_dir(self, path: str) -> list[str]:
        prefix = self._key(path) + "/" if self._key(path) else ""
        with _LOCK:
            keys = list(self._files)
        return sorted({k[len(prefix) :].split("/", 1)[0] for k in keys if k.startswith(prefix)})

    def walk(self, prefix: str) -> Iterator[FileInfo]:
        base = self._key(prefix) + "/"
        with _LOCK:
            items = [(k, len(v)) for k, v in self._files.items() if k.startswith(base)]
        for k, n in sorted(items):
            yield FileInfo(k[len(base) :], n)

    def size(self, path: str) -> int:
        return len(self.read_bytes(path))

    def read_bytes(self, path: str) -> bytes:
        try:
            data = self._files[self._key(path)]
        except KeyError:
            raise FileNotFoundError(path) from None
        self.count_fetched(len(data))
        return data

    def read_range(self, path: str, start: int, length: int) -> bytes:
        try:
            data = self._files[self._key(path)][start : start + max(length, 0)]
        except KeyError:
            raise FileNotFoundError(path) from None
        self.count_fetched(len(data))
        return data

    def write_bytes(self, path: str, data: bytes) -> None:
        with _LOCK:
            self._files[self._key(path)] = bytes(data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        with _LOCK:
            if self._key(path) in self._files:
                raise FileExistsError(path)
            self._files[self._key(path)] = bytes(data)

    def upload(self, local_path: str, path: str) -> None:
        with open(local_path, "rb") as f:
            self.write_bytes(path, f.read())

    def open_upload(self, path: str) -> Upload:
        return _MemoryUpload(self, path)

    def download(self, path: str, local_path: str) -> None:
        data = self.read_bytes(path)
        with open(local_path, "wb") as f:
            f.write(data)

    def remove_file(self, path: str) -> None:
        with _LOCK:
            self._files.pop(self._key(path), None)

    def remove_tree(self, prefix: str) -> int:
        base = self._key(prefix) + "/"
        with _LOCK:
            doomed = [k for k in self._files if k.startswith(base)]
            for k in doomed:
                del self._files[k]
        return len(doomed)

    def remove_files(self, paths: list[str]) -> int:
        with _LOCK:
            for p in paths:
                self._files.pop(self._key(p), None)
        return len(paths)

    @staticmethod
    def reset() -> None:
        """Forget every file (tests call this between cases)."""
        with _LOCK:
            for store in _STORES.values():
                store.clear()


class _MemoryUpload(Upload):
    def __init__(self, storage: MemoryStorage, path: str) -> None:
        self._storage, self._path, self._buf = storage, path, bytearray()

    def write(self, data: bytes | memoryview) -> None:
        self._buf += data

    def close(self) -> None:
        self._storage.write_bytes(self._path, bytes(self._buf))

    def abort(self) -> None:
        self._buf = bytearray()
