"""S3Store behaviour beyond the shared contract, against moto_server."""

from __future__ import annotations

import os
import pickle

import boto3
import pytest

from kiln.errors import BadInput, IntegrityError
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


def test_store_pickles_without_its_client_and_hides_secrets(store):
    secretive = S3Store("bucket", "p", access_key="AKIDEXAMPLE", secret_key="very-secret-value")
    assert "very-secret-value" not in repr(secretive) + secretive.url
    store.put_bytes("k", b"v")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.get_bytes("k") == b"v"
