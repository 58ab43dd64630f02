"""`LocalStore`: the store in a local (or shared POSIX) directory.

Layout under `root`:

    <key>                       symlink -> .kiln/blobs/<sha256>.<uuid>
    .kiln/blobs/<sha256>.<uuid> the object's bytes, written once, never modified
    .kiln/tmp/                  files being written

Why symlinks: an object is its bytes *and* their sha256, and both must appear
at once. The key's single directory entry names the blob, and the blob's name
carries the sha256, so creating the entry publishes both atomically:
`os.symlink` fails with EEXIST when the key exists (create-once across
processes without locks), and `os.replace` of a symlink swaps data and digest
together (overwrite). Blobs are fsynced before they are linked, so a crash never
leaves a partial object visible; at worst an unreferenced blob remains in
.kiln/blobs. The top-level name '.kiln' is reserved.

Spelling: a new key is refused (BadInput) when one of its parts differs from an
existing entry of the same directory only in case, Unicode form or trailing
dots (`normalized_key`): S3 keeps such keys apart, a case-insensitive
filesystem (macOS, Windows, some NFS/SMB shares) would merge them. Two writers
racing to create 'A' and 'a' at once are not caught on a case-sensitive disk.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from kiln.core.errors import DISK_ERRNOS, BadInput, DiskError, IntegrityError, StoreError
from kiln.core.trust.key_rules import (
    CHUNK_BYTES,
    normalized_key,
    sha256_bytes,
    validate_key,
    validate_prefix,
    validate_sha256,
)
from kiln.core.run.tidy import Removed
from kiln.store.base import STALE_UPLOAD_S, ObjectInfo, ObjectMissing, Store, check_digest, conflict, write_verified

_INTERNAL = ".kiln"
_BLOB_NAME = re.compile(r"^([0-9a-f]{64})\.[0-9a-f]{32}$")
# A reader can resolve a key just before a concurrent overwrite or delete
# removes the old blob; it then resolves the key again, a few times at most.
_RESOLVE_ATTEMPTS = 5


def _read_chunks(path: str | Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


def _fsync_dir(path: Path) -> None:
    # Makes a new directory entry durable; some filesystems refuse, which only
    # weakens durability after a power loss, never atomicity.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _dir_conflict(url: str, key: str) -> StoreError:
    return StoreError(
        f"local store {url} cannot hold key {key!r}: other keys start with {key + '/'!r} "
        "(S3 allows that, a directory does not); choose another key"
    )


class LocalStore(Store):
    """Create-once object store in the directory `root` (created by `check` or the first put)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(os.path.abspath(Path(root).expanduser()))
        self._tmp = self.root / _INTERNAL / "tmp"
        self._blobs = self.root / _INTERNAL / "blobs"

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def link(self, key: str, expires_s: int = 12 * 3600) -> tuple[str, str | None]:
        """The object's path on this machine; no URL (a browser may not open file:// from a web page)."""
        return str(self.root / validate_key(key)), None

    def check(self) -> None:
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
            self._blobs.mkdir(parents=True, exist_ok=True)
            probe = self._tmp / f"check-{uuid.uuid4().hex}"
            probe.write_bytes(b"ok")
            # The store publishes objects as symlinks: make sure this filesystem has them.
            os.symlink(probe.name, f"{probe}.lnk")
            os.unlink(f"{probe}.lnk")
            probe.unlink()
        except OSError as e:
            raise BadInput(
                f"local store {self.url} is not usable: {e.strerror or e}; "
                "pass a writable directory on a POSIX filesystem with --store"
            ) from None

    # -- paths -------------------------------------------------------------

    def _link_path(self, key: str) -> Path:
        validate_key(key)
        if key.split("/", 1)[0] == _INTERNAL:
            raise BadInput(f"store key {key!r} starts with {_INTERNAL!r}, which the local store reserves")
        return self.root / key

    def _resolve(self, key: str, link: Path) -> tuple[Path, str] | None:
        """(blob path, sha256) the key points at, or None if there is no object."""
        try:
            target = os.readlink(link)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            if link.is_dir():
                return None  # a prefix of other keys, not an object
            raise StoreError(
                f"store key {key!r} in {self.url} is a regular file Kiln did not write; "
                "the local store keeps objects as symlinks into .kiln/blobs"
            ) from None
        match = _BLOB_NAME.match(os.path.basename(target))
        if match is None:
            raise StoreError(f"store key {key!r} in {self.url} points at {target!r}, not at a Kiln blob")
        # Every blob lives in .kiln/blobs; its name alone locates it, whatever the link's depth.
        return self._blobs / match.group(0), match.group(1)

    def _open(self, key: str) -> tuple[BinaryIO, str]:
        """Open the key's blob for reading: (binary file, recorded sha256)."""
        link = self._link_path(key)
        for _ in range(_RESOLVE_ATTEMPTS):
            resolved = self._resolve(key, link)
            if resolved is None:
                raise ObjectMissing(key)
            blob, sha = resolved
            try:
                return open(blob, "rb"), sha
            except FileNotFoundError:
                continue  # replaced or deleted meanwhile: resolve again
        raise IntegrityError(f"store key {key!r} in {self.url} points at missing data {blob}; delete the key")

    # -- writing -----------------------------------------------------------

    def _stage(self, chunks: Iterable[bytes], key: str) -> tuple[Path, str]:
        """Write chunks to a new fsynced blob; return (blob path, sha256).

        A disk that cannot take the blob (full, read-only, over quota: kiln.core.errors.DISK_ERRNOS) raises
        DiskError naming the store's directory and what to do, not a raw OSError.
        """
        try:
            return self._stage_blob(chunks)
        except OSError as exc:
            where = exc.filename or self._tmp
            if exc.errno not in DISK_ERRNOS or not str(where).startswith(str(self.root)):
                raise  # not the store's disk (the file being uploaded, say)
            raise DiskError(f"local store {self.url} cannot take {key!r}: {exc.strerror} ({where}); free space on "
                            f"the disk that holds {self.root}, or point --store at a writable directory with "
                            "room.") from None

    def _stage_blob(self, chunks: Iterable[bytes]) -> tuple[Path, str]:
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._blobs.mkdir(parents=True, exist_ok=True)
        name = uuid.uuid4().hex
        tmp = self._tmp / name
        digest = hashlib.sha256()
        try:
            with open(tmp, "xb") as f:
                for chunk in chunks:
                    digest.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            sha = digest.hexdigest()
            blob = self._blobs / f"{sha}.{name}"
            os.rename(tmp, blob)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self._blobs)  # the blob's entry must be durable before a key points at it
        return blob, sha

    def _make_parent(self, key: str, link: Path) -> None:
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise StoreError(
                f"local store {self.url} cannot hold key {key!r}: one of its parent parts is "
                "already an object (S3 allows that, a directory does not); choose another key"
            ) from None

    def _check_spelling(self, key: str) -> None:
        """BadInput if a part of `key` collides with a differently spelled entry (see module docstring)."""
        directory = self.root
        for part in key.split("/"):
            try:
                names = os.listdir(directory)
            except (FileNotFoundError, NotADirectoryError):
                return  # nothing below here yet: no collision possible
            norm = normalized_key(part)
            clash = next((n for n in names if n != part and n != _INTERNAL and normalized_key(n) == norm), None)
            if clash is not None:
                existing = os.path.relpath(directory / clash, self.root).replace(os.sep, "/")
                raise BadInput(
                    f"store key {key!r} collides with {existing!r} in {self.url}: they differ only in case, "
                    "Unicode form or trailing dots, and name one file on case-insensitive filesystems; "
                    "spell keys consistently")
            directory = directory / part

    def _publish_once(self, key: str, blob: Path, sha: str) -> bool:
        """Create the key's symlink to `blob`; on EEXIST compare digests. Consumes `blob`."""
        link = self._link_path(key)
        try:
            self._check_spelling(key)
        except BaseException:
            blob.unlink(missing_ok=True)
            raise
        self._make_parent(key, link)
        target = os.path.relpath(blob, link.parent)
        try:
            for _ in range(_RESOLVE_ATTEMPTS):
                try:
                    os.symlink(target, link)
                except FileExistsError:
                    existing = self._resolve(key, link)
                    if existing is None:
                        if link.is_dir():
                            raise _dir_conflict(self.url, key) from None
                        continue  # deleted between our attempt and the read: try again
                    blob.unlink(missing_ok=True)
                    if existing[1] != sha:
                        raise conflict(key, existing[1], sha) from None
                    return False
                _fsync_dir(link.parent)
                return True
            raise StoreError(f"store key {key!r} in {self.url} keeps appearing and vanishing; retry",
                             transient=True)
        except BaseException:
            blob.unlink(missing_ok=True)
            raise

    def _existing(self, key: str, sha256: str) -> bool | None:
        """False if the key already holds `sha256`, None if absent; IntegrityError if different."""
        resolved = self._resolve(key, self._link_path(key))
        if resolved is None:
            return None
        if resolved[1] != sha256:
            raise conflict(key, resolved[1], sha256)
        return False

    def put_file(self, key: str, path: str | Path, sha256: str) -> bool:
        validate_sha256(sha256)
        # Skip the copy when the object is already there (the common re-export case).
        if (done := self._existing(key, sha256)) is not None:
            return done
        blob, actual = self._stage(_read_chunks(path), key)
        if actual != sha256:
            blob.unlink(missing_ok=True)
            raise IntegrityError(
                f"file {path} has sha256 {actual}, not the {sha256} given for store key {key!r}; "
                "nothing was stored (was the file changed while it was uploaded?)"
            )
        return self._publish_once(key, blob, sha256)

    def put_bytes(self, key: str, data: bytes) -> bool:
        if (done := self._existing(key, sha256_bytes(data))) is not None:
            return done
        blob, sha = self._stage([data], key)
        return self._publish_once(key, blob, sha)

    def _replace_bytes(self, key: str, data: bytes) -> None:
        link = self._link_path(key)
        self._check_spelling(key)
        blob, _ = self._stage([data], key)
        try:
            self._make_parent(key, link)
            old = self._resolve(key, link)
            tmp_link = self._tmp / f"{uuid.uuid4().hex}.lnk"
            # The target text is relative to the final directory, not to .kiln/tmp.
            os.symlink(os.path.relpath(blob, link.parent), tmp_link)
            try:
                os.replace(tmp_link, link)
            except IsADirectoryError:
                raise _dir_conflict(self.url, key) from None
            finally:
                tmp_link.unlink(missing_ok=True)  # gone already if the replace succeeded
        except BaseException:
            blob.unlink(missing_ok=True)
            raise
        _fsync_dir(link.parent)
        if old is not None:
            old[0].unlink(missing_ok=True)  # blobs are per write, so no other key uses it

    # -- reading -----------------------------------------------------------

    def get_file(self, key: str, dest_path: str | Path, sha256: str | None = None) -> None:
        if sha256 is not None:
            validate_sha256(sha256)
        f, recorded = self._open(key)
        with f:
            write_verified(key, iter(lambda: f.read(CHUNK_BYTES), b""), dest_path, sha256 or recorded)

    def get_bytes(self, key: str, sha256: str | None = None) -> bytes:
        if sha256 is not None:
            validate_sha256(sha256)
        f, recorded = self._open(key)
        with f:
            data = f.read()
        check_digest(key, sha256_bytes(data), sha256 or recorded)
        return data

    def abort_stale_uploads(self, older_than_s: float = STALE_UPLOAD_S) -> Removed:
        """Remove the files in .kiln/tmp that writers which died left there, unchanged for `older_than_s`."""
        removed = Removed()
        cutoff = time.time() - older_than_s
        for path in self._tmp.iterdir() if self._tmp.is_dir() else ():
            try:
                st = path.lstat()
                if st.st_mtime <= cutoff:
                    path.unlink()
                    removed += Removed(1, st.st_size)
            except (FileNotFoundError, IsADirectoryError):
                continue  # finished (renamed) meanwhile, or not a writer's file
        return removed

    def stat(self, key: str) -> ObjectInfo | None:
        link = self._link_path(key)
        for _ in range(_RESOLVE_ATTEMPTS):
            resolved = self._resolve(key, link)
            if resolved is None:
                return None
            try:
                return ObjectInfo(key=key, size_bytes=resolved[0].stat().st_size, sha256=resolved[1])
            except FileNotFoundError:
                continue
        raise IntegrityError(f"store key {key!r} in {self.url} points at missing data; delete the key")

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        # Walk only the deepest directory the prefix names; match the rest by string prefix.
        start = self.root / prefix.rpartition("/")[0]
        if not start.is_dir():
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(start):
            if Path(dirpath) == self.root and _INTERNAL in dirnames:
                dirnames.remove(_INTERNAL)
            rel = os.path.relpath(dirpath, self.root)
            for name in filenames:
                key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                if key.startswith(prefix) and os.path.islink(os.path.join(dirpath, name)):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        link = self._link_path(key)
        resolved = self._resolve(key, link)
        if resolved is None:
            return
        try:
            os.unlink(link)
        except FileNotFoundError:
            return  # another deleter won; it removes the blob
        resolved[0].unlink(missing_ok=True)
