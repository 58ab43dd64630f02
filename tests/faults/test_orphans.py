"""No orphans: whatever an export starts dies with it, even when the export is SIGKILLed mid-compile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
from procmarks import marked, wait_gone

KILN = [sys.executable, "-m", "cli.main"]

pytestmark = pytest.mark.slow


def test_a_sigkilled_export_leaves_no_process_behind(kiln_env, tmp_path):
    mark = uuid.uuid4().hex
    log = tmp_path / "export.log"
    # Its own Prefect home: the killed run's model lease stays taken in the embedded API's database until
    # the next export takes it over (tests/faults/test_killed_export_lease.py); other tests need not do that.
    env = {**kiln_env, "KILN_TEST_MARK": mark, "PREFECT_HOME": str(tmp_path / "prefect")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([*KILN, "export", "--model", "tiny", "--tp", "2", "--buckets", "1x8,2x8",
                                 "--store", f"file://{tmp_path / 'store'}"], env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 300
        while b"Compile forwards: 0/" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "compilation never started"
            time.sleep(0.5)
        time.sleep(2.0)  # the workers are compiling now
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "multiprocessing" in " ".join(p.cmdline())]
        assert workers, "no compile worker was running"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left = wait_gone(mark)
        assert not left, f"left behind by the killed export: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for line in marked(mark):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
