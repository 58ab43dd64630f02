"""Where keys come from and how signed manifests are written and read back (local store, no server)."""

from __future__ import annotations

import base64
import os
import stat

import pytest

from kiln.host.trust import signers as trust
from kiln.core.trust import signing
from kiln.core.errors import BadInput, IntegrityError, KilnError
from kiln.core.trust.manifest import check_manifest
from kiln.core.trust.signing import SigningPlan
from kiln.store import LocalStore, open_store


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (trust.SIGNING_KEY_ENV, trust.VERIFY_KEY_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


@pytest.fixture
def store(tmp_path):
    s = LocalStore(tmp_path / "store")
    s.check()
    return s


def manifest(export_id="e1", plan: SigningPlan | None = None) -> dict:
    key = "ab" * 16
    return {"version": 5, "export_id": export_id, "tp": 2,
            "forwards": [{"key": key, "shapes": "1x8", "batch": [1, 1], "tokens": [8, 8], "hint": [1, 8], "sha256": "0" * 64, "object": f"forwards/{key}.pt2", "python_free": True}],
            "signing": (plan or SigningPlan("off")).manifest_entry()}


def b64_seed(key) -> str:
    return base64.b64encode(key.private_bytes_raw()).decode()


# -- keygen and the development key ----------------------------------------------


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path):
    key_path, pub_path, fp = trust.keygen(tmp_path / "keys")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    parsed = signing.parse_private_key(key_path.read_bytes(), source="k")
    assert signing.fingerprint(parsed.public_key()) == fp
    [pub] = signing.parse_public_keys(pub_path.read_bytes(), source="p")
    assert signing.fingerprint(pub) == fp
    with pytest.raises(BadInput, match="never overwrites"):
        trust.keygen(tmp_path / "keys")
    assert signing.fingerprint(signing.parse_private_key(key_path.read_bytes(), source="k").public_key()) == fp


def test_local_store_without_a_key_gets_the_development_key_once(store, home):
    plan, created = trust.plan_signing(sign=True, block=None, store=store, home=home)
    assert created and plan.source == "dev" and plan.sign
    key_file = home / "keys" / "dev-signing.key"
    assert plan.dev_key_path == str(key_file) and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    again, created_again = trust.plan_signing(sign=True, block=None, store=store, home=home)
    assert not created_again and again.fingerprint == plan.fingerprint
    assert (home / "keys" / "dev-signing.pub").is_file()


def test_s3_store_without_a_key_is_bad_input_with_a_recipe(home):
    s3 = open_store("s3://kiln-bucket/exports")  # no I/O
    with pytest.raises(BadInput) as err:
        trust.plan_signing(sign=True, block=None, store=s3, home=home)
    assert "kiln keygen" in str(err.value) and "--unsigned" in str(err.value) and "KILN_SIGNING_KEY" in str(err.value)
    assert not (home / "keys").exists()


def test_unsigned_only_on_purpose(home, store):
    plan, _ = trust.plan_signing(sign=False, block=None, store=open_store("s3://kiln-bucket/x"), home=home)
    assert plan == SigningPlan("off")
    with pytest.raises(BadInput, match="contradict"):
        trust.plan_signing(sign=False, block="my-key", store=store, home=home)


def test_env_key_wins_over_the_development_key(monkeypatch, store, home):
    key = signing.generate()
    monkeypatch.setenv(trust.SIGNING_KEY_ENV, b64_seed(key))
    plan, created = trust.plan_signing(sign=True, block=None, store=store, home=home)
    assert plan == SigningPlan("env", signing.fingerprint(key.public_key())) and not created
    assert not (home / "keys").exists()


def test_malformed_env_key_fails_before_any_work_without_echoing_it(monkeypatch, store, home):
    monkeypatch.setenv(trust.SIGNING_KEY_ENV, "sk-not-really-a-key-0123456789")
    with pytest.raises(BadInput) as err:
        trust.plan_signing(sign=True, block=None, store=store, home=home)
    assert "sk-not-really" not in str(err.value) and "KILN_SIGNING_KEY" in str(err.value)


