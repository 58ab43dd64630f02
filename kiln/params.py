"""The export's parameters: one pydantic model shared by the CLI, the flow and deployments.

Descriptions, defaults and bounds here are what the Prefect UI renders as the
run form. `prepare` turns them into an ExportJob and its hosts, checking every
input before any expensive work starts.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from kiln.cache import cache_root, cache_status, check_caches
from kiln.errors import BadInput
from kiln.job import ExportJob, HostSpec, place_ranks
from kiln.keys import check_export_id, manifest_key
from kiln.recipe import Recipe, parse_buckets


def kiln_home() -> Path:
    """Where Kiln keeps its default store, model cache and host caches (KILN_HOME, default ./.kiln)."""
    return Path(os.environ.get("KILN_HOME", ".kiln")).resolve()


class ExportParams(BaseModel):
    model: str = Field("tiny", description="'tiny' (the bundled model) or a Hugging Face-layout checkpoint directory.")
    tp: int = Field(2, ge=1, le=1024, description="Tensor-parallel degree: ranks that share the model.")
    buckets: str | None = Field(None, description="BATCHxTOKENS,... (default: the recipe's buckets).")
    store: str | None = Field(None, description="file://DIR or s3://BUCKET/PREFIX (default: KILN_HOME/store).")
    s3_endpoint: str | None = Field(None, description="S3 endpoint URL (default: AWS_ENDPOINT_URL).")
    s3_checksum: Literal["when_required", "when_supported"] = Field(
        "when_required", description="boto3 checksum mode; some S3-compatible servers reject 'when_supported'.")
    store_block: str | None = Field(None, description="Name of a 'Kiln Store' block (replaces store, s3_endpoint, s3_checksum).")
    recipe_block: str | None = Field(None, description="Name of a 'Kiln Recipe' block; settings and flags override it.")
    policy: Literal["borrow", "fail"] | None = Field(None, description="Gate policy when a host can run no compile worker.")
    tuning: Literal["off", "cached", "full"] | None = Field(None, description="Kernel tuning mode.")
    settings: list[str] = Field(default_factory=list, description="Recipe overrides, NAME=VALUE each.")
    assume_available: dict[str, int] = Field(default_factory=dict, description="host -> MiB to assume available.")
    hosts: int | None = Field(None, ge=1, le=64, description="Start a local Dask cluster of this many worker processes standing for hosts host-0..host-N-1.")
    dask: str | None = Field(None, description="Address of a Dask scheduler whose workers are the hosts (each started with --resources kiln-host-NAME=1).")
    sign: bool = Field(True, description="Sign the manifest (Ed25519). False only on purpose: `kiln verify` then needs --allow-unsigned.")
    signing_key_block: str | None = Field(None, description="Name of a Prefect Secret block holding the Ed25519 signing key (default: KILN_SIGNING_KEY, or the local development key for a local store).")
    export_id: str | None = Field(None, description="Name of the export (default: model, tp and time).")
    report: str | None = Field(None, description="Path of the JSON report to write, also on failure.")


def build_recipe(params: ExportParams) -> Recipe:
    base = Recipe()
    if params.recipe_block:
        from blocks.kiln_blocks import load_recipe_block
        base = load_recipe_block(params.recipe_block).recipe()
    recipe = base.with_overrides(params.settings)
    extra = []
    if params.buckets is not None:
        extra.append(f"buckets={params.buckets}")
        parse_buckets(params.buckets)
    if params.policy is not None:
        extra.append(f"policy={params.policy}")
    if params.tuning is not None:
        extra.append(f"tuning={params.tuning}")
    return recipe.with_overrides(extra)


def default_host_names(params: ExportParams) -> list[str] | None:
    """Host names known before any cluster starts: host-0.. for --hosts N, this machine alone, or None for --dask."""
    if params.dask:
        return None
    if params.hosts:
        return [f"host-{i}" for i in range(params.hosts)]
    return [socket.gethostname() or "local"]


def prepare(params: ExportParams, *, host_names: list[str] | None = None, check_store: bool = True,
            signing: bool = True) -> tuple[ExportJob, list[HostSpec]]:
    """Validate every input and build the job; raises BadInput before anything is written to the store.

    `host_names` None means the hosts are not known yet (a Dask cluster not yet
    asked): host checks are skipped and no hosts are returned. Hosts on this
    machine (not --dask) get their cache directory checked for writes here.
    `signing` False leaves the signing key undecided (`kiln plan` signs nothing).
    """
    if params.hosts and params.dask:
        raise BadInput("--hosts starts a local cluster and --dask names an existing one; give one of them.")
    from kiln.checkpoint import inspect_checkpoint, tiny_checkpoint
    from kiln.store import open_store, validate_key

    recipe = build_recipe(params)
    home = kiln_home()
    if params.model == "tiny":
        checkpoint, name = tiny_checkpoint(home), "tiny"
    else:
        checkpoint = Path(params.model).expanduser().resolve()
        name = checkpoint.name
    cfg = inspect_checkpoint(checkpoint)
    cfg.check_tp(params.tp)
    names = host_names or []
    unknown = sorted(set(params.assume_available) - set(names))
    if unknown and host_names is not None:
        raise BadInput(f"--assume-available names unknown host(s) {', '.join(unknown)}; hosts are: {', '.join(names)}.")
    for host, mib in params.assume_available.items():
        if mib < 0:
            raise BadInput(f"--assume-available {host}={mib}: memory must be >= 0 MiB.")
    if params.store_block:
        if params.store or params.s3_endpoint:
            raise BadInput("--store-block names the store; drop --store and --s3-endpoint, or the block.")
        from blocks.kiln_blocks import load_store_block
        store = load_store_block(params.store_block).open()
    else:
        store = open_store(params.store or f"file://{home / 'store'}", s3_endpoint=params.s3_endpoint,
                           checksum_mode=params.s3_checksum)
    if check_store:
        store.check()
    export_id = params.export_id or (
        f"{name}-tp{params.tp}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{secrets.token_hex(2)}")
    check_export_id(export_id)
    validate_key(manifest_key(export_id))
    ranks = place_ranks(params.tp, names) if names else {}
    hosts = [HostSpec(n, ranks[n]) for n in names]
    if not params.dask:  # these hosts are this machine: their caches can be checked now
        check_caches({h.name: cache_status(cache_root(h.name, h.cache_dir)) for h in hosts}, {})
    plan = None
    if signing:
        from kiln.trust import plan_signing
        plan, _ = plan_signing(sign=params.sign, block=params.signing_key_block, store=store, home=home)
    job = ExportJob(export_id=export_id, model_name=name, checkpoint=str(checkpoint),
                    config=cfg.__dict__.copy(), tp=params.tp, recipe=recipe, store_url=store.url,
                    s3_endpoint=params.s3_endpoint, checksum_mode=params.s3_checksum,
                    store_block=params.store_block, assume_available=dict(params.assume_available),
                    signing=plan)
    return job, hosts
