"""What a loader of a finished export gets from `fetch_verified_export`: only checked files (local store)."""

from __future__ import annotations

import hashlib
import io
import stat
import zipfile

import pytest

from kiln.host.trust import signers as trust
from cli.verify import fetch_verified_export
from kiln.core.errors import BadInput, IntegrityError
from kiln.core.machine.cpu_target import CpuIsa
from kiln.host.machine.probe import detect_target
from kiln.core.trust.manifest import build_manifest
from kiln.store import LocalStore

KEY = "ab" * 16


def package(*, symlink: bool = False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("p/archive_format", b"pt2")
        zf.writestr("p/data/aotinductor/model/x.wrapper.so", b"\x7fELF" + b"\0" * 100)
        if symlink:
            info = zipfile.ZipInfo("p/data/aotinductor/model/evil.so")
            info.create_system, info.external_attr = 3, (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, "/bin/sh")
    return buf.getvalue()


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.delenv(trust.SIGNING_KEY_ENV, raising=False)
    monkeypatch.delenv(trust.VERIFY_KEY_ENV, raising=False)
    home, store = tmp_path / "home", LocalStore(tmp_path / "store")

    here = detect_target("cpu").cpu_isa

    def export(data: bytes, cpu: CpuIsa = here) -> None:
        plan, _ = trust.plan_signing(sign=True, block=None, store=store, home=home)
        store.delete(f"forwards/{KEY}.pt2")
        store.put_bytes(f"forwards/{KEY}.pt2", data)
        fwd = {"key": KEY, "shapes": "1x8", "batch": [1, 1], "tokens": [8, 8], "hint": [1, 8],
               "target": cpu.fingerprint, "target_cpu": cpu.to_dict(), "sha256": hashlib.sha256(data).hexdigest(),
               "size_bytes": len(data), "object": f"forwards/{KEY}.pt2", "python_free": True,
               "interface": {"process_group": None}}
        m = build_manifest(export_id="e1", model={}, recipe={}, tp=1, buckets=["1x8"], forwards=[fwd], weights={},
                           kv_plan={},
                           hosts=[], phases=[], signing=plan.manifest_entry())
        trust.write_signed_manifest(store, "e1", m, plan, home)

    def fetch():
        return fetch_verified_export(store, "e1", tmp_path / "dest",
                                     trusted=lambda: trust.trusted_keys(store=store, home=home))

    return store, export, fetch, tmp_path / "dest"


def test_a_good_export_yields_checked_local_files(setup):
    store, export, fetch, dest = setup
    export(package())
    manifest, artifacts, lines = fetch()
    assert artifacts == {"1x8": {"path": str(dest / f"{KEY}.pt2"), "sha256": manifest["forwards"][0]["sha256"],
                                 "object": manifest["forwards"][0]["object"], "shapes": "1x8"}}
    assert (dest / f"{KEY}.pt2").read_bytes() == package()
    assert [line.split(":")[0] for line in lines[1:]] == ["signature ok", "device cpu", "sha256 ok for 1 artifact(s)",
                                                          "package members ok for 1 artifact(s); loading with runtime input checks on"]


def test_bytes_changed_behind_the_store_are_refused_and_not_left_behind(setup):
    store, export, fetch, dest = setup
    export(package())
    (store.root / f"forwards/{KEY}.pt2").write_bytes(package()[:-1] + b"!")  # through the link into the blob
    with pytest.raises(IntegrityError, match=f"forwards/{KEY}.pt2"):
        fetch()
    assert not dest.exists() or not any(dest.iterdir())


def test_a_signed_but_dangerous_package_is_refused(setup):
    store, export, fetch, dest = setup
    export(package(symlink=True))  # the manifest vouches for these bytes; their members still get checked
    with pytest.raises(IntegrityError, match="symlink"):
        fetch()


def test_a_package_for_a_cpu_this_host_cannot_run_is_refused_before_it_is_fetched(setup):
    store, export, fetch, dest = setup
    here = detect_target("cpu").cpu_isa
    other = CpuIsa(arch="riscv64" if here.arch != "riscv64" else "x86_64", level="default", flags=())
    export(package(), other)
    with pytest.raises(BadInput, match=f"forward {KEY} is for {other.fingerprint}: it is {other.arch} code and "
                                       f"this CPU is {here.arch}.*To fix"):
        fetch()
    assert not dest.exists() or not any(dest.iterdir())
