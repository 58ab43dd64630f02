"""A checkpoint in S3 (kiln/host/weights/s3_checkpoint.py) against a real S3 API (moto_server on loopback):
the same per-rank tensors as the directory reader, only the rank's bytes read, a cache keyed by ETag and
size, and bad input naming the object."""

from __future__ import annotations

import json
import math
from pathlib import Path

import boto3
import pytest
import torch

from kiln.core.model.config import TINY
from kiln.core.errors import BadInput
from kiln.core.model.contract import shard_slice
from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights, random_checkpoint
from kiln.host.model import expected_shapes
from kiln.host.weights.s3_checkpoint import S3Checkpoint


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


def _span_bytes(shape, cut, item: int) -> int:
    """Bytes from a tensor's first wanted byte to its last: a row cut is exactly its rows; a column cut of a
    [rows, cols] tensor runs from row 0's slice to the last row's, the other ranks' columns between."""
    if cut is None:
        return item * math.prod(shape)
    dim, lo, hi = cut
    if dim == 0:
        return item * (hi - lo) * math.prod(shape[1:])
    rows, cols = shape
    return item * ((rows - 1) * cols + (hi - lo))


@pytest.mark.parametrize("merge_gap", [0, None], ids=["exact", "merged"])
def test_each_rank_reads_only_its_slices_and_gets_the_directory_readers_tensors(s3_ckpt, tmp_path, merge_gap):
    cfg = inspect_checkpoint(s3_ckpt["folder"])
    tp = 2
    gap = {} if merge_gap is None else {"merge_gap_bytes": merge_gap}
    for rank in range(tp):  # each host opens the checkpoint itself
        ck = S3Checkpoint(s3_ckpt["url"], endpoint_url=s3_ckpt["endpoint"], cache_dir=tmp_path / f"cache-{rank}",
                          **gap)
        assert ck.inspect() == cfg
        header_bytes, header_requests = ck.bytes_read, ck.requests
        got = ck.load_rank_weights(cfg, tp, rank)
        want = load_rank_weights(s3_ckpt["folder"], cfg, tp, rank)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        item = torch.empty((), dtype=torch.float32).element_size()  # as stored (float32)
        rank_bytes = sum(t.numel() * item for t in want.values())
        weight_bytes, weight_requests = ck.bytes_read - header_bytes, ck.requests - header_requests
        total = sum(size for size, _ in ck.objects.values())
        print(f"rank {rank} ({'exact' if merge_gap == 0 else 'merged'}): read {weight_bytes} weight bytes for "
              f"{rank_bytes} ({weight_bytes / rank_bytes:.3f}) in {weight_requests} GETs; with config and headers "
              f"{ck.bytes_read} of the checkpoint's {total}")
        sources = expected_shapes(cfg)
        column_cut = [n for n in sources if (c := shard_slice(n, cfg, tp, rank)) is not None and c[0] == 1]
        assert column_cut, "the row-parallel projections are cut by columns"
        if merge_gap == 0:
            assert weight_bytes == rank_bytes  # exactly its slices
            # one GET per row of every column-cut tensor (no two rows' slices touch at tp 2)
            assert weight_requests == sum(sources[n][0] for n in column_cut) + len(sources) - len(column_cut)
            assert ck.bytes_read < 0.6 * total
        else:  # the default: each tensor in one GET, a column-cut one as its rows' whole span
            assert weight_requests == len(sources)
            assert weight_bytes == sum(_span_bytes(sources[n], shard_slice(n, cfg, tp, rank), item) for n in sources)
            assert rank_bytes < weight_bytes < total

        again = S3Checkpoint(s3_ckpt["url"], endpoint_url=s3_ckpt["endpoint"], cache_dir=tmp_path / f"cache-{rank}")
        cached = again.load_rank_weights(cfg, tp, rank)
        assert again.bytes_read == 0 and all(torch.equal(cached[n], want[n]) for n in want)


