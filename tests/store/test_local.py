"""LocalStore behaviour beyond the shared contract: layout, cleanup, directory limits."""

from __future__ import annotations

import os

import pytest

from kiln.core.errors import BadInput, IntegrityError, StoreError
from kiln.store import LocalStore, sha256_bytes


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def blobs(store: LocalStore) -> list[str]:
    return sorted(os.listdir(store.root / ".kiln" / "blobs"))


def test_objects_are_readable_files_named_by_key(store):
    store.put_bytes("forwards/a.pt2", b"abc")
    path = store.root / "forwards" / "a.pt2"
    assert path.is_symlink()
    assert path.read_bytes() == b"abc"
    assert blobs(store)[0].startswith(sha256_bytes(b"abc") + ".")


def test_failed_and_repeated_writes_leave_no_files_behind(store, tmp_path):
    store.put_bytes("k", b"one")
    store.put_bytes("k", b"one")
    with pytest.raises(IntegrityError):
        store.put_bytes("k", b"two")
    src = tmp_path / "src"
    src.write_bytes(b"three")
    with pytest.raises(IntegrityError):
        store.put_file("j", src, sha256_bytes(b"not three"))
    assert len(blobs(store)) == 1
    assert os.listdir(store.root / ".kiln" / "tmp") == []


def test_overwrite_and_delete_remove_old_blobs(store):
    for i in range(3):
        store.put_json("lease.json", {"i": i}, overwrite=True)
    assert len(blobs(store)) == 1
    store.delete("lease.json")
    assert blobs(store) == []


def test_reserved_top_level_name(store):
    with pytest.raises(BadInput, match=".kiln"):
        store.put_bytes(".kiln/x", b"")
    store.put_bytes("a/.kiln", b"")  # only the top level is reserved


def test_a_key_cannot_be_both_object_and_prefix(store):
    store.put_bytes("a", b"object")
    with pytest.raises(StoreError, match="'a/b'"):
        store.put_bytes("a/b", b"under an object")
    assert store.stat("a/b") is None
    store.put_bytes("d/e", b"x")
    with pytest.raises(StoreError, match="'d'"):
        store.put_bytes("d", b"over a prefix")
    with pytest.raises(StoreError, match="'d'"):
        store.put_json("d", {}, overwrite=True)
    assert store.stat("d") is None
    assert store.list() == ["a", "d/e"]


def test_check_creates_the_directory(tmp_path):
    store = LocalStore(tmp_path / "new" / "store")
    store.check()
    assert (tmp_path / "new" / "store").is_dir()
    assert store.url == (tmp_path / "new" / "store").as_uri()


def test_check_rejects_an_unusable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = LocalStore(blocker / "store")
    with pytest.raises(BadInput, match="not usable") as err:
        store.check()
    assert str(blocker / "store") in str(err.value)


def test_files_left_being_written_are_removed_once_stale(tmp_path):
    """A writer killed mid-write leaves its file in .kiln/tmp; once it is older than the threshold it goes,
    a fresh one (perhaps still being written) stays."""
    import time

    store = LocalStore(tmp_path / "store")
    store.check()
    tmp = tmp_path / "store" / ".kiln" / "tmp"
    (tmp / "left").write_bytes(b"x" * 1000)
    os.utime(tmp / "left", (time.time() - 7200, time.time() - 7200))
    (tmp / "fresh").write_bytes(b"y")
    removed = store.abort_stale_uploads(older_than_s=3600)
    assert (removed.count, removed.size_bytes) == (1, 1000)
    assert [p.name for p in tmp.iterdir()] == ["fresh"]
