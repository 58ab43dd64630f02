"""A host's cache directory: status on disk, and the pure decision over every host."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput
from kiln.core.plan.probe_result import HostProbe
from kiln.host.machine.cache import cache_root, cache_status, check_caches, check_probed_caches, need_mib


def test_a_writable_cache_reports_free_space_and_leaves_no_probe(tmp_path):
    st = cache_status(tmp_path / "c")
    assert st["error"] is None and st["free_mib"] > 0 and st["path"] == str(tmp_path / "c")
    assert list((tmp_path / "c" / "forwards").iterdir()) == []


def test_a_file_where_the_cache_directory_should_be(tmp_path):
    (tmp_path / "c").write_text("not a directory")
    st = cache_status(tmp_path / "c")
    assert st["error"] and str(tmp_path / "c") in st["error"]
    with pytest.raises(BadInput) as err:
        check_caches({"host-a": st}, {})
    assert "host host-a's cache directory" in str(err.value) and str(tmp_path / "c") in str(err.value)
    assert "KILN_CACHE_DIR" in str(err.value)


def test_every_bad_host_is_named_at_once():
    statuses = {"a": {"path": "/ca", "error": None, "free_mib": 10},
                "b": {"path": "/cb", "error": "Read-only file system (/cb/forwards)", "free_mib": 500},
                "c": {"path": "/cc", "error": None, "free_mib": 1000}}
    with pytest.raises(BadInput) as err:
        check_caches(statuses, {"a": 64, "b": 64, "c": 64})
    msg = str(err.value)
    assert "/ca has 10 MiB free but the export's forwards need about 64 MiB" in msg
    assert "/cb is not writable: Read-only file system" in msg
    assert "/cc" not in msg
    check_caches(statuses | {"a": {**statuses["a"], "free_mib": 64}, "b": statuses["c"]}, {"a": 64, "b": 64})


def test_need_counts_only_forwards_the_host_lacks():
    assert need_mib(4, 1, 16) == 48
    assert need_mib(4, 4, 16) == 0
    probes = [HostProbe(name="h", ranks=(0,), memory={}, num_cpus=1, unified=True, target="t", specs=({}, {}),
                        local_keys=(), store_keys=(), cache={"path": "/c", "error": None, "free_mib": 31})]
    with pytest.raises(BadInput, match="need about 32 MiB"):
        check_probed_caches(probes, 16)
    check_probed_caches(probes, 15)


def test_cache_root_prefers_the_host_setting_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KILN_CACHE_DIR", raising=False)
    assert cache_root("h1") == tmp_path / "home" / "cache" / "h1"
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "fast"))
    assert cache_root("h1") == tmp_path / "fast" / "h1"
    assert cache_root("h1", "/explicit") == tmp_path.__class__("/explicit")


def test_a_host_reading_its_ranks_weights_from_s3_needs_room_for_them_in_its_cache():
    from types import SimpleNamespace

    status = {"path": "/ca", "error": None, "free_mib": 100}
    probe = SimpleNamespace(name="a", cache=status, specs=("k",), local_keys=(), ranks=(0, 1))
    check_probed_caches([probe], 16, 42)  # 16 + 2 x 42 = 100
    with pytest.raises(BadInput, match="need about 102 MiB"):
        check_probed_caches([probe], 16, 43)
