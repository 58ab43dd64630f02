"""kiln.core.plan.deadlines: each step's deadline from the plan's prediction, the margin and the floor."""

from __future__ import annotations

import pytest

from kiln.core.errors import DeadlinePassed
from kiln.core.plan import deadlines
from kiln.core.plan.deadlines import Deadline
from kiln.core.run.retry_rule import worth_retrying
from kiln.core.plan.recipe import Recipe

RECIPE = Recipe(deadline_margin=4.0, deadline_floor_s=100.0, max_compile_attempts=2, lease_wait_s=600.0)


def test_a_compile_deadline_is_the_estimate_times_the_margin_or_the_floor():
    got = deadlines.compile_deadlines({"fast": 10.0, "slow": 50.0}, RECIPE)
    assert got["fast"].seconds == 100.0 and "deadline_floor_s" in got["fast"].basis
    assert got["slow"].seconds == 200.0 and "deadline_margin 4 x its compile predicted 50 s" in got["slow"].basis


def test_the_compile_phase_allows_its_slowest_host_every_attempt_and_the_lease_wait():
    each = deadlines.compile_deadlines({"a": 50.0, "b": 50.0, "c": 50.0, "d": 10.0}, RECIPE)  # 200, 200, 200, 100
    got = deadlines.compile_phase_deadline({"h0": (["a", "b", "c"], 2), "h1": (["d"], 1)}, each, RECIPE)
    # h0: 2 attempts x (600 s over 2 workers + the longest, 200 s) = 1000 s; h1: 2 x (100 + 100) = 400 s
    assert got.seconds == 1000.0 + 600.0
    assert "host h0" in got.basis and "max_compile_attempts 2" in got.basis and "lease_wait_s 600" in got.basis


def test_a_key_without_a_prediction_counts_the_floor():
    got = deadlines.compile_phase_deadline({"h0": (["x"], 1)}, {}, RECIPE)
    assert got.seconds == 2 * (100.0 + 100.0) + 600.0


def test_a_check_grows_with_its_shard_and_its_forwards():
    small = deadlines.check_deadline(1, 0, RECIPE)
    big = deadlines.check_deadline(4, 10_000 * 2**20, RECIPE)  # 200 s to read + 240 s of forwards, x 4
    assert small.seconds == 4 * deadlines.CHECK_S_PER_FORWARD
    assert big.seconds == pytest.approx(4 * (10_000 / deadlines.CHECK_READ_MIB_PER_S + 4 * deadlines.CHECK_S_PER_FORWARD))
    host = deadlines.checks_deadline([4, 4], 10_000 * 2**20, RECIPE)
    assert host.seconds == pytest.approx(100.0 + 2 * big.seconds)


def test_tuning_grows_with_its_shapes():
    assert deadlines.tune_deadline(1, RECIPE).seconds == 240.0
    assert deadlines.tune_deadline(10, RECIPE).seconds == 2400.0


def test_a_passed_deadline_names_the_step_and_is_final():
    err = Deadline(120.0, "deadline_floor_s").passed("the check of rank 1 on host h0")
    assert isinstance(err, DeadlinePassed)
    assert str(err).startswith("the check of rank 1 on host h0 did not finish within 120 s (deadline_floor_s)")
    assert "deadline_margin" in str(err)
    assert not worth_retrying(err)


def test_the_settings_are_checked():
    from kiln.core.errors import BadInput

    with pytest.raises(BadInput):
        Recipe(deadline_margin=0.5)
    with pytest.raises(BadInput):
        Recipe(deadline_floor_s=0)


def test_the_phase_clock_says_when_the_phase_running_now_is_past_its_deadline():
    clock = deadlines.PhaseClock()
    assert clock.overdue(now=1e9) is None  # no phase
    clock.start("compile", Deadline(100.0, "the plan"), now=1000.0)
    assert clock.overdue(now=1100.0) is None
    assert clock.overdue(now=1112.0) == "phase compile is 12 s past its deadline of 100 s (the plan)"
    clock.start("probe", None, now=2000.0)  # a phase without a deadline never runs over
    assert clock.overdue(now=1e9) is None
    clock.start("share-verify", Deadline(10.0, "checks"), now=3000.0)
    clock.stop()
    assert clock.overdue(now=1e9) is None
