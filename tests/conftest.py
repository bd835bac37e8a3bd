"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptkeeper.storage import MemoryStorage


@pytest.fixture(autouse=True)
def _fresh_memory_store() -> Iterator[None]:
    MemoryStorage.reset()
    yield
    MemoryStorage.reset()


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 512 KiB tmpfs: writes past it fail with ENOSPC. Needs root (CI and dev machines are)."""
    mnt = tmp_path / f"tiny-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
