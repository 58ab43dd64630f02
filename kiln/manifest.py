"""The export manifest: what an export produced, written last, checked before use. Pure."""

from __future__ import annotations

from kiln.errors import IntegrityError

MANIFEST_VERSION = 1


def build_manifest(*, export_id: str, model: dict, recipe: dict, tp: int, buckets: list[str],
                   forwards: list[dict], kv_plan: dict, hosts: list[dict], phases: list[dict]) -> dict:
    """`forwards` entries carry key, bucket, target, sha256, size_bytes and the store object key."""
    return {"version": MANIFEST_VERSION, "export_id": export_id, "model": model, "recipe": recipe,
            "tp": tp, "buckets": buckets,
            "forwards": sorted(forwards, key=lambda f: (f["target"], f["bucket"])),
            "kv_plan": kv_plan, "hosts": hosts, "phases": phases}


def check_manifest(manifest: object) -> dict:
    """Structural check of a manifest read from the store; raises IntegrityError on anything odd."""
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        raise IntegrityError("the manifest is not a Kiln manifest of a version this Kiln reads.")
    forwards = manifest.get("forwards")
    if not isinstance(forwards, list) or not forwards:
        raise IntegrityError("the manifest lists no forwards.")
    for f in forwards:
        if not isinstance(f, dict) or not all(isinstance(f.get(k), str) for k in ("key", "bucket", "sha256", "object")):
            raise IntegrityError(f"manifest entry {f!r} lacks key, bucket, sha256 or object.")
        if len(f["sha256"]) != 64 or any(c not in "0123456789abcdef" for c in f["sha256"]):
            raise IntegrityError(f"manifest entry for {f['key']} has a malformed sha256.")
    return manifest
