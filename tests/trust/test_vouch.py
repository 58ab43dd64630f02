"""Vouches (kiln/core/trust/vouch.py) and the store reads that rely on them (kiln/host/phases/share.py, kiln/host/phases/host_compile.py): a stored forward's
digest is trusted only when a trusted key vouched for it, and a second compile of a key is reuse. Local store
in a tmp directory; no compile (the 'packages' are arbitrary bytes: nothing here loads them)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.core.trust import layout, signing
from kiln.core.errors import IntegrityError, StoreConflict
from kiln.core.trust.vouch import check_vouch, make_vouch
from kiln.store import LocalStore
from kiln.host.phases import host_compile, share

KEY = "0123456789abcdef0123456789abcdef"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def signer():
    return signing.generate()


@pytest.fixture
def trusted(signer):
    return {signing.fingerprint(signer.public_key()): signer.public_key()}


def test_a_vouch_holds_for_its_key_and_digest_only(signer, trusted):
    doc = make_vouch(KEY, "a" * 64, export_id="e1", compiled_by="h0", signer=signer)
    assert check_vouch(doc, KEY, "a" * 64, trusted) == signing.fingerprint(signer.public_key())
    assert check_vouch(doc, KEY, "b" * 64, trusted) is None  # other bytes
    assert check_vouch(doc, "f" * 32, "a" * 64, trusted) is None  # copied under another forward key
    assert check_vouch(doc, KEY, "a" * 64, {}) is None  # nobody trusted
    other = signing.generate()
    assert check_vouch(doc, KEY, "a" * 64, {signing.fingerprint(other.public_key()): other.public_key()}) is None
    for field, value in (("sha256", "b" * 64), ("key", "f" * 32), ("export_id", "e2"), ("compiled_by", "evil")):
        assert check_vouch({**doc, field: value}, doc["key"] if field != "key" else value,
                           doc["sha256"] if field != "sha256" else value, trusted) is None, field
    forged = make_vouch(KEY, "a" * 64, export_id="e1", compiled_by="h0", signer=other)
    assert check_vouch({**forged, "key_fingerprint": doc["key_fingerprint"]}, KEY, "a" * 64, trusted) is None
    for junk in (None, [], {"kiln_vouch": 1}, {**doc, "signature": "not base64!"}):
        assert check_vouch(junk, KEY, "a" * 64, trusted) is None


def test_a_manifest_signature_is_no_vouch(signer, trusted):
    """The two documents sign different domains: one cannot stand in for the other."""
    body = {"key": KEY, "sha256": "a" * 64, "export_id": "e1", "compiled_by": "h0"}
    sig = signing.sign_manifest(body, signer)
    assert check_vouch({"kiln_vouch": 1, "algorithm": "ed25519", **body, "key_fingerprint": sig["key_fingerprint"],
                        "signature": sig["signature"]}, KEY, "a" * 64, trusted) is None


def put_forward(store: LocalStore, key: str, data: bytes, tmp: Path) -> str:
    path = tmp / f"{key}-{sha(data)[:8]}.pt2"
    path.write_bytes(data)
    store.put_file(layout.artifact_key(key), path, sha(data))
    return sha(data)


def test_stored_forwards_are_trusted_only_when_vouched(tmp_path, signer, trusted):
    store = LocalStore(tmp_path / "store")
    good = put_forward(store, KEY, b"vouched package", tmp_path)
    store.put_json(layout.vouch_key(KEY, good), make_vouch(KEY, good, export_id="e1", compiled_by="h", signer=signer))
    assert share.trusted_digests(store, [KEY, "f" * 32], trusted, {}) == {KEY: good}  # absent: left out

    # The tamper: the key now names other bytes, with their own correct digest in the store's records.
    store.delete(layout.artifact_key(KEY))
    evil = put_forward(store, KEY, b"someone else's native code", tmp_path)
    with pytest.raises(IntegrityError) as err:
        share.trusted_digests(store, [KEY], trusted, {})
    assert KEY in str(err.value) and evil in str(err.value) and "delete the object" in str(err.value)
    # Copying a real vouch of another key (or of other bytes) next to the evil bytes does not help.
    store.put_json(layout.vouch_key(KEY, evil), make_vouch("e" * 32, evil, export_id="e1", compiled_by="h",
                                                           signer=signer))
    with pytest.raises(IntegrityError):
        share.trusted_digests(store, [KEY], trusted, {})
    # An unsigned export trusts no stored digest but the ones its own hosts reported.
    assert share.trusted_digests(store, [KEY], {}, {KEY: evil}) == {KEY: evil}
    with pytest.raises(IntegrityError, match="this export is unsigned"):
        share.trusted_digests(store, [KEY], {}, {KEY: good})


def test_the_outcome_check_refuses_bytes_changed_after_they_were_trusted(tmp_path):
    store = LocalStore(tmp_path / "store")
    put_forward(store, KEY, b"one", tmp_path)
    with pytest.raises(IntegrityError, match="changed behind this export"):
        share.stored_forwards(store, [KEY], {KEY: sha(b"two")})
    assert share.stored_forwards(store, [KEY], {})[1] == [KEY]  # no trusted digest: not there


@dataclass
class Result:
    key: str
    path: Path
    sha256: str


@dataclass
class Job:
    export_id: str = "e2"


def test_a_second_compile_of_a_key_is_reuse_not_an_error(tmp_path, signer, trusted):
    """Two compiles of one key make different bytes; the one stored first wins, the second is told its digest,
    and both are vouched for, so a reader of either export trusts what is stored."""
    store = LocalStore(tmp_path / "store")
    first, second = tmp_path / "first.pt2", tmp_path / "second.pt2"
    first.write_bytes(b"compile one")
    second.write_bytes(b"compile two")
    a = host_compile.publish(store, Job("e1"), "h0", Result(KEY, first, sha(b"compile one")), signer)
    b = host_compile.publish(store, Job("e2"), "h1", Result(KEY, second, sha(b"compile two")), signer)
    assert a == b == sha(b"compile one")
    assert share.trusted_digests(store, [KEY], trusted, {}) == {KEY: a}
    # The same bytes again (a retry that found its own upload): stored, no conflict.
    assert host_compile.publish(store, Job("e1"), "h0", Result(KEY, first, a), signer) == a
    # Unsigned: no vouch, and the conflict is still reuse.
    other = "1" * 32
    assert host_compile.publish(store, Job("e3"), "h0", Result(other, second, sha(b"compile two")), None) \
        == sha(b"compile two")
    assert store.list(layout.vouch_key(other, "")[:-5]) == []


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
