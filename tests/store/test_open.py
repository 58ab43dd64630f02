"""open_store URL parsing and check() failing fast with useful messages."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from pathlib import Path

import pytest

from kiln.core.errors import BadInput
from kiln.store import LocalStore, open_store
from kiln.store.s3 import S3Store

FAIL_FAST_S = 10.0


@pytest.mark.parametrize("url", ["ftp://host/dir", "gs://bucket/p", "http://example.com/x"])
def test_unknown_scheme(url):
    scheme = url.split(":")[0]
    with pytest.raises(BadInput) as err:
        open_store(url)
    assert str(err.value) == f"unknown store scheme {scheme!r} in URL; use file://DIR or s3://BUCKET/PREFIX"


def test_local_urls(tmp_path, monkeypatch):
    assert open_store(f"file://{tmp_path}").root == tmp_path
    assert open_store(str(tmp_path)).root == tmp_path
    assert open_store(f"file://localhost{tmp_path}").root == tmp_path
    monkeypatch.chdir(tmp_path)
    assert open_store("file://rel/dir").root == tmp_path / "rel" / "dir"
    assert isinstance(open_store("plain"), LocalStore)


@pytest.mark.parametrize("url", ["", "file://"])
def test_empty_urls(url):
    with pytest.raises(BadInput):
        open_store(url)


def test_s3_url_parsing(aws_test_env, monkeypatch):
    store = open_store("s3://my-bucket/exports/run1", s3_endpoint="http://127.0.0.1:9")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.endpoint_url) == ("my-bucket", "exports/run1/", "http://127.0.0.1:9")
    assert store.url == "s3://my-bucket/exports/run1"
    assert open_store("s3://my-bucket").prefix == ""
    assert open_store("s3://my-bucket/").url == "s3://my-bucket"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://from-env:9000")
    assert open_store("s3://my-bucket/p").endpoint_url == "http://from-env:9000"
    assert open_store("s3://my-bucket/p", s3_endpoint="https://arg").endpoint_url == "https://arg"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("s3://Bad_Bucket/p", "bucket name"),
        ("s3:///p", "bucket name"),
        ("s3://bucket/a//b", "empty part"),
        ("s3://bucket/../x", "'..'"),
        ("s3://bucket/p?versionId=1", "query"),
    ],
)
def test_bad_s3_urls(url, match):
    with pytest.raises(BadInput, match=match):
        open_store(url)


def test_credentials_in_the_url_are_refused_without_echoing_them():
    with pytest.raises(BadInput) as err:
        open_store("s3://AKID:topsecret@bucket/p")
    assert "topsecret" not in str(err.value)


def test_bad_endpoint_scheme():
    with pytest.raises(BadInput, match="http"):
        open_store("s3://bucket/p", s3_endpoint="localhost:9000")


def test_check_missing_bucket(s3_server, aws_test_env):
    store = open_store("s3://no-such-bucket-kiln/p", s3_endpoint=s3_server.endpoint_url)
    start = time.monotonic()
    with pytest.raises(BadInput) as err:
        store.check()
    assert time.monotonic() - start < FAIL_FAST_S
    message = str(err.value)
    assert "'no-such-bucket-kiln' does not exist" in message
    assert s3_server.endpoint_url in message


def test_check_unreachable_endpoint(aws_test_env):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    store = open_store("s3://some-bucket/p", s3_endpoint=endpoint)
    start = time.monotonic()
    with pytest.raises(BadInput) as err:
        store.check()
    assert time.monotonic() - start < FAIL_FAST_S
    assert f"cannot reach S3 endpoint {endpoint}" in str(err.value)
    assert "'some-bucket'" in str(err.value)


def test_check_endpoint_that_is_not_s3(aws_test_env):
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # a plain web server: 404, no x-amz-* headers
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(BadInput, match="probably not an S3 endpoint") as err:
            open_store("s3://some-bucket/p", s3_endpoint=endpoint).check()
        assert endpoint in str(err.value)
    finally:
        server.shutdown()
        server.server_close()


def test_check_without_credentials(s3_server, aws_test_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # do not wait for an instance role
    store = open_store("s3://some-bucket/p", s3_endpoint=s3_server.endpoint_url)
    with pytest.raises(BadInput, match="no complete AWS credentials"):
        store.check()


@pytest.fixture(scope="module")
def s3_server_with_auth(s3_server_factory):
    """A moto_server that validates credentials against its (empty) IAM: every key is unknown."""
    return s3_server_factory({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})


def test_check_wrong_credentials(s3_server_with_auth, aws_test_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    endpoint = s3_server_with_auth.endpoint_url
    store = open_store("s3://some-bucket/p", s3_endpoint=endpoint)
    with pytest.raises(BadInput, match="refused the credentials") as err:
        store.check()
    assert endpoint in str(err.value) and "'some-bucket'" in str(err.value)
    assert "wrong-secret-value" not in str(err.value)


def test_check_passes_on_a_real_bucket(s3_bucket, tmp_path):
    open_store(s3_bucket).check()
    open_store(str(Path(tmp_path) / "dir")).check()
