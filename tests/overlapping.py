"""Two CLI runs that must overlap: the second starts once the first is far enough (tests import this module)."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable


def run_overlapping(one: Callable[[int], object], started: Callable[[], bool], timeout_s: float = 600) -> list:
    """`one(0)`, then `one(1)` once `started()` says the first is far enough (say, it holds a compile lease):
    both results, in that order. Two CLI processes; the threads only wait for them."""
    with cf.ThreadPoolExecutor(2) as pool:
        first = pool.submit(one, 0)
        deadline = time.monotonic() + timeout_s
        while not started():
            assert not first.done() and time.monotonic() < deadline, "the first run never got that far"
            time.sleep(0.2)
        second = pool.submit(one, 1)
        return [first.result(), second.result()]
