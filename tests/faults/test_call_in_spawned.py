"""kiln.host.processes.spawned.call_in_spawned, which runs each rank check and each tuning measurement: the answer comes
back, so does the error, a death is named, and a process that hangs on its way out after answering does not
hold the caller (the in-flow check of a gemma2 export once waited 15 minutes on ProcessPoolExecutor's
max_tasks_per_child, which joins each retired worker before it starts the next).

The calls here are stand-ins without torch.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kiln.core.errors import BadInput, DeadlinePassed
from kiln.core.plan.deadlines import Deadline
from kiln.host.processes.spawned import ChildDied, RemoteTraceback, call_in_spawned


def _add(a: int, b: int) -> dict:
    return {"sum": a + b, "pid": os.getpid()}


def _refuse(what: str) -> None:
    raise BadInput(f"{what} is wrong")


def _die(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def _answer_then_hang_at_exit() -> int:
    """Answers, then the interpreter's teardown waits for a non-daemon thread that never ends."""
    threading.Thread(target=time.sleep, args=(600,), daemon=False).start()
    return os.getpid()


def _hang_with_a_child(pids_file: str) -> None:
    """Starts a child of its own (as a loader or a compiler does), writes both pids, then hangs."""
    import subprocess
    import sys

    import tempfile

    with open(os.path.join(tempfile.mkdtemp(prefix="aotinductor_"), "model.so"), "wb") as f:  # as a loader's
        f.write(b"x" * 1024)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pids_file, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)


def test_the_answer_comes_back_from_another_process():
    got = call_in_spawned(_add, 2, 3, deadline=Deadline(120.0, "test"))  # an answer within its deadline
    assert got["sum"] == 5 and got["pid"] != os.getpid()


def test_the_error_comes_back_with_its_type_and_where_it_was_raised():
    with pytest.raises(BadInput, match="the bucket is wrong") as caught:
        call_in_spawned(_refuse, "the bucket")
    assert isinstance(caught.value.__cause__, RemoteTraceback)
    assert "in _refuse" in str(caught.value.__cause__)  # the child's frames, not this process's


@pytest.mark.parametrize("how, code", [("kill", -signal.SIGKILL), ("exit", 3)])
def test_a_process_that_dies_without_answering_is_named(how, code):
    with pytest.raises(ChildDied) as caught:
        call_in_spawned(_die, how)
    assert caught.value.exit_code == code and f"exit code {code}" in str(caught.value)


def test_a_process_stuck_on_its_way_out_is_killed_after_the_grace():
    start = time.monotonic()
    pid = call_in_spawned(_answer_then_hang_at_exit, exit_grace_s=1.0)
    took = time.monotonic() - start
    assert 1.0 <= took < 60  # it waited out the grace (the process would not exit), then went on
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone (killed and reaped), not left running


def test_a_process_past_its_deadline_is_killed_with_its_children_and_named(tmp_path, monkeypatch):
    """...and what it left in its temporary directory (AOTInductor's extraction) is removed."""
    monkeypatch.setenv("KILN_TMP_ROOT", str(tmp_path / "tmp"))
    pids_file = tmp_path / "pids"
    start = time.monotonic()
    with pytest.raises(DeadlinePassed) as caught:
        call_in_spawned(_hang_with_a_child, str(pids_file), deadline=Deadline(8.0, "deadline_floor_s"),
                        what="the check of rank 1 on host h0")
    assert 8.0 <= time.monotonic() - start < 60
    assert str(caught.value).startswith("the check of rank 1 on host h0 did not finish within 8 s (deadline_floor_s)")
    for pid in map(int, pids_file.read_text().split()):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the grandchild is reaped by init, a moment later
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"process {pid} outlived the deadline")
    assert list((tmp_path / "tmp").iterdir()) == []  # its own directory went with it
