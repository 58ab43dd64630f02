"""What a new user sees: a fresh `kiln export` is quiet, and a refusal is final and as fast as `kiln plan`."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

pytestmark = pytest.mark.slow

NOISE = ("Traceback", "FutureWarning", "Warning", "WARNING", "ERROR", "database is locked", "telemetry")


def test_fresh_export_prints_progress_and_summary_only(tp2_export):
    # The session's cold `kiln export --model tiny --tp 2` (tests/conftest.py): a fresh Prefect home (a new
    # SQLite database) and none of the test suite's Prefect settings, so what Kiln sets by itself is
    # what is tested; the same export, not another one compiling the same four forwards.
    run = tp2_export["cold"]
    output = run.out + run.err
    assert run.code == 0, output[-3000:]
    for word in NOISE:
        assert word not in output, f"{word!r} in a fresh export's output:\n{output[-3000:]}"
    assert "Compile forwards: 2/2 (all hosts" in run.err  # Kiln's progress line
    assert re.search(r"^export \S+: completed$", run.out, re.M)  # and its summary
    assert "Task run" not in output and "Flow run" not in output  # Prefect's INFO lines stay off the console
    assert tp2_export["cold_report"]["status"] == "completed"


def _timed(kiln, *args) -> tuple[float, object]:
    start = time.monotonic()
    run = kiln(*args)
    return time.monotonic() - start, run


def test_refusal_is_final_and_as_fast_as_plan(kiln, tmp_path):
    """The recipe's defaults (flow_retries 2, 30 s apart): a retried refusal would take a minute more."""
    args = ["--model", "tiny", "--tp", "2", "--store", f"file://{tmp_path / 'store'}", "--policy", "fail",
            "--set", "headroom_floor_mib=10000000"]
    plan_s, plan = _timed(kiln, "plan", *args)
    export_s, run = _timed(kiln, "export", *args, "--report", str(tmp_path / "r.json"))
    assert plan.code == 3 and run.code == 3, run.err[-3000:]
    assert export_s < 3 * plan_s, f"kiln export took {export_s:.1f} s to refuse, kiln plan {plan_s:.1f} s"
    host = socket.gethostname()
    assert f"{host} is " in run.err and "MiB short of one compile worker" in run.err and "Traceback" not in run.err
    # The same sentence as kiln plan's (the MiB figures are read afresh by each).
    said = re.search(r"^gate: refused: (.*)$", plan.out, re.M)[1]
    assert re.sub(r"\d+", "N", said) in re.sub(r"\d+", "N", run.err)
    assert "no flow run was started" in run.err
    assert "Beginning flow run" not in run.err and "try 2 of" not in run.err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["status"] == "failed" and "MiB short" in r["error"]
    assert r["gate"]["decision"] == "refused" and r["gate"]["decided_in"] == "cli"
    assert [p["name"] for p in r["phases"]] == ["probe", "tune", "kv-plan", "gate"]
    assert [m["phase"] for m in r["hosts"][0]["memory"]] == ["start", "probe", "tune", "kv-plan"]
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("*.pt2"))
