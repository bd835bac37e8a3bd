"""Interrupted-and-resumed runs end bit-identical to uninterrupted ones, and resume picks the
newest checkpoint that verifies."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptkeeper import Callback, Checkpointer, CheckpointerCallback, CheckpointNotFoundError, state_digest
from ckptkeeper.storage.layout import COMMIT_RECORD

from ..helpers import builtin_trainer, run_to_end, tiny_trainer


def _cb(save_async: bool) -> CheckpointerCallback:
    return CheckpointerCallback(save_interval=20, ephemeral_save_interval=5, save_async=save_async)


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_crash_and_resume_is_bit_exact(tmp_path: Path, save_async: bool) -> None:
    # 16 batches per epoch: the crash at 37 lands mid-epoch, so the shuffled order must be replayed.
    clean = builtin_trainer(str(tmp_path / "clean"), 45, _cb(save_async))
    clean.fit()
    want = state_digest(clean.model, clean.optimizer)

    first = builtin_trainer(str(tmp_path / "run"), 45, _cb(save_async), crash_at=37)
    assert run_to_end(first) is False
    second = builtin_trainer(str(tmp_path / "run"), 45, _cb(save_async))
    second.fit()
    assert second.checkpoint_loaded and second.start_step == 35
    assert state_digest(second.model, second.optimizer) == want
    for step, loss in second.losses.items():
        assert loss == clean.losses[step], step


def test_resume_falls_back_past_a_corrupt_newest_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = str(tmp_path / "run")
    clean = builtin_trainer(str(tmp_path / "clean"), 30, _cb(False))
    clean.fit()
    first = builtin_trainer(folder, 30, _cb(False), crash_at=26)
    run_to_end(first)
    assert [s for s, _ in Checkpointer().find_checkpoints(folder)] == [0, 20, 25]
    data = tmp_path / "run" / "step25" / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        second = builtin_trainer(folder, 30, _cb(False))
        second.fit()
    assert second.start_step == 20
    assert "skipping checkpoint" in caplog.text and "step25" in caplog.text
    assert state_digest(second.model, second.optimizer) == state_digest(clean.model, clean.optimizer)


def test_load_path_is_used_when_the_save_folder_is_empty(tmp_path: Path) -> None:
    src = tiny_trainer(str(tmp_path / "a"), CheckpointerCallback(save_interval=4, save_async=False), 8)
    src.fit()
    t = tiny_trainer(str(tmp_path / "b"), CheckpointerCallback(save_interval=4, save_async=False), 10)
    t.load_path = str(tmp_path / "a")
    t.fit()
    assert t.start_step == 8 and t.loaded_from == str(tmp_path / "a" / "step8")
    bad = tiny_trainer(str(tmp_path / "c"), None, 3)
    bad.load_path = str(tmp_path / "nothing-here")
    with pytest.raises(CheckpointNotFoundError, match="load_path"):
        bad.fit()


def test_a_finished_folder_trains_and_saves_nothing(tmp_path: Path) -> None:
    tiny_trainer(str(tmp_path), CheckpointerCallback(save_interval=5, save_async=False), 10).fit()
    before = sorted(p.name for p in tmp_path.iterdir())
    again = tiny_trainer(str(tmp_path), CheckpointerCallback(save_interval=5, save_async=False), 8)
    again.fit()
    assert again.start_step == 10 and again.losses == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == before


class Counter:
    """A user Stateful with a tensor and plain values."""

    def __init__(self) -> None:
        self.calls = 0
        self.total = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "total": self.total, "tag": ("a", 1)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.calls = sd["calls"]
        self.total = sd["total"]


class CountingCallback(Callback):
    priority = 5  # before the checkpointer (1), so each step's count is inside that step's checkpoint

    def __init__(self) -> None:
        self.seen = 0
        self.loaded: list[str] = []

    def post_train_batch(self) -> None:
        self.seen += 1

    def post_checkpoint_loaded(self, path: str) -> None:
        self.loaded.append(path)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen = sd["seen"]


def test_extra_state_scheduler_and_callback_state_resume(tmp_path: Path) -> None:
    from ckptkeeper import Trainer
    from ckptkeeper.integrations import build_builtin

    def make(crash: int | None) -> tuple[Trainer, Counter, CountingCallback]:
        setup = build_builtin(seed=1, hidden=16)
        sched = torch.optim.lr_scheduler.StepLR(setup.optimizer, step_size=3, gamma=0.5)
        counter = Counter()
        cc = CountingCallback()

        def step(trainer: Trainer, batch: Any) -> float:
            x, y = batch
            setup.optimizer.zero_grad()
            loss = setup.loss_fn(setup.model(x), y)
            loss.backward()
            setup.optimizer.step()
            sched.step()
            counter.calls += 1
            counter.total += 1
            return float(loss)

        from ..helpers import CrashAt

        cbs: list[Callback] = [CheckpointerCallback(save_interval=4, save_async=False), cc]
        if crash is not None:
            cbs.append(CrashAt(crash))
        t = Trainer(
            model=setup.model,
            optimizer=setup.optimizer,
            data_loader=setup.data_loader,
            save_folder=str(tmp_path),
            max_steps=10,
            train_step=step,
            callbacks=cbs,
            extra_state={"sched": sched, "counter": counter},
        )
        return t, counter, cc

    t1, _, _ = make(crash=9)
    run_to_end(t1)
    t2, counter, cc = make(crash=None)
    t2.fit()
    assert t2.start_step == 8
    assert counter.calls == 10 and torch.equal(counter.total, torch.full((3,), 10.0))
    assert cc.seen == 10 and cc.loaded == [str(tmp_path / "step8")]
    assert t2.optimizer is not None
    assert t2.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.5**3)


def test_default_checkpointer_is_added_and_hooks_run_in_priority_order(tmp_path: Path) -> None:
    order: list[str] = []

    class Low(Callback):
        priority = -5

        def pre_train(self) -> None:
            order.append("low")

    class High(Callback):
        priority = 10

        def pre_train(self) -> None:
            order.append("high")

    t = tiny_trainer(str(tmp_path), None, 3, extra_callbacks=[Low(), High()])
    assert any(isinstance(c, CheckpointerCallback) for c in t.callbacks)
    t.fit()
    assert order == ["high", "low"]
    assert [s for s, _ in Checkpointer().find_checkpoints(str(tmp_path))] == [0, 3]


def test_on_error_lets_the_save_in_flight_finish(tmp_path: Path) -> None:
    class Boom(Callback):
        priority = -10

        def post_train_batch(self) -> None:
            if self.step == 4:
                raise RuntimeError("boom")

    errors: list[BaseException] = []

    class Seen(Callback):
        def on_error(self, exc: BaseException) -> None:
            errors.append(exc)

    cb = CheckpointerCallback(save_interval=4, save_async=True)
    t = tiny_trainer(str(tmp_path), cb, 10, extra_callbacks=[Boom(), Seen()])
    with pytest.raises(RuntimeError, match="boom"):
        t.fit()
    assert len(errors) == 1
    assert (tmp_path / "step4" / COMMIT_RECORD).exists()


def test_blocked_ephemeral_steps_are_skipped(tmp_path: Path) -> None:
    class Block(Callback):
        priority = 5

        def post_train_batch(self) -> None:
            self.trainer.block_ephemeral_checkpoints = self.step in (2, 4)

    cb = CheckpointerCallback(save_interval=10, ephemeral_save_interval=2, save_async=False, remove="never")
    tiny_trainer(str(tmp_path), cb, 7, extra_callbacks=[Block()]).fit()
    assert [(e.step, e.kind) for e in cb.history if e.event == "save"] == [
        (0, "permanent"),
        (6, "ephemeral"),
        (7, "permanent"),
    ]


def test_disabled_callback_saves_nothing(tmp_path: Path) -> None:
    tiny_trainer(str(tmp_path), CheckpointerCallback(enabled=False), 5).fit()
    assert Checkpointer().find_checkpoints(str(tmp_path)) == []
