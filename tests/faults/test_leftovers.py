"""What runs leave on a host, removed: the temporary directories of processes that are gone
(kiln.host.processes.scratch: a dead owner's go, a live owner's stay) and the caches' caps, least recently
used first (kiln.host.machine.cache). Stand-in files and processes, no torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kiln.core.errors import BadInput
from kiln.core.run.tidy import owner_dir_name, owner_of
from kiln.host.machine import cache
from kiln.host.processes import scratch
from kiln.host.processes.procs import started_at

MIB = 2**20


def _dead_process() -> tuple[int, float]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    born = started_at(proc.pid)
    proc.wait()
    return proc.pid, born


def test_a_dead_owners_leftovers_are_swept_a_live_owners_are_not(tmp_path, monkeypatch):
    monkeypatch.setenv(scratch.ROOT_ENV, str(tmp_path))
    dead_pid, dead_born = _dead_process()
    dead = tmp_path / owner_dir_name(dead_pid, dead_born)
    (dead / "aotinductor_abc").mkdir(parents=True)
    (dead / "aotinductor_abc" / "model.so").write_bytes(b"x" * MIB)
    (dead / "kiln-load-xyz").mkdir()
    reused = tmp_path / owner_dir_name(os.getpid(), started_at(os.getpid()) - 3600)  # our pid, another start
    reused.mkdir()
    live = tmp_path / owner_dir_name(os.getpid(), started_at(os.getpid()))
    (live / "kiln-load-abc").mkdir(parents=True)
    stranger = tmp_path / "aotinductor_notours"
    stranger.mkdir()
    removed = scratch.sweep()
    assert (removed.count, removed.size_bytes) == (2, MIB)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, stranger.name])


def test_a_process_makes_its_own_directory_and_adopts_it_as_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setenv(scratch.ROOT_ENV, str(tmp_path / "root"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    code = ("import os, tempfile; from kiln.host.processes import scratch; d = scratch.adopt(); "
            "print(d, tempfile.mkdtemp(prefix='aotinductor_'), scratch.mkdtemp('kiln-ranks-'), os.environ['TMPDIR'], "
            "os.getpid())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    own = out[0]
    assert os.path.dirname(own) == str(tmp_path / "root") and owner_of(os.path.basename(own))[0] == int(out[4])
    assert all(p.startswith(own + "/") for p in out[1:3]) and out[3] == own
    assert not (tmp_path / "root" / os.path.basename(own)).exists()  # removed at its normal exit


def test_the_host_cache_keeps_its_cap_least_recently_used_first(tmp_path):
    now = time.time()
    for i, key in enumerate(["old", "mid", "new", "needed"]):
        path = tmp_path / "forwards" / f"{key}.pt2"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x" * MIB)
        os.utime(path, (now - 1000 + i * 100, now - 1000 + i * 100))
    (tmp_path / "verified").mkdir()
    (tmp_path / "verified" / "r.json").write_text("{}")
    os.utime(tmp_path / "verified" / "r.json", (now - 5000, now - 5000))
    weights = tmp_path / "s3-checkpoints" / "v1" / "rank0-of-1.safetensors"  # not counted: its own rule
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"w" * (3 * MIB))
    os.utime(tmp_path / "forwards" / "needed.pt2", (now - 9999, now - 9999))  # oldest, but this export needs it
    removed = cache.cap_cache(tmp_path, 2 * MIB, keep_keys={"needed"})
    assert removed.count == 3 and removed.size_bytes == 2 * MIB + 2  # the record, then old, then mid
    assert sorted(p.name for p in (tmp_path / "forwards").iterdir()) == ["needed.pt2", "new.pt2"]
    assert weights.exists() and (tmp_path / "forwards" / "needed.pt2").stat().st_mtime >= now
    assert cache.cap_cache(tmp_path, None).count == 0  # no cap


def test_fetched_exports_keep_their_cap_least_recently_used_first(tmp_path):
    now = time.time()
    for i, name in enumerate(["e1", "e2", "e3"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f.pt2").write_bytes(b"x" * MIB)
        os.utime(tmp_path / name, (now - 300 + i * 100, now - 300 + i * 100))
    removed = cache.cap_folders(tmp_path, 2 * MIB, keep="e1")  # e1 is being verified again: kept, marked used
    assert (removed.count, removed.size_bytes) == (1, MIB)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e1", "e3"]


def test_the_cap_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(cache.CACHE_MIB_ENV, raising=False)
    assert cache.cap_bytes() == cache.CACHE_MIB * MIB
    monkeypatch.setenv(cache.CACHE_MIB_ENV, "0")
    assert cache.cap_bytes() is None
    monkeypatch.setenv(cache.CACHE_MIB_ENV, "lots")
    with pytest.raises(BadInput, match="KILN_CACHE_MIB"):
        cache.cap_bytes()
