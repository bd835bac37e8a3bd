"""Where checkpoint bytes live: the Storage interface and a registry keyed by URL scheme.

``storage_for(url)`` picks the backend: plain paths and ``file://`` use the local disk,
``memory://`` an in-process fake, ``s3://`` and ``gs://`` the object-store backends (optional
extras, imported only when used, with an install hint when missing).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from ..errors import ConfigurationError
from .base import FileInfo, Storage
from .layout import COMMIT_RECORD, MODEL_DIR, TRAIN_DIR, parse_step, step_dir_name
from .local import LocalStorage
from .memory import MemoryStorage

__all__ = [
    "COMMIT_RECORD",
    "MODEL_DIR",
    "TRAIN_DIR",
    "FileInfo",
    "LocalStorage",
    "MemoryStorage",
    "Storage",
    "is_url",
    "parse_step",
    "register_scheme",
    "step_dir_name",
    "storage_for",
]

_REGISTRY: dict[str, Callable[[str], Storage]] = {
    "file": lambda url: LocalStorage(),
    "memory": lambda url: MemoryStorage(),
}


_INSTANCES: dict[tuple[str, ...], Storage] = {}
_INSTANCES_LOCK = threading.Lock()
# Client settings read from the environment: a change makes a new client (tests start servers).
_CLIENT_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
    "STORAGE_EMULATOR_HOST",
    "CKPTKEEPER_GCS_TOKEN",
    "CKPTKEEPER_RETRIES",
)


def register_scheme(scheme: str, factory: Callable[[str], Storage]) -> None:
    """Make ``scheme://`` URLs use the Storage that ``factory(url)`` returns."""
    _REGISTRY[scheme] = factory
    with _INSTANCES_LOCK:
        for key in [k for k in _INSTANCES if k[0] == scheme]:
            del _INSTANCES[key]


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote location (any scheme but ``file``)."""
    return "://" in path and not path.startswith("file://")


def storage_for(path: str) -> Storage:
    """The backend for a path or URL; ConfigurationError names an unknown scheme."""
    if "://" not in path:
        return LocalStorage()
    scheme = path.split("://", 1)[0]
    if scheme not in _REGISTRY:
        from . import remote  # noqa: F401  (registers s3/gs lazily; see remote.py)

    try:
        factory = _REGISTRY[scheme]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigurationError(f"unsupported storage scheme '{scheme}://' in {path!r}; use one of: {known}") from None
    # One client per scheme and settings: creating an S3 or GCS client costs tens of milliseconds.
    key = (scheme, *(os.environ.get(name, "") for name in _CLIENT_ENV))
    with _INSTANCES_LOCK:
        if key not in _INSTANCES:
            _INSTANCES[key] = factory(path)
        return _INSTANCES[key]
