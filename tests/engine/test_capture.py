"""What a save captures: the same names, tensors and values as ``capture()``, whichever way it was
taken (a save takes parameters as the model holds them, without detaching each)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptkeeper import Checkpointer, TrainingState
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
