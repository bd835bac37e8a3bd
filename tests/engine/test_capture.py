"""What a save captures: the same names, tensors and values as ``capture()``, whichever way it was
taken (a save takes parameters as the model holds them, without detaching each)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptkeeper import Checkpointer, CorruptCheckpointError, TrainingState
from ckptkeeper.engine.state import (
    _canonical_fqn,
    _names_of,
    _param_fqns,
    capture_to_write,
    flatten_tensors,
    state_digest,
)
from tests.helpers import stepped_linear


class _Odd(nn.Module):
    """Shared modules, a tied weight, a None child and a None parameter: named_parameters()'s edge cases."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Sequential(nn.Linear(2, 2), nn.Identity(), self.a)
        self.c = self.b
        self.d = nn.ModuleDict({"x": nn.Linear(1, 1), "y": self.a})
        self.p = nn.Parameter(torch.zeros(1))
        self.register_parameter("none", None)
        self.register_module("gone", None)
        self.tied = nn.Linear(2, 2)
        self.tied.weight = self.a.weight


def test_parameter_names_are_named_parameters_own_in_its_order() -> None:
    m = _Odd()
    want = [(id(p), _canonical_fqn(m, n, _names_of(m))) for n, p in m.named_parameters()]
    assert list(_param_fqns(m).items()) == want
    assert [n for _, n in want] == [
        "p",
        "a.weight",
        "a.bias",
        "b.0.weight",
        "b.0.bias",
        "d.x.weight",
        "d.x.bias",
        "tied.bias",
    ]


def test_a_saves_capture_holds_the_same_tensors_as_capture() -> None:
    state = stepped_linear(0, 4, 3)
    public, meta = state.capture()
    written, written_meta = capture_to_write(state)
    assert written_meta == meta
    got = dict(flatten_tensors(written))
    assert list(got) == [k for k, _ in flatten_tensors(public)]
    for key, t in flatten_tensors(public):
        assert torch.equal(got[key], t) and got[key].data_ptr() == t.data_ptr(), key
        assert not t.requires_grad  # capture() stays detached for its callers
    assert got["model.weight"] is state.model.weight  # the save's own: not rewrapped


def test_a_replaced_capture_is_what_a_save_writes(tmp_path: Path) -> None:
    class Doubled(TrainingState):
        def capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
            tensors, meta = super().capture()
            tensors["model"] = {k: v * 2 for k, v in tensors["model"].items()}
            return tensors, meta

    src = stepped_linear(1, 4, 3)
    doubled = Doubled(src.model, src.optimizer)
    assert torch.equal(capture_to_write(doubled)[0]["model"]["weight"], src.model.weight.detach() * 2)
    saved = Checkpointer().save(str(tmp_path), 1, doubled)
    dst = stepped_linear(2, 4, 3)
    Checkpointer().load(saved.path, dst)
    assert torch.equal(dst.model.weight, src.model.weight * 2)


def test_dcps_writer_saves_parameters_as_the_model_holds_them(tmp_path: Path) -> None:
    # DCP's writer (writer="dcp", and what the fast writers do not take) gets the save's capture.
    src = stepped_linear(3, 5, 2)
    assert src.model.weight.requires_grad
    saved = Checkpointer(writer="dcp").save(str(tmp_path), 1, src)
    dst = stepped_linear(4, 5, 2)
    Checkpointer().load(saved.path, dst)
    assert state_digest(dst.model, dst.optimizer) == state_digest(src.model, src.optimizer)
    assert src.model.weight.requires_grad and src.model.weight.grad is not None


class _Tagged(nn.Parameter):
    """A parameter subclass (bitsandbytes' Params4bit and Int8Params are such)."""


