"""ckptkeeper for Hugging Face ``transformers.Trainer``: policy, atomic checkpoints, automatic exact resume.

Use :class:`CkptkeeperTrainer` where you would use ``transformers.Trainer`` (same arguments, plus
``save_folder`` and ckptkeeper's policy). ``train()`` then resumes from the newest checkpoint in the
save folder that verifies (corrupt ones are skipped with a warning), with no
``resume_from_checkpoint``, and continues exactly as an uninterrupted run would.

What goes where
---------------
One ckptkeeper checkpoint per save, committed atomically: model and optimizer tensors in DCP
files; the LR scheduler's and the AMP grad scaler's state (``extra_state``); and, in the same
checksummed trainer-state JSON, HF's ``TrainerState`` (what ``trainer_state.json`` holds, with the
``TrainerControl`` and stateful callbacks' states brought up to date as HF does) and the python,
numpy, torch (and CUDA) RNG streams. Nothing is written beside the checkpoint and nothing is
unpickled on load.

Which Transformers seam, and why
--------------------------------
HF's ``Trainer`` already knows how to resume exactly (it recomputes the epoch and the batches to
skip from ``TrainerState.global_step``, skips them with ``accelerate``'s seedable sampler, and puts
the RNG state back after the skip), but reads every piece from files in a ``checkpoint-N`` folder,
some of them with ``torch.load``. A ``TrainerCallback`` alone cannot supply those pieces, so this
is a ``Trainer`` subclass that keeps HF's resume logic and overrides only the private methods that
read or write checkpoint files (pinned and tested with ``transformers==5.24.0``):

* ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler``,
  ``_load_rng_state``: take the state from the ckptkeeper checkpoint instead of files. Model,
  optimizer, scheduler and scaler are loaded together in ``_load_optimizer_and_scheduler``, the first
  point where the optimizer and scheduler exist (loading the optimizer after the scheduler is
  created is what keeps the restored learning rate, as in HF).
* ``_save_checkpoint``: a save HF's own ``save_strategy`` asks for becomes a permanent ckptkeeper
  checkpoint (``save_strategy="no"`` leaves the schedule to ckptkeeper's policy alone).

``train()`` first picks the checkpoint: the newest one whose every file passes its checksum
(``verify``), so that the trainer state HF reads early and the tensors loaded later come from the
same checkpoint. HF reads the trainer state as ``trainer_state.json`` from the folder it is given,
so that JSON (already verified) is written to a private temporary folder which stands in for the
checkpoint. The schedule runs in an internal ``TrainerCallback`` (``on_step_end``, after the
optimizer and scheduler step and ``global_step += 1``).

Limitations: single process or DDP (DeepSpeed and FSDP keep their own sharded checkpoints and are
refused); ``load_best_model_at_end`` is refused (HF's best-model tracking reads its own folders);
``resume_from_checkpoint=<path>`` is refused (use ``load_path=`` to start from a checkpoint in another
folder). Resuming reads the chosen checkpoint twice (verification, then load).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import torch

from ._resume import set_rng_state
from .engine import Checkpointer, Stateful, TrainingState
from .errors import CheckpointError, ConfigurationError, CorruptCheckpointError
from .manager import CheckpointManager
from .policy import CheckpointPolicyConfig

try:
    import transformers
    from transformers.trainer_callback import ExportableState, TrainerCallback, TrainerControl, TrainerState
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ckptkeeper.hf needs transformers: pip install 'ckptkeeper[hf]'") from exc

__all__ = ["CkptkeeperTrainer"]

log = logging.getLogger("ckptkeeper.hf")

_JSON_NAME = "hf_trainer_state"
_TRAINER_STATE_NAME = "trainer_state.json"  # the name HF's train() reads


class _TrainerStateJson:
    """HF's TrainerState as ``json_state``: saved with every checkpoint; on load, HF reads it itself."""

    def __init__(self, trainer: CkptkeeperTrainer) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self._trainer
        doc = dataclasses.asdict(t.state)
        # What HF's _save_checkpoint does to the state before writing trainer_state.json, on a copy.
        by_name: dict[str, list[Any]] = {}
        for cb in [*t.callback_handler.callbacks, t.control]:
            if isinstance(cb, ExportableState):
                by_name.setdefault(type(cb).__name__, []).append(cb.state())
        doc["stateful_callbacks"] = {k: v[0] if len(v) == 1 else v for k, v in by_name.items()}
        return {"trainer_state": doc}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # HF's train() already read it from the stand-in folder (see the module docstring)


