"""Vouches (kiln/core/trust/vouch.py) and the store reads that rely on them (kiln/host/phases/share.py,
kiln/host/phases/host_compile.py): a stored package is loadable only when a trusted key vouched for its bytes;
several signers' packages of one key live side by side, each export loading its own signer's (or one it
trusts) and never another's. Local store in a tmp directory; no compile (the 'packages' are arbitrary bytes:
nothing here loads them)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.core.trust import layout, signing
from kiln.core.errors import IntegrityError, StoreConflict
from kiln.core.trust.vouch import check_vouch, make_vouch, untrusted_warning, vouched_calls
from kiln.store import LocalStore
from kiln.host.phases import host_compile, share

KEY = "0123456789abcdef0123456789abcdef"
CALLS = {"python_free": True, "ops": ["aoti_torch_cpu_mm"], "why": None}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def vouch(key, sha256, signer, **kw):
    return make_vouch(key, sha256, export_id=kw.get("export_id", "e1"), compiled_by=kw.get("compiled_by", "h0"),
                      calls=kw.get("calls", CALLS), signer=signer)


def test_a_vouch_holds_for_its_key_and_digest_only(signer, trusted):
    doc = vouch(KEY, "a" * 64, signer)
    assert check_vouch(doc, KEY, "a" * 64, trusted) == signing.fingerprint(signer.public_key())
    assert check_vouch(doc, KEY, "b" * 64, trusted) is None  # other bytes
    assert check_vouch(doc, "f" * 32, "a" * 64, trusted) is None  # copied under another forward key
    assert check_vouch(doc, KEY, "a" * 64, {}) is None  # nobody trusted
    other = signing.generate()
    assert check_vouch(doc, KEY, "a" * 64, {signing.fingerprint(other.public_key()): other.public_key()}) is None
    for field, value in (("sha256", "b" * 64), ("key", "f" * 32), ("export_id", "e2"), ("compiled_by", "evil"),
                         ("calls", {**CALLS, "python_free": False})):
        assert check_vouch({**doc, field: value}, doc["key"] if field != "key" else value,
                           doc["sha256"] if field != "sha256" else value, trusted) is None, field
    forged = vouch(KEY, "a" * 64, other)
    assert check_vouch({**forged, "key_fingerprint": doc["key_fingerprint"]}, KEY, "a" * 64, trusted) is None
    for junk in (None, [], {"kiln_vouch": 1}, {**doc, "signature": "not base64!"}, {**doc, "calls": None}):
        assert check_vouch(junk, KEY, "a" * 64, trusted) is None
    assert vouched_calls(doc) == CALLS  # what the package calls is signed with its digest


def test_a_version_1_vouch_still_verifies_and_carries_no_calls(signer, trusted):
    """Stores written before vouches said what a package calls: their vouches are still good, and the reader
    inspects those bytes itself."""
    import base64
    import json

    from kiln.core.trust import vouch as vouch_module

    body = {"key": KEY, "sha256": "a" * 64, "export_id": "e1", "compiled_by": "h0"}
    signed = vouch_module.DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    doc = {"kiln_vouch": 1, "algorithm": "ed25519", **body, "key_fingerprint": signing.fingerprint(signer.public_key()),
           "signature": base64.b64encode(signer.sign(signed)).decode()}
    assert check_vouch(doc, KEY, "a" * 64, trusted) and vouched_calls(doc) is None


def test_a_manifest_signature_is_no_vouch(signer, trusted):
    """The two documents sign different domains: one cannot stand in for the other."""
    body = {"key": KEY, "sha256": "a" * 64, "export_id": "e1", "compiled_by": "h0"}
    sig = signing.sign_manifest(body, signer)
    assert check_vouch({"kiln_vouch": 1, "algorithm": "ed25519", **body, "key_fingerprint": sig["key_fingerprint"],
                        "signature": sig["signature"]}, KEY, "a" * 64, trusted) is None


def put_forward(store: LocalStore, key: str, data: bytes, tmp: Path) -> str:
    path = tmp / f"{key}-{sha(data)[:8]}.pt2"
    path.write_bytes(data)
    store.put_file(layout.artifact_key(key, sha(data)), path, sha(data))
    return sha(data)


def test_a_package_is_loadable_only_when_a_trusted_key_vouched_for_it(tmp_path, signer, trusted):
    store = LocalStore(tmp_path / "store")
    good = put_forward(store, KEY, b"vouched package", tmp_path)
    store.put_json(layout.vouch_key(KEY, good, signing.fingerprint(signer.public_key())), vouch(KEY, good, signer))
    found, untrusted = share.trusted_packages(store, [KEY, "f" * 32], trusted, {})
    assert {k: p.sha256 for k, p in found.items()} == {KEY: good} and untrusted == {}  # absent: left out
    assert found[KEY].object == layout.artifact_key(KEY, good) and found[KEY].calls == CALLS

    # A planted package beside it, with its own correct digest in the store's records: named, never chosen.
    evil = put_forward(store, KEY, b"someone else's native code", tmp_path)
    found, untrusted = share.trusted_packages(store, [KEY], trusted, {})
    assert found[KEY].sha256 == good and untrusted == {KEY: [evil]}
    warning = untrusted_warning(untrusted, trusted)
    assert KEY in warning and evil in warning and "compiles its own" in warning
    # Copying a real vouch of another key next to the evil bytes does not help.
    fp = signing.fingerprint(signer.public_key())
    store.put_json(layout.vouch_key(KEY, evil, fp), vouch("e" * 32, evil, signer))
    assert share.trusted_packages(store, [KEY], trusted, {})[1] == {KEY: [evil]}
    # Only the planted package at a key: the key is not loadable, the export compiles its own.
    other = "2" * 32
    put_forward(store, other, b"planted alone", tmp_path)
    assert share.trusted_packages(store, [other], trusted, {}) == ({}, {other: [sha(b"planted alone")]})
    # An unsigned export trusts no stored digest but the ones its own hosts reported.
    found, untrusted = share.trusted_packages(store, [KEY], {}, {KEY: evil})
    assert found[KEY].sha256 == evil and found[KEY].calls is None and untrusted == {KEY: [good]}


def test_a_store_written_before_digests_is_read_as_it_is(tmp_path, signer, trusted):
    """forwards/<key>.pt2 with its one vouch at vouches/<key>/<sha256>.json: still loadable, never rewritten."""
    store = LocalStore(tmp_path / "store")
    path = tmp_path / "old.pt2"
    path.write_bytes(b"an older export's package")
    old = sha(b"an older export's package")
    store.put_file(layout.legacy_artifact_key(KEY), path, old)
    store.put_json(layout.legacy_vouch_key(KEY, old), vouch(KEY, old, signer))
    found, untrusted = share.trusted_packages(store, [KEY], trusted, {})
    assert found[KEY].sha256 == old and found[KEY].object == layout.legacy_artifact_key(KEY) and not untrusted


def test_the_outcome_check_refuses_bytes_changed_after_they_were_trusted(tmp_path):
    store = LocalStore(tmp_path / "store")
    one = put_forward(store, KEY, b"one", tmp_path)
    mine = share.Stored(KEY, sha(b"two"), layout.artifact_key(KEY, one), CALLS, None)  # the store now says "one"
    with pytest.raises(IntegrityError, match="changed behind this export"):
        share.stored_forwards(store, [KEY], {KEY: mine})
    assert share.stored_forwards(store, [KEY], {})[1] == [KEY]  # no trusted package: not there


@dataclass
class Result:
    key: str
    path: Path
    sha256: str
    calls: dict


@dataclass
class Job:
    export_id: str = "e2"


def test_two_signers_store_their_packages_side_by_side(tmp_path, signer, trusted):
    """Two compiles of one key by two signers make different bytes: both are stored, each with its signer's
    vouch; each signer's reader loads its own, and nothing is replaced."""
    store = LocalStore(tmp_path / "store")
    second_signer = signing.generate()
    trusted_2 = {signing.fingerprint(second_signer.public_key()): second_signer.public_key()}
    first, second = tmp_path / "first.pt2", tmp_path / "second.pt2"
    first.write_bytes(b"compile one")
    second.write_bytes(b"compile two")
    a, b = sha(b"compile one"), sha(b"compile two")
    host_compile.publish(store, Job("e1"), "h0", Result(KEY, first, a, CALLS), signer)
    host_compile.publish(store, Job("e2"), "h1", Result(KEY, second, b, CALLS), second_signer)
    assert share.find_trusted(store, KEY, trusted) == (share.Stored(KEY, a, layout.artifact_key(KEY, a), CALLS,
                                                                    next(iter(trusted))), [b])
    assert share.find_trusted(store, KEY, trusted_2)[0].sha256 == b
    assert share.find_trusted(store, KEY, {**trusted, **trusted_2})[1] == []  # trusting both: nothing to warn of
    assert share.packages_of(store, KEY) == sorted([(a, layout.artifact_key(KEY, a)), (b, layout.artifact_key(KEY, b))])
    # The same bytes again (a retry that found its own upload): stored, no conflict, one vouch.
    host_compile.publish(store, Job("e1"), "h0", Result(KEY, first, a, CALLS), signer)
    assert len(store.list(layout.vouch_prefix(KEY, a))) == 1
    # Unsigned: no vouch, the package stored all the same.
    other = "1" * 32
    host_compile.publish(store, Job("e3"), "h0", Result(other, second, b, CALLS), None)
    assert store.list(layout.vouch_prefix(other, b)) == [] and store.exists(layout.artifact_key(other, b))
    assert host_compile.lease_scope(None) == "unsigned"
    assert host_compile.lease_scope(signer) != host_compile.lease_scope(second_signer)


