"""What a run leaves behind and which of it goes (kiln.core.run.tidy, pure)."""

from __future__ import annotations

from kiln.core.run.tidy import Entry, Removed, over_cap, owner_dir_name, owner_gone, owner_of, removed_line

MIB = 2**20


def test_an_owner_directory_names_its_process_and_its_start():
    name = owner_dir_name(4242, 1700000000.123)
    assert name == "4242-1700000000.12" and owner_of(name) == (4242, 1700000000.12)
    assert owner_of("aotinductor_x1y2") is None and owner_of("12-") is None and owner_of("x-1.0") is None
    assert owner_gone(name, None)  # no process with that pid
    assert owner_gone(name, 1700000100.0)  # that pid is another process now
    assert not owner_gone(name, 1700000000.5)  # the owner itself (start times within the tolerance)
    assert not owner_gone("not-an-owner", None)


def test_over_the_cap_the_least_recently_used_go_first_never_what_is_kept():
    entries = [Entry("a", 40, used_s=1.0), Entry("b", 40, used_s=3.0), Entry("c", 40, used_s=2.0),
               Entry("d", 40, used_s=0.5)]
    assert over_cap(entries, 200) == []
    assert over_cap(entries, 100) == ["d", "a"]
    assert over_cap(entries, 100, keep={"d"}) == ["a", "c"]
    assert over_cap(entries, 0, keep={"a", "b", "c", "d"}) == []  # what the run needs stays, over the cap


def test_one_line_says_what_was_removed():
    assert removed_line("on host h0", {"temporary directories": Removed(), "cached files": Removed()}) is None
    assert removed_line("on host h0", {"temporary directories": Removed(2, 3 * MIB + MIB // 2),
                                       "cached files": Removed()}) == \
        "removed on host h0: 2 temporary directories (3.5 MiB)"
