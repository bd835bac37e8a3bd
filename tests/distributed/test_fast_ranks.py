"""The fast engine with several ranks: each rank writes its shards itself, loads read only the
pieces a rank needs at any world size (locally and with ranged object-store reads), stock DCP
reads the result, and a corrupt shard on one rank fails every rank with nothing changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptkeeper.storage import storage_for
from ckptkeeper.storage.layout import COMMIT_RECORD

from . import workers
from .spawn import run_ranks


def _ok(out: list[dict]) -> list:  # type: ignore[type-arg]
    assert all(o["ok"] for o in out), [o.get("tb", o) for o in out]
    return [o["value"] for o in out]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of trained FSDP2 state saved at 2 ranks and at 3, with whole-tensor references."""
    d = tmp_path_factory.mktemp("fast")
    for world in (2, 3):
        files = _ok(run_ranks(world, workers.save_wide, str(d / f"w{world}"), str(d / f"ref{world}.pt"),
                              out=d / f"o{world}"))  # fmt: skip
        expected = {f"model_and_optim/__{r}_0.distcp" for r in range(world)}
        expected |= {f"model_and_optim/.ckptkeeper-pieces-{r}.json" for r in range(world)}
        expected |= {f"train/rank{r}.json" for r in range(world)}
        expected |= {"model_and_optim/.metadata", "model_and_optim/.ckptkeeper-index.json"}
        assert set(files[0]) == expected
    return d


@pytest.mark.parametrize(("saved_at", "loaded_at"), [(2, 1), (2, 3), (3, 2)])
def test_resharding_through_the_fast_reader_restores_every_tensor(saved: Path, saved_at: int, loaded_at: int) -> None:
    path = str(saved / f"w{saved_at}" / "step5")
    out = run_ranks(loaded_at, workers.load_wide, path, str(saved / f"ref{saved_at}.pt"),
                    out=saved / f"l{saved_at}{loaded_at}")  # fmt: skip
    for value in _ok(out):
        assert value["equal"] and value["keys"] >= 12, value
        # Not DCP's reader: the per-piece one (the single-process reader only takes one-rank checkpoints).
        assert value["reader"] == "pieces", value


def test_stock_dcp_loads_a_multi_rank_fast_checkpoint_in_a_fresh_process(saved: Path) -> None:
    code = """
import sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
ref = torch.load(sys.argv[2], weights_only=True)
meta = dcp.FileSystemReader(sys.argv[1]).read_metadata()
want = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)}
dcp.load(want, checkpoint_id=sys.argv[1], no_dist=True)
assert set(want) == set(ref), sorted(set(want) ^ set(ref))[:5]
bad = [k for k in ref if not torch.equal(want[k], ref[k])]
assert not bad, bad[:5]
print("ok", len(want))
"""
    for world in (2, 3):
        model_dir = saved / f"w{world}" / "step5" / "model_and_optim"
        res = subprocess.run([sys.executable, "-c", code, str(model_dir), str(saved / f"ref{world}.pt")],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-2000:]


def test_a_corrupt_shard_on_one_rank_fails_every_rank_and_changes_nothing(saved: Path, tmp_path: Path) -> None:
    import shutil

    path = tmp_path / "step5"
    shutil.copytree(saved / "w2" / "step5", path)
    shard = path / "model_and_optim" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the large weight's data: same size, other bytes
    shard.write_bytes(bytes(data))
    out = _ok(run_ranks(2, workers.load_wide, str(path), str(saved / "ref2.pt"), out=tmp_path / "o"))
    for rank, value in enumerate(out):
        assert value["error"] == "CorruptCheckpointError", value
        assert value["unchanged"], value
        assert "__1_0.distcp" in value["message"] and ("rank 1" in value["message"]) == (rank == 0), value


