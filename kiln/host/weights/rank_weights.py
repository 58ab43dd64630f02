"""A checkpoint by its address: a local directory (kiln/host/weights/checkpoint.py) or s3://BUCKET/PREFIX
(kiln/host/weights/s3_checkpoint.py). The callers that need a checkpoint's config or a rank's weights go through here.

Contracts: the same answers for the same files wherever they are. An S3
checkpoint is reached at `s3_endpoint` (else AWS_ENDPOINT_URL, else AWS; the
credentials are the AWS chain's), the same endpoint as an S3 store's.
`cache_dir` (a host's cache) keeps a rank's tensors read from S3.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kiln.core.model.config import ModelConfig
from kiln.core.model.rank_bytes import weight_bytes_per_rank


def is_s3(checkpoint: str) -> bool:
    return str(checkpoint).startswith("s3://")


def _s3(checkpoint: str, s3_endpoint: str | None, cache_dir: str | Path | None = None):
    from kiln.host.weights.s3_checkpoint import S3Checkpoint
    return S3Checkpoint(checkpoint, endpoint_url=s3_endpoint, cache_dir=cache_dir)


def inspect(checkpoint: str, *, s3_endpoint: str | None = None) -> ModelConfig:
    """The checkpoint's config after its headers are checked (no weights read); BadInput naming what is wrong."""
    if is_s3(checkpoint):
        return _s3(checkpoint, s3_endpoint).inspect()
    from kiln.host.weights.checkpoint import inspect_checkpoint
    return inspect_checkpoint(checkpoint)


def image_text(checkpoint: str, *, s3_endpoint: str | None = None) -> dict | None:
    """For an image-text checkpoint, {'left_out': what its export leaves out (the vision tower and projector),
    in the report's words; 'prefixes': where its text decoder's tensors are}
    (kiln.core.model.hf_config.multimodal.text_tensors); None for a text-only checkpoint."""
    if is_s3(checkpoint):
        return _s3(checkpoint, s3_endpoint).image_text()
    from kiln.host.weights.checkpoint import image_text as of_directory
    return of_directory(checkpoint)


def identity(checkpoint: str, *, s3_endpoint: str | None = None) -> dict | None:
    """What a manifest records of an S3 checkpoint (every object's name, size and ETag), known from a listing;
    None for a directory, whose identity (`directory_identity`) takes reading every file."""
    return _s3(checkpoint, s3_endpoint).identity() if is_s3(checkpoint) else None


def directory_identity(checkpoint: str, digests: Path | None) -> dict:
    """What a manifest records of a checkpoint directory: {'path', 'files': [{'name', 'size_bytes', 'sha256'}]}
    (kiln.host.weights.checkpoint.checkpoint_files; each file's digest remembered under `digests`)."""
    from kiln.host.weights.checkpoint import checkpoint_files
    return {"path": str(checkpoint), "files": checkpoint_files(checkpoint, digests)}


def changed_content(recorded: dict, now: dict) -> str | None:
    """The first difference between two identities of one checkpoint, in words (None: the same): an S3
    checkpoint's objects (name, size, ETag: `identity`) or a directory's files (name, size, sha256:
    `directory_identity`)."""
    field, label, shown = ("etag", "ETag", None) if "objects" in recorded else ("sha256", "sha256", 16)
    entries = "objects" if "objects" in recorded else "files"

    def described(identity: dict) -> dict[str, str]:
        return {o["name"]: f"{o['size_bytes']} bytes, {label} {o[field][:shown]}" for o in identity.get(entries, [])}

    was, is_ = described(recorded), described(now)
    for name in sorted(set(was) | set(is_)):
        if was.get(name) != is_.get(name):
            return f"{name} was {was.get(name, 'absent')}, now {is_.get(name, 'absent')}"
    return None


def fingerprint(checkpoint: str, *, s3_endpoint: str | None = None, digests: Path | None = None) -> str:
    """A short identity of the checkpoint's files (a directory's content: kiln.host.weights.checkpoint's, each file's
    digest remembered under `digests`; S3: names, sizes, ETags)."""
    if is_s3(checkpoint):
        objects = identity(checkpoint, s3_endpoint=s3_endpoint)["objects"]
        return hashlib.sha256(json.dumps(objects).encode()).hexdigest()[:16]
    from kiln.host.weights.checkpoint import checkpoint_fingerprint
    return checkpoint_fingerprint(checkpoint, digests)


def load_rank_weights(checkpoint: str, cfg: ModelConfig, tp: int, rank: int, *, s3_endpoint: str | None = None,
                      cache_dir: str | Path | None = None) -> dict:
    """One rank's package constants in `cfg.dtype` (kiln.host.weights.checkpoint.load_rank_weights' contract)."""
    if is_s3(checkpoint):
        return _s3(checkpoint, s3_endpoint, cache_dir).load_rank_weights(cfg, tp, rank)
    from kiln.host.weights.checkpoint import load_rank_weights as from_directory
    return from_directory(checkpoint, cfg, tp, rank)


def check_job_caches(job, probes: list) -> None:
    """kiln.host.machine.cache.check_probed_caches for `job` (kiln.core.plan.job.ExportJob): room for its forwards, and for
    its ranks' weights when its checkpoint is in S3 (a host's check keeps each rank's tensors in its cache,
    kiln.host.weights.s3_weight_cache)."""
    from kiln.host.machine.cache import check_probed_caches

    per_rank = -(-weight_bytes_per_rank(job.model_config, job.tp) // 2**20) if is_s3(job.checkpoint) else 0
    check_probed_caches(probes, job.recipe.artifact_mib_estimate, per_rank)
