"""Async saves: the snapshot is isolated, failures surface with step and file, one save at a time,
staging buffers are reused, and async writes the same tensors as sync."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ckptkeeper import (
    Checkpointer,
    CheckpointerCallback,
    CheckpointSaveError,
    CkptkeeperError,
    ConfigurationError,
    TrainingState,
    state_digest,
)
from ckptkeeper.engine import SaveStage

from ..helpers import stepped_linear, tiny_trainer


def _state() -> TrainingState:
    return stepped_linear(0, 64, 64, batch=2, optimizer=torch.optim.Adam)


def _read_tensors(folder: Path, like: TrainingState) -> dict[str, Any]:
    tensors, _ = like.capture()
    fresh = {k: {kk: torch.zeros_like(vv) for kk, vv in v.items()} if k == "model" else v for k, v in tensors.items()}
    dcp_load({"model": fresh["model"]}, storage_reader=FileSystemReader(str(folder / "model_and_optim")), no_dist=True)
    return fresh["model"]


def _assert_holds(folder: Path, like: TrainingState, expected: dict[str, torch.Tensor]) -> None:
    """The model tensors written to ``folder`` are exactly ``expected``."""
    written = _read_tensors(folder, like)
    for k, v in expected.items():
        assert torch.equal(written[k], v), k


def test_state_changed_after_the_call_does_not_leak_in(tmp_path: Path) -> None:
    st = _state()
    before = {k: v.clone() for k, v in st.model.state_dict().items()}
    ckpt = Checkpointer()
    _, fut = ckpt.save_async(str(tmp_path), 1, st)
    with torch.no_grad():
        for p in st.model.parameters():
            p.add_(1000.0)  # right after the call returns, while the write may still run
    fut.result()
    _assert_holds(tmp_path / "step1", st, before)
    ckpt.close()


def failing_at(step: int) -> Checkpointer:
    """A checkpointer whose tensor write fails with an I/O error at one step (through the public seam)."""

    def fault(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and stage.step == step:
            raise OSError(errno.EIO, "Input/output error", os.path.join(stage.work, "model_and_optim", "__0_0.distcp"))

    return Checkpointer(on_stage=fault)


def test_background_failure_surfaces_with_step_and_file(tmp_path: Path) -> None:
    cb = CheckpointerCallback(save_interval=4, save_async=True)
    trainer = tiny_trainer(str(tmp_path), cb, steps=10, checkpointer=failing_at(4))
    with pytest.raises(CheckpointSaveError) as info:
        trainer.fit()
    msg = str(info.value)
    assert "step 4" in msg and "__0_0.distcp" in msg and "Input/output error" in msg
    # Nothing half-visible: step 4 is neither complete nor left as a folder; step 0 is intact.
    # (Raised at step 5 when the failure was over by then, or after step 8's due save started,
    # which a failure never costs: then step 8 is complete too.)
    assert [s for s, _ in Checkpointer().find_checkpoints(str(tmp_path))] in ([0], [0, 8])
    assert not (tmp_path / "step4").exists()


def test_at_most_one_save_in_flight(tmp_path: Path) -> None:
    log: list[str] = []
    active = {"n": 0, "max": 0}
    release = threading.Event()
    lock = threading.Lock()

    def hold_each_write(stage: SaveStage) -> None:
        # Counts saves between their tensor write and their trainer-state write.
        if stage.name == "writing tensors":
            with lock:
                active["n"] += 1
                active["max"] = max(active["max"], active["n"])
                log.append("start")
            release.wait(timeout=30)
        elif stage.name == "writing trainer state":
            with lock:
                active["n"] -= 1
                log.append("end")

    ckpt = Checkpointer(on_stage=hold_each_write)
    st = _state()
    _, first = ckpt.save_async(str(tmp_path), 1, st)
    assert ckpt.save_in_flight
    second: dict[str, Any] = {}
    t = threading.Thread(target=lambda: second.update(r=ckpt.save_async(str(tmp_path), 2, st)))
    t.start()
    t.join(timeout=0.5)
    assert "r" not in second  # the second call waits for the first save
    release.set()
    t.join(timeout=30)
    second["r"][1].result()
    first.result()
    assert active["max"] == 1
    assert log == ["start", "end", "start", "end"]
    assert [s for s, _ in ckpt.find_checkpoints(str(tmp_path))] == [1, 2]
    ckpt.close()


def test_staging_buffers_are_allocated_once_and_reused(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    st = _state()
    ptrs = []
    for step in range(1, 4):
        ckpt.save_async(str(tmp_path), step, st)
        ckpt.wait()
        ptrs.append(sorted(b.data_ptr() for b in ckpt._stager._buffers.values()))
    assert ckpt._stager.allocations == 1
    assert ptrs[0] == ptrs[1] == ptrs[2]
    assert ckpt._stager.nbytes >= sum(p.numel() * 4 for p in st.model.parameters())
    ckpt.close()


def test_sync_and_async_write_identical_tensors(tmp_path: Path) -> None:
    st = _state()
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, st)
    _, fut = ckpt.save_async(str(tmp_path), 2, st)
    fut.result()
    a = _read_tensors(tmp_path / "step1", st)
    b = _read_tensors(tmp_path / "step2", st)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k])
    other = _state()
    ckpt.load(str(tmp_path / "step2"), other)
    assert state_digest(other.model, other.optimizer) == state_digest(st.model, st.optimizer)
    ckpt.close()


def test_save_result_metrics_reach_post_checkpoint_saved(tmp_path: Path) -> None:
    from ckptkeeper import Callback, SaveResult

    seen: list[SaveResult] = []

    class Watch(Callback):
        def post_checkpoint_saved(self, path: str, result: SaveResult) -> None:
            seen.append(result)

    cb = CheckpointerCallback(save_interval=3, save_async=True)
    tiny_trainer(str(tmp_path), cb, steps=7, extra_callbacks=[Watch()]).fit()
    assert [r.step for r in seen] == [0, 3, 6, 7]
    for r in seen:
        assert r.bytes > 0 and r.durable_s >= r.blocked_s >= 0 and r.throughput > 0


@pytest.mark.parametrize(
    ("folder", "stages"),
    [
        ("local", ["preparing", "writing tensors", "writing trainer state", "publishing"]),
        ("memory://stages", ["preparing", "writing tensors", "writing trainer state", "uploading", "publishing"]),
    ],
)
def test_the_fault_seam_names_every_stage_and_a_fault_there_leaves_nothing_visible(
    tmp_path: Path, folder: str, stages: list[str]
) -> None:
    where = str(tmp_path / "run") if folder == "local" else folder
    seen: list[tuple[str, int]] = []
    ckpt = Checkpointer(on_stage=lambda s: seen.append((s.name, s.step)))
    ckpt.save(where, 1, _state())
    assert seen == [(name, 1) for name in stages]
    for failing in stages:

        def fault(stage: SaveStage, failing: str = failing) -> None:
            if stage.name == failing:
                raise OSError(errno.EIO, "Input/output error", f"injected at {failing}")

        ckpt.on_stage = fault
        with pytest.raises(CheckpointSaveError, match=f"step 2.*injected at {failing}"):
            ckpt.save(where, 2, _state())
        assert [s for s, _ in ckpt.find_checkpoints(where)] == [1], failing
    ckpt.close()


def test_the_commit_method_is_chosen_once_per_storage(tmp_path: Path) -> None:
    from ckptkeeper.engine.commit import RecordLastCommit, RenameCommit, commit_method_for
    from ckptkeeper.storage import storage_for

    def remove(path: str) -> None:
        raise AssertionError(path)

    assert isinstance(commit_method_for(storage_for(str(tmp_path)), remove, None, 2), RenameCommit)
    assert isinstance(commit_method_for(storage_for("memory://c"), remove, None, 2), RecordLastCommit)


def test_rollback_backs_up_into_the_staging_buffers_of_the_same_name_shape_and_dtype() -> None:
    from ckptkeeper.engine.loader import Rollback
    from ckptkeeper.engine.staging import Stager

    stager = Stager()
    # What an async save staged: the model and the optimizer, in the save's order.
    stager.stage_lazily(
        {
            "optim": {"state": {"w": {"exp_avg": torch.zeros(4)}}},
            "model": {"w": torch.zeros(4), "b": torch.zeros(3), "h": torch.zeros(2)},
        }
    )
    staged = dict(stager._buffers)
    w, b, h = torch.arange(4.0), torch.arange(3, dtype=torch.float64), torch.arange(5.0)
    # A load's live tensors: a part of the staged layout, in another order; b has another
    # dtype and h another shape than their buffers, so they get backups of their own.
    guard = Rollback(stager, {"model": {"h": h, "b": b, "w": w}}, incremental=True)
    assert guard._buffers == {"model.w": staged["model.w"]}
    guard.back_up_whole(["model.w", "model.b", "model.h"])
    assert staged["model.w"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the backup is in the staging buffer
    for t in (w, b, h):
        t.fill_(-1)
    guard.restore()
    assert w.tolist() == [0.0, 1.0, 2.0, 3.0] and b.tolist() == [0.0, 1.0, 2.0] and h.tolist() == list(range(5))


def test_a_failed_load_after_an_async_save_puts_back_the_state_it_found(tmp_path: Path) -> None:
    from ckptkeeper import CorruptCheckpointError
    from ckptkeeper.engine.fastio import DATA_FILE

    torch.manual_seed(0)
    # Many small tensors (read and backed up in runs) and one large one (backed up piece by piece).
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)], torch.nn.Linear(256, 256))
    with torch.no_grad():
        model[-1].weight.copy_(torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256) + 1e6)
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    st = TrainingState(model, opt)
    ckpt = Checkpointer()
    _, fut = ckpt.save_async(str(tmp_path), 1, st)
    fut.result()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0).add_(0.5)  # the state the failed load must leave as it was
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    before_opt = {(i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    data = tmp_path / "step1" / "model_and_optim" / DATA_FILE
    raw = bytearray(data.read_bytes())
    marker = (torch.arange(64, dtype=torch.float32) + 1e6).numpy().tobytes()
    at = raw.index(marker) + 200_000  # inside the large weight
    raw[at] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        ckpt.load(str(tmp_path / "step1"), st)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            assert torch.equal(v, before_opt[(i, k)]), (i, k)
    ckpt.close()


def _held_at_step1(fail: bool = False) -> tuple[Checkpointer, threading.Event]:
    """A checkpointer whose write of step 1 waits until the event is set (then fails, with ``fail``)."""
    hold = threading.Event()

    def on_stage(stage: SaveStage) -> None:
        if stage.step == 1 and stage.name == "writing tensors":
            hold.wait(30)
            if fail:
                raise OSError(5, "Input/output error")

    return Checkpointer(on_stage=on_stage), hold


def _gated_job(outcome: Any) -> tuple[Any, threading.Event, threading.Event]:
    """(job, go, ended): the job waits for ``go``, sets ``ended``, then raises ``outcome`` if it is
    an exception, else returns it."""
    go, ended = threading.Event(), threading.Event()

    def job() -> Any:
        go.wait(30)
        ended.set()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return job, go, ended


@contextlib.contextmanager
def _sigusr1_during(handler: Any, release: threading.Event) -> Iterator[None]:
    """Run the block with ``handler`` for SIGUSR1, sent to the main thread 0.2 s in; ``release`` set 0.5 s in."""
    previous = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident
    assert main is not None
    try:
        threading.Timer(0.2, signal.pthread_kill, args=(main, signal.SIGUSR1)).start()
        threading.Timer(0.5, release.set).start()
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _interrupt_main_after(seconds: float) -> threading.Timer:
    """Ctrl-C as a terminal sends it, to the main thread (``_thread.interrupt_main`` only sets a
    flag, which a thread blocked waiting on a lock does not see until it wakes)."""
    import signal

    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(seconds, signal.pthread_kill, args=(main, signal.SIGINT))
    timer.start()
    return timer


def test_an_interrupted_wait_keeps_the_job_tracked_until_it_ends() -> None:
    from ckptkeeper.engine.async_runner import AsyncRunner

    runner: AsyncRunner[str] = AsyncRunner()
    job, go, ended = _gated_job(OSError("disk gone"))
    runner.submit(job)
    _interrupt_main_after(0.1)
    with pytest.raises(KeyboardInterrupt):
        runner.wait()  # Ctrl-C while waiting
    assert runner.in_flight and not ended.is_set()
    runner.forget(runner._last)  # type: ignore[arg-type]  # as a caller that collected it would
    threading.Timer(0.3, go.set).start()
    runner.settle()  # still waits for the job: it may be reading buffers
    assert ended.is_set() and not runner.in_flight

    again: AsyncRunner[str] = AsyncRunner()
    go.clear()
    again.submit(job)
    _interrupt_main_after(0.1)
    with pytest.raises(KeyboardInterrupt):
        again.wait()
    go.set()
    with pytest.raises(OSError, match="disk gone"):
        again.wait()  # the outcome was not lost with the interrupted wait
    assert again.wait() is None  # and it is raised once
    runner.close()
    again.close()


def test_a_load_after_an_interrupted_wait_does_not_touch_the_buffers_a_save_is_writing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters())
    st = TrainingState(model, opt)

    def train(scale: float) -> None:
        for p in model.parameters():
            p.grad = torch.full_like(p, scale)
        opt.step()

    ckpt, hold = _held_at_step1()  # a slow write of step 1
    ckpt.save(str(tmp_path), 0, st)
    train(1.0)
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    _, fut = ckpt.save_async(str(tmp_path), 1, st)
    train(3.0)  # training goes on
    _interrupt_main_after(0.2)
    with pytest.raises(KeyboardInterrupt):
        ckpt.wait()  # Ctrl-C while waiting for step 1
    assert ckpt.save_in_flight
    threading.Timer(0.5, hold.set).start()
    ckpt.load(str(tmp_path / "step0"), st)  # must wait for step 1 before using the staging buffers
    fut.result()
    _assert_holds(tmp_path / "step1", st, at_call)
    ckpt.close()


def test_a_forgotten_save_still_running_is_not_overwritten_by_the_next_one(tmp_path: Path) -> None:
    st = _state()
    ckpt, hold = _held_at_step1()
    at_call = {k: v.clone() for k, v in st.model.state_dict().items()}
    _, first = ckpt.save_async(str(tmp_path), 1, st)
    ckpt.forget(first)  # its outcome is collected elsewhere (as the Manager does)
    with torch.no_grad():
        for p in st.model.parameters():
            p.add_(5.0)
    threading.Timer(0.5, hold.set).start()
    _, second = ckpt.save_async(str(tmp_path), 2, st)  # stages only once step 1 is written
    first.result()
    second.result()
    _assert_holds(tmp_path / "step1", st, at_call)
    ckpt.close()


def test_ctrl_c_while_a_job_is_handed_to_the_writer_leaves_it_tracked() -> None:
    import signal
    import sys

    from ckptkeeper.engine.async_runner import AsyncRunner

    runner: AsyncRunner[int] = AsyncRunner()
    job, go, ended = _gated_job(7)

    main = threading.main_thread().ident
    assert main is not None

    def tracer(frame: Any, event: str, arg: Any) -> None:
        # Ctrl-C just after the executor queued the job, before the runner could record it.
        if event == "call" and frame.f_code.co_name == "_adjust_thread_count":
            sys.settrace(None)
            signal.pthread_kill(main, signal.SIGINT)

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.submit(job)
    finally:
        sys.settrace(None)
    assert runner.in_flight  # the job runs, and the runner knows
    threading.Timer(0.3, go.set).start()
    runner.settle()
    assert ended.is_set()
    assert runner.wait() == 7
    runner.close()


def test_a_cancelled_save_is_reported_once_and_saving_goes_on(tmp_path: Path) -> None:
    import concurrent.futures

    from ckptkeeper.engine.async_runner import AsyncRunner

    runner: AsyncRunner[int] = AsyncRunner()
    go = threading.Event()
    runner.submit(lambda: int(go.wait(30)))
    queued = runner.submit(lambda: 2)  # waits behind the first: can still be cancelled
    assert queued.cancel()
    go.set()
    with pytest.raises(concurrent.futures.CancelledError):
        runner.wait()
    assert runner.wait() is None  # once
    assert runner.submit(lambda: 3).result() == 3 and runner.wait() == 3
    runner.close()


def test_a_save_error_is_raised_to_one_of_two_threads_waiting_for_it(tmp_path: Path) -> None:
    st = _state()
    ckpt, gate = _held_at_step1(fail=True)
    ckpt.save_async(str(tmp_path), 1, st)
    raised: list[str] = []

    def waiter() -> None:
        try:
            ckpt.wait()
            raised.append("none")
        except CheckpointSaveError:
            raised.append("error")

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    threading.Timer(0.3, gate.set).start()
    for t in threads:
        t.join(30)
    assert sorted(raised) == ["error", "none"]
    ckpt.save_async(str(tmp_path), 2, st)[1].result()  # saving goes on
    ckpt.close()


def test_a_save_error_reaches_the_wait_whose_signal_handler_closed_the_checkpointer(tmp_path: Path) -> None:
    ckpt, hold = _held_at_step1(fail=True)
    ckpt.save_async(str(tmp_path), 1, _state())
    with (
        _sigusr1_during(lambda signum, frame: ckpt.close(), hold),
        pytest.raises(CheckpointSaveError),
    ):  # a graceful stop
        ckpt.wait()  # the handler's close() waits too while this waits: the error still arrives here
    assert ckpt.wait() is None  # once


def test_a_signal_handler_that_waits_and_catches_leaves_the_error_to_the_code_it_interrupted(tmp_path: Path) -> None:
    ckpt, hold = _held_at_step1(fail=True)
    ckpt.save_async(str(tmp_path), 1, _state())
    seen: list[str] = []

    def handler(signum: int, frame: Any) -> None:
        try:
            seen.append(f"handler got {ckpt.wait()}")
        except CheckpointSaveError:
            seen.append("handler caught the error")

    with _sigusr1_during(handler, hold), pytest.raises(CheckpointSaveError):
        ckpt.wait()
    assert seen == ["handler got None"]  # raised once: to the wait the handler interrupted
    ckpt.close()


def test_a_sigint_handler_installed_while_a_save_is_handed_over_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import concurrent.futures.thread
    import signal

    def users(signum: int, frame: Any) -> None:  # a graceful-stop handler
        pass

    submit = concurrent.futures.thread.ThreadPoolExecutor.submit

    def installing(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is threading.main_thread():  # not the save's own writer threads
            signal.signal(signal.SIGINT, users)  # installed (by a signal handler, say) mid-hand-over
        return submit(self, fn, *args, **kwargs)

    previous = signal.getsignal(signal.SIGINT)
    ckpt = Checkpointer()
    try:
        monkeypatch.setattr(concurrent.futures.thread.ThreadPoolExecutor, "submit", installing)
        _, fut = ckpt.save_async(str(tmp_path), 1, _state())
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is users
        fut.result()
    finally:
        signal.signal(signal.SIGINT, previous)
        ckpt.close()


def test_a_wait_in_a_handler_that_interrupted_the_runners_own_bookkeeping_does_not_deadlock() -> None:
    from ckptkeeper.engine.async_runner import AsyncRunner

    runner: AsyncRunner[int] = AsyncRunner()
    runner.submit(lambda: 7)
    runner.settle()
    got: list[int | None] = []

    def in_the_lock() -> None:
        with runner._lock:  # a signal handler runs while its thread holds the lock
            got.append(runner.wait())

    t = threading.Thread(target=in_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert got == [7], "deadlocked"
    runner.close()


def _hook_calling(
    call: str,
    folder: Path,
    st: TrainingState,
    load_into: TrainingState,
    box: list[Checkpointer],
    seen: list[BaseException],
) -> Callable[[SaveStage], None]:
    """An on_stage hook that, at step 2's "writing tensors", makes ``call`` on ``box[0]`` (saving
    ``st``, loading step 1 into ``load_into``; "load with another": through a second
    checkpointer) and records what it raised in ``seen`` before raising it on."""

    def hook(stage: SaveStage) -> None:
        if stage.name != "writing tensors" or stage.step != 2:
            return
        ck = box[0]
        try:
            if call == "wait":
                ck.wait()
            elif call == "load":
                ck.load(str(folder / "step1"), load_into)
            elif call == "load with another":
                Checkpointer().load(str(folder / "step1"), load_into)
            elif call == "save_async":
                ck.save_async(str(folder), 3, st)
            elif call == "save":
                ck.save(str(folder), 3, st)
            else:
                ck.close()
        except BaseException as exc:
            seen.append(exc)
            raise

    return hook


@pytest.mark.parametrize("call", ["wait", "load", "save", "save_async", "close"])
def test_a_hook_that_waits_for_its_own_save_gets_an_error_instead_of_a_deadlock(tmp_path: Path, call: str) -> None:
    # An on_stage hook runs on the writer thread, inside the save: wait(), load(), save(),
    # save_async() and close() there would wait for that very save, for ever.
    st = _state()
    box: list[Checkpointer] = []
    seen: list[BaseException] = []
    ckpt = Checkpointer(on_stage=_hook_calling(call, tmp_path, st, _state(), box, seen))
    box.append(ckpt)
    ckpt.save(str(tmp_path), 1, st)
    _, fut = ckpt.save_async(str(tmp_path), 2, st)
    done = threading.Event()
    threading.Thread(target=lambda: (concurrent.futures.wait([fut], timeout=20), done.set()), daemon=True).start()
    assert done.wait(20), "the save never finished: the hook's call waited for it"
    assert len(seen) == 1 and "inside" in str(seen[0]) and "on_stage" in str(seen[0]), seen
    with pytest.raises(CheckpointSaveError):
        ckpt.wait()  # the save failed with that error, reported once
    assert not (tmp_path / "step2").exists() and not (tmp_path / "step3").exists()
    ckpt.save_async(str(tmp_path), 4, st)[1].result()  # and saving goes on
    ckpt.close()


@pytest.mark.parametrize("call", ["load", "load with another", "save", "save_async", "close"])
def test_a_sync_save_hook_that_loads_or_saves_gets_an_error_and_changes_nothing(tmp_path: Path, call: str) -> None:
    # Found by an outside attack: a synchronous save's hook runs on the training thread, where
    # load() went through. It put the step-1 state back under the save, which then committed a
    # mix (parameters read after the load, optimizer slots captured before it) that passed
    # verify; at several ranks, a load on one rank only waited for the others until the
    # process group's timeout. A nested save or close() there interleaved with the save too.
    st = _state()
    box: list[Checkpointer] = []
    seen: list[BaseException] = []
    ckpt = Checkpointer(on_stage=_hook_calling(call, tmp_path, st, st, box, seen))
    box.append(ckpt)
    ckpt.save(str(tmp_path), 1, st)
    with torch.no_grad():
        for p in st.model.parameters():
            p.add_(1.0)  # step 2's state differs from step 1's
    before = state_digest(st.model, st.optimizer)
    with pytest.raises(CheckpointSaveError, match=r"inside a synchronous save"):
        ckpt.save(str(tmp_path), 2, st)
    assert len(seen) == 1 and isinstance(seen[0], ConfigurationError), seen
    assert "on_stage" in str(seen[0]) and f"Checkpointer.{call.split()[0]}()" in str(seen[0]), seen
    assert state_digest(st.model, st.optimizer) == before  # nothing was loaded into it
    assert not (tmp_path / "step2").exists() and not (tmp_path / "step3").exists()
    assert [s for s, _ in ckpt.find_checkpoints(str(tmp_path))] == [1]
    ckpt.wait()  # a sync save's hook may wait: nothing is in flight
    ckpt.on_stage = None
    ckpt.save(str(tmp_path), 2, st)  # and saving goes on
    ckpt.save_async(str(tmp_path), 3, st)[1].result()
    ckpt.close()
    assert [s for s, _ in Checkpointer().find_checkpoints(str(tmp_path))] == [1, 2, 3]


def test_a_sync_save_hook_may_save_with_another_checkpointer(tmp_path: Path) -> None:
    # A save only reads the state: through another checkpointer it is allowed inside a hook.
    st = _state()
    other = Checkpointer()

    def hook(stage: SaveStage) -> None:
        if stage.name == "writing tensors":
            other.save(str(tmp_path / "other"), stage.step, st)

    ckpt = Checkpointer(on_stage=hook)
    ckpt.save(str(tmp_path / "main"), 1, st)
    assert ckpt.find_checkpoints(str(tmp_path / "main"))[0][0] == 1
    assert other.find_checkpoints(str(tmp_path / "other"))[0][0] == 1
    ckpt.close()
    other.close()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_save_leaves_no_work_folder_behind(tmp_path: Path, interrupt: type[BaseException]) -> None:
    # Found by an outside attack: an interrupt raised inside the save (Ctrl-C, sys.exit from a
    # hook) skipped the clean-up an I/O error gets, and left the step's work folder.
    def hook(stage: SaveStage) -> None:
        if stage.name == "writing trainer state" and stage.step == 2:
            raise interrupt

    st = _state()
    ckpt = Checkpointer(on_stage=hook)
    ckpt.save(str(tmp_path), 1, st)
    with pytest.raises(interrupt):
        ckpt.save(str(tmp_path), 2, st)
    assert sorted(os.listdir(tmp_path)) == ["step1"]
    ckpt.save(str(tmp_path), 3, st)
    ckpt.close()
    assert sorted(os.listdir(tmp_path)) == ["step1", "step3"]


def test_a_hook_may_collect_a_save_that_has_finished(tmp_path: Path) -> None:
    # Only a wait that would block is refused inside a save: an earlier save's finished future is
    # collected as anywhere else.
    st = _state()
    got: list[Any] = []
    earlier: list[Any] = []

    def hook(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and stage.step == 2:
            got.append(ckpt.wait_for(earlier[0]))

    ckpt = Checkpointer(on_stage=hook)
    _, fut1 = ckpt.save_async(str(tmp_path), 1, st)
    earlier.append(fut1)
    concurrent.futures.wait([fut1])
    _, fut2 = ckpt.save_async(str(tmp_path), 2, st)  # waits for (and collects) save 1 first
    assert fut2.result().step == 2 and len(got) == 1
    ckpt.close()


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("who", ["training thread", "hook", "another thread's sync save"])
def test_cleaning_scratch_during_saves_leaves_their_work_folders_alone(tmp_path: Path, who: str, store: bool) -> None:
    # A running save's work folder (on an object store: its uploads, announced by intents, before
    # the record) is not a leftover, whoever asks for the clean-up and however the save runs:
    # deleted under the save, the save committed a checkpoint without its tensors (found by
    # outside attacks).
    import uuid

    folder = f"memory://cleaning-{uuid.uuid4().hex[:8]}" if store else str(tmp_path)
    st = _state()
    writing, go_on = threading.Event(), threading.Event()
    removed: list[str] = []

    def hold(stage: SaveStage) -> None:
        if stage.name == "publishing" and stage.step == 2:  # everything written (and uploaded)
            if who == "hook":
                removed.extend(ckpt.clean_scratch(folder))
            writing.set()
            go_on.wait(10)

    ckpt = Checkpointer(on_stage=hold)
    if not store:
        (tmp_path / ".tmp-step1-0123abcd").mkdir()  # an interrupted save's leftover: cleaned
    if who == "another thread's sync save":
        results: list[Any] = []
        saver = threading.Thread(target=lambda: results.append(ckpt.save(folder, 2, st)))
        saver.start()
    else:
        _, fut = ckpt.save_async(folder, 2, st)
    assert writing.wait(10)
    if who != "hook":
        # Another checkpointer, too; on a store with the folder spelled otherwise (an empty part
        # is no part there: the same objects).
        other = folder.replace("memory://", "memory:///") if store else folder
        removed.extend(Checkpointer().clean_scratch(other))
    go_on.set()
    if who == "another thread's sync save":
        saver.join(10)
        assert results and results[0].step == 2
    else:
        assert fut.result().step == 2
    assert [os.path.basename(p) for p in removed] == ([] if store else [".tmp-step1-0123abcd"])
    step2 = ckpt.find_checkpoints(folder)
    assert [s for s, _ in step2] == [2]
    ckpt.verify(step2[0][1])
    ckpt.load(step2[0][1], _state())
    ckpt.close()


@pytest.mark.parametrize("call", ["close", "drain", "wait", "save", "finish", "poll"])
def test_a_hook_calling_the_managers_waits_changes_nothing_and_the_error_reaches_the_training_code(
    tmp_path: Path, call: str
) -> None:
    # Refused before anything changes: close() from the hook had released the folder's lease
    # under the running save and marked the manager closed, so the save's error was lost; drain()
    # dropped the save's tracking and logged a failure that had not happened.
    from ckptkeeper import CheckpointManager, CheckpointPolicyConfig, ConfigurationError

    seen: list[BaseException] = []
    box: list[CheckpointManager] = []

    def hook(stage: SaveStage) -> None:
        if stage.name != "writing tensors" or stage.step != 2 or threading.current_thread() is threading.main_thread():
            return
        mgr = box[0]
        try:
            if call == "save":
                mgr.save(3, wait=True)
            elif call == "poll":
                mgr.poll(wait=True)
            else:
                getattr(mgr, call)()
        except BaseException as exc:
            seen.append(exc)
            raise

    cfg = CheckpointPolicyConfig(save_interval=1, save_async=True)
    mgr = CheckpointManager(
        str(tmp_path), model=torch.nn.Linear(4, 4), config=cfg, checkpointer=Checkpointer(on_stage=hook)
    )
    box.append(mgr)
    mgr.restore()
    mgr.save_if_due(1)
    mgr.save_if_due(2)
    lease = mgr.lease
    with pytest.raises(CheckpointSaveError, match=f"CheckpointManager.{call}"):
        mgr.wait()
    assert len(seen) == 1 and isinstance(seen[0], ConfigurationError)
    assert mgr.lease is lease is not None and not mgr._closed  # nothing was closed or released
    mgr.save_if_due(4)
    mgr.close()
    found = [step for step, _ in Checkpointer().find_checkpoints(str(tmp_path))]
    assert 2 not in found and 4 in found, found


@pytest.mark.parametrize(
    ("damage", "stage_name", "writer"),
    [
        ("delete", "publishing", "auto"),
        ("truncate", "publishing", "auto"),
        # Before each rank hashes what it wrote: a file gone by then was left out of the record.
        ("delete", "writing trainer state", "dcp"),
        ("delete-metadata", "writing trainer state", "dcp"),
        ("delete-layout", "writing trainer state", "auto"),
    ],
)
def test_a_save_whose_work_folder_is_damaged_before_the_commit_fails_and_publishes_nothing(
    tmp_path: Path, damage: str, stage_name: str, writer: str
) -> None:
    # Something else deletes or cuts a file of a save in progress: the commit must not publish a
    # record without its tensors and report success.
    from ckptkeeper.engine.discovery import LAYOUT_FILE

    st = _state()

    def hook(stage: SaveStage) -> None:
        if stage.name == stage_name and stage.step == 2:
            data = Path(stage.work) / "model_and_optim" / "__0_0.distcp"
            if damage == "delete":
                data.unlink()
            elif damage == "delete-metadata":
                (Path(stage.work) / "model_and_optim" / ".metadata").unlink()
            elif damage == "delete-layout":
                (Path(stage.work) / LAYOUT_FILE).unlink()
            else:
                os.truncate(data, data.stat().st_size - 1)

    ckpt = Checkpointer(on_stage=hook, writer=writer)
    ckpt.save(str(tmp_path), 1, st)
    ckpt.save_async(str(tmp_path), 2, st)
    with pytest.raises(CheckpointSaveError, match=r"(__0_0\.distcp|\.metadata|layout\.json)\): \[Errno \d+\] a file"):
        ckpt.wait()
    assert sorted(os.listdir(tmp_path)) == ["step1"]
    assert ckpt.find_checkpoints(str(tmp_path)) == [(1, str(tmp_path / "step1"))]
    ckpt.close()


@pytest.mark.parametrize("call", ["load", "save_async", "close", "wait", "save"])
def test_a_done_callback_of_a_save_gets_an_error_instead_of_a_deadlock(tmp_path: Path, call: str) -> None:
    # A save's done-callbacks run on the writer thread after the save has returned: a load or
    # the next save there waited for that thread to be free, for ever.
    st = _state()
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, st)
    outcome: list[Any] = []
    done = threading.Event()

    def callback(fut: concurrent.futures.Future[Any]) -> None:
        try:
            if call == "load":
                ckpt.load(str(tmp_path / "step1"), _state())
            elif call == "save_async":
                ckpt.save_async(str(tmp_path), 3, st)
            elif call == "close":
                ckpt.close()
            elif call == "save":
                outcome.append(ckpt.save(str(tmp_path), 3, st))  # blocks on nothing: not refused
            else:
                outcome.append(ckpt.wait())  # the save has finished: collected, not refused
        except BaseException as exc:
            outcome.append(exc)
        finally:
            done.set()

    gate = threading.Event()

    def hold(stage: SaveStage) -> None:
        if stage.step == 2 and stage.name == "preparing":
            gate.wait(10)  # the callback is added while the save still runs

    ckpt.on_stage = hold
    _, fut = ckpt.save_async(str(tmp_path), 2, st)
    fut.add_done_callback(callback)
    gate.set()
    assert done.wait(20), "the callback's call waited for the writer thread it runs on"
    if call in ("wait", "save"):
        assert len(outcome) == 1 and outcome[0].step == (2 if call == "wait" else 3), outcome
    else:
        assert len(outcome) == 1 and isinstance(outcome[0], ConfigurationError), outcome
        assert "writer thread" in str(outcome[0])
    ckpt.on_stage = None
    ckpt.save_async(str(tmp_path), 4, st)[1].result()  # saving goes on
    ckpt.close()
    assert [s for s, _ in ckpt.find_checkpoints(str(tmp_path))] == ([1, 2, 3, 4] if call == "save" else [1, 2, 4])


def test_a_sync_save_hook_that_closes_the_manager_changes_nothing(tmp_path: Path) -> None:
    # A synchronous save's hook runs on the training thread; closing the manager there released
    # the folder's lease while the save was still writing.
    from ckptkeeper import CheckpointManager, CheckpointPolicyConfig

    box: list[CheckpointManager] = []
    seen: list[BaseException] = []

    def hook(stage: SaveStage) -> None:
        if stage.step == 2 and stage.name == "writing tensors":
            try:
                box[0].close(final_save=False)
            except BaseException as exc:
                seen.append(exc)
                raise

    cfg = CheckpointPolicyConfig(save_interval=1, save_async=False)
    ck = Checkpointer(on_stage=hook)
    mgr = CheckpointManager(str(tmp_path), model=torch.nn.Linear(4, 4), config=cfg, checkpointer=ck)
    box.append(mgr)
    mgr.restore()
    mgr.save_if_due(1)
    lease = mgr.lease
    with pytest.raises(CheckpointSaveError, match=r"CheckpointManager\.close"):
        mgr.save_if_due(2)
    assert len(seen) == 1 and mgr.lease is lease is not None and not mgr._closed
    mgr.save_if_due(3)
    mgr.close()
    assert [s for s, _ in Checkpointer().find_checkpoints(str(tmp_path))] == [0, 1, 3]


def test_an_exception_inside_the_hand_over_never_leaves_the_writer_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A signal handler other than Python's default Ctrl-C may raise inside the executor's
    # submit(), after the job is queued: the job must still run (it is untracked then, as before),
    # not wait for ever for a record that never comes (found by an outside attack).
    import concurrent.futures.thread as cft

    original = cft.ThreadPoolExecutor._adjust_thread_count
    fired: list[bool] = []

    def raising_once(self: Any) -> None:
        original(self)
        if not fired:
            fired.append(True)
            raise SystemExit("a handler raised inside submit()")

    monkeypatch.setattr(cft.ThreadPoolExecutor, "_adjust_thread_count", raising_once)
    st = _state()
    ckpt = Checkpointer()
    with pytest.raises(SystemExit):
        ckpt.save_async(str(tmp_path), 1, st)
    done = threading.Event()
    second = threading.Thread(target=lambda: (ckpt.save_async(str(tmp_path), 2, st)[1].result(), done.set()))
    second.daemon = True
    second.start()
    assert done.wait(20), "the writer waited for ever for the interrupted hand-over"
    ckpt.close()
    assert [s for s, _ in ckpt.find_checkpoints(str(tmp_path))] == [1, 2]


@pytest.mark.parametrize("use_async", [False, True])
def test_trainer_state_code_that_closes_the_manager_during_its_save_changes_nothing(
    tmp_path: Path, use_async: bool
) -> None:
    # The trainer state's objects run user code (state_dict()) inside the manager's save:
    # closing the manager there released the folder's lease under the save.
    from ckptkeeper import CheckpointManager, CheckpointPolicyConfig

    box: list[CheckpointManager] = []

    class Closing:
        armed = False

        def state_dict(self) -> dict[str, Any]:
            if self.armed:
                box[0].close(final_save=False)
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    closing = Closing()
    cfg = CheckpointPolicyConfig(save_interval=1, save_async=False)
    mgr = CheckpointManager(str(tmp_path), model=torch.nn.Linear(4, 4), config=cfg, json_state={"c": closing})
    box.append(mgr)
    mgr.restore()
    lease = mgr.lease
    closing.armed = True
    with pytest.raises(ConfigurationError, match=r"CheckpointManager\.close"):
        mgr.write_checkpoint(use_async=use_async)
    assert mgr.lease is lease is not None and not mgr._closed
    closing.armed = False
    mgr.close()


@pytest.mark.parametrize("damage", ["delete", "replace-shorter"])
@pytest.mark.parametrize("save_async", [False, True])
def test_an_object_store_save_whose_uploads_vanish_fails_and_publishes_nothing(damage: str, save_async: bool) -> None:
    # The rename commit checked its files before the record went in; the record-last commit of
    # object stores did not: an uploaded object deleted (or rewritten) by something else before
    # the commit gave a record naming a missing or wrong-sized object, reported as a success.
    import uuid

    from ckptkeeper.storage import storage_for

    folder = f"memory://vanish-{uuid.uuid4().hex[:8]}/run"
    store = storage_for(folder)
    st = _state()

    def hook(stage: SaveStage) -> None:
        if stage.name == "publishing" and stage.step == 2:
            key = store.join(stage.final, "model_and_optim/__0_0.distcp")
            if damage == "delete":
                store.remove_file(key)
            else:
                store.write_bytes(key, b"short")

    ckpt = Checkpointer(on_stage=hook)
    ckpt.save(folder, 1, st)
    with pytest.raises(CheckpointSaveError, match=r"__0_0\.distcp"):
        if save_async:
            ckpt.save_async(folder, 2, st)
            ckpt.wait()
        else:
            ckpt.save(folder, 2, st)
    assert ckpt.find_checkpoints(folder) == [(1, store.join(folder, "step1"))]
    ckpt.close()


def test_a_train_state_function_is_called_once_per_save_also_when_over_the_staging_budget(tmp_path: Path) -> None:
    # Found by an outside attack: over the budget the async save fell back to a synchronous one,
    # which called the function again (the Lightning adapter's runs on_save_checkpoint hooks).
    calls: list[int] = []

    def train_state() -> dict[str, Any]:
        calls.append(1)
        return {"calls": len(calls)}

    ckpt = Checkpointer(staging_budget_bytes=1)
    ckpt.save_async(str(tmp_path), 1, _state(), train_state=train_state)[1].result()
    ckpt.save(str(tmp_path), 2, _state(), train_state=train_state)
    assert len(calls) == 2
    assert ckpt.load(str(tmp_path / "step1"), _state())["calls"] == 1
    ckpt.close()


def test_a_bad_metric_is_refused_before_an_earlier_saves_failure_in_one_process(tmp_path: Path) -> None:
    def full_at_step1(stage: SaveStage) -> None:
        if stage.step == 1 and stage.name == "writing trainer state":
            raise OSError(errno.ENOSPC, "No space left on device")

    ckpt = Checkpointer(on_stage=full_at_step1)
    ckpt.save_async(str(tmp_path), 1, _state())
    for _ in range(2):  # the metric, each time; the earlier failure waits for the next wait
        with pytest.raises(ConfigurationError, match="loss"):
            ckpt.save(str(tmp_path), 2, _state(), metrics={"loss": float("nan")})
    with pytest.raises(CkptkeeperError, match="disk is full"):
        ckpt.wait()
    ckpt.close()


def test_state_that_json_cannot_store_is_named_with_the_advice_for_its_part(tmp_path: Path) -> None:
    # The one message had told a train_state's owner to fix state_dict() values (a state's own
    # values are refused by name as they are captured).
    class Odd:
        def state_dict(self) -> dict[str, Any]:
            return {"when": object()}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    ckpt = Checkpointer()
    with pytest.raises(CheckpointSaveError, match=r"the train_state cannot be stored as JSON.*tensors belong"):
        ckpt.save(str(tmp_path), 1, _state(), train_state={"when": object()})
    with pytest.raises(ConfigurationError, match=r"extra\.odd\.when holds a object.*state_dict\(\)"):
        ckpt.save(str(tmp_path), 2, TrainingState(torch.nn.Linear(2, 2), extra={"odd": Odd()}))
    assert ckpt.find_checkpoints(str(tmp_path)) == []
    ckpt.close()
