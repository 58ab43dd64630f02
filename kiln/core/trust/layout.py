"""The store's layout: every object key Kiln writes, built here and parsed back here.

Pure. No other module spells a store path. Each kind of object has a
builder and `parse` inverts every builder (tests/unit/test_layout.py checks
the round trip):

    forwards/<key>.pt2                       a compiled forward (AOTInductor package, no weights)
    inspections/<key>.json                   what that package calls (kiln.host.trust.package_check)
    vouches/<key>/<sha256>.json              a signed word that those bytes are Kiln's (kiln.core.trust.vouch)
    memory/<graph digest>/<key>.json         a compile worker's measured peak, per (graph, target, compiler)
    tuning/<result id>.json                  one GEMM shape's kernel-tuning result
    leases/<key>/<generation:08d>.json       a compile lease on a forward key
    exports/<export id>/manifest.json        the export's manifest, and manifest.sig beside it
    exports/<export id>/compiled/<key>.json  who compiled a forward in that export, how long it took
    exports/<export id>/memory-<sha12>.png   the export's memory ledger picture
"""

from __future__ import annotations

import re

from kiln.core.forwards.forward_keys import ForwardSpec, digest

FORWARDS = "forwards/"
INSPECTIONS = "inspections/"
VOUCHES = "vouches/"
MEMORY = "memory/"
TUNING = "tuning/"
LEASES = "leases/"
EXPORTS = "exports/"


def artifact_key(key: str) -> str:
    """Where a forward's package lives."""
    return f"{FORWARDS}{key}.pt2"


def inspection_key(key: str) -> str:
    """Where the record of what a forward's package calls lives, with the sha256 of the bytes inspected."""
    return f"{INSPECTIONS}{key}.json"


def vouch_key(key: str, sha256: str) -> str:
    """Where the vouch for forward `key`'s package with `sha256` lives (kiln.core.trust.vouch)."""
    return f"{VOUCHES}{key}/{sha256}.json"


def graph_digest(spec: ForwardSpec) -> str:
    """What a worker's memory depends on: the forward's graph, target and compiler options (not its bucket)."""
    return digest({"graph": spec.graph, "target": spec.target, "compiler": spec.compiler})


def worker_memory_prefix(spec: ForwardSpec) -> str:
    """Where the measured worker peaks of a forward's graph live: new buckets of one graph share them."""
    return f"{MEMORY}{graph_digest(spec)}/"


def worker_memory_key(spec: ForwardSpec, key: str) -> str:
    return f"{worker_memory_prefix(spec)}{key}.json"


def tuning_key(result_id: str) -> str:
    """Where one GEMM shape's tuning result lives (its id: kiln.core.plan.tuning_plan.result_id)."""
    return f"{TUNING}{result_id}.json"


def lease_prefix(key: str) -> str:
    return f"{LEASES}{key}/"


def lease_key(key: str, generation: int) -> str:
    return f"{LEASES}{key}/{generation:08d}.json"


def generation_of(object_key: str) -> int:
    """The generation of a lease object (`lease_key`'s inverse, for its number)."""
    parsed = parse(object_key)
    if not parsed or parsed["kind"] != "lease":
        raise ValueError(f"{object_key!r} is not a lease object")
    return parsed["generation"]


def lease_generations(key: str, object_keys) -> dict[int, str]:
    """generation -> object key of each lease of `key` among `object_keys` (a listing of `lease_prefix(key)`).

    Anything else under the prefix (an object Kiln did not write there) is no lease and is ignored.
    """
    out = {}
    for obj in object_keys:
        parsed = parse(obj)
        if parsed and parsed["kind"] == "lease" and parsed["key"] == key:
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
_PATTERNS = [
    ("forward", re.compile(rf"{FORWARDS}(?P<key>{_NAME})\.pt2")),
    ("inspection", re.compile(rf"{INSPECTIONS}(?P<key>{_NAME})\.json")),
    ("vouch", re.compile(rf"{VOUCHES}(?P<key>{_NAME})/(?P<sha256>[0-9a-f]{{64}})\.json")),
    ("worker_memory", re.compile(rf"{MEMORY}(?P<graph>[0-9a-f]+)/(?P<key>{_NAME})\.json")),
    ("tuning", re.compile(rf"{TUNING}(?P<result_id>[0-9a-f]+)\.json")),
    ("lease", re.compile(rf"{LEASES}(?P<key>{_NAME})/(?P<generation>\d{{8,}})\.json")),
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
