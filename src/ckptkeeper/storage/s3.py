"""S3 and S3-compatible object stores (MinIO, R2, ...), through boto3.

boto3 is used directly rather than through s3fs: its transfer manager streams multipart uploads
from disk with bounded memory and aborts a failed multipart upload itself, puts can be made
create-only (``IfNoneMatch="*"``), and botocore's "standard" retry mode backs off exponentially
with jitter on throttling, 5xx and connection errors. Endpoint, credentials and profile come from
the standard settings (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``, ...).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import StorageAccessError, StorageError
from .base import FileInfo, Storage, Upload

__all__ = ["S3Storage"]

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403"}
_EXISTS = {"PreconditionFailed", "ConditionalRequestConflict", "412"}
_PART = 8 << 20


def retries_from_env() -> int:
    """Attempts per request (``CKPTKEEPER_RETRIES``, default 10); ConfigurationError names a bad value."""
    from ..errors import ConfigurationError

    text = os.environ.get("CKPTKEEPER_RETRIES", "").strip() or "10"
    try:
        attempts = int(text)
    except ValueError:
        attempts = 0
    if attempts < 1:
        raise ConfigurationError(
            f"CKPTKEEPER_RETRIES must be a positive integer (attempts per S3 request, default 10), got {text!r}; "
            "fix or unset it"
        )
    return attempts


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    return bucket, key.strip("/")


class S3Storage(Storage):
    """Objects in an S3 bucket; checkpoints commit by creating the commit record last, create-only."""

    is_remote = True

    def __init__(self) -> None:
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError:
            raise StorageError("s3:// save folders need boto3: pip install 'ckptkeeper[s3]'") from None
        session = boto3.session.Session()
        region = session.region_name or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        cfg = Config(
            retries={"max_attempts": retries_from_env(), "mode": "standard"},
            max_pool_connections=32,
            connect_timeout=10,
            read_timeout=60,
        )
        self.client = session.client("s3", region_name=region, config=cfg)
        self.retries = 0
        """Requests retried so far (botocore reports the attempts of every call, transfers included)."""
        self.client.meta.events.register("after-call.s3", self._count_retries)
        self.transfer = TransferConfig(
            multipart_threshold=_PART, multipart_chunksize=_PART, max_concurrency=10, use_threads=True
        )

    def _count_retries(self, parsed: Any = None, **_: Any) -> None:
        attempts = (parsed or {}).get("ResponseMetadata", {}).get("RetryAttempts", 0) if isinstance(parsed, dict) else 0
        self.retries += int(attempts or 0)

    # ----------------------------------------------------------------- errors

    @contextlib.contextmanager
    def _errors(self, url: str) -> Iterator[None]:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

        try:
            yield
        except S3UploadFailedError as exc:
            # The transfer manager has already aborted the multipart upload; nothing was published.
            raise StorageError(f"upload to {url} failed after retries: {exc}") from exc
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            bucket = split_url(url)[0]
            if code in _NOT_FOUND:
                raise FileNotFoundError(url) from exc
            if code == "NoSuchBucket":
                raise StorageAccessError(
                    f"bucket '{bucket}' does not exist ({url}); create it or fix the save folder URL"
                ) from exc
            if code in _DENIED:
                raise StorageAccessError(
                    f"S3 rejected the credentials for {url} ({code}); check AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and the bucket policy"
                ) from exc
            if code in _EXISTS:
                raise FileExistsError(url) from exc
            raise StorageError(f"S3 request for {url} failed: {exc}") from exc
        except NoCredentialsError as exc:
            raise StorageAccessError(
                f"no S3 credentials found for {url}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
            ) from exc
        except EndpointConnectionError as exc:
            raise StorageAccessError(f"cannot reach the S3 endpoint for {url}: {exc}; check AWS_ENDPOINT_URL") from exc
        except BotoCoreError as exc:
            raise StorageError(f"S3 request for {url} failed: {exc}") from exc

    # ----------------------------------------------------------------- primitives

    def _pages(self, url: str, delimiter: bool) -> Iterator[dict[str, Any]]:
        bucket, key = split_url(url)
        prefix = f"{key}/" if key else ""
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        if delimiter:
            kwargs["Delimiter"] = "/"
        with self._errors(url):
            yield from self.client.get_paginator("list_objects_v2").paginate(**kwargs)

    def exists(self, path: str) -> bool:
        bucket, key = split_url(path)
        try:
            with self._errors(path):
                self.client.head_object(Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        return True

    def list_dir(self, path: str) -> list[str]:
        names: set[str] = set()
        prefix_len = len(split_url(path)[1]) + 1 if split_url(path)[1] else 0
        for page in self._pages(path, delimiter=True):
            names |= {p["Prefix"][prefix_len:].rstrip("/") for p in page.get("CommonPrefixes", [])}
            names |= {o["Key"][prefix_len:] for o in page.get("Contents", [])}
        return sorted(n for n in names if n)

    def walk(self, prefix: str) -> Iterator[FileInfo]:
        base = len(split_url(prefix)[1]) + 1
        for page in self._pages(prefix, delimiter=False):
            for o in page.get("Contents", []):
                yield FileInfo(o["Key"][base:], int(o["Size"]))

    def size(self, path: str) -> int:
        bucket, key = split_url(path)
        with self._errors(path):
            return int(self.client.head_object(Bucket=bucket, Key=key)["ContentLength"])

    def read_bytes(self, path: str) -> bytes:
        bucket, key = split_url(path)
        with self._errors(path):
            body = self.client.get_object(Bucket=bucket, Key=key)["Body"]
            data: bytes = body.read()
        self.count_fetched(len(data))
        return data

    def read_range(self, path: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        bucket, key = split_url(path)
        with self._errors(path):
            body = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")["Body"]
            data: bytes = body.read()
        self.count_fetched(len(data))
        return data

    def write_bytes(self, path: str, data: bytes) -> None:
        bucket, key = split_url(path)
        with self._errors(path):
            self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        bucket, key = split_url(path)
        with self._errors(path):
            self.client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")

    def upload(self, local_path: str, path: str) -> None:
        bucket, key = split_url(path)
        with self._errors(path):
            self.client.upload_file(local_path, bucket, key, Config=self.transfer)

    def open_upload(self, path: str) -> Upload:
        return _S3Upload(self, path)

    def download(self, path: str, local_path: str) -> None:
        bucket, key = split_url(path)
        with self._errors(path):
            self.client.download_file(bucket, key, local_path, Config=self.transfer)
        self.count_fetched(os.path.getsize(local_path))

    def remove_file(self, path: str) -> None:
        bucket, key = split_url(path)
        with self._errors(path):
            self.client.delete_object(Bucket=bucket, Key=key)

    def remove_tree(self, prefix: str) -> int:
        bucket, key = split_url(prefix)
        if not key:
            raise StorageError(f"refusing to clear the bucket root {prefix!r}")
        n = 0
        # Listing is paginated (1,000 keys a page at most) and each page is deleted in one batch.
        for page in self._pages(prefix, delimiter=False):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if not keys:
                continue
            with self._errors(prefix):
                out = self.client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            if out.get("Errors"):
                raise StorageError(f"could not delete {len(out['Errors'])} objects under {prefix}: {out['Errors'][0]}")
            n += len(keys)
        return n

    def remove_files(self, paths: list[str]) -> int:
        by_bucket: dict[str, list[str]] = {}
        for p in paths:
            bucket, key = split_url(p)
            if not key:
                raise StorageError(f"refusing to delete the bucket root {p!r}")
            by_bucket.setdefault(bucket, []).append(key)
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
                batch = [{"Key": k} for k in keys[i : i + 1000]]
                with self._errors(f"s3://{bucket}/{keys[i]}"):
                    out = self.client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
                if out.get("Errors"):
                    raise StorageError(f"could not delete {len(out['Errors'])} objects in {bucket}: {out['Errors'][0]}")
        return len(paths)

    def abort_uploads(self, prefix: str, paths: set[str]) -> int:
        bucket, key = split_url(prefix)
        wanted = {split_url(p)[1] for p in paths if split_url(p)[0] == bucket}
        n = 0
        with self._errors(prefix):
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=bucket, Prefix=f"{key}/" if key else ""
            )
            for page in pages:
                for up in page.get("Uploads", []):
                    if up["Key"] in wanted:
                        self.client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                        n += 1
        return n

    def check_access(self, path: str) -> None:
        bucket, key = split_url(path)
        if not bucket:
            raise StorageAccessError(f"{path!r} names no bucket; use s3://BUCKET/PREFIX")
        with self._errors(path):
            try:
                self.client.head_bucket(Bucket=bucket)
            except Exception as exc:
                code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
                if code in ("404", "NoSuchBucket"):
                    raise StorageAccessError(
                        f"bucket '{bucket}' does not exist ({path}); create it or fix the save folder URL"
                    ) from exc
                raise
            self.client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/" if key else "", MaxKeys=1)


class _S3Upload(Upload):
    """A multipart upload fed part by part: at most a few parts are in memory at once.

    A file smaller than one part is sent with one put. A failure anywhere aborts the multipart
    upload; one left by a killed writer is aborted by the intent clean-up (``abort_uploads``).
    """

    _IN_FLIGHT = 4

    def __init__(self, storage: S3Storage, path: str) -> None:
        self._s3, self._path = storage, path
        self._bucket, self._key = split_url(path)
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.Semaphore(self._IN_FLIGHT)

    def _send(self, number: int, body: bytes) -> dict[str, Any]:
        try:
            with self._s3._errors(self._path):
                r = self._s3.client.upload_part(
                    Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=body
                )
            return {"PartNumber": number, "ETag": r["ETag"]}
        finally:
            self._slots.release()

    def _flush(self) -> None:
        if self._upload_id is None:
            with self._s3._errors(self._path):
                self._upload_id = self._s3.client.create_multipart_upload(Bucket=self._bucket, Key=self._key)[
                    "UploadId"
                ]
            self._pool = ThreadPoolExecutor(max_workers=self._IN_FLIGHT, thread_name_prefix="ckptkeeper-part")
        assert self._pool is not None
        for done in self._parts:
            if done.done() and done.exception() is not None:
                raise done.exception()  # type: ignore[misc]
        body, self._buf = bytes(self._buf), bytearray()
        self._slots.acquire()  # bounded memory: wait while _IN_FLIGHT parts are on their way
        self._parts.append(self._pool.submit(self._send, len(self._parts) + 1, body))

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), _PART - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) >= _PART:
                self._flush()

    def close(self) -> None:
        if self._upload_id is None:
            with self._s3._errors(self._path):
                self._s3.client.put_object(Bucket=self._bucket, Key=self._key, Body=bytes(self._buf))
            return
        if self._buf:
            self._flush()
        try:
            parts = [f.result() for f in self._parts]
            with self._s3._errors(self._path):
                self._s3.client.complete_multipart_upload(
                    Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
                )
        except BaseException:
            self.abort()
            raise
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def abort(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self._s3.client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)
