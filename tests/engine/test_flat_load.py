"""The columnar lane of multi-rank loads at the saved world size (``engine/flatload.py``).

Checked in one process on what two ranks would write (no process group): it must place every
piece where the general index does, refuse every table or index the general index refuses, and
read, check and copy exactly as the general reader does.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptkeeper import CorruptCheckpointError
from ckptkeeper.engine.flatload import FlatRead, NotPlaced, flat_index, flat_segments, plan_flat, read_flat
from ckptkeeper.engine.sharded import (
    LocalSource,
    Piece,
    check_stored,
    index_bytes,
    index_from_own_table,
    plan_reads,
    shard_name,
    table_name,
    write_shard,
)
from ckptkeeper.engine.state import SavedTensor

_BIG = 1 << 18  # a row of 1 MiB of float32: read straight into its tensor


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {f"w{i}": torch.randn(4, 3, generator=gen) for i in range(6)}
    out["b"] = torch.arange(8, dtype=torch.int64)
    out["big"] = torch.randn(2, _BIG, generator=gen)
    out["s0"] = torch.tensor(3.0)  # replicated scalars, each written by one rank (AdamW's steps)
    out["s1"] = torch.tensor(7.0)
    out["s2"] = torch.tensor(11.0)
    return out


def _write(tmp_path: Path) -> tuple[dict[str, Any], Any, dict[str, int]]:
    """Two ranks' tables, the shared index and the data files' sizes, of row-halves of _tensors()."""
    model_dir = tmp_path / "model_and_optim"
    model_dir.mkdir(parents=True)
    per_rank = []
    for rank in range(2):
        pieces = []
        for fqn, t in _tensors().items():
            if t.dim() == 0:
                pieces.append(Piece(fqn, (fqn,), t, (), (), fqn in {0: ("s0", "s2"), 1: ("s1",)}[rank]))
                continue
            half = t.shape[0] // 2
            offsets = (rank * half,) + (0,) * (t.dim() - 1)
            pieces.append(Piece(fqn, (fqn,), t[rank * half : (rank + 1) * half].clone(), offsets, tuple(t.shape), True))
        _, layout, whole_sums = write_shard(str(model_dir), pieces, rank, 1)
        per_rank.append((layout, whole_sums))
    tables = {shard_name(r): json.loads((tmp_path / table_name(r)).read_bytes()) for r in range(2)}
    sizes = {shard_name(r): (model_dir / shard_name(r)).stat().st_size for r in range(2)}
    return tables, json.loads(index_bytes(per_rank)), sizes


def _local(fqn: str, rank: int) -> torch.Tensor:
    t = _tensors()[fqn]
    if t.dim() == 0:
        return t
    half = t.shape[0] // 2
    return t[rank * half : (rank + 1) * half]


def test_each_piece_is_where_the_general_index_places_it(tmp_path: Path) -> None:
    tables, index, sizes = _write(tmp_path)
    for rank in range(2):
        own = shard_name(rank)
        flat = flat_index(tables[own], own, index, 2, sizes)
        general = index_from_own_table(tables[own], own, index, 2, sizes)
        assert flat.saved == general.saved
        assert set(flat.spots) == set(general.pieces) == set(_tensors())
        for fqn, (stored,) in general.pieces.items():
            file, start, kind, data_sum = flat.spots[fqn]
            segs = stored.segs
            assert (file, start, kind.offsets, kind.sizes) == (stored.file, segs["head"].offset, stored.offsets,
                                                               stored.sizes)  # fmt: skip
            assert (kind.head, kind.nbytes, kind.tail) == tuple(segs[k].length for k in ("head", "data", "tail"))
            assert (kind.head_sum, data_sum, kind.tail_sum) == tuple(segs[k].xxh3_64 for k in ("head", "data", "tail"))
        # Both scalars are read from the file of the rank that wrote them.
        assert flat.spots["s0"][0] == shard_name(0) and flat.spots["s1"][0] == shard_name(1)


def _outcome(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except (ValueError, KeyError, TypeError, AttributeError):  # what the loader turns into CorruptCheckpointError
        return "refused"
    return "taken"


_ODD_VALUES = [0, 1, -1, 2, 3, 7, 1 << 40, True, False, 2.0, "2", "", None, [], [0], [2, 0], {}, "torch.int32",
               "torch.float64", "model_and_optim/__0_0.distcp", "0123456789abcdef"]  # fmt: skip


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def test_every_forged_table_or_index_is_refused_by_both_or_by_neither(tmp_path: Path) -> None:
    # The flat index repeats the general one's checks in its own loops: 1,500 forgeries (one
    # value of the table or the index replaced, a column entry dropped or duplicated), and both
    # must agree on each, for each rank. Where both take one, they place the same pieces.
    tables, index, sizes = _write(tmp_path)
    rng = random.Random(11)
    checked = {"refused": 0, "taken": 0}
    for trial in range(2500):
        rank = trial % 2
        own = shard_name(rank)
        table, idx = copy.deepcopy(tables[own]), copy.deepcopy(index)
        if trial % 5 == 4:
            # A whole row repeated (every column), one of its values then changed below: rows
            # of one name that disagree (an outside attack found the file went unchecked).
            w = idx["whole"]
            k = rng.randrange(len(w["names"]))
            for col in ("names", "kind", "rank", "start", "sums"):
                w[col].insert(rng.randrange(len(w[col]) + 1) if col == "names" else len(w[col]), w[col][k])
            # (only "names" lands elsewhere when the others go last: rows then pair up anew)
            doc: Any = idx
            path = ("whole", rng.choice(["kind", "rank", "start", "sums"]), len(w["names"]) - 1)
            _set(doc, path, copy.deepcopy(rng.choice([*_ODD_VALUES, *w[path[1]]])))
        else:
            doc = table if rng.random() < 0.5 else idx
            path = rng.choice(_paths(doc)[1:])
        parent: Any = doc
        for key in path[:-1]:
            parent = parent[key]
        if trial % 5 == 4:
            pass
        elif isinstance(parent, list) and rng.random() < 0.3:
            if rng.random() < 0.5:
                parent.pop(path[-1])
            else:
                parent.insert(path[-1], copy.deepcopy(parent[path[-1]]))
        else:
            _set(doc, path, copy.deepcopy(rng.choice(_ODD_VALUES)))
        general = _outcome(index_from_own_table, table, own, idx, 2, sizes)
        flat = _outcome(flat_index, table, own, idx, 2, sizes)
        assert flat == general, (rank, path, general, flat)
        checked[flat] += 1
        if flat == "taken":
            got = flat_index(table, own, idx, 2, sizes)
            want = index_from_own_table(table, own, idx, 2, sizes)
            assert got.saved == want.saved and set(got.spots) == set(want.pieces)
            for fqn, (file, start, _, data_sum) in got.spots.items():
                assert any(s.file == file and s.segs["head"].offset == start and s.segs["data"].xxh3_64 == data_sum
                           for s in want.pieces[fqn]), fqn  # fmt: skip
    assert checked["refused"] > 500 and checked["taken"] > 20, checked
    # A data file longer than its table says (the whole pieces' checks above cannot see bytes past
    # the last of them): both refuse.
    for rank in range(2):
        own = shard_name(rank)
        longer = {**sizes, own: sizes[own] + 10}
        for index_of in (index_from_own_table, flat_index):
            with pytest.raises(ValueError, match="covers"):
                index_of(tables[own], own, index, 2, longer)


def test_the_shared_index_must_agree_with_the_own_table_about_whole_pieces(tmp_path: Path) -> None:
    tables, index, sizes = _write(tmp_path)
    w = index["whole"]
    i = w["names"].index("s0")
    j = next(k for k in range(len(w["names"])) if w["rank"][k] == 0 and k != i)
    redirected = copy.deepcopy(index)
    for col in ("start", "sums"):  # s0 pointed at another whole piece's bytes, with its checksum
        redirected["whole"][col][i] = w[col][j]
    with pytest.raises(ValueError, match="where the segment table"):
        flat_index(tables[shard_name(0)], shard_name(0), redirected, 2, sizes)
    # Rank 1 cannot tell (rank 0's file is checked by rank 0; the loader has the ranks agree).
    flat_index(tables[shard_name(1)], shard_name(1), redirected, 2, sizes)
    # A whole row repeated with another rank: rank 1's s1 said to be in rank 0's file too, at a
    # place rank 0's table gives another tensor. Rank 0 must refuse it even though the first row
    # (in rank 1's file) placed s1 already (found by an outside attack: the file went unchecked).
    twice = copy.deepcopy(index)
    k = twice["whole"]["names"].index("s1")
    for col in ("names", "kind", "rank", "start", "sums"):
        twice["whole"][col].append(twice["whole"][col][k])
    twice["whole"]["rank"][-1] = 0
    twice["whole"]["start"][-1] = index["whole"]["start"][i]
    for index_of in (index_from_own_table, flat_index):
        with pytest.raises(ValueError, match="where the segment table"):
            index_of(tables[shard_name(0)], shard_name(0), twice, 2, sizes)


def _reads(tmp_path: Path, rank: int) -> tuple[list[FlatRead], dict[str, torch.Tensor]]:
    tables, index, sizes = _write(tmp_path)
    own = shard_name(rank)
    flat = flat_index(tables[own], own, index, 2, sizes)
    dests = {fqn: torch.full_like(_local(fqn, rank), 5) for fqn in _tensors()}
    reads = sorted(
        FlatRead(*flat.spots[fqn][:2], i, *flat.spots[fqn][2:], fqn, t, False)
        for i, (fqn, t) in enumerate(dests.items())
    )
    return reads, dests


@pytest.mark.parametrize("rank", [0, 1])
def test_reads_fill_every_destination_exactly_with_backups_first(tmp_path: Path, rank: int) -> None:
    reads, dests = _reads(tmp_path, rank)
    backed: list[str] = []
    events: list[tuple[str, int, int]] = []

    def before_write(fqn: str, start: int, length: int) -> None:
        assert torch.equal(dests[fqn], torch.full_like(dests[fqn], 5))  # not written yet
        events.append((fqn, start, length))

    def back_up_whole(names: list[str]) -> None:
        assert all(torch.equal(dests[n], torch.full_like(dests[n], 5)) for n in names)
        backed.extend(names)

    read_flat(LocalSource(str(tmp_path / "model_and_optim")), reads, True, 2, before_write, back_up_whole)
    for fqn, t in dests.items():
        assert torch.equal(t, _local(fqn, rank)), fqn
    # The large piece is backed up alone, the small ones a job at a time: each exactly once.
    assert events == [("big", 0, _BIG * 4)]
    assert sorted(backed) == sorted(set(_tensors()) - {"big"})


@pytest.mark.parametrize("others_fresh", [False, True])
def test_destinations_sharing_memory_are_read_through_a_buffer(tmp_path: Path, others_fresh: bool) -> None:
    reads, dests = _reads(tmp_path, 0)
    shared = dests["w1"]  # w2 is read into w1's memory too: each piece is checked before its copy
    reads = [r._replace(dest=shared) if r.fqn == "w2" else r for r in reads]
    if others_fresh:
        # Tensors the plan made itself are left out of the overlap check: the two live ones that
        # share memory are still found.
        reads = [r if r.fqn in ("w1", "w2") else r._replace(fresh=True) for r in reads]
    backed: list[str] = []
    read_flat(LocalSource(str(tmp_path / "model_and_optim")), reads, True, 2, None, backed.extend)
    assert torch.equal(shared, _local("w2", 0))  # the later piece in file order, as copies land
    assert torch.equal(dests["w3"], _local("w3", 0))


class _Buffered:
    """A local source without scatter reads: what an object store's source is to the reader."""

    def __init__(self, model_dir: str) -> None:
        self._local = LocalSource(model_dir)
        self.where = model_dir

    def read_into(self, rel: str, offset: int, view: memoryview) -> None:
        self._local.read_into(rel, offset, view)

    def close(self) -> None:
        self._local.close()


