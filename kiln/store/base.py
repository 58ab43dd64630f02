"""The `Store` interface: content-addressed, create-once object storage.

Contracts shared by every implementation (tests/store/test_contract.py runs the
same tests over each):

- Keys are validated with `validate_key` (BadInput on a bad key).
- Every object carries the sha256 of its bytes, recorded when it was written.
- `put_*` is create-once: True if this call created the object, False if it
  already held the same sha256, IntegrityError if it holds a different one (the
  existing object is left intact). Of several writers racing on one key,
  across processes and hosts, exactly one gets True, and no reader ever sees a
  partially written object.
- `get_*` verifies the sha256 on the client after the transfer, against the
  caller's digest if given, else against the recorded one, and raises
  IntegrityError naming the key on a mismatch (nothing is left at the
  destination). A missing key raises `ObjectMissing`, a KeyError.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kiln.core.errors import IntegrityError, StoreConflict
from kiln.core.run.tidy import Removed
from kiln.core.trust.key_rules import CHUNK_BYTES


STALE_UPLOAD_S = 24 * 3600.0
"""An upload begun longer ago than this and never completed was left by a writer that died (no upload of
one object takes a day): `Store.abort_stale_uploads` removes it."""


class ObjectMissing(KeyError):
    """The key names no object in the store. `key` is the store key."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"no object at store key {self.key!r}"


@dataclass(frozen=True)
class ObjectInfo:
    """What the store knows about one object without reading its bytes."""

    key: str
    """The store key, as passed to the store (without any S3 prefix)."""
    size_bytes: int
    """Size of the object's bytes."""
    sha256: str | None
    """Recorded hex sha256; None only for objects written outside Kiln."""


def json_bytes(obj: Any) -> bytes:
    """Canonical JSON encoding used by `put_json`: sorted keys, indent 2, UTF-8, final newline."""
    return (json.dumps(obj, sort_keys=True, indent=2) + "\n").encode("utf-8")


def check_digest(key: str, actual: str, expected: str | None) -> None:
    """Raise IntegrityError unless `actual` equals `expected` (None: no digest to check against)."""
    if expected is None:
        raise IntegrityError(
            f"store object {key!r} has no recorded sha256, so it cannot be verified; "
            "pass the expected sha256 or rewrite the object with Kiln"
        )
    if actual != expected:
        raise IntegrityError(
            f"store object {key!r} has sha256 {actual}, expected {expected}; "
            "the object is corrupt or was replaced: delete it and export again"
        )


def conflict(key: str, existing: str | None, new: str) -> StoreConflict:
    """The error for a create-once write that found different content under `key`."""
    return StoreConflict(
        f"store key {key!r} already holds an object with sha256 {existing}, not {new}; "
        "objects are written once: a different artifact under the same key means the key "
        "misses an input (or the store holds a stale object: delete it)",
        existing=existing,
    )


class Store(abc.ABC):
    """Create-once object storage with sha256 recorded per object (see module docstring)."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Display URL without secrets, e.g. 'file:///abs/dir' or 's3://bucket/prefix'."""

    @abc.abstractmethod
    def check(self) -> None:
        """Verify the store is usable; raise BadInput naming where and why (never secrets) for what the user
        must fix, StoreError(transient=True) for a blip that outlasted the store's retries."""

    @abc.abstractmethod
    def put_file(self, key: str, path: str | Path, sha256: str) -> bool:
        """Create `key` from the local file `path`, whose hex sha256 is `sha256`.

        The file is hashed while it is uploaded; if it does not match `sha256`,
        nothing is stored and IntegrityError is raised. Returns True if this
        call created the object, False if it existed with the same sha256.
        """

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> bool:
        """Create `key` holding `data` (sha256 computed here); same contract as `put_file`."""

    @abc.abstractmethod
    def _replace_bytes(self, key: str, data: bytes) -> None:
        """Atomically create or replace `key` with `data` (readers see old or new, never a mix)."""

    @abc.abstractmethod
    def get_file(self, key: str, dest_path: str | Path, sha256: str | None = None) -> None:
        """Download `key` to `dest_path` atomically (temp file + os.replace), verified.

        The parent directory of `dest_path` is created. On a digest mismatch the
        temp file is removed, `dest_path` is left as it was, and IntegrityError
        is raised.
        """

    @abc.abstractmethod
    def get_bytes(self, key: str, sha256: str | None = None) -> bytes:
        """Return the bytes of `key`, verified as in `get_file`."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """Return the object's size and recorded sha256, or None if there is no object."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Return the sorted full keys that start with `prefix` (plain string prefix)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key`; a missing key is not an error."""

    def link(self, key: str, expires_s: int = 12 * 3600) -> tuple[str, str | None]:
        """(where `key` is, for a person; a URL a browser opens, or None): the store's own address here.
        An S3 store gives a presigned URL valid `expires_s`; a local store a path and no URL."""
        return f"{self.url.rstrip('/')}/{key}", None

    def abort_stale_uploads(self, older_than_s: float = STALE_UPLOAD_S) -> Removed:
        """Remove what writers that died left unfinished in this store, begun more than `older_than_s`
        ago (an S3 store: uploads in parts never completed, under its prefix; a local store: files left
        being written); returns what was removed. Writes in progress are younger and left alone."""
        return Removed()

    def exists(self, key: str) -> bool:
        """True if `key` names an object."""
        return self.stat(key) is not None

    def put_json(self, key: str, obj: Any, *, overwrite: bool = False) -> bool:
        """Store `obj` as canonical JSON (`json_bytes`).

        overwrite=False: create-once, as `put_bytes`. overwrite=True: replace
        whatever is there atomically (manifest, leases) and return True.
        """
        data = json_bytes(obj)
        if not overwrite:
            return self.put_bytes(key, data)
        self._replace_bytes(key, data)
        return True

    def get_json(self, key: str) -> Any:
        """Return the parsed JSON object at `key`, verified against its recorded sha256."""
        return json.loads(self.get_bytes(key).decode("utf-8"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


@contextmanager
def replaced_on_success(dest_path: str | Path) -> Iterator[BinaryIO]:
    """Yield a new temp file beside `dest_path`; on a clean exit fsync it and move it over `dest_path`.

    The destination directory is created if needed. On any error the temp file
    is removed and `dest_path` is untouched, so a reader never sees a partial
    or unverified file: verify inside the block.
    """
    dest = Path(dest_path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex}.part"
    try:
        with open(tmp, "xb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of the file at `path`, read in CHUNK_BYTES chunks (constant memory): Kiln's one file hash."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def write_verified(key: str, chunks: Iterable[bytes], dest_path: str | Path, expected: str | None) -> None:
    """Write `chunks` to `dest_path` atomically, verifying their sha256 against `expected`.

    The bytes go to a temp file in the destination directory (created if
    needed), are fsynced, and only then replace `dest_path`; on a digest
    mismatch or any error the temp file is removed and `dest_path` is untouched.
    """
    digest = hashlib.sha256()
    with replaced_on_success(dest_path) as out:
        for chunk in chunks:
            digest.update(chunk)
            out.write(chunk)
        check_digest(key, digest.hexdigest(), expected)
