"""Compile leases per key, renewed while compiling (kiln.host.leases.leasing) with a cheap stand-in compile (no torch).

Two contenders (two exports of one store) race over the same keys with a
lease TTL far shorter than one compile: each key is leased when submitted and
renewed while it compiles, so each is compiled exactly once and both finish.
The stand-in writes bytes that differ per compile, as real packages do: a key
compiled twice would store two packages.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import hashlib

from kiln.core.trust.layout import artifact_key, artifact_prefix
from kiln.host.compile.compiler import CompilePool, CompileResult
from kiln.host.leases.leasing import Leases, compile_leased
from kiln.store import open_store


def stand_in(spec: dict, out_path: str) -> CompileResult:
    """Runs in a spawned worker: log the start, take `sleep_s`, write bytes unique to this compile."""
    with open(spec["log"], "a") as log:
        log.write(f"{spec['key']} {os.getpid()}\n")
    time.sleep(spec["sleep_s"])
    Path(out_path).write_text(f"{spec['key']} {uuid.uuid4().hex}")
    return CompileResult(key=spec["key"], path=out_path, sha256="", size_bytes=0, compile_s=spec["sleep_s"],
                         pid=os.getpid())


def put_package(store, key: str, data: bytes) -> None:
    store.put_bytes(artifact_key(key, hashlib.sha256(data).hexdigest()), data)  # create-once


def stored_in(store):
    """compile_leased's `stored`: the store holds a package of the key (no vouches in these stand-ins)."""
    return lambda key: bool(store.list(artifact_prefix(key)))


