"""The I/O tasks' retries under real Prefect (the ops tests' server): a bug fails at its first try, a transient
error is retried. The tasks carry the I/O tasks' own retry settings (tasks.phases._IO), without the delays.

The retries are the flow run's own (Prefect's task engine, in the process that runs the flow); the API only
records them, so the session's server shows them as the embedded API would, without starting one (10-20 s
of CPU on a fresh Prefect home)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a flow run against the session's Prefect server

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, time
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from tasks.phases import _IO, IO_RETRY_DELAYS_S

calls = {"type_error": 0, "key_error": 0, "connection_reset": 0}

@task(**{**_IO, "retry_delay_seconds": 0})
def type_error():
    calls["type_error"] += 1
    return len(None)  # a bug

@task(**{**_IO, "retry_delay_seconds": 0})
def key_error():
    calls["key_error"] += 1
    return {}["forwards"]  # a bug

@task(**{**_IO, "retry_delay_seconds": 0})
def connection_reset():
    calls["connection_reset"] += 1
    if calls["connection_reset"] < 3:
        raise ConnectionResetError(104, "Connection reset by peer")
    return "ok"

@flow
def tries() -> dict:
    states = {t.name: t(return_state=True) for t in (type_error, key_error, connection_reset)}
    return {name: {"state": s.type.value, "calls": calls[name], "max_tries": len(IO_RETRY_DELAYS_S) + 1,
                   "id": str(s.state_details.task_run_id)} for name, s in states.items()}

result = tries()
with get_client(sync_client=True) as client:  # task runs reach the API as events: wait for their records
    deadline = time.monotonic() + 120
    for r in result.values():
        while True:
            try:
                run = client.read_task_run(r["id"])
                if run.state and run.state.is_final():
                    r["run_count"] = run.run_count
                    break
            except ObjectNotFound:
                pass
            assert time.monotonic() < deadline, "task runs never reached the API"
            time.sleep(0.5)
print("RESULT " + json.dumps(result))
"""


def test_a_bug_fails_at_its_first_try_and_a_transient_error_is_retried(ops_env):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=ops_env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    r = json.loads(line.removeprefix("RESULT "))
    for bug in ("type_error", "key_error"):
        assert r[bug]["state"] == "FAILED" and r[bug]["calls"] == 1 and r[bug]["run_count"] == 1, r
    assert r["connection_reset"]["max_tries"] == 4  # the I/O tasks' retries would have allowed 3 more
    assert (r["connection_reset"]["state"], r["connection_reset"]["calls"], r["connection_reset"]["run_count"]) == (
        "COMPLETED", 3, 3), r
