"""A host's local cache directory: where it is, whether it takes writes, whether it has room.

Each host keeps its compiled and downloaded forwards in its cache directory
(KILN_CACHE_DIR, else KILN_HOME/cache/<host>), with the records of checks passed
(`verified/`) and of files hashed (`digests/`); at most KILN_CACHE_MIB of them
(`cap_bytes`, default CACHE_MIB): at an export's start `cap_cache` removes the
least recently used beyond that (an export's start marks its forwards used), and
`cap_folders` does the same for the exports `kiln verify` and `kiln run` fetch
into KILN_HOME. Ranks' weights read from S3 (`s3-checkpoints/`) keep their own
rule (kiln.host.weights.s3_weight_cache). A cache that cannot be written,
or lacks room for the forwards the host will hold, is found before anything
compiles: `cache_status` runs on the host (it creates the directory and
writes, fsyncs and removes a probe file), and `check_caches` (pure) turns the
statuses of every host into one BadInput naming each bad host and its path.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.core.errors import BadInput
from kiln.core.run.tidy import Entry, Removed, over_cap
from kiln.store import sha256_file

if TYPE_CHECKING:
    from kiln.core.plan.job import HostSpec

CACHE_DIR_ENV = "KILN_CACHE_DIR"
CACHE_MIB_ENV = "KILN_CACHE_MIB"
CACHE_MIB = 32768
"""MiB each of Kiln's caches on a machine keeps by default (KILN_CACHE_MIB; 0: no cap)."""
CAPPED = ("forwards", "verified", "digests")
"""The folders of a host's cache whose files count against its cap."""
MIB = 2**20


def cache_root(host_name: str, configured: str = "") -> Path:
    """The host's cache directory, resolved where this runs (on the host itself)."""
    if configured:
        return Path(configured)
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser().resolve() / host_name
    from kiln.core.machine.home import kiln_home
    return kiln_home() / "cache" / host_name


def cache_dir(host: "HostSpec") -> Path:
    """The host's local cache, resolved where this runs (on the host itself)."""
    return cache_root(host.name, host.cache_dir)


def local_path(host: "HostSpec", key: str) -> Path:
    """Where the host keeps forward `key`."""
    return cache_dir(host) / "forwards" / f"{key}.pt2"


