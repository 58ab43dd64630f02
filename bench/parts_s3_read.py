"""S3 checkpoint reads: what each rank reads against its weight bytes, and against downloading the files whole.

One checkpoint (the tiny model's width, `s3_read_layers` layers, float32, two safetensors shards) is uploaded
once to the suite's moto server. Each of the suite's samples, the sides' order rotating:
- Kiln: `kiln.host.weights.s3_checkpoint.S3Checkpoint` lists the prefix and reads the config and the headers, then
  each rank of tp 2 reads its own slices (ranged GETs at the header's offsets, 16 at once, no host cache),
  as a host does in an export: with its default `merge_gap_bytes` (a column-cut tensor read as its rows'
  whole span, one GET) and with 0 ("exact": one GET per row of a column-cut tensor, only the rank's bytes);
- boto3: `download_file` of every object of the prefix (its defaults: threaded ranged transfers), what a
  user who copies the checkpoint first waits for before anything can start.
Figures, for the default and for exact: the most weight bytes one rank received over that rank's weight
bytes (`kiln.core.model.rank_bytes.weight_bytes_per_rank`; its embedding, norms and head are whole on every rank,
its projections cut), and one rank's whole read (listing, headers, slices) over the whole download, medians
over the repetitions.

The loader's memory: a larger checkpoint (bench.rank_peak's model, ~300 MB in float32, in --quick too: the
S3 loader's fixed cost, its boto3 client and chunks in flight, ~25 MB, is 0.2x a 120 MB rank's weights) is
uploaded too, and rank 0 of tp 2 is loaded from S3 and from the same files in a directory, each in a fresh
process (bench.loader_peak), the sides alternating: each process's peak resident memory growth over that
rank's weight bytes.
"""

from __future__ import annotations

import json
import time

from bench.context import Context
from bench.figures import median, ratio
from bench.parts_hosts import BUCKET, s3_client
from bench.runs import FAKE_AWS, PYTHON

TP = 2


def _client(ctx: Context):
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=ctx.work.s3_endpoint, region_name=FAKE_AWS["AWS_DEFAULT_REGION"],
                        aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
                        config=Config(s3={"addressing_style": "path"}, max_pool_connections=16))


def part_s3_read(ctx: Context) -> dict:
    from kiln.core.model.config import TINY
    from kiln.core.model.rank_bytes import weight_bytes_per_rank
    from kiln.host.weights.checkpoint import random_checkpoint
    from kiln.host.weights.s3_checkpoint import MERGE_GAP_BYTES, S3Checkpoint

    cfg = TINY.replace(num_layers=ctx.s.s3_read_layers)
    folder = random_checkpoint(ctx.work.path("s3_read", "ckpt", "x").parent, cfg, seed=3, num_shards=2)
    prefix = ctx.tag("s3-read/ckpt")
    plain = s3_client(ctx)
    files = sorted(folder.iterdir())
    for f in files:
        plain.upload_file(str(f), BUCKET, f"{prefix}/{f.name}")
    total = sum(f.stat().st_size for f in files)
    client = _client(ctx)
    url = f"s3://{BUCKET}/{prefix}"
    rows = []
    for rep in range(ctx.s.samples):
        row: dict = {}

        def kiln_side(name: str, gap: dict) -> None:
            ranks = []
            for rank in range(TP):
                start = time.perf_counter()
                ckpt = S3Checkpoint(url, client=client, **gap)
                got = ckpt.inspect()
                before, before_requests = ckpt.bytes_read, ckpt.requests
                weights = ckpt.load_rank_weights(got, TP, rank)
                ranks.append({"rank": rank, "s": time.perf_counter() - start, "slice_bytes": ckpt.bytes_read - before,
                              "slice_requests": ckpt.requests - before_requests, "header_bytes": before,
                              "tensors": len(weights)})
            row[name] = ranks

        def boto_side() -> None:
            down = ctx.work.path("s3_read", f"down-{rep}", "x").parent
            start = time.perf_counter()
            for o in plain.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["Contents"]:
                plain.download_file(BUCKET, o["Key"], str(down / o["Key"].rsplit("/", 1)[-1]))
            row["boto3_s"] = time.perf_counter() - start

        sides = [lambda: kiln_side("kiln", {}), lambda: kiln_side("exact", {"merge_gap_bytes": 0}), boto_side]
        for side in sides[rep % 3:] + sides[:rep % 3]:
            side()
        rows.append(row)
    peaks = _loader_peaks(ctx, plain)
    rank_bytes = weight_bytes_per_rank(cfg, TP)
    figures = {"s3_loader_peak_ratio": median([r["s3"]["peak_over_weights"] for r in peaks]),
               "local_loader_peak_ratio": median([r["local"]["peak_over_weights"] for r in peaks])}
    for side, figure in (("kiln", "s3"), ("exact", "s3_exact")):
        figures[f"{figure}_rank_bytes_ratio"] = max(r["slice_bytes"] for row in rows for r in row[side]) / rank_bytes
        figures[f"{figure}_read_vs_download_ratio"] = median(
            [ratio(median([r["s"] for r in row[side]]), row["boto3_s"]) for row in rows])
    return {"figures": figures,
            "raw": {"loader_peaks": peaks, "checkpoint_bytes": total, "rank_weight_bytes": rank_bytes, "layers": cfg.num_layers,
                    "tp": TP, "merge_gap_bytes": MERGE_GAP_BYTES, "reps": rows},
            "notes": "moto_server on loopback: no network latency, so the time ratio shows the work each side does "
                     "(bytes moved, requests made), not what a remote S3 endpoint's round trips add; a rank's weights "
                     f"are {rank_bytes / total:.0%} of the checkpoint's bytes at tp {TP} (its embedding and head "
                     "are whole on every rank); the loader peaks: rank 0 of tp 2 of a 4-layer hidden-768 "
                     "float32 model, each side a fresh process, no host cache"}


def _loader_peaks(ctx: Context, plain) -> list[dict]:
    """[{'local': bench.loader_peak's result, 's3': the same from S3}, ...] per sample, the sides alternating."""
    from bench.rank_peak import config
    from kiln.host.weights.checkpoint import random_checkpoint

    folder = random_checkpoint(ctx.work.path("s3_read", "peak-ckpt", "x").parent, config(quick=False), seed=4)
    prefix = ctx.tag("s3-read/peak-ckpt")
    for f in sorted(folder.iterdir()):
        plain.upload_file(str(f), BUCKET, f"{prefix}/{f.name}")
    env = ctx.work.env(inductor=None, kiln_home="s3_read/home")
    sides = {"local": [str(folder)], "s3": [f"s3://{BUCKET}/{prefix}"]}
    rows = []
    for rep in range(ctx.s.samples):
        row = {}
        for side in (["local", "s3"] if rep % 2 == 0 else ["s3", "local"]):
            run = ctx.work.run(f"s3-loader-peak-{side}-{rep + 1}", [PYTHON, "-m", "bench.loader_peak", *sides[side],
                                                                    str(TP), "0", ctx.work.s3_endpoint], env).expect(0)
            row[side] = json.loads(run.log.read_text().strip().splitlines()[-1])
        rows.append(row)
    return rows
