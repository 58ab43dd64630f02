"""`kiln verify`: re-check a finished export from its manifest.

In this order, and nothing is loaded before all of it passed: the manifest's
signature against the trusted keys (kiln.host.trust.signers), the manifest's structure, each
artifact's sha256 on download, each package's members (kiln.host.trust.package_check,
inside the loader). Then all `tp` ranks run the compiled forwards together
under gloo, with AOTInductor's runtime input checks on, and the combined output
is compared with the unsharded eager model.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from kiln.host.trust.signers import read_verified_manifest, trusted_keys
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.core.model.config import BUNDLED_MODEL, ModelConfig
from kiln.core.errors import BadInput, MemoryShort, VerifyMismatch
from kiln.core.forwards.forward_keys import check_export_id
from kiln.core.machine.home import kiln_home
from kiln.core.trust.layout import manifest_key
from kiln.core.trust.manifest import check_manifest, forwards_for_host, manifest_device
from kiln.core.run.outcome import passed, routing_note
from kiln.host.trust.package_check import check_package
from kiln.core.plan.recipe import Recipe
from kiln.core.plan.sizing import verify_peak_mib
from kiln.host.weights import rank_weights as weights
from kiln.host.weights.checkpoint import tiny_checkpoint
from kiln.host.machine.probe import consumer_target, host_memory
from kiln.host.ranks.verify_ranks import verify_all_ranks
from kiln.store import Store, open_store, validate_key


def fetch_verified_export(store: Store, export_id: str, dest: Path, *, trusted,
                          allow_unsigned: bool = False) -> tuple[dict, dict[str, dict], list[str]]:
    """Everything a loader of a finished export needs, checked: (manifest, artifacts, lines).

    The signature first (`trusted` returns the trusted keys), then the
    manifest's structure, then which forwards this host can run (its device and
    target: kiln.core.trust.manifest.forwards_for_host refuses by name before anything
    is fetched), then each artifact's sha256 (against the signed manifest) as it
    lands in `dest`, then each package's members. `artifacts` maps forward
    shapes ('1x8', '2-8x16-64@8x64'; where the ranks' shares differ, 'SHAPES ranks 0,1': one per rank shape)
    to {'path', 'sha256', 'object', 'shapes'[, 'ranks']} (kiln.host.ranks.verify_ranks.rank_artifacts picks a
    rank's); load them with
    kiln.host.ranks.loader.load_forward on the manifest's device
    (kiln.core.trust.manifest.manifest_device), which checks both again.
    """
    check_export_id(export_id)
    raw, signature_line = read_verified_manifest(store, export_id, trusted=trusted, allow_unsigned=allow_unsigned)
    manifest = check_manifest(raw, export_id=export_id)
    device = manifest_device(manifest)
    chosen = forwards_for_host(manifest, *consumer_target(device))
    lines = [f"manifest {store.url}/{manifest_key(export_id)}: {len(manifest['forwards'])} forward(s)",
             signature_line, f"device {device}: {len(chosen)} forward(s) for this host's target"]
    artifacts = {}
    for f in chosen:
        path = dest / f"{f['key']}.pt2"
        store.get_file(validate_key(f["object"]), path, f["sha256"])  # raises IntegrityError on mismatch
        name = f["shapes"] + (f" ranks {','.join(map(str, f['ranks']))}" if "ranks" in f else "")
        artifacts[name] = {"path": str(path), "sha256": f["sha256"], "object": f["object"], "shapes": f["shapes"],
                           **({"ranks": f["ranks"]} if "ranks" in f else {})}
    lines.append(f"sha256 ok for {len(artifacts)} artifact(s)")
    for art in artifacts.values():
        check_package(art["path"])  # the loader checks again; here a refusal stops before any process starts
    lines.append(f"package members ok for {len(artifacts)} artifact(s); loading with runtime input checks on")
    return manifest, artifacts, lines


def open_export(store_url: str | None, export_id: str, dest: str, *, model: str | None = None,
                s3_endpoint: str | None = None, verify_keys: list[str] = (), verify_key_block: str | None = None,
                allow_unsigned: bool = False) -> tuple[dict, str, ModelConfig, dict[str, dict], list[str]]:
    """A finished export, checked and fetched into KILN_HOME/`dest`/EXPORT_ID: (manifest, checkpoint, config,
    artifacts, lines). The checkpoint (`model`, else the one the manifest names) must be the exported model.
    What earlier runs left on this machine is removed first (`_tidy`)."""
    home = kiln_home()
    check_export_id(export_id)
    store = open_store(store_url or f"file://{home / 'store'}", s3_endpoint=s3_endpoint)
    store.check()
    trusted = partial(trusted_keys, files=list(verify_keys), block=verify_key_block, store=store, home=home)
    # The manifest is read (and its signature checked) before the checkpoint, which the manifest names.
    raw, _ = read_verified_manifest(store, export_id, trusted=trusted, allow_unsigned=allow_unsigned)
    manifest = check_manifest(raw, export_id=export_id)
    if model:
        checkpoint = model.rstrip("/") if weights.is_s3(model) else str(Path(model).resolve())
    elif manifest["model"]["name"] == BUNDLED_MODEL:
        checkpoint = str(tiny_checkpoint(home))
    else:
        checkpoint = manifest["model"].get("checkpoint", "")
    exported = ModelConfig(**manifest["model"]["config"])
    cfg = weights.inspect(checkpoint, s3_endpoint=s3_endpoint).replace(dtype=exported.dtype)  # --dtype may differ
    if cfg != exported:
        raise BadInput(f"checkpoint {checkpoint} does not match the model the export was made from; "
                       "pass the right one with --model.")
    recorded = manifest["model"].get("checkpoint_identity")
    if recorded and weights.is_s3(checkpoint):
        changed = weights.changed_content(recorded, weights.identity(checkpoint, s3_endpoint=s3_endpoint))
    elif recorded and recorded.get("files"):  # a directory: its files' digests (remembered under KILN_HOME)
        changed = weights.changed_content(recorded, weights.directory_identity(checkpoint, home / "digests"))
    else:
        changed = None
    if changed:
        raise BadInput(f"checkpoint {checkpoint} is not the one exported: {changed}; pass the exported one "
                       "with --model, or export this one.")
    _tidy(home / dest, export_id)
    manifest, artifacts, lines = fetch_verified_export(store, export_id, home / dest / export_id,
                                                       trusted=trusted, allow_unsigned=allow_unsigned)
    return manifest, checkpoint, cfg, artifacts, lines


def _tidy(fetched: Path, export_id: str) -> None:
    """Before fetching: remove the temporary directories of Kiln processes gone from this machine (a rank
    killed leaves AOTInductor's extractions) and the exports fetched into `fetched` least recently used
    beyond KILN_CACHE_MIB (never `export_id`'s); one line on stderr says what went."""
    import sys

    from kiln.core.run.tidy import removed_line
    from kiln.host.machine import cache
    from kiln.host.processes import scratch

    try:
        cap = cache.cap_bytes()
        line = removed_line("on this machine", {
            "temporary directories of processes gone": scratch.sweep(),
            f"exports fetched into {fetched} least recently used over {cache.CACHE_MIB_ENV}="
            f"{cap // cache.MIB if cap else 0}": cache.cap_folders(fetched, cap, keep=export_id)})
    except Exception as exc:  # noqa: BLE001 - housekeeping: said, never fatal
        line = f"could not tidy {fetched}: {exc}"
    if line:
        print(line, file=sys.stderr)


def verify_export(store_url: str | None, export_id: str, *, pin: str | None = None, **options) -> dict:
    """`kiln verify`: all ranks together against the unsharded eager model, per forward at its range's
    checked shapes (four corners, hint and an interior shape); with `pin`, then the verified manifest,
    signature and packages copied into that folder (kiln.host.trust.pinned) for the C++ runner and torch alone."""
    if pin:
        from kiln.host.trust.pinned import check_pin_folder
        check_pin_folder(Path(pin))  # bad input: before anything is fetched or run
    manifest, checkpoint, cfg, artifacts, lines = open_export(store_url, export_id, "verify", **options)
    recipe = Recipe.from_dict(manifest["recipe"])
    predicted = verify_peak_mib(shard_bytes=weight_bytes_per_rank(cfg, manifest["tp"]),
                                full_bytes=weight_bytes_per_rank(cfg, 1), tp=manifest["tp"],
                                num_forwards=len({a["shapes"] for a in artifacts.values()}),
                                half=cfg.dtype != "float32",
                                process_base_mib=recipe.process_base_mib)
    available = host_memory()["host_available_mib"]
    if predicted > available:
        raise MemoryShort(f"kiln verify runs all {manifest['tp']} ranks and the unsharded model on this machine: "
                          f"about {predicted} MiB, but {available} MiB are available. Free memory, or verify on "
                          "a larger machine (the export itself was checked rank by rank on its hosts).")
    lines.append(f"memory: about {predicted} MiB predicted for {manifest['tp']} ranks and the unsharded model "
                 f"({available} MiB available)")
    checks, peak_mib = verify_all_ranks(checkpoint=str(checkpoint), config=manifest["model"]["config"], tp=manifest["tp"],
                              s3_endpoint=options.get("s3_endpoint"),
                              artifacts=artifacts, page_tokens=recipe.page_tokens, pages_per_seq=recipe.pages_per_seq,
                              atol=recipe.verify_atol, half_ratio=recipe.verify_half_ratio,
                              device=manifest_device(manifest))
    for shapes, c in sorted(checks.items()):
        lines.append(f"  {shapes}: {manifest['tp']} ranks together vs unsharded eager at {c['shapes']} shape(s): "
                     f"max |diff| {c['diff']:.2e} at {c['at']} (scaled; limit {c['limit']:.2e}{routing_note(c)})")
    failed = sorted(b for b, c in checks.items() if not passed(c))
    if failed:
        c = checks[failed[0]]
        if c.get("wrong_choice"):
            raise VerifyMismatch(f"export {export_id}: compiled ranks of forward {failed[0]} made a choice "
                                 f"{cfg.dtype} does not allow at {c['at']}: {c['wrong_choice']}.")
        raise VerifyMismatch(f"export {export_id}: compiled ranks of forward {failed[0]} differ from the unsharded "
                             f"model at {c['at']} by {c['diff']:.2e} (scaled; limit {c['limit']:.2e} for {cfg.dtype}"
                             f"{routing_note(c)}).")
    lines.append(f"verify ok: {manifest['tp']} ranks match the unsharded model ({cfg.dtype}; "
                 f"{'within ' + str(recipe.verify_atol) if cfg.dtype == 'float32' else 'compared in float32'})")
    lines.append(f"memory: peak {peak_mib} MiB measured over the rank processes (predicted {predicted} MiB)")
    if pin:
        from kiln.host.trust.pinned import pin_export
        store = open_store(store_url or f"file://{kiln_home() / 'store'}", s3_endpoint=options.get("s3_endpoint"))
        lines.append(pin_export(store, export_id, manifest, artifacts, Path(pin)))
    return {"lines": lines, "diffs": checks, "memory": {"predicted_mib": predicted, "peak_mib": peak_mib}}