def test_a_fused_checkpoint_reads_each_projections_rows_from_s3_as_from_a_directory(s3_bucket, s3_server, tmp_path):
    """Phi-3's qkv_proj and gate_up_proj: each rank reads its q, k and v rows (and gate and up rows) of one fused
    tensor; the same constants as the directory reader, and fewer bytes than the whole checkpoint."""
    cfg = TINY.replace(architecture="phi3", rotary_dim=8)
    folder = random_checkpoint(tmp_path / "phi3", cfg, seed=5)
    bucket = s3_bucket[5:].split("/")[0]
    _upload(boto3.client("s3", endpoint_url=s3_server.endpoint_url), bucket, "ckpt/phi3", folder)
    assert inspect_checkpoint(folder) == cfg
    for rank in range(2):
        ck = S3Checkpoint(f"s3://{bucket}/ckpt/phi3", endpoint_url=s3_server.endpoint_url, merge_gap_bytes=0)
        got = ck.load_rank_weights(cfg, 2, rank)
        want = load_rank_weights(folder, cfg, 2, rank)
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
        assert ck.bytes_read < 0.6 * sum(size for size, _ in ck.objects.values())


def test_an_fp8_block_checkpoint_reads_each_ranks_float8_slices_and_scales_from_s3_as_from_a_directory(
        s3_bucket, s3_server, tmp_path):
    """FP8 blocks (kiln.core.model.quant): each rank's float8 projections and float32 scales, those of a share that
    starts inside a block repeated over its sub-blocks (the experts' 48 rows a rank, blocks of 64), the same
    from S3 as from the directory, and cached as read."""
    from kiln.core.model.quant import WeightQuant

    cfg = TINY.replace(architecture="qwen3_moe", qk_norm=True, num_experts=2, experts_per_token=1,
                       moe_intermediate_size=96, moe_layers=(1,), dtype="bfloat16",
                       quant=WeightQuant("fp8_blocks", (64, 64)))
    folder = random_checkpoint(tmp_path / "fp8", cfg, seed=5)
    bucket = s3_bucket[5:].split("/")[0]
    _upload(boto3.client("s3", endpoint_url=s3_server.endpoint_url), bucket, "ckpt/fp8", folder)
    assert inspect_checkpoint(folder) == cfg
    for rank in range(2):
        ck = S3Checkpoint(f"s3://{bucket}/ckpt/fp8", endpoint_url=s3_server.endpoint_url, cache_dir=tmp_path / "c")
        got = ck.load_rank_weights(cfg, 2, rank)
        want = load_rank_weights(folder, cfg, 2, rank)
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
        assert got["model.runs.1.mlp.experts.up_proj.weight"].dtype == torch.float8_e4m3fn
        assert got["model.runs.1.mlp.experts.up_proj.weight_scale_inv"].shape == (2, 3, 6)  # 16-row sub-blocks
        cached = S3Checkpoint(f"s3://{bucket}/ckpt/fp8", endpoint_url=s3_server.endpoint_url,
                              cache_dir=tmp_path / "c").load_rank_weights(cfg, 2, rank)
        assert all(cached[n].dtype == want[n].dtype and torch.equal(cached[n], want[n]) for n in want)


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
    # The replaced version can never be read again: writing the new one evicted it.
    entry, root = second._cache_file(cfg, 2, 0), tmp_path / "cache"
    assert {p for p in root.rglob("*") if p.is_file()} == {entry, entry.parent / "source.json"}


def test_bodies_stream_into_the_tensors_in_chunks_converting_their_dtype(s3_bucket, s3_server, tmp_path, monkeypatch):
    """A bfloat16 checkpoint read as float32 with 96-byte chunks: every range split across chunks, each chunk
    converted into its place; the directory reader's tensors exactly, at most max_concurrency chunks held."""
    from kiln.host.weights import s3_checkpoint

    monkeypatch.setattr(s3_checkpoint, "CHUNK_BYTES", 96)
    stored = TINY.replace(num_layers=1, dtype="bfloat16")
    folder = random_checkpoint(tmp_path / "bf16", stored, seed=6)
    bucket = s3_bucket[5:].split("/")[0]
    _upload(boto3.client("s3", endpoint_url=s3_server.endpoint_url), bucket, "ckpt/bf16", folder)
    cfg = stored.replace(dtype="float32")
    for gap in (0, s3_checkpoint.MERGE_GAP_BYTES):
        ck = S3Checkpoint(f"s3://{bucket}/ckpt/bf16", endpoint_url=s3_server.endpoint_url, merge_gap_bytes=gap,
                          max_concurrency=4)
        got = ck.load_rank_weights(cfg, 2, 1)
        want = load_rank_weights(folder, cfg, 2, 1)
        assert sorted(got) == sorted(want)
        assert all(got[n].dtype == torch.float32 and torch.equal(got[n], want[n]) for n in want)


