"""Loads into tensors the fast readers cannot read into in place (memory that is not one run of the
tensor's bytes on the CPU: a transposed parameter here, a GPU tensor on a GPU machine) go through
the fast readers anyway: read and checked in host memory, then copied in. A failure anywhere leaves
those tensors as they were, as for any other load."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptkeeper import Checkpointer, TrainingState, state_digest
from ckptkeeper.errors import CheckpointMismatchError, CorruptCheckpointError

from ..helpers import Picky, load_readers


def _transposed(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    # A parameter whose memory holds its transpose: non-contiguous, as after p.data = w.t(); over 1 MiB,
    # so that the readers back it up by byte ranges rather than with a run of small tensors.
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(600, 520), nn.Linear(520, 8))
    with torch.no_grad():
        model[0].weight.data = model[0].weight.detach().t().contiguous().t()
    assert not model[0].weight.is_contiguous()
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _stepped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _transposed(seed)
    model(torch.randn(3, 600)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def test_a_non_contiguous_parameter_loads_through_the_fast_reader_in_its_own_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = _stepped(0)
    want = state_digest(model, opt)
    path = Checkpointer().save(str(tmp_path), 1, TrainingState(model, opt)).path
    back, back_opt = _stepped(1)
    weight, strides, at = back[0].weight, back[0].weight.stride(), back[0].weight.data_ptr()
    caplog.set_level(logging.INFO, logger="ckptkeeper.metrics")
    Checkpointer().load(path, TrainingState(back, back_opt))
    assert load_readers(caplog.records) == ["fast"]  # was DCP's reader, for one non-contiguous parameter
    assert state_digest(back, back_opt) == want
    # Loaded into the parameter itself: same object, same memory, same layout.
    assert back[0].weight is weight and weight.stride() == strides and weight.data_ptr() == at
    assert torch.equal(weight, model[0].weight)


def test_a_damaged_checkpoint_leaves_a_non_contiguous_parameter_as_it_was(tmp_path: Path) -> None:
    model, opt = _stepped(0)
    path = Checkpointer().save(str(tmp_path), 1, TrainingState(model, opt)).path
    data = Path(path) / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # in the middle of the tensors' bytes
    data.write_bytes(bytes(raw))
    back, back_opt = _stepped(1)
    before = state_digest(back, back_opt)
    with pytest.raises(CorruptCheckpointError):
        Checkpointer().load(path, TrainingState(back, back_opt))
    assert state_digest(back, back_opt) == before


def test_a_load_that_fails_after_the_copies_went_in_puts_a_non_contiguous_parameter_back(tmp_path: Path) -> None:
    model, opt = _stepped(0)
    path = Checkpointer().save(str(tmp_path), 1, TrainingState(model, opt, extra={"p": Picky("a")})).path
    back, back_opt = _stepped(1)
    before = state_digest(back, back_opt)
    weight = back[0].weight.detach().clone()
    with pytest.raises(CheckpointMismatchError, match="KeyError"):
        Checkpointer().load(path, TrainingState(back, back_opt, extra={"p": Picky("b")}))
    assert torch.equal(back[0].weight, weight) and not back[0].weight.is_contiguous()
    assert state_digest(back, back_opt) == before


def _buffer_module(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Module()
    m.register_buffer("w", torch.randn(300, 200).t().contiguous().t())
    return m


def test_a_non_contiguous_inference_tensor_is_still_loaded_by_dcps_reader(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by an outside attack: an inference tensor takes no copy_ outside inference mode, so the
    # host copy could not go in and the load failed (as a mismatch); DCP's reader fills it.
    saved = _buffer_module(0)
    path = Checkpointer().save(str(tmp_path), 1, TrainingState(saved)).path
    with torch.inference_mode():
        into = _buffer_module(1)
    caplog.set_level(logging.INFO, logger="ckptkeeper.metrics")
    Checkpointer().load(path, TrainingState(into))
    assert load_readers(caplog.records) == ["dcp"]
    assert torch.equal(into.w, saved.w)


def test_host_copies_that_would_exceed_the_staging_budget_are_not_made(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by an outside attack: the host copies (a transposed 600x520 weight and its two AdamW
    # slots, made like it: 3.6 MiB) were made whatever the budget; over it, DCP's reader reads.
    model, opt = _stepped(0)
    want = state_digest(model, opt)
    path = Checkpointer().save(str(tmp_path), 1, TrainingState(model, opt)).path
    caplog.set_level(logging.INFO, logger="ckptkeeper.metrics")
    for budget, reader in ((1 << 20, "dcp"), (64 << 20, "fast")):
        caplog.clear()
        back, back_opt = _stepped(1)
        Checkpointer(staging_budget_bytes=budget).load(path, TrainingState(back, back_opt))
        assert load_readers(caplog.records) == [reader], budget
        assert state_digest(back, back_opt) == want
