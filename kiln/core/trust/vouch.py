"""Vouches: a trusted key's word that a forward key's package has a given sha256. Pure: no torch, prefect, boto3.

A compiled forward is native code that every host loads. The store's own
record of an object's sha256 (S3 metadata, a local blob's name) is the word of
whoever can write the store, so it is never enough to load a package. A
forward's digest is trusted only when a vouch for (key, sha256) verifies with a
key the reader trusts:

- the host that compiles a forward signs a vouch with the export's signing key
  and writes it *before* it uploads the package (`vouches/<key>/<sha256>.json`,
  create-once), so every stored package a signed export made is vouched for,
  even when that export dies right after the upload;
- a reader (the export that reuses the forward, or that lost a race to compile
  it) looks up the vouch for the digest the store records and checks its
  signature against its own trusted keys. No vouch that verifies: the stored
  package is not loaded (kiln.core.errors.IntegrityError naming the key).

What is signed: DOMAIN followed by the canonical JSON of {'key', 'sha256',
'export_id', 'compiled_by'}; the domain tag keeps a vouch from being replayed
as a manifest signature and the reverse. A vouch is about bytes, not about an
export: any export of a trusted key may reuse them.
"""

from __future__ import annotations

import base64
import binascii
import json

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kiln.core.errors import IntegrityError
from kiln.core.trust.signing import fingerprint

VOUCH_VERSION = 1
DOMAIN = b"kiln-forward-vouch-v1\n"
"""Prefix of the signed bytes; differs from the manifest's (kiln.core.trust.signing.DOMAIN)."""

_BODY = ("key", "sha256", "export_id", "compiled_by")


def _signed_bytes(body: dict) -> bytes:
    return DOMAIN + json.dumps({k: body[k] for k in _BODY}, sort_keys=True, separators=(",", ":"),
                               ensure_ascii=True).encode("ascii")


def make_vouch(key: str, sha256: str, *, export_id: str, compiled_by: str, signer: Ed25519PrivateKey) -> dict:
    """The vouch document (JSON-able) of `signer` for the package of forward `key` with `sha256`."""
    body = {"key": key, "sha256": sha256, "export_id": export_id, "compiled_by": compiled_by}
    return {"kiln_vouch": VOUCH_VERSION, "algorithm": "ed25519", **body,
            "key_fingerprint": fingerprint(signer.public_key()),
            "signature": base64.b64encode(signer.sign(_signed_bytes(body))).decode()}


def check_vouch(doc: object, key: str, sha256: str, trusted: dict[str, Ed25519PublicKey]) -> str | None:
    """The fingerprint of the trusted key whose valid vouch `doc` is for (key, sha256); None otherwise.

    None covers every way a vouch fails: malformed, for another key or digest,
    signed by a key not in `trusted` (fingerprint -> public key), or a
    signature that does not verify. The caller decides what an unvouched
    forward means (kiln.core.trust.vouch.unvouched_error).
    """
    if not isinstance(doc, dict) or doc.get("kiln_vouch") != VOUCH_VERSION or doc.get("algorithm") != "ed25519":
        return None
    if not all(isinstance(doc.get(f), str) for f in (*_BODY, "key_fingerprint", "signature")):
        return None
    if doc["key"] != key or doc["sha256"] != sha256:
        return None
    public = trusted.get(doc["key_fingerprint"])
    if public is None:
        return None
    try:
        public.verify(base64.b64decode(doc["signature"], validate=True), _signed_bytes(doc))
    except (InvalidSignature, binascii.Error, ValueError):
        return None
    return doc["key_fingerprint"]


def unvouched_error(keys: list[str], recorded: dict[str, str | None], trusted: dict[str, Ed25519PublicKey],
                    objects: dict[str, str]) -> IntegrityError:
    """The error for stored forwards (`keys`) that no trusted key vouched for: which, and what would fix it.

    `recorded`: key -> the sha256 the store records; `objects`: key -> its store object.
    """
    first = keys[0]
    known = ", ".join(sorted(trusted)) or "none: this export is unsigned and KILN_VERIFY_KEY is not set"
    more = f" (and {len(keys) - 1} more: {', '.join(keys[1:4])}{', ...' if len(keys) > 4 else ''})" \
        if len(keys) > 1 else ""
    return IntegrityError(
        f"forward {first}{more} is in the store ({objects[first]}, sha256 {recorded.get(first) or 'unrecorded'}) "
        f"but no key this export trusts vouched for those bytes (trusted keys: {known}); Kiln loads no native "
        "code on the store's word, so nothing was compiled or loaded. If a trusted export made it, give its "
        "signer's public key with KILN_VERIFY_KEY; otherwise delete the object (someone wrote it behind Kiln's "
        "back, or an unsigned export did) and export again: it will be compiled anew.")