def test_a_cache_write_that_fails_leaves_no_file_and_the_load_goes_on(s3_ckpt, tmp_path, monkeypatch):
    import safetensors.torch

    def full_disk(tensors, path):
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    cfg = inspect_checkpoint(s3_ckpt["folder"])
    ck = S3Checkpoint(s3_ckpt["url"], endpoint_url=s3_ckpt["endpoint"], cache_dir=tmp_path / "cache")
    got = ck.load_rank_weights(cfg, 2, 0)
    want = load_rank_weights(s3_ckpt["folder"], cfg, 2, 0)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == ["source.json"]


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
    index = json.loads((s3_ckpt["folder"] / "model.safetensors.index.json").read_text())
    index["weight_map"][sorted(index["weight_map"])[0]] = "../tiny/model-00001-of-00002.safetensors"
    _put(s3_ckpt, "escaping/config.json", config)
    _put(s3_ckpt, "escaping/model.safetensors.index.json", json.dumps(index).encode())
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        _put(s3_ckpt, f"escaping/{f}", (s3_ckpt["folder"] / f).read_bytes())
    with pytest.raises(BadInput, match=r"escaping/model.safetensors.index.json: weight_map entry .* -> "
                                       r"'../tiny/model-00001-of-00002.safetensors' is not a file name inside"):
        opened("escaping").inspect()
    index = json.loads((s3_ckpt["folder"] / "model.safetensors.index.json").read_text())
    moved = sorted(index["weight_map"])[0]
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"][moved] = next(f for f in shards if f != index["weight_map"][moved])
    _put(s3_ckpt, "misplaced/config.json", config)
    _put(s3_ckpt, "misplaced/model.safetensors.index.json", json.dumps(index).encode())
    for f in shards:
        _put(s3_ckpt, f"misplaced/{f}", (s3_ckpt["folder"] / f).read_bytes())
    with pytest.raises(BadInput, match=rf"misplaced/model.safetensors.index.json: weight_map places tensor '{moved}'"):
        opened("misplaced").inspect()
    shard = (s3_ckpt["folder"] / "model-00001-of-00002.safetensors").read_bytes()
    length = int.from_bytes(shard[:8], "little")
    header = json.loads(shard[8:8 + length])
    name = sorted(n for n in header if n != "__metadata__")[0]
    header[name]["data_offsets"][1] -= 4
    raw = json.dumps(header).encode()
    _put(s3_ckpt, "offsets/config.json", config)
    _put(s3_ckpt, "offsets/model.safetensors", len(raw).to_bytes(8, "little") + raw + shard[8 + length:])
    ck = opened("offsets")
    for check in (ck.inspect, lambda: ck.load_rank_weights(TINY, 2, 0)):  # a host loading checks it too
        with pytest.raises(BadInput, match=rf"offsets/model.safetensors: tensor '{name}' has data_offsets"):
            check()
    _put(s3_ckpt, "badconfig/config.json", b"{not json")
    _put(s3_ckpt, "badconfig/model.safetensors", b"")
    with pytest.raises(BadInput, match=r"badconfig/config.json is not a valid config"):
        opened("badconfig").inspect()
    with pytest.raises(BadInput, match="s3://BUCKET/PREFIX"):
        S3Checkpoint("s3:///x")


def test_coalesce_merges_close_ranges_and_caps_a_fetch():
    from kiln.host.weights.s3_checkpoint import coalesce

    rows = [(i * 100, i * 100 + 49) for i in range(4)]  # 50 wanted bytes, then a 50-byte gap, four times
    assert coalesce(rows, 0) == [(a, b, [(a, b)]) for a, b in rows]
    assert coalesce(rows, 50) == [(0, 349, rows)]
    assert coalesce(rows, 49) == coalesce(rows, 0)  # a gap one byte too wide is not read
    assert coalesce(rows, 50, max_fetch_bytes=200) == [(0, 149, rows[:2]), (200, 349, rows[2:])]
