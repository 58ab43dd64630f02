"""`S3Store`: the store in an S3 (or S3-compatible) bucket, through botocore.

Object `key` lives at `<prefix><key>` in the bucket; its sha256 is the object
metadata 'sha256' (header x-amz-meta-sha256), written in the same request as
the bytes, so data and digest appear together.

Create-once uses conditional writes (`If-None-Match: *`): on put_object for
objects below `multipart_threshold_bytes`, and on complete_multipart_upload for
larger ones, so of several racing writers exactly one creates the object and
the others get 412 PreconditionFailed (or 409 ConditionalRequestConflict while
the winner is still in flight) and then compare digests. AWS S3, moto and
SeaweedFS enforce the condition on both calls (moto checks it without a lock, so two
completions it serves at the same moment can both succeed); an S3-compatible
server that ignores it degrades create-once to last-writer-wins for racing
writers of the same key (the sha256 comparison of an existing object still
happens before a large upload starts). If a conditional write succeeds but its response is lost and
botocore retries it, the retry sees the object and the call returns False
although it created the object: "True" counts creations, not guarantees one.

Large files move in parts of `part_size_bytes`, up to `max_concurrency` at
once, in both directions, by Kiln's own thread pool (s3_parts.py), not by
boto3's managed transfer (s3transfer), which cannot send If-None-Match on the
completion nor hash the bytes it sends (s3_parts.py says more). An upload
hashes the parts in order while they are sent, completes only if the digest
matches, and is aborted on any failure or lost race once the parts in flight
have finished (the look for an existing object, a HEAD, goes out with the
upload's creation). get_file reads the recorded sha256, size and ETag from
the answer to its first range's GET (no HEAD), fetches every other range
concurrently with If-Match on that ETag (so bytes and digest belong to the
same version), and writes each range at its offset
in the thread that fetched it while the ranges are hashed in order; the file
is verified and fsynced before it replaces the destination.

Downloads are verified by hashing on the client, in order, before the file
replaces anything: servers may accept a wrong transport checksum (moto does;
SeaweedFS refuses it with BadDigest), and the digest is what guards loading
native code. A partial body is never kept (a short read is an error, not a
smaller object). A multipart completion whose answer was lost is recognised
by the object it created.

Retries are per request and only in kiln.store.s3_client (kiln.core.run.retry_rule):
botocore's, `max_attempts` tries of each request, and `read_attempts` GETs of
a body that breaks off. A StoreError raised after that has spent the budget:
`transient` says whether it may heal later, and no task or flow retries it
again. `check` tries twice with short timeouts, so a wrong endpoint fails in
seconds, except that an answer meaning "later" (5xx, throttling) gets the full
budget.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from urllib3.exceptions import HTTPError as Urllib3Error

from kiln.core.errors import BadInput, IntegrityError, StoreError
from kiln.core.plan.job import CHECKSUM_MODES
from kiln.core.trust.key_rules import sha256_bytes, validate_bucket, validate_key, validate_prefix, validate_sha256
from kiln.core.run.retry_rule import transient
from kiln.core.run.tidy import Removed
from kiln.store.base import (STALE_UPLOAD_S, ObjectInfo, ObjectMissing, Store, check_digest, conflict,
                             replaced_on_success)
from kiln.store.s3_client import (
    BODY_ERRORS,
    QUICK_CHECK,
    READ_ATTEMPTS,
    REQUEST_RETRIES,
    check_bucket,
    client_config,
    make_client,
    read_body,
)
from kiln.store.s3_errors import MISSING_KEY, error_code, lost_race
from kiln.store.s3_parts import byte_ranges, fetch_in_order, upload_in_parts, write_at
from kiln.store.s3_stale import abort_stale

MIB = 1024 * 1024
_MIN_PART_BYTES = 5 * MIB  # S3's minimum size of every part but the last
_CONFLICT_ATTEMPTS = 8  # 409s and create/delete races: back off and try again


class S3Store(Store):
    """Create-once object store under `s3://bucket/prefix`.

    Credentials come from the arguments, else from the standard AWS chain
    (environment, profile, instance role). `checksum_mode` sets botocore's
    request_checksum_calculation and response_checksum_validation
    ('when_required' suits S3-compatible servers; 'when_supported' adds CRC32
    checksums to transfers and declares them on multipart uploads, as boto3's
    upload_file does). `max_attempts` is botocore's retry budget per
    request; `read_attempts` bounds the GETs of one range whose body breaks
    off. Files of `multipart_threshold_bytes` or more are uploaded in parts of
    `part_size_bytes` (at least 5 MiB), and get_file fetches ranges of that
    size; up to `max_concurrency` parts move at once (boto3's default is 10),
    so one transfer holds about (max_concurrency + 1) x part_size_bytes in
    memory.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        checksum_mode: str = CHECKSUM_MODES[0],
        max_attempts: int = REQUEST_RETRIES["max_attempts"],
        read_attempts: int = READ_ATTEMPTS,
        multipart_threshold_bytes: int = 8 * MIB,
        part_size_bytes: int = 8 * MIB,
        max_concurrency: int = 10,
    ) -> None:
        self.bucket = validate_bucket(bucket)
        validate_prefix(prefix)
        self.prefix = prefix if prefix == "" or prefix.endswith("/") else prefix + "/"
        if checksum_mode not in CHECKSUM_MODES:
            raise BadInput(f"S3 checksum mode {checksum_mode!r} is unknown; use one of {', '.join(CHECKSUM_MODES)}")
        if part_size_bytes < _MIN_PART_BYTES:
            raise BadInput(f"S3 part size {part_size_bytes} bytes is below S3's minimum of {_MIN_PART_BYTES}")
        if max_attempts < 1 or read_attempts < 1:
            raise BadInput(f"S3 max_attempts and read_attempts must be at least 1, not {max_attempts}, {read_attempts}")
        if max_concurrency < 1:
            raise BadInput(f"S3 max_concurrency must be at least 1, not {max_concurrency}")
        self.read_attempts = read_attempts
        self.max_concurrency = max_concurrency
        self.checksum_mode = checksum_mode
        self.endpoint_url = endpoint_url
        self.region = region
        self._credentials = {
            "aws_access_key_id": access_key,
            "aws_secret_access_key": secret_key,
            "aws_session_token": session_token,
        }
        self.multipart_threshold_bytes = multipart_threshold_bytes
        self.part_size_bytes = part_size_bytes
        self._config = client_config(max_concurrency=max_concurrency, max_attempts=max_attempts,
                                     checksum_mode=checksum_mode)
        self._client_cache: Any = None

    # Clients hold sockets and do not pickle; a store sent to another process builds its own.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client_cache": None}

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix.rstrip('/')}".rstrip("/")

    def _make_client(self, config: Config) -> Any:
        return make_client(config, region=self.region, endpoint_url=self.endpoint_url, **self._credentials)

    @property
    def _client(self) -> Any:
        if self._client_cache is None:
            self._client_cache = self._make_client(self._config)
        return self._client_cache

    def check(self) -> None:
        check_bucket(self.bucket, self.endpoint_url, quick=lambda: self._make_client(self._config.merge(QUICK_CHECK)),
                     patient=lambda: self._client)

    # -- helpers -------------------------------------------------------------

    def link(self, key: str, expires_s: int = 12 * 3600) -> tuple[str, str | None]:
        """s3://BUCKET/KEY and a presigned GET URL valid `expires_s` (signed locally, no request)."""
        full = self._full(key)
        url = self._client.generate_presigned_url("get_object", Params={"Bucket": self.bucket, "Key": full},
                                                  ExpiresIn=int(expires_s))
        return f"s3://{self.bucket}/{full}", url

    def _full(self, key: str) -> str:
        return self.prefix + validate_key(key)

    @contextmanager
    def _errors(self, action: str, key: str) -> Iterator[None]:
        """Turn botocore errors into ObjectMissing (404 on a key) or StoreError (after botocore's retries)."""
        try:
            yield
        except ClientError as e:
            if error_code(e) in MISSING_KEY:
                raise ObjectMissing(key) from None
            raise StoreError(f"S3 {action} of {key!r} in {self.url} failed: {e}", transient=transient(e)) from e
        except (BotoCoreError, Urllib3Error) as e:  # urllib3's: a body that broke off on its last re-read
            raise StoreError(f"S3 {action} of {key!r} in {self.url} failed: {e}", transient=transient(e)) from e

    def _create_once(self, key: str, sha256: str, write: Callable[[], Any]) -> bool:
        """Run the conditional `write`; True if it created `key`, else compare with what is there."""
        for attempt in range(_CONFLICT_ATTEMPTS):
            try:
                write()
                return True
            except ClientError as e:
                race = lost_race(e)
                if race is None:
                    raise
            if race == "exists":
                info = self.stat(key)
                if info is not None:
                    if info.sha256 != sha256:
                        raise conflict(key, info.sha256, sha256)
                    return False
            # In flight elsewhere, or deleted since the 412: wait and try again.
            time.sleep(min(0.05 * 2**attempt, 2.0))
        raise StoreError(f"S3 put of {key!r} in {self.url} kept conflicting with other writers; retry",
                         transient=True)

    def _put_small(self, key: str, data: bytes, sha256: str) -> bool:
        def write() -> None:
            self._client.put_object(
                Bucket=self.bucket, Key=self._full(key), Body=data, Metadata={"sha256": sha256}, IfNoneMatch="*"
            )

        with self._errors("put", key):
            return self._create_once(key, sha256, write)

    def _put_multipart(self, key: str, path: str | Path, sha256: str) -> bool:
        client, full = self._client, self._full(key)
        # With checksums on, parts carry CRC32s the upload must declare (as boto3's upload_file does); S3
        # refuses checksummed parts of an upload created without one, and then wants them in the completion.
        crc32 = {"ChecksumAlgorithm": "CRC32"} if self.checksum_mode == "when_supported" else {}
        with self._errors("multipart upload", key):
            # Compare with an existing object before uploading many MiB for nothing. The HEAD goes out before
            # the upload is created, not beside it: an upload created for an object that exists would have to
            # be aborted, and one whose creation's answer was lost (botocore creates another on its retry)
            # could not be, and stays billed (tests/faults/test_s3_proxy.py). The completion's If-None-Match,
            # not this look, is what keeps the object created once.
            if (info := self.stat(key)) is not None:
                if info.sha256 != sha256:
                    raise conflict(key, info.sha256, sha256)
                return False
            upload_id = client.create_multipart_upload(
                Bucket=self.bucket, Key=full, Metadata={"sha256": sha256}, **crc32
            )["UploadId"]

            def send_part(number: int, data: bytes) -> dict:
                resp = client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                                          Body=data, **crc32)
                return {"ETag": resp["ETag"], "PartNumber": number,
                        **{name: resp[name] for name in ("ChecksumCRC32",) if crc32 and name in resp}}

            completed = False
            try:
                parts, actual = upload_in_parts(path, self.part_size_bytes, self.max_concurrency, send_part)
                if actual != sha256:
                    raise _file_mismatch(path, actual, sha256, key)

                def complete() -> None:
                    try:
                        client.complete_multipart_upload(
                            Bucket=self.bucket,
                            Key=full,
                            UploadId=upload_id,
                            MultipartUpload={"Parts": parts},
                            IfNoneMatch="*",
                        )
                    except ClientError as e:
                        # A retry after a lost answer finds the upload gone: did it create our object?
                        if error_code(e) == "NoSuchUpload" and (info := self.stat(key)) and info.sha256 == sha256:
                            return
                        raise

                completed = self._create_once(key, sha256, complete)
                return completed
            finally:
                if not completed:  # lost the race or failed: do not leave billed parts behind
                    try:
                        client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
                    except (ClientError, BotoCoreError):
                        pass

    # -- Store ---------------------------------------------------------------

    def put_file(self, key: str, path: str | Path, sha256: str) -> bool:
        validate_sha256(sha256)
        validate_key(key)
        if Path(path).stat().st_size >= self.multipart_threshold_bytes:
            return self._put_multipart(key, path, sha256)
        data = Path(path).read_bytes()
        if (actual := sha256_bytes(data)) != sha256:
            raise _file_mismatch(path, actual, sha256, key)
        return self._put_small(key, data, sha256)

    def put_bytes(self, key: str, data: bytes) -> bool:
        validate_key(key)
        return self._put_small(key, data, sha256_bytes(data))

    def _replace_bytes(self, key: str, data: bytes) -> None:
        with self._errors("put", key):
            self._client.put_object(
                Bucket=self.bucket, Key=self._full(key), Body=data, Metadata={"sha256": sha256_bytes(data)}
            )

    def _read_retrying(self, key: str, **get_args: str) -> tuple[dict, bytes]:
        """GET `key` with `get_args` and read the whole body; GET again when the body breaks off (bounded)."""
        with self._errors("get", key):
            return read_body(lambda: self._client.get_object(Bucket=self.bucket, Key=self._full(key), **get_args),
                             lambda body: body.read(), self.read_attempts)

    def _first_range(self, key: str) -> tuple[dict, int]:
        """GET `key`'s first range, headers only (its body not read yet): (response, the object's size).

        The response stands for a HEAD (size, ETag, recorded sha256) and its body is the first range. An empty
        object has no first range (416): it is fetched whole; so is one from a server that ignores Range.
        """
        with self._errors("get", key):
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key),
                                               Range=f"bytes=0-{self.part_size_bytes - 1}")
            except ClientError as e:
                if error_code(e) != "InvalidRange":
                    raise
                resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key))
        content_range = resp.get("ContentRange")  # 'bytes 0-LAST/SIZE'; none when the whole object came
        return resp, int(content_range.rsplit("/", 1)[1]) if content_range else resp["ContentLength"]

    def get_file(self, key: str, dest_path: str | Path, sha256: str | None = None) -> None:
        if sha256 is not None:
            validate_sha256(sha256)
        first, size = self._first_range(key)
        expected = sha256 or first.get("Metadata", {}).get("sha256")
        ranges = byte_ranges(0, size, self.part_size_bytes if first.get("ContentRange") else max(size, 1))
        digest = hashlib.sha256()
        opened = [first]
        with replaced_on_success(dest_path) as out, closing(first["Body"]):

            def fetch(first_byte: int, last_byte: int) -> bytes:
                data = None
                if first_byte == 0 and opened:  # the first range's body, already on its way
                    try:
                        data = opened.pop()["Body"].read()
                    except BODY_ERRORS:
                        pass  # requested again below
                if data is None:
                    # If-Match: every range comes from the version whose sha256 the first answer gave (412 if
                    # it was replaced since).
                    data = self._read_retrying(key, Range=f"bytes={first_byte}-{last_byte}",
                                               IfMatch=first["ETag"])[1]
                if len(data) != last_byte - first_byte + 1:
                    raise StoreError(f"S3 get of {key!r} in {self.url} answered bytes {first_byte}-{last_byte} "
                                     f"with {len(data)} bytes; the server does not honour Range requests")
                write_at(out.fileno(), data, first_byte)  # here, so writing overlaps the hashing below
                return data

            with closing(fetch_in_order(fetch, ranges, self.max_concurrency)) as parts:
                for data in parts:  # in order: the digest is of the whole object
                    digest.update(data)
            check_digest(key, digest.hexdigest(), expected)

    def get_bytes(self, key: str, sha256: str | None = None) -> bytes:
        if sha256 is not None:
            validate_sha256(sha256)
        resp, data = self._read_retrying(key)
        check_digest(key, sha256_bytes(data), sha256 or resp.get("Metadata", {}).get("sha256"))
        return data

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            with self._errors("head", key):
                resp = self._client.head_object(Bucket=self.bucket, Key=self._full(key))
        except ObjectMissing:
            return None
        return ObjectInfo(key=key, size_bytes=resp["ContentLength"], sha256=resp.get("Metadata", {}).get("sha256"))

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        keys = []
        with self._errors("list", prefix):
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                keys.extend(obj["Key"][len(self.prefix) :] for obj in page.get("Contents", []))
        return sorted(keys)

    def abort_stale_uploads(self, older_than_s: float = STALE_UPLOAD_S) -> Removed:  # see kiln.store.s3_stale
        return abort_stale(self._client, self.bucket, self.prefix, older_than_s, self._errors)

    def delete(self, key: str) -> None:
        try:
            with self._errors("delete", key):
                self._client.delete_object(Bucket=self.bucket, Key=self._full(key))
        except ObjectMissing:
            pass  # AWS answers 204 for a missing key; some S3 clones answer 404


def _file_mismatch(path: str | Path, actual: str, expected: str, key: str) -> IntegrityError:
    return IntegrityError(
        f"file {path} has sha256 {actual}, not the {expected} given for store key {key!r}; "
        "nothing was stored (was the file changed while it was uploaded?)"
    )
