"""A Hugging Face-layout checkpoint in S3 (`s3://BUCKET/PREFIX`), read with ranged GETs.

What is read, in order: the listing of PREFIX (each object's size and ETag),
`config.json`, the index when there is one, then each safetensors file's
header only (two ranged GETs: the 8-byte length, then the JSON header). A
rank's weights are then read slice by slice at the header's offsets: a row
slice is one range, a column slice one range per row; ranges of one tensor
closer than `merge_gap_bytes` are fetched as one GET (the gap read and
dropped), and the GETs run concurrently (`max_concurrency`). Each body is
copied CHUNK_BYTES at a time straight into the rank's constants (converted to
their dtype as it goes), so a rank's read holds its weights once plus at most
`max_concurrency` chunks. `bytes_read` counts every byte received, `requests`
every GET.

Contracts: `load_rank_weights` returns what kiln.host.weights.checkpoint's does for a
directory holding the same files: one rank's shard of every parameter, in
`cfg.dtype`. With a `cache_dir`, a rank's tensors are kept there under a key of
every object's name, size and ETag (plus tp, rank and dtype), so a second load
of the same checkpoint reads no weights again; a replaced object has a new
ETag, hence a new key (kiln.host.weights.s3_weight_cache: written atomically, evicted,
counted by the cache checks). `identity()` is what a manifest records. Bad input
(a missing config.json, a prefix with no safetensors, an object that is
missing, refused or replaced, a corrupt header, shapes config.json does not
imply) is BadInput naming the object. A blip is not bad input: each request
is retried by botocore (kiln.store.s3_client.REQUEST_RETRIES) and a body that breaks
off is fetched again (kiln.store.s3_client.READ_ATTEMPTS); what outlasts that (5xx,
throttling, read timeouts, closed connections) is StoreError(transient=True)
and is not retried again by a task or the flow (kiln.core.run.retry_rule).
Compile workers need none of this: they compile weightless.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput, StoreError
from kiln.core.model.hf_config import from_hf
from kiln.core.model.hf_config.multimodal import text_tensors, wrapper_of
from kiln.core.model.safetensors_header import DTYPES, header_length, index_weight_map, parse_header
from kiln.host.weights import s3_weight_cache
from kiln.host.weights.safetensors_io import torch_dtype

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: object name, dtype, shape and its absolute byte range [start, end)."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start_byte: int
    end_byte: int


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix ending in '/' or empty) of s3://BUCKET/PREFIX; BadInput otherwise."""
    if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
        raise BadInput(f"{url!r} is not an S3 checkpoint address; use s3://BUCKET/PREFIX.")
    bucket, _, prefix = url[5:].partition("/")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def row_ranges(info: TensorInfo, cut: tuple[int, int, int] | None) -> list[tuple[int, int]]:
    """Byte ranges [first, last] (inclusive, as HTTP Range says) holding `cut` of the tensor (None: all of it),
    adjacent ranges merged. `cut` is (dim, start, stop) as kiln.core.model.contract.rank_reads gives it."""
    if cut is None:
        return [(info.start_byte, info.end_byte - 1)] if info.end_byte > info.start_byte else []
    dim, lo, hi = cut
    inner = DTYPES[info.dtype].itemsize_bytes
    for d in info.shape[dim + 1:]:
        inner *= d
    outer = 1
    for d in info.shape[:dim]:
        outer *= d
    stride = info.shape[dim] * inner
    ranges: list[tuple[int, int]] = []
    for r in range(outer):
        first = info.start_byte + r * stride + lo * inner
        last = first + (hi - lo) * inner - 1
        if ranges and ranges[-1][1] + 1 == first:
            ranges[-1] = (ranges[-1][0], last)
        else:
            ranges.append((first, last))
    return ranges


MERGE_GAP_BYTES = 1 << 20
"""Ranges of one tensor at most this far apart are fetched as one GET. On S3 a request costs about what a
MiB of transfer does (tens of ms to the first byte, at tens to hundreds of MB/s per connection), so a column
slice (one range per row, each a few KiB at real widths) is read as its rows' whole span, one GET, rather
than as thousands of small ones: more bytes (the other ranks' columns of the row-parallel projections), far
fewer requests. 0 reads exactly the rank's bytes."""


MAX_FETCH_BYTES = 64 << 20
"""A merged fetch stops growing at this size, so a large tensor still comes in several GETs at once."""