@pytest.mark.parametrize("how", ["scatter", "buffered", "no backup"])
@pytest.mark.parametrize(("fqn", "kind"), [("w3", "head"), ("w3", "data"), ("w3", "tail"), ("s0", "data"),
                                           ("w0", "head"), ("b", "tail"), ("s0", "tail"),  # a run's ends
                                           ("big", "head"), ("big", "data"), ("big", "tail")])  # fmt: skip
def test_a_flipped_byte_is_named_and_nothing_of_its_job_is_unguarded(
    tmp_path: Path, fqn: str, kind: str, how: str
) -> None:
    reads, dests = _reads(tmp_path, 0)
    read = next(r for r in reads if r.fqn == fqn)
    k = read.kind
    at = {
        "head": read.start + 3,
        "data": read.start + k.head + k.nbytes - 1,
        "tail": read.start + k.head + k.nbytes + 2,
    }
    data_file = tmp_path / "model_and_optim" / read.file
    raw = bytearray(data_file.read_bytes())
    raw[at[kind]] ^= 0x40
    data_file.write_bytes(bytes(raw))
    backed: list[str] = []
    model_dir = str(tmp_path / "model_and_optim")
    source = _Buffered(model_dir) if how == "buffered" else LocalSource(model_dir)
    backup = None if how == "no backup" else backed.extend
    small = [n for n in dests if n != "big"]

    def unchanged(names: list[str]) -> bool:
        return all(torch.equal(dests[n], torch.full_like(dests[n], 5)) for n in names)

    with pytest.raises(CorruptCheckpointError, match=rf"{fqn} \({kind}\)"):
        read_flat(source, reads, True, 2, None, backup)
    if fqn != "big":
        # Every small piece lies in one job here. Read through a buffer (an object store's source,
        # or with no backup to put them back), its checksums fail before a byte is copied; read
        # straight into the tensors, each was backed up before its read started (the loader puts
        # them back from there).
        if how == "scatter":
            assert sorted(backed) == sorted(small)
        else:
            assert unchanged(small) and backed == []
    elif kind != "data":
        assert unchanged(["big"])  # its head/tail are checked first
    # check_stored (a load without a backup checks every segment first) finds the same damage.
    with pytest.raises(CorruptCheckpointError, match=rf"{fqn} \({kind}\)"):
        check_stored(LocalSource(model_dir), flat_segments(reads))


