"""Which hosts are there: the Dask scheduler's answer at the moment asked, never a cached one without workers.

`Client.scheduler_info()` returns the client's cached identity, which its periodic refresh replaces with one
that lists no worker; read between the two, every host looked gone, and a loaded export's compile phase took
a live host for lost (a CI run: host-a 'lost mid-compile' while its worker was connected). Here the refresh
runs every millisecond, so a read that can race it does (85 of 300 reads did, before the fix).
"""

from __future__ import annotations

import dask
from distributed import Scheduler, SpecCluster, Worker

from flows.hosts import RESOURCE_PREFIX, HostRunner


def test_the_hosts_alive_are_every_connected_worker_at_every_read(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # required for hosts; never called here
    workers = {name: {"cls": Worker, "options": {"nthreads": 1, "name": name,
                                                  "resources": {f"{RESOURCE_PREFIX}{name}": 1}}}
               for name in ("host-a", "host-b")}
    with dask.config.set({"distributed.client.scheduler-info-interval": "1ms"}), \
            SpecCluster(scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": False}},
                        workers=workers) as cluster, \
            HostRunner(dask_address=cluster.scheduler_address) as runner:
        assert runner.host_names == ["host-a", "host-b"]
        seen = [runner.alive() for _ in range(300)]
    assert all(hosts == {"host-a", "host-b"} for hosts in seen), [h for h in seen if h != {"host-a", "host-b"}][:3]
