"""The source code that shapes a compiled forward, hashed into every forward key.

Purpose: a package depends on the code that builds its graph (the model, the
consumer contract, the config's derived sizes), on the code that exports and
compiles it (dynamic shapes, `Dim` bounds, constants metadata, Inductor
options) and on the code that installs tuned kernel choices. A change to any
of them must change every key, or a stale package is silently reused.

Contracts: `KEY_SOURCES` is the one list of those modules. A module's source
file is hashed; a package's every `.py` file, sorted by its path inside the
package. A listed module that cannot be found raises (a renamed module must be
renamed here too, never silently dropped). The files are located without
importing them (no torch import).

Pitfalls: a module added to how forwards are built (e.g. a new model file)
belongs in `KEY_SOURCES`; tests/unit/test_key_sources.py checks that a change
in each listed module changes the keys.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

KEY_SOURCES = (
    "kiln.host.model",  # the graph's code (a package of model files works too)
    "kiln.core.config",  # the derived sizes the model reads (head_dim, shard sizes)
    "kiln.core.contract",  # parameter shapes, shard slices, the process group
    "kiln.host.compiler",  # torch.export, dynamic shapes, constants metadata, the Inductor call
    "kiln.host.inductor_options",  # the Inductor options of every forward
    "kiln.host.tuner",  # how tuned kernel choices reach Inductor
)
"""Modules whose source goes into every forward key, in hashing order."""

FINGERPRINT_HEX_CHARS = 16


def source_files(module: str) -> list[tuple[str, Path]]:
    """(name, path) of the source files of `module`: its file, or every .py file of a package, sorted."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None and not spec.submodule_search_locations:
        raise LookupError(f"key source {module!r} (kiln.host.key_sources.KEY_SOURCES) has no source file; "
                          "update KEY_SOURCES when a module is renamed or moved")
    if spec.submodule_search_locations:  # a package
        files = []
        for root in map(Path, spec.submodule_search_locations):
            files += [(f"{module}/{p.relative_to(root).as_posix()}", p) for p in root.rglob("*.py")]
        return sorted(files)
    return [(module, Path(spec.origin))]


def _read(path: Path) -> bytes:
    return path.read_bytes()


def code_fingerprint(modules: tuple[str, ...] = KEY_SOURCES) -> str:
    """sha256 over the names and bytes of every source file of `modules`, in order (16 hex characters)."""
    h = hashlib.sha256()
    for module in modules:
        for name, path in source_files(module):
            data = _read(path)
            h.update(f"{name}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()[:FINGERPRINT_HEX_CHARS]


def model_code_fingerprint() -> str:
    """The code fingerprint that goes into a forward's graph: every module of `KEY_SOURCES`."""
    return code_fingerprint()
