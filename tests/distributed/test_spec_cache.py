"""Facts kept per sharding-spec object (the box a shard covers, who writes it) are never used for
another object or for a spec changed in place: a wrong box would place bytes at the wrong offsets."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ckptkeeper.engine import sharded
from ckptkeeper.engine.sharded import _BY_SPEC_ID, _region, local_pieces


def test_a_spec_changed_in_place_is_looked_at_again(mesh: DeviceMesh) -> None:
    d = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    assert isinstance(d, DTensor)
    found = _region(d, 1)
    assert found is not None and found[1:] == ((0, 0), (8, 4))
    assert _BY_SPEC_ID[id(d._spec)][0]() is d._spec  # kept by identity from now on
    assert _region(d, 1) is not None
    # torch sets spec fields in places; what is kept must follow (a pending sum has no box).
    d._spec.placements = (Partial(),)
    assert _region(d, 1) is None
    assert local_pieces({"w": d}, 0, 1) is None
    d._spec.placements = (Shard(0),)
    again = _region(d, 1)
    assert again is not None and again[1:] == ((0, 0), (8, 4))


def test_an_entry_left_by_another_object_at_the_same_address_is_not_used(mesh: DeviceMesh) -> None:
    d = distribute_tensor(torch.randn(6, 2), mesh, [Shard(0)])
    other = distribute_tensor(torch.randn(10, 2), mesh, [Replicate()])
    spec = d._spec
    # What a dead spec's entry looks like once a new spec is made at its address.
    box = ((10, 2), (0, 0), (10, 2))
    _BY_SPEC_ID[id(spec)] = [weakref.ref(other._spec), hash(spec), 1, box, True, (*box, True)]
    found = _region(d, 1)
    assert found is not None and found[1:] == ((0, 0), (6, 2))
    pieces = local_pieces({"w": d}, 0, 1)
    assert pieces is not None and [(p.offsets, p.global_shape) for p in pieces[0]] == [((0, 0), (6, 2))]


def test_equal_specs_of_several_objects_each_get_their_own_entry(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = [distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]) for _ in range(3)]
    assert len({id(d._spec) for d in made}) == 3 and made[0]._spec == made[1]._spec
    calls = []
    real = sharded._box
    monkeypatch.setattr(sharded, "_box", lambda v, w: calls.append(1) or real(v, w))
    sharded._REGIONS.clear()
    for _ in range(2):
        for d in made:
            assert _region(d, 1) is not None
    assert len(calls) == 1  # worked out once, by value; each object then known by identity
    assert all(_BY_SPEC_ID[id(d._spec)][0]() is d._spec for d in made)


def test_a_save_takes_the_kept_facts_only_for_the_same_unchanged_spec(mesh: DeviceMesh) -> None:
    d = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    for _ in range(2):  # the second save takes the facts the first one kept
        found = local_pieces({"w": d}, 0, 1)
        assert found is not None
        assert [(p.offsets, p.global_shape, p.writer) for p in found[0]] == [((0, 0), (8, 4), True)]
    assert _BY_SPEC_ID[id(d._spec)][5] is not None
    # Another object's entry at this spec's address (what a dead spec leaves): never used.
    other = distribute_tensor(torch.randn(10, 2), mesh, [Shard(0)])
    box = ((8, 4), (3, 0), (11, 4))
    _BY_SPEC_ID[id(d._spec)] = [weakref.ref(other._spec), hash(d._spec), 1, box, True, (*box, True)]
    found = local_pieces({"w": d}, 0, 1)
    assert found is not None and [(p.offsets, p.global_shape) for p in found[0]] == [((0, 0), (8, 4))]
    # The spec changed in place (a pending sum has no box): the kept facts are not used.
    local_pieces({"w": d}, 0, 1)
    d._spec.placements = (Partial(),)
    assert local_pieces({"w": d}, 0, 1) is None
    d._spec.placements = (Shard(0),)
    assert local_pieces({"w": d}, 0, 1) is not None
    # A local shard that no longer has the box's shape: not taken (DCP's writer gets the state).
    d._local_tensor = torch.randn(3, 4)
    assert local_pieces({"w": d}, 0, 1) is None


def test_a_load_plan_takes_the_kept_box_only_for_the_same_unchanged_spec(mesh: DeviceMesh) -> None:
    from ckptkeeper.engine.flatload import FlatIndex, NotPlaced, plan_flat
    from ckptkeeper.engine.state import SavedTensor

    d = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    index = FlatIndex({"w": SavedTensor((8, 4), torch.float32)}, {})  # knows no piece of it
    for _ in range(2):  # the second plan takes the box the first one kept
        with pytest.raises(NotPlaced):
            plan_flat({"w": d}, index, 1)
    d._spec.placements = (Partial(),)  # changed in place: a pending sum has no box
    assert plan_flat({"w": d}, index, 1) is None
    d._spec.placements = (Shard(0),)
    with pytest.raises(NotPlaced):
        plan_flat({"w": d}, index, 1)  # looked at again, and kept again
    assert _BY_SPEC_ID[id(d._spec)][1] == d._spec.__dict__.get("_hash")
    d._local_tensor = torch.randn(3, 4)  # no longer the box's shape
    assert plan_flat({"w": d}, index, 1) is None
