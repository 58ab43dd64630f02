"""The store layout has one owner (kiln/core/trust/layout.py): every builder's key parses back to its arguments,
no two kinds of object can share a key, and no other module spells a store path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.core.trust import layout
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.trust.key_rules import validate_key
from kiln.core.forwards.shape_ranges import parse_shape_range

KEY = "0123456789abcdef0123456789abcdef"
SPEC = ForwardSpec(key=KEY, shapes=parse_shape_range("1x8"), target="cpu-x86_64", graph={"layers": 2}, inputs={},
                   compiler={})
SHA = "ab" * 32
SIGNER = "ed25519:" + "cd" * 16
BUILT = [
    (layout.artifact_key(KEY, SHA), {"kind": "forward", "key": KEY, "sha256": SHA}),
    (layout.legacy_artifact_key(KEY), {"kind": "legacy_forward", "key": KEY}),
    (layout.vouch_key(KEY, SHA, SIGNER), {"kind": "vouch", "key": KEY, "sha256": SHA,
                                          "signer": layout.signer_name(SIGNER)}),
    (layout.legacy_vouch_key(KEY, SHA), {"kind": "legacy_vouch", "key": KEY, "sha256": SHA}),
    (layout.worker_memory_key(SPEC, KEY), {"kind": "worker_memory", "graph": layout.graph_digest(SPEC), "key": KEY}),
    (layout.tuning_key("ab" * 16, SIGNER), {"kind": "tuning", "result_id": "ab" * 16,
                                            "signer": layout.signer_name(SIGNER)}),
    (layout.lease_key(KEY, "unsigned", 7), {"kind": "lease", "key": KEY, "scope": "unsigned", "generation": 7}),
    (layout.manifest_key("tiny-tp2.x_1"), {"kind": "manifest", "export_id": "tiny-tp2.x_1"}),
    (layout.signature_key("tiny-tp2.x_1"), {"kind": "signature", "export_id": "tiny-tp2.x_1"}),
    (layout.compile_log_key("e1", KEY), {"kind": "compile_log", "export_id": "e1", "key": KEY}),
    (layout.ledger_picture_key("e1", "0123456789ab"), {"kind": "ledger_picture", "export_id": "e1",
                                                       "png_sha12": "0123456789ab"}),
]


@pytest.mark.parametrize("key, parsed", BUILT, ids=[p["kind"] for _, p in BUILT])
def test_every_key_parses_back_to_what_built_it(key, parsed):
    assert layout.parse(key) == parsed
    assert validate_key(key) == key  # a valid store key on every backend


def test_kinds_do_not_overlap():
    for key, parsed in BUILT:
        matches = [kind for kind, pattern in layout._PATTERNS if pattern.fullmatch(key)]
        assert matches == [parsed["kind"]], (key, matches)


def test_listings_and_generations():
    assert [layout.parse(k)["kind"] if layout.parse(k) else None for k in
            (layout.artifact_key("a1", SHA), layout.legacy_artifact_key("a1"), "forwards/x.txt",
             "forwards/a1/notadigest.pt2")] == ["forward", "legacy_forward", None, None]
    assert layout.artifact_key(KEY, SHA).startswith(layout.artifact_prefix(KEY))
    assert layout.vouch_key(KEY, SHA, SIGNER).startswith(layout.vouch_prefix(KEY, SHA))
    assert layout.generation_of(layout.lease_key(KEY, "s1", 12)) == 12
    assert layout.lease_key(KEY, "s1", 3).startswith(layout.lease_prefix(KEY, "s1"))
    assert layout.lease_prefix(KEY, "s1").startswith(layout.lease_key_prefix(KEY))
    # one scope's listing never counts another scope's leases
    listing = [layout.lease_key(KEY, "s1", 1), layout.lease_key(KEY, "s2", 2)]
    assert layout.lease_generations(KEY, "s1", listing) == {1: listing[0]}
    assert layout.worker_memory_key(SPEC, KEY).startswith(layout.worker_memory_prefix(SPEC))
    with pytest.raises(ValueError):
        layout.generation_of(layout.artifact_key(KEY, SHA))
    assert layout.parse("somewhere/else.json") is None


def test_no_other_module_spells_a_store_path():
    root = Path(__file__).resolve().parents[2]
    literal = re.compile(r"""["'](?:forwards|vouches|memory|tuning|leases|exports)/""")
    found = []
    for top in ("kiln", "flows", "tasks", "blocks", "cli", "bench"):
        for path in (root / top).rglob("*.py"):
            if path.name == "layout.py" and path.parent.name == "trust":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if literal.search(code) and not code.strip().startswith(('"""', "'")):
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, "store paths outside kiln/core/trust/layout.py:\n" + "\n".join(found)
