"""One export per model at a time: a second run waits for the model's lease (enqueued, not cancelled)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HELD_S = 15.0


def test_second_export_of_a_model_waits_for_the_lease(prefect_server, ops_env, tmp_path):
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.variables import Variable

    from flows.model_lease import ensure_limit, holder_variable, lease_name

    api = prefect_server.api()
    export_id = f"queued-{uuid.uuid4().hex[:8]}"
    # The run is refused by the gate right after its probe: cheap, and it shows when the probe ran.
    # retry_refusals (with no retries) makes kiln export leave the refusal to the flow run, after the lease.
    cmd = [sys.executable, "-m", "cli.main", "export", "--export-id", export_id, "--buckets", "1x8",
           "--store", f"file://{tmp_path / 'store'}", "--set", "headroom_floor_mib=10000000",
           "--set", "retry_refusals=true", "--set", "flow_retries=0"]
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        ensure_limit(lease_name("tiny"))
        holder = {"flow_run_id": "0000-holder", "flow_run_name": "first-run", "export_id": "first-export",
                  "since": "2026-12-01T00:00:00+00:00"}
        with concurrency(lease_name("tiny"), occupy=1, strict=True):  # another export of tiny is running
            Variable.set(holder_variable(lease_name("tiny")), holder, overwrite=True)  # as model_lease records it
            proc = subprocess.Popen(cmd, env=ops_env, cwd=tmp_path, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            deadline = time.monotonic() + 180
            while not (runs := api.runs_of_export(export_id)) or "waiting for the model lease" not in api.logs(runs[0]["id"]):
                assert proc.poll() is None, proc.stdout.read()[-3000:]
                assert time.monotonic() < deadline, "the second export never asked for the lease"
                time.sleep(1.0)
            waiting_since = time.monotonic()
            time.sleep(HELD_S)
            [run] = api.runs_of_export(export_id)
            assert run["state_type"] == "RUNNING"  # enqueued, not cancelled
            assert not api.task_runs(run["id"])  # nothing probed, nothing compiled while it waits
            assert proc.poll() is None
            # The waiting run says what it waits for, and whom.
            assert ("waiting for the model lease kiln-model-tiny (one export per model at a time): held by flow run "
                    "first-run (0000-holder), export first-export, since 2026-12-01T00:00:00+00:00") in api.logs(run["id"])
            Variable.unset(holder_variable(lease_name("tiny")))
        released_after_s = time.monotonic() - waiting_since
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 3, out[-3000:]  # then it ran: probed, and the gate refused it
    logs = api.logs(run["id"])
    waited_s = float(logs.split("took the model lease kiln-model-tiny after ")[1].split(" s")[0])
    assert waited_s >= released_after_s - 1.0
    assert any(t["name"].startswith("probe") for t in api.task_runs(run["id"]))


def test_a_killed_export_frees_the_model_lease(prefect_server, ops_env, tmp_path):
    """The promise of docs/operations.md: a run killed while holding its model's slot frees it within its lease
    (the recipe's model_lease_s; 60 s here, Prefect's shortest, so the test waits one minute, not the default
    two) and the server's repossessor's round."""
    import signal

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from procmarks import wait_gone

    from flows.model_lease import lease_name

    lease_s = 60.0

    model = tmp_path / f"lease-victim-{uuid.uuid4().hex[:6]}"
    subprocess.run([sys.executable, "-m", "cli.main", "checkpoint", str(model)], env=ops_env, check=True,
                   capture_output=True, timeout=300)
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "export", "--model", str(model), "--tp", "2",
                             "--buckets", "1x8,2x8,4x8", "--store", f"file://{tmp_path / 'store'}",
                             "--set", f"model_lease_s={lease_s}"],
                            env={**ops_env, "KILN_TEST_MARK": mark}, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    name = lease_name(model.name)

    def active_slots() -> int:
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as c:
            try:
                return c.read_global_concurrency_limit_by_name(name).active_slots
            except Exception:  # not created yet
                return 0

    try:
        deadline = time.monotonic() + 300
        while active_slots() != 1:
            assert proc.poll() is None and time.monotonic() < deadline, "the export never took its model lease"
            time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)  # mid-export: no finally, no release
        proc.wait(timeout=30)
        killed = time.monotonic()
        assert active_slots() == 1, "the slot was released, not left to expire: this test shows nothing"
        while active_slots() != 0:
            assert time.monotonic() - killed < lease_s + 60, f"{name} still held {lease_s + 60:.0f} s after the kill"
            time.sleep(2.0)
        freed_s = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
        left = wait_gone(mark, timeout_s=30)
    assert not left, f"left behind by the killed export: {left}"  # compile workers still starting at the kill were
    # Expiry: at most the lease after the last renewal, then the server's repossessor (every 15 s) frees it.
    assert freed_s <= lease_s + 15 + 5, freed_s


HOLD = """
import sys, time
from prefect import flow
from flows.model_lease import model_lease
from flows.params import ExportParams

@flow(name="lease-holder")
def hold(model: str, export_id: str, hold_s: float) -> None:
    with model_lease(ExportParams(model=model, export_id=export_id)):
        print("holding", flush=True)
        time.sleep(hold_s)

hold(sys.argv[1], sys.argv[2], float(sys.argv[3]))
"""


def test_a_holder_whose_process_died_is_taken_over_at_once_on_a_server(prefect_server, ops_env, tmp_path):
    """On a real server the dead holder's slot is freed by its lease id, at once, not after LEASE_S."""
    import signal

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.variables import Variable

    from flows.model_lease import LEASE_S, holder_variable, lease_name

    model = str(tmp_path / f"lease-dead-{uuid.uuid4().hex[:6]}")
    name = lease_name(Path(model).name)
    victim = subprocess.Popen([sys.executable, "-c", HOLD, model, "victim-export", "600"], env=ops_env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        while (line := victim.stdout.readline()) and line.strip() != "holding":  # its logs come first
            seen.append(line)
        assert victim.poll() is None, "".join(seen)[-3000:]
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            holder = Variable.get(holder_variable(name))
        assert holder["pid"] == victim.pid and holder["lease_id"] and holder["export_id"] == "victim-export"
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        start = time.monotonic()
        heir = subprocess.run([sys.executable, "-c", HOLD, model, "heir-export", "0"], env=ops_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        took_s = time.monotonic() - start
    finally:
        if victim.poll() is None:
            victim.kill()
    out = heir.stdout + heir.stderr
    assert heir.returncode == 0, out[-3000:]
    assert (f"took over the model lease {name} from flow run {holder['flow_run_name']} ({holder['flow_run_id']}), "
            f"export victim-export, since {holder['since']}, process {victim.pid} on {holder['host']}: its process "
            f"{victim.pid} on {holder['host']} is gone") in out, out[-3000:]
    assert took_s < LEASE_S / 2, took_s  # not the server's expiry
    # Freed by its lease, which the server revoked: its expiry cannot free a slot a second time.
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as c:
        with pytest.raises(Exception) as gone:
            c.renew_concurrency_lease(lease_id=holder["lease_id"], lease_duration=LEASE_S)
        assert getattr(getattr(gone.value, "response", None), "status_code", None) in (404, 410), gone.value
        assert c.read_global_concurrency_limit_by_name(name).active_slots == 0
