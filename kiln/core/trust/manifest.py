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
the dynamic dimension named), the native `ops` it calls and its `constants`.
"""

from __future__ import annotations

import re

from kiln.core.errors import BadInput, IntegrityError
from kiln.core.trust.key_rules import check_no_collisions
from kiln.core.trust.layout import artifact_key, legacy_artifact_key
from kiln.core.forwards.shape_ranges import parse_shape_range
from kiln.core.machine.target import device_of

MANIFEST_VERSION = 5
_KEY = re.compile(r"^[0-9a-f]{16,64}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def export_manifest(job, report) -> dict:
    """The manifest of a finished export: `job` (kiln.core.plan.job.ExportJob) and its `report` (forwards,
    KV plan, hosts and phases recorded)."""
    from kiln.core.model.contract import weight_layout

    return build_manifest(
        export_id=job.export_id, model={"name": job.model_name, "checkpoint": job.checkpoint, "config": job.config,
                                        **({"checkpoint_identity": job.checkpoint_identity}
                                           if job.checkpoint_identity else {})},
        recipe=job.recipe.to_dict(), tp=job.tp, buckets=[str(b) for b in job.recipe.buckets],
        forwards=report.forwards, weights=weight_layout(job.model_config, job.tp), kv_plan=report.kv_plan,
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


def manifest_device(manifest: dict) -> str:
    """'cpu' or 'cuda': the device a (checked) manifest's packages run on (`runtime.device`; absent: cpu, as
    consumers written against manifests without it assume)."""
    device = (manifest.get("runtime") or {}).get("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise IntegrityError(f"the manifest's runtime device is {device!r}, not 'cpu' or 'cuda'.")
    return device


def forwards_for_host(manifest: dict, host_target: str, num_gpus: int) -> list[dict]:
    """The forwards a consumer on a host of target fingerprint `host_target` with `num_gpus` usable GPUs
    loads, one per shapes (a bucket or a range); BadInput naming what does not fit before anything is fetched.

    The rule (docs/run-without-kiln.md): a CUDA export needs a GPU, and only forwards compiled for this
    host's target (GPU arch, CUDA, Triton, wrapper ISA) load on it. Shapes with forwards for several
    targets take this host's; CPU shapes with one forward take that one (a CPU runs a package compiled for
    its own ISA or a lower one; Inductor's code for a higher one stops with an illegal instruction).
    """
    device = manifest_device(manifest)
    export = manifest.get("export_id")
    if device == "cuda" and num_gpus <= 0:
        raise BadInput(f"export {export} was compiled for CUDA (targets "
                       f"{', '.join(sorted({str(f.get('target')) for f in manifest['forwards']}))}) and this host has no "
                       "usable GPU (none visible, or torch here is a CPU build); run it on a GPU host of that "
                       "target, or export again with --set device=cpu.")
    by_shapes: dict[str, list[dict]] = {}
    for f in manifest["forwards"]:
        by_shapes.setdefault(f["shapes"], []).append(f)
    chosen = []
    for shapes, fs in sorted(by_shapes.items()):
        mine = [f for f in fs if f.get("target") == host_target]
        if not mine and (device == "cuda" or len(fs) > 1):
            raise BadInput(f"export {export} has no forward of shapes {shapes} for this host's target "
                           f"{host_target} (it has {', '.join(sorted(str(f.get('target')) for f in fs))}); run it on a "
                           "host of one of those targets, or export again with a host of this one.")
        chosen.append(mine[0] if mine else fs[0])
    return chosen
