from kiln.core.trust.layout import generation_of, lease_key
from kiln.core.run.leases import decide_lease, new_lease


def test_free_key_creates_generation_zero():
    assert decide_lease(None, "a", 100.0).action == "create"
    assert decide_lease(None, "a", 100.0).generation == 0


def test_live_lease_of_another_owner_waits():
    d = decide_lease((3, new_lease("b", 100.0, 60.0)), "a", 150.0)
    assert (d.action, d.generation) == ("wait", 4)


def test_stale_lease_is_taken_over_with_next_generation():
    d = decide_lease((3, new_lease("b", 100.0, 60.0)), "a", 160.0)
    assert (d.action, d.generation) == ("create", 4)


def test_own_lease_is_held():
    assert decide_lease((0, new_lease("a", 100.0, 60.0)), "a", 1e9).action == "hold"


def test_garbled_lease_counts_as_stale():
    assert decide_lease((1, {"owner": "b"}), "a", 0.0).action == "create"


def test_generation_round_trip_sorts():
    keys = [lease_key("k", "s", g) for g in (10, 2, 1)]
    assert [generation_of(k) for k in sorted(keys)] == [1, 2, 10]


def test_a_lease_whose_process_died_here_is_taken_over_before_its_expiry():
    doc = new_lease("b", 100.0, 900.0, {"host": "h", "pid": 7, "started_at": 50.0})
    d = decide_lease((2, doc), "a", 101.0, host="h", pid_started_at_s=None)
    assert (d.action, d.generation) == ("create", 3) and "process 7 on h is gone" in d.why
    assert decide_lease((2, doc), "a", 101.0, host="h", pid_started_at_s=50.0).action == "wait"
    assert decide_lease((2, doc), "a", 101.0, host="other", pid_started_at_s=None).action == "wait"


def test_renewal_is_due_every_third_of_the_ttl():
    from kiln.core.run.leases import renewal_due
    assert not renewal_due(100.0, 119.0, 60.0) and renewal_due(100.0, 120.0, 60.0)
