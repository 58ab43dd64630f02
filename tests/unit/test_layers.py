"""The folders are layers: imports point down only, there is no cycle, the core is pure, and
importing a module configures nothing.

Layers, bottom to top: kiln.core (pure decisions; its rooms in the order of CORE_ROOMS) < kiln.store
(object stores) < kiln.host (what runs on one host: torch; its rooms in the order of HOST_ROOMS) <
kiln.device_check < blocks (Prefect block classes) < tasks (Prefect tasks and their bodies) < flows < bench
< cli (`kiln bench` runs the bench). Inside kiln.core and kiln.host each room is a layer of its own, so a
room imports only the rooms below it. Every import counts, also one inside a function.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE_ROOMS = ("kiln.core.errors", "kiln.core.model", "kiln.core.machine", "kiln.core.forwards", "kiln.core.trust",
              "kiln.core.plan", "kiln.core.run")
"""kiln.core's rooms, bottom to top: the errors every room raises, the model's description, a host's
description, a forward's identity, trust and the store's layout, the plan, the run."""
HOST_ROOMS = ("kiln.host.machine", "kiln.host.processes", "kiln.host.model.layers", "kiln.host.model.families",
              "kiln.host.model", "kiln.host.weights", "kiln.host.trust", "kiln.host.compile", "kiln.host.leases",
              "kiln.host.ranks", "kiln.host.phases")
"""kiln.host's rooms, bottom to top: this host's readings, processes, the model (shared layers, families,
decoders), weights, trust, compiling, leases, ranks at work, a host's part of each phase."""
LAYERS = (*CORE_ROOMS, "kiln.store", *HOST_ROOMS, "kiln.device_check", "blocks", "tasks", "flows", "bench", "cli")
PACKAGES = ("kiln", "kiln.core", "kiln.host")
"""Packages whose __init__ holds a docstring only: they belong to no layer."""
MAX_ROOM_MODULES = 20
"""No folder of the library holds more modules of its own than this: more is several jobs side by side."""
CORE_FORBIDDEN = {"prefect", "prefect_aws", "prefect_dask", "torch", "boto3", "botocore", "s3transfer", "dask",
                  "distributed", "safetensors", "transformers", "matplotlib"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("kiln", "blocks", "tasks", "flows", "cli", "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports (the most specific known name), wherever the import statement sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _local(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _layer(name: str) -> int | None:
    """The index in LAYERS of the most specific prefix of `name` (a room inside kiln.host.model before it)."""
    found = [(len(prefix), i) for i, prefix in enumerate(LAYERS) if name == prefix or name.startswith(prefix + ".")]
    return max(found)[1] if found else None


GRAPH = {name: {t for t in map(_local, _imports(name, path)) if t and t != name} for name, path in MODULES.items()}


def test_every_module_belongs_to_a_layer():
    loose = sorted(n for n in MODULES if _layer(n) is None and n not in PACKAGES)
    assert not loose, f"modules outside every layer {LAYERS}: {loose}"


def test_imports_point_down_only():
    upward = sorted(f"{a} ({LAYERS[_layer(a)]}) imports {b} ({LAYERS[_layer(b)]})"
                    for a, deps in GRAPH.items() for b in deps
                    if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(GRAPH[n]):
            if m.startswith(n + "."):  # a package's __init__ importing its own modules is not a cycle
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(GRAPH):
        if n not in state and (cycle := visit(n)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_core_is_pure():
    bad = sorted(f"{name} imports {imp}" for name, path in MODULES.items() if _layer(name) == 0
                 for imp in _imports(name, path) if imp.split(".")[0] in CORE_FORBIDDEN)
    assert not bad, "the core imports a framework:\n" + "\n".join(bad)


def test_the_checker_sees_violations():
    """The walk finds what it must: a known upward import and a known cycle shape would show."""
    assert "kiln.core.errors" in GRAPH["kiln.core.plan.recipe"]
    assert _layer("kiln.core.run.outcome") > _layer("kiln.core.plan.gate") > _layer("kiln.core.model.config")
    assert _layer("kiln.host.model.decoder") > _layer("kiln.host.model.families.llama") > _layer(
        "kiln.host.model.layers.attention")
    assert "flows.export" in GRAPH["cli.start_export"]  # a lazy import inside a function counts
    assert _layer("flows.export") > _layer("tasks.phases") > _layer("kiln.host.compile.compiler") > _layer("kiln.core.plan.gate")


_PROBE = """
import importlib, json, logging, os, sys
names = json.loads(sys.argv[1])
import dask
before_env = dict(os.environ)
before_dask = json.dumps(dask.config.config, sort_keys=True, default=str)
levels = lambda: {n: logging.getLogger(n).level for n in ["", "distributed", "prefect", "torch", "botocore"]}
before_levels = levels()
for name in names:
    importlib.import_module(name)
env = {k: v for k, v in os.environ.items() if before_env.get(k) != v}
gone = sorted(set(before_env) - set(os.environ))
print(json.dumps({"env": env, "gone": gone, "dask": json.dumps(dask.config.config, sort_keys=True, default=str) != before_dask,
                  "levels": {k: v for k, v in levels().items() if before_levels[k] != v}}))
"""


@pytest.mark.timeout(300)
def test_importing_configures_nothing():
    """Importing every module of the prefect layers and below leaves the environment, Dask's config and
    the loggers' levels as they were (torch and prefect themselves may set things; they are imported first)."""
    names = [n for n in MODULES if _layer(n) is not None and _layer(n) <= LAYERS.index("cli") and _layer(n) != LAYERS.index("bench")]
    pre = ("import torch, prefect, prefect.flows, prefect.blocks.core, prefect_aws, prefect_dask, distributed, boto3, "
           "matplotlib; ")
    out = subprocess.run([sys.executable, "-c", pre + _PROBE, json.dumps(names)], cwd=ROOT, capture_output=True,
                         text=True, timeout=280, env={k: v for k, v in __import__("os").environ.items()
                                                      if not k.startswith(("DASK_", "PREFECT_LOGGING"))})
    assert out.returncode == 0, out.stderr[-3000:]
    changed = json.loads(out.stdout.strip().splitlines()[-1])
    assert changed == {"env": {}, "gone": [], "dask": False, "levels": {}}, changed


FAMILY_SIDES = ("kiln.core.model.hf_config.", "kiln.host.model.families.")
"""A model family has one module on each side, by its name: its config.json reading and its decoder layer."""


def test_no_two_modules_share_a_name():
    """Names say what they hold: one `plan.py`, one `keys.py`, ... across the packages (not `__init__`), but
    for a family's two modules, one on each side of FAMILY_SIDES."""
    seen: dict[str, str] = {}
    clashes = []
    for name in MODULES:
        leaf = name.rpartition(".")[2]
        if MODULES[name].name == "__init__.py":
            continue
        other = seen.get(leaf, "")
        if {name.removesuffix(leaf), other.removesuffix(leaf)} == set(FAMILY_SIDES):
            continue
        if leaf in seen:
            clashes.append(f"{seen[leaf]} and {name}")
        seen.setdefault(leaf, name)
    assert not clashes, "modules that share a name: " + "; ".join(clashes)


MAX_MODULE_LINES = 400
TASKS_LINES = 200


def test_rooms_stay_small():
    """No module of the code's layers over MAX_MODULE_LINES; the tasks layer (decorators and calls) under
    TASKS_LINES in all; blocks/ holds Prefect Block classes and nothing else."""
    lines = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()
             if not name.startswith("bench")}
    assert not {n: k for n, k in lines.items() if k > MAX_MODULE_LINES}, "split these modules by job"
    assert sum(k for n, k in lines.items() if n == "tasks" or n.startswith("tasks.")) < TASKS_LINES
    for name, path in MODULES.items():
        if name.startswith("blocks.") and path.name != "__init__.py":
            extra = [n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)
                     and not any(getattr(b, "id", None) == "Block" for b in n.bases)]
            assert not extra, f"{name}: {extra} are not Prefect blocks; the library holds them"


def test_rooms_say_what_they_hold():
    """Every folder of the library has an __init__.py whose docstring says what it holds, and holds at most
    MAX_ROOM_MODULES modules of its own."""
    for top in ("kiln", "blocks", "tasks", "flows", "cli"):
        for folder in sorted(p for p in (ROOT / top).rglob("*") if p.is_dir() and p.name != "__pycache__"):
            if not any(folder.glob("*.py")):
                continue
            rel = folder.relative_to(ROOT).as_posix()
            init = folder / "__init__.py"
            assert init.exists(), f"{rel}/ has no __init__.py saying what it holds"
            assert ast.get_docstring(ast.parse(init.read_text())), f"{rel}/__init__.py: a docstring saying what it holds"
            own = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            assert len(own) <= MAX_ROOM_MODULES, f"{rel}/ holds {len(own)} modules: group them by job"
