"""Forward keys cover every source that shapes a package (kiln.host.key_sources)."""

from __future__ import annotations

import sys

import pytest

from kiln.core.forward_keys import forward_spec
from kiln.core.recipe import Bucket
from kiln.host import key_sources
from kiln.host.key_sources import KEY_SOURCES, code_fingerprint, model_code_fingerprint, source_files


def _key(code: str) -> str:
    return forward_spec(bucket=Bucket(1, 8), graph={"config": {}, "tp": 1, "code": code}, target="cpu-x",
                        torch_version="2.13.0", page_tokens=16, pages_per_seq=4, compiler={}).key


def test_the_compiler_and_its_options_are_key_sources():
    assert {"kiln.host.model", "kiln.host.compiler", "kiln.host.inductor_options",
            "kiln.core.contract"} <= set(KEY_SOURCES)


@pytest.mark.parametrize("module", KEY_SOURCES)
def test_a_change_in_each_key_source_changes_the_keys(monkeypatch, module):
    before = model_code_fingerprint()
    changed = {path for _, path in source_files(module)}
    real_read = key_sources._read
    monkeypatch.setattr(key_sources, "_read", lambda p: real_read(p) + (b"\n# edited\n" if p in changed else b""))
    after = model_code_fingerprint()
    assert after != before and _key(after) != _key(before)


def test_the_fingerprint_is_stable_and_ordered():
    assert model_code_fingerprint() == model_code_fingerprint()
    assert code_fingerprint(KEY_SOURCES) != code_fingerprint(tuple(reversed(KEY_SOURCES)))


def test_a_package_hashes_every_py_file_of_it(tmp_path, monkeypatch):
    pkg = tmp_path / "keysrc_pkg"
    (pkg / "layers").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "layers" / "attention.py").write_text("HEADS = 4\n")
    (pkg / "notes.txt").write_text("not code")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [name for name, _ in source_files("keysrc_pkg")] == ["keysrc_pkg/__init__.py",
                                                                "keysrc_pkg/layers/attention.py"]
    before = code_fingerprint(("keysrc_pkg",))
    (pkg / "notes.txt").write_text("still not code")
    assert code_fingerprint(("keysrc_pkg",)) == before
    (pkg / "layers" / "attention.py").write_text("HEADS = 8\n")
    assert code_fingerprint(("keysrc_pkg",)) != before
    sys.modules.pop("keysrc_pkg", None)


def test_a_missing_key_source_is_an_error_not_a_silent_skip():
    with pytest.raises(LookupError, match="kiln.host.no_such_model.*KEY_SOURCES"):
        code_fingerprint(("kiln.host.no_such_model",))
