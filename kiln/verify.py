"""`kiln verify`: re-check a finished export from its manifest.

Every artifact's sha256 is checked on download, before anything loads it; then
all `tp` ranks run the compiled forwards together under gloo and the combined
output is compared with the unsharded eager model.
"""

from __future__ import annotations

from pathlib import Path

from kiln.checkpoint import inspect_checkpoint, tiny_checkpoint
from kiln.errors import BadInput, IntegrityError
from kiln.keys import manifest_key
from kiln.manifest import check_manifest
from kiln.params import kiln_home
from kiln.store import ObjectMissing, open_store, validate_key
from kiln.verify_ranks import verify_all_ranks


def verify_export(store_url: str | None, export_id: str, *, model: str | None = None,
                  s3_endpoint: str | None = None) -> dict:
    home = kiln_home()
    store = open_store(store_url or f"file://{home / 'store'}", s3_endpoint=s3_endpoint)
    store.check()
    key = validate_key(manifest_key(export_id))
    try:
        manifest = check_manifest(store.get_json(key))
    except ObjectMissing:
        raise BadInput(f"no export {export_id!r} in {store.url} (no {key}); check the export id and --store.") from None
    lines = [f"manifest {store.url}/{key}: {len(manifest['forwards'])} forward(s)"]
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
    cache = home / "verify" / export_id
    artifacts = {}
    for f in manifest["forwards"]:
        dest = cache / f"{f['key']}.pt2"
        store.get_file(validate_key(f["object"]), dest, f["sha256"])  # raises IntegrityError on mismatch
        artifacts[f["bucket"]] = {"path": str(dest), "sha256": f["sha256"]}
    lines.append(f"sha256 ok for {len(artifacts)} artifact(s)")
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
