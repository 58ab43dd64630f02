"""A checkpoint in S3 (kiln/host/s3_checkpoint.py) against a real S3 API (moto_server on loopback):
the same per-rank tensors as the directory reader, only the rank's bytes read, a cache keyed by ETag and
size, and bad input naming the object."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
import torch

from kiln.core.config import TINY
from kiln.core.errors import BadInput
from kiln.host.checkpoint import inspect_checkpoint, load_rank_weights, random_checkpoint
from kiln.host.s3_checkpoint import S3Checkpoint


def _upload(client, bucket: str, prefix: str, folder: Path) -> None:
    for f in sorted(folder.iterdir()):
        client.upload_file(str(f), bucket, f"{prefix}/{f.name}")


@pytest.fixture
def s3_ckpt(s3_bucket, s3_server, tmp_path):
    """TINY written as two shards with an index, in a directory and uploaded under s3://BUCKET/ckpt/tiny."""
    folder = random_checkpoint(tmp_path / "tiny", TINY, seed=3, num_shards=2)
    bucket = s3_bucket[5:].split("/")[0]
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    _upload(client, bucket, "ckpt/tiny", folder)
    return {"folder": folder, "url": f"s3://{bucket}/ckpt/tiny", "bucket": bucket, "client": client,
            "endpoint": s3_server.endpoint_url}


def test_each_rank_reads_only_its_slices_and_gets_the_directory_readers_tensors(s3_ckpt, tmp_path):
    cfg = inspect_checkpoint(s3_ckpt["folder"])
    tp = 2
    for rank in range(tp):  # each host opens the checkpoint itself
        ck = S3Checkpoint(s3_ckpt["url"], endpoint_url=s3_ckpt["endpoint"], cache_dir=tmp_path / f"cache-{rank}")
        assert ck.inspect() == cfg
        header_bytes = ck.bytes_read
        got = ck.load_rank_weights(cfg, tp, rank)
        want = load_rank_weights(s3_ckpt["folder"], cfg, tp, rank)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        file_item = {n: torch.empty((), dtype=getattr(torch, "float32")).element_size() for n in want}
        rank_bytes = sum(t.numel() * file_item[n] for n, t in want.items())  # as stored (float32)
        weight_bytes = ck.bytes_read - header_bytes
        total = sum(size for size, _ in ck.objects.values())
        print(f"rank {rank}: read {weight_bytes} weight bytes for {rank_bytes} ({weight_bytes / rank_bytes:.3f}); "
              f"with config and headers {ck.bytes_read} of the checkpoint's {total}")
        assert weight_bytes == rank_bytes  # exactly its slices: <= 1.05 with room to spare
        assert ck.bytes_read < 0.6 * total

        again = S3Checkpoint(s3_ckpt["url"], endpoint_url=s3_ckpt["endpoint"], cache_dir=tmp_path / f"cache-{rank}")
        cached = again.load_rank_weights(cfg, tp, rank)
        assert again.bytes_read == 0 and all(torch.equal(cached[n], want[n]) for n in want)


def test_a_replaced_object_has_a_new_etag_so_the_cache_misses(s3_ckpt, tmp_path):
    cfg = inspect_checkpoint(s3_ckpt["folder"])
    first = S3Checkpoint(s3_ckpt["url"], endpoint_url=s3_ckpt["endpoint"], cache_dir=tmp_path / "cache")
    first.load_rank_weights(cfg, 2, 0)
    other = random_checkpoint(tmp_path / "other", TINY, seed=4, num_shards=2)
    _upload(s3_ckpt["client"], s3_ckpt["bucket"], "ckpt/tiny", other)
    second = S3Checkpoint(s3_ckpt["url"], endpoint_url=s3_ckpt["endpoint"], cache_dir=tmp_path / "cache")
    assert second.identity() != first.identity()
    assert all(o["etag"] and o["size_bytes"] > 0 for o in second.identity()["objects"])
    got = second.load_rank_weights(cfg, 2, 0)
    assert second.bytes_read > 0
    want = load_rank_weights(other, cfg, 2, 0)
    assert all(torch.equal(got[n], want[n]) for n in want)


def _put(s3_ckpt, key: str, body: bytes) -> None:
    s3_ckpt["client"].put_object(Bucket=s3_ckpt["bucket"], Key=key, Body=body)


def test_bad_input_names_the_object(s3_ckpt):
    def opened(prefix: str) -> S3Checkpoint:
        return S3Checkpoint(f"s3://{s3_ckpt['bucket']}/{prefix}", endpoint_url=s3_ckpt["endpoint"])

    config = (s3_ckpt["folder"] / "config.json").read_bytes()
    with pytest.raises(BadInput, match=r"s3://.*/nothing-here/config.json does not exist"):
        opened("nothing-here")
    _put(s3_ckpt, "config-only/config.json", config)
    with pytest.raises(BadInput, match=r"config-only/ holds no \*.safetensors"):
        opened("config-only")
    _put(s3_ckpt, "truncated/config.json", config)
    _put(s3_ckpt, "truncated/model.safetensors", b"\xff" * 8 + b"{}")
    with pytest.raises(BadInput, match=r"truncated/model.safetensors: its header claims"):
        opened("truncated").inspect()
    _put(s3_ckpt, "indexed/config.json", config)
    _put(s3_ckpt, "indexed/model.safetensors.index.json", (s3_ckpt["folder"] / "model.safetensors.index.json").read_bytes())
    _put(s3_ckpt, "indexed/model-00001-of-00002.safetensors",
         (s3_ckpt["folder"] / "model-00001-of-00002.safetensors").read_bytes())
    with pytest.raises(BadInput, match=r"indexed/model-00002-of-00002.safetensors is listed in the checkpoint index"):
        opened("indexed").inspect()
    _put(s3_ckpt, "badconfig/config.json", b"{not json")
    _put(s3_ckpt, "badconfig/model.safetensors", b"")
    with pytest.raises(BadInput, match=r"badconfig/config.json is not a valid config"):
        opened("badconfig").inspect()
    with pytest.raises(BadInput, match="s3://BUCKET/PREFIX"):
        S3Checkpoint("s3:///x")
