"""Finding the processes a test's export started: each inherits KILN_TEST_MARK from it."""

from __future__ import annotations

import os
import time

import psutil


def marked(mark: str) -> list[str]:
    """Processes whose environment carries KILN_TEST_MARK=mark (every process an export started inherits it)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get("KILN_TEST_MARK") == mark:
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:120]}")
        except psutil.Error:
            continue
    return found


def wait_gone(mark: str, timeout_s: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
