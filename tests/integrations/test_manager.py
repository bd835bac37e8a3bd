"""CheckpointManager in a hand-written loop: resume, data position, triggers, retention, preemption."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptkeeper import (
    Checkpointer,
    CheckpointManager,
    CheckpointPolicyConfig,
    CheckpointSaveError,
    ConfigurationError,
    CorruptCheckpointError,
    DiskFullError,
    RetentionRules,
    state_digest,
)
from ckptkeeper.engine import SaveStage, discovery


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any, DataLoader[Any]]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(48, 6, generator=g)
    y = torch.randn(48, 2, generator=g)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)


def _step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, batch: list[torch.Tensor]) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    opt.step()
    sched.step()


def _run(
    folder: str,
    steps: int,
    *,
    stop_at: int | None = None,
    config: CheckpointPolicyConfig | None = None,
    metrics: Any = None,
    **kw: Any,
) -> tuple[CheckpointManager, str, int]:
    """Train to ``steps`` (or abandon the run after ``stop_at``, as a crash would); returns (mgr, digest, start)."""
    model, opt, sched, loader = _setup()
    cfg = config or CheckpointPolicyConfig(save_interval=6, ephemeral_save_interval=2, save_async=False)
    mgr = CheckpointManager(folder, model=model, optimizer=opt, extra_state={"sched": sched}, config=cfg, **kw)
    step = start = mgr.restore()
    for batch in mgr.data(loader, max_steps=steps):
        _step(model, opt, sched, batch)
        step += 1
        mgr.save_if_due(step, metrics=metrics(step) if metrics else None)
        if step == stop_at:
            mgr.close(final_save=False)  # a crash: nothing more is saved
            return mgr, state_digest(model, opt), start
    mgr.close()
    return mgr, state_digest(model, opt), start


def _steps_on_disk(folder: str) -> list[int]:
    return [i.step for i in discovery.list_checkpoints(folder) if i.complete]


@pytest.mark.parametrize("save_async", [False, True])
def test_crash_and_resume_equals_an_uninterrupted_run(tmp_path: Path, save_async: bool) -> None:
    cfg = CheckpointPolicyConfig(save_interval=6, ephemeral_save_interval=2, save_async=save_async)
    _, whole, _ = _run(str(tmp_path / "whole"), 17, config=cfg)  # 17 steps: three epochs of 6 batches
    _run(str(tmp_path / "crash"), 17, stop_at=9, config=cfg)
    mgr, resumed, start = _run(str(tmp_path / "crash"), 17, config=cfg)
    assert start == 8 and mgr.loaded_from is not None and mgr.loaded_from.endswith("step8")
    assert resumed == whole
    # The final step is saved at close, superseded ephemerals are gone, permanents stay.
    assert _steps_on_disk(str(tmp_path / "crash")) == [0, 6, 12, 16, 17]


def test_resume_falls_back_past_a_corrupt_checkpoint(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    _, whole, _ = _run(str(tmp_path / "whole"), 12)
    _run(folder, 12, stop_at=9)
    data = next(p for p in (tmp_path / "run" / "step8").rglob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    _, resumed, start = _run(folder, 12)
    assert start == 6 and resumed == whole  # step 8 skipped; step 6 loaded and replayed exactly


def test_all_checkpoints_corrupt_raises_unless_asked_to_start_fresh(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    _run(folder, 3, stop_at=3, config=CheckpointPolicyConfig(save_interval=2, save_async=False))
    for data in (tmp_path / "run").rglob("*.distcp"):
        data.write_bytes(b"\0" * data.stat().st_size)
    with pytest.raises(CorruptCheckpointError, match="none of the 2 checkpoints"):
        _run(folder, 4)
    _, _, start = _run(folder, 4, start_fresh_if_unloadable=True)
    assert start == 0


def test_restore_loads_nothing_once_pick_chose_to_start_fresh() -> None:
    # Found by an outside attack: with the refused checkpoints left in place (an object store),
    # restore() tried them again without pick()'s accept rule and loaded one.
    folder = "memory://pick-then-restore/run"
    _run(folder, 4, config=CheckpointPolicyConfig(save_interval=2, save_async=False))
    model, opt, sched, _ = _setup(seed=5)
    fresh = state_digest(model, opt)
    mgr = CheckpointManager(folder, model=model, optimizer=opt, extra_state={"sched": sched},
                            start_fresh_if_unloadable=True)  # fmt: skip
    mgr.open()

    def refuse(path: str, ts: dict[str, Any]) -> None:
        raise CorruptCheckpointError(f"{path}: written by another trainer")

    assert mgr.pick(accept=refuse) is None
    assert mgr.restore() == 0 and not mgr.checkpoint_loaded
    assert state_digest(model, opt) == fresh
    mgr.close(final_save=False)
    assert {2, 4} <= set(_steps_on_disk(folder))  # left in place on the object store, not saved over yet


def test_misuse_gets_clear_errors(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigurationError, match="model"):
        CheckpointManager(str(tmp_path))
    with pytest.raises(ConfigurationError, match="save_every_seconds"):
        CheckpointManager(str(tmp_path), model=model, save_every_seconds=0)
    with pytest.raises(ConfigurationError, match="not a signal"):
        CheckpointManager(str(tmp_path), model=model, save_on_signals=[12345])
    mgr = CheckpointManager(str(tmp_path), model=model)
    with pytest.raises(ConfigurationError, match="restore"):
        mgr.save_if_due(1)
    mgr.restore()
    mgr.save_if_due(3)
    with pytest.raises(ConfigurationError, match="before step 3"):
        mgr.save_if_due(2)
    with pytest.raises(ConfigurationError, match="finite"):  # the engine refuses; the manager drops it (below)
        Checkpointer().save(str(tmp_path / "other"), 4, mgr.state, metrics={"loss": float("nan")})
    mgr.close()
    with pytest.raises(ConfigurationError, match="closed"):
        mgr.save_if_due(5)


def test_save_now_and_force(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=None, pre_train_checkpoint=False)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg)
    assert mgr.restore() == 0
    first = mgr.save(5, wait=True, metrics={"loss": 0.25})
    assert mgr.save(5) == first  # already saved: nothing written again
    (info,) = [i for i in discovery.list_checkpoints(folder) if i.step == 5]
    assert info.complete and info.ephemeral is False and dict(info.metrics) == {"loss": 0.25}
    created = Checkpointer().read_record(first).created_unix
    mgr.save(5, force=True, wait=True, metrics={"loss": 0.5})
    assert Checkpointer().read_record(first).created_unix > created
    mgr.close()
    assert dict(Checkpointer().read_record(first).extra["metrics"]) == {"loss": 0.5}
    assert [e.event for e in mgr.history] == ["save", "save"]


def test_wall_clock_trigger(tmp_path: Path) -> None:
    never = CheckpointPolicyConfig(save_interval=None, pre_train_checkpoint=False, save_async=False)
    mgr, _, _ = _run(str(tmp_path / "a"), 5, config=never, save_every_seconds=1e-9)
    # Each step is past the (tiny) deadline: an ephemeral save each, each superseding the last.
    assert [(e.step, e.kind) for e in mgr.history if e.event == "save"] == [(s, "ephemeral") for s in range(1, 6)]
    assert _steps_on_disk(str(tmp_path / "a")) == [5]
    mgr, _, _ = _run(str(tmp_path / "b"), 5, config=never, save_every_seconds=3600, stop_at=5)
    assert _steps_on_disk(str(tmp_path / "b")) == []
    assert mgr.history == []


def test_retention_keep_last_and_best(tmp_path: Path) -> None:
    cfg = CheckpointPolicyConfig(save_interval=2, save_async=False)
    folder = str(tmp_path / "run")
    losses = {2: 0.9, 4: 0.1, 6: 0.8, 8: 0.7, 10: 0.6, 12: 0.5}
    mgr, _, _ = _run(
        folder,
        12,
        config=cfg,
        retention=RetentionRules(keep_last=2, keep_best=1, best_metric="loss"),
        metrics=lambda s: {"loss": losses.get(s, 1.0)},
    )
    # Step 0 (pre-train, no metric) and the others go; the best (4) and the last two stay.
    assert _steps_on_disk(folder) == [4, 10, 12]
    removed = sorted(e.step for e in mgr.history if e.event == "remove")
    assert removed == [0, 2, 6, 8]


def test_retention_never_removes_the_newest(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=2, save_async=True)
    _run(folder, 6, config=cfg, retention=RetentionRules(keep_last=1))
    assert _steps_on_disk(folder) == [6]
    # Without retention rules permanent checkpoints stay, as in the seed.
    _run(str(tmp_path / "b"), 6, config=cfg)
    assert _steps_on_disk(str(tmp_path / "b")) == [0, 2, 4, 6]


def _slow_writes(mgr: CheckpointManager, seconds: float) -> None:
    def slow(stage: SaveStage) -> None:
        if stage.name == "writing tensors":
            time.sleep(seconds)

    mgr.checkpointer.on_stage = slow


@pytest.mark.parametrize("during_async_save", [False, True])
def test_sigterm_saves_once_and_exits_cleanly(tmp_path: Path, during_async_save: bool) -> None:
    folder = str(tmp_path / "run")
    model, opt, sched, loader = _setup()
    cfg = CheckpointPolicyConfig(save_interval=4, save_async=True, pre_train_checkpoint=False)
    mgr = CheckpointManager(
        folder, model=model, optimizer=opt, extra_state={"sched": sched}, config=cfg, save_on_signals=[signal.SIGTERM]
    )
    previous = signal.getsignal(signal.SIGTERM)
    step = mgr.restore()
    if during_async_save:
        _slow_writes(mgr, 0.5)
    with pytest.raises(SystemExit) as exit_:
        for batch in mgr.data(loader):
            _step(model, opt, sched, batch)
            step += 1
            mgr.save_if_due(step)
            if step == 4:
                assert mgr.checkpoint_pending  # the step-4 save is being written in the background
                os.kill(os.getpid(), signal.SIGTERM)
            assert step < 6
    assert exit_.value.code == 0
    assert step == 5
    assert _steps_on_disk(folder) == [4, 5]  # the save in flight finished, then step 5 was saved once
    assert signal.getsignal(signal.SIGTERM) == previous
    assert mgr.lease is None
    # The next run resumes from the preemption checkpoint.
    model2, opt2, sched2, _ = _setup()
    again = CheckpointManager(folder, model=model2, optimizer=opt2, extra_state={"sched": sched2}, config=cfg)
    assert again.restore() == 5
    again.close()
    assert state_digest(model2, opt2) == state_digest(model, opt)


def test_data_ends_at_max_steps_without_drawing_a_batch(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    _run(folder, 6)
    model, opt, sched, loader = _setup()
    mgr = CheckpointManager(folder, model=model, optimizer=opt, extra_state={"sched": sched})
    assert mgr.restore() == 6
    rng = torch.get_rng_state()
    assert list(mgr.data(loader, max_steps=6)) == []  # already there: no batch, no shuffle drawn
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(ConfigurationError, match="max_steps"):
        mgr.data(loader, max_steps=-1)
    mgr.close()
    assert max(_steps_on_disk(folder)) == 6


def test_a_model_that_grew_resumes_with_strict_false_and_says_what_it_left_out(tmp_path: Path) -> None:
    from ckptkeeper import CheckpointMismatchError

    folder = str(tmp_path / "run")
    _run(folder, 4)
    model = _setup()[0]
    grown = nn.Sequential(*model, nn.Linear(2, 2))
    strict = CheckpointManager(folder, model=grown, optimizer=torch.optim.AdamW(grown.parameters()))
    with pytest.raises(CheckpointMismatchError, match="strict=False"):
        strict.restore()
    mgr = CheckpointManager(folder, model=grown, optimizer=torch.optim.AdamW(grown.parameters()), strict=False)
    assert mgr.restore() == 4
    report = mgr.load_report
    assert report is not None and sorted(report.missing_keys) == ["model.3.bias", "model.3.weight"]
    assert report.unexpected_keys == [] and report.mismatched_keys == []  # the saved scheduler was not asked for
    mgr.close(final_save=False)
    ref, ref_opt, _, _ = _setup()
    with CheckpointManager(folder, model=ref, optimizer=ref_opt, take_lease=False) as same:
        same.restore()
    assert torch.equal(grown[0].weight, ref[0].weight) and torch.equal(grown[2].bias, ref[2].bias)
    assert not torch.equal(grown[0].weight, _setup()[0][0].weight)  # step 4's weights, not a fresh init


def test_a_failed_async_save_is_raised_once_and_the_next_save_still_happens(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")

    def fail_step_4(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and stage.step == 4:
            raise OSError(5, "Input/output error", "injected")

    cfg = CheckpointPolicyConfig(save_interval=4, save_async=True)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg, checkpointer=Checkpointer(on_stage=fail_step_4))
    mgr.restore()
    errors = []
    for step in range(1, 9):
        try:
            mgr.save_if_due(step)
        except CheckpointSaveError as exc:
            errors.append((step, str(exc)))
    mgr.close()
    assert len(errors) == 1 and "step 4" in errors[0][1]  # raised once, at a later step
    assert _steps_on_disk(folder) == [0, 8]


def test_save_after_an_ephemeral_of_the_same_step_makes_it_permanent(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=None, ephemeral_save_interval=2, save_async=False)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg)
    mgr.restore()
    for step in range(1, 9):
        mgr.save_if_due(step)
        if step == 4:
            mgr.save(4)  # the user wants this one kept
    mgr.close()
    kinds = {i.step: i.ephemeral for i in discovery.list_checkpoints(folder) if i.complete}
    assert kinds[4] is False and 2 not in kinds and 6 not in kinds  # 4 stayed; superseded ephemerals went


def test_bad_metrics_never_stop_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=1, save_async=False, pre_train_checkpoint=False)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg)
    mgr.restore()
    values: list[Any] = [float("nan"), float("inf"), 10**400, "0.5", torch.tensor(0.25), torch.ones(3)]
    for step, value in enumerate(values, start=1):
        mgr.save_if_due(step, metrics={"loss": value, "ok": 1.0})
    mgr.close()
    saved = {i.step: dict(i.metrics) for i in discovery.list_checkpoints(folder)}
    assert saved[1] == {"ok": 1.0} and saved[3] == {"ok": 1.0}
    assert saved[5] == {"loss": 0.25, "ok": 1.0}  # a one-element tensor is its number
    assert caplog.text.count("is not stored with the checkpoint") == 1  # warned once per name


def test_steps_beyond_what_a_record_can_hold_are_refused(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), model=nn.Linear(2, 2))
    mgr.restore()
    with pytest.raises(ConfigurationError, match="2\\*\\*62"):
        mgr.save_if_due(2**63)
    with pytest.raises(ConfigurationError, match="2\\*\\*62"):
        Checkpointer().save(str(tmp_path), 2**70, mgr.state)
    mgr.close(final_save=False)
    with pytest.raises(ConfigurationError, match="closed"):
        mgr.data([1, 2])


def test_pick_skips_what_accept_refuses(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    _run(folder, 6, config=CheckpointPolicyConfig(save_interval=2, save_async=False))

    def only_old(path: str, ts: dict[str, Any]) -> None:
        if ts["global_step"] > 2:
            raise CorruptCheckpointError(f"{path}: not ours")

    mgr = CheckpointManager(folder, model=nn.Linear(2, 2))
    picked = mgr.pick(accept=only_old)
    assert picked is not None and picked[0].endswith("step2") and picked[1]["global_step"] == 2
    mgr.close(final_save=False)


def test_a_preemption_signal_during_restore_is_kept_for_the_first_step(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    _run(folder, 4, config=CheckpointPolicyConfig(save_interval=2, save_async=False))
    model, opt, _, _ = _setup()
    mgr = CheckpointManager(folder, model=model, optimizer=opt, save_on_signals=[signal.SIGTERM], exit_on_signal=False)
    mgr.on_loaded.append(lambda path: os.kill(os.getpid(), signal.SIGTERM))  # arrives mid-restore
    step = mgr.restore()  # the process survives it
    assert step == 4 and not mgr.preempted
    mgr.save_if_due(step)  # nothing new to save; the manager stops
    assert mgr.preempted and mgr.lease is None


def _manager_failing_at(folder: Path, step: int) -> tuple[CheckpointManager, Any]:
    """A restored async manager whose save of ``step`` waits for the event returned, then fails with EIO."""
    hold = threading.Event()

    def on_stage(stage: SaveStage) -> None:
        if stage.step == step and stage.name == "writing tensors":
            hold.wait(30)
            raise OSError(5, "Input/output error")

    cfg = CheckpointPolicyConfig(save_interval=None, pre_train_checkpoint=False, save_async=True)
    mgr = CheckpointManager(
        str(folder), model=nn.Linear(2, 2), config=cfg, checkpointer=Checkpointer(on_stage=on_stage)
    )
    assert mgr.restore() == 0
    return mgr, hold


def test_ctrl_c_while_waiting_for_an_async_save_loses_neither_the_save_nor_its_error(tmp_path: Path) -> None:
    mgr, hold = _manager_failing_at(tmp_path / "run", 5)
    main = threading.main_thread().ident
    assert main is not None
    threading.Timer(0.2, signal.pthread_kill, args=(main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        mgr.save(5, wait=True)  # Ctrl-C while the save is being written
    hold.set()
    with pytest.raises(CheckpointSaveError, match="Input/output error"):
        mgr.wait()  # the save's failure is still reported, once
    mgr.wait()
    mgr.close(final_save=False)


def test_ctrl_c_while_a_save_is_handed_to_the_writer_is_still_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import concurrent.futures.thread

    mgr, hold = _manager_failing_at(tmp_path / "run", 5)

    submit = concurrent.futures.thread.ThreadPoolExecutor.submit

    def interrupted(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        queued = submit(self, fn, *args, **kwargs)
        if getattr(fn, "__name__", "") == "run":
            signal.raise_signal(signal.SIGINT)  # Ctrl-C once the save is queued
        return queued

    monkeypatch.setattr(concurrent.futures.thread.ThreadPoolExecutor, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(5)
    monkeypatch.undo()
    assert mgr.checkpointer.save_in_flight
    threading.Timer(0.3, hold.set).start()
    with pytest.raises(CheckpointSaveError, match="Input/output error"):
        mgr.wait()  # the save the manager never got the future of: waited for, its error raised
    mgr.wait()
    mgr.close(final_save=False)


def test_a_save_error_taken_by_the_checkpointer_is_not_raised_again_by_the_manager(tmp_path: Path) -> None:
    mgr, hold = _manager_failing_at(tmp_path / "run", 5)
    mgr.save(5)
    raised: list[str] = []

    def waiter(name: str, fn: Any) -> None:
        try:
            fn()
            raised.append(f"{name} returned")
        except CheckpointSaveError:
            raised.append(f"{name} raised")

    threads = [threading.Thread(target=waiter, args=(f"mgr.wait {i}", mgr.wait)) for i in range(2)]
    threads.append(threading.Thread(target=waiter, args=("checkpointer.wait", mgr.checkpointer.wait)))
    for t in threads:
        t.start()
    threading.Timer(0.3, hold.set).start()
    for t in threads:
        t.join(30)
    assert sum(r.endswith("raised") for r in raised) == 1, raised  # once, whoever waited
    mgr.wait()
    mgr.close(final_save=False)


def test_an_emergency_save_in_a_signal_handler_does_not_swallow_the_failed_save_it_interrupted(tmp_path: Path) -> None:
    mgr, hold = _manager_failing_at(tmp_path / "run", 1)
    mgr.save(1)
    saved: list[str] = []

    def handler(signum: int, frame: Any) -> None:
        hold.set()
        saved.append(mgr.save(2, wait=True))  # an emergency save while the main thread waits

    previous = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident
    assert main is not None
    try:
        threading.Timer(0.3, signal.pthread_kill, args=(main, signal.SIGUSR1)).start()
        with pytest.raises(CheckpointSaveError, match="step 1"):
            mgr.wait()  # step 1's failure still reaches the code that was waiting
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert saved and saved[0].endswith("step2")
    assert [s for s, _ in Checkpointer().find_checkpoints(str(tmp_path / "run"))] == [2]
    mgr.wait()
    mgr.close(final_save=False)


def _interrupting_at(step: int) -> Checkpointer:
    """A checkpointer whose saves of ``step`` raise KeyboardInterrupt inside the save (a hook)."""

    def interrupt(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and stage.step == step:
            raise KeyboardInterrupt

    return Checkpointer(on_stage=interrupt)


def _fails_once_at(step: int) -> tuple[Checkpointer, dict[str, int]]:
    """A checkpointer whose first save of ``step`` fails while writing (EIO); later ones work."""
    attempts = {"n": 0}

    def once(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and stage.step == step:
            attempts["n"] += 1
            if attempts["n"] == 1:
                raise OSError(5, "Input/output error", "injected")

    return Checkpointer(on_stage=once), attempts


def _async_manager_failing_once(folder: str, step: int, interval: int) -> tuple[CheckpointManager, dict[str, int]]:
    """A restored async manager saving every ``interval`` steps whose first save of ``step`` fails."""
    ckpt, attempts = _fails_once_at(step)
    cfg = CheckpointPolicyConfig(save_interval=interval, save_async=True)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg, checkpointer=ckpt)
    mgr.restore()
    return mgr, attempts


def _raised_over_steps(
    mgr: CheckpointManager, last: int, errors: type[BaseException], settle: Callable[[int], bool]
) -> int:
    """Call save_if_due for steps 1..last (first letting the save in flight end where ``settle``
    says); how many calls raised ``errors``."""
    raised = 0
    for step in range(1, last + 1):
        if settle(step):
            _until_settled(mgr)
        try:
            mgr.save_if_due(step)
        except errors:
            raised += 1
    return raised


def _first_run(folder: str, cfg: CheckpointPolicyConfig, steps: int = 8) -> None:
    """A whole run of ``steps`` steps saving to ``folder`` (for a second run to resume)."""
    first = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg)
    first.restore()
    for step in range(1, steps + 1):
        first.save_if_due(step)
    first.close()


def _until_settled(mgr: CheckpointManager) -> None:
    """Wait until the save in flight has ended (its outcome not collected)."""
    deadline = time.monotonic() + 30
    while mgr.checkpointer.save_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)


def _failing_from(step: int) -> Checkpointer:
    """A checkpointer whose saves of ``step`` and later fail while writing (a disk that filled up)."""

    def full(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and stage.step >= step:
            raise OSError(28, "No space left on device", "injected")

    return Checkpointer(on_stage=full)


@pytest.mark.parametrize("save_async", [False, True])
def test_failed_ephemeral_saves_never_cost_the_last_good_one(tmp_path: Path, save_async: bool) -> None:
    # Found by attacking the manager: a failed ephemeral save still counted as the newest one,
    # so the good ephemeral it "superseded" was deleted at the next call (a full disk deleted
    # every ephemeral checkpoint the run had, one per failed save).
    folder = str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=None, ephemeral_save_interval=2, save_async=save_async)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg, checkpointer=_failing_from(4))
    mgr.restore()
    failed = 0
    for step in range(1, 11):
        try:
            mgr.save_if_due(step)
        except DiskFullError:
            failed += 1
    try:
        mgr.wait()  # a failed save still in flight raises here (the others were raised in the loop)
    except DiskFullError:
        failed += 1
    assert failed >= 2
    assert 2 in _steps_on_disk(folder)  # the last good ephemeral stays while nothing newer exists
    assert mgr.ephemeral_checkpoints == [os.path.join(folder, "step2")]
    mgr.close(final_save=False)
    assert 2 in _steps_on_disk(folder)


def test_a_failed_save_is_not_taken_for_saved(tmp_path: Path) -> None:
    # save(step) after that step's save failed returned the failed path without writing, and
    # close() skipped the final save: the run ended with its last steps lost and no error.
    folder = str(tmp_path / "run")
    mgr, calls = _async_manager_failing_once(folder, 8, 4)
    for step in range(1, 9):
        mgr.save_if_due(step)
    with pytest.raises(CheckpointSaveError, match="step 8"):
        mgr.save(8, wait=True)  # the failure is raised once step 8 is written again by this call
    assert 8 in _steps_on_disk(folder) and calls["n"] == 2
    path = mgr.save(8, wait=True)  # saved: nothing to write
    assert path == os.path.join(folder, "step8") and calls["n"] == 2
    assert mgr.checkpoints == [os.path.join(folder, "step0"), os.path.join(folder, "step4"), path]
    mgr.close()

    # The same failure caught at the final step: close() saves the final step instead of skipping it.
    folder = str(tmp_path / "again")
    mgr, calls = _async_manager_failing_once(folder, 8, 4)
    for step in range(1, 9):
        mgr.save_if_due(step)
    with pytest.raises(CheckpointSaveError, match="step 8"):
        mgr.wait()
    mgr.close()
    assert 8 in _steps_on_disk(folder)


def test_preemption_after_a_failed_async_save_still_saves_the_next_step(tmp_path: Path) -> None:
    # The save in flight had failed: the next call raised its error before it looked at the
    # preemption signal, so a loop that does not catch it died without the preemption save, and
    # the step it asked to save (and everything since the last good save) was lost.
    folder = str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=4, save_async=True)
    mgr = CheckpointManager(
        folder,
        model=nn.Linear(2, 2),
        config=cfg,
        checkpointer=_fails_once_at(4)[0],
        save_on_signals=[signal.SIGUSR1],
        exit_on_signal=False,
    )
    mgr.restore()
    for step in range(1, 5):
        mgr.save_if_due(step)  # step 4's save starts, and fails in the background
    _until_settled(mgr)  # it has failed by the next call (its error not collected yet)
    os.kill(os.getpid(), signal.SIGUSR1)
    path = mgr.save_if_due(5)  # the failure is logged; step 5 is saved and the manager stops
    assert mgr.preempted and path == os.path.join(folder, "step5")
    assert _steps_on_disk(folder) == [0, 5]


def test_close_saves_the_final_step_when_its_async_save_failed_unnoticed(tmp_path: Path) -> None:
    # close() decided whether the final step needed saving before it waited for the save in
    # flight: that save's failure was raised from close(), and the final step was never written.
    folder = str(tmp_path / "run")
    mgr, attempts = _async_manager_failing_once(folder, 8, 4)
    for step in range(1, 9):
        mgr.save_if_due(step)  # step 8's save fails in the background
    with pytest.raises(CheckpointSaveError, match="step 8"):
        mgr.close()  # still raised once, after the final step is saved again
    assert _steps_on_disk(folder) == [0, 4, 8] and attempts["n"] == 2
    assert mgr.lease is None


@pytest.mark.parametrize("how", ["save-wait", "save", "close", "thread"])
def test_a_failed_save_collected_elsewhere_is_not_taken_for_saved(tmp_path: Path, how: str) -> None:
    # The failure of step 8's async save was collected by checkpointer.wait() (or in another
    # thread), not by the manager: save(8) returned a path without writing (step 4's, with
    # wait=True), and close() ended without step 8 and without an error (an outside attack).
    folder = str(tmp_path / "run")
    mgr, attempts = _async_manager_failing_once(folder, 8, 4)
    for step in range(1, 9):
        mgr.save_if_due(step)
    caught: list[BaseException] = []

    def collect() -> None:
        try:
            mgr.checkpointer.wait()
        except CheckpointSaveError as exc:
            caught.append(exc)

    if how == "thread":
        worker = threading.Thread(target=collect)
        worker.start()
        worker.join()
    else:
        collect()
    assert len(caught) == 1
    if how.startswith("save"):
        path = mgr.save(8, wait=how == "save-wait")
        assert path == os.path.join(folder, "step8")
    mgr.close()  # the error was raised once already: not again
    assert _steps_on_disk(folder) == [0, 4, 8] and attempts["n"] == 2


def test_a_failed_saves_error_never_costs_the_next_scheduled_save(tmp_path: Path) -> None:
    # Step 6's async save failed; its error, raised at the next due save (step 8), skipped that
    # save: the run had no checkpoint between step 4 and the end (an outside attack). The due
    # save now goes ahead and the error is raised after it has started.
    folder = str(tmp_path / "run")
    mgr, _ = _async_manager_failing_once(folder, 6, 2)
    raised: list[int] = []
    for step in range(1, 10):
        if step == 8:
            _until_settled(mgr)  # step 6's save has failed by now, its error not raised yet
        try:
            mgr.save_if_due(step)
        except CheckpointSaveError as exc:
            assert "step 6" in str(exc)
            raised.append(step)
    mgr.close()
    assert raised == [8]
    assert _steps_on_disk(folder) == [0, 2, 4, 8, 9]


@pytest.mark.parametrize("save_async", [False, True])
def test_a_failed_resave_of_a_step_on_an_object_store_keeps_what_is_left(save_async: bool) -> None:
    # On an object store, saving a step again (an ephemeral made permanent, or force=True)
    # removes that step's checkpoint first (the keys are the same). When the new save failed,
    # the manager still listed the removed checkpoint as its newest ephemeral and removed the
    # older one it had superseded: resume went back to step 0 (an outside attack).
    import uuid

    url = f"memory://resave-{uuid.uuid4().hex[:8]}/run"
    failing = {"on": False}

    def fail(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and stage.step == 4 and failing["on"]:
            raise OSError(5, "Input/output error", "injected")

    cfg = CheckpointPolicyConfig(save_interval=None, ephemeral_save_interval=2, save_async=save_async)
    mgr = CheckpointManager(url, model=nn.Linear(2, 2), config=cfg, checkpointer=Checkpointer(on_stage=fail))
    mgr.restore()
    for step in range(1, 5):
        mgr.save_if_due(step)
    mgr.wait()
    failing["on"] = True
    with pytest.raises(CheckpointSaveError, match="step 4"):
        mgr.save(4, wait=True)  # made permanent: fails after step 4's ephemeral was removed
    steps = [i.step for i in mgr.checkpointer.list_checkpoints(url) if i.complete]
    assert steps == [0, 2]
    listed = [p.rsplit("/", 1)[-1] for p in mgr.ephemeral_checkpoints + mgr.checkpoints]
    assert "step4" not in listed
    mgr.save_if_due(5)
    assert [i.step for i in mgr.checkpointer.list_checkpoints(url) if i.complete] == [0, 2]
    failing["on"] = False
    mgr.close()  # the final step is saved: nothing stands for step 4 or later
    assert [i.step for i in mgr.checkpointer.list_checkpoints(url) if i.complete] == [0, 2, 5]


def test_a_keyboard_interrupt_inside_an_async_save_is_raised_once_and_saving_goes_on(tmp_path: Path) -> None:
    # A KeyboardInterrupt raised inside step 4's background save (a hook) came back at every later
    # call and from close(): poll() re-raised it each time, and no later or final save was made
    # (an outside attack).
    folder = str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=4, save_async=True)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg, checkpointer=_interrupting_at(4))
    mgr.restore()
    raised = _raised_over_steps(mgr, 12, KeyboardInterrupt, lambda step: step == 5)
    mgr.close()
    assert raised == 1 and _steps_on_disk(folder) == [0, 8, 12]


def test_a_failed_timed_save_does_not_put_off_the_next_one(tmp_path: Path) -> None:
    # The clock of save_every_seconds restarted when the failed save started: the next timed save
    # came a whole interval later (with a 30-minute interval, about an hour without a checkpoint).
    folder = str(tmp_path / "run")
    ckpt, _ = _fails_once_at(2)
    cfg = CheckpointPolicyConfig(save_interval=None, save_async=True, pre_train_checkpoint=False)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg, checkpointer=ckpt, save_every_seconds=0.5)
    mgr.restore()
    mgr.save_if_due(1)  # not due yet
    time.sleep(0.6)
    assert mgr.save_if_due(2) == os.path.join(folder, "step2")  # due: starts, and fails
    _until_settled(mgr)
    with pytest.raises(CheckpointSaveError, match="step 2"):
        mgr.save_if_due(3)  # still due (the failed save does not count): saved, then the error
    mgr.close(final_save=False)
    assert _steps_on_disk(folder) == [3]


def test_ctrl_c_during_a_resave_on_an_object_store_leaves_nothing_missing_listed() -> None:
    # Ctrl-C inside the save that made step 4 permanent, after the store had removed step 4's
    # ephemeral: the manager still listed step 4 and close() skipped the final save, leaving
    # only step 0 to resume from (an outside attack).
    import uuid

    url = f"memory://ctrlc-{uuid.uuid4().hex[:8]}/run"
    armed = {"on": False}

    def interrupt(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and stage.step == 4 and armed["on"]:
            armed["on"] = False
            raise KeyboardInterrupt

    cfg = CheckpointPolicyConfig(save_interval=None, ephemeral_save_interval=2, save_async=False)
    mgr = CheckpointManager(url, model=nn.Linear(2, 2), config=cfg, checkpointer=Checkpointer(on_stage=interrupt))
    mgr.restore()
    for step in range(1, 5):
        mgr.save_if_due(step)
    armed["on"] = True
    with pytest.raises(KeyboardInterrupt):
        mgr.save(4)
    listed = [p.rsplit("/", 1)[-1] for p in mgr.ephemeral_checkpoints + mgr.checkpoints]
    assert "step4" not in listed
    mgr.close()  # the final step is saved again
    assert [i.step for i in mgr.checkpointer.list_checkpoints(url) if i.complete] == [0, 2, 4]


@pytest.mark.parametrize("store", [False, True])
def test_a_resumed_run_keeps_the_checkpoint_it_resumed_from(tmp_path: Path, store: bool) -> None:
    # Resumed at step 8, save_if_due(8) wrote step 8 again (on an object store, removing the
    # resume point first); and when save(8, force=True) failed there, close() did not write it
    # back, so the next run resumed from step 4 (an outside attack).
    import uuid

    folder = f"memory://resumed-{uuid.uuid4().hex[:8]}/run" if store else str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=4, save_async=False)
    _first_run(folder, cfg)
    writes: list[int] = []
    failing = {"on": False}

    def hook(stage: SaveStage) -> None:
        if stage.name == "writing tensors":
            writes.append(stage.step)
            if failing["on"]:
                raise OSError(5, "Input/output error", "injected")

    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg, checkpointer=Checkpointer(on_stage=hook))
    assert mgr.restore() == 8
    assert mgr.save_if_due(8) is None and writes == []  # saved already
    failing["on"] = True
    with pytest.raises(CheckpointSaveError):
        mgr.save(8, force=True)
    failing["on"] = False
    mgr.close()
    assert 8 in [i.step for i in mgr.checkpointer.list_checkpoints(folder) if i.complete]


def test_an_on_saved_callback_that_raises_is_not_called_again_for_that_save(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=2, save_async=True, pre_train_checkpoint=False)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg)
    seen: list[str] = []

    def note(path: str, result: Any) -> None:
        seen.append(os.path.basename(path))
        if len(seen) == 1:
            raise RuntimeError("a callback's own bug")

    mgr.on_saved.append(note)
    mgr.restore()
    raised = _raised_over_steps(mgr, 6, RuntimeError, lambda step: True)
    mgr.close()
    assert raised == 1 and seen == ["step2", "step4", "step6"]


def test_a_raising_on_saved_callback_does_not_stop_the_due_save(tmp_path: Path) -> None:
    # The callback of step 2's save ran at step 4's call, before step 4's save: its error
    # stopped that save, and the run had no checkpoint after step 2 (an outside attack).
    folder = str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=2, save_async=True, pre_train_checkpoint=False)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg)

    def buggy(path: str, result: Any) -> None:
        if path.endswith("step2"):
            raise RuntimeError("a callback's own bug")

    mgr.on_saved.append(buggy)
    mgr.restore()
    for step in range(1, 4):
        mgr.save_if_due(step)
    _until_settled(mgr)
    with pytest.raises(RuntimeError, match="callback's own bug"):
        mgr.save_if_due(4)  # step 4 is saved, then the callback's error is raised
    mgr.wait()
    assert _steps_on_disk(folder) == [2, 4]  # saved by that call, not by close()
    mgr.close()


def test_a_failing_async_resave_of_the_resumed_step_is_written_back_at_close() -> None:
    # With async saves, close() looked for the resumed step's checkpoint before the failing
    # forced re-save of it had ended: the old checkpoint was still there, so no final save was
    # made, and the re-save then removed it (an outside attack): the next run resumed at step 4.
    import uuid

    url = f"memory://resave-async-{uuid.uuid4().hex[:8]}/run"
    cfg = CheckpointPolicyConfig(save_interval=4, save_async=True)
    _first_run(url, cfg)
    failing = {"on": True}

    def slow_failure(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and failing["on"]:
            failing["on"] = False
            time.sleep(0.3)
            raise OSError(5, "Input/output error", "injected")

    mgr = CheckpointManager(url, model=nn.Linear(2, 2), config=cfg, checkpointer=Checkpointer(on_stage=slow_failure))
    assert mgr.restore() == 8
    mgr.save(8, force=True)  # async: removes step 8, then fails
    with pytest.raises(CheckpointSaveError):
        mgr.close()
    assert [i.step for i in mgr.checkpointer.list_checkpoints(url) if i.complete] == [0, 4, 8]


def test_a_keyboard_interrupt_inside_a_background_save_does_not_mask_the_users_error(tmp_path: Path) -> None:
    # close() after an error drains the save in flight and logs its failure; a KeyboardInterrupt
    # raised inside that save (by a hook) escaped drain() and replaced the training error that
    # was on its way up (an outside attack).
    folder = str(tmp_path / "run")
    cfg = CheckpointPolicyConfig(save_interval=2, save_async=True)
    caught: BaseException | None = None
    try:
        with CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg, checkpointer=_interrupting_at(2)) as mgr:
            mgr.restore()
            for step in range(1, 3):
                mgr.save_if_due(step)
            raise ValueError("training broke")
    except BaseException as exc:  # caught whatever it is: a KeyboardInterrupt would stop the test session
        caught = exc
    assert isinstance(caught, ValueError) and str(caught) == "training broke"
    assert _steps_on_disk(folder) == [0]
