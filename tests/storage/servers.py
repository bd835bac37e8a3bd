"""The backends every conformance test runs against."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

BACKENDS = ["local", "memory", "s3", "gs"]


def backend_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty root folder (path or URL) on the backend named by ``request.param``."""
    if request.param == "local":
        yield str(tmp_path / "root")
    elif request.param == "memory":
        yield f"memory://bucket/{uuid.uuid4().hex[:8]}"
    elif request.param == "s3":
        yield request.getfixturevalue("s3_root")
    elif request.param == "gs":
        yield request.getfixturevalue("gs_root")
    else:
        raise AssertionError(request.param)