class _PolicyCallback(TrainerCallback):  # type: ignore[misc]
    """Runs ckptkeeper's schedule inside HF's loop."""

    def __init__(self, trainer: CkptkeeperTrainer) -> None:
        self._trainer = trainer

    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._trainer._ckpt_begin()

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        mgr = self._trainer.checkpoint_manager
        if mgr is None:
            return
        if control.should_save:
            # HF's save_strategy asks for this step: a permanent checkpoint (its _save_checkpoint,
            # called next, finds the step saved), not an ephemeral the policy would supersede.
            mgr.save(state.global_step)
        else:
            mgr.save_if_due(state.global_step)


class CkptkeeperTrainer(transformers.Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` whose checkpoints are ckptkeeper's, resumed automatically.

    Args (besides ``transformers.Trainer``'s):
        save_folder: where checkpoints go (path, ``s3://``, ``gs://``); default ``args.output_dir``.
        checkpoint_config: a :class:`~ckptkeeper.CheckpointPolicyConfig` (default: its defaults).
        load_path: a checkpoint (or save folder) to start from when ``save_folder`` holds none.
        start_fresh_if_unloadable: train from scratch when the folder holds checkpoints and none
            loads (default: raise :class:`~ckptkeeper.CorruptCheckpointError`).
        take_lease: hold the save folder's writer lease during ``train()``.
        checkpointer: the engine (threads, spool, staging budget); default ``Checkpointer()``.

    Steps are HF's ``state.global_step`` (optimizer updates). :attr:`checkpoint_manager` is the
    run's :class:`~ckptkeeper.CheckpointManager` (``loaded_from``, ``start_step``, ``history``).
    """

    def __init__(
        self,
        *args: Any,
        save_folder: str | None = None,
        checkpoint_config: CheckpointPolicyConfig | None = None,
        load_path: str | None = None,
        start_fresh_if_unloadable: bool = False,
        take_lease: bool = True,
        checkpointer: Checkpointer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        folder = save_folder if save_folder is not None else self.args.output_dir
        if not isinstance(folder, str) or not folder:
            raise ConfigurationError("CkptkeeperTrainer: 'save_folder' (or args.output_dir) must be a path or URL")
        if checkpoint_config is not None and not isinstance(checkpoint_config, CheckpointPolicyConfig):
            raise ConfigurationError(
                f"'checkpoint_config' must be a CheckpointPolicyConfig, got {type(checkpoint_config).__name__}"
            )
        if self.args.load_best_model_at_end:
            raise ConfigurationError(
                "CkptkeeperTrainer does not support load_best_model_at_end (HF's best-model tracking reads its own "
                "checkpoint folders); keep the best weights with retention keep_best or save_model() instead"
            )
        self.save_folder = folder
        self.checkpoint_config = checkpoint_config or CheckpointPolicyConfig()
        self.load_path = load_path
        self.start_fresh_if_unloadable = start_fresh_if_unloadable
        self.take_lease = take_lease
        self._checkpointer = checkpointer
        self.checkpoint_manager: CheckpointManager | None = None
        self._picked: str | None = None
        self._picked_step = 0
        self._stand_in: str | None = None
        self._picked_rng: dict[str, Any] | None = None
        self.add_callback(_PolicyCallback(self))

    # ------------------------------------------------------------------ train

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Train, resuming from the newest good checkpoint in ``save_folder`` (see the class docstring)."""
        if resume_from_checkpoint not in (None, False, True):
            raise ConfigurationError(
                "CkptkeeperTrainer resumes from its save folder by itself; instead of resume_from_checkpoint=<path>, "
                "pass load_path=<path> to start from a checkpoint elsewhere"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ConfigurationError("CkptkeeperTrainer does not support DeepSpeed or FSDP (they shard checkpoints)")
        if self.checkpoint_manager is not None:
            self.checkpoint_manager.close(final_save=False)
        mgr = CheckpointManager(
            self.save_folder,
            model=self.model,
            json_state={_JSON_NAME: _TrainerStateJson(self)},
            config=self.checkpoint_config,
            checkpointer=self._checkpointer,
            load_path=self.load_path,
            start_fresh_if_unloadable=self.start_fresh_if_unloadable,
            take_lease=self.take_lease,
        )
        self.checkpoint_manager = mgr
        try:
            mgr.open()
            resume = self._pick_checkpoint(mgr)
            if resume is not None and 0 < self.args.max_steps <= self._picked_step:
                # HF would run one more step before noticing it is done: load the weights, train nothing.
                return self._finished(mgr, resume)
            out = super().train(
                resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
            mgr.close()  # final save of the last step when not saved yet; waits; releases the folder
            return out
        except BaseException:
            mgr.close(final_save=False)
            raise
        finally:
            if self._stand_in is not None:
                shutil.rmtree(self._stand_in, ignore_errors=True)
            self._stand_in = None
            self._picked = None
            self._picked_rng = None

    def _pick_checkpoint(self, mgr: CheckpointManager) -> str | None:
        """Choose the newest checkpoint that verifies; returns the stand-in folder for HF, or None."""

        def hf_state_of(path: str, ts: dict[str, Any]) -> dict[str, Any]:
            hf_state = ts.get("callbacks", {}).get(_JSON_NAME, {}).get("trainer_state")
            if not isinstance(hf_state, dict):
                raise CorruptCheckpointError(
                    f"checkpoint {path} holds no Hugging Face trainer state (written by another trainer?)"
                )
            return hf_state

        # The manager's fallback rules, with a full checksum pass as the test; a checkpoint without
        # HF's state (written by another trainer) is skipped like a corrupt one.
        def accept(path: str, ts: dict[str, Any]) -> None:
            hf_state_of(path, ts)

        picked = mgr.pick(accept=accept)
        if picked is None:
            return None
        path, ts = picked
        hf_state = hf_state_of(path, ts)
        self._picked = path
        self._picked_step = int(ts["global_step"])
        self._picked_rng = ts["rng"]
        self._stand_in = tempfile.mkdtemp(prefix="ckptkeeper-hf-")
        with open(os.path.join(self._stand_in, _TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            json.dump(hf_state, f)
        return self._stand_in

    def _finished(self, mgr: CheckpointManager, stand_in: str) -> Any:
        """The save folder is at or past ``max_steps``: load the model (no optimizer exists yet) and stop."""
        assert self._picked is not None
        if not isinstance(self.model, torch.nn.Module):
            raise ConfigurationError("CkptkeeperTrainer needs a model (a torch.nn.Module)")
        mgr.state = TrainingState(self.model)
        mgr.load(self._picked)
        self.state = TrainerState.load_from_json(os.path.join(stand_in, _TRAINER_STATE_NAME))
        mgr.close(final_save=False)
        log.info(
            "%s is at step %d, at or past max_steps=%d: nothing to train", self._picked, mgr.step, self.args.max_steps
        )
        return transformers.trainer_utils.TrainOutput(self.state.global_step, 0.0, {})

    # ------------------------------------------------------------------ state

    def _attach_state(self) -> None:
        # The optimizer and scheduler exist only from _prepare_for_training on: the manager's
        # state is built then. accelerate wraps the optimizer; its state lives in the inner one.
        mgr = self._manager()
        opt = self.optimizer
        inner = getattr(opt, "optimizer", opt)
        extra: dict[str, Stateful] = {}
        if self.lr_scheduler is not None:
            extra["lr_scheduler"] = self.lr_scheduler
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            extra["grad_scaler"] = scaler
        if not isinstance(self.model, torch.nn.Module):
            raise ConfigurationError("CkptkeeperTrainer needs a model (a torch.nn.Module)")
        mgr.state = TrainingState(self.model, inner, extra)

    def _ckpt_begin(self) -> None:
        mgr = self._manager()
        if not mgr.checkpoint_loaded:
            self._attach_state()
        # Resumed: begin() only; fresh: resume() finds nothing to load (or starts fresh over
        # unloadable ones, as asked) and begin() makes the pre-train save.
        mgr.restore()

    def _manager(self) -> CheckpointManager:
        if self.checkpoint_manager is None:
            raise ConfigurationError("CkptkeeperTrainer: checkpoints exist only inside train()")
        return self.checkpoint_manager

    def _is_stand_in(self, checkpoint: Any) -> bool:
        return self._stand_in is not None and checkpoint == self._stand_in

    # ------------------------------------------------------------------ HF's private seams

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._is_stand_in(resume_from_checkpoint):
            return  # loaded with the optimizer, in _load_optimizer_and_scheduler
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._is_stand_in(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        mgr = self._manager()
        self._attach_state()
        assert self._picked is not None
        mgr.load(self._picked)
        if mgr.step != self.state.global_step:
            raise CheckpointError(
                f"checkpoint {self._picked} is of step {mgr.step} but its trainer state says {self.state.global_step}"
            )
        log.info("resumed from %s (step %d)", self._picked, mgr.step)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._is_stand_in(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._is_stand_in(checkpoint):
            super()._load_rng_state(checkpoint)
            return
        # HF calls this after skipping the consumed batches: the RNG streams continue from here.
        if self._picked_rng is not None:
            set_rng_state(self._picked_rng)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        mgr = self.checkpoint_manager
        if mgr is None:
            raise ConfigurationError("CkptkeeperTrainer saves checkpoints only inside train()")
        mgr.save(self.state.global_step)
