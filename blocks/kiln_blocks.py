"""Prefect blocks: where an export stores its artifacts, and the recipe it follows.

Purpose: a deployment is configured from the Prefect UI by naming blocks
(`store_block`, `recipe_block` parameters) instead of pasting URLs and secrets.
Contracts: `KilnStore.open()` returns the same Store as `--store`; credentials
come from prefect-aws's AwsCredentials or MinIOCredentials blocks and stay
SecretStr (masked in the UI, never in logs or reports). `KilnRecipe.recipe()`
returns a validated Recipe. Register with `prefect block register -m blocks.kiln_blocks`.
"""

from __future__ import annotations

from typing import Literal

from prefect.blocks.core import Block
from prefect_aws import AwsCredentials, MinIOCredentials
from pydantic import Field

from kiln.errors import BadInput
from kiln.recipe import Recipe


class KilnStore(Block):
    """Content-addressed store of compiled forwards, tuning results and manifests."""

    _block_type_name = "Kiln Store"
    _description = "Where Kiln exports keep their artifacts: a local directory or an S3 bucket and prefix."

    url: str = Field(..., description="file://DIR or s3://BUCKET/PREFIX")
    endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, Ceph, ...); empty for AWS itself.")
    checksum_mode: Literal["when_required", "when_supported"] = Field(
        "when_required", description="boto3 request/response checksums; some S3-compatible servers reject them.")
    credentials: AwsCredentials | MinIOCredentials | None = Field(
        None, description="Credentials; empty: the standard AWS chain of each host.")

    def credentials_dict(self) -> dict:
        c = self.credentials
        if isinstance(c, MinIOCredentials):
            return {"access_key": c.minio_root_user, "secret_key": c.minio_root_password.get_secret_value(),
                    "region": c.region_name}
        if isinstance(c, AwsCredentials):
            out = {"access_key": c.aws_access_key_id, "region": c.region_name,
                   "secret_key": c.aws_secret_access_key.get_secret_value() if c.aws_secret_access_key else None,
                   "session_token": c.aws_session_token.get_secret_value() if c.aws_session_token else None}
            return {k: v for k, v in out.items() if v}
        return {}

    def open(self):
        from kiln.store import open_store
        return open_store(self.url, s3_endpoint=self.endpoint_url, checksum_mode=self.checksum_mode,
                          credentials=self.credentials_dict())


_DEFAULT = Recipe()


class KilnRecipe(Block):
    """The per-cluster choices of an export; see kiln/recipe.py for each setting's meaning."""

    _block_type_name = "Kiln Recipe"
    _description = "Buckets, memory constants, gate policy and tuning mode of Kiln exports."

    buckets: str = Field(",".join(str(b) for b in _DEFAULT.buckets), description="BATCHxTOKENS,...")
    headroom_floor_mib: int = Field(_DEFAULT.headroom_floor_mib, gt=0)
    recipe_headroom_mib: int = Field(_DEFAULT.recipe_headroom_mib, gt=0)
    worker_host_mib: int | None = Field(None, gt=0, description="Empty: the measured peak when known, else the estimate.")
    worker_device_mib: int = Field(_DEFAULT.worker_device_mib, ge=0)
    activation_reserve_mib: int = Field(_DEFAULT.activation_reserve_mib, ge=0)
    unified_memory: bool | None = Field(None, description="Empty: as probed on each host.")
    page_tokens: int = Field(_DEFAULT.page_tokens, gt=0)
    max_context_tokens: int = Field(_DEFAULT.max_context_tokens, gt=0)
    policy: Literal["borrow", "fail"] = _DEFAULT.policy
    tuning: Literal["off", "cached", "full"] = _DEFAULT.tuning
    retry_refusals: bool = Field(_DEFAULT.retry_refusals,
                                 description="Retry a gate refusal (flow_retries times) to wait for memory; "
                                             "off: a refusal is final.")
    settings: dict[str, str] = Field(default_factory=dict, description="Any other recipe setting, NAME: VALUE.")

    def recipe(self) -> Recipe:
        fields = self.model_dump(exclude={"settings", "block_type_slug"})
        items = [f"{k}={'auto' if v is None else v}" for k, v in fields.items() if k in Recipe.__dataclass_fields__]
        return Recipe().with_overrides(items + [f"{k}={v}" for k, v in self.settings.items()])


def _load(cls, name: str):
    try:
        return cls.load(name)
    except ValueError as exc:  # Prefect raises ValueError for a block document it cannot find
        raise BadInput(f"no {cls._block_type_name} block named {name!r} on the Prefect server "
                       f"({exc}); create it in the UI or with {cls.__name__}(...).save({name!r}).") from None


def load_store_block(name: str) -> KilnStore:
    return _load(KilnStore, name)


def load_recipe_block(name: str) -> KilnRecipe:
    return _load(KilnRecipe, name)
