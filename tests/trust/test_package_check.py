"""The members of a package are checked before anything extracts it: synthetic zips, no torch."""

from __future__ import annotations

import stat
import struct
import zipfile
from pathlib import Path

import pytest

from kiln.core.errors import IntegrityError
from kiln.host.trust.package_check import PackageLimits, check_package

ROOT = "fwd"
GOOD = {
    f"{ROOT}/archive_format": b"pt2",
    f"{ROOT}/archive_version": b"0",
    f"{ROOT}/byteorder": b"little",
    f"{ROOT}/.data/version": b"1\n",
    f"{ROOT}/data/aotinductor/model/abc.wrapper.cpp": b"// code\n",
    f"{ROOT}/data/aotinductor/model/abc.wrapper.so": b"\x7fELF" + b"\0" * 4000,
}


def make(path: Path, members: dict[str, bytes], *, symlinks=(), compression=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, target in symlinks:
            info = zipfile.ZipInfo(name)
            info.create_system = 3
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return path


def refused(path: Path, *needles: str, limits: PackageLimits = PackageLimits()) -> str:
    with pytest.raises(IntegrityError) as err:
        check_package(path, limits)
    msg = str(err.value)
    assert str(path) in msg and "not extracted or loaded" in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_a_pt2_layout_passes(tmp_path):
    assert check_package(make(tmp_path / "ok.pt2", GOOD)) == len(GOOD)


def test_a_deflated_package_passes(tmp_path):
    assert check_package(make(tmp_path / "ok.pt2", GOOD, compression=zipfile.ZIP_DEFLATED)) == len(GOOD)


@pytest.mark.parametrize(("name", "needle"), [
    ("/etc/cron.d/evil", "absolute path"),
    (f"{ROOT}/../../evil.so", "'..'"),
    (f"{ROOT}/data/./x", "'.'"),
    (f"{ROOT}//data/x", "empty"),
    (f"{ROOT}\\data\\x", "backslash"),
    ("C:/evil", "absolute path"),
    (f"{ROOT}/data/x\x01", "control"),
    (f"{ROOT}/data/cafe\u0301", "NFC"),
])
def test_dangerous_member_names(tmp_path, name, needle):
    refused(make(tmp_path / "bad.pt2", {**GOOD, name: b"x"}), needle)


def test_symlink_member(tmp_path):
    p = make(tmp_path / "bad.pt2", GOOD, symlinks=[(f"{ROOT}/data/aotinductor/model/libc.so", "/lib/libc.so.6")])
    refused(p, "symlink", "libc.so")


def test_duplicate_and_colliding_members(tmp_path):
    path = tmp_path / "dup.pt2"
    make(path, GOOD)
    with zipfile.ZipFile(path, "a") as zf, pytest.warns(UserWarning):
        zf.writestr(f"{ROOT}/byteorder", b"big")
    refused(path, "appears twice")
    refused(make(tmp_path / "case.pt2", {**GOOD, f"{ROOT}/data/aotinductor/model/ABC.wrapper.so": b"x"}),
            "case-folding")


@pytest.mark.parametrize(("members", "needle"), [
    ({**GOOD, "other/x": b"x"}, "2 top-level entries"),
    ({**GOOD, f"{ROOT}/hooks/run.sh": b"x"}, "'hooks'"),
    ({k: v for k, v in GOOD.items() if not k.endswith("archive_format")}, "archive_format"),
    ({**GOOD, f"{ROOT}/archive_format": b"zip"}, "archive_format"),
    ({k: v for k, v in GOOD.items() if "aotinductor" not in k}, "no AOTInductor code"),
    ({"loose": b"x"}, "outside the archive's top-level directory"),
])
def test_unexpected_layouts(tmp_path, members, needle):
    refused(make(tmp_path / "layout.pt2", members), needle)


def test_not_a_zip_and_empty_zip(tmp_path):
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"\x7fELF not a zip at all")
    refused(junk, "not a readable zip")
    refused(make(tmp_path / "empty.pt2", {}), "no members")


def test_size_limits(tmp_path):
    p = make(tmp_path / "ok.pt2", GOOD)
    refused(p, "members (limit 3)", limits=PackageLimits(max_members=3))
    refused(p, "limit 100", limits=PackageLimits(max_member_bytes=100))
    refused(p, "bytes in all", limits=PackageLimits(max_total_bytes=1000))


def test_zip_bomb_ratio(tmp_path):
    bomb = make(tmp_path / "bomb.pt2", {**GOOD, f"{ROOT}/data/aotinductor/model/zeros.bin": b"\0" * (16 << 20)},
                compression=zipfile.ZIP_DEFLATED)
    refused(bomb, "ratio limit")


def test_a_header_that_lies_about_the_size_is_caught_on_read(tmp_path):
    path = make(tmp_path / "liar.pt2", GOOD)
    data = bytearray(path.read_bytes())
    name = f"{ROOT}/data/aotinductor/model/abc.wrapper.so".encode()
    # Shrink the declared uncompressed size in the central directory and the local header.
    for sig, size_at in ((b"PK\x01\x02", 24), (b"PK\x03\x04", 22)):
        start = 0
        while (i := data.find(sig, start)) != -1:
            name_at = i + (46 if sig == b"PK\x01\x02" else 30)
            if data[name_at:name_at + len(name)] == name:
                struct.pack_into("<I", data, i + size_at, 100)
            start = i + 4
    path.write_bytes(bytes(data))
    refused(path, "abc.wrapper.so")


def test_encrypted_member(tmp_path):
    path = make(tmp_path / "enc.pt2", GOOD)
    data = bytearray(path.read_bytes())
    i = data.find(b"PK\x01\x02")  # first central directory entry: set the 'encrypted' flag bit
    struct.pack_into("<H", data, i + 8, struct.unpack_from("<H", data, i + 8)[0] | 1)
    path.write_bytes(bytes(data))
    refused(path, "encrypted")
