"""A SIGKILLed export frees its model on the embedded default: the next export takes its leases over at once.

With the embedded Prefect API (a plain `kiln export`) a model lease lives in
the memory of the process that took it, so nothing would ever free the slot
of a process killed with SIGKILL. The test kills an export (its whole process
group) while it holds the model lease and a compile lease, then runs the next
export of the same model on the same PREFECT_HOME and store: it must finish
without an operator and say whom it took the leases from. The test watches
the slot and the holder record by reading Prefect's SQLite database (it never
writes it).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from procmarks import wait_gone

KILN = [sys.executable, "-m", "cli.main"]

pytestmark = pytest.mark.slow


def slot_and_holder(prefect_home: Path) -> tuple[int, dict]:
    """(active slots of kiln-model-tiny, its holder record) as the database says now; (0, {}) before they exist."""
    db = prefect_home / "prefect.db"
    if not db.exists():
        return 0, {}
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            slot = con.execute("select active_slots from concurrency_limit_v2 where name = 'kiln-model-tiny'").fetchone()
            var = con.execute("select value from variable where name = 'kiln-model-tiny-holder'").fetchone()
    except sqlite3.OperationalError:  # tables not created yet, or the database busy
        return 0, {}
    return (slot[0] if slot else 0), (json.loads(var[0]) if var else {})


def test_the_next_export_takes_over_the_leases_of_a_sigkilled_one(kiln_env, tmp_path):
    mark = uuid.uuid4().hex
    store = tmp_path / "store"
    env = {**kiln_env, "KILN_TEST_MARK": mark, "KILN_HOME": str(tmp_path / "home"),
           "PREFECT_HOME": str(tmp_path / "prefect")}
    cmd = [*KILN, "export", "--model", "tiny", "--tp", "1", "--buckets", "1x8", "--store", f"file://{store}",
           "--set", "flow_retries=0"]
    with open(tmp_path / "first.log", "wb") as out:
        first = subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        # Killed while it holds the model lease and compiles (a compile lease on the key is in the store).
        while not (slot_and_holder(tmp_path / "prefect")[0] == 1 and list(store.glob("leases/*/*/*.json"))):
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first export never held its leases"
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGKILL)  # the export and everything it started: no finally runs
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert not wait_gone(mark, timeout_s=30)
    slots, holder = slot_and_holder(tmp_path / "prefect")
    assert slots == 1 and holder["pid"] > 0, "the slot was released, not left behind: this test shows nothing"
    assert list(store.glob("leases/*/*/*.json")), "the compile lease was released: this test shows nothing"

    start = time.monotonic()
    second = subprocess.run(cmd, env={**env, "KILN_TEST_MARK": uuid.uuid4().hex}, capture_output=True, text=True,
                            timeout=900)
    took_s = time.monotonic() - start
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    dead = f"process {holder['pid']} on {holder['host']}"
    assert (f"took over the model lease kiln-model-tiny from flow run {holder['flow_run_name']} "
            f"({holder['flow_run_id']}), export {holder['export_id']}, since {holder['since']}, {dead}: its process "
            f"{holder['pid']} on {holder['host']} is gone") in out, out[-4000:]
    assert any("took over the compile lease of" in line and dead in line for line in out.splitlines()), out[-4000:]
    assert "waiting for the model lease" not in out  # taken over at once, not waited for
    assert slot_and_holder(tmp_path / "prefect")[0] == 0  # released at the end, as always
    assert not list(store.glob("leases/*/*/*.json"))
    print(f"second export after the kill: {took_s:.0f} s")
