"""A per-rank save reuses the last save's plan only for the very same tensors
(``engine/save_memo.py``): a kept plan holds byte views of the tensors' memory and their
``torch.save`` heads, so a plan used for a tensor that moved, shrank, changed dtype or layout
would write wrong bytes, or bytes that are no longer the tensor's.

Checked in one process on what one rank writes (``plan_shard`` + ``write_shard``), every piece
read back from the data file with ``torch.load`` and compared with the tensor as it was saved.
"""

from __future__ import annotations

import gc
import io
import json
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptkeeper.engine.fastio import _leaves
from ckptkeeper.engine.save_memo import SaveMemo, fingerprints
from ckptkeeper.engine.sharded import plan_shard, recheck_shard, shard_name, table_name, table_pieces, write_shard

_BIG = 1 << 18  # float32 elements: a 1 MiB tensor, written alone (in parts) rather than in a run


def _tree(mesh: DeviceMesh | None = None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    tree: dict[str, Any] = {
        "model": {
            "w": torch.nn.Parameter(torch.randn(4, 3, generator=gen)),
            "big": torch.randn(2, _BIG, generator=gen),
            "ids": torch.arange(6, dtype=torch.int64),
            "sq": torch.randn(3, 3, generator=gen),
            "z": torch.randn(3, dtype=torch.complex64, generator=gen),
        },
        "optim": {"state": {"w": {"exp_avg": torch.randn(4, 3, generator=gen), "step": torch.tensor(3.0)}}},
    }
    if mesh is not None:
        tree["model"]["d"] = distribute_tensor(torch.randn(5, 2, generator=gen), mesh, [Shard(0)])
    return tree


def _save(
    folder: Path, tree: Any, memo: SaveMemo, world: int, between: Callable[[], Any] | None = None
) -> dict[str, torch.Tensor]:
    """Rank 0's save of ``tree`` through ``memo`` (at ``world`` 1 it writes every piece); each read
    back. ``between`` runs after planning, before writing."""
    model_dir = folder / "model_and_optim"
    model_dir.mkdir(parents=True)
    plan = plan_shard(tree, 0, world, memo, eager=between is not None)  # as a save with an on_stage hook
    assert plan is not None
    if between is not None:
        between()
        plan = recheck_shard(plan, 0, world)  # as a save does after its on_stage hook
    write_shard(str(model_dir), plan.pieces, 0, 1, None, plan.kept)
    if plan.kept is not None:
        memo.keep(plan.kept)
    doc = json.loads((folder / table_name(0)).read_bytes())
    data = (model_dir / shard_name(0)).read_bytes()
    back: dict[str, torch.Tensor] = {}
    for fqn, _, stored, _ in table_pieces(doc, shard_name(0), len(data)):
        segs = stored.segs
        blob = data[segs["head"].offset : segs["tail"].offset + segs["tail"].length]
        back[fqn] = torch.load(io.BytesIO(blob), weights_only=True)
    return back


def _expected(tree: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for fqn, _, v in _leaves(tree):
        t = v._local_tensor if isinstance(v, DTensor) else v
        out[fqn] = t.detach().resolve_conj().resolve_neg().clone()
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for fqn, t in want.items():
        assert got[fqn].dtype == t.dtype and got[fqn].shape == t.shape, fqn
        assert torch.equal(got[fqn], t), fqn


def test_the_same_tensors_saved_again_reuse_the_plan_and_write_their_new_values(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    tree = _tree(mesh)
    memo = SaveMemo()
    _same(_save(tmp_path / "a", tree, memo, 1), _expected(tree))
    assert (memo.hits, memo.misses) == (0, 1)
    with torch.no_grad():  # what an optimizer step does: new values, same memory
        for _, _, v in _leaves(tree):
            (v._local_tensor if isinstance(v, DTensor) else v).mul_(2).add_(1)
    _same(_save(tmp_path / "b", tree, memo, 1), _expected(tree))
    assert (memo.hits, memo.misses) == (1, 1)
    # The two tables differ only in their data checksums.
    a, b = (json.loads((tmp_path / f / table_name(0)).read_bytes()) for f in "ab")
    assert a["sums"] != b["sums"] and {k: v for k, v in a.items() if k != "sums"} == {
        k: v for k, v in b.items() if k != "sums"
    }


def _swap(t: torch.Tensor, new: torch.Tensor) -> None:
    t.data = new


def _slot(tree: dict[str, Any], name: str) -> torch.Tensor:
    return tree["optim"]["state"]["w"][name]  # type: ignore[no-any-return]


# Each changes one thing a kept plan depends on, most keeping the tensor's first byte where it was.
_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "new memory": lambda tr: _swap(tr["model"]["w"], torch.randn(4, 3)),
    "other dtype, same bytes": lambda tr: _swap(_slot(tr, "exp_avg"), _slot(tr, "exp_avg").view(torch.int32)),
    "shrunk in place": lambda tr: _swap(tr["model"]["ids"], tr["model"]["ids"][:2]),
    "reshaped in place": lambda tr: _swap(tr["model"]["ids"], tr["model"]["ids"].view(2, 3)),
    "transposed (not contiguous)": lambda tr: _swap(tr["model"]["w"], tr["model"]["w"].data.t()),
    "transposed, same shape": lambda tr: _swap(tr["model"]["sq"], tr["model"]["sq"].t()),
    "lazy conjugate": lambda tr: _swap(tr["model"]["z"], tr["model"]["z"].conj()),
    "lazy negation": lambda tr: _swap(_slot(tr, "step"), torch._neg_view(_slot(tr, "step"))),
    "resized": lambda tr: tr["model"]["ids"].resize_(40),
    "renamed": lambda tr: tr["model"].__setitem__("w2", tr["model"].pop("w")),
    "added": lambda tr: tr["model"].__setitem__("extra", torch.ones(2)),
    "removed": lambda tr: tr["model"].pop("ids"),
    "same name, other keys": lambda tr: tr.__setitem__("model.big", tr["model"].pop("big")),
    "local shard swapped": lambda tr: setattr(tr["model"]["d"], "_local_tensor", torch.randn(5, 2)),
    "spec changed in place": lambda tr: setattr(tr["model"]["d"]._spec, "placements", (Replicate(),)),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_tensor_changed_between_saves_is_planned_anew_and_written_as_it_is_now(
    tmp_path: Path, mesh: DeviceMesh, change: str
) -> None:
    tree = _tree(mesh)
    memo = SaveMemo()
    _save(tmp_path / "a", tree, memo, 1)
    _save(tmp_path / "b", tree, memo, 1)
    assert (memo.hits, memo.misses) == (1, 1)
    with torch.no_grad():
        _CHANGES[change](tree)
    _same(_save(tmp_path / "c", tree, memo, 1), _expected(tree))
    assert memo.hits == 1, "a plan made for the tensors before the change was reused"
    # Saved once more as they now are: reused where nothing had to be copied first.
    _same(_save(tmp_path / "d", tree, memo, 1), _expected(tree))


def test_a_tensor_over_a_shorter_storage_at_the_same_address_is_not_taken_for_the_same_tensor(
    tmp_path: Path,
) -> None:
    # A storage resized to 0 and then to less (as FSDP2 resizes parameters' storages) may come
    # back at its old address, depending on the allocator: the kept plan would then write the
    # tensor's whole length from a shorter block. Made here deterministically: the same address,
    # shape and dtype over a storage half as long. Its fingerprint must differ, so the save
    # plans anew (and a storage shorter than its tensor is refused by name when planning).
    import ctypes

    from ckptkeeper import ConfigurationError

    tree = _tree()
    whole = torch.randn(2048)
    tree["model"]["mid"] = whole[:1024]  # its storage holds 8 KiB
    memo = SaveMemo()
    _save(tmp_path / "a", tree, memo, 1)
    _save(tmp_path / "b", tree, memo, 1)
    assert (memo.hits, memo.misses) == (1, 1)
    block = (ctypes.c_ubyte * 4096).from_address(whole.data_ptr())
    over = torch.frombuffer(block, dtype=torch.float32)  # the same first byte, a 4 KiB storage
    assert over.data_ptr() == whole.data_ptr() and over.shape == (1024,)
    before = fingerprints(_leaves(tree))
    tree["model"]["mid"] = over
    assert fingerprints(_leaves(tree)) != before
    _same(_save(tmp_path / "c", tree, memo, 1), _expected(tree))
    assert memo.hits == 1
    short = torch.randn(1024)
    short.untyped_storage().resize_(1024)  # resized under the tensor, at whatever address
    tree["model"]["mid"] = short
    with pytest.raises(ConfigurationError, match=r"model\.mid reaches 4096 bytes into its storage, which holds 1024"):
        _save(tmp_path / "d", tree, memo, 1)
    del block


def test_a_tensor_that_must_be_copied_first_is_never_kept(tmp_path: Path) -> None:
    tree = _tree()
    tree["model"]["w"].data = tree["model"]["w"].data.t()  # written from a compact copy, every save
    memo = SaveMemo()
    for folder in "abc":
        _same(_save(tmp_path / folder, tree, memo, 1), _expected(tree))
    assert memo.hits == 0


def test_a_failed_write_keeps_nothing(tmp_path: Path) -> None:
    class Broken:
        def write(self, data: Any) -> None:
            raise OSError("the store went away")

        def close(self) -> None: ...

        def abort(self) -> None: ...

    tree = _tree()
    memo = SaveMemo()
    (tmp_path / "model_and_optim").mkdir()
    plan = plan_shard(tree, 0, 1, memo)
    assert plan is not None and plan.kept is not None
    with pytest.raises(OSError, match="went away"):
        write_shard(str(tmp_path / "model_and_optim"), plan.pieces, 0, 1, Broken(), plan.kept)  # type: ignore[arg-type]
    memo.keep(plan.kept)
    _same(_save(tmp_path / "a", tree, memo, 1), _expected(tree))
    assert (memo.hits, memo.misses) == (0, 2)


def test_a_kept_plan_is_lent_to_one_save_at_a_time_and_two_layouts_are_kept(tmp_path: Path) -> None:
    live, staged = _tree(), _tree()  # a checkpointer's sync saves and its async saves' buffers
    memo = SaveMemo()
    _save(tmp_path / "a", live, memo, 1)
    _save(tmp_path / "b", staged, memo, 1)
    leaves = _leaves(live)
    assert memo.take(0, 2, leaves) is None  # another world size
    taken = memo.take(0, 1, leaves)
    assert taken is not None
    assert memo.take(0, 1, leaves) is None  # lent out: a second save plans its own
    memo.keep(taken)
    for folder, tree in (("c", live), ("d", staged), ("e", live)):
        _same(_save(tmp_path / folder, tree, memo, 1), _expected(tree))
    assert memo.hits == 4


def test_leaves_the_memo_cannot_follow_are_planned_every_time(tmp_path: Path) -> None:
    class Sub(torch.Tensor):
        pass

    tree = _tree()
    assert fingerprints(_leaves(tree)) is not None
    tree["model"]["w"] = torch.randn(2).as_subclass(Sub)
    assert fingerprints(_leaves(tree)) is None


@pytest.mark.parametrize("which", [0, 1100, 2099])
def test_a_change_anywhere_in_a_large_state_is_seen(tmp_path: Path, which: int) -> None:
    # Compared a part at a time (a miss stops early): every part must be compared on a hit.
    tree = {"p": {str(i): torch.full((2,), float(i)) for i in range(2100)}}
    memo = SaveMemo()
    _save(tmp_path / "a", tree, memo, 1)
    _save(tmp_path / "b", tree, memo, 1)
    assert memo.hits == 1
    tree["p"][str(which)].data = torch.full((3,), -1.0)
    _same(_save(tmp_path / "c", tree, memo, 1), _expected(tree))
    assert memo.hits == 1


class _Converted(Mapping[str, torch.Tensor]):
    """A state whose tensors are made when asked for (a float32 copy of each bf16 weight, put in
    the same place of an arena each time): nothing but the save holds them, and each save finds
    its copies where the last save's were, so it reuses the last save's plan."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights
        self.arena = torch.empty(len(weights), *next(iter(weights.values())).shape)
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __getitem__(self, key: str) -> torch.Tensor:
        i = list(self.weights).index(key)
        self.arena[i].copy_(self.weights[key].float())
        copy = torch.frombuffer(self.arena[i].numpy().data, dtype=torch.float32).view(self.arena[i].shape)
        self.made.append(weakref.ref(copy))
        return copy

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def test_tensors_made_on_access_are_held_while_a_reused_plan_writes_them(tmp_path: Path) -> None:
    # Found by an outside attack: a reused plan's byte views point at tensors that only the pass
    # which compared them held; freed before the write (a state whose tensors are made on access),
    # their memory could be reused, and the save wrote whatever was there then.
    weights = {f"w{i}": torch.randn(64, 64).bfloat16() for i in range(8)}
    state = _Converted(weights)
    memo = SaveMemo()

    def all_held() -> None:
        assert all(ref() is not None for ref in state.made), "a tensor the plan writes from was freed"

    for folder in "abc":
        for w in weights.values():
            w.add_(1)
        state.made.clear()
        got = _save(tmp_path / folder, {"model": state}, memo, 1, between=all_held)
        _same(got, {f"model.{k}": w.float() for k, w in weights.items()})
    assert memo.hits == 2


def test_tensors_moved_by_a_hook_after_planning_are_planned_again(tmp_path: Path) -> None:
    # Found by an outside attack: an on_stage hook at "writing tensors" runs after the plan was
    # found; one that moved a tensor (same values, new memory) left the reused plan pointing at
    # the freed memory, which the save then wrote (wrong values, or a crash).
    tree = _tree()
    memo = SaveMemo()
    _save(tmp_path / "a", tree, memo, 1)
    litter: list[torch.Tensor] = []

    def hook() -> None:
        w = tree["optim"]["state"]["w"]
        w["exp_avg"].data = w["exp_avg"].data.clone()  # the old memory is freed...
        litter.extend(torch.full((4, 3), 7.0) for _ in range(64))  # ...and taken by something else

    got = _save(tmp_path / "b", tree, memo, 1, between=hook)
    assert memo.hits == 1  # found before the hook, planned again after it
    _same(got, _expected(tree))


def test_a_hook_that_changes_replicated_tensors_fails_the_save(tmp_path: Path) -> None:
    tree = _tree()
    memo = SaveMemo()
    _save(tmp_path / "a", tree, memo, 1)
    ids = tree["model"]["ids"]
    with pytest.raises(ValueError, match="changed during the save"):
        _save(tmp_path / "b", tree, memo, 1, between=lambda: setattr(ids, "data", torch.arange(9)))


def test_a_new_plan_made_before_a_hook_moved_a_tensor_is_not_kept(tmp_path: Path, mesh: DeviceMesh) -> None:
    # Found by an outside attack: a save that planned anew, with a hook that then gave a DTensor
    # another local shard (FSDP2's model.to() does), wrote the old shard (its piece holds it) but
    # fingerprinted the new one; the kept plan's views were of the old, freed after the save, and
    # the next save, finding the new shard where the fingerprints said, wrote the freed memory.
    tree = _tree(mesh)
    d = tree["model"]["d"]
    memo = SaveMemo()
    litter: list[torch.Tensor] = []

    def move() -> None:
        d._local_tensor = d._local_tensor.clone()

    _same(_save(tmp_path / "a", tree, memo, 1, between=move), _expected(tree))
    litter.extend(torch.full((5, 2), 7.0) for _ in range(64))  # takes the old shard's memory
    _same(_save(tmp_path / "b", tree, memo, 1), _expected(tree))
    assert memo.hits == 0


def test_fingerprints_tell_apart_shapes_of_the_same_elements_at_the_same_address() -> None:
    # Fingerprints are one flat list (dimensions count first, then sizes): the same bytes seen as
    # (6,), (1, 6) or (6, 1) must differ, alone and followed by another leaf.
    base = torch.zeros(6)
    after = torch.ones(2)
    prints = [
        fingerprints([("a", ("a",), view), ("b", ("b",), after)]) for view in (base, base.view(1, 6), base.view(6, 1))
    ]
    assert all(p is not None for p in prints)
    firsts = [p[0] for p in prints if p is not None]
    assert len({repr(f) for f in firsts}) == 3 and firsts[0] != firsts[1] != firsts[2] != firsts[0]
    again = fingerprints([("a", ("a",), base), ("b", ("b",), after)])
    assert again is not None and again[0] == firsts[0]


def _tracked_now() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_a_kept_plan_keeps_few_objects_for_the_collector(tmp_path: Path) -> None:
    # A kept plan lives as long as the run, and every collection walks what it holds: at 2,000
    # nested tensors it adds about two tracked objects per tensor (each tensor's byte view and
    # the storage object torch keeps once asked for its size), not a tuple, a torch.Size, a view,
    # a view's buffer and a path pair each (about five, before).
    count = 2000
    tree = {"model": {f"layers.{i}.w": torch.full((3,), float(i)) for i in range(count)}}
    memo = SaveMemo()
    before = _tracked_now()
    _same(_save(tmp_path / "a", tree, memo, 1), _expected(tree))
    assert memo.misses == 1 and len(memo._kept) == 1
    assert _tracked_now() - before < 2.5 * count
    _same(_save(tmp_path / "b", tree, memo, 1), _expected(tree))
    assert memo.hits == 1
