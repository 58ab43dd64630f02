"""A pinned export: a verified manifest, its signature and this host's packages, copied into a folder only its
owner can write, for the C++ runner and torch alone to load from (`kiln verify EXPORT_ID --pin DIR`).

Contracts: written only after `kiln verify` passed; the folder is created mode 0700 and must be new or empty
(nothing of another export is mixed in). It holds `manifest.json` and `manifest.sig` as the store encodes them
(the runner verifies the signature over exactly those bytes) and `forwards/<key>/<sha256>.pt2`, each package
hashed while it is copied and checked against the signed manifest, so the folder holds what was verified even
if the store changes afterwards. Consumers load from it with `--manifest DIR/manifest.json --packages
DIR/forwards` and still check the signature and every digest themselves.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kiln.core.errors import BadInput, IntegrityError
from kiln.core.trust.layout import FORWARDS, signature_key
from kiln.store import ObjectMissing, Store
from kiln.store.base import json_bytes


def check_pin_folder(dest: Path) -> None:
    """BadInput unless `dest` is a new or empty folder: asked before any work starts."""
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BadInput(f"--pin {dest}: not a new or empty folder; pin each export into a folder of its own.")


def pin_export(store: Store, export_id: str, manifest: dict, artifacts: dict[str, dict], dest: Path) -> str:
    """Write the pinned folder `dest` for `manifest` (verified) and `artifacts` (shapes -> {'path', 'sha256',
    'object'}, verified); returns the line that says what was written."""
    dest = Path(dest)
    check_pin_folder(dest)
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(dest, 0o700)
    (dest / "manifest.json").write_bytes(json_bytes(manifest))
    try:
        (dest / "manifest.sig").write_bytes(json_bytes(store.get_json(signature_key(export_id))))
    except ObjectMissing:
        pass  # an unsigned export (accepted with --allow-unsigned): consumers need --allow-unsigned too
    copied = {}
    for art in artifacts.values():
        rel = Path(art["object"].removeprefix(FORWARDS))
        if rel.is_absolute() or ".." in rel.parts:
            raise IntegrityError(f"manifest object {art['object']!r} leaves the forwards folder; refusing it.")
        if rel in copied:
            continue
        target = dest / "forwards" / rel
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        copied[rel] = _copy_hashed(Path(art["path"]), target, art["sha256"])
    return (f"pinned: {dest} (manifest, {'signature, ' if (dest / 'manifest.sig').exists() else ''}"
            f"{len(copied)} package(s)); load with --manifest {dest / 'manifest.json'} --packages {dest / 'forwards'}")


def _copy_hashed(src: Path, dest: Path, sha256: str) -> str:
    h = hashlib.sha256()
    with open(src, "rb") as f, open(dest, "xb") as out:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            out.write(chunk)
    if h.hexdigest() != sha256:
        dest.unlink()
        raise IntegrityError(f"{src}: sha256 {h.hexdigest()} is not the manifest's {sha256}; nothing pinned of it.")
    os.chmod(dest, 0o600)
    return sha256
