"""Forward keys cover what shapes a package, and only that (kiln.host.compile.key_sources, inductor_options)."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest

from kiln.core.model.config import TINY
from kiln.core.errors import KilnError
from kiln.core.forwards.forward_keys import forward_spec
from kiln.core.plan.job import ExportJob
from kiln.core.plan.recipe import Bucket, Recipe
from kiln.core.forwards.shape_ranges import static_shape
from kiln.host.compile import key_sources
from kiln.host.compile.inductor_options import INDUCTOR_ENV_UNKEYED, inductor_env
from kiln.host.compile.key_sources import KEY_SOURCES, code_fingerprint, keyed_code, model_code_fingerprint, source_files


_READ = key_sources._read


def _key(code: str, env: dict | None = None) -> str:
    graph = {"config": {}, "tp": 1, "code": code, **({} if env is None else {"inductor_env": env})}
    return forward_spec(shapes=static_shape(Bucket(1, 8)), graph=graph, target="cpu-x", torch_version="2.13.0", page_tokens=16,
                        pages_per_seq=4, compiler={}).key


def _edit(monkeypatch, edit) -> str:
    """The fingerprint with `edit(path, source) -> source` applied to every key source file as it is read."""
    monkeypatch.setattr(key_sources, "_read", lambda p: edit(Path(p), _READ(p)))
    return model_code_fingerprint()


def _in_function(source: str, name: str, line: str) -> str:
    """`source` with `line` added as the last statement of its top-level function `name`."""
    node = next(n for n in ast.parse(source).body if getattr(n, "name", None) == name)
    lines = source.split("\n")
    indent = " " * node.body[-1].col_offset
    return "\n".join(lines[:node.end_lineno] + [indent + line] + lines[node.end_lineno:])


def test_the_model_the_export_call_and_the_options_are_key_sources_the_pool_is_not():
    assert {"kiln.host.model", "kiln.host.compile.export_call", "kiln.host.compile.inductor_options",
            "kiln.core.model.contract"} <= set(KEY_SOURCES)
    hashed = {path.name for entry in KEY_SOURCES for _, path in source_files(entry)}
    assert "compiler.py" not in hashed  # the pool, its retries and its messages


@pytest.mark.parametrize("entry", KEY_SOURCES)
def test_a_change_in_each_key_source_changes_the_keys(monkeypatch, entry):
    before = model_code_fingerprint()
    changed = {path for _, path in source_files(entry)}
    module, _, name = entry.partition(":")

    def edit(path: Path, source: str) -> str:
        if path not in changed:
            return source
        return _in_function(source, name, "edited = 1") if name else source + "\nEDITED = 1\n"

    after = _edit(monkeypatch, edit)
    assert after != before and _key(after) != _key(before)


def test_an_edit_to_the_pool_or_to_a_message_keeps_the_keys(monkeypatch):
    """Scheduling code, messages, comments and docstrings reach no graph: editing them compiles nothing."""
    before = model_code_fingerprint()
    compiler = Path(key_sources.__file__).with_name("compiler.py")
    assert "max_compile_attempts=" in compiler.read_text()
    edits = {
        "compiler.py": ("max_compile_attempts=", "max_attempts ="),  # the pool's retry message
        "config.py": ("must be a positive integer, got", "must be an integer above 0, not"),  # raised messages
        "contract.py": ('"""', '"""Edited. '),  # a docstring
        "export_call.py": ("# Built on the meta device", "# Made on the meta device"),  # a comment
        "tuner.py": ("refusing to compile it", "will not compile it"),  # a message outside tuner.install
    }

    def edit(path: Path, source: str) -> str:
        old, new = edits.get(path.name, (None, None))
        if old is None:
            return source
        assert old in source, (path, old)
        return source.replace(old, new, 1)

    after = _edit(monkeypatch, edit)
    assert after == before and _key(after) == _key(before)


def test_an_edit_to_the_model_code_changes_the_keys_its_layout_does_not(monkeypatch):
    rotary = next(Path(path) for name, path in source_files("kiln.host.model") if name.endswith("/rotary.py"))
    source = rotary.read_text()
    assert "def " in source
    before = model_code_fingerprint()
    relaid = _edit(monkeypatch, lambda p, s: s.replace("\ndef ", "\n\n\n# a comment\ndef ") if p == rotary else s)
    assert relaid == before
    edited = _edit(monkeypatch, lambda p, s: _in_function(s, "rope_inv_freq", "edited = 1") if p == rotary else s)
    assert edited != before


def test_keyed_code_drops_what_reaches_no_graph():
    a = 'def f(x):\n    """Doc."""\n    if x < 0:\n        raise ValueError(f"x is {x}")  # why\n    return x + 1\n'
    b = ('def f(x):\n    """Other doc."""\n    # a comment\n    if x < 0:\n        raise ValueError(\n'
         '            "x must be >= 0, "\n            f"got {x}")\n\n    return x + 1\n')
    assert keyed_code(a) == keyed_code(b)
    assert keyed_code(a) != keyed_code(a.replace("x + 1", "x + 2"))
    assert keyed_code(a) != keyed_code(a.replace("ValueError", "TypeError"))
    assert keyed_code(a + "def g():\n    pass\n", "f") == keyed_code(a, "f")
    with pytest.raises(LookupError, match="'h' is not a top-level function"):
        keyed_code(a, "h")


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
    with pytest.raises(LookupError, match="not of a package"):
        code_fingerprint(("keysrc_pkg:f",))
    sys.modules.pop("keysrc_pkg", None)


def test_a_missing_key_source_is_an_error_not_a_silent_skip():
    with pytest.raises(LookupError, match="kiln.host.no_such_model.*KEY_SOURCES"):
        code_fingerprint(("kiln.host.no_such_model",))
    with pytest.raises(LookupError, match="'no_such_function'.*KEY_SOURCES"):
        code_fingerprint(("kiln.host.compile.tuner:no_such_function",))


# ---- The Inductor settings in force ----------------------------------------------------------------------

def test_inductor_env_is_the_inductor_variables_that_change_code():
    env = {"TORCHINDUCTOR_FREEZING": "1", "TORCH_INDUCTOR_CPP_WRAPPER": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x",
           "TORCHINDUCTOR_COMPILE_THREADS": "4", "PATH": "/bin", "TORCH_LOGS": "+inductor"}
    assert inductor_env(env) == {"TORCHINDUCTOR_FREEZING": "1", "TORCH_INDUCTOR_CPP_WRAPPER": "1"}
    assert list(inductor_env({"TORCHINDUCTOR_Z": "1", "TORCHINDUCTOR_A": "1"})) == ["TORCHINDUCTOR_A",
                                                                                  "TORCHINDUCTOR_Z"]
    assert all(name.startswith("TORCHINDUCTOR_") for name in INDUCTOR_ENV_UNKEYED)


def _probe_keys(monkeypatch, tmp_path) -> list[str]:
    """The forward keys kiln.host.phases.host_probe.probe_host reports, torch and the machine stubbed (no torch import)."""
    from kiln.host.phases import host_probe
    from kiln.store import open_store
    from kiln.core.machine.gpus import GpuReading
    from kiln.core.plan.job import HostSpec
    from kiln.core.machine.target import cpu_target_of

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="2.13.0"))
    monkeypatch.setattr(host_probe.probe, "memory_snapshot",
                        lambda reading=None: {"host_total_mib": 1024, "host_available_mib": 512})
    monkeypatch.setattr(host_probe.probe, "gpu_reading", lambda: GpuReading((), "none"))
    monkeypatch.setattr(host_probe.probe, "detect_target", lambda device, reading=None: cpu_target_of(
        machine="x86_64", cpu="cpu-test", torch_version="2.13.0"))
    monkeypatch.setattr(host_probe.probe, "num_cpus", lambda: 2)
    job = ExportJob(export_id="e", model_name="m", checkpoint="/none", config=TINY.to_dict(), tp=1,
                    recipe=Recipe(), store_url=str(tmp_path / "store"))
    probe = host_probe.probe_host(job, HostSpec(name="h", ranks=(0,), cache_dir=str(tmp_path / "cache")),
                                  open_store(job.store_url))
    return [s.key for s in probe.specs]


def test_a_changed_inductor_setting_changes_the_probed_keys(monkeypatch, tmp_path):
    """TORCHINDUCTOR_FREEZING changes the generated code: the probe's keys change with it; the cache dir
    does not."""
    for name in list(inductor_env()):
        monkeypatch.delenv(name)
    before = _probe_keys(monkeypatch, tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert _probe_keys(monkeypatch, tmp_path) == before
    monkeypatch.setenv("TORCHINDUCTOR_FREEZING", "1")
    frozen = _probe_keys(monkeypatch, tmp_path)
    assert set(frozen).isdisjoint(before)
    monkeypatch.setenv("TORCHINDUCTOR_FREEZING", "0")
    assert set(_probe_keys(monkeypatch, tmp_path)).isdisjoint(frozen + before)


def test_a_worker_refuses_a_key_made_for_other_inductor_settings(monkeypatch):
    """Another host of the target may compile a key: its workers must run the settings the key hashes."""
    from kiln.host.compile.compiler import _check_inductor_env

    for name in list(inductor_env()):
        monkeypatch.delenv(name)
    spec = {"key": "k1", "shapes": "1x8", "target": "cpu-test", "graph": {"inductor_env": {}}}
    _check_inductor_env(spec)
    _check_inductor_env({**spec, "graph": {}})  # a spec made by hand, for no settings
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    _check_inductor_env(spec)
    monkeypatch.setenv("TORCHINDUCTOR_FREEZING", "1")
    with pytest.raises(KilnError, match="forward k1 .*differing: TORCHINDUCTOR_FREEZING.*cpu-test"):
        _check_inductor_env(spec)
    _check_inductor_env({**spec, "graph": {"inductor_env": {"TORCHINDUCTOR_FREEZING": "1"}}})
    assert _key("c", {}) != _key("c", {"TORCHINDUCTOR_FREEZING": "1"})
