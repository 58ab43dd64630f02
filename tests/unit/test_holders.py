"""Whether a lease holder is provably gone (kiln.core.run.holders): its process here dead, or its record expired."""

from kiln.core.run.holders import describe, holder_gone, holder_record

HOST = "node-a"


def rec(host=HOST, pid=4242, started=1000.0, now=2000.0, ttl=120.0) -> dict:
    return holder_record(host, pid, started, now, ttl)


def test_a_live_holder_on_this_host_is_not_gone():
    assert holder_gone(rec(), host=HOST, now_s=2010.0, pid_started_at_s=1000.0) is None


def test_a_dead_process_on_this_host_is_gone_at_once():
    why = holder_gone(rec(), host=HOST, now_s=2001.0, pid_started_at_s=None)
    assert why == "its process 4242 on node-a is gone"


def test_a_reused_pid_is_not_mistaken_for_the_holder():
    why = holder_gone(rec(), host=HOST, now_s=2001.0, pid_started_at_s=1500.0)
    assert why and "now another process" in why


def test_start_time_jitter_under_a_second_is_the_same_process():
    assert holder_gone(rec(), host=HOST, now_s=2001.0, pid_started_at_s=1000.4) is None


def test_a_holder_on_another_host_is_judged_by_its_expiry_only():
    other = rec(host="node-b")
    assert holder_gone(other, host=HOST, now_s=2119.0, pid_started_at_s=None) is None
    assert holder_gone(other, host=HOST, now_s=2130.0, pid_started_at_s=None) == "its lease expired 10 s ago"


def test_a_live_process_that_stopped_renewing_has_let_go():
    assert holder_gone(rec(), host=HOST, now_s=2200.0, pid_started_at_s=1000.0) == "its lease expired 80 s ago"


def test_a_record_without_process_or_expiry_is_no_proof():
    old = {"flow_run_id": "x", "flow_run_name": "first-run", "export_id": "e", "since": "2026-12-01T00:00:00+00:00"}
    assert holder_gone(old, host=HOST, now_s=1e12, pid_started_at_s=None) is None
    assert holder_gone({}, host=HOST, now_s=1e12, pid_started_at_s=None) is None
    assert holder_gone({"expires_at": True}, host=HOST, now_s=1e12, pid_started_at_s=None) is None


def test_describe_names_process_run_and_export():
    text = describe({**rec(), "flow_run_name": "grateful-tody", "flow_run_id": "r1", "export_id": "e1"})
    assert text == "flow run grateful-tody (r1), export e1, process 4242 on node-a"
    assert describe({}) == "another export"