def test_a_truncated_data_file_is_refused(tmp_path: Path) -> None:
    reads, _ = _reads(tmp_path, 1)
    data_file = tmp_path / "model_and_optim" / shard_name(1)
    data_file.write_bytes(data_file.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpointError, match="ends early"):
        read_flat(LocalSource(str(tmp_path / "model_and_optim")), reads)


def test_destinations_that_are_not_exactly_one_piece_step_aside(tmp_path: Path) -> None:
    tables, index, sizes = _write(tmp_path)
    flat = flat_index(tables[shard_name(0)], shard_name(0), index, 2, sizes)
    # Whole pieces are read at any rank (plain tensors: replicated).
    got = plan_flat({"s1": torch.zeros(()), "s0": torch.zeros(())}, flat, 2)
    assert got is not None and [r.fqn for r in got] == ["s0", "s1"]  # in file order
    # The whole of a sharded tensor (not this rank's box): the general planner takes it.
    with pytest.raises(NotPlaced):
        plan_flat({"w0": torch.zeros(4, 3)}, flat, 2)
    # A tensor the index does not know, another dtype, a view that is not contiguous: no fast reader.
    assert plan_flat({"nope": torch.zeros(2)}, flat, 2) is None
    assert plan_flat({"s0": torch.zeros((), dtype=torch.float64)}, flat, 2) is None
    assert plan_flat({"b": torch.zeros(4, 2, dtype=torch.int64).t()}, flat, 2) is None
    # A lazy conjugate or negation holds the other values in its memory: DCP's reader copies
    # through the view, raw bytes would not (neither planner takes it).
    general = index_from_own_table(tables[shard_name(0)], shard_name(0), index, 2, sizes)
    neg = torch._neg_view(torch.zeros(()))
    assert plan_flat({"s0": neg}, flat, 2) is None and plan_reads({"s0": neg}, general, 2, "test") is None
    assert plan_flat({"s0": torch.zeros(())}, flat, 2) is not None
    # Empty destinations read nothing.
    assert (
        plan_flat({"e": torch.zeros(0)}, flat._replace(saved={**flat.saved, "e": SavedTensor((0,), torch.float32)}), 2)
        == []
    )


