"""Manifest signatures: Ed25519 over canonical bytes. Pure: no torch, prefect or boto3.

What is signed: `canonical_bytes(manifest)`, a domain tag followed by the
manifest's canonical JSON (sorted keys, no whitespace, ASCII only), so the
signature does not depend on how the store encoded the file. The signature
document (stored beside the manifest as `manifest.sig`) names the key by
fingerprint and carries the manifest's sha256 for diagnostics; trust comes only
from the verifier's own list of public keys, never from the document.

Key formats: a private key is an unencrypted PEM (PKCS8, "BEGIN PRIVATE KEY")
or the base64 of its 32-byte raw seed; a public key is a PEM ("BEGIN PUBLIC
KEY") or the base64 of its 32 raw bytes. Error messages name where a key came
from, never its bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kiln.core.errors import BadInput, IntegrityError

SIGNATURE_VERSION = 1
DOMAIN = b"kiln-manifest-v1\n"
"""Prefix of the signed bytes: a Kiln manifest signature cannot be replayed as anything else."""

_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----.+?-----END \1-----", re.S)


def canonical_bytes(manifest: dict) -> bytes:
    """The bytes a manifest signature covers: DOMAIN + canonical JSON of `manifest`."""
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return DOMAIN + body.encode("ascii")


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint(key: Ed25519PublicKey | bytes) -> str:
    """'ed25519:' + the first 32 hex characters of sha256(raw 32-byte public key)."""
    raw = key if isinstance(key, bytes) else raw_public(key)
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:32]


def decode_b64_32(text: bytes) -> bytes | None:
    """The 32 bytes that `text` is the base64 of, or None."""
    try:
        raw = base64.b64decode(b"".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 32 else None


def parse_private_key(text: str | bytes, *, source: str) -> Ed25519PrivateKey:
    """An Ed25519 private key from PEM or base64 of the raw seed; BadInput naming `source` otherwise."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    data = data.strip()
    if b"-----BEGIN" in data:
        if b"ENCRYPTED" in data:
            raise BadInput(f"the signing key from {source} is encrypted; Kiln needs an unencrypted PEM "
                           "(keep it in a Prefect Secret block or a protected environment instead).")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError, binascii.Error):
            key = None
        if isinstance(key, Ed25519PrivateKey):
            return key
        raise BadInput(f"the signing key from {source} is not an Ed25519 private key in PEM; "
                       "create one with `kiln keygen DIR`.")
    raw = decode_b64_32(data)
    if raw is None:
        raise BadInput(f"the signing key from {source} is neither an Ed25519 PEM private key nor the base64 "
                       "of 32 raw bytes; create one with `kiln keygen DIR`.")
    return Ed25519PrivateKey.from_private_bytes(raw)


def parse_public_keys(text: str | bytes, *, source: str) -> list[Ed25519PublicKey]:
    """Every Ed25519 public key in `text`: PEM blocks, or base64 lines of 32 raw bytes."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    keys: list[Ed25519PublicKey] = []
    blocks = [m.group(0) for m in _PEM_BLOCK.finditer(data)]
    if blocks:
        for block in blocks:
            if b"PRIVATE KEY" in block:
                raise BadInput(f"{source} holds a private key; give verifiers the public key only "
                               "(the .pub file that `kiln keygen` writes).")
            try:
                key = serialization.load_pem_public_key(block)
            except (ValueError, TypeError, binascii.Error):
                key = None
            if not isinstance(key, Ed25519PublicKey):
                raise BadInput(f"{source} holds a PEM block that is not an Ed25519 public key.")
            keys.append(key)
    else:
        for line in data.replace(b",", b"\n").splitlines():
            if not line.strip() or line.strip().startswith(b"#"):
                continue
            raw = decode_b64_32(line.strip())
            if raw is None:
                raise BadInput(f"{source} is neither PEM nor base64 of 32-byte Ed25519 public keys.")
            keys.append(Ed25519PublicKey.from_public_bytes(raw))
    if not keys:
        raise BadInput(f"{source} holds no public key.")
    return keys


def private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def public_pem(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def generate() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@dataclass(frozen=True)
class SigningPlan:
    """How an export's manifest is signed; picklable and free of secrets (travels with the job).

    `source` is 'env' (KILN_SIGNING_KEY), 'block' (a Prefect Secret block),
    'dev' (the local development key file) or 'off' (--unsigned).
    """

    source: str
    fingerprint: str | None = None
    block: str | None = None
    dev_key_path: str | None = None

    @property
    def sign(self) -> bool:
        return self.source != "off"

    def manifest_entry(self) -> dict:
        """The manifest's `signing` entry (covered by the signature itself)."""
        return {"signed": self.sign, "key_fingerprint": self.fingerprint}

    def describe(self) -> str:
        if not self.sign:
            return "unsigned (--unsigned): `kiln verify` refuses it unless given --allow-unsigned"
        where = {"env": "KILN_SIGNING_KEY", "block": f"Prefect Secret block {self.block!r}",
                 "dev": f"the local development key {self.dev_key_path}"}[self.source]
        return f"signed with {self.fingerprint} from {where}"


def sign_manifest(manifest: dict, key: Ed25519PrivateKey) -> dict:
    """The signature document for `manifest` (JSON-able)."""
    data = canonical_bytes(manifest)
    public = key.public_key()
    return {"kiln_signature": SIGNATURE_VERSION, "algorithm": "ed25519",
            "key_fingerprint": fingerprint(public),
            "public_key": base64.b64encode(raw_public(public)).decode(),
            "manifest_sha256": hashlib.sha256(data).hexdigest(),
            "signature": base64.b64encode(key.sign(data)).decode()}


def verify_manifest(manifest: dict, signature: object, trusted: dict[str, Ed25519PublicKey], *,
                    what: str = "the manifest") -> str:
    """Check `signature` over `manifest` with one of the `trusted` keys (fingerprint -> key).

    Returns the signer's fingerprint; raises IntegrityError naming what is wrong.
    """
    fields = ("key_fingerprint", "public_key", "manifest_sha256", "signature")
    if (not isinstance(signature, dict) or signature.get("kiln_signature") != SIGNATURE_VERSION
            or signature.get("algorithm") != "ed25519"
            or not all(isinstance(signature.get(f), str) for f in fields)):
        raise IntegrityError(f"the signature of {what} is malformed; refusing the export.")
    fp = signature["key_fingerprint"]
    key = trusted.get(fp)
    if key is None:
        known = ", ".join(sorted(trusted)) or "none"
        raise IntegrityError(f"{what} is signed by key {fp}, which is not a trusted verify key "
                             f"(trusted: {known}); refusing the export. Pass the signer's public key "
                             "with --verify-key FILE or KILN_VERIFY_KEY if you trust it.")
    data = canonical_bytes(manifest)
    try:
        sig = base64.b64decode(signature["signature"], validate=True)
        key.verify(sig, data)
    except (InvalidSignature, binascii.Error, ValueError):
        changed = hashlib.sha256(data).hexdigest() != signature["manifest_sha256"]
        raise IntegrityError(
            f"the signature of {what} does not verify with key {fp}: "
            + ("the manifest was changed after it was signed" if changed else "the signature was changed")
            + "; refusing the export.") from None
    return fp
