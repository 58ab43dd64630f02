"""Check the members of a compiled package (.pt2, a zip) before anything extracts or loads it.

AOTInductor extracts a package into a temporary directory and dlopens the
shared library inside, so a package is checked member by member first, even
when its sha256 matched the manifest (the manifest may have been built from a
bad artifact, and the check costs one read of a few MiB). Refused, with
IntegrityError naming the package and the member:

- names that are absolute, hold '..' / '.' / empty parts, backslashes, control
  characters, are not NFC, or collide with another member after case-folding
  and Unicode normalisation (including exact duplicates);
- symlinks, devices, FIFOs (anything but regular files and directories) and
  encrypted members;
- too many members, a member or a total too large, a suspicious compression
  ratio; and every member is read through with a byte cap, so a header that
  lies about sizes cannot turn it into a zip bomb (CRCs are checked too);
- a layout other than a PT2 archive: one top-level directory holding
  `archive_format` ('pt2'), the AOTInductor code under `data/aotinductor/` and
  only the entries PT2 archives define.

Pure: the standard library only.
"""

from __future__ import annotations

import json
import re
import stat
import unicodedata
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import BadInput, IntegrityError
from kiln.core.trust.key_rules import check_no_collisions

# Second-level entries of a PT2 archive (torch/csrc/export/pt2_archive_constants.h).
PT2_ENTRIES = frozenset({"archive_format", "archive_version", "byteorder", ".data", "data", "extra", "models",
                         "xl_model_weights"})
_CHUNK = 1 << 20


@dataclass(frozen=True)
class PackageLimits:
    """Bounds a package must stay within; the defaults fit weightless packages with room to spare."""

    max_members: int = 4096
    """Entries in the zip."""
    max_member_bytes: int = 2 << 30
    """Uncompressed bytes of one member (2 GiB)."""
    max_total_bytes: int = 8 << 30
    """Uncompressed bytes of all members (8 GiB)."""
    max_ratio: float = 200.0
    """Largest uncompressed/compressed ratio of a member above 1 MiB (AOTI stores members uncompressed)."""


def _refuse(path: Path | str, why: str) -> IntegrityError:
    return IntegrityError(f"package {path} is refused: {why}; it was not extracted or loaded. "
                          "Delete it (and its store object) and export again.")


def _check_name(path, name: str) -> list[str]:
    if not name or "\x00" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise _refuse(path, f"member {name!r} has an empty name or control characters")
    if "\\" in name:
        raise _refuse(path, f"member {name!r} contains a backslash")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise _refuse(path, f"member {name!r} has an absolute path")
    if unicodedata.normalize("NFC", name) != name:
        raise _refuse(path, f"member {name!r} is not in Unicode NFC form")
    parts = name.rstrip("/").split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise _refuse(path, f"member {name!r} has a {part or 'empty'!r} path part")
    return parts


def _file_type(info: zipfile.ZipInfo) -> int:
    """The Unix file type bits of a member (0 when the zip carries none)."""
    return stat.S_IFMT(info.external_attr >> 16) if info.create_system == 3 else 0


