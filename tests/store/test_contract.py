"""The Store contract, run unchanged against LocalStore and S3Store on two servers: moto_server and SeaweedFS."""

from __future__ import annotations

import multiprocessing
import os
import queue
from pathlib import Path

import pytest

from kiln.core.errors import IntegrityError
from kiln.store import LocalStore, ObjectMissing, Store, open_store, sha256_bytes, sha256_file
from kiln.store.base import json_bytes

MIB = 1024 * 1024


@pytest.fixture(params=["local", "moto", "seaweedfs"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return f"file://{tmp_path / 'store'}"
    return request.getfixturevalue("s3_bucket_on")(request.getfixturevalue(f"{request.param}_s3"))


@pytest.fixture
def store(store_url: str) -> Store:
    opened = open_store(store_url)
    opened.check()
    return opened


def tamper(store: Store, key: str, data: bytes) -> None:
    """Replace an object's bytes behind the store's back, keeping its recorded sha256."""
    if isinstance(store, LocalStore):
        (store.root / key).write_bytes(data)  # writes through the key's symlink into its blob
        return
    import boto3

    client = boto3.client("s3", endpoint_url=store.endpoint_url)
    full = store.prefix + key
    metadata = client.head_object(Bucket=store.bucket, Key=full)["Metadata"]
    client.put_object(Bucket=store.bucket, Key=full, Body=data, Metadata=metadata)


def write(path: Path, data: bytes) -> tuple[Path, str]:
    path.write_bytes(data)
    return path, sha256_bytes(data)


# -- create-once -----------------------------------------------------------------


def test_put_bytes_creates_once_and_records_sha(store):
    assert store.put_bytes("forwards/a.pt2", b"artifact") is True
    assert store.put_bytes("forwards/a.pt2", b"artifact") is False
    info = store.stat("forwards/a.pt2")
    assert info is not None
    assert (info.key, info.size_bytes, info.sha256) == ("forwards/a.pt2", 8, sha256_bytes(b"artifact"))
    assert store.get_bytes("forwards/a.pt2") == b"artifact"


def test_different_content_raises_and_keeps_the_original(store, tmp_path):
    store.put_bytes("k", b"first")
    with pytest.raises(IntegrityError, match="'k'"):
        store.put_bytes("k", b"second")
    path, sha = write(tmp_path / "f", b"third")
    with pytest.raises(IntegrityError, match="'k'"):
        store.put_file("k", path, sha)
    with pytest.raises(IntegrityError, match="'k'"):
        store.put_json("k", {"x": 1})
    assert store.get_bytes("k") == b"first"


def test_put_file_round_trip(store, tmp_path):
    path, sha = write(tmp_path / "src.bin", os.urandom(100_000))
    assert store.put_file("forwards/b.pt2", path, sha) is True
    assert store.put_file("forwards/b.pt2", path, sha) is False
    dest = tmp_path / "new" / "dir" / "b.pt2"  # parent does not exist yet
    store.get_file("forwards/b.pt2", dest)
    assert dest.read_bytes() == path.read_bytes()
    store.get_file("forwards/b.pt2", dest, sha256=sha)  # replaces an existing file
    assert sha256_file(dest) == sha


def test_put_file_with_wrong_sha_stores_nothing(store, tmp_path):
    path, _ = write(tmp_path / "f", b"bytes")
    with pytest.raises(IntegrityError, match="nothing was stored"):
        store.put_file("k", path, sha256_bytes(b"other bytes"))
    assert not store.exists("k")


def test_recreate_after_delete(store):
    store.put_bytes("k", b"one")
    store.delete("k")
    assert store.put_bytes("k", b"two") is True
    assert store.get_bytes("k") == b"two"


# -- verified reads --------------------------------------------------------------


def test_get_detects_tampered_object(store, tmp_path):
    store.put_bytes("forwards/c.pt2", b"good native code")
    tamper(store, "forwards/c.pt2", b"evil native code")
    dest = tmp_path / "out" / "c.pt2"
    with pytest.raises(IntegrityError, match="forwards/c.pt2"):
        store.get_file("forwards/c.pt2", dest)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # no temp file left behind
    with pytest.raises(IntegrityError, match="forwards/c.pt2"):
        store.get_bytes("forwards/c.pt2")


def test_get_keeps_existing_destination_on_mismatch(store, tmp_path):
    store.put_bytes("k", b"stored")
    dest = tmp_path / "k"
    dest.write_bytes(b"previous")
    with pytest.raises(IntegrityError):
        store.get_file("k", dest, sha256=sha256_bytes(b"something else"))
    assert dest.read_bytes() == b"previous"


def test_get_checks_the_callers_sha(store):
    store.put_bytes("k", b"stored")
    assert store.get_bytes("k", sha256=sha256_bytes(b"stored")) == b"stored"
    with pytest.raises(IntegrityError, match="'k'"):
        store.get_bytes("k", sha256=sha256_bytes(b"expected"))


def test_missing_key(store, tmp_path):
    for read in (lambda: store.get_bytes("nope"), lambda: store.get_json("nope"),
                 lambda: store.get_file("nope", tmp_path / "x")):  # fmt: skip
        with pytest.raises(ObjectMissing) as err:
            read()
        assert isinstance(err.value, KeyError)
        assert err.value.key == "nope"
    assert not (tmp_path / "x").exists()
    assert store.stat("nope") is None
    assert store.exists("nope") is False
    store.delete("nope")  # missing is fine


# -- listing and deleting --------------------------------------------------------


def test_list_exists_delete(store):
    for key in ["forwards/b.pt2", "forwards/a.pt2", "forwardsX/c", "tuning/t.json", "manifest.json"]:
        store.put_bytes(key, key.encode())
    assert store.list() == ["forwards/a.pt2", "forwards/b.pt2", "forwardsX/c", "manifest.json", "tuning/t.json"]
    assert store.list("forwards/") == ["forwards/a.pt2", "forwards/b.pt2"]
    assert store.list("forwards") == ["forwards/a.pt2", "forwards/b.pt2", "forwardsX/c"]
    assert store.list("forwards/a") == ["forwards/a.pt2"]
    assert store.list("absent/") == []
    assert store.exists("forwards/a.pt2")
    assert not store.exists("forwards")  # a prefix is not an object
    store.delete("forwards/a.pt2")
    assert not store.exists("forwards/a.pt2")
    assert store.list("forwards/") == ["forwards/b.pt2"]


# -- JSON ------------------------------------------------------------------------


def test_json_round_trip_and_overwrite(store):
    doc = {"b": [1, 2], "a": {"z": None, "y": "ü"}}
    assert store.put_json("manifest.json", doc) is True
    assert store.put_json("manifest.json", dict(reversed(doc.items()))) is False  # same canonical bytes
    assert store.get_json("manifest.json") == doc
    raw = store.get_bytes("manifest.json")
    assert raw == json_bytes(doc)
    assert raw.startswith(b'{\n  "a"')  # sorted keys, indent 2
    assert store.put_json("manifest.json", {"v": 2}, overwrite=True) is True
    assert store.get_json("manifest.json") == {"v": 2}
    assert store.stat("manifest.json").sha256 == sha256_bytes(json_bytes({"v": 2}))


# -- large objects ---------------------------------------------------------------


def test_large_file_round_trip(store, tmp_path):
    path, sha = write(tmp_path / "big.bin", os.urandom(20 * MIB))
    assert store.put_file("big/f.bin", path, sha) is True
    assert store.put_file("big/f.bin", path, sha) is False
    assert store.stat("big/f.bin").size_bytes == 20 * MIB
    other, other_sha = write(tmp_path / "other.bin", os.urandom(20 * MIB))
    with pytest.raises(IntegrityError):
        store.put_file("big/f.bin", other, other_sha)
    dest = tmp_path / "down" / "f.bin"
    store.get_file("big/f.bin", dest)
    assert sha256_file(dest) == sha


# -- concurrency across processes ------------------------------------------------


def _race_put(url: str, key: str, path: str, sha: str, barrier, results) -> None:
    store = open_store(url)
    barrier.wait(timeout=120)  # all writers start together
    try:
        results.put(("created" if store.put_file(key, path, sha) else "existed", path))
    except IntegrityError:
        results.put(("conflict", path))
    except BaseException as e:  # report, do not hang the parent
        results.put(("error", repr(e)))


@pytest.mark.parametrize("same_content", [True, False], ids=["same", "different"])
def test_racing_processes_create_exactly_once(store_url, tmp_path, same_content):
    num_writers = 4
    files = []
    for i in range(num_writers):
        data = b"shared artifact" if same_content else f"artifact {i}".encode()
        files.append(write(tmp_path / f"w{i}.bin", data * 1000))
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(num_writers), ctx.Queue()
    procs = [
        ctx.Process(target=_race_put, args=(store_url, "forwards/race.pt2", str(p), sha, barrier, results))
        for p, sha in files
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = [results.get(timeout=180) for _ in procs]
    except queue.Empty:
        pytest.fail("a writer process did not report within 180 s")
    finally:
        for proc in procs:
            proc.join(timeout=30)
    kinds = sorted(kind for kind, _ in outcomes)
    loser = "existed" if same_content else "conflict"
    assert kinds == sorted(["created"] + [loser] * (num_writers - 1)), outcomes
    winner = next(Path(path) for kind, path in outcomes if kind == "created")
    assert open_store(store_url).get_bytes("forwards/race.pt2") == winner.read_bytes()



def test_link_opens_the_object_for_a_person(store: Store):
    """A local store's link is its path on this machine (no URL); an S3 store's is a presigned URL that a
    plain HTTP GET (a browser) reads without credentials."""
    import urllib.request

    store.put_bytes("exports/e1/manifest.json", b'{"k": 1}')
    text, url = store.link("exports/e1/manifest.json", expires_s=600)
    if url is None:
        assert Path(text).read_bytes() == b'{"k": 1}'
    else:
        assert text.startswith("s3://") and text.endswith("exports/e1/manifest.json")
        assert "Expires=" in url  # SigV2 (Expires=epoch) or SigV4 (X-Amz-Expires=600), as boto3 signs
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.read() == b'{"k": 1}'
