"""Sharing compiled forwards: which stored package of a key may be loaded (a trusted key vouched for its
bytes, or this export compiled them), what it calls, and a host's copy of those it lacks.

A store shared by several signers holds, per forward key, one package per compile
(`forwards/<key>/<sha256>.pt2`, kiln.core.trust.layout), each with the vouches of whoever compiled it.
An export loads a package only when a key it trusts vouched for those bytes, or when it compiled them
itself; any other package at the key is left where it is, named in a warning, and never loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import DISK_ERRNOS, DiskError, IntegrityError, StoreError
from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.trust import layout
from kiln.host.machine.cache import local_path
from kiln.store import ObjectMissing


@dataclass(frozen=True)
class Stored:
    """A package of a forward that an export may load."""

    key: str
    sha256: str
    object: str
    """Its store key: `forwards/<key>/<sha256>.pt2`, or a store's older `forwards/<key>.pt2`."""
    calls: dict | None
    """What it calls, from a vouch that verified ({'python_free', 'ops', 'why'}); None: inspect it first."""
    vouched_by: str | None
    """The fingerprint of the trusted key that vouched for it; None for this export's own compile."""


def packages_of(store, key: str) -> list[tuple[str, str]]:
    """(sha256, store key) of every package the store holds for forward `key`: one per digest, then the one
    a store written before packages were kept by digest holds (its digest as the store records it)."""
    out = []
    for obj in store.list(layout.artifact_prefix(key)):
        parsed = layout.parse(obj)
        if parsed and parsed["kind"] == "forward" and parsed["key"] == key:
            out.append((parsed["sha256"], obj))
    legacy = store.stat(layout.legacy_artifact_key(key))
    if legacy is not None and legacy.sha256 and all(sha != legacy.sha256 for sha, _ in out):
        out.append((legacy.sha256, layout.legacy_artifact_key(key)))
    return sorted(out)


def _vouches(store, key: str, sha256: str) -> list:
    """Every vouch document stored for (key, sha256), one per signer (and a store's older single vouch)."""
    docs = []
    for obj in [*store.list(layout.vouch_prefix(key, sha256)), layout.legacy_vouch_key(key, sha256)]:
        try:
            docs.append(store.get_json(obj))
        except (ObjectMissing, IntegrityError, ValueError):
            continue
        except StoreError as exc:  # unreadable for good (e.g. a file written behind the store's back): no vouch
            if exc.transient:
                raise
    return docs


def find_trusted(store, key: str, trusted: dict, own: str | None = None) -> tuple[Stored | None, list[str]]:
    """(the package of `key` this export may load, or None; the sha256s of the packages at `key` that no key
    of `trusted` (fingerprint -> public key) vouched for).

    `own` is the digest this export's compiling host returned for the key (its task's word, not the
    store's): that package is the one loaded. Otherwise the first digest (in sorted order) that a trusted
    key vouched for.
    """
    from kiln.core.trust.vouch import check_vouch, vouched_calls

    mine = first = None
    untrusted = []
    for sha256, obj in packages_of(store, key):
        vouched = None
        for doc in _vouches(store, key, sha256):
            signer = check_vouch(doc, key, sha256, trusted)
            if signer:
                vouched = Stored(key, sha256, obj, vouched_calls(doc), signer)
                break
        if sha256 == own:
            mine = vouched or Stored(key, sha256, obj, None, None)
        elif vouched is None:
            untrusted.append(sha256)
        elif first is None:
            first = vouched
    return mine or first, untrusted


def trusted_packages(store, keys: list[str], trusted: dict, own: dict[str, str]
                     ) -> tuple[dict[str, Stored], dict[str, list[str]]]:
    """(key -> the package it may load, for each of `keys` the store holds one of; key -> the digests at it
    nobody trusted vouched for). `own`: key -> the digest this export compiled (`find_trusted`)."""
    found, untrusted = {}, {}
    for key in keys:
        package, others = find_trusted(store, key, trusted, own.get(key))
        if package is not None:
            found[key] = package
        if others:
            untrusted[key] = others
    return found, untrusted


def untrusted_note(store, keys: list[str], trusted: dict) -> str | None:
    """The warning naming the packages at `keys` that no key of `trusted` vouched for, or None when there are
    none (kiln.core.trust.vouch.untrusted_warning)."""
    from kiln.core.trust.vouch import untrusted_warning

    _, untrusted = trusted_packages(store, keys, trusted, {})
    return untrusted_warning(untrusted, trusted) if untrusted else None


def stored_forwards(store, keys: list[str], packages: dict[str, Stored]) -> tuple[dict[str, dict], list[str]]:
    """(key -> {'sha256', 'size_bytes', 'object', 'calls'} of each forward it may load, the keys without one).

    `packages`: key -> its trusted package (`trusted_packages`). 'calls' is what the package's wrapper
    calls (kiln.host.trust.package_check.package_calls), as its signed vouch says; a package without
    one (this export's own compile, or a store's older vouch) is downloaded, checked against its trusted
    digest and inspected here: an unsigned record of it is never believed.
    """
    import shutil

    from kiln.host.processes import scratch
    from kiln.host.trust.package_check import check_package, package_calls

    found, missing = {}, []
    for key in keys:
        package = packages.get(key)
        info = store.stat(package.object) if package else None
        if info is None:
            missing.append(key)
            continue
        if info.sha256 != package.sha256:
            raise IntegrityError(f"forward {key}: the store now records sha256 {info.sha256} for "
                                 f"{package.object}, not the trusted {package.sha256}; it was changed behind this "
                                 "export. Export again: the export compiles its own.")
        calls = package.calls
        if calls is None:
            tmp = scratch.mkdtemp("kiln-inspect-")  # this process's own: swept at the next start if it is killed
            try:
                path = Path(tmp) / f"{key}.pt2"
                store.get_file(package.object, path, package.sha256)
                check_package(path)
                calls = package_calls(path).to_dict()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        found[key] = {"sha256": package.sha256, "size_bytes": info.size_bytes, "object": package.object,
                      "calls": {k: calls[k] for k in ("python_free", "ops", "why")}}
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
            store.get_file(f["object"], path, f["sha256"])
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            raise DiskError(f"host {host.name} cannot write forward {f['key']} into its cache: "
                            f"{exc.strerror} ({exc.filename or path}); free space there or point "
                            "KILN_CACHE_DIR at a writable local disk with room.") from None
        fetched += 1
    return fetched
