"""Records that later exports act on, signed: only a trusted key's word sizes a pool or is reused. Pure.

The store holds measurements that decide what later exports do: a compile
worker's measured peak (`memory/`: the gate sizes compile pools by it) and a
GEMM shape's kernel-tuning result (`tuning/`: it picks the kernels a forward
compiles with). Anyone
who can write the store can write such a record, so a reader acts on one only
when a key it trusts signed it; any other record is ignored, as if never
measured (the recipe's own figures stand).

What is signed: DOMAIN, the record's kind and a newline, then the canonical
JSON of its body (sorted keys, no whitespace, ASCII). The kind keeps a record
of one kind from being replayed as another.
"""

from __future__ import annotations

import base64
import binascii
import json

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kiln.core.trust.signing import fingerprint

RECORD_VERSION = 1
DOMAIN = b"kiln-record-v1\n"
"""Prefix of the signed bytes; differs from a manifest's and a vouch's."""


def _signed_bytes(kind: str, body: dict) -> bytes:
    return DOMAIN + kind.encode("ascii") + b"\n" + json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def sign_record(kind: str, body: dict, signer: Ed25519PrivateKey) -> dict:
    """The stored document of `body` (JSON-able) as a record of `kind`, signed by `signer`."""
    return {"kiln_record": RECORD_VERSION, "kind": kind, "body": body,
            "key_fingerprint": fingerprint(signer.public_key()),
            "signature": base64.b64encode(signer.sign(_signed_bytes(kind, body))).decode()}


def trusted_body(doc: object, kind: str, trusted: dict[str, Ed25519PublicKey]) -> dict | None:
    """The body of `doc` when it is a record of `kind` signed by one of `trusted` (fingerprint -> public
    key); None for anything else (malformed, another kind, unsigned, an untrusted or failing signature)."""
    if not isinstance(doc, dict) or doc.get("kiln_record") != RECORD_VERSION or doc.get("kind") != kind:
        return None
    body, fp, sig = doc.get("body"), doc.get("key_fingerprint"), doc.get("signature")
    if not isinstance(body, dict) or not isinstance(fp, str) or not isinstance(sig, str):
        return None
    public = trusted.get(fp)
    if public is None:
        return None
    try:
        public.verify(base64.b64decode(sig, validate=True), _signed_bytes(kind, body))
    except (InvalidSignature, binascii.Error, ValueError):
        return None
    return body
