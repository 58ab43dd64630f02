"""The Prefect server Kiln starts logs to a file, so no amount of output can block it."""

from __future__ import annotations

import sys

from flows.prefect_server import server_log_path, start_logged

LOUD = "import sys\nfor i in range(4096): sys.stderr.write(f'{i:06d} ' + 'x' * 249 + '\\n')\nprint('done')\n"
"""1 MiB on stderr (16 times a pipe's buffer), then a line on stdout."""


def test_a_process_that_logs_a_lot_is_not_blocked_and_its_log_is_kept(tmp_path):
    log = tmp_path / "logs" / "server.log"
    proc = start_logged([sys.executable, "-c", LOUD], {}, log)
    assert proc.wait(timeout=60) == 0  # with stderr on an unread pipe it would block after 64 KiB
    text = log.read_text()
    assert text.count("\n004095 ") == 1 and text.rstrip().endswith("done") and len(text) > 2**20
    start_logged([sys.executable, "-c", "print('second')"], {}, log).wait(timeout=60)
    assert log.read_text().startswith(text) and "second" in log.read_text()  # appended, not replaced


def test_the_server_log_is_under_kiln_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    assert server_log_path() == tmp_path / "home" / "logs" / "prefect-server.log"
