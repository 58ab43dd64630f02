"""A rank of `kiln verify` or `kiln run` that dies posts nothing: spawn_ranks notices its exit within
seconds, names it, and stops the other ranks (which would wait on it in gloo forever).

The ranks here are stand-ins without torch (kiln.host.ranks.verify_ranks.spawn_ranks runs any target): one
dies as a segfault or the OOM killer would end it, the other waits as a rank blocked in a collective.
`kiln verify` itself under the same fault: tests/integration/test_export.py.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from kiln.core.errors import RankDied, RanksTimedOut
from kiln.host.ranks.verify_ranks import spawn_ranks


def _rank(rank: int, tp: int, rendezvous: str, job: dict, link) -> None:
    """Rank 1 ends as job['how'] says while 'running forward 1x16'; rank 0 waits (as in gloo) or, with
    job['echo'], reports the error a peer's death causes in gloo once rank 1 is gone."""
    Path(job["dir"], f"rank-{rank}.started").touch()
    if rank == 1:
        link.doing("running forward 1x16")
        if job["how"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if job["how"] == "exit 0":
            os._exit(0)
        time.sleep(600)
    link.doing("waiting in all_gather")
    if job.get("echo"):
        while not Path(job["dir"], "rank-1.started").exists():
            time.sleep(0.05)
        time.sleep(0.3)
        raise RuntimeError("[gloo] Connection closed by peer")
    time.sleep(600)


def _ranks_left() -> list[int]:
    """Pids of this process's spawned children still running (ranks; not multiprocessing's resource tracker)."""
    left = []
    for child in psutil.Process().children():
        try:
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                left.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.parametrize("how, said", [("kill", "signal SIGKILL (-9)"), ("exit 0", "exit code 0")])
def test_a_dead_rank_ends_the_wait_named_and_the_others_are_stopped(tmp_path, how, said):
    start = time.monotonic()
    with pytest.raises(RankDied) as caught:
        spawn_ranks(_rank, 2, {"dir": str(tmp_path), "how": how}, timeout_s=120)
    assert time.monotonic() - start < 30
    assert str(caught.value).startswith(f"rank 1 died with {said} while running forward 1x16; "
                                        "the other rank was stopped.")
    assert not _ranks_left(), "rank 0 was left waiting"


def test_a_peers_error_after_a_death_reports_the_death(tmp_path):
    # A long poll: rank 0's error comes before spawn_ranks would look at the exit codes by itself.
    with pytest.raises(RankDied, match=r"^rank 1 died with signal SIGKILL \(-9\) while running forward 1x16"):
        spawn_ranks(_rank, 2, {"dir": str(tmp_path), "how": "kill", "echo": True}, timeout_s=120, poll_s=60)


def test_ranks_that_hang_time_out_saying_what_each_was_doing(tmp_path):
    # What each says, unless the machine is too busy to start them in 3 s (kiln.core.run.rank_exit's own test).
    with pytest.raises(RanksTimedOut, match=r"^the ranks did not finish within 3 s \(rank 0 (waiting in all_gather|"
                                            r"had not started), rank 1 (running forward 1x16|had not started)\); "
                                            r"they were stopped"):
        spawn_ranks(_rank, 2, {"dir": str(tmp_path), "how": "hang"}, timeout_s=3)
    assert not _ranks_left()


def test_the_rank_fault_fires_only_for_its_rank_and_text(monkeypatch):
    from kiln.host.processes import faults  # the seam is installed in this process (tests/conftest.py)

    monkeypatch.setenv("KILN_FAULT_KILL_RANK", "1:running forward")
    faults.point("rank", 0, "running forward 1x16")  # another rank: this process lives on
    faults.point("rank", 1, "loading weights")
    monkeypatch.setenv("KILN_FAULT_KILL_RANK", "running forward")
    with pytest.raises(ValueError, match="expected RANK:MATCH"):
        faults.point("rank", 1, "running forward 1x16")
