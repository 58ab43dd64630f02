"""S3Store behaviour beyond the shared contract, against moto_server."""

from __future__ import annotations

import os
import pickle
import threading
import time

import boto3
import pytest
from botocore.exceptions import IncompleteReadError

from kiln.core.errors import BadInput, IntegrityError, StoreError
from kiln.store import open_store, sha256_bytes
from kiln.store.s3 import S3Store

MIB = 1024 * 1024


@pytest.fixture
def store(s3_bucket: str) -> S3Store:
    opened = open_store(s3_bucket)
    assert isinstance(opened, S3Store)
    return opened


def raw_client(store: S3Store):
    return boto3.client("s3", endpoint_url=store.endpoint_url)


def test_keys_live_under_the_prefix_with_sha_metadata(store):
    store.put_bytes("forwards/a.pt2", b"abc")
    head = raw_client(store).head_object(Bucket=store.bucket, Key="exports/run1/forwards/a.pt2")
    assert head["Metadata"] == {"sha256": sha256_bytes(b"abc")}
    assert store.url == f"s3://{store.bucket}/exports/run1"


def test_prefix_is_a_directory_not_a_string_prefix(store):
    sibling = open_store(f"s3://{store.bucket}/exports/run10")
    sibling.put_bytes("k", b"sibling")
    store.put_bytes("k", b"mine")
    assert store.list() == ["k"]
    assert store.get_bytes("k") == b"mine"


def test_large_files_use_multipart(store, tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(20 * MIB))
    store.put_file("big", path, sha256_bytes(path.read_bytes()))
    etag = raw_client(store).head_object(Bucket=store.bucket, Key=store.prefix + "big")["ETag"]
    assert etag.strip('"').endswith("-3")  # 8 + 8 + 4 MiB parts


class _SkipsPrecheck(S3Store):
    """Hides an existing object from the first stat, as if another writer finished mid-upload."""

    hidden_once = True

    def stat(self, key):
        if self.hidden_once:
            self.hidden_once = False
            return None
        return super().stat(key)


@pytest.mark.parametrize("same_content", [True, False])
def test_conditional_complete_multipart_detects_the_winner(store, tmp_path, same_content):
    winner = os.urandom(9 * MIB)
    store.put_bytes("big", winner)
    loser = winner if same_content else os.urandom(9 * MIB)
    path = tmp_path / "loser.bin"
    path.write_bytes(loser)
    racer = _SkipsPrecheck(store.bucket, store.prefix, endpoint_url=store.endpoint_url)
    if same_content:
        assert racer.put_file("big", path, sha256_bytes(loser)) is False
    else:
        with pytest.raises(IntegrityError, match="'big'"):
            racer.put_file("big", path, sha256_bytes(loser))
    assert store.get_bytes("big") == winner
    uploads = raw_client(store).list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
    assert uploads == []  # the losing upload was aborted


def test_object_without_recorded_sha_is_not_trusted(store):
    raw_client(store).put_object(Bucket=store.bucket, Key=store.prefix + "foreign", Body=b"data")
    assert store.stat("foreign").sha256 is None
    with pytest.raises(IntegrityError, match="no recorded sha256"):
        store.get_bytes("foreign")
    assert store.get_bytes("foreign", sha256=sha256_bytes(b"data")) == b"data"


def test_checksum_mode_when_supported_round_trip(s3_bucket):
    store = open_store(s3_bucket, checksum_mode="when_supported")
    assert store.put_bytes("k", b"x" * 1000) is True
    assert store.get_bytes("k") == b"x" * 1000


def test_bad_settings_are_rejected():
    with pytest.raises(BadInput, match="checksum mode"):
        S3Store("bucket", checksum_mode="always")
    with pytest.raises(BadInput, match="part size"):
        S3Store("bucket", part_size_bytes=MIB)
    with pytest.raises(BadInput, match="max_concurrency"):
        S3Store("bucket", max_concurrency=0)


def test_store_pickles_without_its_client_and_hides_secrets(store):
    secretive = S3Store("bucket", "p", access_key="AKIDEXAMPLE", secret_key="very-secret-value")
    assert "very-secret-value" not in repr(secretive) + secretive.url
    store.put_bytes("k", b"v")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.get_bytes("k") == b"v"


