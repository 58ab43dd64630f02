"""Manifest signatures, pure: canonical bytes, fingerprints, key parsing, sign and verify."""

from __future__ import annotations

import base64
import copy
import pickle
import subprocess
import sys

import pytest

from kiln.core.trust import signing
from kiln.core.errors import BadInput, IntegrityError
from kiln.core.trust.signing import SigningPlan

MANIFEST = {"version": 4, "export_id": "e1", "tp": 2, "signing": {"signed": True, "key_fingerprint": None},
            "forwards": [{"key": "ab" * 16, "shapes": "1x8", "batch": [1, 1], "tokens": [8, 8], "hint": [1, 8], "sha256": "0" * 64, "object": f"forwards/{'ab' * 16}.pt2", "python_free": True}],
            "recipe": {"verify_atol": 0.001, "name": "caf\u00e9"}}


@pytest.fixture(scope="module")
def key():
    return signing.generate()


def signed(key, manifest=MANIFEST):
    m = copy.deepcopy(manifest)
    m["signing"]["key_fingerprint"] = signing.fingerprint(key.public_key())
    return m, signing.sign_manifest(m, key)


def trusted(*keys):
    return {signing.fingerprint(k.public_key()): k.public_key() for k in keys}


def test_canonical_bytes_ignore_key_order_and_carry_the_domain_tag():
    shuffled = dict(reversed(list(MANIFEST.items())))
    assert signing.canonical_bytes(shuffled) == signing.canonical_bytes(MANIFEST)
    data = signing.canonical_bytes(MANIFEST)
    assert data.startswith(b"kiln-manifest-v1\n") and data.isascii() and b" " not in data
    assert signing.canonical_bytes({**MANIFEST, "tp": 3}) != data


def test_canonical_bytes_refuse_nan():
    with pytest.raises(ValueError):
        signing.canonical_bytes({"x": float("nan")})


def test_fingerprint_is_stable_and_shaped(key):
    fp = signing.fingerprint(key.public_key())
    assert fp == signing.fingerprint(signing.raw_public(key.public_key()))
    assert fp.startswith("ed25519:") and len(fp) == len("ed25519:") + 32
    assert fp != signing.fingerprint(signing.generate().public_key())


def test_private_key_from_pem_or_base64_seed(key):
    pem = signing.private_pem(key)
    seed = key.private_bytes_raw()
    for text in (pem, pem.decode(), base64.b64encode(seed).decode(), "  " + base64.b64encode(seed).decode() + "\n"):
        parsed = signing.parse_private_key(text, source="test")
        assert signing.fingerprint(parsed.public_key()) == signing.fingerprint(key.public_key())


@pytest.mark.parametrize("text", ["", "not a key", base64.b64encode(b"x" * 31).decode(),
                                  "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----"])
def test_bad_private_keys_name_the_source_not_the_bytes(text):
    with pytest.raises(BadInput) as err:
        signing.parse_private_key(text, source="KILN_SIGNING_KEY")
    assert "KILN_SIGNING_KEY" in str(err.value) and "kiln keygen" in str(err.value)
    if text.strip():
        assert text.strip() not in str(err.value)


def test_private_key_of_another_algorithm_is_refused():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    other = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    with pytest.raises(BadInput, match="not an Ed25519 private key"):
        signing.parse_private_key(other, source="x")


def test_public_keys_from_pem_blocks_or_base64_lines(key):
    other = signing.generate()
    pems = signing.public_pem(key.public_key()) + signing.public_pem(other.public_key())
    assert len(signing.parse_public_keys(pems, source="f")) == 2
    lines = "# trusted\n" + base64.b64encode(signing.raw_public(key.public_key())).decode() + "\n"
    [parsed] = signing.parse_public_keys(lines, source="f")
    assert signing.fingerprint(parsed) == signing.fingerprint(key.public_key())
    with pytest.raises(BadInput, match="private key"):
        signing.parse_public_keys(signing.private_pem(key), source="f")
    with pytest.raises(BadInput, match="holds no public key"):
        signing.parse_public_keys("# nothing\n", source="f")


def test_sign_then_verify(key):
    manifest, sig = signed(key)
    assert signing.verify_manifest(manifest, sig, trusted(key)) == signing.fingerprint(key.public_key())
    assert sig["manifest_sha256"] == __import__("hashlib").sha256(signing.canonical_bytes(manifest)).hexdigest()
    # The document survives a JSON round trip (as it does through the store).
    import json
    assert signing.verify_manifest(json.loads(json.dumps(manifest)), json.loads(json.dumps(sig)), trusted(key))


@pytest.mark.parametrize("change", [
    lambda m: m["forwards"][0].update(sha256="1" * 64),
    lambda m: m.update(tp=3),
    lambda m: m["signing"].update(signed=False),
    lambda m: m["recipe"].update(verify_atol=1.0),
])
def test_a_changed_manifest_is_refused(key, change):
    manifest, sig = signed(key)
    change(manifest)
    with pytest.raises(IntegrityError, match="changed after it was signed"):
        signing.verify_manifest(manifest, sig, trusted(key))


def test_a_changed_signature_is_refused(key):
    manifest, sig = signed(key)
    raw = bytearray(base64.b64decode(sig["signature"]))
    raw[0] ^= 1
    with pytest.raises(IntegrityError, match="signature was changed"):
        signing.verify_manifest(manifest, {**sig, "signature": base64.b64encode(bytes(raw)).decode()}, trusted(key))


def test_an_untrusted_signer_is_refused_even_with_a_valid_signature(key):
    attacker = signing.generate()
    manifest, sig = signed(attacker)
    with pytest.raises(IntegrityError, match="not a trusted verify key") as err:
        signing.verify_manifest(manifest, sig, trusted(key))
    assert signing.fingerprint(key.public_key()) in str(err.value)
    # Relabelling the attacker's signature with the trusted fingerprint does not help.
    relabelled = {**sig, "key_fingerprint": signing.fingerprint(key.public_key())}
    with pytest.raises(IntegrityError, match="does not verify"):
        signing.verify_manifest(manifest, relabelled, trusted(key))


@pytest.mark.parametrize("sig", [None, [], {"kiln_signature": 1}, {"kiln_signature": 1, "algorithm": "rsa"}])
def test_malformed_signature_documents(key, sig):
    with pytest.raises(IntegrityError, match="malformed"):
        signing.verify_manifest(MANIFEST, sig, trusted(key))


def test_signing_plan_carries_no_secret(key):
    fp = signing.fingerprint(key.public_key())
    plan = SigningPlan("env", fp)
    blob = pickle.dumps(plan)
    assert key.private_bytes_raw() not in blob and signing.private_pem(key) not in blob
    assert plan.manifest_entry() == {"signed": True, "key_fingerprint": fp}
    off = SigningPlan("off")
    assert not off.sign and off.manifest_entry() == {"signed": False, "key_fingerprint": None}
    assert "--allow-unsigned" in off.describe() and fp in plan.describe()


def test_signing_module_imports_no_torch_prefect_or_boto3():
    code = ("import sys, kiln.core.trust.signing, kiln.core.trust.manifest, kiln.host.trust.package_check, kiln.host.machine.cache, kiln.host.processes.faults; "
            "print(sorted(m for m in ('torch', 'prefect', 'boto3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
