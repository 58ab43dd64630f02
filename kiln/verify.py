"""`kiln verify`: re-check a finished export from its manifest.

In this order, and nothing is loaded before all of it passed: the manifest's
signature against the trusted keys (kiln.trust), the manifest's structure, each
artifact's sha256 on download, each package's members (kiln.package_check,
inside the loader). Then all `tp` ranks run the compiled forwards together
under gloo, with AOTInductor's runtime input checks on, and the combined output
is compared with the unsharded eager model.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from kiln.checkpoint import inspect_checkpoint, tiny_checkpoint
from kiln.errors import BadInput, IntegrityError
from kiln.keys import check_export_id, manifest_key
from kiln.manifest import check_manifest
from kiln.package_check import check_package
from kiln.params import kiln_home
from kiln.store import Store, open_store, validate_key
from kiln.trust import read_verified_manifest, trusted_keys
from kiln.verify_ranks import verify_all_ranks


def fetch_verified_export(store: Store, export_id: str, dest: Path, *, trusted,
                          allow_unsigned: bool = False) -> tuple[dict, dict[str, dict], list[str]]:
    """Everything a loader of a finished export needs, checked: (manifest, artifacts, lines).

    The signature first (`trusted` returns the trusted keys), then the
    manifest's structure, then each artifact's sha256 (against the signed
    manifest) as it lands in `dest`, then each package's members. `artifacts`
    maps a bucket ('1x8') to {'path', 'sha256'}; load them with
    kiln.loader.load_forward, which checks both again.
    """
    check_export_id(export_id)
    raw, signature_line = read_verified_manifest(store, export_id, trusted=trusted, allow_unsigned=allow_unsigned)
    manifest = check_manifest(raw, export_id=export_id)
    lines = [f"manifest {store.url}/{manifest_key(export_id)}: {len(manifest['forwards'])} forward(s)",
             signature_line]
    artifacts = {}
    for f in manifest["forwards"]:
        path = dest / f"{f['key']}.pt2"
        store.get_file(validate_key(f["object"]), path, f["sha256"])  # raises IntegrityError on mismatch
        artifacts[f["bucket"]] = {"path": str(path), "sha256": f["sha256"]}
    lines.append(f"sha256 ok for {len(artifacts)} artifact(s)")
    for art in artifacts.values():
        check_package(art["path"])  # the loader checks again; here a refusal stops before any process starts
    lines.append(f"package members ok for {len(artifacts)} artifact(s); loading with runtime input checks on")
    return manifest, artifacts, lines


def verify_export(store_url: str | None, export_id: str, *, model: str | None = None,
                  s3_endpoint: str | None = None, verify_keys: list[str] = (), verify_key_block: str | None = None,
                  allow_unsigned: bool = False) -> dict:
    home = kiln_home()
    check_export_id(export_id)
    store = open_store(store_url or f"file://{home / 'store'}", s3_endpoint=s3_endpoint)
    store.check()
    trusted = partial(trusted_keys, files=list(verify_keys), block=verify_key_block, store=store, home=home)
    # The manifest is read (and its signature checked) before the checkpoint, which the manifest names.
    raw, _ = read_verified_manifest(store, export_id, trusted=trusted, allow_unsigned=allow_unsigned)
    manifest = check_manifest(raw, export_id=export_id)
    if model:
        checkpoint = Path(model).resolve()
    elif manifest["model"]["name"] == "tiny":
        checkpoint = tiny_checkpoint(home)
    else:
        checkpoint = Path(manifest["model"].get("checkpoint", ""))
    cfg = inspect_checkpoint(checkpoint)
    if cfg.__dict__ != manifest["model"]["config"]:
        raise BadInput(f"checkpoint {checkpoint} does not match the model the export was made from; "
                       "pass the right one with --model.")
    manifest, artifacts, lines = fetch_verified_export(store, export_id, home / "verify" / export_id,
                                                       trusted=trusted, allow_unsigned=allow_unsigned)
    diffs = verify_all_ranks(checkpoint=str(checkpoint), config=manifest["model"]["config"], tp=manifest["tp"],
                             artifacts=artifacts, page_tokens=manifest["recipe"]["page_tokens"],
                             pages_per_seq=manifest["recipe"]["max_context_tokens"] // manifest["recipe"]["page_tokens"])
    atol = manifest["recipe"]["verify_atol"]
    for bucket, diff in sorted(diffs.items()):
        lines.append(f"  {bucket}: {manifest['tp']} ranks together vs unsharded eager: max |diff| {diff:.2e}")
    worst = max(diffs.values())
    if worst > atol:
        raise IntegrityError(f"export {export_id}: compiled ranks differ from the unsharded model by {worst:.2e} "
                             f"(> verify_atol {atol}).")
    lines.append(f"verify ok: {manifest['tp']} ranks match the unsharded model within {atol}")
    return {"lines": lines, "diffs": diffs}
