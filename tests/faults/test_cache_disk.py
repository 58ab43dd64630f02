"""Fault 6: the local cache disk is full or not writable.

Root ignores permission bits, so "not writable" is made real: a file where the
cache directory should be, and a read-only bind mount; "full" is a tiny tmpfs.
Mounting needs root (CAP_SYS_ADMIN); without it those tests skip and say so.
Every refusal must name the path, and come before compilation where it can be
known; a disk that fills up mid-run fails with the path named too.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import uuid
from pathlib import Path

import pytest

from kiln.core.errors import DiskError
from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.trust.layout import artifact_key
from kiln.core.plan.recipe import Recipe
from kiln.host.phases.share import fetch_missing
from kiln.store import LocalStore


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here ({proc.stderr.strip() or proc.returncode}); needs root with CAP_SYS_ADMIN")


@pytest.fixture
def mounts():
    done: list[Path] = []

    def mount(target: Path, *args: str) -> Path:
        target.mkdir(parents=True, exist_ok=True)
        _mount(*args, str(target))
        done.append(target)
        return target

    yield mount
    for target in reversed(done):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def tmpfs(mounts, path: Path, size: str) -> Path:
    return mounts(path, "-t", "tmpfs", "-o", f"size={size}", "tmpfs")


def export(run_kiln, tmp_path, cache: Path, *extra: str):
    """`run_kiln`: the `kiln` fixture (a subprocess) where the export gets as far as the flow, else `kiln_main`."""
    store = tmp_path / "store"
    run = run_kiln("export", "--tp", "2", "--buckets", "1x8", "--store", f"file://{store}",
               "--report", str(tmp_path / "r.json"), *extra, env={"KILN_CACHE_DIR": str(cache)})
    return run, store


def no_objects(store: Path) -> bool:
    """Nothing at all was written to the local store: no key (a symlink), no blob, no temporary file."""
    return not store.exists() or not [p for p in store.rglob("*") if p.is_symlink() or p.is_file()]


def no_forwards_or_leases(store: Path) -> bool:
    """Nothing compiled was published and no key stays leased (a ledger picture may be stored)."""
    return not store.exists() or not [p for p in store.rglob("*") if p.is_symlink()
                                      and (p.suffix == ".pt2" or "leases" in p.parts)]


def test_a_file_where_the_cache_directory_should_be(kiln_main, tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file, not a directory")
    run, store = export(kiln_main, tmp_path, blocker)
    assert run.code == 2, run.err[-2000:]
    assert str(blocker) in run.err and "is not writable" in run.err and "Traceback" not in run.err
    assert "Prefect" not in run.err  # refused before the flow started
    assert no_objects(store)


def test_a_read_only_cache_is_refused_before_anything_runs(kiln_main, tmp_path, mounts):
    src = tmp_path / "ro-src"
    src.mkdir()
    ro = mounts(tmp_path / "ro", "--bind", "-o", "ro", str(src))
    run, store = export(kiln_main, tmp_path, ro)
    assert run.code == 2, run.err[-2000:]
    assert "Read-only file system" in run.err and str(ro) in run.err and "Traceback" not in run.err
    assert no_objects(store)


@pytest.mark.slow
def test_a_full_cache_is_refused_after_the_probe_before_compiling(kiln, tmp_path, mounts):
    full = tmpfs(mounts, tmp_path / "full", "1m")
    run, store = export(kiln, tmp_path, full)
    assert run.code == 2, run.err[-2000:]
    assert str(full) in run.err and "MiB free but the export's forwards need about 16 MiB" in run.err
    r = json.loads((tmp_path / "r.json").read_text())
    assert [p["name"] for p in r["phases"]] == ["probe"] and r["phases"][0]["status"] == "failed"
    assert r["hosts"][0]["cache"]["free_mib"] <= 1
    assert no_objects(store)


@pytest.mark.slow
def test_a_disk_that_fills_up_while_compiling_names_the_path(kiln, tmp_path, mounts):
    full = tmpfs(mounts, tmp_path / "small", "1m")  # the probe passes, the 1.8 MB package does not fit
    run, store = export(kiln, tmp_path, full, "--set", "artifact_mib_estimate=0")
    assert run.code == 1, run.err[-2000:]
    assert "No space left on device" in run.err and str(full) in run.err
    assert "Traceback" not in run.err.split("kiln: ")[-1]
    assert not list(full.rglob("*.pt2"))  # no partial package left behind
    assert no_forwards_or_leases(store)


def test_a_disk_that_fills_up_while_downloading_names_the_path(tmp_path, mounts):
    store = LocalStore(tmp_path / "store")
    data = hashlib.sha256(b"seed").digest() * 65536  # 2 MiB
    key = uuid.uuid4().hex
    store.put_bytes(artifact_key(key, hashlib.sha256(data).hexdigest()), data)
    cache = tmpfs(mounts, tmp_path / "dl", "1m")
    job = ExportJob(export_id="e", model_name="m", checkpoint="/nonexistent", config={}, tp=1, recipe=Recipe(),
                    store_url=store.url)
    host = HostSpec("h", (0,), cache_dir=str(cache))
    with pytest.raises(DiskError) as err:
        fetch_missing(store, job, host, [{"key": key, "sha256": hashlib.sha256(data).hexdigest(),
                                          "object": artifact_key(key, hashlib.sha256(data).hexdigest())}])
    assert "No space left on device" in str(err.value) and str(cache) in str(err.value) and key in str(err.value)
    assert not [p for p in cache.rglob("*") if p.is_file()]  # the partial download was removed