def test_two_ranks_resume_from_s3_fetching_one_copy_in_ranged_reads(saved: Path, tmp_path: Path, s3_root: str) -> None:
    storage = storage_for(s3_root)
    src = saved / "w2" / "step5"
    # The commit record last, as a save publishes it.
    files = sorted((f for f in src.rglob("*") if f.is_file()), key=lambda f: f.name == COMMIT_RECORD)
    for f in files:
        storage.upload(str(f), f"{s3_root}/run/step5/{f.relative_to(src).as_posix()}")
    env = {k: os.environ[k] for k in os.environ if k.startswith(("AWS_", "CKPTKEEPER_"))}
    url = f"{s3_root}/run/step5"
    out = _ok(run_ranks(2, workers.load_wide, url, str(saved / "ref2.pt"), out=tmp_path / "o", env=env))
    total = out[0]["bytes"]
    for value in out:
        assert value["equal"] and value["reader"] == "pieces", value
        assert value["fetched"] <= 0.6 * total, value  # its half of the shards, the small files, no more
    assert sum(v["fetched"] for v in out) <= 1.25 * total

    # One rank without memory for a load's backup: every rank takes the download way together.
    out = _ok(run_ranks(2, workers.load_wide, url, str(saved / "ref2.pt"), out=tmp_path / "o1", env=env,
                        per_rank_env={1: {"CKPTKEEPER_STAGING_BUDGET": "16"}}))  # fmt: skip
    assert [v["reader"] for v in out] == ["download", "download"] and all(v["equal"] for v in out), out

    # A flipped byte in rank 1's shard on the store: every rank refuses, nothing changes.
    key = f"{url}/model_and_optim/__1_0.distcp"
    data = bytearray(storage.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(key, bytes(data))
    out = _ok(run_ranks(2, workers.load_wide, url, str(saved / "ref2.pt"), out=tmp_path / "o2", env=env))
    for value in out:
        assert value["error"] == "CorruptCheckpointError" and value["unchanged"], value


def test_multi_rank_loads_plan_from_the_segment_tables_and_check_them(saved: Path, tmp_path: Path) -> None:
    import json
    import shutil

    from ..helpers import forge
    from ..trust.test_hostile_files import _Dotted

    path = tmp_path / "step5"
    shutil.copytree(saved / "w2" / "step5", path)
    # DCP's .metadata is for DCP: a planted pickle there (record re-signed) is never decoded by a
    # load that the tables place, so the load succeeds and nothing runs; verify names it.
    marker = tmp_path / "pwned"
    forge(path, "model_and_optim/.metadata", _Dotted("os", "system", f"touch {marker}").dumps())
    out = _ok(run_ranks(2, workers.load_wide, str(path), str(saved / "ref2.pt"), out=tmp_path / "o"))
    assert all(v["equal"] and v["reader"] == "pieces" for v in out), out
    assert not marker.exists()
    # A table that gives a piece other sizes (rows and columns swapped): refused everywhere.
    rel = "model_and_optim/.ckptkeeper-pieces-1.json"
    table = json.loads((path / rel).read_bytes())
    kind = next(k for k in table["kinds"] if len(k[3]) == 2 and k[3][0] != k[3][1] and k[3][0] > 1)
    kind[3] = [kind[3][1], kind[3][0]]
    forge(path, rel, json.dumps(table).encode())
    out = _ok(run_ranks(2, workers.load_wide, str(path), str(saved / "ref2.pt"), out=tmp_path / "o2"))
    for value in out:
        assert value["error"] == "CorruptCheckpointError" and value["unchanged"], value
    assert not marker.exists()


def test_a_multi_rank_load_keeps_the_order_of_the_optimizers_slots(tmp_path: Path) -> None:
    # The slots came back in the segment tables' order ("step" last), so the next save's layout
    # differed from the last one's and rank 0 rebuilt DCP's metadata instead of reusing it.
    assert _ok(run_ranks(2, workers.slot_order_after_load, str(tmp_path / "run"), out=tmp_path / "o")) == [True, True]


def test_verify_checks_the_per_rank_tables_sums(saved: Path, tmp_path: Path) -> None:
    # A format-2 table re-signed with a wrong sum for intact bytes: loads trust those sums, so
    # verify must refuse it (it passed, checking only whole files and the table's structure).
    import json
    import shutil

    from ckptkeeper import Checkpointer, CorruptCheckpointError

    from ..helpers import forge

    path = tmp_path / "step5"
    shutil.copytree(saved / "w2" / "step5", path)
    Checkpointer().verify(str(path))
    rel = "model_and_optim/.ckptkeeper-pieces-1.json"
    table = json.loads((path / rel).read_bytes())
    table["sums"][-1] = "0123456789abcdef"
    forge(path, rel, json.dumps(table).encode())
    with pytest.raises(CorruptCheckpointError, match=rf"__1_0.distcp is corrupt: the bytes of {table['names'][-1]}"):
        Checkpointer().verify(str(path))
    # A kind forged to a 4 GiB piece (an outside attack: verify took 12 s and 4 GiB to refuse it)
    # is refused before anything is worked out for it.
    table = json.loads((path / rel).read_bytes())
    table["kinds"][0][1] = [1 << 30, 4]
    table["kinds"][0][2] = [0, 0]
    table["kinds"][0][3] = [1 << 30, 4]
    forge(path, rel, json.dumps(table).encode())
    with pytest.raises(CorruptCheckpointError, match="larger than the file"):
        Checkpointer().verify(str(path))


def test_a_load_at_the_saved_world_size_reads_its_own_table_and_the_shared_index(saved: Path, tmp_path: Path) -> None:
    # Every rank had read every rank's table: at 1,024 ranks of 1,000 tensors, 50 MB per rank.
    import json
    import shutil

    from ckptkeeper import Checkpointer, CorruptCheckpointError

    from ..helpers import forge

    # An index that leaves out whole pieces a rank needs (the other rank wrote them): that rank
    # plans from every table instead, and the load is still exact.
    path = tmp_path / "step5"
    shutil.copytree(saved / "w2" / "step5", path)
    rel = "model_and_optim/.ckptkeeper-index.json"
    intact = json.loads((path / rel).read_bytes())
    whole = intact["whole"]
    assert set(whole["rank"]) == {0, 1}  # AdamW's step tensors, spread over both ranks' files
    keep = [i for i, r in enumerate(whole["rank"]) if r == 0]
    cut = {**intact, "whole": {k: (v if k == "kinds" else [v[i] for i in keep]) for k, v in whole.items()}}
    forge(path, rel, json.dumps(cut).encode())
    # Both loads in one process group (the intact checkpoint first).
    outs = _ok(run_ranks(2, workers.load_wide_counting_tables_each, [str(saved / "w2" / "step5"), str(path)],
                         str(saved / "ref2.pt"), out=tmp_path / "o1"))  # fmt: skip
    for rank, (value, _) in enumerate(outs):
        assert value["equal"] and value["reader"] == "pieces", value
        assert value["tables"] == [f"__{rank}_0.distcp"], value
        assert value["lanes"] == ["flat"], value  # planned and read in columns (engine/flatload.py)
    out = [cut_load for _, cut_load in outs]
    assert all(v["equal"] for v in out), out
    assert out[0]["tables"] == ["__0_0.distcp", "__1_0.distcp"] and out[1]["tables"] == ["__1_0.distcp"], out
    # Rank 0 lacks a whole piece in the cut index: it steps aside to the general planner and reader.
    assert out[0]["lanes"] == ["general"] and out[1]["lanes"] == ["flat"], out
    # At another world size every table is read (any rank's pieces may be needed).
    out = _ok(run_ranks(3, workers.load_wide_counting_tables, str(saved / "w2" / "step5"), str(saved / "ref2.pt"),
                        out=tmp_path / "o2"))  # fmt: skip
    assert all(v["equal"] and v["tables"] == ["__0_0.distcp", "__1_0.distcp"] for v in out), out
    assert all(v["lanes"] == ["general"] for v in out), out
    # ...but verify, asked whether the files are as written, names the index (it passed before).
    with pytest.raises(CorruptCheckpointError, match="leaves out the whole piece"):
        Checkpointer().verify(str(path))

    # A damaged index is refused by verify; loads check it against each rank's own table (every
    # rank the whole pieces in its own file), agree, and plan from the tables instead: exact on
    # every rank. Outside attacks had a redirected whole piece (another tensor's bytes and
    # checksum) load wrong values on one rank, and a forged shape or an extra tensor give some
    # ranks a mismatch error while others reported corruption (and restore() then hung).
    def past_end(doc: dict) -> None:  # type: ignore[type-arg]
        doc["whole"]["start"][0] = 1 << 40

    def wrong_sum(doc: dict) -> None:  # type: ignore[type-arg]
        doc["whole"]["sums"][-1] = "0123456789abcdef"

    def other_world(doc: dict) -> None:  # type: ignore[type-arg]
        doc["world_size"] = 3

    def redirected(doc: dict) -> None:  # type: ignore[type-arg]
        w = doc["whole"]
        a, b = 0, next(i for i in range(1, len(w["names"])) if w["kind"][i] == w["kind"][0])
        for col in ("rank", "start", "sums"):
            w[col][a] = w[col][b]

    def extra_tensor(doc: dict) -> None:  # type: ignore[type-arg]
        doc["tensors"]["names"].append("model.9.weight")
        doc["tensors"]["kind"].append(0)

    def other_shape(doc: dict) -> None:  # type: ignore[type-arg]
        t = doc["tensors"]
        i = t["names"].index("model.0.weight")
        dtype, shape = t["kinds"][t["kind"][i]]
        t["kinds"].append([dtype, [shape[0] + 1, *shape[1:]]])
        t["kind"][i] = len(t["kinds"]) - 1

    damages = (past_end, wrong_sum, other_world, redirected, extra_tensor, other_shape)
    damaged = []
    for damage in damages:
        doc = json.loads(json.dumps(intact))
        damage(doc)
        copy = tmp_path / damage.__name__ / "step5"
        shutil.copytree(saved / "w2" / "step5", copy)
        forge(copy, rel, json.dumps(doc).encode())
        with pytest.raises(CorruptCheckpointError):
            Checkpointer().verify(str(copy))
        damaged.append(str(copy))
    outs = _ok(run_ranks(2, workers.load_wide_counting_tables_each, damaged, str(saved / "ref2.pt"),
                         out=tmp_path / "o-damaged"))  # fmt: skip
    for rank_out in outs:
        assert len(rank_out) == len(damages), rank_out
        for damage, value in zip(damages, rank_out, strict=True):
            assert value.get("equal") and value["tables"] == ["__0_0.distcp", "__1_0.distcp"], (damage.__name__, value)
            assert value["lanes"] == ["general"], (damage.__name__, value)
    # With strict=False nothing raises where an index invents a tensor: the tables decide what is
    # reported too (found by an outside attack: the invented tensor was reported as unexpected).
    ghost = damaged[damages.index(extra_tensor)]
    outs = _ok(run_ranks(2, workers.load_wide_counting_tables_each, [ghost], str(saved / "ref2.pt"), False,
                         out=tmp_path / "o-ghost"))  # fmt: skip
    for (value,) in outs:
        assert value["equal"] and value["lanes"] == ["general"], value
        assert value["report"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}, value


def test_verify_refuses_two_tables_for_one_data_file(saved: Path, tmp_path: Path) -> None:
    # A format-1 table listed beside the format-2 one of the same file passed verify (loads read
    # the format-2 table; a ckptkeeper that knows only format 1 reads the other).
    import shutil

    from ckptkeeper import Checkpointer, CorruptCheckpointError

    from ..helpers import forge

    path = tmp_path / "step5"
    shutil.copytree(saved / "w2" / "step5", path)
    forge(path, "model_and_optim/.ckptkeeper-layout-1.json", b'{"not": "a table"}')
    with pytest.raises(CorruptCheckpointError, match=r"two segment tables of __1_0\.distcp"):
        Checkpointer().verify(str(path))


def _format1_table(path: Path, rank: int, change: Any = None) -> bytes:
    """Rank ``rank``'s format-2 table of ``path`` rewritten as format 1 (``change`` edits its pieces)."""
    import json

    from ckptkeeper.engine.sharded import table_pieces

    name = f"__{rank}_0.distcp"
    doc = json.loads((path / f"model_and_optim/.ckptkeeper-pieces-{rank}.json").read_bytes())
    found = table_pieces(doc, name, (path / "model_and_optim" / name).stat().st_size)
    rows = [list(stored.segs[k]) for _, _, stored, _ in found for k in ("head", "data", "tail")]
    pieces = {fqn: [str(w.dtype), list(w.shape), list(st.offsets), list(st.sizes)] for fqn, w, st, _ in found}
    if change is not None:
        change(pieces)
    return json.dumps({f"model_and_optim/{name}": rows, "pieces": pieces}).encode()


def test_verify_checks_format1_boxes_and_every_table_and_index_entry_once(saved: Path, tmp_path: Path) -> None:
    # Found by an outside attack: format-1 per-rank tables with two ranks' boxes of one tensor
    # swapped (same-sized pieces) passed verify and loaded scrambled values; a single-process
    # table listed beside a per-rank one escaped the one-table check; an index listing a whole
    # piece twice passed.
    import json
    import shutil

    from ckptkeeper import Checkpointer, CorruptCheckpointError
    from ckptkeeper.engine.record import CommitRecord
    from ckptkeeper.storage.layout import COMMIT_RECORD

    from ..helpers import forge

    def fresh(name: str) -> Path:
        path = tmp_path / name / "step5"
        shutil.copytree(saved / "w3" / "step5", path)
        return path

    def as_format1(path: Path, change: dict[int, Any]) -> None:
        files = dict(CommitRecord.from_json((path / COMMIT_RECORD).read_bytes(), "test").files)
        for rank in range(3):
            forge(path, f"model_and_optim/.ckptkeeper-layout-{rank}.json", _format1_table(path, rank, change.get(rank)))
        files = dict(CommitRecord.from_json((path / COMMIT_RECORD).read_bytes(), "test").files)
        for rel in [f"model_and_optim/.ckptkeeper-pieces-{r}.json" for r in range(3)]:
            files.pop(rel)
        files.pop("model_and_optim/.ckptkeeper-index.json")
        forge(path, files=files)

    honest = fresh("honest")
    as_format1(honest, {})
    Checkpointer().verify(str(honest))  # format-1 tables as an older ckptkeeper wrote them: fine

    def at(offset: int) -> Any:
        return lambda pieces: pieces["model.0.bias"].__setitem__(2, [offset])

    swapped = fresh("swapped")
    assert json.loads(_format1_table(swapped, 1))["pieces"]["model.0.bias"][2:] == [[171], [171]]
    as_format1(swapped, {0: at(171), 1: at(0)})
    with pytest.raises(CorruptCheckpointError, match=r"model\.0\.bias"):
        Checkpointer().verify(str(swapped))

    beside = fresh("beside")
    forge(beside, "model_and_optim/.ckptkeeper-layout.json", _format1_table(beside, 0))
    with pytest.raises(CorruptCheckpointError, match=r"two segment tables of __0_0\.distcp"):
        Checkpointer().verify(str(beside))

    twice = fresh("twice")
    rel = "model_and_optim/.ckptkeeper-index.json"
    doc = json.loads((twice / rel).read_bytes())
    for column in ("names", "kind", "rank", "start", "sums"):
        doc["whole"][column].append(doc["whole"][column][0])
    forge(twice, rel, json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match="twice"):
        Checkpointer().verify(str(twice))


def test_hsdp_states_save_and_load_exactly_at_any_world_size(tmp_path: Path) -> None:
    # HSDP (replicated over one mesh dimension, sharded over the other) was untested: each shard
    # is written by one of its replicas, so at the saved world size half the ranks read their
    # shards from another rank's file. 4 ranks on a 2 x 2 mesh, loaded back at 4 (the same mesh)
    # and under plain FSDP2 at 2 and 1: every tensor exact, through the piece reader.
    folder, ref = tmp_path / "hsdp", tmp_path / "ref.pt"
    files = _ok(run_ranks(4, workers.save_wide, str(folder), str(ref), "hsdp", out=tmp_path / "o-save"))
    assert all(f == files[0] for f in files)
    assert {f"model_and_optim/__{r}_0.distcp" for r in range(4)} <= set(files[0])
    for world in (4, 2, 1):
        out = _ok(run_ranks(world, workers.load_wide, str(folder / "step5"), str(ref), "hsdp",
                            out=tmp_path / f"o{world}"))  # fmt: skip
        for value in out:
            assert value["equal"] and value["reader"] == "pieces", (world, value)


@pytest.mark.parametrize("world", [2, 3])
def test_when_one_rank_finds_corruption_every_rank_raises_it(tmp_path: Path, world: int) -> None:
    # Ranks that failed a load round for different reasons (or, at 3 ranks, one that succeeded)
    # raised different classes, so a caller that falls back to an earlier checkpoint on
    # corruption (restore) sent them different ways (found by outside attacks).
    out = _ok(run_ranks(world, workers.load_round_with_different_failures, out=tmp_path / "o"))
    assert out == ["CorruptCheckpointError"] * world


def test_a_rank_that_dies_while_the_ranks_vote_on_the_index_is_named(saved: Path, tmp_path: Path) -> None:
    # The vote on planning from the shared index was a bare collective: the survivor got gloo's
    # "Connection reset by peer" instead of the rank that stopped (found by an outside attack).
    out = run_ranks(2, workers.load_wide_while_rank_one_dies_planning, str(saved / "w2" / "step5"),
                    out=tmp_path / "o", expect_dead=frozenset({1}), timeout=120)  # fmt: skip
    assert out[1]["type"] == "dead", out[1]
    survivor = _ok([out[0]])[0]
    assert survivor["error"] == "CheckpointError" and survivor["unchanged"], survivor
    assert "rank 1 stopped answering during the load" in survivor["message"], survivor


def test_the_quick_model_state_dict_is_dcps_on_an_fsdp2_model(tmp_path: Path) -> None:
    assert _ok(run_ranks(2, workers.compare_model_state_dicts, out=tmp_path / "o")) == [True, True]


def test_checkpoint_names_follow_a_swapped_submodule(tmp_path: Path) -> None:
    # Found by an outside attack: names kept per model went stale when a DDP child was replaced
    # by another module under the same attribute, and saves then used keys DCP does not.
    ((first, ours, dcps),) = _ok(run_ranks(1, workers.names_after_a_swap, out=tmp_path / "o"))
    assert first == ["enc.weight", "enc.bias"]
    assert ours == dcps == ["enc.module.weight", "enc.module.bias"]
    # A second attack: the same module objects re-bound under each other's names.
    ((ours, dcps),) = _ok(run_ranks(1, workers.names_after_rebinding, out=tmp_path / "o2"))
    assert ours == dcps
    assert set(ours) == {"b.weight", "b.bias", "a.module.weight", "a.module.bias"}


def test_tables_that_disagree_with_the_data_or_the_metadata_are_caught_before_anything_changes(
    saved: Path, tmp_path: Path
) -> None:
    # Found by an outside attack (both record-re-signing forgeries):
    import json
    import shutil

    from ckptkeeper import Checkpointer, CorruptCheckpointError

    from ..helpers import forge

    tables = [f"model_and_optim/.ckptkeeper-pieces-{r}.json" for r in (0, 1)]
    # 1. Two ranks' offsets for one tensor swapped (same sizes, same bytes): verify compared each
    #    piece with any box DCP's metadata has for the tensor, not the one kept in that file.
    path = tmp_path / "swapped" / "step5"
    shutil.copytree(saved / "w2" / "step5", path)
    docs = [json.loads((path / rel).read_bytes()) for rel in tables]
    kinds = [{n: d["kinds"][k] for n, k in zip(d["names"], d["kind"], strict=True)} for d in docs]
    fqn = next(f for f in kinds[0] if f in kinds[1] and kinds[0][f][3] == kinds[1][f][3]
               and kinds[0][f][2] != kinds[1][f][2])  # fmt: skip
    for doc, other in zip(docs, reversed(kinds), strict=True):
        # A kind of its own for the piece, with the other rank's offsets.
        mine = doc["kinds"][doc["kind"][doc["names"].index(fqn)]]
        doc["kinds"].append([mine[0], mine[1], other[fqn][2], mine[3]])
        doc["kind"][doc["names"].index(fqn)] = len(doc["kinds"]) - 1
    for rel, doc in zip(tables, docs, strict=True):
        forge(path, rel, json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match="DCP's metadata has another"):
        Checkpointer().verify(str(path))

    # 2. A data checksum in rank 1's table that is wrong for intact bytes, loaded by ranks with no
    #    room for a backup (one of them, then both): every segment is checked before any write.
    path = tmp_path / "badsum" / "step5"
    shutil.copytree(saved / "w2" / "step5", path)
    doc = json.loads((path / tables[1]).read_bytes())
    doc["sums"][-1] = "0" * 16
    forge(path, tables[1], json.dumps(doc).encode())
    for budgets in ({1: {"CKPTKEEPER_STAGING_BUDGET": "16"}},
                    {r: {"CKPTKEEPER_STAGING_BUDGET": "16"} for r in (0, 1)}):  # fmt: skip
        out = _ok(run_ranks(2, workers.load_wide, str(path), str(saved / "ref2.pt"), out=tmp_path / "o",
                            per_rank_env=budgets))  # fmt: skip
        for value in out:
            assert value["error"] == "CorruptCheckpointError" and value["unchanged"], value
    # 3. (a second attack) The damage only in what a rank with a backup reads (rank 0's own first
    #    shard), the other rank without room for one: it must not have written when rank 0 finds it.
    path = tmp_path / "badsum0" / "step5"
    shutil.copytree(saved / "w2" / "step5", path)
    doc = json.loads((path / tables[0]).read_bytes())
    doc["sums"][0] = "0" * 16
    forge(path, tables[0], json.dumps(doc).encode())
    out = _ok(run_ranks(2, workers.load_wide, str(path), str(saved / "ref2.pt"), out=tmp_path / "o3",
                        per_rank_env={1: {"CKPTKEEPER_STAGING_BUDGET": "16"}}))  # fmt: skip
    for value in out:
        assert value["error"] == "CorruptCheckpointError" and value["unchanged"], value


def test_tied_weights_load_and_are_checked_on_the_bytes_read_at_two_ranks(tmp_path: Path) -> None:
    # Found by an outside attack on the scatter reads: two names sharing memory were both read
    # into it before either was checked, so an intact untied checkpoint was refused as corrupt
    # and a damaged first copy passed under its twin's bytes.
    for value in _ok(run_ranks(2, workers.load_tied_weights, str(tmp_path / "c"), out=tmp_path / "o")):
        assert all(value["later"]), value
        assert value["damaged"], "no tied pair had both copies in one file"
        assert f"{value['damaged']} (data)" in value["error"] and value["unchanged"], value


def test_parameters_that_are_lazy_conjugates_or_negations_load_their_values(tmp_path: Path) -> None:
    # Found by an outside attack: the multi-rank readers copied raw bytes into a parameter whose
    # memory holds the conjugated (or negated) values, so it read back conjugated, silently.
    for value in _ok(run_ranks(2, workers.load_into_lazy_views, str(tmp_path / "c"), out=tmp_path / "o")):
        assert value == {"c": True, "n": True, "still_lazy": True}, value


def test_saves_of_the_same_tensors_reuse_their_plans_and_hold_the_state_of_their_step(tmp_path: Path) -> None:
    for value in _ok(run_ranks(2, workers.saves_reusing_plans, str(tmp_path / "ck"), out=tmp_path / "o")):
        # Hits and misses after step 5, then after steps 6 and 7: the sync saves of steps 2 and 5
        # and the async save of step 4 reuse a plan; the first save after the load plans anew.
        # Rank 0 took both ranks' layouts from their tokens at steps 2, 4 and 5 (6 layouts); at
        # step 7 it had lost them, asked both ranks again, and the checkpoint is still whole.
        hits_misses = value["counts"][:2] + value["counts"][2:4]
        assert hits_misses == [3, 2, 4, 3], value
        assert value["counts"][4:] == ([6, 2] if value["rank"] == 0 else [0, 0]), value
        assert all(value["loaded"].values()) and len(value["loaded"]) == 7, value
        assert value["by_dcp"], value


def test_a_hook_that_recasts_the_model_during_a_reused_save_gets_a_whole_checkpoint(tmp_path: Path) -> None:
    # Found by an outside attack: the save was planned again after the hook, but its layout still
    # went to rank 0 by the old plan's token, so DCP's metadata and the shared index described
    # float32 pieces in a file of float64 ones (verify failed; stock DCP could not read it).
    out = run_ranks(2, workers.hook_casts_the_model_during_a_save, str(tmp_path / "ck"), out=tmp_path / "o")
    for value in _ok(out):
        assert value == {"verified": True, "loaded": True, "by_dcp": True}, value


def test_a_load_in_one_ranks_sync_save_hook_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    # Found by an outside attack: load() from a synchronous save's on_stage hook on one rank went
    # through there, and the other rank waited in the save's exchange until the process group's
    # timeout. Refused before anything changes, the error reaches every rank together.
    out = run_ranks(2, workers.load_inside_a_sync_save_on_one_rank, str(tmp_path / "ck"), out=tmp_path / "o",
                    timeout=120)  # fmt: skip
    _failed_everywhere(_ok(out), ("Checkpointer.load()", "inside a synchronous save"), [1, 3])


def _failed_everywhere(values: list[dict[str, Any]], named: tuple[str, ...], steps: list[int]) -> None:
    """Every rank's save or load failed with nothing changed, rank 1's error saying each of
    ``named``, and each rank then found the checkpoints of ``steps``."""
    assert all(n in values[1]["error"] for n in named), values
    for value in values:
        assert value["error"] and value["unchanged"] and value["steps"] == steps, value


@pytest.mark.parametrize("how", ["sync", "async", "load"])
def test_a_shard_whose_memory_was_shrunk_on_one_rank_fails_every_rank(tmp_path: Path, how: str) -> None:
    # A local shard whose storage was resized under it (as FSDP2 does to unsharded parameters)
    # was written from past its memory's end (or read into it), here after a save whose plan the
    # next one would have reused.
    out = run_ranks(2, workers.shrunk_shard_on_one_rank, str(tmp_path / "ck"), how, out=tmp_path / "o", timeout=120)
    _failed_everywhere(_ok(out), ("0.weight", "storage"), [1, 2])


@pytest.mark.parametrize("what", ["save", "load", "exit"])
def test_an_interrupt_on_one_rank_fails_the_others_instead_of_leaving_them_waiting(tmp_path: Path, what: str) -> None:
    # A KeyboardInterrupt (Ctrl-C, or raised by a hook) inside one rank's part of a save or load
    # skipped that rank's exchange of outcomes: the other ranks waited in it until the process
    # group's timeout. The interrupted rank now reports it before raising it as itself.
    out = run_ranks(2, workers.interrupted_on_one_rank, str(tmp_path / "ck"), what, out=tmp_path / "o", timeout=120)
    zero, one = _ok(out)
    kind = "SystemExit" if what == "exit" else "KeyboardInterrupt"
    assert one["seen"] == kind, one
    assert "rank 1" in zero["seen"] and kind in zero["seen"], zero  # (SystemExit(3) said only "3")
    for value in (zero, one):
        assert value["unchanged"] and value["steps"] == [1, 3], value


@pytest.mark.parametrize(
    ("kind", "background"),
    [
        ("sparse", False),
        ("shrunk", False),
        ("meta", True),
        ("no memory", True),
        ("state_dict raises", False),
        ("state_dict raises", True),
        ("train state", False),
        ("train state", True),
    ],
)
def test_a_tensor_one_rank_cannot_save_fails_every_rank_on_the_dcp_and_staging_paths(
    tmp_path: Path, kind: str, background: bool
) -> None:
    # Found by an outside attack: refused on rank 1 just before DCP's writer, while rank 0 went
    # into DCP's own collectives (both waited until the timeout); a meta tensor failed staging
    # after the ranks had agreed to save, so rank 0's background save ran alone. So did any
    # other failure of the staging copy there (host memory running out, say). An extra whose
    # state_dict() failed, or a train_state that cannot be stored, on one rank only, failed that
    # rank before the first exchange: the others' save then paired with its next one.
    out = run_ranks(2, workers.unsaveable_extra_on_one_rank, str(tmp_path / "ck"), kind, background,
                    out=tmp_path / "o", timeout=120)  # fmt: skip
    zero, one = _ok(out)
    named = {
        "no memory": "allocate memory",
        "state_dict raises": "state_dict failed",
        "train state": "the train_state cannot be stored",
    }
    assert named.get(kind, "extra.b.t") in one["error"], one
    assert "rank 1" in zero["error"] or "another rank" in zero["error"], zero
    for value in (zero, one):
        assert value["steps"] == [2], value


@pytest.mark.parametrize(("kind", "named"), [("sparse", "sparse_csr"), ("nested", "a nested tensor")])
def test_an_unsaveable_extra_on_one_rank_is_refused_by_name_with_the_per_rank_writer(
    tmp_path: Path, kind: str, named: str
) -> None:
    # With the per-rank writer chosen by default too (the test above uses DCP's): torch calls a CSR
    # tensor not "sparse" (is_sparse is for COO only), so the per-rank path keeps it out by layout;
    # a nested tensor has no shape to ask (it failed there with torch's words; found by an outside attack).
    out = run_ranks(2, workers.unsaveable_extra_on_one_rank, str(tmp_path / "ck"), kind, False, "auto",
                    out=tmp_path / "o", timeout=120)  # fmt: skip
    zero, one = _ok(out)
    assert "extra.b.t" in one["error"] and named in one["error"], one
    assert "rank 1" in zero["error"] or "another rank" in zero["error"], zero
    assert zero["steps"] == one["steps"] == [2]


@pytest.mark.parametrize("what", ["save", "load", "failing load"])
def test_ctrl_c_while_a_rank_waits_in_an_exchange_ends_the_save_alike_on_every_rank(tmp_path: Path, what: str) -> None:
    # Found by an outside attack: a real SIGINT interrupted the wait inside the exchange itself,
    # leaving it half done: the other rank waited until the timeout (or aborted on the next,
    # mismatched collective). Held until the save or load ends on every rank, then raised.
    out = run_ranks(2, workers.ctrl_c_while_waiting_in_an_exchange, str(tmp_path / "ck"), what, out=tmp_path / "o",
                    timeout=120)  # fmt: skip
    zero, one = _ok(out)
    # A load that failed everywhere still stops the interrupted rank (a restore would otherwise
    # go on to the next checkpoint as if Ctrl-C had not been pressed).
    failed = "CorruptCheckpointError" if what == "failing load" else ""
    assert (zero["seen"], one["seen"]) == (failed, "KeyboardInterrupt"), (zero, one)
    for value in (zero, one):
        assert value["steps"] == ([1, 2, 3] if what == "save" else [1, 3]), value


def test_ctrl_c_in_one_ranks_staging_copy_is_raised_after_the_save_is_handed_over(tmp_path: Path) -> None:
    # Found by reading save_async after the staging failure above: a Ctrl-C inside rank 1's
    # staging copy (after the ranks agreed to save) was raised there at once, and rank 0's
    # background save waited for rank 1 in its first exchange, which rank 1's next save then
    # entered with the wrong step.
    out = run_ranks(2, workers.ctrl_c_while_staging, str(tmp_path / "ck"), out=tmp_path / "o", timeout=120)
    zero, one = _ok(out)
    assert (zero["seen"], one["seen"]) == ("", "KeyboardInterrupt"), (zero, one)
    for value in (zero, one):
        assert value["steps"] == [1, 2], value


@pytest.mark.parametrize(
    "how", ["manager sync", "manager async", "interrupt", "nan metric", "resave", "manager resave", "manager fsdp1"]
)
def test_a_state_one_rank_cannot_take_fails_the_save_on_every_rank(tmp_path: Path, how: str, request: Any) -> None:
    # Found by an outside attack: raised on one rank before the save's first exchange (the
    # manager's json_state, an interrupt from a state_dict(), a NaN metric), the other ranks'
    # save went on and paired with that rank's next one (the async manager hung); and handed
    # to the save's first round, rank 0 had already cleared an object store's copy of the step
    # being saved again (the checkpoint was lost). Then, by a third: a re-save through the
    # manager looked for the step's checkpoint in a collective on one rank only (its error was a
    # save error, the failing rank's not), and an FSDP1 capture's own collectives met the first
    # exchange of a rank that skipped its capture.
    folder = request.getfixturevalue("s3_root") if how == "resave" else str(tmp_path / "ck")
    out = run_ranks(2, workers.state_fails_on_one_rank, folder, how, out=tmp_path / "o", timeout=120)
    zero, one = _ok(out)
    named = {"interrupt": "KeyboardInterrupt", "nan metric": "loss"}.get(how, "state_dict failed here")
    assert named in one["error"], one
    assert "another rank" in zero["error"] or "rank 1" in zero["error"], zero
    for value in (zero, one):
        # The manager saves step 0 as it starts (the pre-train checkpoint).
        want = ([0] if how.startswith("manager") else []) + ([1, 2] if how.endswith("resave") else [2])
        assert value["steps"] == want, value
