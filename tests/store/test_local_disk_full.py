"""A full disk under a local store, or under a host's record of passed checks, without a raw OSError."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from kiln.core.errors import DiskError
from kiln.store import LocalStore


def no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_staging_names_the_store_and_what_to_do(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    store.check()
    monkeypatch.setattr(os, "fsync", no_space)
    for write in (lambda: store.put_bytes("forwards/a.pt2", b"x" * 100),
                  lambda: store.put_json("exports/e1/manifest.json", {"a": 1}, overwrite=True)):
        with pytest.raises(DiskError) as err:
            write()
        assert "No space left on device" in str(err.value) and str(store.root) in str(err.value)
        assert "free space" in str(err.value)
    monkeypatch.undo()
    assert store.list() == [] and not list((store.root / ".kiln" / "tmp").iterdir())  # nothing half-written


def test_an_unreadable_file_to_upload_is_not_called_a_full_store(tmp_path):
    store = LocalStore(tmp_path / "store")
    with pytest.raises(FileNotFoundError):
        store.put_file("forwards/a.pt2", tmp_path / "missing.pt2", "0" * 64)


def test_a_failed_record_of_a_passed_check_only_warns(tmp_path, monkeypatch, caplog):
    from kiln.host.phases import rank_check

    monkeypatch.setattr(rank_check.cache, "write_record", lambda path, record: no_space())
    with caplog.at_level(logging.WARNING, logger="kiln.host.phases.rank_check"):
        rank_check.remember_check(tmp_path / "verified" / "x.json", {"diff": 0.0})
    assert "could not remember a passed check" in caplog.text and "No space left" in caplog.text
