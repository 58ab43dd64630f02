"""How `make test` splits the suite over two pytest-xdist workers (`-n 2 --dist loadgroup`).

On 2 cores one worker leaves a core idle most of the time: a compile, torch's
import and Inductor are one process each, and many tests wait on servers, leases
and retries (measured: 45 % of the CPU idle over a serial run). Two workers fill
it. What a worker runs is a group, never split between the workers:

- the tests of one module (its module fixtures are made once);
- every test that reads the session's tp 2 export (`tp2_export`: default buckets
  compiled cold on the embedded API), or the session's one-layer package
  (`small_forward`): made on one worker only;
- everything under tests/ops/ (one PostgreSQL cluster and Prefect server).

The groups are handed out longest first (HEAVIEST, then collection order), so
the last ones to run are short and the two workers end close together.
"""

from __future__ import annotations

import pytest

SHARED = ("tp2_export", "small_forward")
"""Session fixtures too costly to make on both workers: a test that uses one is in that fixture's group."""

HEAVIEST = ("ops", "tp2_export", "tests/reference/test_export_run.py", "tests/bench/test_bench_quick.py",
            "tests/integration/test_incident.py", "tests/integration/test_faults_cluster.py",
            "tests/faults/test_compile_pool_kill.py", "tests/faults/test_s3_proxy.py",
            "tests/tuning/test_tuning_export.py", "tests/integration/test_s3_model.py",
            "tests/faults/test_compile_kill_export.py", "tests/faults/test_killed_export_lease.py")
"""Groups that take minutes (docs/testing.md's slowest), in the order they are handed out."""


def group_of(item: pytest.Item) -> str:
    path = item.nodeid.split("::", 1)[0]
    if path.startswith("tests/ops/"):
        return "ops"
    for fixture in SHARED:
        if fixture in item.fixturenames:
            return fixture
    return path


def assign(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each item with its group and order the items heaviest group first (stable within a group)."""
    if not config.pluginmanager.hasplugin("xdist") or config.getoption("dist", "no") != "loadgroup":
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item)))
    rank = {name: i for i, name in enumerate(HEAVIEST)}
    items.sort(key=lambda item: rank.get(group_of(item), len(rank)))
