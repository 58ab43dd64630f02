"""Keys that filesystems would confuse: NFC, trailing dots/spaces, and collisions after normalisation."""

from __future__ import annotations

import unicodedata

import pytest

from kiln.core.errors import BadInput
from kiln.store import LocalStore, check_no_collisions, normalized_key, validate_key

CAFE_NFC = "caf\u00e9"
CAFE_NFD = unicodedata.normalize("NFD", CAFE_NFC)


@pytest.mark.parametrize(("key", "why"), [
    ("exports/run./manifest.json", "ending in '.'"),
    ("a/b ", "ending in '.' or ' '"),
    ("a../b", "ending in '.'"),
    (f"forwards/{CAFE_NFD}.pt2", "NFC"),
])
def test_keys_filesystems_would_rename_are_refused(key, why):
    with pytest.raises(BadInput, match=why):
        validate_key(key)


@pytest.mark.parametrize("key", [f"forwards/{CAFE_NFC}.pt2", "Exports/Run1/manifest.json", "a/.hidden", "a/..b"])
def test_nfc_and_mixed_case_keys_are_valid(key):
    assert validate_key(key) == key


def test_normalized_key_folds_case_unicode_form_and_trailing_dots():
    assert normalized_key("Forwards/A.PT2") == normalized_key("forwards/a.pt2")
    assert normalized_key(CAFE_NFD) == normalized_key(CAFE_NFC.upper())
    assert normalized_key("a./b ") == normalized_key("a/b")
    assert normalized_key("a/b") != normalized_key("a/c")


@pytest.mark.parametrize("keys", [
    ["forwards/a.pt2", "forwards/A.pt2"],
    ["Exports/x", "exports/x"],
    [CAFE_NFC, CAFE_NFD],
    ["a", "a"],
    ["straße", "STRASSE"],
])
def test_collisions_are_refused_naming_both(keys):
    with pytest.raises(BadInput) as err:
        check_no_collisions(keys)
    assert repr(keys[0]) in str(err.value)


def test_distinct_keys_pass():
    check_no_collisions(["forwards/a.pt2", "forwards/b.pt2", "exports/a/manifest.json", "a/b", "ab"])


def test_local_store_refuses_a_key_spelled_like_an_existing_one(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put_bytes("forwards/abc.pt2", b"one")
    for clash, existing in [("forwards/ABC.pt2", "forwards/abc.pt2"), ("Forwards/other.pt2", "forwards")]:
        with pytest.raises(BadInput, match="collides with") as err:
            store.put_bytes(clash, b"two")
        assert repr(existing) in str(err.value)
        with pytest.raises(BadInput, match="collides with"):
            store.put_json(clash, {"x": 1}, overwrite=True)
    assert store.list() == ["forwards/abc.pt2"]
    assert len(list((store.root / ".kiln" / "blobs").iterdir())) == 1  # refused writes leave no blob
    # Same spelling: create-once as before.
    assert store.put_bytes("forwards/abc.pt2", b"one") is False
    assert store.put_bytes("forwards/abd.pt2", b"three") is True
