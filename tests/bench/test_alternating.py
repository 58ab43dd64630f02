"""bench.alternating: the step scripts' one timing loop (warm-up, rotating order, sync and after hooks)."""

from __future__ import annotations

import pytest

from bench.alternating import alternate


def _recorder():
    log: list[str] = []
    return log, {name: (lambda name=name: log.append(name) or name.upper()) for name in ("a", "b")}


def test_warms_each_once_then_alternates_which_goes_first():
    log, calls = _recorder()
    timed = alternate(calls, 4, 2)
    assert log == ["a", "b"] + ["a", "a", "b", "b", "b", "b", "a", "a"] * 2
    assert timed.warm == {"a": "A", "b": "B"}
    assert list(timed.step_s) == ["a", "b"] and all(len(v) == 4 for v in timed.step_s.values())
    assert all(s >= 0 for v in timed.step_s.values() for s in v)


def test_more_than_two_sides_rotate():
    log: list[str] = []
    calls = {n: (lambda n=n: log.append(n)) for n in ("x", "y", "z")}
    alternate(calls, 3, 1)
    assert log[3:] == ["x", "y", "z", "y", "z", "x", "z", "x", "y"]


def test_sync_brackets_each_sample_and_after_follows_it():
    log, calls = _recorder()
    alternate(calls, 2, 1, sync=lambda: log.append("|"), after=lambda name: log.append(f"after {name}"))
    assert log[2:] == ["|", "a", "|", "after a", "|", "b", "|", "after b",
                       "|", "b", "|", "after b", "|", "a", "|", "after a"]


def test_seconds_are_per_call(monkeypatch):
    clock = iter([0.0, 2.0, 10.0, 16.0])
    monkeypatch.setattr("bench.alternating.time.perf_counter", lambda: next(clock))
    timed = alternate({"a": lambda: None, "b": lambda: None}, 1, 4)
    assert timed.step_s == {"a": [pytest.approx(0.5)], "b": [pytest.approx(1.5)]}
