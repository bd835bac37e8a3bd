"""A rank that dies mid-save: the survivors fail, and their error names the rank that stopped answering
(not the transport's "Connection reset by peer", which stays in the exception chain)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptkeeper import Checkpointer
from ckptkeeper import distributed as D
from ckptkeeper.engine.agreement import lost_rank_error
from ckptkeeper.errors import CheckpointError, CheckpointSaveError

from . import dead_rank_workers, workers
from .spawn import run_ranks

GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:41659: Connection reset "
    "by peer. This is typically caused by a remote worker hanging or bugs in the application."
)
GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
    "operation to complete"
)


@pytest.mark.parametrize(
    ("exc", "lost"),
    [
        (RuntimeError(GLOO_RESET), True),
        (RuntimeError(GLOO_TIMEOUT), True),
        (RuntimeError("[pair.cc:598] Connection closed by peer [10.0.0.7]:5012"), True),
        (RuntimeError("Input tensor sizes must be equal"), False),
        (OSError(5, "Input/output error"), False),
    ],
)
def test_peer_lost_tells_a_vanished_peer_from_an_own_failure(exc: BaseException, lost: bool) -> None:
    assert D.peer_lost(exc) is lost


def test_lost_peer_reads_the_address_from_gloos_message() -> None:
    assert D.lost_peer(RuntimeError(GLOO_RESET)) == (None, "127.0.0.1:41659")
    assert D.lost_peer(RuntimeError("Connection closed by peer [::1]:5012")) == (None, "[::1]:5012")
    assert D.lost_peer(RuntimeError(GLOO_TIMEOUT)) == (None, None)


def test_the_lost_rank_message_says_what_happened_and_what_to_do() -> None:
    # Outside a 2-rank group the silent rank cannot be told: the message says it was another one.
    err = lost_rank_error(RuntimeError(GLOO_RESET), 4, None)
    assert isinstance(err, CheckpointSaveError)
    msg = str(err)
    assert msg.startswith("step 4: another rank (not this rank 0) stopped answering during the save")
    assert "127.0.0.1:41659" in msg and "restart the job" in msg and "Connection reset" not in msg
    timed_out = str(lost_rank_error(RuntimeError(GLOO_TIMEOUT), 4, None))
    assert "timed out waiting for it" in timed_out
    load = lost_rank_error(RuntimeError(GLOO_RESET), None, None, loading=True)
    assert type(load) is CheckpointError and "during the load" in str(load) and "step" not in str(load)


def test_the_survivor_of_two_names_the_rank_that_died_mid_save(tmp_path: Path) -> None:
    out = run_ranks(2, workers.train_while_a_rank_dies, str(tmp_path / "run"), out=tmp_path / "o",
                    expect_dead=frozenset({1}), timeout=120)  # fmt: skip
    assert out[1]["type"] == "dead" and out[1]["exitcode"] == 9
    survivor = out[0]
    assert survivor["type"] == "CheckpointSaveError", survivor
    assert survivor["error"].startswith("step 4: rank 1 stopped answering during the save"), survivor["error"]
    assert "Connection reset by peer" not in survivor["error"]
    assert "rank 0" not in survivor["error"]  # the survivor does not blame itself
    assert [s for s, _ in Checkpointer().find_checkpoints(str(tmp_path / "run"))] == [0]


def test_rank_zero_dying_is_named_by_rank_one(tmp_path: Path) -> None:
    out = run_ranks(2, dead_rank_workers.train_while_one_rank_dies, str(tmp_path / "run"), 0, out=tmp_path / "o",
                    expect_dead=frozenset({0}), timeout=120)  # fmt: skip
    assert out[0]["type"] == "dead", out[0]
    assert out[1]["type"] == "CheckpointSaveError", out[1]
    assert out[1]["error"].startswith("step 4: rank 0 stopped answering during the save"), out[1]["error"]


def test_with_three_ranks_the_survivors_say_another_rank_stopped(tmp_path: Path) -> None:
    out = run_ranks(3, dead_rank_workers.train_while_one_rank_dies, str(tmp_path / "run"), 2, out=tmp_path / "o",
                    expect_dead=frozenset({2}), timeout=120)  # fmt: skip
    assert out[2]["type"] == "dead", out[2]
    for r in (0, 1):
        assert out[r]["type"] == "CheckpointSaveError", out[r]
        msg = out[r]["error"]
        assert msg.startswith(f"step 4: another rank (not this rank {r}) stopped answering during the save"), msg
        assert "Connection reset by peer" not in msg
    assert [s for s, _ in Checkpointer().find_checkpoints(str(tmp_path / "run"))] == [0]
