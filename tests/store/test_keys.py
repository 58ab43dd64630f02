"""Key, prefix, bucket and digest validation: pure, no server."""

import hashlib

import pytest

from kiln.core.errors import BadInput
from kiln.core.trust.key_rules import validate_bucket, validate_sha256
from kiln.store import sha256_bytes, sha256_file, validate_key, validate_prefix


@pytest.mark.parametrize("key", ["a", "forwards/ab12.pt2", "a/b/c.json", "x.y-z_1", "a/.hidden", "a/..b"])
def test_valid_keys_are_returned_unchanged(key):
    assert validate_key(key) == key


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("", "empty"),
        ("a//b", "empty part"),
        ("a/", "empty part"),
        ("/a", "absolute"),
        ("./a", "'.'"),
        ("a/./b", "'.'"),
        ("../a", "'..'"),
        ("a/..", "'..'"),
        ("a\\b", "backslash"),
        ("a\x00b", "control"),
        ("a\nb", "control"),
        ("a\x7fb", "control"),
    ],
)
def test_bad_keys_raise_badinput_naming_the_key(key, why):
    with pytest.raises(BadInput) as err:
        validate_key(key)
    assert why in str(err.value)
    if key:
        assert repr(key) in str(err.value)


def test_non_string_key_is_rejected():
    with pytest.raises(BadInput):
        validate_key(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix", ["", "a", "a/", "forwards/ab", "a/b/"])
def test_valid_prefixes(prefix):
    assert validate_prefix(prefix) == prefix


@pytest.mark.parametrize("prefix", ["/", "/a", "a//", "a//b/", "../", "a/./", "a\\", "a\x01"])
def test_bad_prefixes(prefix):
    with pytest.raises(BadInput):
        validate_prefix(prefix)


@pytest.mark.parametrize("bucket", ["abc", "kiln-artifacts", "my.bucket.1", "a" * 63])
def test_valid_buckets(bucket):
    assert validate_bucket(bucket) == bucket


@pytest.mark.parametrize(
    "bucket", ["ab", "a" * 64, "Upper", "under_score", "-start", "end-", "a..b", "192.168.1.1", ""]
)
def test_bad_buckets(bucket):
    with pytest.raises(BadInput, match="bucket"):
        validate_bucket(bucket)


def test_sha256_validation():
    good = "0" * 64
    assert validate_sha256(good) == good
    for bad in ["0" * 63, "A" * 64, "g" * 64, ""]:
        with pytest.raises(BadInput):
            validate_sha256(bad)


def test_sha256_helpers_match_hashlib(tmp_path):
    data = bytes(range(256)) * 10_000  # 2.56 MB: three 1 MiB chunks
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    assert sha256_bytes(data) == expected
    assert sha256_file(path) == expected
