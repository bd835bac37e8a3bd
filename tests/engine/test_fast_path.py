"""The fast single-process writer and reader: stock DCP format, budget rules, and the GPU path."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ckptkeeper import Checkpointer, ConfigurationError, CorruptCheckpointError, TrainingState, state_digest
from ckptkeeper.engine import discovery
from ckptkeeper.engine.fastio import can_use_fast_path, write_fast


def _state(seed: int = 0) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return TrainingState(model, opt)


def test_fast_metadata_is_exactly_what_dcp_writes(tmp_path: Path) -> None:
    tensors, _ = _state().capture()
    assert can_use_fast_path(tensors)
    write_fast(str(tmp_path / "fast"), tensors)
    dcp_save(tensors, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    fast = pickle.loads((tmp_path / "fast" / ".metadata").read_bytes())
    ref = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())
    assert fast.state_dict_metadata == ref.state_dict_metadata
    assert fast.planner_data == ref.planner_data
    assert set(fast.storage_data) == set(ref.storage_data)
    assert (tmp_path / "fast" / "__0_0.distcp").stat().st_size == (tmp_path / "dcp" / "__0_0.distcp").stat().st_size


def test_saves_use_the_fast_path_and_record_a_checksummed_layout(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, _state())
    record = ckpt.verify(str(tmp_path / "step1"))
    # The segment table is a checksummed file of the checkpoint, not part of the record.
    assert "layout" not in record.extra and discovery.LAYOUT_FILE in record.files
    segments = discovery.read_layout(str(tmp_path / "step1"), record)["model_and_optim/__0_0.distcp"]
    assert {row[0] for row in segments} == {"head", "data", "tail"}
    # The segments tile the data file exactly: every byte is covered by one checksum.
    spans = sorted((row[2], row[3]) for row in segments)
    pos = 0
    for off, length in spans:
        assert off == pos
        pos += length
    assert pos == record.files["model_and_optim/__0_0.distcp"].bytes


@pytest.mark.parametrize(("save_writer", "load_writer"), [("auto", "dcp"), ("dcp", "auto"), ("dcp", "dcp")])
def test_fast_and_dcp_paths_read_each_other(tmp_path: Path, save_writer: str, load_writer: str) -> None:
    src = _state(0)
    Checkpointer(writer=save_writer).save(str(tmp_path), 2, src)
    dst = _state(1)
    Checkpointer(writer=load_writer).load(str(tmp_path / "step2"), dst)
    assert state_digest(dst.model, dst.optimizer) == state_digest(src.model, src.optimizer)


def test_truncated_data_file_is_caught(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 3, _state())
    data = tmp_path / "step3" / "model_and_optim" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp"):
        ckpt.load(str(tmp_path / "step3"), _state())


def test_over_budget_falls_back_to_a_sync_save(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = Checkpointer(staging_budget_bytes=1024)
    with caplog.at_level(logging.WARNING):
        path, fut = ckpt.save_async(str(tmp_path), 4, _state())
    assert fut.done() and fut.result().step == 4
    assert "saving synchronously instead" in caplog.text
    assert ckpt._stager.nbytes == 0  # nothing was staged
    assert ckpt.dir_is_checkpoint(path)


def test_over_budget_error_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTKEEPER_STAGING_BUDGET", "2048")
    ckpt = Checkpointer(over_budget="error")
    assert ckpt.staging_budget_bytes == 2048
    with pytest.raises(ConfigurationError, match="staging_budget_bytes"):
        ckpt.save_async(str(tmp_path), 5, _state())
    assert not (tmp_path / "step5").exists()


@pytest.mark.parametrize("kwargs", [{"writer": "fast"}, {"over_budget": "maybe"}, {"staging_budget_bytes": -1}])
def test_bad_engine_settings(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Checkpointer(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: pinned staging of GPU tensors")
def test_cuda_tensors_are_staged_in_pinned_memory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 256).cuda()
    state = TrainingState(model)
    ckpt = Checkpointer()
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    path, fut = ckpt.save_async(str(tmp_path), 1, state)
    with torch.no_grad():
        model.weight.add_(1.0)
    result = fut.result()
    assert all(b.is_pinned() for b in ckpt._stager._buffers.values())
    assert result.blocked_s <= result.durable_s
    restored = nn.Linear(256, 256)
    Checkpointer().load(path, TrainingState(restored))
    assert torch.equal(restored.weight, before["weight"])
    ckpt.close()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: staged DTensor shards stay in host memory"
)
def test_staged_cuda_dtensor_shards_stay_in_host_memory() -> None:
    # The async writer sees the staged copy of a CUDA DTensor; rebuilt with from_local() it went
    # back onto the GPU (a device copy per tensor, in the background thread).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from ckptkeeper.engine.staging import Stager

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        live = distribute_tensor(torch.randn(8, 4, device="cuda"), mesh, [Shard(0)])
        staged = Stager().stage_lazily({"w": live})()["w"]
        assert isinstance(staged, DTensor) and staged._local_tensor.device.type == "cpu"
        assert torch.equal(staged._local_tensor, live._local_tensor.cpu())
    finally:
        if own:
            dist.destroy_process_group()


def test_checkpoints_with_the_layout_inline_in_the_record_still_load(tmp_path: Path) -> None:
    # What 0.2 wrote: the segment table inside the commit record, no file of its own.
    import json

    from ckptkeeper.engine.record import CommitRecord
    from ckptkeeper.storage.layout import COMMIT_RECORD

    from ..helpers import forge

    src = _state(0)
    Checkpointer().save(str(tmp_path), 3, src)
    folder = tmp_path / "step3"
    table = json.loads((folder / discovery.LAYOUT_FILE).read_bytes())
    del table["tensors"]  # 0.2's table held the segments only
    rec = CommitRecord.from_json((folder / COMMIT_RECORD).read_bytes(), "x")
    files = {k: v for k, v in rec.files.items() if k != discovery.LAYOUT_FILE}
    (folder / discovery.LAYOUT_FILE).unlink()
    forge(folder, files=files, extra={**rec.extra, "layout": table})
    dst = _state(1)
    Checkpointer().load(str(folder), dst)
    assert state_digest(dst.model, dst.optimizer) == state_digest(src.model, src.optimizer)
    assert Checkpointer().verify(str(folder)).extra["layout"] == table


def test_small_pieces_are_written_together_and_read_back_exactly(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from ckptkeeper.cli.bench_run import _FixedState
    from ckptkeeper.engine.fastio import _CHUNK, _plan_writes, _skeleton

    # Neighbouring small tensors (headers and trailers too) are gathered into one write; a large
    # tensor's data goes alone, in parts, and its trailer starts the next run.
    big = torch.arange(3 << 20, dtype=torch.uint8)  # above _SMALL_PIECE, below _CHUNK: one part
    tensors = [torch.full((3,), 1.0), torch.full((5,), 2.0), big, torch.full((7,), 3.0), torch.zeros(0)]
    plan = _plan_writes(tensors)
    sizes = [len(sk[0]) + t.nbytes + len(sk[1]) for sk, t in zip(plan.skeletons, tensors, strict=True)]
    assert plan.total == sum(sizes)
    heads = [len(sk[0]) for sk in plan.skeletons]
    tails = [len(sk[1]) for sk in plan.skeletons]
    assert [(off, [len(b) for b in bufs]) for off, bufs in plan.jobs] == [
        (0, [heads[0], 12, tails[0], heads[1], 20, tails[1], heads[2]]),
        (sizes[0] + sizes[1] + heads[2], [3 << 20]),
        (sizes[0] + sizes[1] + sizes[2] - tails[2], [tails[2], heads[3], 28, tails[3], heads[4], tails[4]]),
    ]
    # The jobs hold the file's bytes in order: what torch.save writes for each tensor.
    image = b"".join(bytes(b) for _, bufs in plan.jobs for b in bufs)
    assert image == b"".join(_skeleton(t)[0] + t.numpy().tobytes() + _skeleton(t)[1] for t in tensors)
    huge = torch.zeros(_CHUNK + 5, dtype=torch.uint8)
    assert [len(b) for _, bufs in _plan_writes([huge]).jobs for b in bufs][1:3] == [_CHUNK, 5]

    torch.manual_seed(0)
    tree = {"model": {f"t{i}": torch.randn(i % 7 + 1, 3) for i in range(2000)}}
    tree["model"]["big"] = torch.randn(1 << 19)
    Checkpointer().save(str(tmp_path), 1, _FixedState(tree))
    back = {"model": {k: torch.zeros_like(v) for k, v in tree["model"].items()}}
    Checkpointer().load(str(tmp_path / "step1"), _FixedState(back))
    stock = {"model": {k: torch.zeros_like(v) for k, v in tree["model"].items()}}
    dcp_load(stock, storage_reader=FileSystemReader(str(tmp_path / "step1" / "model_and_optim")), no_dist=True)
    for k, v in tree["model"].items():
        assert torch.equal(back["model"][k], v) and torch.equal(stock["model"][k], v), k
    # A flipped byte in one small tensor of a run fails the load and leaves every tensor as it was.
    from ckptkeeper import CorruptCheckpointError
    from ckptkeeper.engine import discovery as disc

    record = Checkpointer().read_record(str(tmp_path / "step1"))
    seg = next(r for r in disc.read_layout(str(tmp_path / "step1"), record)["model_and_optim/__0_0.distcp"]
               if r[0] == "data" and r[1] == "model.t1500")  # fmt: skip
    data_file = tmp_path / "step1" / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data_file.read_bytes())
    raw[seg[2] + 1] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    fresh = {"model": {k: torch.full_like(v, 7.0) for k, v in tree["model"].items()}}
    with pytest.raises(CorruptCheckpointError, match=r"model\.t1500"):
        Checkpointer().load(str(tmp_path / "step1"), _FixedState(fresh))
    assert all(bool((v == 7.0).all()) for v in fresh["model"].values())


class _Tied(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(16, 64)
        self.head = nn.Linear(64, 16, bias=False)
        self.head.weight = self.emb.weight  # tied: two names, one memory
        self.z = nn.Linear(64, 4)


def _flip_data_byte(folder: Path, fqn: str) -> None:
    """Flip a byte inside ``fqn``'s data in the data file (not re-signed: a damaged disk)."""
    import json

    rows = json.loads((folder / discovery.LAYOUT_FILE).read_bytes())["model_and_optim/__0_0.distcp"]
    seg = next(r for r in rows if r[0] == "data" and r[1] == fqn)
    data_file = folder / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data_file.read_bytes())
    raw[seg[2] + seg[3] // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))


def test_a_failed_load_leaves_tied_weights_as_they_were(tmp_path: Path) -> None:
    # Found by an outside attack: the second name of a tied weight was backed up after the first
    # name's load had overwritten their shared memory, and restored last.
    Checkpointer().save(str(tmp_path), 1, TrainingState(_Tied(0)))
    _flip_data_byte(tmp_path / "step1", "model.z.weight")
    model = _Tied(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match=r"model\.z\.weight"):
        Checkpointer().load(str(tmp_path / "step1"), TrainingState(model))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert model.head.weight is model.emb.weight


def test_a_segment_table_listing_another_shape_is_refused(tmp_path: Path) -> None:
    import json

    from ..helpers import forge

    src = nn.Module()
    src.p = nn.Parameter(torch.randn(8, 4))
    Checkpointer().save(str(tmp_path), 1, TrainingState(src))
    folder = tmp_path / "step1"
    table = json.loads((folder / discovery.LAYOUT_FILE).read_bytes())
    table["tensors"]["model.p"][1] = [4, 8]  # same bytes, transposed: only the header knows
    forge(folder, discovery.LAYOUT_FILE, json.dumps(table).encode())
    dst = nn.Module()
    dst.p = nn.Parameter(torch.zeros(4, 8))
    with pytest.raises(CorruptCheckpointError, match="shape or dtype"):
        Checkpointer().load(str(folder), TrainingState(dst))
    assert bool((dst.p == 0).all())


def test_non_contiguous_parameters_and_lazy_views_round_trip_for_us_and_stock_dcp(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from ckptkeeper.cli.bench_run import _FixedState

    base = torch.randn(8, 4)
    tree = {
        "model": {"t": base.t(), "c": torch.randn(3, dtype=torch.complex64).conj(), "n": torch.randn(5)._neg_view()}
    }
    want = {k: v.resolve_conj().resolve_neg().clone() for k, v in tree["model"].items()}
    Checkpointer().save(str(tmp_path), 1, _FixedState(tree))
    # Into a non-contiguous destination (a transposed parameter): DCP's reader takes it.
    back = {"model": {"t": torch.zeros(8, 4).t(), "c": torch.zeros(3, dtype=torch.complex64), "n": torch.zeros(5)}}
    Checkpointer().load(str(tmp_path / "step1"), _FixedState(back))
    stock = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp_load(stock, checkpoint_id=str(tmp_path / "step1" / "model_and_optim"), no_dist=True)
    for k, v in want.items():
        assert torch.equal(back["model"][k], v) and torch.equal(stock["model"][k], v), k


def test_views_into_a_larger_buffer_are_written_as_their_own_bytes_only(tmp_path: Path) -> None:
    # Contiguous views at an offset of one buffer (a padded FSDP2 shard is one) are written without
    # a copy: each blob must still be what torch.save writes for a compact tensor of its shape.
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from ckptkeeper.cli.bench_run import _FixedState

    flat = torch.randn(64)
    tree = {"model": {"a": flat[3:23].view(4, 5), "b": flat[40:47], "c": flat[0:0], "d": flat[63:]}}
    want = {k: v.clone() for k, v in tree["model"].items()}
    Checkpointer().save(str(tmp_path), 1, _FixedState(tree))
    data = tmp_path / "step1" / "model_and_optim" / "__0_0.distcp"
    compact = tmp_path / "compact"
    Checkpointer().save(str(compact), 1, _FixedState({"model": {k: v.clone() for k, v in want.items()}}))
    assert data.read_bytes() == (compact / "step1" / "model_and_optim" / "__0_0.distcp").read_bytes()
    back = {"model": {k: torch.full_like(v, 7.0) for k, v in want.items()}}
    Checkpointer().load(str(tmp_path / "step1"), _FixedState(back))
    stock = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp_load(stock, checkpoint_id=str(tmp_path / "step1" / "model_and_optim"), no_dist=True)
    for k, v in want.items():
        assert torch.equal(back["model"][k], v) and torch.equal(stock["model"][k], v), k
    assert torch.equal(tree["model"]["a"], want["a"])  # the buffer itself is untouched


def test_the_piece_reader_backs_a_tensor_up_before_any_piece_is_written() -> None:
    # Found by an outside attack: a second reader skipped the backup of a tensor whose first
    # backup was still being copied, and wrote into it.
    import threading
    import time

    from ckptkeeper.engine.fastio import Segment
    from ckptkeeper.engine.sharded import _Read, read_pieces

    dest = torch.zeros(4, 2)
    stored = torch.arange(8, dtype=torch.float32).reshape(4, 2)

    class Source:
        where = "memory"

        def read_into(self, rel: str, offset: int, view: memoryview) -> None:
            # Each row: a 16-byte "header", then the row's 8 bytes.
            raw = b"".join(b"\0" * 16 + stored[r].numpy().tobytes() for r in range(4))
            view[:] = raw[offset : offset + len(view)]

        def close(self) -> None:
            pass

    def piece(row: int) -> _Read:
        at = row * 24
        segs = {"head": Segment("head", "w", at, 16, ""), "data": Segment("data", "w", at + 16, 8, ""),
                "tail": Segment("tail", "w", at + 24, 0, "")}  # fmt: skip
        return _Read.make("w", dest, f"f{row}", segs, (row, 0), (1, 2), (0, 0), (row, 0), (row + 1, 2))

    seen: list[torch.Tensor] = []
    started = threading.Event()

    def before_write(name: str, start: int, length: int) -> None:
        started.set()
        time.sleep(0.3)  # a slow copy: the other reader must wait for it
        seen.append(dest.clone())

    # Hand-made segments carry no real checksums: verify=False.
    read_pieces(Source(), [piece(0), piece(1), piece(2), piece(3)], verify=False, threads=4, before_write=before_write)
    assert len(seen) == 1 and bool((seen[0] == 0).all())
    assert torch.equal(dest, stored)
