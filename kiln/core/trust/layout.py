"""The store's layout: every object key Kiln writes, built here and parsed back here.

Pure. No other module spells a store path. Each kind of object has a
builder and `parse` inverts every builder (tests/unit/test_layout.py checks
the round trip):

    forwards/<key>/<sha256>.pt2              a compiled forward (AOTInductor package, no weights), by its digest
    vouches/<key>/<sha256>/<signer>.json     one signer's signed word that those bytes are Kiln's, and what
                                             they call (kiln.core.trust.vouch); <signer>: its fingerprint
    memory/<graph digest>/<key>.json         a compile worker's measured peak, per (graph, target, compiler), signed
    tuning/<result id>/<signer>.json         one GEMM shape's kernel-tuning result, as one signer measured it
    leases/<key>/<scope>/<generation:08d>.json  a compile lease on a forward key, among exports of one signer
    exports/<export id>/manifest.json        the export's manifest, and manifest.sig beside it
    exports/<export id>/compiled/<key>.json  who compiled a forward in that export, how long it took
    exports/<export id>/memory-<sha12>.png   the export's memory ledger picture

Many signers share one store: a key may hold several packages (one per
compile), each with the vouches of whoever compiled it; an export loads one
that a key it trusts vouched for, and compiles (and adds) its own otherwise.
Nothing is replaced or deleted to make room, so every manifest stays valid.

Stores written before packages were kept by digest hold `forwards/<key>.pt2`
and `vouches/<key>/<sha256>.json` (one signer per digest); they are read as
they are (`legacy_artifact_key`, `legacy_vouch_key`) and never written.
"""

from __future__ import annotations

import re

from kiln.core.forwards.forward_keys import ForwardSpec, digest

FORWARDS = "forwards/"
VOUCHES = "vouches/"
MEMORY = "memory/"
TUNING = "tuning/"
LEASES = "leases/"
EXPORTS = "exports/"


def artifact_prefix(key: str) -> str:
    """Where the packages of forward `key` live, one per digest."""
    return f"{FORWARDS}{key}/"


def artifact_key(key: str, sha256: str) -> str:
    """Where forward `key`'s package with `sha256` lives."""
    return f"{FORWARDS}{key}/{sha256}.pt2"


def legacy_artifact_key(key: str) -> str:
    """Where a store written before packages were kept by digest holds forward `key`'s one package."""
    return f"{FORWARDS}{key}.pt2"


def signer_name(fingerprint: str) -> str:
    """A key fingerprint ('ed25519:<hex>') as one path segment ('ed25519-<hex>')."""
    return fingerprint.replace(":", "-")


def vouch_prefix(key: str, sha256: str) -> str:
    """Where the vouches of every signer for forward `key`'s package with `sha256` live."""
    return f"{VOUCHES}{key}/{sha256}/"


def vouch_key(key: str, sha256: str, fingerprint: str) -> str:
    """Where the vouch of the key with `fingerprint` for forward `key`'s package `sha256` lives."""
    return f"{vouch_prefix(key, sha256)}{signer_name(fingerprint)}.json"


def legacy_vouch_key(key: str, sha256: str) -> str:
    """Where a store written before packages were kept by digest holds the one vouch for (key, sha256)."""
    return f"{VOUCHES}{key}/{sha256}.json"


def graph_digest(spec: ForwardSpec) -> str:
    """What a worker's memory depends on: the forward's graph, target and compiler options (not its bucket)."""
    return digest({"graph": spec.graph, "target": spec.target, "compiler": spec.compiler})


def worker_memory_prefix(spec: ForwardSpec) -> str:
    """Where the measured worker peaks of a forward's graph live: new buckets of one graph share them."""
    return f"{MEMORY}{graph_digest(spec)}/"


def worker_memory_key(spec: ForwardSpec, key: str) -> str:
    return f"{worker_memory_prefix(spec)}{key}.json"


def tuning_prefix(result_id: str) -> str:
    """Where every signer's result of one GEMM shape (its id: kiln.core.plan.tuning_plan.result_id) lives."""
    return f"{TUNING}{result_id}/"