def test_block_key_is_read_from_the_secret_block(monkeypatch, store, home):
    key = signing.generate()
    seen = []
    monkeypatch.setattr(trust, "_secret_block", lambda name: seen.append(name) or signing.private_pem(key).decode())
    plan, _ = trust.plan_signing(sign=True, block="kiln-signing", store=store, home=home)
    assert plan.source == "block" and plan.block == "kiln-signing" and seen == ["kiln-signing"]
    assert signing.fingerprint(trust.signing_key(plan, home).public_key()) == plan.fingerprint


def test_development_key_must_not_live_inside_the_store(tmp_path):
    inside = LocalStore(tmp_path / "home")
    with pytest.raises(BadInput, match="contains KILN_HOME/keys"):
        trust.plan_signing(sign=True, block=None, store=inside, home=tmp_path / "home")


def test_a_key_swapped_during_the_export_signs_nothing(monkeypatch, store, home):
    monkeypatch.setenv(trust.SIGNING_KEY_ENV, b64_seed(signing.generate()))
    plan, _ = trust.plan_signing(sign=True, block=None, store=store, home=home)
    monkeypatch.setenv(trust.SIGNING_KEY_ENV, b64_seed(signing.generate()))
    with pytest.raises(KilnError, match="changed during the export"):
        trust.write_signed_manifest(store, "e1", manifest(plan=plan), plan, home)
    assert store.list() == []


# -- writing and reading signed manifests ---------------------------------------------


@pytest.fixture
def dev_plan(store, home):
    return trust.plan_signing(sign=True, block=None, store=store, home=home)[0]


def read(store, home, export_id="e1", keys=None, **kw):
    trusted = lambda: trust.trusted_keys(store=store, home=home, **(keys or {}))  # noqa: E731
    return trust.read_verified_manifest(store, export_id, trusted=trusted, **kw)


def test_signed_manifest_round_trip(store, home, dev_plan):
    entry = trust.write_signed_manifest(store, "e1", manifest(plan=dev_plan), dev_plan, home)
    assert entry["signed"] and entry["signature"] == "exports/e1/manifest.sig"
    assert sorted(store.list()) == ["exports/e1/manifest.json", "exports/e1/manifest.sig"]
    got, line = read(store, home)
    assert check_manifest(got, export_id="e1")["signing"]["key_fingerprint"] == dev_plan.fingerprint
    assert dev_plan.fingerprint in line and "signature ok" in line
    raw = b"".join(store.get_bytes(k) for k in store.list())
    assert signing.private_pem(trust.signing_key(dev_plan, home)) not in raw


def test_manifest_changed_through_the_store_api_is_refused(store, home, dev_plan):
    m = manifest(plan=dev_plan)
    trust.write_signed_manifest(store, "e1", m, dev_plan, home)
    m["forwards"][0]["sha256"] = "f" * 64  # an attacker with write access to the store
    store.put_json("exports/e1/manifest.json", m, overwrite=True)
    with pytest.raises(IntegrityError, match="changed after it was signed"):
        read(store, home)


def test_missing_signature_is_refused_unless_unsigned_was_allowed(store, home, dev_plan):
    trust.write_signed_manifest(store, "e1", manifest(plan=dev_plan), dev_plan, home)
    store.delete("exports/e1/manifest.sig")
    with pytest.raises(IntegrityError, match="not signed"):
        read(store, home)
    # The manifest claims a signature: even --allow-unsigned refuses it.
    with pytest.raises(IntegrityError, match="says it was signed"):
        read(store, home, allow_unsigned=True)


def test_unsigned_export_is_marked_and_needs_allow_unsigned(store, home, dev_plan):
    # A signature without its manifest (a write that died between the two) is stale.
    store.put_json("exports/e1/manifest.sig", signing.sign_manifest(manifest(plan=dev_plan),
                                                                    trust.signing_key(dev_plan, home)))
    off = SigningPlan("off")
    entry = trust.write_signed_manifest(store, "e1", manifest(plan=off), off, home)
    assert entry["signed"] is False and entry["signature"] is None
    assert store.list() == ["exports/e1/manifest.json"]  # the stale signature is gone
    with pytest.raises(IntegrityError, match="--allow-unsigned"):
        read(store, home)
    got, line = read(store, home, allow_unsigned=True)
    assert got["signing"] == {"signed": False, "key_fingerprint": None} and "unsigned" in line


