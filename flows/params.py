"""The export's parameters: one pydantic model shared by the CLI, the flow and deployments.

Descriptions, defaults and bounds here are what the Prefect UI renders as the
run form. `prepare` turns them into an ExportJob and its hosts, checking every
input before any expensive work starts.
"""

from __future__ import annotations

import datetime as dt
import secrets
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kiln.core.errors import BadInput
from kiln.core.forwards.forward_keys import check_export_id
from kiln.core.machine.home import kiln_home
from kiln.core.model.config import BUNDLED_MODEL, DTYPE_BYTES
from kiln.core.plan.job import CHECKSUM_MODES, DEFAULT_TP, ExportJob, HostSpec, place_ranks
from kiln.core.trust.layout import manifest_key
from kiln.core.plan.recipe import SETTING, Recipe, form_overrides, recipe_form, recipe_of_form
from kiln.core.plan.settings import GROUPS, form_value, worded_text
from kiln.core.model.v4_fields import export_refusal
from kiln.host.machine.cache import cache_root, cache_status, check_caches

_NAME = r"^[A-Za-z0-9._-]*$"
_BLOCK = worded_text(_NAME, "a block name: letters, digits, '.', '_' or '-'; or empty")
_EXPORT_ID = Annotated[worded_text(_NAME, "an export name: letters, digits, '.', '_' or '-'; or empty"),
                       Field(max_length=200)]


class HostMemory(BaseModel):
    """One host's assumed available memory."""

    model_config = ConfigDict(extra="forbid", title="Host memory")

    host: str = Field(..., min_length=1, title="Host", description="The host's name (e.g. host-1).")
    mib: int = Field(..., ge=0, title="Available (MiB)", description="Memory to assume available, MiB.")


RecipeSettings = recipe_form()
"""The recipe's settings as the run form's typed fields (derived from kiln/core/plan/recipe.py)."""