def coalesce(ranges: list[tuple[int, int]], gap_bytes: int,
             max_fetch_bytes: int = MAX_FETCH_BYTES) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Sorted, disjoint byte ranges [first, last] grouped into fetches (first, last, [the ranges inside]):
    a range joins the previous fetch when at most `gap_bytes` unwanted bytes separate them and the fetch
    stays within `max_fetch_bytes`."""
    out: list[list] = []
    for first, last in ranges:
        if out and first - out[-1][1] - 1 <= gap_bytes and last - out[-1][0] < max_fetch_bytes:
            out[-1][1] = last
            out[-1][2].append((first, last))
        else:
            out.append([first, last, [(first, last)]])
    return [(first, last, inside) for first, last, inside in out]


CHUNK_BYTES = 256 << 10
"""A body is copied into its tensors this many bytes at a time (a multiple of every dtype's size). 1 MiB
chunks held 1.30x a rank's bytes at the peak, 256 KiB 1.11x (bench/parts_s3_read.py, 16 GETs in flight):
each thread's freed chunks stay in its malloc arena."""

Sink = Callable[[int, memoryview], None]
"""sink(object_offset, data): bytes of one GET's body, handed over in order, CHUNK_BYTES at most."""


class S3Checkpoint:
    """A checkpoint under s3://BUCKET/PREFIX; lists the prefix when made (BadInput when it holds none)."""

    def __init__(self, url: str, *, endpoint_url: str | None = None, cache_dir: str | Path | None = None,
                 max_concurrency: int = 16, client=None, merge_gap_bytes: int = MERGE_GAP_BYTES):
        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_s3_url(url)
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.max_concurrency = max_concurrency
        self.merge_gap_bytes = merge_gap_bytes
        self.bytes_read = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._client = client or _client(endpoint_url, max_concurrency)
        self.objects = self._list()
        """{name under the prefix: (size_bytes, etag)}."""
        if "config.json" not in self.objects:
            raise BadInput(f"{self.url}/config.json does not exist; a Hugging Face-layout checkpoint needs "
                           "config.json beside its *.safetensors (upload it, or check the prefix).")
        if not any(n.endswith(".safetensors") for n in self.objects):
            raise BadInput(f"{self.url}/ holds no *.safetensors objects; a checkpoint needs its weights there.")
        self._tensors: dict[str, TensorInfo] | None = None
        """Every tensor of the text decoder by its name there (an image-text checkpoint's renamed: tensors())."""
        self._raw: dict | None = None
        self._image_text: dict | None = None

    # -- reading -------------------------------------------------------------

    def _name(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _list(self) -> dict[str, tuple[int, str]]:
        from botocore.exceptions import BotoCoreError, ClientError
        out = {}
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=self.prefix, Delimiter="/"):
                for obj in page.get("Contents", []):
                    out[obj["Key"][len(self.prefix):]] = (obj["Size"], obj["ETag"].strip('"'))
        except (ClientError, BotoCoreError) as exc:
            raise read_failure(exc, f"list {self.url}/", "check the bucket, the prefix and the credentials.") \
                from None
        return out

    def _get(self, name: str, first: int | None = None, last: int | None = None) -> bytes:
        """The object's bytes [first, last] (inclusive), or all of it (small objects: config, index, headers)."""
        parts: list[bytes] = []
        self._stream(name, first, last, lambda _, data: parts.append(bytes(data)))
        return b"".join(parts)

    def _stream(self, name: str, first: int | None, last: int | None, sink: Sink) -> None:
        """Hand the object's bytes [first, last] (inclusive; all of it when None) to `sink` in order, If-Match
        the listed ETag. A body that breaks off is fetched again from `first` (the sink sees those bytes
        again), READ_ATTEMPTS GETs in all; a body of another length than asked is BadInput."""
        from botocore.exceptions import BotoCoreError, ClientError
        from urllib3.exceptions import HTTPError as Urllib3Error

        from kiln.store.s3_client import read_body
        args = {"IfMatch": f'"{self.objects[name][1]}"'} if name in self.objects else {}
        if first is not None:
            args["Range"] = f"bytes={first}-{last}"
        try:
            _, got = read_body(lambda: self._client.get_object(Bucket=self.bucket, Key=self.prefix + name, **args),
                               lambda body: _drain(body, first or 0, None if first is None else last - first + 1,
                                                   sink))
        except (ClientError, BotoCoreError, Urllib3Error) as exc:
            raise read_failure(exc, f"read {self._name(name)}", "check it exists, is readable with these "
                               "credentials and was not replaced during the export.") from None
        if first is not None and got != last - first + 1:
            raise BadInput(f"{self._name(name)}: asked for bytes {first}-{last}, got {got} bytes; the object "
                           "is shorter than its safetensors header says (truncated) or the server ignores Range.")
        with self._lock:
            self.bytes_read += got
            self.requests += 1

    def _raw_config(self) -> dict:
        """config.json, parsed (read once)."""
        if self._raw is None:
            try:
                self._raw = json.loads(self._get("config.json"))
            except ValueError as exc:
                raise BadInput(f"{self._name('config.json')} is not a valid config ({exc}).") from None
        return self._raw

    def image_text(self) -> dict | None:
        """kiln.host.weights.checkpoint.image_text's answer for this checkpoint (None for a text-only one, read
        without its headers)."""
        if wrapper_of(self._raw_config()) is None:
            return None
        self.tensors()
        return self._image_text

    def read_config(self) -> ModelConfig:
        return from_hf(self._raw_config())

    def _index(self) -> dict[str, str] | None:
        """The index's weight_map (tensor name -> object name), checked by kiln.core.model.safetensors_header and
        every object it names listed; None when there is no index."""
        if INDEX not in self.objects:
            return None
        placed = index_weight_map(self._get(INDEX), self._name(INDEX))
        absent = sorted(set(placed.values()) - set(self.objects))
        if absent:
            raise BadInput(f"{self._name(absent[0])} is listed in the checkpoint index but does not exist.")
        return placed

    def _header(self, file: str) -> dict[str, TensorInfo]:
        """The object's tensors, its header read with two ranged GETs and checked by
        kiln.core.model.safetensors_header (BadInput naming the object and the field)."""
        size, where = self.objects[file][0], self._name(file)
        length = header_length(self._get(file, 0, 7) if size >= 8 else b"", size, where)
        header = parse_header(self._get(file, 8, 7 + length) if length else b"", size, where)
        base = 8 + length
        return {name: TensorInfo(file, t.dtype, t.shape, base + t.begin_byte, base + t.end_byte)
                for name, t in header.items()}

    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor's place, from the headers (read once, concurrently): with an index, the tensors it
        places in each object (as kiln.host.weights.checkpoint reads a directory)."""
        if self._tensors is None:
            placed = self._index()
            files = sorted(set(placed.values()) if placed is not None else
                           (n for n in self.objects if n.endswith(".safetensors")))
            with ThreadPoolExecutor(self.max_concurrency) as pool:
                headers = list(pool.map(self._header, files))
            have = {name: info for h in headers for name, info in h.items()
                    if placed is None or placed.get(name) == info.file}
            for name, file in (placed or {}).items():
                if name not in have:
                    raise BadInput(f"{self._name(INDEX)}: weight_map places tensor {name!r} in {file}, whose header "
                                   "does not hold it; fix the index or upload the checkpoint again.")
            self._tensors, _, self._image_text = text_tensors(self._raw_config(), have,
                                                                     lambda t: t.end_byte - t.start_byte)
        return self._tensors

    def inspect(self) -> ModelConfig:
        """Config and headers only (no weights): every tensor config.json implies there with its shape,
        and none it does not account for (kiln.host.weights.checkpoint's checks); returns the config."""
        cfg = self.read_config()
        self._check(cfg)
        return cfg

    def _check(self, cfg: ModelConfig) -> None:
        """kiln.host.weights.checkpoint.check_tensors over the headers: every tensor `cfg` implies, with its shape."""
        from kiln.host.weights.checkpoint import check_tensors
        check_tensors(f"{self.url}/", cfg, {name: (self._name(t.file), t.shape, t.dtype)
                                            for name, t in self.tensors().items()})

    def identity(self) -> dict:
        """What a manifest records: the address and every object's name, size and ETag."""
        return {"url": self.url, "objects": [{"name": n, "size_bytes": s, "etag": e}
                                             for n, (s, e) in sorted(self.objects.items())]}

    def _cache_file(self, cfg: ModelConfig, tp: int, rank: int) -> Path | None:
        if self.cache_dir is None:
            return None
        return s3_weight_cache.entry(self.cache_dir, self.identity()["objects"], cfg.dtype, tp, rank)

    def load_rank_weights(self, cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
        """One rank's package constants (kiln.host.weights.checkpoint.load_rank_weights' contract), in `cfg.dtype`;
        from the cache when it holds them."""
        from kiln.host.model import rank_constants
        cached = self._cache_file(cfg, tp, rank)
        if cached is not None:
            hit = s3_weight_cache.read(cached)
            if hit is not None:
                return hit
        self._check(cfg)  # this host's reads, checked here: the flow's inspection ran elsewhere
        # The constants are allocated first (each once); the reads then stream into their slots.
        slots: dict[tuple, list[torch.Tensor]] = {}
        later: list = []  # a quantized checkpoint's scales, repeated over a rank's sub-blocks once read
        out = rank_constants(cfg, tp, rank, lambda name, cut, into: slots.setdefault((name, cut), []).append(into),
                             getattr(torch, cfg.dtype), later)
        self._read_into(slots)
        for repeat in later:
            repeat()
        if cached is not None:
            s3_weight_cache.write(cached, out, self.url, self.identity()["objects"])
        return out

    def _read_into(self, slots: dict[tuple, list[torch.Tensor]]) -> None:
        """Read each (checkpoint tensor, cut) into every tensor `slots` gives it (contiguous, shaped as the
        cut), converted from the stored dtype: its ranges' bytes go, chunk by chunk, to their place in the
        cut tensor; at most max_concurrency GETs at once, each holding one chunk."""
        have = self.tensors()
        jobs = []
        for (name, cut), outs in slots.items():
            info = have[name]
            flats = [o.view(-1) for o in outs]
            placed_bytes = 0
            for first, last, pieces in coalesce(row_ranges(info, cut), self.merge_gap_bytes):
                placed = []
                for a, b in pieces:
                    placed.append((a, b, placed_bytes))
                    placed_bytes += b - a + 1
                jobs.append((info, flats, first, last, placed))
        with ThreadPoolExecutor(self.max_concurrency) as pool:
            for _ in pool.map(lambda job: self._fetch_into(*job), jobs):
                pass

    def _fetch_into(self, info: TensorInfo, flats: list[torch.Tensor], first: int, last: int,
                    placed: list[tuple[int, int, int]]) -> None:
        """One GET of bytes [first, last] of `info`'s object: each wanted range [a, b] lands at byte `at` of
        the cut tensor, i.e. its element at // itemsize of every flat destination."""
        stored = torch_dtype(info.dtype)
        item = stored.itemsize

        def sink(pos: int, data: memoryview) -> None:
            end = pos + len(data)
            for a, b, at in placed:
                lo, hi = max(a, pos), min(b + 1, end)
                if lo < hi:  # chunks and ranges start a whole number of elements from `first`
                    src = torch.frombuffer(data[lo - pos:hi - pos], dtype=stored)
                    start = (at + lo - a) // item
                    for flat in flats:
                        flat[start:start + src.numel()].copy_(src)

        self._stream(info.file, first, last, sink)


def _drain(body, offset: int, expected: int | None, sink: Sink) -> int:
    """Copy a GET's body to `sink` CHUNK_BYTES at a time (whole chunks except the last: the sink's splits
    stay element-aligned), starting at object offset `offset`; stop with BadInput-worthy length once it
    passes `expected` bytes. Returns the bytes received."""
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    got = 0
    while True:
        n = 0
        while n < CHUNK_BYTES:
            data = body.read(CHUNK_BYTES - n)
            if not data:
                break
            buf[n:n + len(data)] = data
            n += len(data)
        if expected is not None and got + n > expected:
            return got + n  # longer than asked (a server ignoring Range): the caller refuses it, unwritten
        if n:
            sink(offset + got, view[:n])
            got += n
        if n < CHUNK_BYTES:
            return got


def read_failure(exc: Exception, what: str, fix: str) -> BadInput | StoreError:
    """What a failed request of the checkpoint raises, after botocore's retries and the body re-reads:
    StoreError(transient=True) for a blip (kiln.store.s3_errors.blip: 5xx, throttling, a read timeout, a
    closed connection), else BadInput saying `what` failed and `fix`."""
    from kiln.store.s3_errors import blip
    if blip(exc):
        return StoreError(f"cannot {what} ({exc}) on any try: the S3 endpoint is busy or failing; nothing to fix "
                          "here, try again later.", transient=True)
    return BadInput(f"cannot {what} ({exc}); {fix}")


def _client(endpoint_url: str | None, max_concurrency: int):
    from kiln.store.s3_client import client_config, make_client
    return make_client(client_config(max_concurrency=max_concurrency), endpoint_url=endpoint_url)
