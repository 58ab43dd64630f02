"""Prefect blocks: where an export stores its artifacts, and the recipe it follows.

Purpose: a deployment is configured from the Prefect UI by naming blocks
(`store_block`, `recipe_block` parameters) instead of pasting URLs and secrets.
Contracts: `KilnStore.open()` returns the same Store as `--store`; credentials
come from prefect-aws's AwsCredentials or MinIOCredentials blocks and stay
SecretStr (masked in the UI, never in logs or reports). `KilnRecipe`'s fields are
the recipe's settings (derived, never restated); `.recipe()` returns a validated Recipe. Register with `prefect block register -m blocks.kiln_blocks`.
"""

from __future__ import annotations

from typing import Literal

from prefect.blocks.core import Block
from prefect_aws import AwsCredentials, MinIOCredentials
from pydantic import Field

from kiln.core.errors import BadInput
from kiln.core.plan.job import CHECKSUM_MODES
from kiln.core.plan.recipe import Recipe, recipe_form, recipe_of_form


class KilnStore(Block):
    """Content-addressed store of compiled forwards, tuning results and manifests."""

    _block_type_name = "Kiln Store"
    _description = "Where Kiln exports keep their artifacts: a local directory or an S3 bucket and prefix."

    url: str = Field(..., description="file://DIR or s3://BUCKET/PREFIX")
    endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, Ceph, ...); empty for AWS itself.")
    checksum_mode: Literal[CHECKSUM_MODES] = Field(
        CHECKSUM_MODES[0], description="boto3 request/response checksums; some S3-compatible servers reject them.")
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


_SETTINGS = recipe_form()


class KilnRecipe(Block):
    """The per-cluster choices of an export: every recipe setting, typed, with its default (docs/recipe.md)."""

    _block_type_name = "Kiln Recipe"
    _description = "Buckets, memory constants, gate policy, tuning mode and retries of Kiln exports."

    # The fields are the recipe's settings as declared in kiln/core/plan/recipe.py: nothing is restated here.
    __annotations__ = {name: field.annotation for name, field in _SETTINGS.model_fields.items()}
    locals().update(_SETTINGS.model_fields)

    def recipe(self) -> Recipe:
        """The validated Recipe: the defaults with this block's settings applied."""
        return recipe_of_form(self.model_dump(include=set(_SETTINGS.model_fields)))


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