def test_a_run_that_cannot_be_prepared_is_raised_once_the_reads_in_flight_are_done() -> None:
    import time
    from collections.abc import Iterator
    from concurrent.futures import ThreadPoolExecutor

    from ckptkeeper.engine.fastio import fetch_and_place

    fetched: list[int] = []
    placed: list[int] = []

    def runs() -> Iterator[int]:  # what a scatter read's preparation (its backup) looks like
        yield 1
        yield 2
        raise RuntimeError("the backup failed")

    def fetch(run: int) -> int:
        time.sleep(0.05)
        fetched.append(run)
        return run

    with ThreadPoolExecutor(max_workers=2) as pool:
        with pytest.raises(RuntimeError, match="the backup failed"):
            fetch_and_place(pool, [], runs(), fetch, lambda run, got: placed.append(got), ahead=3)
        assert sorted(fetched) == [1, 2]  # nothing still writing when the error came out
    assert placed == []  # and nothing placed once a run had failed


def test_a_twin_stands_for_a_destinations_checks_only_where_its_parameter_passed_them(tmp_path: Path) -> None:
    # The plan marks the tensors it made itself (LoadPlan.flat's twins) so that plan_flat does not
    # look at each again. A twin that is not a destination that passed (left out of the plan, or
    # unplaceable) must count for nothing: the tensor is looked at as any other.
    tables, index, sizes = _write(tmp_path)
    flat = flat_index(tables[shard_name(0)], shard_name(0), index, 2, sizes)
    from ckptkeeper.engine.state import MADE_PLAIN

    w0, w1 = _local("w0", 0).clone(), _local("w1", 0).clone()  # w1: w0's shape, shard and dtype
    plain = [("w0", w0, None), ("w1", w1, None), ("s0", torch.zeros(()), None), ("s1", torch.zeros(()), None)]
    twins = [("w0", w0, None), ("w1", w1, w0), ("s0", torch.zeros(()), MADE_PLAIN), ("s1", torch.zeros(()), MADE_PLAIN)]

    def placed(leaves: list[Any]) -> list[tuple[str, int, tuple[int, ...]]] | None:
        got = plan_flat({}, flat, 2, leaves)
        return None if got is None else [(r.fqn, r.start, tuple(r.dest.shape)) for r in got]

    assert placed(twins) == placed(plain) is not None
    # Twins whose parameter is not among the destinations, or whose parameter was refused: the
    # destination's own facts decide (another dtype, a transposed view: DCP's reader takes the load).
    stranger = torch.zeros(2, 3)
    for bad in (w1.double(), torch._neg_view(w1), w1.t().contiguous().t()):
        assert placed([("w1", bad, None)]) is None
        assert placed([("w1", bad, stranger)]) is None
        # w0 is refused too (a view that is not contiguous): nothing is planned, its twin aside.
        assert placed([("w0", w0.t().contiguous().t(), None), ("w1", bad, w0)]) is None


