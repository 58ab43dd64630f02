"""A rank check whose process crashes (a package that segfaults when loaded) fails once and for good.

The check runs in its own spawned process (kiln/host/phases/rank_check.check_ranks); the fault seam's
KILN_FAULT_CRASH_CHECK=1 SIGKILLs that process before it loads anything, as such a package would. The
error names the host and rank and is final: no task retries it (the verify task has none) and the flow
does not try the export again (kiln.core.run.retry_rule). No compile: the forward is never loaded.
"""

from __future__ import annotations

import pytest

from kiln.core.errors import CheckCrashed
from kiln.core.run.retry_rule import transient, worth_retrying


def test_a_rank_check_whose_process_dies_fails_at_its_first_try(tmp_path, monkeypatch):
    from flows.params import ExportParams, prepare
    from kiln.host.phases import rank_check

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KILN_FAULT_CRASH_CHECK", "1")  # read by the check's process (tests/fault_seam)
    job, [host] = prepare(ExportParams(tp=1, store=f"file://{tmp_path / 'store'}"), host_names=["host-0"],
                          signing=False)
    from kiln.host.machine.probe import target_fingerprint

    forward = {"key": "0" * 32, "sha256": "0" * 64, "shapes": "1x8",  # never loaded: the process dies first
               "target": target_fingerprint("cpu")}
    with pytest.raises(CheckCrashed, match=r"host-0: the check of rank 0 died .*1x8") as info:
        rank_check.check_ranks(job, host, [forward])
    assert not transient(info.value) and not worth_retrying(info.value)
