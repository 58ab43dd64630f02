"""Store throughput: Kiln's S3Store against plain boto3, same files, same moto server, side by side.

Each repetition uploads the same files with `S3Store.put_file` (create-once,
sha256 hashed while uploading) and with a plain boto3 client's `upload_file`
(its defaults: threaded multipart transfers), then downloads them with
`S3Store.get_file` (sha256 verified, fsync, atomic rename) and
`download_file`. Each side keeps one client for all repetitions, as a
process does (boto3's is built before the first repetition; Kiln's store
builds its own inside the first one); each repetition writes fresh keys;
the two sides alternate which goes first.
Ratios are of throughput (kiln / boto3), median over the repetitions.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from bench.context import Context
from bench.figures import median, ratio, throughput_mib_s
from bench.parts_hosts import BUCKET, s3_client
from bench.runs import FAKE_AWS

MIB = 2**20


def _files(ctx: Context) -> list[tuple[Path, str]]:
    out = []
    for mib in ctx.s.store_file_mib:
        path = ctx.work.path("store", "files", f"blob-{mib}mib.bin")
        data = os.urandom(mib * MIB)
        path.write_bytes(data)
        out.append((path, hashlib.sha256(data).hexdigest()))
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def part_store(ctx: Context) -> dict:
    from kiln.store.s3 import S3Store

    files = _files(ctx)
    total = sum(p.stat().st_size for p, _ in files)
    plain = s3_client(ctx)
    store = S3Store(BUCKET, ctx.tag("store-bench/kiln"), endpoint_url=ctx.work.s3_endpoint,
                    region=FAKE_AWS["AWS_DEFAULT_REGION"], access_key=FAKE_AWS["AWS_ACCESS_KEY_ID"],
                    secret_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"])
    rows = []
    boto_prefix = ctx.tag("store-bench/boto")
    for rep in range(ctx.s.store_reps):
        down = ctx.work.path("store", f"down-{rep}", "x").parent

        def kiln_up():
            for p, digest in files:
                store.put_file(f"{rep}/blobs/{p.name}", p, digest)

        def boto_up():
            for p, _ in files:
                plain.upload_file(str(p), BUCKET, f"{boto_prefix}-{rep}/blobs/{p.name}")

        def kiln_down():
            for p, digest in files:
                store.get_file(f"{rep}/blobs/{p.name}", down / f"kiln-{p.name}", digest)

        def boto_down():
            for p, _ in files:
                plain.download_file(BUCKET, f"{boto_prefix}-{rep}/blobs/{p.name}", str(down / f"boto-{p.name}"))

        t = {}
        order = [("kiln", kiln_up, kiln_down), ("boto3", boto_up, boto_down)]
        for side, up, _ in (order if rep % 2 == 0 else order[::-1]):
            t[f"{side}_upload_s"] = _timed(up)
        for side, _, dn in (order if rep % 2 == 0 else order[::-1]):
            t[f"{side}_download_s"] = _timed(dn)
        for p, _ in files:  # both sides must have moved the same bytes
            if (down / f"kiln-{p.name}").read_bytes() != (down / f"boto-{p.name}").read_bytes():
                raise RuntimeError(f"downloads of {p.name} differ between Kiln and boto3")
        rows.append(t)
    figures, samples = {}, {}
    # What Kiln's contract costs by itself: hashing the same bytes once (upload and download each hash once).
    hash_s = median([_timed(lambda: [hashlib.sha256(p.read_bytes()).hexdigest() for p, _ in files])
                     for _ in range(3)])
    raw = {"bytes_per_rep": total, "files_mib": list(ctx.s.store_file_mib), "reps": rows, "sha256_alone_s": hash_s}
    for way in ("upload", "download"):
        kiln_mib_s = [throughput_mib_s(total, r[f"kiln_{way}_s"]) for r in rows]
        boto_mib_s = [throughput_mib_s(total, r[f"boto3_{way}_s"]) for r in rows]
        pairs = [ratio(k, b) for k, b in zip(kiln_mib_s, boto_mib_s)]
        figures[f"store_{way}_ratio"] = median(pairs)
        samples[f"store_{way}_ratio"] = pairs
        raw[f"{way}_ratio_per_rep"] = pairs
        raw[f"kiln_{way}_mib_s"] = median(kiln_mib_s)
        raw[f"boto3_{way}_mib_s"] = median(boto_mib_s)
    return {"figures": figures, "samples": samples, "raw": raw,
            "notes": f"{len(files)} random files of {', '.join(map(str, ctx.s.store_file_mib))} MiB per side "
                     f"and repetition ({ctx.s.store_reps}), to one moto_server on loopback; Kiln's side includes "
                     "its sha256 hashing on upload and verification on download and its fsync (its contract), "
                     "boto3's side is a plain client with default transfer settings; each side keeps one "
                     "client for all repetitions; each figure is the median of the per-repetition ratios"}
