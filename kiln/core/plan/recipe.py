"""The recipe: every per-cluster, per-run choice of an export, typed, documented and validated once.

Pure: no torch, prefect or boto3 import. Each field of `Recipe` is a setting,
declared once with `setting(...)`: its type (`Literal` for a list of choices),
default, unit, bounds and a docstring. Everything else is derived from these
declarations by `kiln.core.plan.settings`: the CLI's flags, the deployment's form
fields, the `Kiln Recipe` block and `docs/recipe.md`. Overrides are typed
replacements (`Recipe.replace`); text (`--set NAME=VALUE`) is parsed only at
the edge, by the setting it names.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

from kiln.core.errors import BadInput
from kiln.core.plan.settings import Setting, form_model, form_value, from_form, parse_assignments, setting, settings_of
from kiln.core.forwards.shape_ranges import (BUCKET_PATTERN, SHAPES_PATTERN, Bucket, ShapeRange, group_buckets, parse_buckets,
                                    parse_shape_ranges, show_shape_ranges)
from kiln.core.machine.target import Device

Policy = Literal["borrow", "fail"]
ShapePolicy = Literal["ranges", "static"]
TuningMode = Literal["off", "cached", "full"]
POLICIES: tuple[str, ...] = typing.get_args(Policy)
TUNING_MODES: tuple[str, ...] = typing.get_args(TuningMode)


DEFAULT_BUCKETS = (Bucket(1, 16), Bucket(2, 16), Bucket(4, 32), Bucket(8, 64))


@dataclass(frozen=True)
class Recipe:
    """Choices of one export. Memory is MiB, time seconds; docs/recipe.md lists every setting."""

    buckets: tuple[Bucket, ...] = setting(
        DEFAULT_BUCKETS, "Shape classes the server runs: BATCHxTOKENS (sequences x new tokens). Each is served "
        "by a forward whose range holds it; forward_shapes and shape_policy say which forwards are compiled.",
        parse=lambda text: parse_buckets(text), show=lambda buckets: ",".join(map(str, buckets)),
        pattern=BUCKET_PATTERN, example="1x16,4x64", title="Buckets", group="layout")
    shape_policy: ShapePolicy = setting(
        "ranges", "How the buckets no entry of forward_shapes holds become forwards: ranges (the 1-token buckets "
        "one decode forward over their batches, the rest one prefill forward over their batches and tokens, with "
        "batch 1 apart in each since a range cannot start at 1: at most four forwards, each compiled for its "
        "largest shape) or static (one forward per bucket, compiled for its shape alone).",
        title="Forwards from buckets", group="layout")
    forward_shapes: tuple[ShapeRange, ...] | None = setting(
        None, "Forwards given directly, each a static shape BxT or a range B0-B1xT0-T1, optionally @BxT: the "
        "shape it is compiled for (default: its largest). Each must hold a bucket; a static one keeps that "
        "bucket on a forward of its own where that measurably runs faster.",
        null="none: shape_policy makes every forward", parse=parse_shape_ranges, show=show_shape_ranges,
        pattern=SHAPES_PATTERN, example="1x1,2-64x1@32x1", title="Forward shapes", group="layout")
    policy: Policy = setting(
        "borrow", "What the gate does when a host can run no compile worker: lend its forwards to a host that "
        "can (borrow) or refuse the export (fail).", compiling_only=True,
        title="When a host cannot compile", group="memory")
    device: Device = setting(
        "auto", "Where the forwards run: cpu (any host; a GPU host's CPU too), cuda (compiled on and for each "
        "rank host's GPU; refused by name where a rank's host has none), or auto (cuda where every rank's host "
        "has a GPU, else cpu).", title="Device", group="compile")
    tuning: TuningMode = setting(
        "cached", "How the GEMM kernels are tuned: off (not at all); cached measures only the shapes the store "
        "lacks; full measures all again and replaces them. CPU forwards have nothing to tune.", title="Kernel tuning", group="compile")
    headroom_floor_mib: int = setting(
        2048, "Memory a host keeps free whatever else runs; compile workers start only above it.", unit="MiB", gt=0,
        title="Headroom floor (MiB)", group="memory")
    recipe_headroom_mib: int = setting(
        1024, "Memory the recipe's own preparation needs; the larger of this and headroom_floor_mib applies.",
        unit="MiB", gt=0, title="Preparation headroom (MiB)", group="memory")
    worker_host_mib: int | None = setting(
        None, "Host memory one compile worker takes at its peak, its compiler children included. A number "
        "always wins.", unit="MiB", gt=0,
        null="the peak measured for this graph and target (kept in the store) times worker_mib_margin, or "
             "worker_host_estimate_mib before anything was measured", compiling_only=True,
        title="Memory per compile worker (MiB)", group="memory")
    worker_host_estimate_mib: int = setting(
        1024, "The per-worker figure used before any compile of this graph on this target was measured.",
        unit="MiB", gt=0, compiling_only=True, title="Memory per compile worker before measuring (MiB)",
        group="memory")
    worker_mib_margin: float = setting(
        1.15, "Factor over the largest measured worker peak (the next forwards may be a little larger).", ge=1,
        compiling_only=True, title="Margin over the measured worker peak", group="memory")
    max_compile_workers: int = setting(
        0, "Most compile workers a host starts (0: as many as memory and CPUs allow).", ge=0, compiling_only=True,
        title="Most compile workers per host", group="compile")
    process_base_mib: int = setting(
        512, "Memory of a process that has imported torch and loaded compiled forwards, before any weights "
        "(used to predict the checks' memory).", unit="MiB", gt=0, title="Memory of a bare process (MiB)",
        group="checks")
    worker_device_mib: int = setting(
        2048, "Device memory one compile worker of a CUDA export takes (its CUDA context and what it makes real "
        "on the device): from the device's free memory on a discrete GPU, from the host's pool on unified memory "
        "(GB10). CPU exports reserve none.", unit="MiB", ge=0, compiling_only=True,
        title="Device memory per compile worker (MiB)", group="memory")
    activation_reserve_mib: int = setting(
        256, "Memory each rank keeps for activations when serving; not given to the KV cache.", unit="MiB", ge=0,
        title="Activation reserve per rank (MiB)", group="layout")
    unified_memory: bool | None = setting(
        None, "Whether device memory is the host's own pool (GB10, CPU-only hosts).", null="as probed on each host",
        title="Unified memory", group="memory")
    page_tokens: int = setting(16, "Tokens per KV-cache page.", unit="tokens", gt=0, title="Tokens per KV page",
                              group="layout")
    max_context_tokens: int = setting(
        256, "Longest context a sequence can attend to; pages per sequence = this / page_tokens.", unit="tokens",
        gt=0, title="Longest context (tokens)", group="layout")
    kv_max_pages: int = setting(4096, "Upper bound on KV pages per rank, whatever the memory would allow.",
                                unit="pages", gt=0, title="Most KV pages per rank", group="layout")
    compile_s_estimate: float = setting(
        30.0, "Predicted seconds to compile one static forward before any compile of its graph was measured on "
              "its target (one over a range of shapes: 1.2 times this); measured compiles replace it.", unit="s",
        gt=0, compiling_only=True, title="Compile time estimate per forward (s)", group="compile")
    max_compile_attempts: int = setting(2, "Times one forward is tried when its compile worker dies; after that "
                                        "the export fails (a flow retry does not compile it again).", gt=0,
                                        compiling_only=True, title="Tries per forward", group="compile")
    deadline_margin: float = setting(
        4.0, "Factor over what the plan predicts for a step that the step's deadline allows: a forward's "
        "compile (its measured seconds, else compile_s_estimate), the compile phase (its hosts' forwards over "
        "their workers), a rank check (its forwards and shard), a tuning run (its GEMM shapes). A step past "
        "its deadline is stopped, its leases released, and the export fails naming it; not retried.", ge=1,
        title="Deadline margin", group="advanced")
    deadline_floor_s: float = setting(
        1800.0, "The shortest deadline of any step, whatever its prediction (a graph's first compile has only "
        "the estimate to go by).", unit="s", gt=0, title="Shortest deadline (s)", group="advanced")
    verify_atol: float = setting(
        1e-3, "Largest difference allowed between a compiled forward and eager, as max |compiled - eager| / "
        "max(1, max |eager|) (absolute for outputs up to 1, relative above).", gt=0,
        title="Largest difference from eager", group="checks")
    verify_half_ratio: float = setting(
        2.0, "bfloat16 / float16 forwards: compared with eager in float32 on the same weights, forced to the "
        "forward's own expert and indexer choices (each of which must be within (1 + this) x its scores' "
        "rounding of the best: models.md, 'The check of a forward that makes choices'), they may be off by this "
        "many times eager's own error in their dtype against float32 forced to eager's choices (and always by "
        "verify_atol).", gt=0,
        title="Half-precision error ratio", group="checks")
    lease_ttl_s: float = setting(
        900.0, "Seconds a compile lease protects a key from other exports without a renewal (its holder "
        "renews it every third of that while the key compiles); a lease past expiry, or whose process on "
        "this host died, is taken over.",
        unit="s", gt=0, compiling_only=True, title="Compile lease lifetime (s)", group="compile")
    lease_wait_s: float = setting(
        10800.0, "Seconds an export waits for forwards another export is compiling (holds the leases of) while "
        "none of them gets stored; then it fails naming them and their holder.",
        unit="s", ge=60, compiling_only=True, title="Wait for another export's compiles (s)", group="compile")
    flow_retries: int = setting(
        2, "Times a failed export is tried again, with a fresh probe; only failures that can heal and that no "
        "lower level retried already are retried (docs/operations.md), never bad input, gate refusals (unless "
        "retry_refusals), integrity or verification failures, crashes or bugs.", ge=0, le=10,
        title="Retries of a failed export", group="advanced")
    flow_retry_delay_s: float = setting(30.0, "Seconds between a failed try of the export and the next one.",
                                        unit="s", ge=0, le=86400, title="Delay between retries (s)",
                                        group="advanced")
    retry_refusals: bool = setting(
        False, "Whether a gate refusal counts as a failure that flow_retries try again, flow_retry_delay_s "
        "apart, with a fresh probe each time: for a deployment that waits for memory to be freed. Off: a refusal "
        "is final.", title="Retry refusals", group="advanced")
    model_lease_s: float = setting(
        120.0, "Seconds an export that died without a word (killed) keeps its model's slot (one export per "
        "model at a time) before the Prefect server frees it; a running export renews it every three quarters "
        "of that. A waiting export takes a dead holder's slot over at once when it can tell the holder is gone "
        "(docs/operations.md). At least 60 (Prefect's shortest lease).", unit="s", ge=60, le=3600, title="Model lease lifetime (s)", group="advanced")
    artifact_link_s: float = setting(
        43200.0, "Seconds the presigned URLs of an S3 store's objects (the manifest, the memory picture) in the "
        "run's Prefect artifacts stay valid; anyone who can read the Prefect UI can open them until then. A "
        "local store's links are paths and never expire.",
        unit="s", ge=60, le=7 * 86400, title="Artifact link lifetime (s)", group="store")
    artifact_mib_estimate: int = setting(
        16, "Disk one compiled forward takes in a host's cache; a host needs this times the forwards it lacks "
        "free.", unit="MiB", ge=0, title="Disk per forward (MiB)", group="store")

    def __post_init__(self) -> None:
        for s in SETTINGS:
            s.check(getattr(self, s.name))
        self.shapes  # forward_shapes that hold no bucket are bad input, refused here by name
        if self.max_context_tokens % self.page_tokens:
            raise BadInput(f"max_context_tokens ({self.max_context_tokens}) must be a multiple of "
                           f"page_tokens ({self.page_tokens}).")

    def replace(self, **changes) -> "Recipe":
        """This recipe with typed replacements; an unknown name is BadInput naming the known ones."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise BadInput(f"unknown recipe setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}.")
        return dataclasses.replace(self, **changes)

    def changed(self) -> dict:
        """{name: value} of every setting that differs from its default."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    @property
    def shapes(self) -> tuple[ShapeRange, ...]:
        """The forwards this recipe compiles: forward_shapes, then the buckets they leave grouped by
        shape_policy (kiln.core.forwards.shape_ranges.group_buckets)."""
        return group_buckets(self.buckets, self.shape_policy, self.forward_shapes)

    @property
    def pages_per_seq(self) -> int:
        return self.max_context_tokens // self.page_tokens

    def worker_mib(self, unified: bool, measured_host_mib: int | None = None, *, cuda: bool) -> int:
        """Host memory one compile worker takes: its host figure, plus its device memory where that is the
        host's pool (a CUDA export on unified memory). A CPU export's worker touches no device.

        `measured_host_mib` (a worker's measured peak, margin included) applies unless
        worker_host_mib is set.
        """
        return self.worker_host_source(measured_host_mib)[0] + (self.worker_device_mib if cuda and unified else 0)

    def worker_host_source(self, measured_host_mib: int | None) -> tuple[int, str]:
        """(host MiB of one worker, where it comes from: 'recipe', 'measured' or 'estimate')."""
        if self.worker_host_mib is not None:
            return self.worker_host_mib, "recipe"
        if measured_host_mib is not None:
            return measured_host_mib, "measured"
        return self.worker_host_estimate_mib, "estimate"

    def floor_mib(self) -> int:
        return max(self.headroom_floor_mib, self.recipe_headroom_mib)

    def to_dict(self) -> dict:
        """JSON-ready: buckets as `BxT` strings; `from_dict` reads it back."""
        out = dataclasses.asdict(self)
        out["buckets"] = [str(b) for b in self.buckets]
        out["forward_shapes"] = None if self.forward_shapes is None else [str(r) for r in self.forward_shapes]
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "Recipe":
        """Inverse of `to_dict`; also takes buckets as one `BxT,...` string. Unknown names are bad input."""
        raw = dict(raw)
        if "buckets" in raw and not isinstance(raw["buckets"], tuple):
            b = raw["buckets"]
            raw["buckets"] = parse_buckets(",".join(b) if isinstance(b, (list, tuple)) else str(b))
        shapes = raw.get("forward_shapes")
        if shapes is not None and not (isinstance(shapes, tuple) and all(isinstance(r, ShapeRange) for r in shapes)):
            raw["forward_shapes"] = parse_shape_ranges(",".join(shapes) if isinstance(shapes, (list, tuple))
                                                       else str(shapes))
        return cls().replace(**raw)


SETTINGS: tuple[Setting, ...] = settings_of(Recipe)
"""Every recipe setting, in declaration order: the CLI's flags, the form's fields and docs/recipe.md."""
SETTING: dict[str, Setting] = {s.name: s for s in SETTINGS}


def recipe_from_text(items: list[str] | tuple[str, ...], base: Recipe | None = None) -> Recipe:
    """`base` (default: the defaults) with `NAME=VALUE` items applied, each parsed by the setting it names."""
    return (base or Recipe()).replace(**parse_assignments(SETTINGS, items))


def where_to_set(name: str, value) -> str:
    """How a reader sets recipe setting `name` to `value`: the run form's field and the CLI flag."""
    s = SETTING[name]
    shown = s.show(value)
    return f"set Recipe > '{s.title}' to {shown} in the run form (CLI: --set {name}={shown})"


_FORM = None


def recipe_form():
    """The pydantic model of the recipe's settings (typed fields with the defaults): the run form's
    `recipe` field and the `Kiln Recipe` block are made of it."""
    global _FORM
    if _FORM is None:
        _FORM = form_model(SETTINGS, "RecipeSettings", "Recipe settings: every choice of an export, with its default.",
                           title="Recipe settings")
    return _FORM


def form_overrides(form) -> dict:
    """The settings of a `recipe_form()` instance that override a recipe block's, as form values: each one
    the caller gave, and each one that differs from its default.

    A caller that names some settings (the CLI's flags, an API call, a deployment's defaults) gave those,
    so a flag always wins, also one equal to its default (`--policy borrow` over a block's `fail`). The run
    form sends every setting: there only a value other than the default says the user changed it (to put
    a block's setting back to its default, edit the block).
    """
    given = form.model_fields_set
    if given == set(type(form).model_fields):
        given = set()
    return {k: v for k, v in form.model_dump(mode="json").items()
            if k in given or v != form_value(SETTING[k], SETTING[k].default)}


def recipe_of_form(values: dict, base: Recipe | None = None) -> Recipe:
    """`base` (default: the defaults) with the settings of a form model's dump applied, every one of them."""
    return (base or Recipe()).replace(**from_form(SETTINGS, values))
