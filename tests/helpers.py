"""Small training set-ups shared by the tests: fast, deterministic, and with real state to resume."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from ckptkeeper import Callback, Checkpointer, CheckpointerCallback, Trainer, TrainingState
from ckptkeeper.integrations import build_builtin


class SimulatedCrash(BaseException):
    """Raised by CrashAt to stop a run hard right after a step (no post_train)."""


class CrashAt(Callback):
    """Stops the run right after ``step`` (after the checkpointer's post_train_batch)."""

    priority = -1000

    def __init__(self, step: int) -> None:
        self.crash_step = step

    def post_train_batch(self) -> None:
        if self.step == self.crash_step:
            raise SimulatedCrash(self.step)


def stepped_linear(
    seed: int, n_in: int, n_out: int, batch: int = 1, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW
) -> TrainingState:
    """A ``Linear(n_in, n_out)`` and its optimizer after one step (so that its state exists), seeded."""
    torch.manual_seed(seed)
    model = nn.Linear(n_in, n_out)
    opt = optimizer(model.parameters())
    model(torch.randn(batch, n_in)).sum().backward()
    opt.step()
    return TrainingState(model, opt)


def tiny_trainer(
    folder: str,
    cb: CheckpointerCallback | None,
    steps: int,
    crash_at: int | None = None,
    seed: int = 0,
    checkpointer: Checkpointer | None = None,
    extra_callbacks: Sequence[Callback] = (),
) -> Trainer:
    """A one-layer model on a fixed list of batches: saves take milliseconds."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(7)]
    callbacks: list[Callback] = [cb] if cb is not None else []
    if crash_at is not None:
        callbacks.append(CrashAt(crash_at))
    callbacks.extend(extra_callbacks)
    return Trainer(
        model=model,
        optimizer=opt,
        loss_fn=nn.MSELoss(),
        data_loader=batches,
        save_folder=folder,
        max_steps=steps,
        callbacks=callbacks,
        checkpointer=checkpointer or Checkpointer(),
    )


def builtin_trainer(folder: str, steps: int, cb: CheckpointerCallback, crash_at: int | None = None) -> Trainer:
    """The CLI's built-in model (dropout, shuffling loader, AdamW) in-process."""
    setup = build_builtin(seed=0, hidden=32)
    callbacks: list[Callback] = [cb]
    if crash_at is not None:
        callbacks.append(CrashAt(crash_at))
    return Trainer(
        model=setup.model,
        optimizer=setup.optimizer,
        loss_fn=setup.loss_fn,
        data_loader=setup.data_loader,
        save_folder=folder,
        max_steps=steps,
        callbacks=callbacks,
    )


def run_to_end(trainer: Trainer) -> bool:
    """Fit; True when the run finished, False when it was stopped by CrashAt."""
    try:
        trainer.fit()
    except SimulatedCrash:
        return False
    return True


def events_of(cb: CheckpointerCallback) -> list[dict[str, Any]]:
    """The callback's history in the scenario file's shape."""
    out: list[dict[str, Any]] = []
    for e in cb.history:
        if e.event == "save":
            out.append({"event": "save", "step": e.step, "kind": e.kind})
        else:
            out.append({"event": "remove", "step": e.step, "at_step": e.at_step})
    return out


def forge(folder: Path, rel: str | None = None, data: bytes | None = None, **record_changes: Any) -> None:
    """Do what an attacker with write access can: replace a file and rewrite the commit record so
    that sizes, checksums and the record's own checksum all match again."""
    from ckptkeeper.engine.record import CommitRecord, FileEntry, digest_bytes
    from ckptkeeper.storage.layout import COMMIT_RECORD

    rec = CommitRecord.from_json((folder / COMMIT_RECORD).read_bytes(), "forge")
    files = dict(rec.files)
    if rel is not None and data is not None:
        target = folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        files[rel] = FileEntry(len(data), digest_bytes(data))
    fields = {"step": rec.step, "ephemeral": rec.ephemeral, "world_size": rec.world_size, "files": files,
              "created_unix": rec.created_unix, "extra": dict(rec.extra)}  # fmt: skip
    fields.update(record_changes)
    (folder / COMMIT_RECORD).write_bytes(CommitRecord(**fields).to_json())


def small_state(seed: int = 0) -> TrainingState:
    """A two-layer model with AdamW after one step: optimizer state exists, saves take milliseconds."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return TrainingState(model, opt)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> Any:
    """``examples/NAME.py`` as a module, under another name (``lightning`` would shadow the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"ckptkeeper_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def example_report(name: str, tmp: Path, label: str, *flags: str) -> dict[str, Any]:
    """Run ``examples/NAME.py`` in this process with ``flags`` and return its ``--report``."""
    import json

    report = tmp / f"{label}.json"
    assert load_example(name).main([*flags, "--report", str(report)]) == 0
    return dict(json.loads(report.read_text()))


def run_cli(*args: str, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``ckptkeeper ARGS`` through ``ckptkeeper.cli.main``, the function the console script calls, in
    this process: a fresh interpreter spends seconds importing torch for each command that reads a
    checkpoint. Returns what ``subprocess.run`` would: the exit code (argparse's exits included),
    stdout and stderr. stdin is never a terminal, as under ``subprocess.run(input=...)``."""
    from ckptkeeper.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        stack.enter_context(mock.patch.object(sys, "stdin", io.StringIO(stdin)))
        # A handler made here would keep writing to this call's stderr buffer after it is gone.
        stack.enter_context(mock.patch.object(logging, "basicConfig", lambda **_: None))
        # Commands quieten loggers and warnings for the rest of their process: here, only for the call.
        stack.enter_context(warnings.catch_warnings())
        levels = {
            name: lg.level for name, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)
        }
        stack.callback(_restore_levels, levels)
        try:
            code = main(list(args))
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:  # what the interpreter does with a message: print it, exit 1
                print(exc.code, file=sys.stderr)
                code = 1
    return subprocess.CompletedProcess(["ckptkeeper", *args], code, out.getvalue(), err.getvalue())


def _restore_levels(levels: dict[str, int]) -> None:
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            logger.setLevel(levels.get(name, logging.NOTSET))


def load_readers(records: Sequence[logging.LogRecord]) -> list[Any]:
    """How each load among ``records`` (``caplog.records``) read its tensors: "fast", "pieces" or
    "dcp", from the event the ``ckptkeeper.metrics`` logger gets per load (log it at INFO)."""
    return [
        r.ckptkeeper_event["reader"]  # type: ignore[attr-defined]
        for r in records
        if getattr(r, "ckptkeeper_event", {}).get("event") == "load"
    ]


class Picky:
    """An extra whose load_state_dict raises a raw KeyError on a state saved under another key:
    a load then fails after the tensors went in, and must put everything back."""

    def __init__(self, key: str) -> None:
        self.key, self.value = key, 1

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd[self.key]
