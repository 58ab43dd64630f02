"""Classification of botocore errors for S3Store: lost create-once races and check() failures.

Messages name the endpoint and bucket and never credentials: botocore's own
error strings are not echoed for credential failures.
"""

from __future__ import annotations

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from kiln.core.errors import BadInput

MISSING_KEY = ("404", "NoSuchKey", "NotFound")
_NO_BUCKET = ("404", "NoSuchBucket", "NotFound")
_BAD_CREDENTIALS = (
    "403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "InvalidClientTokenId", "InvalidToken", "ExpiredToken", "UnrecognizedClientException",
)  # fmt: skip
_WRONG_REGION = ("301", "PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException")
_UNREACHABLE = (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError)


def error_code(e: ClientError) -> str:
    """The S3 error code ('NoSuchKey', 'PreconditionFailed', or the HTTP status for HEAD requests)."""
    return str(e.response.get("Error", {}).get("Code", ""))


def lost_race(e: ClientError) -> str | None:
    """'exists' for 412 (another writer created the key), 'in_flight' for 409, else None."""
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if error_code(e) == "PreconditionFailed" or status == 412:
        return "exists"
    if error_code(e) == "ConditionalRequestConflict" or status == 409:
        return "in_flight"
    return None


def explain_check_error(e: Exception, bucket: str, endpoint: str) -> BadInput | None:
    """The BadInput that `S3Store.check` raises for `e` from head_bucket, or None if `e` is not botocore's."""
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return BadInput(
            f"no complete AWS credentials for bucket {bucket!r} at {endpoint}; "
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
        )
    if isinstance(e, _UNREACHABLE):
        return BadInput(
            f"cannot reach S3 endpoint {endpoint} (bucket {bucket!r}); "
            "check --s3-endpoint / AWS_ENDPOINT_URL and that the server is up"
        )
    if isinstance(e, ClientError):
        code = error_code(e)
        headers = e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        if code in _NO_BUCKET and not any(name.lower().startswith("x-amz") for name in headers):
            # Any web server answers 404; S3 and its clones tag answers with x-amz(n)-* headers.
            return BadInput(
                f"endpoint {endpoint} answered 404 for bucket {bucket!r} without S3 headers, so it is "
                "probably not an S3 endpoint; fix --s3-endpoint / AWS_ENDPOINT_URL"
            )
        if code in _NO_BUCKET:
            return BadInput(f"bucket {bucket!r} does not exist at endpoint {endpoint}; create it or fix --store")
        if code in _BAD_CREDENTIALS:
            return BadInput(
                f"S3 endpoint {endpoint} refused the credentials for bucket {bucket!r} ({code}); "
                "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE and the bucket policy"
            )
        if code in _WRONG_REGION:
            region = headers.get("x-amz-bucket-region") or "another region"
            return BadInput(f"bucket {bucket!r} at {endpoint} is in region {region}; set AWS_REGION to it")
        return BadInput(f"S3 endpoint {endpoint} answered {code or 'an error'} for bucket {bucket!r}")
    if isinstance(e, (BotoCoreError, ValueError)):  # e.g. a malformed endpoint URL
        return BadInput(f"cannot use S3 endpoint {endpoint} (bucket {bucket!r}): {e}")
    return None