def test_signed_manifest_copied_to_another_export_is_refused(store, home, dev_plan):
    trust.write_signed_manifest(store, "e1", manifest(plan=dev_plan), dev_plan, home)
    for name in ("manifest.json", "manifest.sig"):
        store.put_bytes(f"exports/e2/{name}", store.get_bytes(f"exports/e1/{name}"))
    got, _ = read(store, home, export_id="e2")  # the signature is valid...
    with pytest.raises(IntegrityError, match="belongs to export 'e1'"):
        check_manifest(got, export_id="e2")  # ...but it is another export's manifest


def test_explicit_verify_keys_replace_the_defaults(store, home, dev_plan, tmp_path, monkeypatch):
    trust.write_signed_manifest(store, "e1", manifest(plan=dev_plan), dev_plan, home)
    _, pub, other_fp = trust.keygen(tmp_path / "other")
    with pytest.raises(IntegrityError, match="not a trusted verify key"):
        read(store, home, keys={"files": [str(pub)]})
    dev_pub = home / "keys" / "dev-signing.pub"
    assert read(store, home, keys={"files": [str(pub), str(dev_pub)]})[0]
    monkeypatch.setenv(trust.VERIFY_KEY_ENV, str(pub))  # a path works too
    with pytest.raises(IntegrityError, match=other_fp):
        read(store, home)
    monkeypatch.setenv(trust.VERIFY_KEY_ENV, dev_pub.read_text())
    assert read(store, home)[0]


def test_no_verify_key_at_all_is_bad_input(tmp_path):
    s3 = open_store("s3://kiln-bucket/x")
    with pytest.raises(BadInput, match="--verify-key"):
        trust.trusted_keys(store=s3, home=tmp_path)


def test_signing_env_key_is_trusted_by_default(monkeypatch, tmp_path):
    key = signing.generate()
    monkeypatch.setenv(trust.SIGNING_KEY_ENV, signing.private_pem(key).decode())
    keys = trust.trusted_keys(store=open_store("s3://kiln-bucket/x"), home=tmp_path)
    assert list(keys) == [signing.fingerprint(key.public_key())]


def test_unreadable_verify_key_file_is_bad_input(store, home):
    with pytest.raises(BadInput, match="cannot read --verify-key"):
        trust.trusted_keys(files=[os.devnull + "/nope"], store=store, home=home)


def test_an_export_id_in_use_is_refused_and_its_signed_export_left_intact(store, home, dev_plan):
    trust.write_signed_manifest(store, "e1", manifest(plan=dev_plan), dev_plan, home)
    before = {k: store.get_bytes(k) for k in store.list()}
    with pytest.raises(BadInput, match=r"export id 'e1' is taken.*another --export-id"):
        trust.check_export_id_free(store, "e1")
    other = manifest(plan=SigningPlan("off"))
    with pytest.raises(BadInput, match=r"export id 'e1' is taken.*another --export-id"):
        trust.write_signed_manifest(store, "e1", other, SigningPlan("off"), home)
    assert {k: store.get_bytes(k) for k in store.list()} == before
    assert read(store, home)[0] == manifest(plan=dev_plan)
    trust.check_export_id_free(store, "e2")  # a free id passes


def test_the_same_manifest_written_again_is_no_change(store, home, dev_plan):
    """A retried manifest task writes the same bytes: create-once takes them, the signature too (Ed25519)."""
    m = manifest(plan=dev_plan)
    trust.write_signed_manifest(store, "e1", m, dev_plan, home)
    store.delete("exports/e1/manifest.sig")  # the first try died between the manifest and its signature
    trust.write_signed_manifest(store, "e1", m, dev_plan, home)
    assert "signature ok" in read(store, home)[1]


def test_the_manifest_is_written_before_its_signature_each_once(store, home, dev_plan):
    writes = []
    put_bytes, replace = store.put_bytes, store._replace_bytes
    store.put_bytes = lambda key, data: writes.append(("create", key)) or put_bytes(key, data)
    store._replace_bytes = lambda key, data: writes.append(("replace", key)) or replace(key, data)
    trust.write_signed_manifest(store, "e1", manifest(plan=dev_plan), dev_plan, home)
    assert writes == [("create", "exports/e1/manifest.json"), ("create", "exports/e1/manifest.sig")]