@pytest.mark.parametrize("writer", ["auto", "dcp"])
def test_a_parameter_subclass_is_saved_as_a_plain_tensor(tmp_path: Path, writer: str) -> None:
    torch.manual_seed(5)
    model = nn.Linear(4, 3)
    model.weight = _Tagged(model.weight.detach().clone())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 4)).sum().backward()
    opt.step()
    saved = Checkpointer(writer=writer).save(str(tmp_path), 1, TrainingState(model, opt))
    dst = stepped_linear(6, 4, 3)
    Checkpointer().load(saved.path, dst)
    assert torch.equal(dst.model.weight, model.weight)
    assert state_digest(dst.model, dst.optimizer) == state_digest(model, opt)


def test_dcps_metadata_records_what_stock_dcp_records(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    saved = Checkpointer(writer="dcp").save(str(tmp_path), 1, stepped_linear(7, 4, 3))
    metadata = FileSystemReader(str(Path(saved.path) / "model_and_optim")).read_metadata()
    flags = {k: v.properties.requires_grad for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    assert flags == {"model.weight": False, "model.bias": False}  # get_model_state_dict's (detached)


def test_a_capture_replaced_on_the_object_or_the_class_is_what_a_save_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = stepped_linear(8, 4, 3)
    own = src.capture

    def doubled() -> tuple[dict[str, Any], dict[str, Any]]:
        tensors, meta = own()
        tensors["model"] = {k: v * 2 for k, v in tensors["model"].items()}
        return tensors, meta

    src.capture = doubled  # type: ignore[method-assign]
    dst = stepped_linear(9, 4, 3)
    Checkpointer().load(Checkpointer().save(str(tmp_path / "a"), 1, src).path, dst)
    assert torch.equal(dst.model.weight, src.model.weight * 2)

    plain = stepped_linear(10, 4, 3)
    monkeypatch.setattr(TrainingState, "capture", lambda self: doubled())
    Checkpointer().load(Checkpointer().save(str(tmp_path / "b"), 1, plain).path, dst)
    assert torch.equal(dst.model.weight, src.model.weight * 2)


def test_states_that_are_not_a_training_state_are_asked_for_their_capture(tmp_path: Path) -> None:
    class Proxy:
        def __init__(self, inner: TrainingState) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    class OwnFull(TrainingState):
        def _full(self) -> dict[str, Any]:  # type: ignore[override]  # an older private signature
            return {"model": {"w": torch.arange(3.0)}, "optim": {}, "extra": {}}

    src = stepped_linear(11, 4, 3)
    states: list[Any] = [
        types.SimpleNamespace(capture=lambda: ({"model": {"w": torch.arange(6.0)}}, {})),
        Proxy(src),
        OwnFull(src.model),
    ]
    for i, state in enumerate(states):
        saved = Checkpointer().save(str(tmp_path / str(i)), 1, state)
        assert Checkpointer().verify(saved.path).step == 1


def _with_wrapper_parameter(seed: int) -> nn.Module:
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    torch.manual_seed(seed)
    model = nn.Linear(4, 4)
    a = torch.randn(4, 4)
    model.extra = nn.Parameter(two_tensor.TwoTensor(a, a * 2))
    return model


def test_a_wrapper_subclass_held_as_a_parameter_is_refused_with_its_name(tmp_path: Path) -> None:
    # Its Parameter flag must not make it pass for a plain tensor (the writer read no memory of its own).
    from ckptkeeper import CheckpointSaveError

    with pytest.raises(CheckpointSaveError, match=r"model\.extra.*tensor subclass"):
        Checkpointer().save(str(tmp_path), 1, TrainingState(_with_wrapper_parameter(0)))
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_a_wrapper_subclass_parameter_is_loaded_through_dcp(tmp_path: Path) -> None:
    src = _with_wrapper_parameter(1)
    plain = nn.Linear(4, 4)
    plain.load_state_dict(src.state_dict(), strict=False)
    plain.extra = nn.Parameter(src.extra.a.detach().clone())  # what a plain model would have saved
    saved = Checkpointer().save(str(tmp_path), 1, TrainingState(plain))
    dst = _with_wrapper_parameter(2)
    # Without room for a backup, as with it: the subclass goes to DCP's reader, not a raw read.
    Checkpointer(staging_budget_bytes=1).load(saved.path, TrainingState(dst))
    assert torch.equal(dst.weight, plain.weight) and torch.equal(dst.extra.a, plain.extra)


def test_a_model_that_names_its_own_parameters_is_asked(tmp_path: Path) -> None:
    class Held(nn.Module):
        """Reports a module it holds outside ``_modules`` through its own named_parameters()."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            object.__setattr__(self, "side", nn.Linear(4, 4))

        def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            for name, p in self.side.named_parameters():
                yield f"{prefix}.side.{name}" if prefix else f"side.{name}", p

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.side(self.lin(x))

    torch.manual_seed(3)
    model = Held()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert sorted(_param_fqns(model).values()) == ["lin.bias", "lin.weight", "side.bias", "side.weight"]
    saved = Checkpointer().save(str(tmp_path), 1, TrainingState(model, opt))
    before = state_digest(model, opt)
    Checkpointer().load(saved.path, TrainingState(model, opt))
    assert state_digest(model, opt) == before


def test_an_interrupted_load_puts_every_tensor_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptkeeper.engine import fastio

    src = stepped_linear(12, 64, 32)
    saved = Checkpointer().save(str(tmp_path), 1, src)
    dst = stepped_linear(13, 64, 32)
    before = state_digest(dst.model, dst.optimizer)

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt  # Ctrl-C once the run's bytes are in the tensors, before their check

    monkeypatch.setattr(fastio, "check_segments", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Checkpointer().load(saved.path, dst)
    assert state_digest(dst.model, dst.optimizer) == before


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, SystemExit])
def test_an_interruption_inside_dcps_reader_is_raised_as_itself_with_everything_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interruption: type[BaseException]
) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    saved = Checkpointer(writer="dcp").save(str(tmp_path), 1, stepped_linear(14, 8, 4))  # read by DCP's reader
    dst = stepped_linear(15, 8, 4)
    before = state_digest(dst.model, dst.optimizer)
    committed: list[object] = []
    own = DefaultLoadPlanner.commit_tensor

    def interrupted(self: Any, req: Any, tensor: Any) -> None:
        own(self, req, tensor)  # one tensor written, then the interruption
        committed.append(req)
        raise interruption()

    monkeypatch.setattr(DefaultLoadPlanner, "commit_tensor", interrupted)
    with pytest.raises(interruption):  # not a CheckpointMismatchError caused by it (DCP wraps it)
        Checkpointer().load(saved.path, dst)
    assert committed and state_digest(dst.model, dst.optimizer) == before


def test_an_interruption_inside_dcps_writer_is_raised_as_itself_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def interrupted(self: Any, plan: Any, planner: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Checkpointer(writer="dcp").save(str(tmp_path), 1, stepped_linear(16, 8, 4))
    assert list(tmp_path.iterdir()) == []


def test_a_wrapper_subclass_destination_is_backed_up_and_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    src = _with_wrapper_parameter(17)
    plain = nn.Linear(4, 4)
    plain.load_state_dict(src.state_dict(), strict=False)
    plain.extra = nn.Parameter(src.extra.a.detach().clone())
    saved = Checkpointer().save(str(tmp_path), 1, TrainingState(plain))
    dst = _with_wrapper_parameter(18)
    before = [t.detach().clone() for t in (dst.weight, dst.bias, dst.extra.a, dst.extra.b)]
    own = DefaultLoadPlanner.commit_tensor
    calls: list[object] = []

    def failing(self: Any, req: Any, tensor: Any) -> None:
        own(self, req, tensor)
        calls.append(req)
        if len(calls) == 3:
            raise OSError("the disk went away")

    monkeypatch.setattr(DefaultLoadPlanner, "commit_tensor", failing)
    with pytest.raises(CorruptCheckpointError):
        Checkpointer().load(saved.path, TrainingState(dst))  # default settings: with a backup
    after = [dst.weight, dst.bias, dst.extra.a, dst.extra.b]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
