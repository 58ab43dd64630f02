"""The export manifest: what an export produced, written last, checked before use. Pure.

The manifest is signed (kiln.core.trust.signing; the signature lives beside it) and says
so in its `signing` entry: {'signed': bool, 'key_fingerprint': str | None}.
`check_manifest` is the structural check that follows the signature check: every
forward names a well-formed key, its object `forwards/<key>/<sha256>.pt2` (or
a store's older `forwards/<key>.pt2`), the shapes it takes (a range and its
hint, kiln.core.forwards.shape_ranges) and a sha256, says whether it is Python-free, its target agrees with `runtime.device`, and no two
keys or objects collide after normalisation.

It is also a consumer contract (kiln.core.model.contract; docs/run-without-kiln.md):
`runtime` names the process group the packages' collectives expect,
whether every package runs without Python, and the `device` the packages run
on ('cpu' or 'cuda'; absent: cpu); `weights` maps each
package constant to its checkpoint tensor and how each rank cuts it; each
forward carries its `interface` (inputs and outputs: names, dtypes, shapes with
the dynamic dimension named), the native `ops` it calls and its `constants`; a CPU
forward also its `target_cpu`, the CPU its code is compiled for
(kiln.core.machine.cpu_target.CpuIsa: arch, ISA level, instruction-set flags),
by which `forwards_for_host` refuses a package this host's CPU cannot run.
"""

from __future__ import annotations

import re

from kiln.core.errors import BadInput, IntegrityError
from kiln.core.trust.key_rules import check_no_collisions
from kiln.core.trust.layout import artifact_key, legacy_artifact_key
from kiln.core.forwards.shape_ranges import parse_shape_range
from kiln.core.machine.cpu_target import ISA_LEVEL_RANK, CpuIsa, arch_and_level, cannot_run, level_above
from kiln.core.machine.target import Target, device_of

