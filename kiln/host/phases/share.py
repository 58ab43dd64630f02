"""Sharing compiled forwards: which stored forwards may be loaded (a trusted key vouched for their bytes, or
this export compiled them), what the store holds of an export's keys, and a host's copy of those it lacks."""

from __future__ import annotations

from pathlib import Path

from kiln.core.errors import DISK_ERRNOS, DiskError, IntegrityError, StoreError
from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.trust.layout import artifact_key, inspection_key, vouch_key
from kiln.host.machine.cache import local_path
from kiln.store import ObjectMissing


def trusted_digests(store, keys: list[str], trusted: dict, own: dict[str, str]) -> dict[str, str]:
    """key -> the sha256 of its stored forward that may be loaded; IntegrityError (kiln.core.trust.vouch) naming
    the stored forwards nobody trusted vouched for. Keys not in the store are left out.

    A stored digest is trusted when the vouch for it verifies with one of `trusted` (fingerprint ->
    public key), or when it is this export's own compile (`own`: key -> the digest its compiling host's
    task returned, not the store's word).
    """
    from kiln.core.trust.vouch import check_vouch, unvouched_error

    out, recorded, unvouched = {}, {}, []
    for key in keys:
        info = store.stat(artifact_key(key))
        if info is None:
            continue
        recorded[key] = info.sha256
        if info.sha256 and own.get(key) == info.sha256:
            out[key] = info.sha256
            continue
        try:
            doc = store.get_json(vouch_key(key, info.sha256)) if info.sha256 else None
        except (ObjectMissing, IntegrityError, ValueError):
            doc = None
        except StoreError as exc:  # unreadable for good (e.g. a file written behind the store's back): no vouch
            if exc.transient:
                raise
            doc = None
        if info.sha256 and check_vouch(doc, key, info.sha256, trusted):
            out[key] = info.sha256
        else:
            unvouched.append(key)
    if unvouched:
        raise unvouched_error(unvouched, recorded, trusted, {k: artifact_key(k) for k in unvouched})
    return out


def stored_forwards(store, keys: list[str], digests: dict[str, str]) -> tuple[dict[str, dict], list[str]]:
    """(key -> {'sha256', 'size_bytes', 'calls'} of each stored forward, the keys not in the store).

    `digests`: key -> the trusted sha256 of its forward (`trusted_digests`); a key the store holds
    with other bytes than those raises IntegrityError, and a stored key without a trusted digest
    counts as missing. 'calls' is the inspection record of those bytes
    (kiln.host.trust.package_check.package_calls), written by the host that compiled them; a package
    without one (its compiler died between the two uploads, or an older Kiln made it) is downloaded,
    checked against the trusted digest and inspected here.
    """
    import tempfile

    from kiln.host.trust.package_check import check_package, package_calls

    found, missing = {}, []
    for key in keys:
        info = store.stat(artifact_key(key))
        if info is None or key not in digests:
            missing.append(key)
            continue
        sha256 = digests[key]
        if info.sha256 != sha256:
            raise IntegrityError(f"forward {key}: the store now records sha256 {info.sha256} for "
                                 f"{artifact_key(key)}, not the trusted {sha256}; it was changed behind this "
                                 "export. Delete the object and export again.")
        try:
            record = store.get_json(inspection_key(key))
        except (ObjectMissing, IntegrityError):
            record = None
        if not isinstance(record, dict) or record.get("sha256") != sha256:
            with tempfile.TemporaryDirectory(prefix="kiln-inspect-") as tmp:
                path = Path(tmp) / f"{key}.pt2"
                store.get_file(artifact_key(key), path, sha256)
                check_package(path)
                record = {"sha256": sha256, **package_calls(path).to_dict()}
            store.put_json(inspection_key(key), record, overwrite=True)
        found[key] = {"sha256": sha256, "size_bytes": info.size_bytes,
                      "calls": {k: record[k] for k in ("python_free", "ops", "why")}}
    return found, missing


def fetch_missing(store, job: ExportJob, host: HostSpec, forwards: list[dict]) -> int:
    """Copy every forward this host lacks (or holds with the wrong digest) from the store; verified."""
    from kiln.store import sha256_file

    fetched = 0
    for f in forwards:
        path = local_path(host, f["key"])
        if path.exists() and sha256_file(path) == f["sha256"]:
            continue
        try:
            store.get_file(artifact_key(f["key"]), path, f["sha256"])
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            raise DiskError(f"host {host.name} cannot write forward {f['key']} into its cache: "
                            f"{exc.strerror} ({exc.filename or path}); free space there or point "
                            "KILN_CACHE_DIR at a writable local disk with room.") from None
        fetched += 1
    return fetched
