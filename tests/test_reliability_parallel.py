"""The launcher when a rank fails: the failing rank's own exception comes back with its
traceback, not the "Connection reset by peer" its peers then meet in a collective."""

from __future__ import annotations

import time

import pytest

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