# The Prefect UI renders ExportParams as the run form (its docstring is the
# form's introduction): bounds and patterns reject bad values before a run is
# created, since deployments enforce their parameter schema; `prepare` checks
# the rest (checkpoint, tp against the heads, the store) before any work.
# No field is nullable (the form would show a type switch): an empty text, 0
# hosts or the 'checkpoint' dtype means "not given". Fields are in form order:
# model and layout, store, then the recipe's settings by topic, then the rest. (Prefect 3.9's form has no
# sections: it titles a fieldset only for a nested object, and nesting the recipe's settings by topic would
# change the flow's parameters, which the CLI, deployments and blocks share.)
class ExportParams(BaseModel):
    """What to export and how. Every field has its default; leave a field empty to use it."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(BUNDLED_MODEL, min_length=1, title="Model",
                       description="'tiny' (a small bundled test model), the directory of a Hugging Face "
                                   "checkpoint on the hosts (config.json and safetensors files), or "
                                   "s3://BUCKET/PREFIX holding one (read in place at the S3 endpoint).")
    tp: int = Field(DEFAULT_TP, ge=1, le=1024, title="Tensor-parallel ranks",
                    description="How many ranks share the model, each holding a slice of every layer: from 1 "
                                "to 1024, at most the model's attention heads (DeepSeek-V4: output groups); "
                                "where it does not divide them, ranks hold near-equal shares, a package per "
                                "distinct share (the run fails at once naming the values that work).")
    dtype: Literal[("checkpoint", *DTYPE_BYTES)] = Field(
        "checkpoint", title="Number format",
        description="The number format to compile and run in: 'checkpoint' keeps the one the checkpoint was "
                    "saved in.")
    hosts: int = Field(0, ge=0, le=64, title="Local test hosts",
                       description="0: the export runs on this machine alone. A number, at most 64: that many "
                                   "local worker processes stand for hosts host-0, host-1, ... (for trying "
                                   "several hosts on one machine); not with a Dask scheduler address.")
    dask: str = Field("", title="Dask scheduler address",
                      description="Empty: no cluster. An address (tcp://HOST:8786): the hosts are that Dask "
                                  "scheduler's workers.")
    store: str = Field("", title="Store",
                       description="Where compiled forwards and the manifest are kept: file://DIR or "
                                   "s3://BUCKET/PREFIX. Empty: the 'store' folder under the Kiln home.")
    s3_endpoint: str = Field("", title="S3 endpoint",
                             description="The S3 server's URL (e.g. http://127.0.0.1:9000). Empty: the "
                                         "serving machine's AWS_ENDPOINT_URL, or AWS itself.")
    s3_checksum: Literal[CHECKSUM_MODES] = Field(
        CHECKSUM_MODES[0], title="S3 checksums",
        description="When uploads send a checksum; some S3-compatible servers refuse 'when_supported'.")
    store_block: _BLOCK = Field(
        "", title="Store block",
        description="Name of a saved 'Kiln Store' block; it replaces Store, S3 endpoint and S3 checksums. "
                    "Empty: no block.")
    sign: bool = Field(True, title="Sign the manifest",
                       description="Sign the manifest so that consumers can check who made it. Off only on "
                                   "purpose: checking it then needs an explicit 'allow unsigned'.")
    signing_key_block: _BLOCK = Field(
        "", title="Signing key block",
        description="Name of a Prefect Secret block holding the signing key. Empty: the serving machine's "
                    "KILN_SIGNING_KEY, or the local development key for a local store.")
    recipe: RecipeSettings = Field(
        default_factory=RecipeSettings, title="Recipe",
        description="Every choice of the export, with its default, listed by topic in this order: "
                    + ", ".join(GROUPS.values()).lower() + ". With a recipe block, the settings changed here "
                    "override the block's.")
    recipe_block: _BLOCK = Field(
        "", title="Recipe block",
        description="Name of a saved 'Kiln Recipe' block to start from; the Recipe settings changed here "
                    "override it. Empty: no block.")
    assume_available: list[HostMemory] = Field(
        default_factory=list, title="Assume available memory",
        description="For a host, the available memory (MiB) to plan with instead of what the host reports "
                    "(for trying what a smaller host would do).")
    export_id: _EXPORT_ID = Field(
        "", title="Export name",
        description="The export's name in the store. Empty: the model, ranks and start time, e.g. "
                    "tiny-tp2-20260101T120000-ab12.")
    report: str = Field("", title="Report file",
                        description="Path of a JSON report to write on the serving machine, also on "
                                    "failure. Empty: none.")

    @field_validator("assume_available", mode="before")
    @classmethod
    def _pairs(cls, value):
        """Also {host: MiB} (the CLI's --assume-available HOST=MIB items, collected)."""
        return [{"host": h, "mib": m} for h, m in value.items()] if isinstance(value, dict) else value

    def assumed(self) -> dict[str, int]:
        """{host: MiB} of `assume_available`."""
        return {a.host: a.mib for a in self.assume_available}

    def flow_parameters(self) -> dict:
        """These values as the export flow's (top-level) parameters."""
        return {name: getattr(self, name) for name in type(self).model_fields}


def parse_assume_available(items: list[str]) -> dict[str, int]:
    """`--assume-available HOST=MIB` items as {host: MiB}; BadInput on anything else."""
    out = {}
    for item in items:
        host, sep, mib = item.partition("=")
        if not sep or not host or not mib.strip().isdigit():
            raise BadInput(f"--assume-available {item!r}: expected HOST=MIB, e.g. host-1=12038.")
        out[host] = int(mib)
    return out


def model_name(params: ExportParams) -> str:
    """The model's short name: 'tiny', the checkpoint directory's name or the S3 prefix's last part."""
    if params.model.startswith("s3://"):
        return params.model.rstrip("/").rsplit("/", 1)[-1]
    return BUNDLED_MODEL if params.model == BUNDLED_MODEL else Path(params.model).expanduser().resolve().name


def export_params(*, recipe: dict | None = None, **fields) -> ExportParams:
    """ExportParams from typed values (the CLI's): `recipe` {setting: value}, the rest ExportParams' fields.
    A value out of its bounds is BadInput naming the flag and what it takes."""
    form = {k: form_value(SETTING[k], v) for k, v in (recipe or {}).items()}
    fields = {k: v for k, v in fields.items() if v is not None}  # not given: the field's default
    try:
        return ExportParams(recipe=form, **fields)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][-1] if err["loc"] and err["loc"][0] == "recipe" else err["loc"][0]) \
                if err["loc"] else "parameters"
            field = ExportParams.model_fields.get(name)
            value = fields.get(name, err.get("input"))
            hint = f" ({field.description})" if field and field.description else ""
            problems.append(f"--{name.replace('_', '-')} {value!r}: {err['msg'].lower()}{hint}")
        raise BadInput("; ".join(problems) + ".") from None


def default_export_id(params: ExportParams, when: dt.datetime | None = None, salt: str | None = None) -> str:
    """`<model>-tp<tp>-<UTC time>-<salt>`; salt defaults to 4 random hex digits."""
    when = when or dt.datetime.now(dt.timezone.utc)
    return f"{model_name(params)}-tp{params.tp}-{when.astimezone(dt.timezone.utc):%Y%m%dT%H%M%S}-{salt or secrets.token_hex(2)}"


def build_recipe(params: ExportParams) -> Recipe:
    """The try's recipe: the recipe block's (or the defaults), then the settings that override it
    (kiln.core.plan.recipe.form_overrides)."""
    base = Recipe()
    if params.recipe_block:
        from blocks.kiln_blocks import load_recipe_block
        base = load_recipe_block(params.recipe_block).recipe()
    return recipe_of_form(form_overrides(params.recipe), base)


