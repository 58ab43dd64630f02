"""Multipart uploads that writers which died left unfinished: found under a store's prefix and aborted.

A writer killed mid-upload, or one whose CreateMultipartUpload answer was lost (botocore's retry creates
another), leaves an upload S3 keeps, and bills, until it is aborted. None of Kiln's uploads of one object
takes a day (kiln.store.base.STALE_UPLOAD_S), so one begun longer ago is stale: `abort_stale` aborts it,
counting its parts' bytes. Its age is by the server's `Initiated` (moto dates every upload 2010-11-10, so
every upload is stale there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from botocore.exceptions import ClientError

from kiln.core.run.tidy import Removed
from kiln.store.s3_errors import error_code


def abort_stale(client: Any, bucket: str, prefix: str, older_than_s: float,
                errors: Callable[[str, str], AbstractContextManager]) -> Removed:
    """Abort every multipart upload in `bucket` under `prefix` begun more than `older_than_s` ago; returns
    what was removed (uploads, their parts' bytes). `errors(action, key)` turns botocore's errors into the
    store's (S3Store._errors). One completed or aborted meanwhile is skipped."""
    cutoff = time.time() - older_than_s
    stale = []
    with errors("list of multipart uploads", prefix):
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
            stale += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])
                      if u.get("Initiated") is not None and u["Initiated"].timestamp() <= cutoff]
    removed = Removed()
    for key, upload_id in stale:
        with errors("abort of a multipart upload", key[len(prefix):]):
            try:
                size = sum(part.get("Size", 0) for page in client.get_paginator("list_parts").paginate(
                    Bucket=bucket, Key=key, UploadId=upload_id) for part in page.get("Parts", []))
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except ClientError as e:
                if error_code(e) == "NoSuchUpload":
                    continue
                raise
        removed += Removed(1, size)
    return removed
