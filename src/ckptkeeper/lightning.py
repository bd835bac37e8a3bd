"""ckptkeeper for PyTorch Lightning: policy, async atomic saves, verification and automatic resume.

Add :class:`CkptkeeperCallback` to ``lightning.Trainer(callbacks=[...])`` and wrap the training
data loader in :class:`ResumableLoader`. A second ``trainer.fit`` on the same save folder continues
from the newest checkpoint that loads (corrupt ones are skipped with a warning), with no
``ckpt_path``, and continues bit-exactly: weights, optimizer, schedulers, loop progress, callback
states, RNG streams and the position in the shuffled epoch all come back.

Which Lightning seam, and why
-----------------------------
Lightning restores a run from one dict (the one ``trainer.save_checkpoint`` writes): model,
optimizers, schedulers, loop progress, callbacks, precision plugin, datamodule, hyper-parameters,
and whatever the module's and callbacks' ``on_save_checkpoint`` add. Its private
``_CheckpointConnector`` builds that dict (``dump_checkpoint``) and applies it in a fixed order
(``restore_model`` before the strategy moves the model, ``restore_training_state`` after the
optimizers exist) once ``_loaded_checkpoint`` holds it. We keep Lightning's own code for both
directions and replace only the file in between:

* saving: the callback asks ``dump_checkpoint()`` for the dict at the step the policy picks
  (``on_train_batch_end``, where Lightning's ``ModelCheckpoint`` saves too, so Lightning's restart
  logic knows the resulting loop state), stores every tensor through ckptkeeper's engine (DCP, model
  weights under ``model.`` like every ckptkeeper checkpoint, so ``ckptkeeper export`` works) and the
  rest as JSON, tuples and non-string dict keys (optimizer states are keyed by int) encoded
  losslessly. A value JSON cannot hold (a class, a function, an OmegaConf container) is refused
  with :class:`~ckptkeeper.ConfigurationError` naming its place in the dict, at the first save.
* resuming: in the ``setup`` hook, which Lightning calls before it restores anything, the
  callback's :class:`~ckptkeeper.CheckpointManager` takes the folder's lease and loads the newest
  good checkpoint (checksums verified, falling back past corrupt ones, RNG streams restored),
  rebuilds Lightning's dict without unpickling anything and hands it to
  ``trainer._checkpoint_connector._loaded_checkpoint``. Lightning then restores everything itself,
  as for ``fit(ckpt_path=...)``. An explicit ``fit(ckpt_path=...)`` replaces that dict (Lightning
  loads its file after ``setup``), so it still works for a fresh save folder; together with a
  checkpoint in the save folder it is refused as ambiguous.

A ``CheckpointIO`` plugin was the other candidate; it is called only when the user passes
``ckpt_path`` and by ``ModelCheckpoint`` with its own file names and schedule, so it could neither
resume automatically nor apply ckptkeeper's policy and retention. Lightning's default
``ModelCheckpoint`` keeps writing its own ``.ckpt`` files (pickles) unless
``Trainer(enable_checkpointing=False)``.

Private Lightning names used (pinned and tested with ``lightning==2.6.6``):
``trainer._checkpoint_connector.dump_checkpoint`` and ``._loaded_checkpoint``.

Data position: Lightning resumes a data loader exactly only when it has ``state_dict`` and
``load_state_dict``; :class:`ResumableLoader` gives a plain (sized) ``DataLoader`` those, recording
the RNG state its epoch's shuffle was drawn from and the batches consumed, and replaying that
shuffle on resume.

Limitations: one process or DDP (the whole dict is gathered like Lightning's own ``.ckpt``; FSDP
and DeepSpeed shard it and are refused); the loaded dict is held in host memory while Lightning
applies it, as Lightning does with its own files.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ._resume import rng_state, set_rng_state
from .engine import Checkpointer, TrainingState
from .errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    ConfigurationError,
    CorruptCheckpointError,
)
from .manager import CheckpointManager
from .policy import CheckpointPolicyConfig

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ckptkeeper.lightning needs Lightning: pip install 'ckptkeeper[lightning]'") from exc

__all__ = ["CkptkeeperCallback", "ResumableLoader", "decode_checkpoint", "encode_checkpoint"]

log = logging.getLogger("ckptkeeper.lightning")

_TENSOR = "__ckptkeeper_tensor__"
_TUPLE = "__ckptkeeper_tuple__"
_ITEMS = "__ckptkeeper_items__"
_FORMAT = 1
_JSON_NAME = "lightning"
_MODEL_KEY = "state_dict"  # Lightning's key for the module's weights


# ---------------------------------------------------------------------- the dict <-> (tensors, JSON)


def encode_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a Lightning checkpoint dict into (tensor tree, JSON document), losslessly.

    The tensor tree is ``{"model": {name: tensor}, "lightning": {path: tensor}}``: the module's
    weights under ``model`` (as in every ckptkeeper checkpoint), every other tensor under its
    dotted path. In the JSON document each tensor is a marker with its key, shape and dtype, a
    tuple is ``{"__ckptkeeper_tuple__": [...]}`` and a dict with keys that are not all strings is
    ``{"__ckptkeeper_items__": [[key, value], ...]}``. Raises :class:`ConfigurationError` naming
    the first value that JSON cannot hold.
    """
    model: dict[str, torch.Tensor] = {}
    others: dict[str, torch.Tensor] = {}

    def tensor(where: list[str], value: torch.Tensor, to_model: bool) -> dict[str, Any]:
        if to_model:
            key, bucket, group = ".".join(where[1:]), model, "model"
        else:
            key, bucket, group = ".".join(where), others, "lightning"
        base, n = key, 1
        while key in bucket:  # two paths that join to the same dotted key
            key, n = f"{base}#{n}", n + 1
        bucket[key] = value
        return {_TENSOR: [group, key], "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}

    def enc(value: Any, where: list[str], in_model: bool) -> Any:
        if isinstance(value, torch.Tensor):
            return tensor(where, value, in_model)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, tuple):
            return {_TUPLE: [enc(v, [*where, str(i)], False) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, [*where, str(i)], False) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            plain = all(isinstance(k, str) and not k.startswith("__ckptkeeper_") for k in value)
            if plain:
                return {k: enc(v, [*where, k], in_model and len(where) == 1) for k, v in value.items()}
            return {
                _ITEMS: [[enc(k, [*where, "<key>"], False), enc(v, [*where, str(k)], False)] for k, v in value.items()]
            }
        place = "checkpoint" + "".join(f"[{p!r}]" for p in where)
        raise ConfigurationError(
            f"the Lightning checkpoint holds a {type(value).__module__}.{type(value).__qualname__} at {place}, "
            "which ckptkeeper cannot store without pickle; keep hyper-parameters, callback and module state to "
            "tensors, numbers, strings, lists, tuples and dicts (or convert it in on_save_checkpoint)"
        )

    doc = {}
    for key, value in checkpoint.items():
        if not isinstance(key, str):
            raise ConfigurationError(f"the Lightning checkpoint has a top-level key {key!r}; only strings are stored")
        if key == _MODEL_KEY and isinstance(value, Mapping):
            doc[key] = {str(k): enc(v, [key, str(k)], True) for k, v in value.items()}
        else:
            doc[key] = enc(value, [key], False)
    return {"model": model, "lightning": others}, doc


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def _markers(doc: Any) -> Iterator[dict[str, Any]]:
    if isinstance(doc, dict):
        if _TENSOR in doc:
            yield doc
            return
        for v in doc.values():
            yield from _markers(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _markers(v)


def template_for(doc: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors shaped like those ``doc`` refers to: what the engine loads into."""
    tree: dict[str, dict[str, torch.Tensor]] = {"model": {}, "lightning": {}}
    for m in _markers(doc):
        group, key = m[_TENSOR]
        if group not in tree or not isinstance(key, str):
            raise ValueError(f"bad tensor reference {m[_TENSOR]!r}")
        shape = m["shape"]
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise ValueError(f"bad tensor shape {shape!r}")
        tree[group][key] = torch.empty(shape, dtype=_dtype(m["dtype"]), device="cpu")  # as the CPU reader fills it
    return tree


def decode_checkpoint(doc: Mapping[str, Any], tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """The inverse of :func:`encode_checkpoint`: Lightning's dict, with ``tensors`` put back in place."""

    def dec(value: Any) -> Any:
        if isinstance(value, list):
            return [dec(v) for v in value]
        if isinstance(value, dict):
            if _TENSOR in value:
                group, key = value[_TENSOR]
                return tensors[group][key]
            if _TUPLE in value:
                return tuple(dec(v) for v in value[_TUPLE])
            if _ITEMS in value:
                return {_hashable(dec(k)): dec(v) for k, v in value[_ITEMS]}
            return {k: dec(v) for k, v in value.items()}
        return value

    return {k: dec(v) for k, v in doc.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, list):  # cannot happen for keys encode_checkpoint wrote (tuples stay tuples)
        raise ValueError("a dict key decoded to a list")
    return key


# ---------------------------------------------------------------------- the state the manager saves


class _LightningState(TrainingState):
    """Lightning's checkpoint dict as the manager's state: tensors through the engine, the rest as JSON.

    The manager asks for the JSON trainer state (``json_state``) before it captures the tensors of
    the same save, so the dict is dumped once, when the JSON is asked for, and its tensors are
    handed over at :meth:`capture`. On load, the JSON (read and checksum-checked first) tells the
    shapes to load into.
    """

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        super().__init__(module)
        self.trainer = trainer
        self._pending: dict[str, Any] | None = None
        self._template: dict[str, dict[str, torch.Tensor]] | None = None
        self._loaded_tensors: Mapping[str, Any] | None = None
        self.loaded: dict[str, Any] | None = None

    # JSON side (json_state={"lightning": <this>.json})
    def dump(self) -> dict[str, Any]:
        checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        tensors, doc = encode_checkpoint(checkpoint)
        self._pending = tensors
        return {"format": _FORMAT, "checkpoint": doc}

    def apply(self, state: dict[str, Any]) -> None:
        if state.get("format") != _FORMAT or not isinstance(state.get("checkpoint"), dict):
            raise CheckpointError("the checkpoint's Lightning state has an unknown format")
        if self._loaded_tensors is None:
            raise CheckpointError("the checkpoint's Lightning state came without its tensors")
        self.loaded = decode_checkpoint(state["checkpoint"], self._loaded_tensors)
        self._loaded_tensors = None

    # tensor side (the engine)
    def capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self._template is not None:
            return self._template, {}
        if self._pending is None:
            raise CheckpointSaveError(
                "ckptkeeper.lightning: the manager captured tensors without first asking for the trainer state; "
                "this version of CheckpointManager is not supported by the Lightning adapter"
            )
        tensors, self._pending = self._pending, None
        return tensors, {}

    def restore(self, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        if self._template is not None:
            self._loaded_tensors = tensors

    def prepare_load(self, train_state: Mapping[str, Any]) -> None:
        ours = train_state.get("callbacks", {}).get(_JSON_NAME)
        if not isinstance(ours, dict) or not isinstance(ours.get("checkpoint"), dict):
            raise ValueError("it holds no Lightning state (was it written by another trainer?)")
        self._template = template_for(ours["checkpoint"])

    def end_load(self) -> None:
        self._template = None


class _JsonPart:
    """The JSON half of :class:`_LightningState`, in the shape ``json_state`` wants."""

    def __init__(self, state: _LightningState) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state.dump()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state.apply(state_dict)


class _LightningCheckpointer(Checkpointer):
    """The engine, told the tensor shapes of a Lightning checkpoint before it loads one.

    The checkpointer's ``check_train_state`` hook sees the checksum-checked trainer state before
    any tensor is read; that is where the shapes come from (a Lightning dict has optimizer state
    that the live optimizer may not have yet).
    """

    def load(
        self,
        path: str,
        state: TrainingState,
        check_train_state: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        if not isinstance(state, _LightningState):
            return super().load(path, state, check_train_state)
        lstate = state

        def check(raw: dict[str, Any]) -> None:
            if check_train_state is not None:
                check_train_state(raw)
            lstate.prepare_load(raw)

        try:
            return super().load(path, state, check)
        except CheckpointMismatchError as exc:
            # The template comes from the checkpoint's own trainer state: a tensor it names that its
            # data files lack (or shape differently) is a damaged checkpoint, not a model change.
            raise CorruptCheckpointError(
                f"checkpoint {path} is inconsistent: its Lightning state and its tensors disagree ({exc}); "
                "load an earlier checkpoint (resume does this automatically) or restore it from a copy"
            ) from None
        finally:
            lstate.end_load()


# ---------------------------------------------------------------------- data position


class ResumableLoader:
    """A sized data loader made resumable: Lightning saves and restores its position exactly.

    Wrap the training loader (``return ResumableLoader(DataLoader(...))`` in ``train_dataloader``).
    It yields the loader's batches unchanged and draws the same random numbers; its
    ``state_dict()`` is the RNG state the current epoch's shuffle was drawn from and the batches
    consumed, and after ``load_state_dict`` the next epoch replays that shuffle, skips the consumed
    batches and puts the RNG streams back as they were. Other attributes (``sampler``,
    ``dataset``, ...) are the loader's. A loader that has ``state_dict`` itself (torchdata's
    ``StatefulDataLoader``) needs no wrapper.
    """

    def __init__(self, loader: Any) -> None:
        try:
            len(loader)
        except TypeError:
            raise ConfigurationError(
                "ResumableLoader needs a loader with a length (a map-style dataset); for an iterable dataset use "
                "a loader with its own state_dict()/load_state_dict(), such as torchdata's StatefulDataLoader"
            ) from None
        self.loader = loader
        self._epoch_rng: dict[str, Any] | None = None
        self._consumed = 0
        self._resume: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy/unpickling): do not recurse
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        # A generator: nothing runs before the first batch is asked for, so the epoch's random
        # draws (shuffle seed, worker seed) happen when the plain loader's would, in the same order.
        resume, self._resume = self._resume, None
        skip = 0
        if resume is not None and resume.get("consumed") and resume.get("epoch_rng") is not None:
            here = rng_state()
            self._epoch_rng = resume["epoch_rng"]
            set_rng_state(self._epoch_rng)
            it = iter(self.loader)
            for _ in range(int(resume["consumed"])):
                try:
                    next(it)
                except StopIteration:
                    break
                skip += 1
            set_rng_state(here)
        else:
            self._epoch_rng = rng_state()
            it = iter(self.loader)
        self._consumed = skip
        for batch in it:
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The position: the current epoch's starting RNG state and batches consumed (JSON)."""
        if self._consumed >= len(self.loader):  # the epoch is done: the next one starts fresh
            return {"epoch_rng": None, "consumed": 0}
        return {"epoch_rng": self._epoch_rng, "consumed": self._consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a position :meth:`state_dict` returned, at the next ``iter()``."""
        consumed = state_dict.get("consumed", 0)
        if type(consumed) is not int or consumed < 0:
            raise CheckpointError(f"ResumableLoader: bad position {state_dict!r}")
        self._resume = dict(state_dict)


# ---------------------------------------------------------------------- the callback


_POLICY_FIELDS = {f.name for f in dataclasses.fields(CheckpointPolicyConfig)}


class CkptkeeperCallback(pl.Callback):
    """Checkpoints a ``lightning.Trainer`` run with ckptkeeper, and resumes it from ``save_folder``.

    Args:
        save_folder: where checkpoints go (path, ``s3://`` or ``gs://`` URL); ``fit`` resumes from it.
        config: a :class:`~ckptkeeper.CheckpointPolicyConfig`; or pass its fields as keywords
            (``save_interval=1000, ephemeral_save_interval=100, ...``), not both.
        start_fresh_if_unloadable: train from scratch when the folder holds checkpoints and none loads
            (default: raise :class:`~ckptkeeper.CorruptCheckpointError`).
        take_lease: hold the folder's writer lease during ``fit``.
        checkpointer_options: keyword arguments of :class:`~ckptkeeper.Checkpointer` (threads, spool,
            staging budget).

    Steps are Lightning's ``trainer.global_step`` (optimizer steps). The last step is saved when
    training ends, unless it was just saved. :attr:`manager` is the run's
    :class:`~ckptkeeper.CheckpointManager` (``loaded_from``, ``history``) during and after ``fit``.
    """

    def __init__(
        self,
        save_folder: str,
        *,
        config: CheckpointPolicyConfig | None = None,
        start_fresh_if_unloadable: bool = False,
        take_lease: bool = True,
        checkpointer_options: Mapping[str, Any] | None = None,
        **policy: Any,
    ) -> None:
        if not isinstance(save_folder, str) or not save_folder:
            raise ConfigurationError("CkptkeeperCallback: 'save_folder' must be a path or URL")
        unknown = set(policy) - _POLICY_FIELDS
        if unknown:
            raise ConfigurationError(
                f"CkptkeeperCallback got unknown settings {sorted(unknown)}; "
                f"the policy settings are {sorted(_POLICY_FIELDS)}"
            )
        if config is not None and policy:
            raise ConfigurationError("CkptkeeperCallback: pass either 'config' or policy settings, not both")
        if config is None:
            if "fixed_steps" in policy and policy["fixed_steps"] is not None:
                policy["fixed_steps"] = tuple(policy["fixed_steps"])
            config = CheckpointPolicyConfig(**policy)
        if not isinstance(config, CheckpointPolicyConfig):
            raise ConfigurationError(f"'config' must be a CheckpointPolicyConfig, got {type(config).__name__}")
        self.save_folder = save_folder
        self.config = config
        self.start_fresh_if_unloadable = start_fresh_if_unloadable
        self.take_lease = take_lease
        self.checkpointer_options = dict(checkpointer_options or {})
        self.manager: CheckpointManager | None = None
        self._state: _LightningState | None = None
        self._last_step = -1

    @property
    def state_key(self) -> str:
        return f"CkptkeeperCallback[{self.save_folder}]"

    # ------------------------------------------------------------------ resume

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise ConfigurationError(
                "ckptkeeper.lightning supports single-device and DDP strategies, not "
                f"{type(trainer.strategy).__name__} (FSDP and DeepSpeed shard the checkpoint dict)"
            )
        self._close(final_save=False)  # a previous fit() of this callback
        self._state = _LightningState(trainer, pl_module)
        self.manager = CheckpointManager(
            self.save_folder,
            state=self._state,
            json_state={_JSON_NAME: _JsonPart(self._state)},
            config=self.config,
            checkpointer=_LightningCheckpointer(**self.checkpointer_options),
            start_fresh_if_unloadable=self.start_fresh_if_unloadable,
            take_lease=self.take_lease,
        )
        self._last_step = -1
        # Not begin(): a pre-train save needs the optimizers, which do not exist yet.
        self.manager.restore(begin=False)
        if self.manager.checkpoint_loaded:
            if self._state.loaded is None:
                raise CheckpointError(f"checkpoint {self.manager.loaded_from} holds no Lightning state")
            log.info("resuming from %s (step %d)", self.manager.loaded_from, self.manager.step)
            # Lightning applies this dict as it would one read from ckpt_path (see module docstring).
            trainer._checkpoint_connector._loaded_checkpoint = self._state.loaded
            self._state.loaded = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mgr = self._manager()
        if trainer.ckpt_path:
            if mgr.checkpoint_loaded:
                raise ConfigurationError(
                    f"fit(ckpt_path={trainer.ckpt_path!r}) was given but save folder {self.save_folder} already holds "
                    f"checkpoints (loaded {mgr.loaded_from}); drop ckpt_path to resume from the folder, "
                    "or use a new folder"
                )
            mgr.step = trainer.global_step  # started from the user's file: count on from there
        if trainer.global_step != mgr.step:
            raise CheckpointError(
                f"Lightning is at global step {trainer.global_step} but the checkpoint was of step {mgr.step}"
            )
        self._last_step = trainer.global_step
        mgr.begin()

    # ------------------------------------------------------------------ saving

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:  # accumulating gradients: no optimizer step yet
            return
        self._last_step = step
        mgr = self._manager()
        metrics = _metrics(trainer)
        if _is_last_step(trainer):
            # Saved here rather than at on_train_end: a dict dumped at a batch end is one Lightning
            # knows how to restart from.
            mgr.save(step, metrics=metrics)
        else:
            mgr.save_if_due(step, metrics=metrics)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(final_save=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(final_save=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close(final_save=False)

    # ------------------------------------------------------------------ helpers

    def _manager(self) -> CheckpointManager:
        if self.manager is None:
            raise ConfigurationError("CkptkeeperCallback was not set up; it works inside trainer.fit()")
        return self.manager

    def _close(self, final_save: bool) -> None:
        if self.manager is not None:
            self.manager.close(final_save=final_save)  # a no-op once closed


def _is_last_step(trainer: pl.Trainer) -> bool:
    if trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    return bool(
        max_epochs not in (None, -1) and trainer.is_last_batch and trainer.current_epoch + 1 >= (max_epochs or 0)
    )


def _metrics(trainer: pl.Trainer) -> dict[str, float] | None:
    out: dict[str, float] = {}
    for name, value in trainer.callback_metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            v = float(value)
            if math.isfinite(v):
                out[name] = v
    return out or None
