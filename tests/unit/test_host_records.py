"""What a host remembers in its cache (a passed check): written atomically, unreadable means absent."""

from __future__ import annotations

import json
import os

import pytest

from kiln.host.machine import cache


def test_a_record_round_trips_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "verified" / "abc-tp2-rank0-w.v2.json"
    cache.write_record(path, {"diff": 0.001, "own": 0.0005})
    assert cache.read_record(path) == {"diff": 0.001, "own": 0.0005}
    assert [p.name for p in path.parent.iterdir()] == [path.name]


@pytest.mark.parametrize("text", ['{"diff": 0.0', "", "not json", "[1, 2]", "\x00\x00\x00"],
                         ids=["truncated", "empty", "garbage", "not-an-object", "zeros"])
def test_an_unreadable_record_is_absent(tmp_path, text):
    path = tmp_path / "r.json"
    path.write_text(text)
    assert cache.read_record(path) is None
    assert cache.read_record(tmp_path / "missing.json") is None


def test_a_write_that_dies_midway_leaves_the_old_record_whole(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    cache.write_record(path, {"diff": 1.0})

    def dies(src, dst):
        raise OSError(5, "Input/output error")  # e.g. the process is killed or the disk fails at the rename

    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(OSError):
        cache.write_record(path, {"diff": 2.0, "own": 0.5})
    assert json.loads(path.read_text()) == {"diff": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
