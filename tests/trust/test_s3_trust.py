"""Trust on a shared store: one signed export to S3 (moto_server) through a real Prefect server, then
fault 4's verify half (corrupted, replaced, re-signed, unsigned, copied) and a grep of every output for
the secrets (the S3 secret access key and the signing key).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import uuid
from pathlib import Path

import boto3
import pytest

from kiln.core.trust import signing

pytestmark = pytest.mark.slow

S3_SECRET = f"kiln-s3-secret-{uuid.uuid4().hex}"
ACCESS_KEY = "AKIAKILNTRUSTTEST"


@pytest.fixture(scope="module")
def world(kiln, kiln_env, prefect_server, s3_server, tmp_path_factory):
    """The signed export every test here looks at, and the means to poke at its store."""
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    d = tmp_path_factory.mktemp("s3-trust")
    key = signing.generate()
    pub = d / "kiln-signing.pub"
    pub.write_bytes(signing.public_pem(key.public_key()))
    block = f"kiln-signing-{uuid.uuid4().hex[:8]}"
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        Secret(value=signing.private_pem(key).decode()).save(block)
    bucket = f"kiln-trust-{uuid.uuid4().hex[:10]}"
    env = {"PREFECT_API_URL": prefect_server, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server.endpoint_url,
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url, aws_access_key_id=ACCESS_KEY,
                      aws_secret_access_key=S3_SECRET, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    store = f"s3://{bucket}/kiln"
    run = kiln("export", "--tp", "2", "--buckets", "1x8", "--store", store, "--signing-key-block", block,
               "--report", str(d / "r.json"), env=env)
    assert run.code == 0, run.err[-3000:]
    return {"dir": d, "key": key, "pub": pub, "block": block, "bucket": bucket, "env": env, "s3": s3,
            "store": store, "run": run, "report": json.loads((d / "r.json").read_text())}


def verify(run_kiln, w, *args, env=None, export_id=None):
    """`kiln verify` of the world's export: `run_kiln` is `kiln_main` (in this process) for a refusal that comes
    before any rank runs, the `kiln` fixture (a subprocess) for a run that gets as far as the ranks."""
    return run_kiln("verify", "--store", w["store"], export_id or w["report"]["export_id"], *args,
                env={**w["env"], **(env or {})})


def obj(w, key: str) -> str:
    return f"kiln/{key}"


def put_raw(w, key: str, body: bytes, metadata: dict | None = None) -> None:
    """Write behind Kiln's back; keep the recorded sha256 unless `metadata` says otherwise."""
    meta = metadata if metadata is not None else w["s3"].head_object(Bucket=w["bucket"], Key=obj(w, key))["Metadata"]
    w["s3"].put_object(Bucket=w["bucket"], Key=obj(w, key), Body=body, Metadata=meta)


def get_raw(w, key: str) -> tuple[bytes, dict]:
    resp = w["s3"].get_object(Bucket=w["bucket"], Key=obj(w, key))
    return resp["Body"].read(), resp["Metadata"]


def refused(run, *needles):
    assert run.code == 1, (run.code, run.err[-2000:])
    assert "Traceback" not in run.err and "verify ok" not in run.out and "ranks together" not in run.out
    for n in needles:
        assert n in run.err, run.err[-2000:]


def test_the_export_is_signed_with_the_block_key(world):
    r = world["report"]
    fp = signing.fingerprint(world["key"].public_key())
    assert r["signing"]["signed"] and r["signing"]["source"] == "block" and r["signing"]["key_fingerprint"] == fp
    assert f"Prefect Secret block {world['block']!r}" in world["run"].err
    manifest = json.loads(get_raw(world, r["manifest"])[0])
    sig = json.loads(get_raw(world, r["signing"]["signature"])[0])
    assert signing.verify_manifest(manifest, sig, {fp: world["key"].public_key()}) == fp


