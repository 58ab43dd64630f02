"""What examples/torch_only.py checks before it loads anything, without an export: the signed bytes are Kiln's,
keys are read as `kiln verify` reads them, and which CPU targets this host is taken to run.

The same checks against a real export, run as torch alone: tests/integration/test_torch_only.py.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

from kiln.core.trust import signing
from kiln.store.base import json_bytes

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import torch_only  # noqa: E402


@pytest.mark.parametrize("target, machine, level, refused", [
    ("cpu-x86_64-avx512-1a2b3c4d", "x86_64", "AVX512", None),
    ("cpu-x86_64-avx2-1a2b3c4d", "x86_64", "AVX512", None),  # AVX512 runs AVX2 code
    ("cpu-x86_64-default-1a2b3c4d", "x86_64", "AVX2", None),
    ("cpu-x86_64-avx512-1a2b3c4d", "x86_64", "AVX2", "ISA level avx512, and this CPU's level is avx2"),
    ("cpu-aarch64-sve256-1a2b3c4d", "aarch64", "SVE128", "ISA level sve256"),
    ("cpu-aarch64-default-1a2b3c4d", "x86_64", "AVX512", "(machine aarch64) and this host's machine is x86_64"),
    ("test", "x86_64", "AVX512", "is not a CPU target this script can check"),
])
def test_which_cpu_targets_run_here(target, machine, level, refused):
    problem = torch_only.cpu_target_problem(target, machine, level)
    assert problem == refused if refused is None else refused in problem


def test_the_signed_bytes_are_kilns():
    manifest = {"version": 5, "b": [1e-06, 0.1, 1e22, -0.0], "a": "t\u00e9st \"q\" \\", "\u00fc": {}}
    assert torch_only.canonical_bytes(manifest) == signing.canonical_bytes(manifest)


def test_keys_are_read_as_kiln_verify_reads_them(tmp_path):
    keys = [signing.generate().public_key() for _ in range(2)]
    prints = {signing.fingerprint(k) for k in keys}
    pem = tmp_path / "both.pub"
    pem.write_bytes(b"".join(signing.public_pem(k) for k in keys))
    b64 = ",".join(base64.b64encode(signing.raw_public(k)).decode() for k in keys)
    (tmp_path / "both.b64").write_text(b64)
    assert set(torch_only.trusted_keys([pem], "")) == prints
    assert set(torch_only.trusted_keys([], b64)) == prints
    assert set(torch_only.trusted_keys([], str(tmp_path / "both.b64"))) == prints  # KILN_VERIFY_KEY as a path
    assert set(torch_only.trusted_keys([], pem.read_text())) == prints
    private = tmp_path / "private.key"
    private.write_bytes(signing.private_pem(signing.generate()))
    with pytest.raises(SystemExit, match=f"--verify-key {private} holds a private key"):
        torch_only.trusted_keys([private], "")
    with pytest.raises(SystemExit, match="KILN_VERIFY_KEY is neither PEM nor base64"):
        torch_only.trusted_keys([], "not a key")


def test_a_signed_manifest_verifies_however_it_is_spelled_and_not_once_changed(tmp_path):
    """Python re-encodes what it parsed, so a manifest stored with other whitespace or key order still verifies;
    a changed value does not, and the refusal names the signature file and the key."""
    key = signing.generate()
    fp = signing.fingerprint(key.public_key())
    manifest = {"version": 5, "export_id": "x", "signing": {"signed": True, "key_fingerprint": fp},
                "recipe": {"verify_atol": 1e-06}}
    (tmp_path / "manifest.sig").write_bytes(json_bytes(signing.sign_manifest(manifest, key)))
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(dict(reversed(list(manifest.items()))), indent=4))
    got, note = torch_only.read_verified_manifest(path, {fp: key.public_key()}, allow_unsigned=False)
    assert got == manifest and note == f"signature ok: signed by {fp}"
    path.write_text(json.dumps({**manifest, "export_id": "y"}))
    with pytest.raises(SystemExit, match=f"the signature {tmp_path / 'manifest.sig'} of manifest {path} does not "
                                         f"verify with key {fp}: the manifest was changed after it was signed"):
        torch_only.read_verified_manifest(path, {fp: key.public_key()}, allow_unsigned=False)