def _free_mib(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free // MIB
        except OSError:
            continue
    return None


def cache_status(root: Path) -> dict:
    """{'path', 'error' (None when writable), 'free_mib'} of the cache at `root` (its forwards/ dir)."""
    forwards = root / "forwards"
    error = None
    probe = forwards / f".kiln-probe-{uuid.uuid4().hex}"
    try:
        forwards.mkdir(parents=True, exist_ok=True)
        with open(probe, "xb") as f:
            f.write(b"kiln cache probe\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        where = exc.filename or forwards
        error = f"{exc.strerror or exc} ({where})"
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return {"path": str(root), "error": error, "free_mib": _free_mib(forwards)}


def check_caches(statuses: dict[str, dict], need_mib: dict[str, int]) -> None:
    """Raise BadInput naming every host whose cache is unwritable or has less than `need_mib` free. Pure."""
    problems = []
    for host in sorted(statuses):
        st, need = statuses[host], need_mib.get(host, 0)
        if st.get("error"):
            problems.append(f"host {host}'s cache directory {st['path']} is not writable: {st['error']}")
        elif need and st.get("free_mib") is not None and st["free_mib"] < need:
            problems.append(f"host {host}'s cache directory {st['path']} has {st['free_mib']} MiB free but the "
                            f"export's forwards need about {need} MiB there (artifact_mib_estimate each, and its "
                            "ranks' weights when read from S3)")
    if problems:
        raise BadInput("; ".join(problems) + ". Free space or fix permissions, or point KILN_CACHE_DIR at a "
                       "writable local disk with room.")


def need_mib(num_forwards: int, num_local: int, artifact_mib_estimate: int) -> int:
    """Room a host's cache needs for the forwards it does not hold yet. Pure."""
    return max(0, num_forwards - num_local) * artifact_mib_estimate


def check_probed_caches(probes: list, artifact_mib_estimate: int, weights_mib_per_rank: int = 0) -> None:
    """`check_caches` over every host's probe (kiln.core.plan.probe_result.HostProbe.cache): room for the forwards
    it lacks and, with `weights_mib_per_rank`, for each of its ranks' weights (kept there when read from S3,
    kiln.host.weights.s3_weight_cache). Pure."""
    check_caches({p.name: p.cache for p in probes if p.cache},
                 {p.name: need_mib(len(p.specs), len(p.local_keys), artifact_mib_estimate)
                  + len(p.ranks) * weights_mib_per_rank for p in probes})


def read_record(path: Path) -> dict | None:
    """The JSON object a host remembered at `path`, or None when it is absent or unreadable (truncated,
    corrupt, not an object): a record that cannot be read is as if never written, so the work it
    remembers is done again instead of failing every retry."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(path: Path, record: dict) -> None:
    """Write `record` as JSON at `path` atomically: a temp file in the same directory, fsynced, then
    os.replace, so a reader sees the old record or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def file_digest(path: Path, records: Path | None) -> str:
    """sha256 of the file at `path`, remembered in the directory `records` (None: not remembered).

    A remembered digest is keyed by the file's device, inode, size, mtime and
    ctime: rewriting the file (in place or by rename, even with its old size
    and mtime restored, as `rsync -a` does) changes its ctime or inode, so the
    file is read again; an unchanged file is not read at all.
    """
    if records is None:
        return sha256_file(path)
    st = path.stat()
    record = records / f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}.json"
    known = read_record(record)
    if known is not None and isinstance(known.get("sha256"), str):
        return known["sha256"]
    digest = sha256_file(path)
    write_record(record, {"sha256": digest, "path": str(path)})
    return digest


def cap_bytes() -> int | None:
    """The cap of each of Kiln's caches here, in bytes: KILN_CACHE_MIB (default CACHE_MIB); None for 0 (no cap)."""
    raw = os.environ.get(CACHE_MIB_ENV, "").strip() or str(CACHE_MIB)
    if not raw.isdigit():
        raise BadInput(f"{CACHE_MIB_ENV}={raw!r}: expected the MiB each of Kiln's caches may keep (0: no cap).")
    return int(raw) * MIB or None


def cap_cache(root: Path, cap: int | None, keep_keys: set[str] | frozenset[str] = frozenset()) -> Removed:
    """Remove the least recently used files of the host cache at `root` (its CAPPED folders) until they take
    at most `cap` bytes (None: no cap), never the forwards `keep_keys` (which are marked used now)."""
    now = time.time()
    keep = set()
    for key in keep_keys:
        path = root / "forwards" / f"{key}.pt2"
        try:
            os.utime(path, (now, now))  # used by the export that starts now
            keep.add(str(path.relative_to(root)))
        except OSError:
            pass  # not here (yet)
    entries = []
    for folder in CAPPED:
        for path in (root / folder).rglob("*") if (root / folder).is_dir() else ():
            try:
                st = path.lstat()
            except OSError:
                continue
            if path.is_file() and not path.is_symlink():
                entries.append(Entry(str(path.relative_to(root)), st.st_size, max(st.st_mtime, st.st_atime)))
    return _remove(root, entries, over_cap(entries, cap, keep) if cap is not None else [])


def cap_folders(parent: Path, cap: int | None, keep: str) -> Removed:
    """Remove the least recently used folders of `parent` (each an export `kiln verify` or `kiln run`
    fetched) until they take at most `cap` bytes (None: no cap), never `keep` (marked used now)."""
    if not parent.is_dir():
        return Removed()
    now = time.time()
    entries = []
    for path in parent.iterdir():
        if path.name == keep:
            os.utime(path, (now, now))
        if path.is_dir() and not path.is_symlink():
            entries.append(Entry(path.name, tree_bytes(path), path.stat().st_mtime))
    return _remove(parent, entries, over_cap(entries, cap, {keep}) if cap is not None else [])


def _remove(root: Path, entries: list[Entry], names: list[str]) -> Removed:
    size = {e.name: e.size_bytes for e in entries}
    removed = Removed()
    for name in names:
        path = root / name
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        except FileNotFoundError:
            continue  # removed meanwhile (another export's start)
        removed += Removed(1, size[name])
    return removed


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (those that vanish meanwhile count 0), not following links."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
