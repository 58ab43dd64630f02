"""Fault 1 at the pool level: a compile worker SIGKILLed mid-compile (a cheap stand-in compile, no torch).

The stand-in goes through the same fault hook as the real compile
(KILN_FAULT_KILL_COMPILE, markers in KILN_FAULT_DIR), records every start in a
log, and writes a small file, so the tests can tell exactly what ran how often.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import kiln_faults as faults
import pytest

from kiln.host.processes import faults as fault_points
from kiln.host.compile.compiler import CompileFailed, CompilePool, CompileResult


def fake_compile(spec: dict, out_path: str) -> CompileResult:
    """Runs in a spawned worker: log the start, maybe die, take a moment, write the artifact."""
    with open(spec["log"], "a") as log:
        log.write(f"{spec['key']} {os.getpid()}\n")
    fault_points.point("compile", spec, "export")  # Kiln's own fault point, as compile_forward calls it
    time.sleep(spec.get("sleep_s", 0.2))
    Path(out_path).write_text(spec["key"])
    return CompileResult(key=spec["key"], path=out_path, sha256="0" * 64, size_bytes=len(spec["key"]),
                         compile_s=0.0, pid=os.getpid())


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.FAULT_DIR_ENV, str(tmp_path / "markers"))
    return tmp_path


def jobs(tmp: Path, buckets: dict[str, float]) -> list[tuple[dict, str]]:
    return [({"key": f"k{b.replace('x', '')}", "shapes": b, "log": str(tmp / "starts.log"), "sleep_s": s},
             str(tmp / f"{b}.out")) for b, s in buckets.items()]


def starts(tmp: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (tmp / "starts.log").read_text().splitlines():
        out[line.split()[0]] = out.get(line.split()[0], 0) + 1
    return out


def run(tmp, work, *, workers=2, max_attempts=2):
    done = []
    with CompilePool(workers, max_attempts=max_attempts, compile_fn=fake_compile, initializer=None) as pool:
        try:
            results = pool.run(work, done.append)
        finally:
            deaths = pool.worker_deaths
    return results, done, deaths


def test_killed_worker_is_replaced_and_only_its_forward_retried(env, monkeypatch):
    monkeypatch.setenv(faults.KILL_COMPILE_ENV, "1x8:1")
    work = jobs(env, {"1x8": 0.2, "2x8": 2.0, "4x8": 0.2})
    results, done, deaths = run(env, work)
    assert deaths == 1
    assert {r.key: r.attempts for r in results} == {"k18": 2, "k28": 1, "k48": 1}
    assert sorted(r.key for r in done) == ["k18", "k28", "k48"]  # each reported once
    # The forward on the other worker kept running; nothing finished was compiled again.
    assert starts(env) == {"k18": 2, "k28": 1, "k48": 1}
    assert len(faults.fired(env / "markers")) == 1
    assert all(Path(out).read_text() == spec["key"] for spec, out in work)


def test_every_forward_killed_once_still_completes(env, monkeypatch):
    monkeypatch.setenv(faults.KILL_COMPILE_ENV, "*:1")
    results, _, deaths = run(env, jobs(env, {"1x8": 0.1, "2x8": 0.1, "4x8": 0.1}))
    assert deaths == 3 and {r.attempts for r in results} == {2}
    assert len(faults.fired(env / "markers")) == 3


def test_a_forward_that_keeps_killing_its_worker_fails_naming_its_key(env, monkeypatch):
    monkeypatch.setenv(faults.KILL_COMPILE_ENV, "2x8:9")
    work = jobs(env, {"1x8": 0.1, "2x8": 0.1, "4x8": 0.1})
    done = []
    with pytest.raises(CompileFailed) as err:
        with CompilePool(1, max_attempts=3, compile_fn=fake_compile, initializer=None) as pool:
            pool.run(work, done.append)
    assert "k28 (2x8)" in str(err.value) and "3 times" in str(err.value) and "max_compile_attempts=3" in str(err.value)
    assert starts(env)["k28"] == 3  # bounded: exactly max_attempts tries
    assert len(faults.fired(env / "markers")) == 3
    # Nothing that finished was lost: the other forwards were reported before the failure.
    assert {r.key for r in done} <= {"k18", "k48"} and "k18" in {r.key for r in done}


def test_fault_spec_parsing():
    assert faults.parse_kill_compile("1x8:2") == ("1x8", 2, "export")
    assert faults.parse_kill_compile("*:1:written") == ("*", 1, "written")
    for bad in ("", "1x8", "1x8:x", "1x8:1:later"):
        with pytest.raises(ValueError):
            faults.parse_kill_compile(bad)


def test_fault_hook_is_inert_without_its_variable(monkeypatch):
    monkeypatch.delenv(faults.KILL_COMPILE_ENV, raising=False)
    faults.maybe_kill_compile({"key": "k", "shapes": "1x8"}, "export")  # returns: we are still alive


def test_fault_hook_needs_a_marker_directory(monkeypatch):
    monkeypatch.setenv(faults.KILL_COMPILE_ENV, "1x8:1")
    monkeypatch.delenv(faults.FAULT_DIR_ENV, raising=False)
    with pytest.raises(RuntimeError, match=faults.FAULT_DIR_ENV):
        faults.maybe_kill_compile({"key": "k", "shapes": "1x8"}, "export")


def test_a_forward_past_its_deadline_has_its_worker_killed_and_fails_naming_it(env):
    """A compile that hangs (600 s) past its key's deadline: its worker is killed, the forward fails final
    naming its key, shapes and host, and the forward on the other worker still finishes and is reported."""
    from kiln.core.errors import DeadlinePassed
    from kiln.core.plan.deadlines import Deadline

    work = jobs(env, {"1x8": 600.0, "2x8": 0.2})
    done = []
    start = time.monotonic()
    with pytest.raises(DeadlinePassed) as err:
        with CompilePool(2, compile_fn=fake_compile, initializer=None, where="host h0",
                         deadlines={"k18": Deadline(3.0, "deadline_floor_s")}) as pool:
            pool.run(work, done.append, on_tick=lambda: None, tick_s=60.0)
    assert time.monotonic() - start < 60  # not the 600 s the compile would have taken, nor the tick
    assert str(err.value).startswith("the compile of forward k18 (1x8) on host h0 did not finish within 3 s "
                                     "(deadline_floor_s); its compile worker was killed")
    assert [r.key for r in done] == ["k28"]
    assert starts(env)["k18"] == 1  # not tried again
    hung = int(next(line.split()[1] for line in (env / "starts.log").read_text().splitlines()
                    if line.startswith("k18")))
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)
