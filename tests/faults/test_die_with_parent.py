"""A worker whose parent died while it was still starting (importing torch takes seconds) does not live on.

It was adopted before it began watching its parent, so it would watch its new one; and a
pool worker holds both ends of its own call queue, so it never reads an end of input either: before
`die_with_parent` compared with the pid that started it, two compile workers of an export killed early
sat idle with 480 MiB each for the rest of the suite.

And a worker started from a thread (a Prefect task's) lives while its process does: the kernel's
PR_SET_PDEATHSIG, which die_with_parent used before, killed it as soon as that thread ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

PARENT = """
import multiprocessing as mp
import os
import sys
import time


def child(armed):
    open(armed + ".started", "w").write("started")
    time.sleep(3.0)  # still starting when the parent dies, as a worker importing torch is
    from kiln.host.processes.procs import die_with_parent

    die_with_parent()
    open(armed, "w").write("armed")
    time.sleep(120)


if __name__ == "__main__":
    worker = mp.get_context("spawn").Process(target=child, args=(sys.argv[1],))
    worker.start()
    open(sys.argv[1] + ".pid", "w").write(str(worker.pid))
    os._exit(0)  # dies at once: no cleanup, as a SIGKILLed export
"""


def test_a_worker_whose_parent_died_before_it_armed_exits(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    armed = tmp_path / "armed"
    # Its output goes nowhere: the worker inherits it, and would keep a pipe open.
    parent = subprocess.run([sys.executable, str(script), str(armed)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=60)
    assert parent.returncode == 0
    pid = int((tmp_path / "armed.pid").read_text())
    try:
        worker = psutil.Process(pid)
        deadline = time.monotonic() + 60
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:
            assert not armed.exists(), "the orphan began watching its new parent"
            assert time.monotonic() < deadline, "the orphaned worker still runs 60 s after its parent died"
            time.sleep(0.2)
    except psutil.NoSuchProcess:
        pass  # gone before we looked
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert (tmp_path / "armed.started").exists(), "the worker never ran: this test shows nothing"
    assert not armed.exists(), "the orphan began watching its new parent"


FROM_A_THREAD = """
import multiprocessing as mp
import os
import sys
import threading
import time


def child(mark):
    from kiln.host.processes.procs import die_with_parent

    die_with_parent()
    open(mark + ".tmp", "w").write(str(os.getpid()))
    os.replace(mark + ".tmp", mark)
    time.sleep(120)


def start(mark, out):
    worker = mp.get_context("spawn").Process(target=child, args=(mark,))
    worker.start()
    out.append(worker)
    deadline = time.monotonic() + 60
    while not os.path.exists(mark) and time.monotonic() < deadline:  # armed before this thread ends
        time.sleep(0.05)


if __name__ == "__main__":
    mark, out = sys.argv[1], []
    thread = threading.Thread(target=start, args=(mark, out))  # as a Prefect task thread starts a pool
    thread.start()
    thread.join()
    time.sleep(2.0)
    open(mark + ".alive", "w").write("yes" if out[0].is_alive() else "no")
    os._exit(0)  # the process goes: now the worker must too
"""


def test_a_worker_started_from_a_thread_lives_while_the_process_does_and_dies_with_it(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(FROM_A_THREAD)
    mark = tmp_path / "armed"
    parent = subprocess.run([sys.executable, str(script), str(mark)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=120)
    assert parent.returncode == 0 and mark.exists(), "the worker never armed: this test shows nothing"
    pid = int(mark.read_text())
    try:
        assert (tmp_path / "armed.alive").read_text() == "yes", \
            "the worker died when the thread that started it ended, its process still running"
        deadline = time.monotonic() + 30
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the worker still runs 30 s after its parent process exited"
            time.sleep(0.2)
    except psutil.NoSuchProcess:
        pass
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
