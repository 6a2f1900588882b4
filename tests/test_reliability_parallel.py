"""The launcher when a rank fails: the failing rank's own exception comes back with its
traceback, not the "Connection reset by peer" its peers then meet in a collective."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmnote.parallel import launch, workers
from llmnote.parallel.launcher import RankTraceback


def test_the_failing_ranks_own_exception_is_raised():
    failing_rank = 1  # rank 0 then fails in the all-reduce, and used to be reported
    t0 = time.monotonic()
    with pytest.raises(workers.RankFailure, match=f"rank {failing_rank} failed on purpose") as info:
        launch(workers.fail_in_rank, 2, failing_rank, timeout_s=60)
    assert time.monotonic() - t0 < 30  # the peer waiting in the all-reduce is not waited for
    cause = info.value.__cause__
    assert isinstance(cause, RankTraceback)
    text = str(cause)
    assert f"in rank {failing_rank} of 2" in text
    assert "in fail_in_rank" in text
    assert 'raise RankFailure(f"rank {rank} failed on purpose")' in text


def test_a_keyboard_interrupt_in_a_rank_is_reported_as_such():
    with pytest.raises(RuntimeError, match="rank 0 of 2 raised KeyboardInterrupt") as info:
        launch(workers.fail_in_rank, 2, 0, "interrupt", timeout_s=60)
    assert "raise KeyboardInterrupt" in str(info.value.__cause__)


def exit_in_rank(rank: int, world_size: int, failing_rank: int) -> int:
    """Rank ``failing_rank`` dies without a Python exception (as a signal or the OOM
    killer would end it) while its peers wait in an all-reduce; they then fail there
    ("Connection closed by peer") and record that echo."""
    if rank == failing_rank:
        time.sleep(0.2)  # let the peers enter the collective first
        os._exit(7)
    # the peers finish recording their echo even when the launcher is quick to stop them
    # (as a peer busy in C code, or a slow parent, lets them): the race made certain
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.all_reduce(torch.ones(4))
    return rank


def close_then_exit_late(rank: int, world_size: int, failing_rank: int) -> int:
    """Rank ``failing_rank`` closes its connections while its peers wait in an all-reduce
    (they record the echo at once) and dies 1 s later: the parent sees the echo first."""
    if rank == failing_rank:
        time.sleep(0.2)
        dist.destroy_process_group()
        time.sleep(1.0)
        os._exit(7)
    dist.all_reduce(torch.ones(4))
    return rank


def test_a_death_seen_after_its_peers_echo_is_still_the_cause():
    # without the launcher's grace for echo-only failures this reported rank 0's
    # "Connection closed by peer"
    with pytest.raises(mp.ProcessExitedException,
                       match="process 1 terminated with exit code 7"):
        launch(close_then_exit_late, 2, 1, timeout_s=60)


def test_a_rank_that_dies_without_an_exception_is_reported_not_its_peers_echo():
    # the peer's record of the closed connection, written after the death, used to win
    for _ in range(3):
        t0 = time.monotonic()
        with pytest.raises(mp.ProcessExitedException,
                           match="process 1 terminated with exit code 7") as info:
            launch(exit_in_rank, 2, 1, timeout_s=60)
        assert time.monotonic() - t0 < 30
        assert info.value.error_index == 1 and info.value.exit_code == 7
