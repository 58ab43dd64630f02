"""A host's cache of ranks' weights read from S3 checkpoints (kiln.host.weights.s3_checkpoint).

Layout: `<cache>/s3-checkpoints/<version>/rank<r>-of-<tp>.safetensors`, where `version` hashes every
object's name, size and ETag, the dtype and the package layout (a replaced object has a new ETag, hence a
new version), and `source.json` in each version names the checkpoint's address and its objects' digest.

Contracts:
- an entry is written to a temporary file of its own (mkstemp: no two writers, threads or processes, share
  one) and renamed into place, so a reader sees a whole entry or none; a write that fails removes its
  temporary file, leaves no entry and warns: the weights were read, only the cache goes without them;
- eviction: writing a version of a checkpoint removes that address's versions of other objects (they were
  replaced: those bytes cannot be read again), and every version not read or written for KEEP_S;
- an entry that cannot be read counts as absent (it is read from S3 again and rewritten);
- the room entries take is counted by the host's cache check (kiln.host.machine.cache.check_job_caches).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from kiln.core.model.contract import LAYOUT

log = logging.getLogger(__name__)

FOLDER = "s3-checkpoints"
KEEP_S = 14 * 24 * 3600
"""A version nobody read or wrote for this long is removed when another is written."""


def entry(cache_dir: Path | str, objects: list[dict], dtype: str, tp: int, rank: int) -> Path:
    """Where rank `rank` of `tp` of the checkpoint whose objects are `objects` (name, size, ETag) lives, in
    `dtype`."""
    version = hashlib.sha256(json.dumps([objects, dtype, LAYOUT]).encode()).hexdigest()[:32]
    return Path(cache_dir) / FOLDER / version / f"rank{rank}-of-{tp}.safetensors"


def objects_digest(objects: list[dict]) -> str:
    """What tells two versions of one address apart: its objects' names, sizes and ETags."""
    return hashlib.sha256(json.dumps(objects).encode()).hexdigest()[:32]


def read(path: Path) -> dict | None:
    """The cached tensors at `path`, or None when absent or unreadable; marks its version as used."""
    from safetensors.torch import load_file

    if not path.exists():
        return None
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 (truncated or corrupt: read from S3 again)
        log.warning("the cached rank weights %s cannot be read (%s); reading them from S3 again", path, exc)
        return None
    _touch(path.parent)
    return tensors


def write(path: Path, tensors: dict, url: str, objects: list[dict]) -> None:
    """Keep `tensors` at `path` (atomically), record the version's address `url` and its `objects`, then
    evict (see the module)."""
    from safetensors.torch import save_file

    version = path.parent
    tmp = None
    try:
        version.mkdir(parents=True, exist_ok=True)
        (version / "source.json").write_text(json.dumps({"url": url, "objects": objects_digest(objects)}))
        fd, tmp = tempfile.mkstemp(dir=version, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        save_file(tensors, tmp)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        log.warning("cannot keep the rank's weights in the host cache at %s (%s); going on without the cache",
                    path, exc)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    evict(version.parent, keep=version, url=url, objects=objects_digest(objects))


def evict(root: Path, *, keep: Path, url: str, objects: str, now: float | None = None) -> list[Path]:
    """Remove the versions under `root` of the address `url` whose objects are not `objects` (its digest),
    and every version but `keep` unused for KEEP_S; returns what was removed."""
    now = time.time() if now is None else now
    removed = []
    for version in sorted(p for p in root.iterdir() if p.is_dir() and p != keep) if root.is_dir() else []:
        try:
            source = json.loads((version / "source.json").read_text())
        except (OSError, ValueError):
            source = {}
        replaced = source.get("url") == url and source.get("objects") != objects
        if replaced or now - _last_used(version) > KEEP_S:
            shutil.rmtree(version, ignore_errors=True)
            removed.append(version)
    return removed


def _touch(version: Path) -> None:
    try:
        os.utime(version)
    except OSError:
        pass


def _last_used(version: Path) -> float:
    try:
        return max([version.stat().st_mtime] + [p.stat().st_mtime for p in version.iterdir()])
    except OSError:
        return 0.0