def _facts(t: torch.Tensor) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.device, tuple(local.shape), local.stride(), local.layout


@pytest.mark.parametrize(
    "case", ["plain", "transposed", "bf16 slots saved as fp32", "dtensor", "meta context", "quantized slot"]
)
def test_the_twins_a_plan_gives_tell_the_truth_about_the_tensors_it_made(case: str, request: Any) -> None:
    # plan_flat trusts a twin instead of looking at the tensor: each must be exactly what its
    # docstring says (the parameter's device, shape, strides and spec with the checkpoint's dtype;
    # or a contiguous CPU tensor), also where a device context moves what torch.empty makes.
    from torch import nn
    from torch.distributed.tensor import DTensor

    from ckptkeeper import TrainingState
    from ckptkeeper.engine.state import MADE_PLAIN, flatten_tensors

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    if case == "transposed":
        model[0].weight = nn.Parameter(torch.randn(6, 8).t())  # a parameter that is not contiguous
    if case == "dtensor":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=request.getfixturevalue("mesh"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    st = TrainingState(model, opt)
    tensors, meta = st.capture()
    saved = {k: SavedTensor(tuple(t.shape), t.dtype) for k, t in flatten_tensors(tensors)}
    if case == "bf16 slots saved as fp32":
        model.to(torch.bfloat16)
        opt.state.clear()
    if case == "quantized slot":
        # A slot of another shape in a quantized dtype (a checkpoint made elsewhere, say): torch.empty
        # makes a quantized tensor, whose scale and zero point raw bytes would not carry (found by an
        # outside attack).
        saved["optim.state.0.weight.q"] = SavedTensor((7,), torch.quint8)
    with torch.device("meta") if case == "meta context" else contextlib.nullcontext():
        plan = st.plan_load(saved, meta, "here")
    assert plan.flat is not None
    twinned = 0
    for key, t, twin in plan.flat:
        if twin is None:
            continue
        twinned += 1
        assert t.dtype == saved[key].dtype, key
        if twin is MADE_PLAIN:
            assert t.is_cpu and t.is_contiguous() and tuple(t.shape) == saved[key].shape, key
            assert not (t.is_conj() or t.is_neg() or t.is_quantized or t.is_sparse), key
            continue
        assert _facts(t) == _facts(twin), key
        if isinstance(twin, DTensor):
            assert isinstance(t, DTensor) and t._spec is twin._spec, key
    # Every optimizer slot has one (a device context included: the plan makes its tensors on the
    # CPU), except a quantized one.
    slots = sum(1 for key, _, _ in plan.flat if key.startswith("optim."))
    untwinned = {"quantized slot": 1}.get(case, 0)
    assert twinned == slots - untwinned > 0
    # A twin also says the tensor is new memory (read_flat's overlap check leaves it out): none
    # shares a byte with another destination or with the optimizer's state as it was.
    from ckptkeeper.engine.fastio import overlapping_spans

    def local(t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if isinstance(t, DTensor) else t

    live = [(f"old {i}", t) for i, t in enumerate(x for s in opt.state.values() for x in s.values())]
    spans = [
        (local(t).data_ptr(), local(t).data_ptr() + local(t).nbytes, key)
        for key, t in [*((k, t) for k, t, _ in plan.flat), *live]
        if local(t).nbytes and not local(t).is_meta
    ]
    made = {key for key, _, twin in plan.flat if twin is not None}
    assert made and not overlapping_spans(spans) & made