def test_a_conflict_carries_the_stored_digest(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put_bytes("x/y.bin", b"one")
    with pytest.raises(StoreConflict) as err:
        store.put_bytes("x/y.bin", b"two")
    assert err.value.existing == sha(b"one")


def test_the_loader_loads_the_bytes_it_hashed_from_a_private_copy(tmp_path, monkeypatch):
    """No window between the digest check and the load: what AOTInductor opens is a private copy made
    while hashing, so changing the file at `path` after the check changes nothing that is loaded."""
    import torch._inductor

    from kiln.host.ranks import loader

    path = tmp_path / "fwd.pt2"
    path.write_bytes(b"the package that was vouched for")
    seen = {}

    class Stop(Exception):
        pass

    def fake_load(p, *args, **kwargs):
        path.write_bytes(b"swapped in after the check")  # the attacker's move, too late
        seen["path"], seen["sha"] = p, sha(Path(p).read_bytes())
        seen["mode"] = Path(p).stat().st_mode & 0o777
        raise Stop

    monkeypatch.setattr(loader, "check_package", lambda p: None)
    monkeypatch.setattr(loader, "package_device", lambda p: "cpu")
    monkeypatch.setattr(torch._inductor, "aoti_load_package", fake_load)
    with pytest.raises(Stop):
        loader.load_forward(path, {}, sha(b"the package that was vouched for"))
    assert Path(seen["path"]) != path and seen["sha"] == sha(b"the package that was vouched for")
    assert seen["mode"] == 0o600 and not Path(seen["path"]).exists()  # removed once loaded
