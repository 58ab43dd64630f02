"""Validation of store keys, prefixes and S3 bucket names, and sha256 helpers.

Pure: imports neither boto3 nor anything that touches the network. A key is a
'/'-separated relative path such as 'forwards/ab12.pt2'; the same key must mean
the same object in a local directory and in S3, so anything a filesystem or S3
would interpret differently ('..', '//', backslashes, control characters) is
rejected up front with BadInput.

Normalisation: a key must be in Unicode NFC and no part may end in '.' or ' '
(macOS rewrites names to NFD, Windows and SMB drop trailing dots and spaces, so
such a key could name a different file than it says). Keys that differ only in
case, Unicode form or trailing dots/spaces are distinct in S3 but one file on a
case-insensitive filesystem: `normalized_key` maps them together and
`check_no_collisions` refuses a set of keys in which two collide.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from kiln.core.errors import BadInput

CHUNK_BYTES = 1024 * 1024
"""Read size for streamed hashing and copying (1 MiB)."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# AWS rules for new buckets: 3-63 chars, lowercase letters, digits, '.', '-';
# starts and ends with a letter or digit. S3-compatible stores accept these too.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4 = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


def _check_parts(what: str, text: str, parts: list[str]) -> None:
    if _CONTROL.search(text):
        raise BadInput(f"store {what} {text!r} contains a control character; use printable characters only")
    if "\\" in text:
        raise BadInput(f"store {what} {text!r} contains a backslash; separate parts with '/'")
    if text.startswith("/"):
        raise BadInput(f"store {what} {text!r} is absolute; drop the leading '/'")
    for part in parts:
        if part == "":
            raise BadInput(f"store {what} {text!r} has an empty part ('//' or a trailing '/')")
        if part in (".", ".."):
            raise BadInput(f"store {what} {text!r} has a {part!r} part; use plain names")


def validate_key(key: str) -> str:
    """Return `key` unchanged if it is a valid object key, else raise BadInput.

    Valid: non-empty, relative, '/'-separated, no empty/'.'/'..' parts, no
    backslash, no control characters, NFC, no part ending in '.' or ' '.
    """
    if not isinstance(key, str):
        raise BadInput(f"store key must be a string, not {type(key).__name__}: {key!r}")
    if key == "":
        raise BadInput("store key is empty; name the object, e.g. 'folder/name.json'")
    parts = key.split("/")
    _check_parts("key", key, parts)
    for part in parts:
        if part.endswith((".", " ")):
            raise BadInput(f"store key {key!r} has a part ending in '.' or ' ' ({part!r}), which some "
                           "filesystems drop; use plain names")
    if unicodedata.normalize("NFC", key) != key:
        raise BadInput(f"store key {key!r} is not in Unicode NFC form; some filesystems would store it "
                       "under another name: normalise it to NFC")
    return key


def validate_prefix(prefix: str) -> str:
    """Return `prefix` unchanged if it is a valid listing prefix, else raise BadInput.

    Same rules as `validate_key`, except that '' (everything) and one trailing
    '/' are allowed. A prefix matches keys by plain string prefix, as in S3.
    """
    if not isinstance(prefix, str):
        raise BadInput(f"store prefix must be a string, not {type(prefix).__name__}: {prefix!r}")
    if prefix == "":
        return prefix
    body = prefix[:-1] if prefix.endswith("/") else prefix
    if body == "":
        raise BadInput(f"store prefix {prefix!r} is absolute; drop the leading '/'")
    _check_parts("prefix", prefix, body.split("/"))
    return prefix


def normalized_key(key: str) -> str:
    """The form under which filesystems may confuse keys: NFC, case-folded, trailing dots/spaces dropped."""
    parts = unicodedata.normalize("NFC", key).split("/")
    return "/".join(unicodedata.normalize("NFC", p.casefold()).rstrip(". ") for p in parts)


def check_no_collisions(keys: Iterable[str], *, what: str = "store keys") -> None:
    """Raise BadInput if two of `keys` are equal or become equal under `normalized_key`."""
    seen: dict[str, str] = {}
    for key in keys:
        norm = normalized_key(key)
        if norm not in seen:
            seen[norm] = key
            continue
        other = seen[norm]
        if other == key:
            raise BadInput(f"{what}: {key!r} appears twice; every name must be distinct")
        raise BadInput(f"{what}: {other!r} and {key!r} are the same name on case-insensitive or "
                       "Unicode-normalising filesystems; every name must be distinct after case-folding "
                       "and normalisation")


def validate_bucket(bucket: str) -> str:
    """Return `bucket` if it is a valid S3 bucket name (AWS naming rules), else raise BadInput."""
    if not _BUCKET.match(bucket) or ".." in bucket or _IPV4.match(bucket):
        raise BadInput(
            f"S3 bucket name {bucket!r} is invalid; use 3-63 lowercase letters, digits, '.' or '-', "
            "starting and ending with a letter or digit"
        )
    return bucket


def validate_sha256(sha256: str, *, what: str = "sha256") -> str:
    """Return `sha256` if it is 64 lowercase hex digits, else raise BadInput."""
    if not isinstance(sha256, str) or not _SHA256.match(sha256):
        raise BadInput(f"{what} {sha256!r} is not a sha256 hex digest (64 lowercase hex digits)")
    return sha256


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()

