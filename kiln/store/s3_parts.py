"""Concurrent part transfers for S3Store: parts sent, and byte ranges fetched, by a thread pool.

Both directions keep the order where it matters and the concurrency where it
pays. The sha256 of a file is computed over its bytes in order by one hashing
thread, while up to `max_concurrency` parts are on the wire; hashlib releases
the GIL on large buffers, so hashing overlaps the transfers. At most
`max_concurrency` parts are in flight, and one more may wait in memory: a
transfer holds about (max_concurrency + 1) x part size bytes.

Why not boto3's managed transfer (s3transfer, behind upload_file and
download_file), which would move the parts just as concurrently: it cannot
keep the store's guarantees. Its uploads take no IfNoneMatch (not among
ALLOWED_UPLOAD_ARGS), abort the upload themselves when the completion fails
(so a 409 cannot be retried, nor a lost answer recognised), and read the file
on their own, so the sha256 would need a second read that need not see the
bytes that were sent. Its downloads send their own HEAD, so the recorded
sha256 could belong to another version than the bytes, hash nothing while
they transfer, and skip fsync.

Nothing here imports boto3: the callers pass the request as a function, so
the logic is unit-tested without a server (tests/store/test_s3_parts.py).
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from kiln.core.trust.key_rules import CHUNK_BYTES


def byte_ranges(start_byte: int, size_bytes: int, part_size_bytes: int) -> list[tuple[int, int]]:
    """Inclusive (first, last) byte ranges of at most `part_size_bytes` covering [start_byte, size_bytes)."""
    return [(first, min(first + part_size_bytes, size_bytes) - 1)
            for first in range(start_byte, size_bytes, part_size_bytes)]


def upload_in_parts(
    path: str | Path,
    part_size_bytes: int,
    max_concurrency: int,
    send_part: Callable[[int, bytes], dict],
) -> tuple[list[dict], str]:
    """Send `path` in parts of `part_size_bytes`, up to `max_concurrency` at once; return (parts, sha256).

    `send_part(part_number, data)` uploads one part (numbers from 1) and returns
    its entry for CompleteMultipartUpload ({"ETag", "PartNumber", checksums}).
    The file is read by the calling thread and hashed in that order, so the digest
    is of exactly the bytes sent. `parts` holds the entries in part order;
    `sha256` is the hex digest of every byte read. On any error no new part
    starts, the parts in flight are waited for, and the first error is
    raised: an abort that follows leaves no part behind.
    """
    digest = hashlib.sha256()
    parts: list[dict] = []
    in_flight: set[Future] = set()

    def settle(done: set[Future]) -> None:
        parts.extend(future.result() for future in done)

    pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="kiln-s3-put")
    # One thread hashes the parts in the order they were read, so reading and sending the next part never
    # waits for the hash of this one; at most max_concurrency parts wait for it.
    hasher = ThreadPoolExecutor(1, thread_name_prefix="kiln-s3-hash")
    hashing: deque[Future] = deque()
    try:
        with open(path, "rb") as f:
            number = 0
            while data := f.read(part_size_bytes):
                number += 1
                if len(in_flight) >= max_concurrency:
                    done, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                    settle(done)
                while len(hashing) >= max_concurrency:
                    hashing.popleft().result()
                in_flight.add(pool.submit(send_part, number, data))
                hashing.append(hasher.submit(digest.update, data))  # while the part is on its way
        settle(wait(in_flight).done)
        for hashed in hashing:
            hashed.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        hasher.shutdown(wait=True, cancel_futures=True)
    return sorted(parts, key=lambda part: part["PartNumber"]), digest.hexdigest()


def fetch_in_order(
    fetch: Callable[[int, int], bytes],
    ranges: Sequence[tuple[int, int]],
    max_concurrency: int,
) -> Iterator[bytes]:
    """Yield `fetch(first, last)` for each range, in order, with up to `max_concurrency` fetched ahead.

    A single range is fetched in the calling thread. Closing the iterator
    early cancels the fetches not started and waits for those in flight; a
    fetch's error is raised when its turn comes.
    """
    if len(ranges) <= 1:
        yield from (fetch(first, last) for first, last in ranges)
        return
    todo = iter(ranges)
    pending: deque[Future] = deque()
    with ThreadPoolExecutor(min(max_concurrency, len(ranges)), thread_name_prefix="kiln-s3-get") as pool:
        try:
            for first, last in todo:
                pending.append(pool.submit(fetch, first, last))
                if len(pending) >= max_concurrency:
                    break
            while pending:
                data = pending.popleft().result()
                if (nxt := next(todo, None)) is not None:  # keep the pool busy while the caller consumes
                    pending.append(pool.submit(fetch, *nxt))
                yield data
        finally:
            for future in pending:
                future.cancel()


def write_at(fd: int, data: bytes, offset: int) -> None:
    """Write all of `data` to the open file `fd` at byte `offset`, in pieces of at most CHUNK_BYTES.

    Other threads may write other ranges of the same file meanwhile.
    """
    # Pieces, because on the bench machine (Linux 6.18) one 8 MiB write into the page cache took
    # ~55 ms, twenty times as long as the same bytes written 1 MiB at a time.
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view[:CHUNK_BYTES], offset)
        view, offset = view[written:], offset + written
