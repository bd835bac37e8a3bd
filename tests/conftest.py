"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ckptkeeper.storage import MemoryStorage


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank CPU device mesh in this process (a gloo group of one, made here unless one exists)."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if own:
            dist.destroy_process_group()


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


# ---------------------------------------------------------------- object-store servers

from .servers import GcsServer, MotoServer  # noqa: E402


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoServer]:
    """One moto S3 server for the session (5-key listing pages force pagination)."""
    server = MotoServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    """One fake-gcs-server for the session."""
    server = GcsServer(tmp_path_factory.mktemp("gcs"))
    try:
        yield server
    finally:
        server.stop()


def s3_settings(endpoint: str) -> dict[str, str]:
    """The standard AWS settings that point any client at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "CKPTKEEPER_RETRIES": "10",
    }


def make_bucket(endpoint: str) -> str:
    import boto3

    name = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=name)  # fmt: skip
    return name


@pytest.fixture
def s3_root(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """An empty ``s3://`` save folder in a fresh bucket, with the client settings in the environment."""
    for k, v in s3_settings(moto.url).items():
        monkeypatch.setenv(k, v)
    return f"s3://{make_bucket(moto.url)}/run"


def make_gcs_bucket(endpoint: str) -> str:
    import urllib.request

    name = f"g-{uuid.uuid4().hex[:12]}"
    req = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test", data=f'{{"name": "{name}"}}'.encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    urllib.request.urlopen(req, timeout=10).read()
    return name


@pytest.fixture
def gs_root(gcs: GcsServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """An empty ``gs://`` save folder in a fresh bucket on the emulator."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return f"gs://{make_gcs_bucket(gcs.url)}/run"