MANIFEST_VERSION = 5
_KEY = re.compile(r"^[0-9a-f]{16,64}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def export_manifest(job, report) -> dict:
    """The manifest of a finished export: `job` (kiln.core.plan.job.ExportJob) and its `report` (forwards,
    KV plan, hosts and phases recorded)."""
    from kiln.core.model.contract import weight_layout
    from kiln.core.model.hf_config.multimodal import stored_name

    identity = job.checkpoint_identity or report.checkpoint_identity  # S3: listed at the start; a directory: read
    prefixes = job.image_text["prefixes"] if job.image_text else None
    weights = weight_layout(job.model_config, job.tp)
    for entry in weights.values():  # an image-text checkpoint: its text decoder's tensors as its files name them
        for source in entry["sources"]:
            source["tensor"] = stored_name(source["tensor"], prefixes)
    return build_manifest(
        export_id=job.export_id, model={"name": job.model_name, "checkpoint": job.checkpoint, "config": job.config,
                                        **({"checkpoint_identity": identity} if identity else {}),
                                        **({"image_text": job.image_text} if job.image_text else {})},
        recipe=job.recipe.to_dict(), tp=job.tp, buckets=[str(b) for b in job.recipe.buckets],
        forwards=report.forwards, weights=weights, kv_plan=report.kv_plan,
        hosts=list(report.hosts.values()), phases=list(report.phases), signing=job.signing.manifest_entry())


def build_manifest(*, export_id: str, model: dict, recipe: dict, tp: int, buckets: list[str],
                   forwards: list[dict], weights: dict, kv_plan: dict, hosts: list[dict], phases: list[dict],
                   signing: dict) -> dict:
    """`forwards` are kiln.core.run.outcome.forward_records; `weights` is kiln.core.model.contract.weight_layout;
    `signing` is {'signed', 'key_fingerprint'} (kiln.core.trust.signing.SigningPlan.manifest_entry)."""
    groups = sorted({f["interface"]["process_group"] for f in forwards if f["interface"]["process_group"]})
    devices = sorted({device_of(f["target"]) for f in forwards})
    if len(devices) > 1:
        raise ValueError(f"an export's forwards run on one device, not on {' and '.join(devices)}")
    runtime = {"process_group": groups[0] if groups else None, "world_size": tp,
               "python_free": all(f["python_free"] for f in forwards), "device": devices[0] if devices else "cpu"}
    return {"version": MANIFEST_VERSION, "export_id": export_id, "model": model, "recipe": recipe,
            "tp": tp, "buckets": buckets, "runtime": runtime, "weights": weights,
            "forwards": sorted(forwards, key=lambda f: (f["target"], f["shapes"])),
            "kv_plan": kv_plan, "hosts": hosts, "phases": phases, "signing": dict(signing)}


def check_manifest(manifest: object, *, export_id: str | None = None) -> dict:
    """Structural check of a manifest read from the store; raises IntegrityError on anything odd.

    With `export_id`, the manifest must be that export's (a signed manifest
    copied under another export's name is refused).
    """
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        raise IntegrityError("the manifest is not a Kiln manifest of a version this Kiln reads "
                             f"(version {MANIFEST_VERSION}).")
    if export_id is not None and manifest.get("export_id") != export_id:
        raise IntegrityError(f"the manifest stored for export {export_id!r} belongs to export "
                             f"{manifest.get('export_id')!r}; refusing it.")
    signing = manifest.get("signing")
    if not isinstance(signing, dict) or not isinstance(signing.get("signed"), bool):
        raise IntegrityError("the manifest does not say whether it is signed (no 'signing' entry).")
    forwards = manifest.get("forwards")
    if not isinstance(forwards, list) or not forwards:
        raise IntegrityError("the manifest lists no forwards.")
    for f in forwards:
        if not isinstance(f, dict) or not all(isinstance(f.get(k), str) for k in ("key", "shapes", "sha256", "object")):
            raise IntegrityError(f"manifest entry {f!r} lacks key, shapes, sha256 or object.")
        if not _KEY.match(f["key"]):
            raise IntegrityError(f"manifest entry {f['key']!r} is not a forward key (16-64 lowercase hex digits).")
        if not _SHA256.match(f["sha256"]):
            raise IntegrityError(f"manifest entry for {f['key']} has a malformed sha256.")
        if f["object"] not in (artifact_key(f["key"], f["sha256"]), legacy_artifact_key(f["key"])):
            raise IntegrityError(f"manifest entry for {f['key']} points at {f['object']!r}, "
                                 f"not at {artifact_key(f['key'], f['sha256'])!r}.")
        _check_shapes(f)
        if not isinstance(f.get("python_free"), bool):
            raise IntegrityError(f"manifest entry for {f['key']} does not say whether it is Python-free.")
        _check_target_cpu(f)
    _check_ranks(manifest)
    device = manifest_device(manifest)
    off = sorted({f["target"] for f in forwards if device_of(str(f.get("target", ""))) != device})
    if off:
        raise IntegrityError(f"the manifest says its forwards run on {device} but lists forwards of target(s) "
                             f"{', '.join(off)}.")
    try:
        check_no_collisions([f["object"] for f in forwards], what="manifest objects")
    except BadInput as exc:
        raise IntegrityError(str(exc)) from None
    return manifest


def _check_ranks(manifest: dict) -> None:
    """IntegrityError unless the forwards' 'ranks' (an export whose ranks' shares differ: each forward names the
    ranks it is theirs; kiln.core.model.shares) give every rank of the export's tp one forward per shapes and
    target, or no forward names any (every rank loads every one)."""
    forwards, tp = manifest["forwards"], manifest.get("tp")
    named = [f for f in forwards if "ranks" in f]
    if not named:
        return
    if len(named) < len(forwards) or not isinstance(tp, int):
        raise IntegrityError("some forwards of the manifest name their ranks and others do not.")
    held: dict[tuple, list] = {}
    for f in named:
        ranks = f["ranks"]
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, int) and 0 <= r < tp for r in ranks):
            raise IntegrityError(f"manifest entry for {f['key']}: its ranks {ranks!r} are not ranks of tp {tp}.")
        held.setdefault((f["shapes"], f.get("target")), []).extend(ranks)
    for (shapes, target), ranks in held.items():
        if sorted(ranks) != list(range(tp)):
            raise IntegrityError(f"the manifest's forwards of shapes {shapes} ({target}) are for ranks "
                                 f"{sorted(ranks)}, not each of the {tp} ranks once.")