def starts(log: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in log.read_text().splitlines():
        out[line.split()[0]] = out.get(line.split()[0], 0) + 1
    return out


def contender(store_url: str, owner: str, jobs, ttl_s: float, out: dict, renew: bool = True) -> None:
    store = open_store(store_url)
    leases = Leases(store, owner, ttl_s, scope="signer-1")
    if not renew:
        leases.renew_due = lambda: None  # what a share leased once and never renewed amounts to
    uploaded: list[str] = []

    def upload(result: CompileResult) -> None:
        put_package(store, result.key, Path(result.path).read_bytes())
        leases.release(result.key)
        uploaded.append(result.key)

    try:
        with CompilePool(1, compile_fn=stand_in, initializer=None) as pool:
            out["waited"] = compile_leased(pool, leases, jobs, upload, stored=stored_in(store), poll_s=0.1)
        out["uploaded"] = uploaded
    except BaseException as exc:
        out["error"] = exc


def race(tmp_path: Path, *, renew: bool, compile_s: float = 3.0, ttl_s: float = 0.5, n_keys: int = 4):
    keys = [f"{i:032x}" for i in range(n_keys)]
    outs: dict[str, dict] = {"a": {}, "b": {}}
    url = f"file://{tmp_path / 'store'}"
    threads = []
    for name in outs:
        jobs = [({"key": k, "shapes": "1x8", "log": str(tmp_path / "starts.log"), "sleep_s": compile_s},
                 str(tmp_path / name / f"{k}.pt2")) for k in keys]
        (tmp_path / name).mkdir()
        threads.append(threading.Thread(target=contender, args=(url, f"export-{name}:host", jobs, ttl_s,
                                                                outs[name], renew)))
    # The second export arrives while the first is compiling its first key, its lease already older than
    # the TTL: without renewal that lease has expired by then whatever the machine's load (the control
    # depends on it), with renewal it is fresh.
    threads[0].start()
    log = tmp_path / "starts.log"
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(2 * ttl_s)
    threads[1].start()
    for t in threads:
        t.join(timeout=120)
    return keys, outs, starts(tmp_path / "starts.log"), open_store(url)


def test_two_exports_racing_with_a_ttl_shorter_than_a_compile_compile_each_key_once(tmp_path):
    keys, outs, counts, store = race(tmp_path, renew=True)
    assert "error" not in outs["a"] and "error" not in outs["b"], outs
    assert counts == {k: 1 for k in keys}  # exactly once each, over both exports
    assert sorted(outs["a"]["uploaded"] + outs["b"]["uploaded"]) == keys
    assert outs["a"]["uploaded"] and outs["b"]["uploaded"]  # both worked: the keys were shared out, one at a time
    assert all(len(store.list(artifact_prefix(k))) == 1 for k in keys)
    assert not store.list("leases/")  # every lease released on upload


def test_without_renewal_the_same_race_compiles_a_key_twice(tmp_path):
    """The control: the race above shows something only because renewal is what keeps a compiling key."""
    # A longer compile leaves the second export's pool seconds to start while the first key still compiles.
    _, outs, counts, _ = race(tmp_path, renew=False, compile_s=5.0, n_keys=2)
    assert max(counts.values()) > 1, counts


def test_pool_skips_what_on_submit_refuses_and_ticks_while_compiling(tmp_path):
    jobs = [({"key": k, "shapes": "1x8", "log": str(tmp_path / "starts.log"), "sleep_s": 0.6},
             str(tmp_path / f"{k}.pt2")) for k in ("k1", "k2", "k3")]
    ticks: list[float] = []
    asked: list[str] = []

    def on_submit(spec: dict) -> bool:
        asked.append(spec["key"])
        return spec["key"] != "k2"

    with CompilePool(1, compile_fn=stand_in, initializer=None) as pool:
        results = pool.run(jobs, lambda r: None, on_submit=on_submit, on_tick=lambda: ticks.append(time.monotonic()),
                           tick_s=0.1)
    assert [r.key for r in results] == ["k1", "k3"] and starts(tmp_path / "starts.log") == {"k1": 1, "k3": 1}
    assert asked == ["k1", "k2", "k3"]  # asked once each, as each was about to start
    assert len(ticks) >= 8  # about every 0.1 s over 1.2 s of compiling
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.6


# The same race between two real exports (a TTL shorter than a compile, the holder renewing) is
# tests/integration/test_faults_cluster.py::test_two_exports_at_once_compile_each_key_once.


def test_a_key_stored_while_its_lease_was_taken_is_reused_not_compiled(tmp_path):
    """The other export uploads between this one's look at the store and its lease (its lease released
    with the upload): the key is checked again under the lease, not compiled a second time."""
    store = open_store(f"file://{tmp_path / 'store'}")

    class UploadedMeanwhile(Leases):
        def acquire(self, key: str) -> bool:
            put_package(store, key, b"the other export's package")
            return super().acquire(key)

    leases = UploadedMeanwhile(store, "export-b:host", 30.0, scope="signer-1")
    jobs = [({"key": "k1", "shapes": "1x8", "log": str(tmp_path / "starts.log"), "sleep_s": 0.1},
             str(tmp_path / "k1.pt2"))]
    with CompilePool(1, compile_fn=stand_in, initializer=None) as pool:
        assert compile_leased(pool, leases, jobs, lambda r: None, stored=stored_in(store), poll_s=0.1) == set()
    assert not (tmp_path / "starts.log").exists()  # never compiled
    assert not store.list("leases/") and not leases.held


def test_on_an_error_the_workers_stop_before_the_leases_are_released(tmp_path):
    """An upload fails while another key still compiles: its lease is released only once its worker is dead."""
    import psutil

    store = open_store(f"file://{tmp_path / 'store'}")
    jobs = [({"key": k, "shapes": "1x8", "log": str(tmp_path / "starts.log"), "sleep_s": s}, str(tmp_path / f"{k}.pt2"))
            for k, s in (("k1", 0.5), ("k2", 60.0))]
    pids: list[int] = []
    alive_at_release: dict[str, list[int]] = {}

    class Watched(Leases):
        def release(self, key: str) -> None:
            alive_at_release[key] = [p for p in pids if psutil.pid_exists(p)
                                     and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            super().release(key)

    leases = Watched(store, "export-a:host", 60.0, scope="signer-1")

    def upload(result: CompileResult) -> None:
        pids.extend(pool.worker_pids())
        raise RuntimeError("the store refused the upload")

    start = time.monotonic()
    with CompilePool(2, compile_fn=stand_in, initializer=None) as pool:
        try:
            compile_leased(pool, leases, jobs, upload, stored=stored_in(store), poll_s=0.1)
        except RuntimeError:
            pass
        else:
            raise AssertionError("the upload's error was not raised")
    assert time.monotonic() - start < 40, "the error waited for the other compile to finish"
    assert len(pids) == 2 and set(alive_at_release) == {"k1", "k2"}
    assert alive_at_release == {"k1": [], "k2": []}, "a lease was released while a worker still compiled"
    assert not store.list("leases/")
