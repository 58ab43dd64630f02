"""Holding a lease (kiln.host.leases.lease_wait.hold) against an in-memory slot: the waiting, takeovers, records.

Prefect's side (flows/model_lease.py's PrefectSlot) runs under real Prefect in tests/ops/test_model_lease.py;
here the slot is a few lines of Python, so each decision of the loop is seen on its own.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from kiln.host.processes import procs
from kiln.host.leases.lease_wait import hold


class Slot:
    """One slot and its holder record, in memory; `free_answers` False plays a holder with no lease id."""

    name = "kiln-model-test"

    def __init__(self, holder: dict | None = None, free_answers: bool = True):
        self.taken = holder is not None
        self.records = [holder] if holder is not None else []
        self.freed: list[str] = []
        self.free_answers = free_answers
        self.releases = 0
        self.lock = threading.Lock()

    @contextmanager
    def host_lock(self):
        with self.lock:
            yield

    def holder_if_taken(self):
        return (self.records[-1] if self.records else {}) if self.taken else None

    def free(self, holder, why):
        if not self.free_answers:
            return False
        self.freed.append(why)
        self.taken = False
        return True

    def try_take(self):
        if self.taken:
            return False
        self.taken = True
        return "lease-1"

    def release(self):
        self.releases += 1
        self.taken = False

    def record(self, record):
        self.records.append(record)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log():
    logger = logging.getLogger("test_lease_wait")
    handler = Lines()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.lines = handler.lines
    yield logger
    logger.removeHandler(handler)


ME = {"flow_run_id": "r1", "flow_run_name": "brave-fox", "export_id": "tiny-1"}


def test_a_free_slot_is_taken_recorded_and_given_back(log):
    slot = Slot()
    with hold(slot, ME, 60.0, log, poll_s=0.01) as record:
        assert slot.taken and slot.records == [record]
        assert record["lease_id"] == "lease-1" and record["export_id"] == "tiny-1"
        assert record["host"] == socket.gethostname() and record["pid"] == procs.this_process()["pid"]
        assert record["expires_at"] > time.time() + 50
    assert slot.releases == 1 and not slot.taken
    assert log.lines[0] == "taking the model lease kiln-model-test (one export per model at a time)"


def _dead_pid() -> tuple[int, float]:
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=time.sleep, args=(0,))
    p.start()
    started = procs.started_at(p.pid)
    p.join()
    return p.pid, started


def test_a_holder_whose_process_here_is_dead_is_taken_over_at_once(log):
    pid, started = _dead_pid()
    dead = {"host": socket.gethostname(), "pid": pid, "started_at": started, "expires_at": time.time() + 600}
    slot = Slot(dead)
    t0 = time.monotonic()
    with hold(slot, ME, 60.0, log, poll_s=5.0):
        assert slot.taken
    assert time.monotonic() - t0 < 2.0  # no poll waited
    assert slot.freed == [f"its process {pid} on {socket.gethostname()} is gone"]
    assert any(line.startswith("took over the model lease kiln-model-test from process") for line in log.lines)


def test_a_live_holder_is_waited_for_and_named_once(log):
    alive = {"host": "another-host", "pid": 1, "started_at": 0.0, "expires_at": time.time() + 600,
             "flow_run_name": "calm-owl", "flow_run_id": "r0", "export_id": "tiny-0", "since": "then"}
    slot = Slot(alive)
    threading.Timer(0.3, lambda: setattr(slot, "taken", False)).start()  # the holder finishes
    with hold(slot, ME, 60.0, log, poll_s=0.05):
        assert slot.records[-1]["export_id"] == "tiny-1"
    waiting = [line for line in log.lines if line.startswith("waiting")]
    assert waiting == ["waiting for the model lease kiln-model-test (one export per model at a time): held by "
                       "flow run calm-owl (r0), export tiny-0, since then, process 1 on another-host"]
    assert not slot.freed


def test_an_expired_record_without_a_lease_id_is_said_and_waited_for(log):
    expired = {"host": "another-host", "pid": 1, "started_at": 0.0, "expires_at": time.time() - 30}
    slot = Slot(expired, free_answers=False)
    threading.Timer(0.2, lambda: setattr(slot, "taken", False)).start()  # the server's expiry frees it
    with hold(slot, ME, 60.0, log, poll_s=0.05):
        pass
    assert any("is gone (process 1 on another-host: its lease expired" in line and "waiting for the server" in line
               for line in log.lines)


def test_the_record_is_pushed_forward_while_held_and_the_slot_given_back_on_error(log):
    slot = Slot()
    with pytest.raises(RuntimeError, match="compile failed"):
        with hold(slot, ME, 0.4, log, poll_s=0.01) as first:
            time.sleep(0.35)  # three renewals at 0.1 s
            raise RuntimeError("compile failed")
    renewed = slot.records[1:]
    assert len(renewed) >= 2 and all(r["expires_at"] > first["expires_at"] for r in renewed)
    assert all({k: v for k, v in r.items() if k != "expires_at"} ==
               {k: v for k, v in first.items() if k != "expires_at"} for r in renewed)
    assert slot.releases == 1 and not slot.taken


def test_a_holder_stuck_past_its_deadline_stops_renewing_its_record(log):
    """Once `overdue()` names what is past its deadline, the record is left to expire (a waiting export then
    takes the slot over), said once as an error; the slot itself is still given back when the block ends."""
    slot = Slot()
    stuck = threading.Event()
    with hold(slot, ME, 0.4, log, poll_s=0.01,
              overdue=lambda: "phase compile is 1 s past its deadline" if stuck.is_set() else None):
        time.sleep(0.25)  # renewed meanwhile
        renewed = len(slot.records)
        stuck.set()
        time.sleep(0.4)
    assert renewed >= 2 and len(slot.records) <= renewed + 1  # at most a renewal already under way
    assert [line for line in log.lines if "no longer renewing" in line] == [
        "phase compile is 1 s past its deadline: no longer renewing the model lease kiln-model-test; its holder "
        "record expires within 0 s and a waiting export may then take the model over"]
    assert slot.releases == 1
