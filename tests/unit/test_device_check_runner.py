"""The device check's runner: one JSON line per step as it finishes; a failed step is a line with its error
and the next step still runs (no step here compiles anything)."""

from __future__ import annotations

import json

from kiln.device_check import __main__ as runner
from kiln.device_check import steps


def test_each_step_appends_its_line_and_a_failure_does_not_stop_the_rest(tmp_path, monkeypatch):
    def fine(check):
        check.made["x"] = 1
        return {"figure": 2}

    def broken(check):
        raise RuntimeError("the device fell over")

    def needy(check):
        return {"y": check.need("y", "broken")}

    def skipped(check):
        return {"skipped": "nothing to do on this device"}

    monkeypatch.setattr(steps, "STEPS", (("fine", fine), ("broken", broken), ("needy", needy),
                                         ("skipped", skipped)))
    out = tmp_path / "sub" / "check.jsonl"
    assert runner.run("cpu", out, work=tmp_path / "work") is False
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line["step"], line["ok"]) for line in lines] == [("fine", True), ("broken", False), ("needy", False),
                                                             ("skipped", True)]
    assert lines[0]["figure"] == 2 and lines[0]["device"] == "cpu" and "seconds" in lines[0]
    assert lines[1]["error"] == "RuntimeError: the device fell over" and "Traceback" in lines[1]["traceback"]
    assert lines[2]["error"] == "needs the result of step broken, which failed or did not run"
    assert lines[3]["skipped"] == "nothing to do on this device"


def test_only_runs_the_steps_named(tmp_path, monkeypatch):
    monkeypatch.setattr(steps, "STEPS", (("a", lambda check: {}), ("b", lambda check: {})))
    out = tmp_path / "check.jsonl"
    assert runner.run("cpu", out, work=tmp_path / "work", only=("b",)) is True
    assert [json.loads(line)["step"] for line in out.read_text().splitlines()] == ["b"]