def tuning_key(result_id: str, fingerprint: str) -> str:
    """Where the result of one GEMM shape measured by the export signed with `fingerprint` lives."""
    return f"{tuning_prefix(result_id)}{signer_name(fingerprint)}.json"


def lease_key_prefix(key: str) -> str:
    """Where the leases on `key` of every scope live."""
    return f"{LEASES}{key}/"


def lease_prefix(key: str, scope: str) -> str:
    """Where the leases on `key` among the exports of one `scope` (their signer) live."""
    return f"{lease_key_prefix(key)}{scope}/"


def lease_key(key: str, scope: str, generation: int) -> str:
    return f"{lease_prefix(key, scope)}{generation:08d}.json"


def generation_of(object_key: str) -> int:
    """The generation of a lease object (`lease_key`'s inverse, for its number)."""
    parsed = parse(object_key)
    if not parsed or parsed["kind"] != "lease":
        raise ValueError(f"{object_key!r} is not a lease object")
    return parsed["generation"]


def lease_generations(key: str, scope: str, object_keys) -> dict[int, str]:
    """generation -> object key of each lease of `key` in `scope` among `object_keys` (a listing of
    `lease_prefix(key, scope)`).

    Anything else under the prefix (an object Kiln did not write there) is no lease and is ignored.
    """
    out = {}
    for obj in object_keys:
        parsed = parse(obj)
        if parsed and parsed["kind"] == "lease" and parsed["key"] == key and parsed["scope"] == scope:
            out[parsed["generation"]] = obj
    return out


def manifest_key(export_id: str) -> str:
    return f"{EXPORTS}{export_id}/manifest.json"


def signature_key(export_id: str) -> str:
    """The manifest's signature document, beside it."""
    return f"{EXPORTS}{export_id}/manifest.sig"


def compile_log_key(export_id: str, key: str) -> str:
    return f"{EXPORTS}{export_id}/compiled/{key}.json"


def ledger_picture_key(export_id: str, png_sha12: str) -> str:
    return f"{EXPORTS}{export_id}/memory-{png_sha12}.png"


_NAME = r"[A-Za-z0-9._-]+"
_SHA256 = r"[0-9a-f]{64}"
_PATTERNS = [
    ("forward", re.compile(rf"{FORWARDS}(?P<key>{_NAME})/(?P<sha256>{_SHA256})\.pt2")),
    ("legacy_forward", re.compile(rf"{FORWARDS}(?P<key>{_NAME})\.pt2")),
    ("vouch", re.compile(rf"{VOUCHES}(?P<key>{_NAME})/(?P<sha256>{_SHA256})/(?P<signer>{_NAME})\.json")),
    ("legacy_vouch", re.compile(rf"{VOUCHES}(?P<key>{_NAME})/(?P<sha256>{_SHA256})\.json")),
    ("worker_memory", re.compile(rf"{MEMORY}(?P<graph>[0-9a-f]+)/(?P<key>{_NAME})\.json")),
    ("tuning", re.compile(rf"{TUNING}(?P<result_id>[0-9a-f]+)/(?P<signer>{_NAME})\.json")),
    ("lease", re.compile(rf"{LEASES}(?P<key>{_NAME})/(?P<scope>{_NAME})/(?P<generation>\d{{8,}})\.json")),
    ("manifest", re.compile(rf"{EXPORTS}(?P<export_id>{_NAME})/manifest\.json")),
    ("signature", re.compile(rf"{EXPORTS}(?P<export_id>{_NAME})/manifest\.sig")),
    ("compile_log", re.compile(rf"{EXPORTS}(?P<export_id>{_NAME})/compiled/(?P<key>{_NAME})\.json")),
    ("ledger_picture", re.compile(rf"{EXPORTS}(?P<export_id>{_NAME})/memory-(?P<png_sha12>[0-9a-f]{{12}})\.png")),
]


def parse(object_key: str) -> dict | None:
    """{'kind', and the builder's arguments} of an object key this layout builds; None for any other key."""
    for kind, pattern in _PATTERNS:
        m = pattern.fullmatch(object_key)
        if m:
            out = {"kind": kind, **m.groupdict()}
            if "generation" in out:
                out["generation"] = int(out["generation"])
            return out
    return None