def test_verify_with_the_public_key_passes(kiln, world):
    v = verify(kiln, world, "--verify-key", str(world["pub"]))
    assert v.code == 0, v.err[-3000:]
    assert f"signature ok: signed by {world['report']['signing']['key_fingerprint']}" in v.out
    assert "verify ok: 2 ranks match" in v.out


def test_verify_without_any_key_is_bad_input(kiln_main, world):
    v = verify(kiln_main, world)
    assert v.code == 2 and "--verify-key" in v.err and "Traceback" not in v.err


def test_verify_key_block_with_another_key_is_refused(kiln, world):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    other = f"kiln-verify-{uuid.uuid4().hex[:8]}"
    with temporary_settings({PREFECT_API_URL: world["env"]["PREFECT_API_URL"]}):
        Secret(value=signing.public_pem(signing.generate().public_key()).decode()).save(other)
    refused(verify(kiln, world, "--verify-key-block", other), "not a trusted verify key")


def test_a_corrupted_artifact_in_s3_is_named_and_never_loaded(kiln_main, world):
    f = world["report"]["forwards"][0]
    good, meta = get_raw(world, f["object"])
    bad = bytearray(good)
    bad[len(bad) // 3] ^= 0x01
    try:
        put_raw(world, f["object"], bytes(bad))  # the recorded sha256 stays: only the bytes changed
        v = verify(kiln_main, world, "--verify-key", str(world["pub"]))
    finally:
        put_raw(world, f["object"], good, meta)
    refused(v, f["object"], "corrupt or was replaced")
    assert "sha256 ok" not in v.out


def test_a_replaced_artifact_with_a_consistent_store_digest_is_still_refused(kiln_main, world):
    f = world["report"]["forwards"][0]
    good, meta = get_raw(world, f["object"])
    evil = good[::-1]
    try:
        put_raw(world, f["object"], evil, {"sha256": hashlib.sha256(evil).hexdigest()})
        v = verify(kiln_main, world, "--verify-key", str(world["pub"]))
    finally:
        put_raw(world, f["object"], good, meta)
    refused(v, f["object"], f["sha256"])  # the signed manifest's digest wins over the store's


def test_an_export_reusing_a_replaced_forward_stops_before_loading_it(kiln, world):
    """The store's metadata agrees with the replaced bytes, but the package's name is the digest a trusted key
    vouched for, and those bytes are not it: the next export stops at its outcome check, naming both digests,
    before anything is downloaded or loaded."""
    f = world["report"]["forwards"][0]
    good, meta = get_raw(world, f["object"])
    evil = good[::-1]
    evil_sha = hashlib.sha256(evil).hexdigest()
    report = world["dir"] / "tampered.json"
    try:
        put_raw(world, f["object"], evil, {"sha256": evil_sha})
        run = kiln("export", "--tp", "2", "--buckets", "1x8", "--store", world["store"], "--signing-key-block",
                   world["block"], "--report", str(report), env=world["env"])
    finally:
        put_raw(world, f["object"], good, meta)
    assert run.code == 1 and f["key"] in run.err and evil_sha in run.err, run.err[-3000:]
    assert "changed behind this export" in run.err
    r = json.loads(report.read_text())
    assert r["status"] == "failed" and not r["forwards"] and not r["manifest"]
    listed = world["s3"].list_objects_v2(Bucket=world["bucket"], Prefix="kiln/exports/")["Contents"]
    for o in listed:
        if o["Key"].endswith("/manifest.json"):
            m = json.loads(world["s3"].get_object(Bucket=world["bucket"], Key=o["Key"])["Body"].read())
            assert evil_sha not in {x["sha256"] for x in m["forwards"]}


def test_a_manifest_changed_in_the_store_fails_its_signature(kiln_main, world):
    r = world["report"]
    good, meta = get_raw(world, r["manifest"])
    m = json.loads(good)
    m["forwards"][0]["sha256"] = hashlib.sha256(b"evil").hexdigest()
    body = json.dumps(m).encode()
    try:
        put_raw(world, r["manifest"], body, {"sha256": hashlib.sha256(body).hexdigest()})
        v = verify(kiln_main, world, "--verify-key", str(world["pub"]))
    finally:
        put_raw(world, r["manifest"], good, meta)
    refused(v, "changed after it was signed")


def test_a_forgery_signed_by_another_key_is_refused(kiln_main, world):
    r = world["report"]
    attacker = signing.generate()
    good_m, meta_m = get_raw(world, r["manifest"])
    good_s, meta_s = get_raw(world, r["signing"]["signature"])
    m = json.loads(good_m)
    m["signing"]["key_fingerprint"] = signing.fingerprint(attacker.public_key())
    body, sig = json.dumps(m).encode(), json.dumps(signing.sign_manifest(m, attacker)).encode()
    try:
        put_raw(world, r["manifest"], body, {"sha256": hashlib.sha256(body).hexdigest()})
        put_raw(world, r["signing"]["signature"], sig, {"sha256": hashlib.sha256(sig).hexdigest()})
        v = verify(kiln_main, world, "--verify-key", str(world["pub"]))
    finally:
        put_raw(world, r["manifest"], good_m, meta_m)
        put_raw(world, r["signing"]["signature"], good_s, meta_s)
    refused(v, signing.fingerprint(attacker.public_key()), "not a trusted verify key")


def test_a_missing_signature_is_refused(kiln_main, world):
    r = world["report"]
    good, meta = get_raw(world, r["signing"]["signature"])
    try:
        world["s3"].delete_object(Bucket=world["bucket"], Key=obj(world, r["signing"]["signature"]))
        v = verify(kiln_main, world, "--verify-key", str(world["pub"]))
        v_allow = verify(kiln_main, world, "--verify-key", str(world["pub"]), "--allow-unsigned")
    finally:
        put_raw(world, r["signing"]["signature"], good, meta)
    refused(v, "is not signed")
    refused(v_allow, "says it was signed but its signature is missing")


def test_a_signed_manifest_copied_to_another_export_is_refused(kiln_main, world):
    r = world["report"]
    other = f"copy-{uuid.uuid4().hex[:6]}"
    for name in ("manifest.json", "manifest.sig"):
        body, meta = get_raw(world, f"exports/{r['export_id']}/{name}")
        put_raw(world, f"exports/{other}/{name}", body, meta)
    refused(verify(kiln_main, world, "--verify-key", str(world["pub"]), export_id=other), "belongs to export")


def test_an_s3_export_without_a_key_is_refused_before_any_work(kiln_main, world):
    prefix = f"nokey-{uuid.uuid4().hex[:6]}"
    run = kiln_main("export", "--tp", "2", "--buckets", "1x8", "--store", f"s3://{world['bucket']}/{prefix}",
               env=world["env"])
    assert run.code == 2 and "kiln keygen DIR" in run.err and "--unsigned" in run.err
    assert world["s3"].list_objects_v2(Bucket=world["bucket"], Prefix=prefix).get("KeyCount", 0) == 0


def test_an_unsigned_export_says_so_and_verify_needs_allow_unsigned(kiln, kiln_main, world):
    report = world["dir"] / "unsigned.json"
    # An unsigned export reuses a stored forward only when a key it trusts vouched for it (KILN_VERIFY_KEY).
    run = kiln("export", "--tp", "2", "--buckets", "1x8", "--store", world["store"], "--unsigned",
               "--report", str(report), env={**world["env"], "KILN_VERIFY_KEY": str(world["pub"])})
    assert run.code == 0, run.err[-3000:]
    r = json.loads(report.read_text())
    assert r["signing"]["signed"] is False and r["signing"]["signature"] is None
    assert "signed: NO (--unsigned)" in run.out and r["counts"]["reused"] == 1  # nothing compiled again
    assert json.loads(get_raw(world, r["manifest"])[0])["signing"] == {"signed": False, "key_fingerprint": None}
    refused(verify(kiln_main, world, export_id=r["export_id"]), "--allow-unsigned")
    v = verify(kiln, world, "--allow-unsigned", export_id=r["export_id"])
    assert v.code == 0, v.err[-3000:]
    assert "unsigned export accepted because of --allow-unsigned" in v.out and "verify ok" in v.out


def _paged(read, page: int = 10, **filters) -> list:
    """Every record `read` returns for `filters`, page by page (the server returns at most 200 at a time;
    small pages here, so the paging itself is exercised)."""
    out: list = []
    while True:
        got = read(**filters, limit=page, offset=len(out))
        out += got
        if len(got) < page:
            return out


def _prefect_records(api_url: str, export_id: str) -> tuple[str, list[str]]:
    """(this export's flow run id, everything the server holds about that run as JSON: the flow run, its
    task runs, all its logs and all its artifacts), read page by page and filtered by the run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.settings import PREFECT_API_URL, temporary_settings

    key = export_id.lower().replace("_", "-").replace(".", "-")  # the flow's artifact keys start with it
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        summaries = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=f"{key}%")))
        run_ids = {a.flow_run_id for a in summaries}
        assert len(run_ids) == 1 and None not in run_ids, f"artifacts of {export_id} belong to runs {run_ids}"
        (run_id,) = run_ids
        runs = FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        records = [*client.read_flow_runs(flow_run_filter=runs),
                   *_paged(client.read_task_runs, flow_run_filter=runs),
                   *_paged(client.read_logs, log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))),
                   *_paged(client.read_artifacts, flow_run_filter=runs)]
    assert all(getattr(r, "flow_run_id", run_id) == run_id for r in records)
    return str(run_id), [r.model_dump_json() for r in records]


def test_no_secret_appears_in_any_output(kiln, kiln_env, world):
    seed = world["key"].private_bytes_raw()
    pem = signing.private_pem(world["key"]).decode()
    pem_body = "".join(pem.strip().splitlines()[1:-1])
    secrets = {"S3 secret key": S3_SECRET, "signing key PEM": pem_body,
               "signing key seed (base64)": base64.b64encode(seed).decode(), "signing key seed (hex)": seed.hex()}
    texts: dict[str, str] = {"export stdout": world["run"].out, "export stderr": world["run"].err,
                             "report": (world["dir"] / "r.json").read_text()}
    blobs: dict[str, bytes] = {}
    listing = world["s3"].list_objects_v2(Bucket=world["bucket"]).get("Contents", [])
    for o in listing:
        blobs[f"s3://{o['Key']}"] = world["s3"].get_object(Bucket=world["bucket"], Key=o["Key"])["Body"].read()
    for path in Path(kiln_env["KILN_HOME"]).rglob("*"):
        if path.is_file() and not path.is_symlink():
            blobs[str(path)] = path.read_bytes()
    run_id, records = _prefect_records(world["env"]["PREFECT_API_URL"], world["report"]["export_id"])
    texts.update({f"prefect record {i}": r for i, r in enumerate(records)})
    # The records are this export's own, all of them: its gate decision, compile and summary are among them.
    assert any('"gate: ' in r for r in records) and any(world["report"]["export_id"] in r for r in records)
    assert any('"name":"compile' in r.replace(" ", "") for r in records), "no compile task run read"
    # All of its logs, first to last: the flow run's opening and closing lines are both among them.
    flow_logs = [r for r in records if '"level":' in r and '"task_run_id":null' in r]
    assert any("Beginning flow run" in r for r in flow_logs)
    assert any("Finished in state Completed" in r for r in flow_logs)
    assert any(k.endswith("manifest.json") for k in blobs) and any(k.endswith(".pt2") for k in blobs)
    found = [(what, where) for what, s in secrets.items() for where, t in texts.items() if s in t]
    found += [(what, where) for what, s in secrets.items() for where, b in blobs.items() if s.encode() in b]
    found += [("signing key seed (raw)", where) for where, b in blobs.items() if seed in b]
    print(f"secrets grep: {len(secrets) + 1} secret forms over {len(texts)} texts and {len(blobs)} files: "
          f"{len(found)} found")
    assert found == []