def rank_forwards(forwards: list[dict], rank: int) -> list[dict]:
    """The forwards rank `rank` loads: those whose 'ranks' name it where ranks' shares differ (kiln.core.model.
    shares: a package per rank shape), every one otherwise."""
    return [f for f in forwards if rank in f.get("ranks", [rank])]


def _check_shapes(forward: dict) -> None:
    """IntegrityError unless the forward's 'shapes' names a well-formed range whose 'batch', 'tokens' and
    'hint' it states again (kiln.core.forwards.shape_ranges.ShapeRange.to_dict)."""
    try:
        stated = parse_shape_range(forward["shapes"]).to_dict()
    except BadInput as exc:
        raise IntegrityError(f"manifest entry for {forward['key']} has malformed shapes: {exc}") from None
    if any(forward.get(k) != stated[k] for k in ("batch", "tokens", "hint")):
        raise IntegrityError(f"manifest entry for {forward['key']}: its batch, tokens and hint do not state the "
                             f"range {forward['shapes']!r} names.")


def _check_target_cpu(forward: dict) -> None:
    """IntegrityError unless a CPU forward's 'target_cpu' (absent in manifests written before it) is a CPU
    description whose fingerprint is the forward's target."""
    if "target_cpu" not in forward or device_of(str(forward.get("target", ""))) != "cpu":
        return
    try:
        cpu = CpuIsa.from_dict(forward["target_cpu"])
    except ValueError as exc:
        raise IntegrityError(f"manifest entry for {forward['key']}: its target_cpu is malformed: {exc}") from None
    if cpu.fingerprint != forward.get("target"):
        raise IntegrityError(f"manifest entry for {forward['key']}: its target_cpu describes {cpu.fingerprint}, "
                             f"not its target {forward.get('target')}.")


