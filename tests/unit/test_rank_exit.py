"""What `kiln verify` and `kiln run` say when a rank dies or the ranks hang (kiln.core.run.rank_exit)."""

from __future__ import annotations

from kiln.core.run.rank_exit import describe_exit, rank_died_message, ranks_timed_out_message


def test_an_exit_status_in_words():
    assert describe_exit(-9) == "signal SIGKILL (-9)"
    assert describe_exit(-11) == "signal SIGSEGV (-11)"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(-200) == "signal 200 (-200)"  # no such signal: its number


def test_a_dead_rank_is_named_with_its_signal_and_what_it_was_doing():
    msg = rank_died_message(1, -9, "running forward 4x32", world_size=2)
    assert msg.startswith("rank 1 died with signal SIGKILL (-9) while running forward 4x32; "
                          "the other rank was stopped.")
    assert "out-of-memory killer" in msg and "\n" not in msg
    assert rank_died_message(0, 2, "", world_size=1) == (
        "rank 0 died with exit code 2 before it said what it was doing.")
    msg = rank_died_message(3, -11, "loading weights", world_size=4)
    assert "the other 3 ranks were stopped" in msg and "native code" in msg


def test_a_timeout_says_what_each_rank_was_doing():
    msg = ranks_timed_out_message(600, {0: "running forward 1x16", 1: ""})
    assert msg.startswith("the ranks did not finish within 600 s (rank 0 running forward 1x16, "
                          "rank 1 had not started); they were stopped.")
