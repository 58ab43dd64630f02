"""The store's word is not trust: a package planted at a forward key (real native code, with its own correct
digest in the store's records and a copied vouch) is named, never loaded and never listed in a signed
manifest; the export compiles its own package of the key beside it and completes (kiln.core.trust.vouch).

The session's tp 2 export (a copy of its store) stands in for "compiled into two stores": its other buckets'
packages are real packages of the same model with other bytes, which is what another signer's compile of the
key would make.
"""

from __future__ import annotations

import json

import pytest

from kiln.core.trust import layout
from kiln.store import LocalStore

pytestmark = pytest.mark.slow


def manifests(root) -> list[dict]:
    return [json.loads(p.read_text()) for p in (root / "exports").glob("*/manifest.json")]


def test_a_package_planted_at_a_key_is_named_and_never_loaded_and_the_export_compiles_its_own(
        kiln, tp2_export, tp2_store_copy, tmp_path):
    root = tp2_store_copy["root"]
    store = LocalStore(root)
    victim, donor = sorted(tp2_export["cold_report"]["forwards"], key=lambda f: f["shapes"])[:2]
    planted = layout.artifact_key(victim["key"], donor["sha256"])
    store.put_file(planted, (root / donor["object"]).resolve(), donor["sha256"])  # the store vouches for itself
    # An attacker who can write the store can copy a vouch too: it is for another key.
    [vouch] = store.list(layout.vouch_prefix(donor["key"], donor["sha256"]))
    store.put_bytes(f"{layout.vouch_prefix(victim['key'], donor['sha256'])}{vouch.rsplit('/', 1)[1]}",
                    store.get_bytes(vouch))
    store.delete(victim["object"])  # and the key's genuine package is gone: the export needs one
    older = manifests(root)
    cache = tmp_path / "cache"
    run = kiln("export", "--model", "tiny", "--tp", "2", "--buckets", victim["shapes"], "--store",
               tp2_store_copy["store"], "--report", str(tmp_path / "r.json"), env={"KILN_CACHE_DIR": str(cache)})
    assert run.code == 0, run.err[-3000:]
    assert "no key this export trusts vouched for" in run.err and donor["sha256"] in run.err  # named, once
    report = run.json(tmp_path / "r.json")
    [mine] = report["forwards"]
    assert report["status"] == "completed" and report["counts"]["compiled"] == 1
    assert mine["key"] == victim["key"] and mine["sha256"] != donor["sha256"]
    assert mine["object"] == layout.artifact_key(victim["key"], mine["sha256"])
    assert any(donor["sha256"] in w for w in report["warnings"])
    assert store.exists(planted), "nothing is deleted to make room"
    assert not any(f.name == f"{victim['key']}.pt2" and f.stat().st_size == donor["size_bytes"]
                   for f in cache.rglob("*.pt2")), "the planted bytes reached a host"
    for m in manifests(root):
        assert all(not (f["key"] == victim["key"] and f["sha256"] == donor["sha256"]) for f in m["forwards"])
    assert all(m in manifests(root) for m in older)  # the older manifests are untouched