def manifest_device(manifest: dict) -> str:
    """'cpu' or 'cuda': the device a (checked) manifest's packages run on (`runtime.device`; absent: cpu, as
    consumers written against manifests without it assume)."""
    device = (manifest.get("runtime") or {}).get("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise IntegrityError(f"the manifest's runtime device is {device!r}, not 'cpu' or 'cuda'.")
    return device


def forwards_for_host(manifest: dict, host: Target | None, num_gpus: int) -> list[dict]:
    """The forwards a consumer on a host of target `host` (None: it has none for the export's device) with
    `num_gpus` usable GPUs loads, one per shapes (a bucket or a range) and, where ranks' shares differ, per
    rank shape (rank_forwards picks a rank's); BadInput naming what does not fit before anything is fetched.

    The rule (docs/run-without-kiln.md): a CUDA export needs a GPU, and a CUDA forward loads only on a host
    of its target (GPU arch, CUDA, Triton, wrapper ISA). A CPU forward loads on a CPU that can run it
    (`cannot_run_here`). Of the forwards of a shapes this host can run, it takes the one of its own target,
    else the one of the highest ISA level, then with the most instruction-set flags, then the first target
    by name; where it can run none, the export is refused naming each forward, its target and why.
    """
    device = manifest_device(manifest)
    export = manifest.get("export_id")
    if device == "cuda" and (host is None or num_gpus <= 0):
        raise BadInput(f"export {export} was compiled for CUDA (targets "
                       f"{', '.join(sorted({str(f.get('target')) for f in manifest['forwards']}))}) and this host has no "
                       "usable GPU (none visible, or torch here is a CPU build); run it on a GPU host of that "
                       "target, or export again with --set device=cpu.")
    if host is None:
        raise ValueError(f"a consumer of a {device} export needs this host's {device} target")
    by_shapes: dict[tuple, list[dict]] = {}
    for f in manifest["forwards"]:  # and by the ranks it is for, where ranks' shares differ (rank_forwards)
        by_shapes.setdefault((f["shapes"], tuple(f.get("ranks", ()))), []).append(f)
    chosen = []
    for (shapes, _), fs in sorted(by_shapes.items()):
        why = {f["key"]: cannot_run_here(f, host) for f in fs}
        runnable = [f for f in fs if why[f["key"]] is None]
        if not runnable:
            raise BadInput(refusal(export, shapes, fs, why, host))
        chosen.append(min(runnable, key=lambda f: _preference(f, host)))
    return chosen


def cannot_run_here(forward: dict, host: Target) -> str | None:
    """Why a host of target `host` cannot run `forward`'s package (a clause naming what it needs and what
    this host has), or None when it can.

    Its own target always runs. A CUDA forward runs only there. A CPU forward runs on a CPU of its
    architecture whose ISA level is its own or higher and that has every instruction-set flag of its
    `target_cpu` (kiln.core.machine.cpu_target.cannot_run); a forward without `target_cpu` (a manifest written
    before it) is known only by its fingerprint, which names its architecture and ISA level but not its
    flags, so on any other CPU it is refused.
    """
    target = str(forward.get("target"))
    if target == host.fingerprint:
        return None
    if device_of(target) == "cuda" or host.device == "cuda":
        return "a CUDA forward loads only on a host of its own target"
    if host.cpu_isa is None:
        return f"this host's CPU is known only by its fingerprint {host.fingerprint}"
    if "target_cpu" in forward:
        return cannot_run(CpuIsa.from_dict(forward["target_cpu"]), host.cpu_isa)
    named = arch_and_level(target)
    if named is None:
        return "its target is not a CPU target this Kiln reads"
    arch, level = named
    if arch != host.cpu_isa.arch:
        return f"it is {arch} code and this CPU is {host.cpu_isa.arch}"
    if level_above(level, host.cpu_isa.level):
        return f"it needs ISA level {level} and this CPU's is {host.cpu_isa.level}"
    return ("the manifest records only its target's fingerprint, not the instruction sets it needs (written "
            "before manifests carried target_cpu), so Kiln cannot tell whether this CPU runs it")


def check_runs_here(forwards: list[dict], host: Target, where: str) -> None:
    """BadInput naming the first of `forwards` a host of target `host` cannot run (cannot_run_here), with
    `where` (e.g. 'host h0') in front: a guard before any process loads one."""
    for f in forwards:
        why = cannot_run_here(f, host)
        if why:
            raise BadInput(f"{where}: forward {f.get('key')} ({f.get('shapes')}) is for target {f.get('target')} and "
                           f"this host's is {host.fingerprint}: {why}. Nothing was loaded; run it on a host of its "
                           "target, or compile it for this one.")


def refusal(export: str | None, shapes: str, forwards: list[dict], why: dict[str, str | None], host: Target) -> str:
    """The refusal of an export none of whose `forwards` of `shapes` this host can run: each forward, its
    target and why not (`why`: key -> cannot_run_here), this host's target, and the fix."""
    cpu = host.cpu_isa
    mine = f"{host.fingerprint}" + (f" ({cpu.arch}, ISA level {cpu.level})" if cpu and host.device == "cpu" else "")
    each = "; ".join(f"forward {f['key']} is for {f.get('target')}: {why[f['key']]}" for f in forwards)
    fix = ("run it on a host of one of those targets (for a CPU forward: any CPU of its architecture with its "
           "ISA level and instruction sets), or export again with a host of this one among the export's hosts, "
           "so its forwards compile for this host")
    return (f"export {export} has no forward of shapes {shapes} for this host's target {mine}: {each}. To fix: "
            f"{fix}.")


def _preference(forward: dict, host: Target) -> tuple:
    """Sort key among the forwards of one shapes a host can run: its own target first, then the highest ISA
    level, the most instruction-set flags, the first target by name."""
    cpu = forward.get("target_cpu") or {}
    return (forward.get("target") != host.fingerprint, -ISA_LEVEL_RANK.get(cpu.get("isa_level"), 0),
            -len(cpu.get("isa_flags", ())), str(forward.get("target")))
