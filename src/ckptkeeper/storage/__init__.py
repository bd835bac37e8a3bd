"""Where checkpoint bytes live: the Storage interface and a registry keyed by URL scheme.

``storage_for(url)`` picks the backend: plain paths and ``file://`` use the local disk,
``memory://`` an in-process fake, ``s3://`` and ``gs://`` the object-store backends (optional
extras, imported only when used, with an install hint when missing).
"""

from __future__ import annotations

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


def register_scheme(scheme: str, factory: Callable[[str], Storage]) -> None:
    """Make ``scheme://`` URLs use the Storage that ``factory(url)`` returns."""
    _REGISTRY[scheme] = factory


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
    return factory(path)
