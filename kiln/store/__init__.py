"""Content-addressed, create-once object storage: a local directory or S3.

Purpose: compiled artifacts, tuning results and manifests travel between hosts
through a `Store`. `open_store(url)` picks the implementation from the URL.

Contracts (details in base.py): objects are written once and carry their
sha256; racing writers of one key get exactly one True; reads verify the
sha256 on the client; the manifest is written last with put_json(overwrite=True).

Anti-patterns: reading objects other than through get_* (nothing is
verified); create-once puts for mutable state (use put_json(overwrite=True));
keys built by string concatenation without validate_key.

Pitfalls: `open_store` does no I/O; call `store.check()` before any work so a
wrong bucket, endpoint or directory fails fast with BadInput. The S3Store
imports boto3 only when an s3:// URL is opened.
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln.core.errors import BadInput
from kiln.core.trust.key_rules import (
    check_no_collisions,
    normalized_key,
    sha256_bytes,
    validate_bucket,
    validate_key,
    validate_prefix,
)
from kiln.store.base import ObjectInfo, ObjectMissing, Store, sha256_file
from kiln.store.local import LocalStore

__all__ = [
    "LocalStore",
    "ObjectInfo",
    "ObjectMissing",
    "Store",
    "check_no_collisions",
    "normalized_key",
    "open_store",
    "sha256_bytes",
    "sha256_file",
    "validate_key",
    "validate_prefix",
]


def open_store(url: str, *, s3_endpoint: str | None = None, checksum_mode: str = "when_required",
               credentials: dict | None = None) -> Store:
    """Open the store that `url` names, without touching it (see `Store.check`).

    - 'file://DIR' or a plain path: a LocalStore in DIR ('file:///abs' or
      'file://rel/dir'; relative paths resolve against the working directory).
    - 's3://BUCKET/PREFIX': an S3Store; the endpoint is `s3_endpoint`, else the
      environment's AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS itself.
      Credentials and region come from the standard AWS chain, never the URL.
    Anything else raises BadInput. `credentials` (access_key, secret_key,
    session_token, region) replace the AWS chain, e.g. from a Prefect block.
    """
    if not isinstance(url, str) or url.strip() == "":
        raise BadInput("store URL is empty; use file://DIR or s3://BUCKET/PREFIX")
    if "://" not in url:
        return LocalStore(Path(url))
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        if rest == "":
            raise BadInput(f"store URL {url!r} names no directory; use file:///ABSOLUTE/DIR")
        return LocalStore(Path(rest[len("localhost") :] if rest.startswith("localhost/") else rest))
    if scheme == "s3":
        return _open_s3(url, rest, s3_endpoint=s3_endpoint, checksum_mode=checksum_mode,
                        credentials=credentials or {})
    raise BadInput(f"unknown store scheme {scheme!r} in URL; use file://DIR or s3://BUCKET/PREFIX")


def _open_s3(url: str, rest: str, *, s3_endpoint: str | None, checksum_mode: str, credentials: dict) -> Store:
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        raise BadInput(
            f"store URL {url.split('://')[0]}://... carries credentials or a port; "
            "pass credentials through the AWS environment or profile and the endpoint with --s3-endpoint"
        )
    if "?" in rest or "#" in rest:
        raise BadInput(f"store URL {url!r} has a query or fragment; use s3://BUCKET/PREFIX")
    validate_bucket(bucket)
    validate_prefix(prefix)
    endpoint = s3_endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise BadInput(f"S3 endpoint {endpoint!r} must start with http:// or https://")
    from kiln.store.s3 import S3Store  # boto3 is imported only for S3 stores

    return S3Store(bucket, prefix, endpoint_url=endpoint, checksum_mode=checksum_mode, **credentials)
