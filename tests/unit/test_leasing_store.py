"""kiln.host.leases.leasing's Leases against a local store in a temporary directory: what it reads, writes and deletes."""

from __future__ import annotations

import logging
import time

import pytest

from kiln.core.trust import layout
from kiln.core.run.leases import new_lease
from kiln.host.leases.leasing import LeaseWaitExpired, Leases, compile_leased
from kiln.store import open_store

SCOPE = "ed25519-0123"
"""The exports of one signer share leases (kiln.host.phases.host_compile.lease_scope)."""
KEY = "0" * 32


@pytest.fixture
def store(tmp_path):
    return open_store(f"file://{tmp_path / 'store'}")


def test_a_stray_object_under_the_lease_prefix_is_no_lease(store):
    store.put_bytes(f"{layout.lease_prefix(KEY, SCOPE)}notes.txt", b"left here by a person")
    store.put_bytes(f"{layout.lease_prefix(KEY, SCOPE)}zzz/00000009.json", b"{}")
    leases = Leases(store, "a:host", 60.0, scope=SCOPE)
    assert leases.acquire(KEY)
    assert leases.held[KEY][0] == 0
    assert layout.lease_generations(KEY, SCOPE, store.list(layout.lease_prefix(KEY, SCOPE))) == {0: layout.lease_key(KEY, SCOPE, 0)}


def test_release_deletes_only_the_generation_held_not_a_contenders(store):
    a = Leases(store, "a:host", 60.0, scope=SCOPE)
    assert a.acquire(KEY)
    # b takes the key over (as it would once a's lease had expired): generation 1 is b's.
    store.put_json(layout.lease_key(KEY, SCOPE, 1), new_lease("b:host", time.time(), 60.0))
    a.release(KEY)
    assert store.exists(layout.lease_key(KEY, SCOPE, 1)), "a deleted the lease its contender holds now"
    assert not a.held


def test_release_deletes_our_generation_and_the_ones_it_replaced(store):
    store.put_json(layout.lease_key(KEY, SCOPE, 0), new_lease("dead:host", time.time() - 3600, 60.0))
    a = Leases(store, "a:host", 60.0, scope=SCOPE)
    assert a.acquire(KEY) and a.held[KEY][0] == 1  # taken over
    a.release(KEY)
    assert store.list(layout.lease_prefix(KEY, SCOPE)) == []


def test_release_leaves_a_recreated_generation_of_someone_else_alone(store):
    a = Leases(store, "a:host", 60.0, scope=SCOPE)
    assert a.acquire(KEY)
    store.delete(layout.lease_key(KEY, SCOPE, 0))  # broken by the orchestrator; another export took the free key
    store.put_json(layout.lease_key(KEY, SCOPE, 0), new_lease("b:host", time.time(), 60.0))
    a.release(KEY)
    assert store.get_json(layout.lease_key(KEY, SCOPE, 0))["owner"] == "b:host"


def test_renewal_stops_once_another_export_took_the_lease_over(store, caplog):
    a = Leases(store, "a:host", 3.0, scope=SCOPE)
    assert a.acquire(KEY)
    store.put_json(layout.lease_key(KEY, SCOPE, 1), new_lease("b:host", time.time(), 60.0))
    a.held[KEY] = (0, time.time() - 10)  # renewal due
    before = store.get_json(layout.lease_key(KEY, SCOPE, 0))
    with caplog.at_level(logging.WARNING, logger="kiln.host.leases.leasing"):
        a.renew_due()
    assert KEY not in a.held
    assert store.get_json(layout.lease_key(KEY, SCOPE, 0)) == before, "renewed a lease taken over"
    assert "no longer ours" in caplog.text and "b:host" in caplog.text


def test_renewal_goes_on_while_the_lease_is_ours(store):
    a = Leases(store, "a:host", 3.0, scope=SCOPE)
    assert a.acquire(KEY)
    a.held[KEY] = (0, time.time() - 10)
    before = store.get_json(layout.lease_key(KEY, SCOPE, 0))["expires_at"]
    a.renew_due()
    assert KEY in a.held and store.get_json(layout.lease_key(KEY, SCOPE, 0))["expires_at"] > before


class NoPool:
    """A pool that compiles nothing: every job is asked for (on_submit), none is started."""

    def run(self, jobs, on_done, *, on_submit=None, on_tick=None, tick_s=10.0):
        for spec, _ in jobs:
            assert not on_submit(spec)
        return []

    def stop(self):
        pass


def test_waiting_for_another_exports_lease_has_a_deadline(store):
    store.put_json(layout.lease_key(KEY, SCOPE, 0), new_lease("other-export:host-b", time.time(), 3600.0,
                                                       {"host": "host-b", "pid": 4242, "started_at": 1.0}))
    leases = Leases(store, "a:host", 60.0, scope=SCOPE)
    start = time.monotonic()
    with pytest.raises(LeaseWaitExpired) as err:
        compile_leased(NoPool(), leases, [({"key": KEY}, "unused")], lambda r: None, stored=lambda key: False,
                       poll_s=0.05, wait_s=0.3)
    assert time.monotonic() - start < 10
    assert KEY in str(err.value) and "process 4242 on host-b" in str(err.value) and "lease_wait_s" in str(err.value)
    assert store.exists(layout.lease_key(KEY, SCOPE, 0))  # not ours: left alone
