"""The part transfer logic of S3Store (kiln.store.s3_parts) without a server: order, concurrency, failures."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from kiln.core.trust.key_rules import CHUNK_BYTES
from kiln.store.s3_parts import byte_ranges, fetch_in_order, upload_in_parts, write_at

PART = 1000


class InFlight:
    """Counts calls running at once; `peak` is the most seen together."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.now -= 1


def test_byte_ranges_cover_the_object_in_parts():
    assert byte_ranges(0, 0, PART) == []
    assert byte_ranges(0, 1, PART) == [(0, 0)]
    assert byte_ranges(0, 2 * PART, PART) == [(0, 999), (1000, 1999)]
    assert byte_ranges(0, 2 * PART + 1, PART) == [(0, 999), (1000, 1999), (2000, 2000)]
    assert byte_ranges(500, 1700, PART) == [(500, 1499), (1500, 1699)]


def test_upload_sends_parts_concurrently_and_hashes_the_file_in_order(tmp_path):
    data = os.urandom(5 * PART + 17)
    path = tmp_path / "f"
    path.write_bytes(data)
    three_at_once = threading.Barrier(3, timeout=10)  # broken (an error) unless 3 parts are in flight together
    received = {}

    def send_part(number: int, part: bytes) -> dict:
        if number <= 3:
            three_at_once.wait()
        received[number] = part
        return {"ETag": f"etag-{number}", "PartNumber": number}

    parts, sha256 = upload_in_parts(path, PART, 4, send_part)
    assert sha256 == hashlib.sha256(data).hexdigest()
    assert parts == [{"ETag": f"etag-{n}", "PartNumber": n} for n in range(1, 7)]
    assert b"".join(received[n] for n in range(1, 7)) == data


def test_upload_keeps_at_most_max_concurrency_parts_in_flight(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(12 * PART))
    in_flight = InFlight()

    def send_part(number: int, part: bytes) -> dict:
        with in_flight:
            time.sleep(0.02)
        return {"ETag": "e", "PartNumber": number}

    parts, _ = upload_in_parts(path, PART, 3, send_part)
    assert len(parts) == 12
    assert in_flight.peak == 3


def test_a_failed_part_stops_the_upload_after_the_parts_in_flight_finish(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(20 * PART))
    in_flight, started = InFlight(), []

    def send_part(number: int, part: bytes) -> dict:
        started.append(number)
        with in_flight:
            if number == 3:
                raise ConnectionError("part 3 failed")
            time.sleep(0.05)
        return {"ETag": "e", "PartNumber": number}

    with pytest.raises(ConnectionError, match="part 3"):
        upload_in_parts(path, PART, 4, send_part)
    assert in_flight.now == 0  # nothing still sending when the caller goes on to abort
    assert max(started) < 3 + 4 + 1  # no new part after the failure was seen (the window is 4)


def test_fetch_yields_in_order_while_fetching_concurrently():
    ranges = byte_ranges(0, 6 * PART, PART)
    three_at_once = threading.Barrier(3, timeout=10)

    def fetch(first: int, last: int) -> bytes:
        if first < 3 * PART:
            three_at_once.wait()
            time.sleep(0.03 * (3 - first // PART))  # the first range finishes last
        return f"{first}-{last};".encode()

    got = b"".join(fetch_in_order(fetch, ranges, 4))
    assert got == b"".join(f"{a}-{b};".encode() for a, b in ranges)


def test_fetch_keeps_at_most_max_concurrency_ranges_in_flight():
    in_flight = InFlight()

    def fetch(first: int, last: int) -> bytes:
        with in_flight:
            time.sleep(0.02)
        return b"x"

    assert len(list(fetch_in_order(fetch, byte_ranges(0, 10 * PART, PART), 3))) == 10
    assert in_flight.peak == 3


def test_fetch_of_one_range_stays_in_the_calling_thread():
    threads = []

    def fetch(first: int, last: int) -> bytes:
        threads.append(threading.current_thread())
        return b"x"

    assert list(fetch_in_order(fetch, [(0, 9)], 4)) == [b"x"]
    assert threads == [threading.current_thread()]


def test_fetch_raises_a_failed_range_and_closing_early_waits_for_the_rest():
    in_flight = InFlight()

    def fetch(first: int, last: int) -> bytes:
        with in_flight:
            if first == PART:
                raise TimeoutError("range 2 failed")
            time.sleep(0.05)
        return b"x"

    parts = fetch_in_order(fetch, byte_ranges(0, 8 * PART, PART), 4)
    assert next(parts) == b"x"
    with pytest.raises(TimeoutError, match="range 2"):
        next(parts)
    assert in_flight.now == 0

    parts = fetch_in_order(fetch, byte_ranges(2 * PART, 10 * PART, PART), 4)
    assert next(parts) == b"x"
    parts.close()
    assert in_flight.now == 0


def test_write_at_fills_ranges_in_any_order(tmp_path):
    path = tmp_path / "f"
    big = os.urandom(3 * CHUNK_BYTES + 5)  # written in pieces
    with open(path, "wb") as out:
        write_at(out.fileno(), big, 10)
        write_at(out.fileno(), b"0123456789", 0)
    assert path.read_bytes() == b"0123456789" + big
