"""Training runs that save to s3:// and gs://, against real servers on 127.0.0.1, with faults:
throttling, a writer killed mid-upload, a store failing mid-multipart, a missing bucket and
rejected credentials."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptkeeper import (
    Checkpointer,
    CheckpointerCallback,
    CheckpointSaveError,
    StorageAccessError,
    StorageError,
    state_digest,
    storage_for,
)
from ckptkeeper.storage.layout import COMMIT_RECORD

from ..conftest import make_bucket, s3_settings
from ..helpers import builtin_trainer, run_cli, run_to_end
from ..servers import SLOW_DOWN, FaultProxy, MotoServer

ARGS = ["--steps", "16", "--save-interval", "8", "--ephemeral-save-interval", "3", "--hidden", "32"]


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper", "-q", *args], capture_output=True, text=True, cwd=cwd, env=full_env,
        timeout=240,
    )  # fmt: skip


@pytest.fixture(scope="module")
def local_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("local")
    # In this process (the run ends normally; a fresh interpreter would spend seconds importing torch):
    # the runs it is compared with crash and resume in processes of their own.
    res = run_cli("-q", "train", "--save-folder", "run", *ARGS, "--report", "r.json", cwd=d)
    assert res.returncode == 0, res.stderr
    digest: str = json.loads((d / "r.json").read_text())["state_digest"]
    return digest


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_crash_and_resume_from_a_bucket_matches_the_local_run(
    scheme: str, request: pytest.FixtureRequest, tmp_path: Path, local_digest: str
) -> None:
    root: str = request.getfixturevalue(f"{scheme}_root")
    crashed = cli("train", "--save-folder", root, *ARGS, "--crash-at-step", "11", cwd=tmp_path)
    assert crashed.returncode == 75, crashed.stderr
    resumed = cli("train", "--save-folder", root, *ARGS, "--report", "r.json", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["start_step"] in (8, 9)
    assert report["state_digest"] == local_digest
    listing = json.loads(run_cli("-q", "ls", root, "--json", cwd=tmp_path).stdout)
    assert [(r["step"], r["complete"]) for r in listing] == [(0, True), (8, True), (15, True), (16, True)]
    for r in listing:
        Checkpointer().verify(r["path"])


def _proxy_env(monkeypatch: pytest.MonkeyPatch, proxy: FaultProxy) -> None:
    for k, v in s3_settings(proxy.url).items():
        monkeypatch.setenv(k, v)


def test_throttling_503_slowdown_is_retried(moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from botocore.retries.standard import ExponentialBackoff

    # botocore waits up to 2**attempt s after a throttle, most of this test's time asleep. How long
    # is botocore's choice; that the throttled requests are retried is what this test proves.
    real_delay = ExponentialBackoff.delay_amount
    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: real_delay(self, context) / 20)
    bucket = make_bucket(moto.url)
    # One request in nine is throttled: enough faults to prove the retries, few enough backoffs to be quick.
    proxy = FaultProxy(moto.port, lambda method, path, n: SLOW_DOWN if n % 9 == 0 else None)
    try:
        _proxy_env(monkeypatch, proxy)
        root = f"s3://{bucket}/run"
        cb = CheckpointerCallback(save_interval=8, ephemeral_save_interval=3, save_async=True)
        first = builtin_trainer(root, 16, cb, crash_at=11)
        assert run_to_end(first) is False
        first.checkpointer.wait()
        second = builtin_trainer(root, 16, CheckpointerCallback(save_interval=8, ephemeral_save_interval=3))
        second.fit()
        assert second.start_step == 9
        assert proxy.injected > 5  # the faults really happened
        ckpt = Checkpointer()
        steps = [s for s, _ in ckpt.find_checkpoints(root)]
        assert steps == [0, 8, 15, 16]
        for _, path in ckpt.find_checkpoints(root):
            ckpt.verify(path)
        clean = builtin_trainer(str(tmp_path / "clean"), 16, CheckpointerCallback(save_interval=8))
        clean.fit()
        assert state_digest(second.model, second.optimizer) == state_digest(clean.model, clean.optimizer)
    finally:
        proxy.stop()


def test_writer_killed_mid_upload_leaves_nothing_visible(
    moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, local_digest: str
) -> None:
    bucket = make_bucket(moto.url)
    root = f"s3://{bucket}/run"

    def hold_commit_of_step8(method: str, path: str, n: int) -> str | None:
        return "hold" if method == "PUT" and "/run/step8/.metadata.json" in path else None

    proxy = FaultProxy(moto.port, hold_commit_of_step8)
    try:
        env = {**os.environ, **s3_settings(proxy.url), "CKPTKEEPER_RETRIES": "1"}
        writer = subprocess.Popen(
            [sys.executable, "-m", "ckptkeeper", "-q", "train", "--save-folder", root, *ARGS, "--no-save-async"],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert proxy.held.wait(timeout=120), "the writer never reached the commit of step 8"
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        proxy.stop()
    for k, v in s3_settings(moto.url).items():
        monkeypatch.setenv(k, v)
    ckpt = Checkpointer()
    storage = storage_for(root)
    # The data objects of step 8 were uploaded, but without the commit record nobody sees a checkpoint.
    assert any(True for _ in storage.walk(storage.join(root, "step8")))
    assert 8 not in [s for s, _ in ckpt.find_checkpoints(root)]
    assert {i.step: i.complete for i in ckpt.list_checkpoints(root)}[8] is False
    # The next run removes the leftover prefix and resumes from the newest complete checkpoint.
    # The settings of the next run (no proxy) are this process's environment by now.
    res = run_cli("-q", "train", "--save-folder", root, *ARGS, "--report", "r.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["start_step"] == 6
    assert report["state_digest"] == local_digest
    assert [s for s, _ in ckpt.find_checkpoints(root)] == [0, 8, 15, 16]


@pytest.mark.parametrize("how", ["file", "stream"])
def test_store_failing_mid_multipart_aborts_the_upload(
    moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    import boto3

    bucket = make_bucket(moto.url)
    proxy = FaultProxy(
        moto.port,
        lambda method, path, n: (500, b"<Error><Code>InternalError</Code></Error>") if "partNumber=3" in path else None,
    )
    try:
        _proxy_env(monkeypatch, proxy)
        monkeypatch.setenv("CKPTKEEPER_RETRIES", "2")
        big = tmp_path / "big.bin"
        big.write_bytes(os.urandom(20 << 20))  # three 8 MiB parts
        storage = storage_for(f"s3://{bucket}/run")
        key = f"s3://{bucket}/run/step5/model_and_optim/__0_0.distcp"
        with pytest.raises(StorageError):
            if how == "file":
                storage.upload(str(big), key)
            else:  # how saves send a data file: streamed from memory, part by part
                upload = storage.open_upload(key)
                try:
                    data = memoryview(big.read_bytes())
                    for i in range(0, len(data), 3 << 20):
                        upload.write(data[i : i + (3 << 20)])
                    upload.close()
                except BaseException:
                    upload.abort()
                    raise
    finally:
        proxy.stop()
    client = boto3.client("s3", endpoint_url=moto.url, aws_access_key_id="t", aws_secret_access_key="t",
                          region_name="us-east-1")  # fmt: skip
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_orphan_uploads_and_incomplete_prefixes_are_cleaned_only_where_announced(s3_root: str) -> None:
    import boto3

    from ckptkeeper.engine.deleter import write_intent

    bucket = s3_root.split("/")[2]
    client = boto3.client("s3")
    # A save killed mid-upload: its intent announced both files, one upload never completed.
    write_intent(storage_for(s3_root), f"{s3_root}/step4", 0,
                 ["model_and_optim/__0_0.distcp", "train/rank0.json"], "0123abcd")  # fmt: skip
    client.create_multipart_upload(Bucket=bucket, Key="run/step4/model_and_optim/__0_0.distcp")
    client.put_object(Bucket=bucket, Key="run/step4/train/rank0.json", Body=b"{}")
    # Somebody else's objects and upload, named like ours but never announced by ckptkeeper.
    client.put_object(Bucket=bucket, Key="run/step4/notes.txt", Body=b"mine")
    client.put_object(Bucket=bucket, Key="run/step6/train/rank0.json", Body=b"{}")
    client.create_multipart_upload(Bucket=bucket, Key="run/step6/model_and_optim/__0_0.distcp")
    client.put_object(Bucket=bucket, Key="elsewhere/keep.txt", Body=b"keep")
    gone = Checkpointer().clean_scratch(s3_root)
    assert gone == [f"{s3_root}/step4"]
    assert [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == [
        "run/step6/model_and_optim/__0_0.distcp"
    ]
    assert sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]) == [
        "elsewhere/keep.txt", "run/step4/notes.txt", "run/step6/train/rank0.json",
    ]  # fmt: skip


def test_a_failed_remote_save_is_invisible(s3_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = storage_for(s3_root)
    real = type(storage).create_exclusive

    def refuse(self: Any, path: str, data: bytes) -> None:
        if not path.endswith(COMMIT_RECORD):
            return real(self, path, data)
        raise StorageError(f"simulated failure creating {path}")

    monkeypatch.setattr(type(storage), "create_exclusive", refuse)
    from ..helpers import tiny_trainer

    t = tiny_trainer(s3_root, CheckpointerCallback(save_interval=5, save_async=False, pre_train_checkpoint=False), 5)
    with pytest.raises(CheckpointSaveError, match="step 5"):
        t.fit()
    monkeypatch.setattr(type(storage), "create_exclusive", real)
    assert storage.list_dir(s3_root) == []  # the uploaded data objects were taken back


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_missing_bucket_is_a_clear_error_before_training(
    scheme: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    request.getfixturevalue(f"{scheme}_root")  # sets the client environment
    root = f"{scheme}://no-such-bucket-here/run"
    cb = CheckpointerCallback(save_interval=2)
    trainer = builtin_trainer(root, 4, cb)
    with pytest.raises(StorageAccessError, match="bucket 'no-such-bucket-here' does not exist"):
        trainer.fit()
    assert trainer.losses == {}
    res = run_cli("-q", "train", "--save-folder", root, "--steps", "3", cwd=tmp_path)
    assert res.returncode == 1 and "does not exist" in res.stderr


def test_rejected_credentials_are_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    server = MotoServer(extra_env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        for k, v in s3_settings(server.url).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("CKPTKEEPER_RETRIES", "1")
        trainer = builtin_trainer("s3://any-bucket/run", 3, CheckpointerCallback())
        with pytest.raises(StorageAccessError, match="rejected the credentials"):
            trainer.fit()
        assert trainer.losses == {}
    finally:
        server.stop()


def test_removal_refuses_bucket_roots(s3_root: str) -> None:
    storage = storage_for(s3_root)
    with pytest.raises(StorageError, match="bucket root"):
        storage.remove_tree("s3://" + s3_root.split("/")[2])


def test_async_upload_runs_while_training_goes_on(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ckptkeeper import TrainingState

    bucket = make_bucket(moto.url)
    proxy = FaultProxy(moto.port, lambda method, path, n: "hold" if method == "PUT" and "/step1/" in path else None)
    try:
        _proxy_env(monkeypatch, proxy)
        model = torch.nn.Linear(64, 64)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        state = TrainingState(model)
        ckpt = Checkpointer()
        path, fut = ckpt.save_async(f"s3://{bucket}/run", 1, state)
        assert proxy.held.wait(timeout=60)  # the upload has started and is stuck at the store...
        assert not fut.done()  # ...while the training thread already has control back
        with torch.no_grad():
            model.weight.add_(1.0)
        proxy.rule = lambda method, path, n: None
        proxy.release.set()  # the held request is dropped; the client retries it and goes on
        fut.result()
        ckpt.close()
        restored = torch.nn.Linear(64, 64)
        Checkpointer().load(path, TrainingState(restored))
        assert torch.equal(restored.weight, before["weight"])  # the change made meanwhile did not leak in
    finally:
        proxy.stop()


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_flipped_byte_in_a_bucket_is_caught(scheme: str, request: pytest.FixtureRequest) -> None:
    import torch

    from ckptkeeper import CorruptCheckpointError, TrainingState

    root: str = request.getfixturevalue(f"{scheme}_root")
    ckpt = Checkpointer()
    ckpt.save(root, 1, TrainingState(torch.nn.Linear(16, 16)))
    storage = storage_for(root)
    target = storage.join(root, "step1", "model_and_optim", "__0_0.distcp")
    data = bytearray(storage.read_bytes(target))
    data[len(data) // 2] ^= 0x01
    storage.write_bytes(target, bytes(data))
    assert ckpt.dir_is_checkpoint(storage.join(root, "step1"))  # same size: complete, but not intact
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp has checksum"):
        ckpt.verify(storage.join(root, "step1"))
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp"):
        ckpt.load(storage.join(root, "step1"), TrainingState(torch.nn.Linear(16, 16)))


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_saves_stream_the_data_file_up_without_a_local_copy(scheme: str, request: pytest.FixtureRequest) -> None:
    import torch

    from ckptkeeper.cli.bench_run import _FixedState
    from ckptkeeper.engine import SaveStage

    root: str = request.getfixturevalue(f"{scheme}_root")
    seen: dict[str, list[str]] = {}

    def look(stage: SaveStage) -> None:
        if stage.name == "writing trainer state":  # the tensors are written by now
            seen["spool"] = [p.relative_to(stage.work).as_posix() for p in Path(stage.work).rglob("*") if p.is_file()]
            seen["store"] = [f.relpath for f in storage_for(stage.final).walk(stage.final)]

    tree = {"model": {"big": torch.randn(5 << 20), "small": torch.randn(7)}}  # 20 MiB: several parts
    ckpt = Checkpointer(on_stage=look)
    ckpt.save(root, 3, _FixedState(tree))
    assert "model_and_optim/__0_0.distcp" not in seen["spool"]
    assert "model_and_optim/__0_0.distcp" in seen["store"] and COMMIT_RECORD not in seen["store"]
    back = {"model": {k: torch.zeros_like(v) for k, v in tree["model"].items()}}
    ckpt.load(f"{root}/step3", _FixedState(back))
    assert all(torch.equal(back["model"][k], v) for k, v in tree["model"].items())
    ckpt.verify(f"{root}/step3")
