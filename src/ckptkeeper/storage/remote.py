"""Registers the object-store schemes; their client libraries are imported only when used."""

from __future__ import annotations

from . import register_scheme
from .base import Storage


def _s3(url: str) -> Storage:
    from .s3 import S3Storage

    return S3Storage()


def _gcs(url: str) -> Storage:
    from .gcs import GCSStorage

    return GCSStorage()


register_scheme("s3", _s3)
register_scheme("gs", _gcs)
register_scheme("gcs", _gcs)
