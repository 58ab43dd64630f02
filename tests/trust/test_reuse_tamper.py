"""The store's word is not trust: a forward key pointed at other real native code, with that code's own
correct digest in the store's records, is never loaded, and no signed manifest lists it (kiln.core.trust.vouch).

The session's tp 2 export (a copy of its store) stands in for "compiled into two stores": its other buckets'
packages are real packages of the same model with other bytes, which is what a second compile of the key
would make; nothing is compiled here.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kiln.core.trust import layout
from kiln.store import LocalStore

pytestmark = pytest.mark.slow


def manifests(root) -> list[dict]:
    return [json.loads(p.read_text()) for p in (root / "exports").glob("*/manifest.json")]


def test_a_forward_pointed_at_other_bytes_stops_the_export_before_anything_loads(kiln, tp2_export, tp2_store_copy,
                                                                                 tmp_path):
    root = tp2_store_copy["root"]
    store = LocalStore(root)
    victim, donor = sorted(tp2_export["cold_report"]["forwards"], key=lambda f: f["shapes"])[:2]
    link = root / victim["object"]
    link.unlink()
    os.symlink(os.readlink(root / donor["object"]), link)  # same directory: the relative target holds
    assert store.stat(victim["object"]).sha256 == donor["sha256"]  # the store vouches for itself
    # An attacker who can write the store can copy a vouch too: it is for another key.
    copied = root / layout.vouch_key(victim["key"], donor["sha256"])
    copied.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(root / layout.vouch_key(donor["key"], donor["sha256"]), copied, follow_symlinks=False)
    assert store.get_json(layout.vouch_key(victim["key"], donor["sha256"]))["key"] == donor["key"]
    cache = tmp_path / "cache"  # a fresh host cache: the rank check would have to load the store's bytes
    run = kiln("export", "--model", "tiny", "--tp", "2", "--store", tp2_store_copy["store"],
               "--report", str(tmp_path / "r.json"), env={"KILN_CACHE_DIR": str(cache)})
    assert run.code == 1, (run.code, run.err[-3000:])
    assert victim["key"] in run.err and "no key this export trusts vouched" in run.err, run.err[-3000:]
    assert "Traceback" not in run.err
    report = run.json(tmp_path / "r.json")
    assert report["status"] == "failed"
    assert not any(p["name"] in ("compile", "share-verify") for p in report["phases"])  # stopped before both
    assert not list(cache.rglob("*.pt2"))  # nothing fetched, so nothing loaded
    for m in manifests(root):
        assert all(not (f["key"] == victim["key"] and f["sha256"] == donor["sha256"]) for f in m["forwards"])
