"""What a host remembers in its cache (a passed check): written atomically, unreadable means absent."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


def test_a_remembered_check_is_keyed_by_what_decided_it():
    """The record's name carries the checker's code and settings (rank_check.decided_by): another tolerance,
    other input paging or other checker code is another record, so a check is run again, not remembered."""
    from kiln.core.plan.job import ExportJob
    from kiln.core.plan.recipe import Recipe
    from kiln.host.phases import rank_check

    def job(**settings):
        return ExportJob(export_id="e", model_name="m", checkpoint="/c", config={}, tp=2,
                         recipe=Recipe(**settings), store_url="file:///s")

    forward = {"sha256": "f" * 64}
    base = rank_check.decided_by(job())
    assert base["checker"] == rank_check.checker_code() and len(base["key"]) == 16
    path = rank_check._record_path(Path("/r"), forward, 2, 0, "w", base)
    assert path.name == f"{'f' * 64}-tp2-rank0-w-{base['key']}.json"
    others = [rank_check.decided_by(job(verify_atol=2e-3)), rank_check.decided_by(job(verify_half_ratio=3.0)),
              rank_check.decided_by(job(page_tokens=32)), {**base, "key": "another-checker"}]
    assert len({base["key"], *(o["key"] for o in others)}) == 5
    assert rank_check.decided_by(job()) == base  # the same settings and code: the same record


def test_the_checker_fingerprint_covers_the_checker_and_the_reference(monkeypatch):
    """A change to the comparison's code (not its comments or docstrings) or to the model changes it."""
    from kiln.host.compile import key_sources
    from kiln.host.phases import rank_check

    rank_check.checker_code.cache_clear()
    before = rank_check.checker_code()
    read = key_sources._read

    def edited(path):
        text = read(path)
        return text + "\nCHANGED = 1\n" if path.name == "routing_ties.py" else text

    monkeypatch.setattr(key_sources, "_read", edited)
    rank_check.checker_code.cache_clear()
    try:
        assert rank_check.checker_code() != before
    finally:
        rank_check.checker_code.cache_clear()


def test_changed_content_names_the_first_file_or_object_that_differs():
    from kiln.host.weights.rank_weights import changed_content

    a = {"path": "/c", "files": [{"name": "config.json", "size_bytes": 10, "sha256": "a" * 64},
                                 {"name": "model.safetensors", "size_bytes": 99, "sha256": "b" * 64}]}
    assert changed_content(a, a) is None
    b = {**a, "files": [a["files"][0], {"name": "model.safetensors", "size_bytes": 99, "sha256": "c" * 64}]}
    assert changed_content(a, b) == ("model.safetensors was 99 bytes, sha256 bbbbbbbbbbbbbbbb, now 99 bytes, "
                                   "sha256 cccccccccccccccc")
    assert changed_content(a, {**a, "files": a["files"][:1]}).endswith("now absent")
    s3 = {"url": "s3://b/m", "objects": [{"name": "model.safetensors", "size_bytes": 99, "etag": '"e1"'}]}
    assert changed_content(s3, {**s3, "objects": [{**s3["objects"][0], "etag": '"e2"'}]}) == \
        'model.safetensors was 99 bytes, ETag "e1", now 99 bytes, ETag "e2"'

