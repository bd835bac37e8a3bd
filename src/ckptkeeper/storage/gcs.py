"""Google Cloud Storage, through gcsfs.

Create-only writes use gcsfs's ``mode="create"`` (``ifGenerationMatch=0``); gcsfs retries 429,
5xx and connection errors itself with exponential backoff. ``STORAGE_EMULATOR_HOST`` points it at
an emulator (anonymous access); otherwise Google's default credentials are used, or the token
named by ``CKPTKEEPER_GCS_TOKEN``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from ..errors import StorageAccessError, StorageError
from .base import FileInfo, Storage, Upload

__all__ = ["GCSStorage"]


def _key(url: str) -> str:
    return url.split("://", 1)[1].strip("/")


class GCSStorage(Storage):
    """Objects in a GCS bucket; checkpoints commit by creating the commit record last, create-only."""

    is_remote = True

    def __init__(self) -> None:
        # Without this, gcsfs probes a gRPC endpoint for zonal buckets and every call waits ~60 s
        # where that probe cannot get an answer (emulators, closed networks).
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        try:
            import gcsfs
        except ImportError:
            raise StorageError("gs:// save folders need gcsfs: pip install 'ckptkeeper[gcs]'") from None
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        kwargs: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
        if emulator:
            kwargs.update(endpoint_url=emulator, token=os.environ.get("CKPTKEEPER_GCS_TOKEN", "anon"))
        elif "CKPTKEEPER_GCS_TOKEN" in os.environ:
            kwargs["token"] = os.environ["CKPTKEEPER_GCS_TOKEN"]
        self.fs = gcsfs.GCSFileSystem(**kwargs)

    @contextlib.contextmanager
    def _errors(self, url: str) -> Iterator[None]:
        try:
            yield
        except (FileNotFoundError, FileExistsError):
            raise
        except PermissionError as exc:
            raise StorageAccessError(
                f"GCS refused access to {url} ({exc}); check the credentials and the bucket's permissions"
            ) from exc
        except OSError as exc:
            raise StorageError(f"GCS request for {url} failed: {exc}") from exc

    def exists(self, path: str) -> bool:
        with self._errors(path):
            return bool(self.fs.isfile(_key(path)))

    def list_dir(self, path: str) -> list[str]:
        try:
            with self._errors(path):
                entries = self.fs.ls(_key(path), detail=False)
        except FileNotFoundError:
            return []
        base = _key(path) + "/"
        return sorted({e.rstrip("/")[len(base) :] for e in entries if e.startswith(base)} - {""})

    def walk(self, prefix: str) -> Iterator[FileInfo]:
        base = _key(prefix) + "/"
        try:
            with self._errors(prefix):
                found = self.fs.find(_key(prefix), detail=True)
        except FileNotFoundError:
            return
        for name, info in sorted(found.items()):
            if name.startswith(base) and info.get("type") != "directory":
                yield FileInfo(name[len(base) :], int(info["size"]))

    def size(self, path: str) -> int:
        with self._errors(path):
            return int(self.fs.size(_key(path)))

    def read_bytes(self, path: str) -> bytes:
        with self._errors(path):
            data: bytes = self.fs.cat_file(_key(path))
        self.count_fetched(len(data))
        return data

    def read_range(self, path: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        with self._errors(path):
            data: bytes = self.fs.cat_file(_key(path), start=start, end=start + length)
        self.count_fetched(len(data))
        return data

    def write_bytes(self, path: str, data: bytes) -> None:
        with self._errors(path):
            self.fs.pipe_file(_key(path), data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        with self._errors(path):
            self.fs.pipe_file(_key(path), data, mode="create")

    def upload(self, local_path: str, path: str) -> None:
        with self._errors(path):
            self.fs.put_file(local_path, _key(path))

    def open_upload(self, path: str) -> Upload:
        return _GCSUpload(self, path)

    def download(self, path: str, local_path: str) -> None:
        with self._errors(path):
            self.fs.get_file(_key(path), local_path)
        self.count_fetched(os.path.getsize(local_path))

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError), self._errors(path):
            self.fs.rm_file(_key(path))

    def remove_tree(self, prefix: str) -> int:
        key = _key(prefix)
        if "/" not in key:
            raise StorageError(f"refusing to clear the bucket root {prefix!r}")
        names = [f"{key}/{f.relpath}" for f in self.walk(prefix)]
        if names:
            with self._errors(prefix):
                self.fs.rm(names)
        return len(names)

    def remove_files(self, paths: list[str]) -> int:
        keys = [_key(p) for p in paths]
        if any("/" not in k for k in keys):
            raise StorageError("refusing to delete a bucket root")
        if keys:
            with contextlib.suppress(FileNotFoundError), self._errors(paths[0]):
                self.fs.rm(keys)
        return len(keys)

    def check_access(self, path: str) -> None:
        bucket = _key(path).split("/", 1)[0]
        if not bucket:
            raise StorageAccessError(f"{path!r} names no bucket; use gs://BUCKET/PREFIX")
        try:
            with self._errors(path):
                self.fs.ls(bucket, detail=False)
        except FileNotFoundError:
            raise StorageAccessError(
                f"bucket '{bucket}' does not exist ({path}); create it or fix the save folder URL"
            ) from None


_BLOCK = 16 << 20


class _GCSUpload(Upload):
    """A resumable upload through gcsfs (a block at a time); finished on close, cancelled on abort."""

    def __init__(self, storage: GCSStorage, path: str) -> None:
        self._gcs, self._path = storage, path
        with storage._errors(path):
            # A resumable upload: the object exists only once its last chunk is sent (at close).
            self._file = storage.fs.open(_key(path), "wb", block_size=_BLOCK)

    def write(self, data: bytes | memoryview) -> None:
        with self._gcs._errors(self._path):
            self._file.write(bytes(data))

    def close(self) -> None:
        with self._gcs._errors(self._path):
            self._file.close()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._file.discard()
