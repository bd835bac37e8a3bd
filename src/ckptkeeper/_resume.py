"""What a resumed run needs besides tensors: RNG streams, the data position, and their checks.

Everything here is stored as JSON in the checkpoint's trainer state (never a pickle): the RNG
states of python, numpy, torch (and CUDA when in use), and where the data loader was (epoch,
batches consumed in it, and the RNG state the epoch began with, so its shuffle can be replayed).
Used by :class:`~ckptkeeper.CheckpointManager`; kept apart so the manager stays about policy.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .engine import Stateful
from .errors import ConfigurationError

__all__ = ["DataPosition", "check_train_state", "from_olmo_core", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """The global RNG streams as JSON. Reading them consumes no randomness."""
    state: dict[str, Any] = {
        "python": _py_rng_to_json(random.getstate()),
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:  # numpy is optional for the library
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def _py_rng_to_json(state: Any) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


def _numpy_state() -> Any:
    try:
        import numpy as np
    except ImportError:
        return None
    return np.random.get_state()


def check_train_state(ts: Mapping[str, Any], json_names: Iterable[str] = ()) -> None:
    """Raise ValueError when a trainer state (already checksum-verified) could not be applied.

    Runs before any tensor is loaded, so a state that passed its checksum but cannot be used
    never leaves a half-loaded model behind. RNG states are tried on the real generators and put
    back.
    """
    step = ts["global_step"]
    if type(step) is not int or step < 0:
        raise ValueError(f"global_step is {step!r}")
    data = ts.get("data", {})
    if not isinstance(data, Mapping):
        raise ValueError("data is not a table")
    for key in ("epoch", "batch_in_epoch"):
        if type(data.get(key, 0)) is not int or data.get(key, 0) < 0:
            raise ValueError(f"data.{key} is {data.get(key)!r}")
    saved = (random.getstate(), torch.get_rng_state())
    np_saved = _numpy_state()
    try:
        set_rng_state(ts["rng"])
        if data.get("epoch_rng") is not None:
            set_rng_state(data["epoch_rng"])
    finally:
        random.setstate(saved[0])
        torch.set_rng_state(saved[1])
        if np_saved is not None:
            import numpy as np

            np.random.set_state(np_saved)
    objects = ts.get("callbacks", {})
    if not isinstance(objects, Mapping):
        raise ValueError("callbacks is not a table")
    for name in json_names:
        if name in objects and not isinstance(objects[name], Mapping):
            raise ValueError(f"the state of {name!r} is not a table")


def from_olmo_core(ts: Mapping[str, Any]) -> Mapping[str, Any]:
    """OLMo-core's trainer state in ckptkeeper's shape (unchanged when it is already ours).

    OLMo-core keeps each RNG state under ``{"version", "state"}`` with torch's as a list of byte
    values; its data-loader position has no equivalent here, so a run continued from an OLMo-core
    checkpoint starts a new pass over its data loader.
    """
    rng = ts.get("rng")
    if not (isinstance(rng, Mapping) and isinstance(rng.get("python"), Mapping)):
        return ts
    ours: dict[str, Any] = {"python": rng["python"]["state"]}
    torch_state = rng.get("torch")
    if isinstance(torch_state, Mapping):
        ours["torch"] = base64.b64encode(bytes(torch_state["state"])).decode()
    numpy_state = rng.get("numpy")
    if isinstance(numpy_state, Mapping):
        ours["numpy"] = numpy_state["state"]
    return {"global_step": ts["global_step"], "rng": ours, "data": {}, "callbacks": {}}


@dataclass
class DataPosition:
    """Where iteration over a data loader stands, and how to get back there after a restart.

    A plain ``DataLoader`` has no state of its own: its shuffle is drawn from the global torch RNG
    when an epoch's iterator starts. So the position is the epoch, the batches consumed in it, and
    the RNG state the epoch started with; resuming replays that epoch's start from that state,
    skips the consumed batches, then puts back the checkpoint's RNG state. A loader with
    ``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader``) is asked instead.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    epoch_rng: dict[str, Any] | None = None
    resume_rng: dict[str, Any] | None = None
    loader_state: dict[str, Any] | None = None

    def to_json(self, loader: Any) -> dict[str, Any]:
        """The position as stored in the trainer state."""
        out: dict[str, Any] = {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "epoch_rng": self.epoch_rng}
        if loader is not None and isinstance(loader, Stateful):
            out["loader"] = loader.state_dict()
        return out

    def apply(self, data: Mapping[str, Any], rng: dict[str, Any]) -> None:
        """Take a stored position; the next :meth:`batches` call continues from it."""
        self.epoch = int(data.get("epoch", 0))
        self.batch_in_epoch = int(data.get("batch_in_epoch", 0))
        self.epoch_rng = data.get("epoch_rng")
        self.loader_state = data.get("loader")
        self.resume_rng = rng

    def batches(
        self, loader: Iterable[Any], epochs: int | None = None, done: Callable[[], bool] | None = None
    ) -> Iterator[Any]:
        """Batches from the stored position on, epoch after epoch (``epochs``: stop after that many in all).

        ``done`` is asked before each batch is fetched: once it says so, iteration ends without
        drawing another batch (which would move the data position and the RNG streams).
        """
        while (epochs is None or self.epoch < epochs) and not (done is not None and done()):
            it = self._open(loader)
            got = 0
            while not (done is not None and done()):
                try:
                    batch = next(it)
                except StopIteration:
                    break
                got += 1
                self.batch_in_epoch += 1
                yield batch
            else:
                return
            if got == 0 and self.batch_in_epoch == 0:
                raise ConfigurationError("the data loader yields no batches")
            self.epoch += 1
            self.batch_in_epoch = 0
            self.epoch_rng = None

    def _open(self, loader: Iterable[Any]) -> Iterator[Any]:
        resume, self.resume_rng = self.resume_rng, None
        if self.loader_state is not None and isinstance(loader, Stateful):
            state, self.loader_state = self.loader_state, None
            loader.load_state_dict(state)
            return iter(loader)
        if resume is None or (self.batch_in_epoch == 0 and self.epoch_rng is None):
            if self.epoch_rng is None:
                self.epoch_rng = rng_state()
            return iter(loader)
        # Replay the epoch from the RNG state it began with, skip what was consumed, then put back
        # the checkpoint's RNG state: the rest of the epoch matches the original run.
        if self.epoch_rng is not None:
            set_rng_state(self.epoch_rng)
        it = iter(loader)
        for _ in range(self.batch_in_epoch):
            try:
                next(it)
            except StopIteration:
                break
        set_rng_state(resume)
        return it