# -- concurrent parts ------------------------------------------------------------
# Requests are observed and faults injected through botocore's before-/after-call events on the
# store's own client; nothing in the store knows about it.


class Requests:
    """Records each S3 operation's start and end on one client; `peak[op]` is the most in flight at once."""

    def __init__(self, client, *, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.events: list[tuple[float, str, str]] = []
        self.peak: dict[str, int] = {}
        self._now: dict[str, int] = {}
        self._lock = threading.Lock()
        client.meta.events.register("before-call.s3.*", self._before)
        client.meta.events.register("after-call.s3.*", self._after)

    def _before(self, model, **_):
        with self._lock:
            self.events.append((time.monotonic(), "start", model.name))
            self._now[model.name] = self._now.get(model.name, 0) + 1
            self.peak[model.name] = max(self.peak.get(model.name, 0), self._now[model.name])
        time.sleep(self.delay_s)  # widens each request so that concurrent ones surely overlap

    def _after(self, model, **_):
        with self._lock:
            self.events.append((time.monotonic(), "end", model.name))
            self._now[model.name] -= 1

    def times(self, what: str, op: str) -> list[float]:
        return [t for t, w, o in self.events if (w, o) == (what, op)]


def small_parts(store: S3Store, **settings) -> S3Store:
    """The same store with 5 MiB parts (S3's minimum), so a few MiB make several parts."""
    return S3Store(store.bucket, store.prefix, endpoint_url=store.endpoint_url, part_size_bytes=5 * MIB,
                   multipart_threshold_bytes=5 * MIB, **settings)


def test_a_file_of_several_parts_moves_concurrently_both_ways(store, tmp_path):
    data = os.urandom(23 * MIB)  # 5 parts: 4 x 5 MiB + 3 MiB
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    sha = sha256_bytes(data)
    parts = small_parts(store, max_concurrency=4)
    seen = Requests(parts._client, delay_s=0.2)
    assert parts.put_file("forwards/big.pt2", path, sha) is True
    head = raw_client(store).head_object(Bucket=store.bucket, Key=store.prefix + "forwards/big.pt2")
    assert head["ETag"].strip('"').endswith("-5")
    assert head["Metadata"] == {"sha256": sha}
    assert seen.peak["UploadPart"] == 4  # max_concurrency parts at once, never more
    dest = tmp_path / "out" / "big.pt2"
    parts.get_file("forwards/big.pt2", dest, sha)
    assert dest.read_bytes() == data
    assert len(seen.times("start", "GetObject")) == 5 and seen.peak["GetObject"] == 4
    assert parts.put_file("forwards/big.pt2", path, sha) is False


def test_a_download_waits_for_no_lone_head_and_an_upload_looks_before_it_creates(store, tmp_path):
    # A download reads size, ETag and digest from its first range's answer: on loopback a lone HEAD was most of
    # what Kiln's transfers cost over boto3's (bench part `store`). An upload looks for an existing object
    # before it creates a multipart upload: an upload created beside that look, whose creation's answer is lost
    # and retried, leaves an upload behind that nothing can abort (tests/faults/test_s3_proxy.py found one).
    data = os.urandom(12 * MIB)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    parts = small_parts(store)
    seen = Requests(parts._client, delay_s=0.2)
    assert parts.put_file("f", path, sha256_bytes(data)) is True
    [head_end], [create_start] = seen.times("end", "HeadObject"), seen.times("start", "CreateMultipartUpload")
    assert head_end <= create_start
    parts.get_file("f", tmp_path / "back", sha256_bytes(data))
    assert (tmp_path / "back").read_bytes() == data
    assert len(seen.times("start", "HeadObject")) == 1 and len(seen.times("start", "GetObject")) == 3
    assert parts.put_file("f", path, sha256_bytes(data)) is False  # found: nothing created, nothing uploaded
    assert len(seen.times("start", "UploadPart")) == 3 and len(seen.times("start", "CreateMultipartUpload")) == 1
    assert raw_client(store).list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []


class _Refused:
    status_code = 400
    headers: dict = {}


def test_a_part_that_fails_aborts_the_upload_after_the_parts_in_flight(store, tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(30 * MIB))  # 6 parts
    parts = small_parts(store, max_concurrency=3)
    seen = Requests(parts._client, delay_s=0.1)

    def refuse_part_3(params, **_):
        if params["query_string"].get("partNumber") == 3:
            return _Refused(), {"Error": {"Code": "InvalidRequest", "Message": "injected"},
                                "ResponseMetadata": {"HTTPStatusCode": 400}}
        return None

    parts._client.meta.events.register_first("before-call.s3.UploadPart", refuse_part_3)
    with pytest.raises(StoreError, match="injected"):
        parts.put_file("big", path, sha256_bytes(path.read_bytes()))
    assert not store.exists("big")
    assert raw_client(store).list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []
    [abort] = seen.times("start", "AbortMultipartUpload")
    assert all(end <= abort for end in seen.times("end", "UploadPart"))  # no part still on its way
    assert len(seen.times("start", "UploadPart")) < 6  # the parts after the failure never started


@pytest.mark.parametrize("same_content", [True, False])
def test_racing_writers_of_a_multipart_object_create_it_once(store, tmp_path, same_content):
    # Both writers pass the existence check and send their parts at the same time; the first to
    # complete wins and the other's conditional completion is refused. The order is forced: moto
    # checks If-None-Match and creates the object without a lock, so completions it serves at the
    # same moment could both succeed (S3 itself decides atomically).
    first = os.urandom(16 * MIB)
    contents = [first, first if same_content else os.urandom(16 * MIB)]
    paths = [tmp_path / "w0.bin", tmp_path / "w1.bin"]
    for path, data in zip(paths, contents):
        path.write_bytes(data)
    writers = [small_parts(store), small_parts(store)]
    second_is_sending, first_is_done = threading.Event(), threading.Event()

    def waits_for(event: threading.Event):
        def handler(**_) -> None:  # a before-call handler that returns something replaces the request
            event.wait(30)

        return handler

    writers[1]._client.meta.events.register("before-call.s3.UploadPart", lambda **_: second_is_sending.set())
    writers[0]._client.meta.events.register("before-call.s3.CompleteMultipartUpload", waits_for(second_is_sending))
    writers[1]._client.meta.events.register("before-call.s3.CompleteMultipartUpload", waits_for(first_is_done))
    outcomes: list = [None, None]

    def write(i: int) -> None:
        try:
            outcomes[i] = writers[i].put_file("forwards/raced.pt2", paths[i], sha256_bytes(contents[i]))
        except Exception as e:
            outcomes[i] = e
        finally:
            if i == 0:
                first_is_done.set()

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outcomes[0] is True
    if same_content:
        assert outcomes[1] is False
    else:
        assert isinstance(outcomes[1], IntegrityError) and "forwards/raced.pt2" in str(outcomes[1])
    assert store.get_bytes("forwards/raced.pt2") == first
    assert raw_client(store).list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []


class _BreaksOff:
    """A response body that fails after `good` bytes, as a reset connection does."""

    def __init__(self, body, good: int) -> None:
        self._body, self._good = body, good

    def read(self, amt=None):
        self._body.read(self._good)
        raise IncompleteReadError(actual_bytes=self._good, expected_bytes=5 * MIB)

    def close(self):
        self._body.close()


def test_a_range_whose_body_breaks_off_is_fetched_again(store, tmp_path):
    data = os.urandom(17 * MIB)  # ranges of 5, 5, 5, 2 MiB
    store.put_bytes("k", data)
    parts = small_parts(store)
    seen = Requests(parts._client)
    broken = []

    def break_range_2_once(parsed, **_):
        if parsed.get("ContentRange", "").startswith(f"bytes {5 * MIB}-") and not broken:
            broken.append(parsed["ContentRange"])
            parsed["Body"] = _BreaksOff(parsed["Body"], good=MIB)

    parts._client.meta.events.register("after-call.s3.GetObject", break_range_2_once)
    dest = tmp_path / "k"
    parts.get_file("k", dest)
    assert broken and dest.read_bytes() == data
    assert len(seen.times("start", "GetObject")) == 5  # 4 ranges, one of them twice


def test_an_object_replaced_during_a_download_is_not_kept(store, tmp_path):
    store.put_bytes("k", os.urandom(12 * MIB))
    parts = small_parts(store)

    replaced = []

    def replace_after_first_range(**_):
        if not replaced:
            replaced.append(True)
            raw_client(store).put_object(Bucket=store.bucket, Key=store.prefix + "k", Body=os.urandom(12 * MIB),
                                         Metadata={"sha256": "0" * 64})

    parts._client.meta.events.register("after-call.s3.GetObject", replace_after_first_range)
    dest = tmp_path / "out" / "k"
    with pytest.raises(StoreError, match="PreconditionFailed"):
        parts.get_file("k", dest)  # If-Match on the first answer's ETag: no range of another version is used
    assert replaced
    assert list(dest.parent.iterdir()) == []


def test_a_tampered_multipart_object_is_refused_and_leaves_nothing(store, tmp_path):
    data = os.urandom(12 * MIB)
    store.put_bytes("k", data)
    tampered = data[: 7 * MIB] + bytes([data[7 * MIB] ^ 1]) + data[7 * MIB + 1 :]  # one bit, in the second range
    raw_client(store).put_object(Bucket=store.bucket, Key=store.prefix + "k", Body=tampered,
                                 Metadata={"sha256": sha256_bytes(data)})
    dest = tmp_path / "k"
    dest.write_bytes(b"previous")
    with pytest.raises(IntegrityError, match="'k'"):
        small_parts(store).get_file("k", dest)
    assert dest.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["k"]


def test_an_empty_object_downloads(store, tmp_path):
    store.put_bytes("empty", b"")
    store.get_file("empty", tmp_path / "empty", sha256_bytes(b""))
    assert (tmp_path / "empty").read_bytes() == b""


def test_with_checksums_on_a_multipart_upload_declares_its_part_checksums(s3_bucket, tmp_path):
    store = open_store(s3_bucket, checksum_mode="when_supported")
    data = os.urandom(11 * MIB)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    parts = small_parts(store, checksum_mode="when_supported")
    declared = []
    parts._client.meta.events.register(
        "before-call.s3.CreateMultipartUpload",
        lambda params, **_: declared.append(params["headers"].get("x-amz-checksum-algorithm")))
    completed = []
    parts._client.meta.events.register(
        "before-call.s3.CompleteMultipartUpload", lambda params, **_: completed.append(params["body"]))
    assert parts.put_file("big", path, sha256_bytes(data)) is True
    assert declared == ["CRC32"]
    assert completed[0].count(b"<ChecksumCRC32>") == 3
    assert store.get_bytes("big") == data



@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
def test_stale_multipart_uploads_under_the_prefix_are_aborted_and_counted(store):
    """What a killed writer leaves (an upload begun, a part sent, never completed) is aborted once it is
    older than the threshold; a fresh one, and one outside the store's prefix, are left alone. SeaweedFS,
    not moto: moto dates every upload 2010-11-10, so none is fresh there."""
    client = raw_client(store)
    left = client.create_multipart_upload(Bucket=store.bucket, Key="exports/run1/forwards/k/left.pt2")["UploadId"]
    client.upload_part(Bucket=store.bucket, Key="exports/run1/forwards/k/left.pt2", UploadId=left, PartNumber=1,
                       Body=b"x" * (5 * MIB))
    client.create_multipart_upload(Bucket=store.bucket, Key="exports/other/forwards/k/theirs.pt2")
    assert store.abort_stale_uploads(older_than_s=3600).count == 0  # begun just now: perhaps still running
    time.sleep(2.0)
    removed = store.abort_stale_uploads(older_than_s=1.0)
    assert (removed.count, removed.size_bytes) == (1, 5 * MIB)
    uploads = client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads] == ["exports/other/forwards/k/theirs.pt2"]
