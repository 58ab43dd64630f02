"""Inductor's caches are private to the user: made 0700 under KILN_HOME (or KILN_INDUCTOR_DIR), refused by name
when someone else owns them or they are open to group or others (kiln.core.machine.home.check_private_dir,
kiln.host.compile.inductor_cache.prepare). No torch: what a worker does with them is tests/faults/test_worker_start.py's."""

from __future__ import annotations

import os
import stat

import pytest

from kiln.core.errors import BadInput
from kiln.core.machine.home import check_private_dir, inductor_root
from kiln.host.compile.inductor_cache import inductor_default_dir, prepare, use_for_loading

NOBODY = 65534
DIR = stat.S_IFDIR


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KILN_INDUCTOR_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return tmp_path / "home"


def test_the_rule_names_the_path_its_owner_and_mode_and_the_fix():
    check_private_dir("/d", mode=DIR | 0o700, owner_uid=1000, uid=1000, what="the cache", fix="fix it")
    with pytest.raises(BadInput, match=r"the cache /d belongs to uid 65534 \(nobody\), not to this user \(uid 1000; "
                                       r"mode 0700\).*Have it removed, or fix it\."):
        check_private_dir("/d", mode=DIR | 0o700, owner_uid=NOBODY, uid=1000, what="the cache", fix="fix it",
                          owner="uid 65534 (nobody)")
    for loose in (0o770, 0o707, 0o755, 0o701):
        with pytest.raises(BadInput, match=rf"the cache /d is open to group or others \(mode {loose:04o}, owned by "
                                           r"uid 1000\).*`chmod 700 /d`, or fix it\."):
            check_private_dir("/d", mode=DIR | loose, owner_uid=1000, uid=1000, what="the cache", fix="fix it")
    with pytest.raises(BadInput, match="the cache /d is not a directory"):
        check_private_dir("/d", mode=stat.S_IFREG | 0o600, owner_uid=1000, uid=1000, what="the cache", fix="fix it")


def test_a_fresh_root_is_made_0700_under_kiln_home_per_user(home):
    old = os.umask(0)  # whatever the umask, the directories are the user's alone
    try:
        dirs = prepare()
    finally:
        os.umask(old)
    root = home / f"inductor-{os.geteuid()}"
    assert inductor_root(os.geteuid()) == root
    assert (dirs.root, dirs.cache, dirs.tmp) == (str(root), str(root / "cache"), str(root / "tmp"))
    for d in (root, root / "cache", root / "tmp"):
        assert _mode(d) == 0o700 and os.stat(d).st_uid == os.geteuid()
    assert prepare() == dirs  # the next export finds them again: the caches stay warm


def test_kiln_inductor_dir_and_torchinductor_cache_dir_are_taken_and_checked(home, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_INDUCTOR_DIR", str(tmp_path / "shared-by-tests"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cold"))  # a run that wants a cold cache
    dirs = prepare()
    assert dirs.root == str(tmp_path / "shared-by-tests") and dirs.cache == str(tmp_path / "cold")
    assert _mode(tmp_path / "cold") == 0o700
    os.chmod(tmp_path / "cold", 0o755)
    with pytest.raises(BadInput, match=f"host h0: TORCHINDUCTOR_CACHE_DIR {tmp_path / 'cold'} is open to group or "
                                       "others \\(mode 0755.*unset TORCHINDUCTOR_CACHE_DIR"):
        prepare("host h0")


def test_inductors_own_default_in_the_environment_counts_as_unset(home, monkeypatch):
    # Importing Inductor writes $TMPDIR/torchinductor_$USER into TORCHINDUCTOR_CACHE_DIR: nobody chose it.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_default_dir())
    assert prepare().cache == str(home / f"inductor-{os.geteuid()}" / "cache")


def test_a_group_or_world_writable_root_is_refused(home):
    root = home / f"inductor-{os.geteuid()}"
    root.mkdir(parents=True)
    os.chmod(root, 0o777)
    with pytest.raises(BadInput, match=f"Kiln's Inductor cache root {root} is open to group or others \\(mode 0777"
                                       ".*`chmod 700 .*point KILN_INDUCTOR_DIR \\(or KILN_HOME\\) at a directory"):
        prepare()
    assert _mode(root) == 0o777, "Kiln refuses it and changes nothing"


def test_a_loading_process_probes_the_cpu_in_the_private_cache_or_keeps_its_own(home, monkeypatch):
    # A rank's process (kiln.host.ranks.verify_ranks, kiln.host.phases.rank_check): AOTInductor's loader builds
    # its vector-ISA probes in Inductor's cache, once per host in the private one.
    use_for_loading()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(home / f"inductor-{os.geteuid()}" / "cache")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    os.chmod(home / f"inductor-{os.geteuid()}", 0o777)  # not private: refused for compiling, left alone here
    use_for_loading()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user (chown) needs root")
def test_a_root_owned_by_someone_else_is_refused_by_name(home):
    root = home / f"inductor-{os.geteuid()}"
    root.mkdir(parents=True, mode=0o700)
    os.chown(root, NOBODY, NOBODY)  # another local user made it first
    with pytest.raises(BadInput, match=f"Kiln's Inductor cache root {root} belongs to uid {NOBODY}.*not to this user "
                                       f"\\(uid {os.geteuid()}; mode 0700\\)"):
        prepare()
    os.chown(root, os.geteuid(), os.getegid())
    (root / "cache").mkdir(mode=0o700)
    os.chown(root / "cache", NOBODY, NOBODY)  # one below it too
    with pytest.raises(BadInput, match="Kiln's Inductor cache .*/cache belongs to uid 65534"):
        prepare()
