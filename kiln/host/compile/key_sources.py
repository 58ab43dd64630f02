"""The source code that shapes a compiled forward, hashed into every forward key.

Purpose: a package depends on the code that builds its graph (the model, the
consumer contract, the config's derived sizes), on the export call (dynamic
shapes, `Dim` bounds, constants metadata, the Inductor call: export_call), on
the compiler options and on how tuned kernel choices reach Inductor. A change
to any of them must change every key, or a stale package is silently reused;
a change to anything else (the compile pool, its retries, a message) must
keep them, or every stored forward is compiled again for nothing.

Contracts: `KEY_SOURCES` is the one list of that code. An entry names a
module (its source file), a package (every `.py` file, sorted by its path
inside the package) or, as 'module:name', one top-level function or class
of a module. What is hashed is the code as ast.unparse writes it, without
its docstrings (and other bare string statements) and the messages of the
exceptions it raises: comments, layout, docstrings and messages reach no
graph, so editing them keeps every key. An entry that cannot be found raises
(a renamed module or function must be renamed here too, never silently
dropped). The files are located and parsed without importing them (no torch
import).

Pitfalls: code added to how forwards are built (e.g. a new model file)
belongs in a key source; code that does not shape the package (scheduling,
I/O) belongs outside the hashed modules (kiln.host.compile.compiler is not hashed,
kiln.host.compile.export_call is). ast.unparse may write the same code differently
under another Python version: hosts on different Pythons then compile a
forward each (a cost, never a wrong package). tests/unit/test_key_sources.py
checks that a change in each entry changes the keys and that a change
elsewhere does not.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from pathlib import Path

KEY_SOURCES = (
    "kiln.host.model",  # the graph's code (a package of model files works too)
    "kiln.core.model.config",  # the derived sizes the model reads (head_dim, shard sizes)
    "kiln.core.model.contract",  # parameter shapes, shard slices, the process group
    "kiln.core.model.attention_shapes",  # each attention kind's tensors (the contract's)
    "kiln.core.model.gpt_oss_fields",  # gpt-oss's stacked experts, sinks and router bias: shapes, cuts, dtypes
    "kiln.core.model.layer_runs",  # which layers one scan runs (the stacked constants' layers)
    "kiln.core.model.cache_layout",  # the KV cache's layout (DeepSeek-V4's slot: the states a step unpacks)
    "kiln.core.model.interface",  # the choice outputs a forward returns after new_kv (which sites, their layers)
    "kiln.core.model.v4_fields",  # DeepSeek-V4's tensors, shard slices and cache states
    "kiln.core.model.quant",  # which tensors a quantized checkpoint quantizes, a rank's scales and their grid
    "kiln.host.compile.export_call",  # torch.export, dynamic shapes, constants metadata, the Inductor call
    "kiln.host.compile.inductor_options",  # the Inductor options of every forward, which Inductor variables are keyed
    "kiln.host.compile.tuner:install",  # how tuned kernel choices reach Inductor (not the tuner's store I/O)
)
"""What goes into every forward key, in hashing order: modules, packages and 'module:function' entries."""

FINGERPRINT_HEX_CHARS = 16


def source_files(entry: str) -> list[tuple[str, Path]]:
    """(name, path) of the source files of `entry`: its module's file, or every .py file of a package, sorted."""
    module = entry.partition(":")[0]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None and not spec.submodule_search_locations:
        raise LookupError(f"key source {entry!r} (kiln.host.compile.key_sources.KEY_SOURCES) has no source file; "
                          "update KEY_SOURCES when a module is renamed or moved")
    if spec.submodule_search_locations:  # a package
        if ":" in entry:
            raise LookupError(f"key source {entry!r}: name a function of a module, not of a package")
        files = []
        for root in map(Path, spec.submodule_search_locations):
            files += [(f"{module}/{p.relative_to(root).as_posix()}", p) for p in root.rglob("*.py")]
        return sorted(files)
    return [(entry, Path(spec.origin))]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def keyed_code(source: str, name: str | None = None) -> str:
    """What a key hashes of `source`: all of it, or its top-level function or class `name`, as ast.unparse
    writes it (no comments, one layout) without docstrings and other bare strings, and with '' for the
    message of each exception raised. LookupError when `name` is not defined at the top level of `source`."""
    tree = ast.parse(source)
    node: ast.AST = tree
    if name is not None:
        node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == name), None)
        if node is None:
            raise LookupError(f"key source {name!r} is not a top-level function or class of its module "
                              "(kiln.host.compile.key_sources.KEY_SOURCES); update it when a function is renamed or moved")
    return ast.unparse(_Unkeyed().visit(node))


def _is_text(node: ast.expr) -> bool:
    return isinstance(node, ast.JoinedStr) or isinstance(node, ast.Constant) and isinstance(node.value, str)


class _Unkeyed(ast.NodeTransformer):
    """Drops what reaches no graph: bare strings (docstrings, fields' docstrings), raised messages."""

    def visit_Expr(self, node: ast.Expr) -> ast.AST | None:
        return None if _is_text(node.value) else self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> ast.AST:
        if isinstance(node.exc, ast.Call):
            node.exc.args = [ast.Constant("") if _is_text(arg) else arg for arg in node.exc.args]
            for kw in node.exc.keywords:
                kw.value = ast.Constant("") if _is_text(kw.value) else kw.value
        return self.generic_visit(node)


def code_fingerprint(entries: tuple[str, ...] = KEY_SOURCES) -> str:
    """sha256 over the names and keyed code (`keyed_code`) of every source of `entries`, in order
    (16 hex characters)."""
    h = hashlib.sha256()
    for entry in entries:
        name = entry.partition(":")[2] or None
        for file_name, path in source_files(entry):
            data = keyed_code(_read(path), name).encode()
            h.update(f"{file_name}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()[:FINGERPRINT_HEX_CHARS]


def model_code_fingerprint() -> str:
    """The code fingerprint that goes into a forward's graph: every entry of `KEY_SOURCES`."""
    return code_fingerprint()
