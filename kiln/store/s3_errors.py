"""Classification of botocore errors for S3: lost create-once races, check() failures, checkpoint reads.

What a user must fix is BadInput: no credentials or refused ones, no such
bucket, the wrong region, an endpoint nothing can connect to or that is not S3,
a malformed URL. A blip that outlasted botocore's per-request retries (a read
timeout, a connection closed mid-answer, throttling, a 5xx answer) is
StoreError(transient=True): nothing to fix, it may heal later, and no task or
flow retries it again (kiln.core.run.retry_rule: one level per failure). Messages
name the endpoint and bucket and never credentials: botocore's own error
strings are not echoed for credential failures.
"""

from __future__ import annotations

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
)

from kiln.core.errors import BadInput, StoreError
from kiln.core.run.retry_rule import transient

MISSING_KEY = ("404", "NoSuchKey", "NotFound")
_NO_BUCKET = ("404", "NoSuchBucket", "NotFound")
_BAD_CREDENTIALS = (
    "403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "InvalidClientTokenId", "InvalidToken", "ExpiredToken", "UnrecognizedClientException",
)  # fmt: skip
_WRONG_REGION = ("301", "PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException")
_CANNOT_CONNECT = (EndpointConnectionError, ConnectTimeoutError)
"""Nothing accepted a connection at the endpoint (after botocore's retries): most likely the wrong endpoint."""


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


def blip(e: BaseException) -> bool:
    """Whether `e`, from a botocore call that spent its retries, is a blip rather than something to fix: a
    transient error (kiln.core.run.retry_rule.transient) other than an endpoint nothing can connect to."""
    return transient(e) and not isinstance(e, _CANNOT_CONNECT)


def explain_check_error(e: Exception, bucket: str, endpoint: str) -> BadInput | StoreError | None:
    """What `S3Store.check` raises for `e` from head_bucket: BadInput for what the user must fix,
    StoreError(transient=True) for a blip (see the module docstring); None if `e` is not botocore's."""
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return BadInput(
            f"no complete AWS credentials for bucket {bucket!r} at {endpoint}; "
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
        )
    if isinstance(e, _CANNOT_CONNECT):
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
        if blip(e):
            return StoreError(f"S3 endpoint {endpoint} answered {code or 'an error'} for bucket {bucket!r} on "
                              "every try (busy or failing); nothing to fix here: try again later", transient=True)
        return BadInput(f"S3 endpoint {endpoint} answered {code or 'an error'} for bucket {bucket!r}")
    if blip(e):  # reached, then a read timeout or a closed connection on every try
        return StoreError(f"S3 endpoint {endpoint} (bucket {bucket!r}) failed mid-request on every try ({e}); "
                          "nothing to fix here: try again later", transient=True)
    if isinstance(e, (BotoCoreError, ValueError)):  # e.g. a malformed endpoint URL
        return BadInput(f"cannot use S3 endpoint {endpoint} (bucket {bucket!r}): {e}")
    return None
