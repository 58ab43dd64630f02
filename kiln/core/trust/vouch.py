"""Vouches: a trusted key's word that a forward key's package has a given sha256, and what it calls. Pure.

A compiled forward is native code that every host loads. The store's own
record of an object's sha256 (S3 metadata, a local blob's name) is the word of
whoever can write the store, so it is never enough to load a package. A
forward's digest is trusted only when a vouch for (key, sha256) verifies with a
key the reader trusts:

- the host that compiles a forward signs a vouch with the export's signing key
  and writes it *before* it uploads the package
  (`vouches/<key>/<sha256>/<signer>.json`, create-once), so every stored
  package a signed export made is vouched for, even when that export dies
  right after the upload;
- a reader (the export that reuses the forward, a later probe) looks up the
  vouches for each digest the store holds under the key and checks their
  signatures against its own trusted keys. A digest no trusted key vouched for
  is not loaded: the reader compiles its own and stores it beside the others.

What is signed: DOMAIN followed by the canonical JSON of {'key', 'sha256',
'export_id', 'compiled_by', 'calls'}: 'calls' is what the package's wrapper
calls as its compiling host inspected it (kiln.host.trust.package_check:
'python_free', 'ops', 'why'), so the manifest's claim that a forward is
Python-free comes from a signed word, never from an unsigned record. Version 1
vouches (stores written before) carry no 'calls': a reader inspects those
bytes itself. The domain tag keeps a vouch from being replayed as a manifest
signature and the reverse. A vouch is about bytes, not about an export: any
export of a trusted key may reuse them.
"""

from __future__ import annotations

import base64
import binascii
import json

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kiln.core.trust.signing import fingerprint

VOUCH_VERSION = 2
READ_VERSIONS = (1, 2)
"""Versions a reader accepts: 1 (no 'calls'; stores written before) and 2."""
DOMAIN = b"kiln-forward-vouch-v1\n"
"""Prefix of the signed bytes; differs from the manifest's (kiln.core.trust.signing.DOMAIN)."""

_BODY = ("key", "sha256", "export_id", "compiled_by")
"""The signed fields of every version; version 2 adds 'calls'."""
CALLS = ("python_free", "ops", "why")
"""What a vouch says the package calls (kiln.host.trust.package_check.package_calls)."""


def _signed_bytes(body: dict) -> bytes:
    fields = _BODY + (("calls",) if body.get("kiln_vouch", VOUCH_VERSION) >= 2 else ())
    return DOMAIN + json.dumps({k: body[k] for k in fields}, sort_keys=True, separators=(",", ":"),
                               ensure_ascii=True).encode("ascii")


def make_vouch(key: str, sha256: str, *, export_id: str, compiled_by: str, calls: dict,
               signer: Ed25519PrivateKey) -> dict:
    """The vouch document (JSON-able) of `signer` for the package of forward `key` with `sha256`, which
    calls `calls` ({'python_free', 'ops', 'why'})."""
    body = {"key": key, "sha256": sha256, "export_id": export_id, "compiled_by": compiled_by,
            "calls": {k: calls[k] for k in CALLS}}
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
    if not isinstance(doc, dict) or doc.get("kiln_vouch") not in READ_VERSIONS or doc.get("algorithm") != "ed25519":
        return None
    if not all(isinstance(doc.get(f), str) for f in (*_BODY, "key_fingerprint", "signature")):
        return None
    if doc["kiln_vouch"] >= 2 and not _calls_shaped(doc.get("calls")):
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


def _calls_shaped(calls: object) -> bool:
    return (isinstance(calls, dict) and isinstance(calls.get("python_free"), bool)
            and isinstance(calls.get("ops"), list) and all(isinstance(op, str) for op in calls["ops"])
            and (calls.get("why") is None or isinstance(calls.get("why"), str)))


def vouched_calls(doc: dict) -> dict | None:
    """What a vouch that `check_vouch` accepted says its package calls; None for a version 1 vouch."""
    return {k: doc["calls"][k] for k in CALLS} if doc.get("kiln_vouch", 1) >= 2 else None


def untrusted_warning(untrusted: dict[str, list[str]], trusted: dict[str, Ed25519PublicKey]) -> str:
    """The warning for packages the store holds that no key this export trusts vouched for (`untrusted`:
    forward key -> their sha256s): which, and what it means."""
    first = sorted(untrusted)[0]
    count = sum(len(v) for v in untrusted.values())
    more = f" and {len(untrusted) - 1} more key(s)" if len(untrusted) > 1 else ""
    known = ", ".join(sorted(trusted)) or "none: this export is unsigned and KILN_VERIFY_KEY is not set"
    return (f"the store holds {count} package(s) of forward {first}{more} (sha256 {', '.join(untrusted[first][:2])}"
            f"{', ...' if len(untrusted[first]) > 2 else ''}) that no key this export trusts vouched for "
            f"(trusted keys: {known}): they are not loaded; this export compiles its own and stores them beside "
            "those. If a signer you trust made them, give its public key with KILN_VERIFY_KEY to reuse them.")
