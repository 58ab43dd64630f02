"""A rank check whose process crashes (a package that segfaults when loaded) or hangs fails once and for good.

The check runs in its own spawned process (kiln/host/phases/rank_check.check_ranks); the fault seam's
KILN_FAULT_CRASH_CHECK=1 SIGKILLs that process before it loads anything, as such a package would. The
error names the host and rank and is final: no task retries it (the verify task has none) and the flow
does not try the export again (kiln.core.run.retry_rule). No compile: the forward is never loaded.
"""

from __future__ import annotations

import pytest

from kiln.core.errors import CheckCrashed, DeadlinePassed
from kiln.core.run.retry_rule import transient, worth_retrying


def test_a_rank_check_whose_process_dies_fails_at_its_first_try(tmp_path, monkeypatch):
    from flows.params import ExportParams, prepare
    from kiln.host.phases import rank_check

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KILN_FAULT_CRASH_CHECK", "1")  # read by the check's process (tests/fault_seam)
    monkeypatch.setenv("KILN_TMP_ROOT", str(tmp_path / "tmp"))
    job, [host] = prepare(ExportParams(tp=1, store=f"file://{tmp_path / 'store'}"), host_names=["host-0"],
                          signing=False)
    from kiln.host.machine.probe import target_fingerprint

    forward = {"key": "0" * 32, "sha256": "0" * 64, "shapes": "1x8",  # never loaded: the process dies first
               "target": target_fingerprint("cpu")}
    with pytest.raises(CheckCrashed, match=r"host-0: the check of rank 0 died .*1x8") as info:
        rank_check.check_ranks(job, host, [forward])
    assert not transient(info.value) and not worth_retrying(info.value)
    assert list((tmp_path / "tmp").iterdir()) == []  # the killed process's temporary directory went with it


def test_a_rank_check_past_its_deadline_is_stopped_and_named(tmp_path, monkeypatch):
    """KILN_FAULT_HANG_CHECK=1 hangs the check's process; its deadline, derived from the check's size
    (a forward at CHECK_S_PER_FORWARD, here made short) stops it and names the rank and host."""
    from flows.params import ExportParams, prepare
    from kiln.core.plan import deadlines
    from kiln.host.phases import rank_check

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KILN_FAULT_HANG_CHECK", "1")
    monkeypatch.setattr(deadlines, "CHECK_S_PER_FORWARD", 1.0)
    job, [host] = prepare(ExportParams(tp=1, store=f"file://{tmp_path / 'store'}",
                                       recipe={"deadline_floor_s": 6.0, "deadline_margin": 1.0}),
                          host_names=["host-0"], signing=False)
    from kiln.host.machine.probe import target_fingerprint

    forward = {"key": "0" * 32, "sha256": "0" * 64, "shapes": "1x8", "target": target_fingerprint("cpu")}
    with pytest.raises(DeadlinePassed, match=r"^the check of rank 0 on host host-0 \(forwards 1x8\) did not "
                                             r"finish within 6 s \(deadline_floor_s") as info:
        rank_check.check_ranks(job, host, [forward])
    assert not transient(info.value) and not worth_retrying(info.value)