def check_package(path: Path | str, limits: PackageLimits = PackageLimits()) -> int:
    """Check the package at `path` (see module docstring); return its number of members."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise _refuse(path, f"it is not a readable zip ({exc})") from None
    with zf:
        infos = zf.infolist()
        if not infos:
            raise _refuse(path, "it has no members")
        if len(infos) > limits.max_members:
            raise _refuse(path, f"it has {len(infos)} members (limit {limits.max_members})")
        roots, seconds, total = set(), set(), 0
        for info in infos:
            parts = _check_name(path, info.filename)
            kind = _file_type(info)
            if info.is_dir():
                if kind not in (0, stat.S_IFDIR):
                    raise _refuse(path, f"directory member {info.filename!r} has file type {oct(kind)}")
            elif kind not in (0, stat.S_IFREG):
                what = "a symlink" if kind == stat.S_IFLNK else f"not a regular file (type {oct(kind)})"
                raise _refuse(path, f"member {info.filename!r} is {what}")
            if info.flag_bits & 0x1:
                raise _refuse(path, f"member {info.filename!r} is encrypted")
            if info.file_size > limits.max_member_bytes:
                raise _refuse(path, f"member {info.filename!r} declares {info.file_size} bytes "
                                    f"(limit {limits.max_member_bytes})")
            if info.file_size > _CHUNK and info.file_size > limits.max_ratio * max(1, info.compress_size):
                raise _refuse(path, f"member {info.filename!r} expands {info.compress_size} bytes to "
                                    f"{info.file_size} (ratio limit {limits.max_ratio:g})")
            total += info.file_size
            if total > limits.max_total_bytes:
                raise _refuse(path, f"its members declare more than {limits.max_total_bytes} bytes in all")
            roots.add(parts[0])
            if len(parts) > 1:
                seconds.add(parts[1])
            elif not info.is_dir():
                raise _refuse(path, f"member {info.filename!r} lies outside the archive's top-level directory")
        try:
            check_no_collisions([i.filename.rstrip("/") for i in infos], what=f"members of package {path}")
        except BadInput as exc:
            raise _refuse(path, str(exc)) from None
        if len(roots) != 1:
            raise _refuse(path, f"it has {len(roots)} top-level entries ({', '.join(sorted(roots)[:4])}); "
                                "a PT2 archive has exactly one")
        if unknown := sorted(seconds - PT2_ENTRIES):
            raise _refuse(path, f"it holds {', '.join(repr(u) for u in unknown[:4])}, which a PT2 archive "
                                "does not define")
        root = next(iter(roots))
        names = {i.filename for i in infos}
        if not any(n.startswith(f"{root}/data/aotinductor/") and not n.endswith("/") for n in names):
            raise _refuse(path, "it has no AOTInductor code under data/aotinductor/")
        fmt = f"{root}/archive_format"
        if fmt not in names or zf.getinfo(fmt).file_size > 64 or zf.read(fmt).strip() != b"pt2":
            raise _refuse(path, "its archive_format is missing or is not 'pt2'")
        _read_through(path, zf, infos, limits)
    return len(infos)


def _read_through(path, zf: zipfile.ZipFile, infos: list[zipfile.ZipInfo], limits: PackageLimits) -> None:
    """Decompress every member with a byte cap: sizes must be what the headers say, CRCs must match."""
    total = 0
    for info in infos:
        if info.is_dir():
            continue
        got = 0
        try:
            with zf.open(info) as f:
                while chunk := f.read(_CHUNK):
                    got += len(chunk)
                    total += len(chunk)
                    if got > info.file_size or total > limits.max_total_bytes:
                        raise _refuse(path, f"member {info.filename!r} expands beyond its declared size")
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
            raise _refuse(path, f"member {info.filename!r} cannot be read ({exc})") from None
        if got != info.file_size:
            raise _refuse(path, f"member {info.filename!r} holds {got} bytes, not the {info.file_size} declared")


def package_device(path: Path | str) -> str | None:
    """The device a checked package was compiled for ('cpu', 'cuda': AOTInductor's AOTI_DEVICE_KEY in its
    wrapper's metadata), read without extracting it; None when it records none."""
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if "/data/aotinductor/" in name and name.endswith("wrapper_metadata.json"):
                try:
                    return json.loads(zf.read(name)).get("AOTI_DEVICE_KEY") or None
                except (ValueError, AttributeError):
                    return None
    return None


_SHIM = re.compile(r"\b(aoti_torch_[A-Za-z0-9_]+)\s*\(")
PROXY_CALL = "aoti_torch_proxy_executor_call_function"
"""How a wrapper calls an op that has no C shim: through the proxy executor, which looks the op up by name."""
NATIVE_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d", "quantized", "mkldnn", "onednn"})
"""Op namespaces libtorch registers in C++: an op of these reached through the proxy executor needs no Python."""


@dataclass(frozen=True)
class PackageCalls:
    """What a package's generated wrapper calls: whether it can run with libtorch alone."""

    python_free: bool
    ops: tuple[str, ...]
    """The op shims it calls (aoti_torch_cpu_<op>) and the C++-registered ops it reaches through the proxy
    executor (by their op name), sorted."""
    why: str | None = None
    """When not Python-free: the reason, naming the ops."""

    def to_dict(self) -> dict:
        return {"python_free": self.python_free, "ops": list(self.ops), "why": self.why}


def package_calls(path: Path | str) -> PackageCalls:
    """Read the AOTInductor wrapper of a checked package and classify every call it makes into torch.

    A wrapper calls ops through C shims compiled into libtorch (`aoti_torch_<device>_<op>`), or, for an
    op without one, through the proxy executor, which looks the op up by name in the loading process; the
    extern-kernel node file beside the wrapper names those ops. A package is Python-free when every op
    it reaches that way is registered in C++ (a namespace of NATIVE_NAMESPACES, not marked as a
    `torch.library.custom_op`): a Python custom op exists only in a process that registers it.
    """
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        wrappers = [n for n in names if "/data/aotinductor/" in n and n.endswith(".wrapper.cpp")]
        if not wrappers:
            return PackageCalls(False, (), "it holds no wrapper source (data/aotinductor/*.wrapper.cpp) to inspect")
        source = "\n".join(zf.read(n).decode("utf-8", "replace") for n in wrappers)
        extern = [n for n in names if "/data/aotinductor/" in n and n.endswith(".json")
                  and not n.endswith(("_metadata.json", "_compile_flags.json", "_linker_flags.json"))]
        nodes = []
        for name in extern:
            try:
                nodes += [n.get("node", {}) for n in json.loads(zf.read(name)).get("nodes", [])]
            except (ValueError, AttributeError):
                return PackageCalls(False, (), f"its extern kernel file {name.rsplit('/', 1)[-1]} is unreadable")
    calls = set(_SHIM.findall(source))
    shims = {c for c in calls if re.match(r"aoti_torch_(cpu|cuda|xpu|mps)_", c)}
    proxied = {str(n.get("target")) for n in nodes}
    python = sorted({str(n.get("target")) for n in nodes
                     if "torch_library_custom_op" in str(n.get("metadata", ""))
                     or str(n.get("target")).split("::")[0].split(".")[0] not in NATIVE_NAMESPACES})
    ops = tuple(sorted(shims | (proxied - set(python))))
    if python:
        return PackageCalls(False, ops, f"it calls {', '.join(python[:3])} through the proxy executor, "
                                        "a Python custom op that only a process registering it can run")
    if PROXY_CALL in calls and not nodes:
        return PackageCalls(False, ops, "it calls ops through the proxy executor without naming them in an "
                                        "extern kernel file, so they cannot be checked")
    return PackageCalls(True, ops)