def default_host_names(params: ExportParams) -> list[str] | None:
    """Host names known before any cluster starts: host-0.. for --hosts N, this machine alone, or None for --dask."""
    if params.dask:
        return None
    if params.hosts:
        return [f"host-{i}" for i in range(params.hosts)]
    return [socket.gethostname() or "local"]


def prepare(params: ExportParams, *, host_names: list[str] | None = None, check_store: bool = True,
            signing: bool = True, recipe: Recipe | None = None) -> tuple[ExportJob, list[HostSpec]]:
    """Validate every input and build the job; raises BadInput before anything is written to the store.

    A blip while it reads an S3 checkpoint or checks the store is not bad input: each request is retried
    by botocore (kiln.store.s3_client.REQUEST_RETRIES), and what outlasts that is StoreError(transient=True).

    `host_names` None means the hosts are not known yet (a Dask cluster not yet
    asked): host checks are skipped and no hosts are returned. Hosts on this
    machine (not --dask) get their cache directory checked for writes here.
    `signing` False makes no signing key (`kiln plan` signs nothing): the job then carries the plan an export
    would make, if it exists already, only for what it trusts (kiln.host.trust.signers.preview_signing).
    `recipe`: the try's recipe when the caller built it already (it is built once per try).
    """
    if params.hosts and params.dask:
        raise BadInput("--hosts starts a local cluster and --dask names an existing one; give one of them.")
    from kiln.host.weights import rank_weights as weights
    from kiln.host.weights.checkpoint import tiny_checkpoint
    from kiln.store import open_store, validate_key

    recipe = recipe or build_recipe(params)
    home = kiln_home()
    name = model_name(params)
    if params.model == BUNDLED_MODEL:
        checkpoint = str(tiny_checkpoint(home))
    elif weights.is_s3(params.model):
        checkpoint = params.model.rstrip("/")  # read where it is: each host reads its ranks' slices
    else:
        checkpoint = str(Path(params.model).expanduser().resolve())
    cfg = weights.inspect(checkpoint, s3_endpoint=params.s3_endpoint or None)
    if params.dtype != "checkpoint":
        cfg = cfg.replace(dtype=params.dtype)
    cfg.check_tp(params.tp)
    if cfg.v4 is not None and export_refusal(recipe):  # its slot cache: static shapes, no padded steps
        raise BadInput(export_refusal(recipe))
    names = host_names or []
    unknown = sorted(set(params.assumed()) - set(names))
    if unknown and host_names is not None:
        raise BadInput(f"--assume-available names unknown host(s) {', '.join(unknown)}; hosts are: {', '.join(names)}.")
    for host, mib in params.assumed().items():
        if mib < 0:
            raise BadInput(f"--assume-available {host}={mib}: memory must be >= 0 MiB.")
    if params.store_block:
        if params.store or params.s3_endpoint:
            raise BadInput("--store-block names the store; drop --store and --s3-endpoint, or the block.")
        from blocks.kiln_blocks import load_store_block
        store = load_store_block(params.store_block).open()
    else:
        store = open_store(params.store or f"file://{home / 'store'}", s3_endpoint=params.s3_endpoint or None,
                           checksum_mode=params.s3_checksum)
    if check_store:
        store.check()
    export_id = params.export_id or default_export_id(params)
    check_export_id(export_id)
    validate_key(manifest_key(export_id))
    ranks = place_ranks(params.tp, names) if names else {}
    hosts = [HostSpec(n, ranks[n]) for n in names]
    if not params.dask:  # these hosts are this machine: their caches can be checked now
        check_caches({h.name: cache_status(cache_root(h.name, h.cache_dir)) for h in hosts}, {})
    if signing:
        from kiln.host.trust.signers import check_export_id_free, plan_signing
        check_export_id_free(store, export_id)
        plan, _ = plan_signing(sign=params.sign, block=params.signing_key_block or None, store=store, home=home)
    else:
        from kiln.host.trust.signers import preview_signing
        plan = preview_signing(sign=params.sign, block=params.signing_key_block or None, store=store, home=home)
    job = ExportJob(export_id=export_id, model_name=name, checkpoint=checkpoint,
                    checkpoint_identity=weights.identity(checkpoint, s3_endpoint=params.s3_endpoint or None),
                    config=cfg.to_dict(), tp=params.tp, recipe=recipe, store_url=store.url,
                    s3_endpoint=params.s3_endpoint or None, checksum_mode=params.s3_checksum,
                    store_block=params.store_block or None, assume_available=params.assumed(),
                    signing=plan, image_text=weights.image_text(checkpoint, s3_endpoint=params.s3_endpoint or None))
    return job, hosts

