"""Loading a real compiled forward: package members checked first, weights bound first, wrong shapes raise.

Loading native code can take a process down, so every load runs in a
subprocess that reports what happened as JSON on its last line.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
import zipfile

import pytest

from kiln.core.errors import IntegrityError
from kiln.host.trust.package_check import check_package
from kiln.host.ranks.loader import load_forward
from kiln.store import sha256_file

pytestmark = pytest.mark.slow

LOAD_AND_CALL = r"""
import json, sys
import torch
from kiln.core.model.config import ModelConfig
from kiln.host.ranks.loader import load_forward
from kiln.host.model import ShardedDecoder, example_inputs

job = json.loads(sys.argv[1])
cfg = ModelConfig(**job["config"])
torch.manual_seed(3)
eager = ShardedDecoder(cfg, 1).eval()
weights = dict(eager.state_dict())
compiled = load_forward(job["path"], weights, job["sha256"])
out = {"checks_on": __import__("os").environ.get("AOTI_RUNTIME_CHECK_INPUTS")}
def inputs(batch, tokens):
    return example_inputs(cfg, 1, batch, tokens, page_tokens=job["page_tokens"],
                          pages_per_seq=job["pages_per_seq"], num_pages=job["pages_per_seq"] + 3, seed=1)
with torch.no_grad():
    args = inputs(job["batch"], job["tokens"])
    got, want = compiled(*args), eager(*args)
    out["diff"] = max(float((g - w).abs().max()) for g, w in zip(got, want))
    for name, bad in [("tokens", inputs(job["batch"], job["tokens"] + 1)),
                      ("batch", inputs(job["batch"] + 1, job["tokens"])),
                      ("kv heads", args[:2] + (args[2][..., :1, :].contiguous(),) + args[3:]),
                      ("dtype", (args[0].to(torch.int32),) + args[1:])]:
        try:
            compiled(*bad)
            out[name] = "no error"
        except RuntimeError as exc:
            out[name] = "RuntimeError"
print(json.dumps(out))
"""


def run_loader(job: dict) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_CALL, json.dumps(job)], capture_output=True, text=True,
                          timeout=600)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return proc, json.loads(last) if last.startswith("{") else None


def test_the_real_package_has_the_layout_the_check_expects(small_forward):
    assert check_package(small_forward["path"]) >= 5
    with zipfile.ZipFile(small_forward["path"]) as zf:
        assert any(n.endswith(".wrapper.so") for n in zf.namelist())
        assert sum(i.file_size for i in zf.infolist()) < 5 * 2**20  # weightless


def test_wrong_input_shapes_raise_instead_of_crashing(small_forward):
    proc, out = run_loader(small_forward)
    assert proc.returncode == 0 and out is not None, proc.stderr[-3000:]
    assert out["checks_on"] == "1"
    assert out["diff"] < 1e-3
    assert {k: out[k] for k in ("tokens", "batch", "kv heads", "dtype")} == dict.fromkeys(
        ("tokens", "batch", "kv heads", "dtype"), "RuntimeError")


def test_a_package_with_a_bad_member_is_refused_before_extraction(small_forward, tmp_path, monkeypatch):
    bad = tmp_path / "bad.pt2"
    shutil.copy(small_forward["path"], bad)
    with zipfile.ZipFile(bad) as zf:
        root = zf.namelist()[0].split("/")[0]
    with zipfile.ZipFile(bad, "a") as zf:
        info = zipfile.ZipInfo(f"{root}/data/aotinductor/model/libevil.so")
        info.create_system = 3
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    import torch._inductor

    calls = []
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda *a, **k: calls.append(a))
    # The sha256 matches (a manifest built from a bad artifact): the member check still refuses it.
    with pytest.raises(IntegrityError, match="is a symlink"):
        load_forward(bad, {}, sha256_file(bad))
    assert calls == []  # never handed to AOTInductor


def test_a_package_whose_sha256_does_not_match_is_not_loaded(small_forward, tmp_path):
    copy = tmp_path / "copy.pt2"
    data = bytearray(open(small_forward["path"], "rb").read())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    proc, out = run_loader({**small_forward, "path": str(copy)})
    assert proc.returncode == 1 and out is None
    assert "IntegrityError" in proc.stderr and "does not match the manifest" in proc.stderr
