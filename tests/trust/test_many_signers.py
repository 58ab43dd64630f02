"""Two signers share one store: two checkpoints of one architecture exported at once, each signed by its own key
(each user's own KILN_HOME and development key into a local store; two KILN_SIGNING_KEYs into S3). Their forward
keys are the same (weights are in no key), neither trusts the other, and both finish: each compiles and stores its
own package of the key beside the other's, vouches only for what it compiled, and lists only that in its signed
manifest. Nothing is replaced, so both manifests stay valid; a later export names the other signer's package in a
warning and reuses its own.

The second export starts once the first has taken its compile lease, and the first's compile waits (the fault
seam's KILN_FAULT_HOLD_COMPILE) until the second has probed: the two overlap however slowly the second starts.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
from overlapping import run_overlapping

from kiln.core.trust import layout, signing
from kiln.store import open_store

pytestmark = pytest.mark.slow

ARGS = ["--tp", "1", "--buckets", "1x8", "--set", "lease_ttl_s=30"]


def _run_both(kiln, tmp_path: Path, store_url: str, envs: list[dict]) -> list[dict]:
    other = tmp_path / "tiny-other-weights"
    assert kiln("checkpoint", str(other), "--seed", "7").code == 0
    models = ["tiny", str(other)]
    probed = str(tmp_path / "second-probed")
    overlap = [{"KILN_FAULT_HOLD_COMPILE": probed}, {"KILN_FAULT_MARK_PROBE": probed}]
    store = open_store(store_url)

    def one(i: int):
        # Both report to the session's Prefect server (the kiln fixture's default): what the two signers share
        # is the store. Two exports on their own embedded APIs are test_faults_cluster.py's point, not this one's.
        env = {**envs[i], "PREFECT_HOME": str(tmp_path / f"prefect{i}"), **overlap[i]}
        return kiln("export", "--model", models[i], *ARGS, "--store", store_url, "--report",
                    str(tmp_path / f"r{i}.json"), env=env)

    runs = run_overlapping(one, lambda: bool(store.list(layout.LEASES)))  # the first holds a compile lease
    for run in runs:
        assert run.code == 0, run.err[-3000:]
    return [json.loads((tmp_path / f"r{i}.json").read_text()) for i in (0, 1)]


def _check_side_by_side(store_url: str, reports: list[dict]) -> None:
    store = open_store(store_url)
    [a], [b] = (r["forwards"] for r in reports)
    assert a["key"] == b["key"] and a["sha256"] != b["sha256"], "one architecture, two compiles"
    assert all(r["counts"]["compiled"] == 1 and r["status"] == "completed" for r in reports)
    signers = [r["signing"]["key_fingerprint"] for r in reports]
    assert signers[0] != signers[1]
    assert sorted(layout.parse(o)["sha256"] for o in store.list(layout.artifact_prefix(a["key"]))) \
        == sorted([a["sha256"], b["sha256"]])
    for f, signer in zip((a, b), signers):  # each package vouched for by its own signer only
        assert f["object"] == layout.artifact_key(f["key"], f["sha256"])
        assert store.list(layout.vouch_prefix(f["key"], f["sha256"])) \
            == [layout.vouch_key(f["key"], f["sha256"], signer)]
    for r, f in zip(reports, (a, b)):  # each manifest lists its own package
        manifest = store.get_json(layout.manifest_key(r["export_id"]))
        assert [(x["key"], x["sha256"]) for x in manifest["forwards"]] == [(f["key"], f["sha256"])]
    assert not store.list(layout.LEASES), "a lease outlived its compile"


def test_two_signers_export_at_once_into_one_local_store(kiln, tmp_path):
    store_url = f"file://{tmp_path / 'store'}"
    homes = [tmp_path / "home-a", tmp_path / "home-b"]
    reports = _run_both(kiln, tmp_path, store_url, [{"KILN_HOME": str(h)} for h in homes])
    _check_side_by_side(store_url, reports)
    for run_by, manifests_of in ((homes[0], reports[0]), (homes[1], reports[1])):  # both verify, as their users
        v = kiln("verify", "--store", store_url, manifests_of["export_id"], env={"KILN_HOME": str(run_by)})
        assert v.code == 0 and "verify ok" in v.out, v.err[-2000:]
    # The first user exports again: its own package is reused; the other signer's is named, not loaded.
    again = kiln("export", "--model", "tiny", *ARGS, "--store", store_url, "--report", str(tmp_path / "again.json"),
                 env={"KILN_HOME": str(homes[0])})
    assert again.code == 0, again.err[-3000:]
    r = json.loads((tmp_path / "again.json").read_text())
    assert r["counts"]["compiled"] == 0 and r["forwards"][0]["sha256"] == reports[0]["forwards"][0]["sha256"]
    other = reports[1]["forwards"][0]["sha256"]
    assert any(other in w and "no key this export trusts vouched for" in w for w in r["warnings"]), r["warnings"]


def test_two_signers_export_at_once_into_one_s3_store(kiln, s3_bucket, tmp_path):
    aws = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    keys = [base64.b64encode(signing.generate().private_bytes_raw()).decode() for _ in range(2)]
    reports = _run_both(kiln, tmp_path, s3_bucket, [{**aws, "KILN_SIGNING_KEY": k} for k in keys])
    _check_side_by_side(s3_bucket, reports)
