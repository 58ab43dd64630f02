"""Where per-host tasks run: this process, a local Dask cluster standing for N hosts, or a real one.

Purpose: `HostRunner.submit(host, task, **params)` runs a Prefect task on the
host it concerns; `HostRunner.call(host, fn, *args)` runs a plain function
there (a reading, not a phase: no task run). One machine: the flow's own task runner. Several hosts: a
Dask cluster whose workers each carry a resource `kiln-host-<name>=1`, and
tasks pinned to that resource through prefect-dask's client, so they are
still Prefect task runs of the same flow run.

Contracts: every Dask worker runs with `distributed.worker.daemon: False` so
the compile pool can start processes inside it. Several processes report to
Prefect, so Dask needs a real Prefect server (PREFECT_API_URL); the embedded
API would start one temporary server per process.

Pitfalls: a worker without a `kiln-host-*` resource is not a host and gets no
work; two workers with the same host resource are refused (a host is one
worker).
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack, contextmanager

import dask

from kiln.core.errors import BadInput

RESOURCE_PREFIX = "kiln-host-"
WORKER_ENV = {"DASK_DISTRIBUTED__WORKER__DAEMON": "False", "DASK_LOGGING__DISTRIBUTED": "warning"}
"""What a host's Dask worker process needs at start: non-daemonic (compile pools start processes
inside it) and logs that stay readable. Set while a local cluster runs; an external `dask worker`
is started with them by its operator (see docs/several-hosts.md)."""


@contextmanager
def _worker_settings():
    """Dask config and environment for the worker processes this process starts, restored afterwards."""
    saved = {k: os.environ.get(k) for k in WORKER_ENV}
    os.environ.update(WORKER_ENV)
    try:
        with dask.config.set({"distributed.worker.daemon": False}):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Done:
    """A finished local call, shaped like a future."""

    def __init__(self, future):
        self._future = future

    def done(self) -> bool:
        return self._future.state.is_final()

    def result(self):
        return self._future.result()


class _Ready:
    """A value computed at once, shaped like a future."""

    def __init__(self, value):
        self._value = value

    def done(self) -> bool:
        return True

    def result(self):
        return self._value


class HostRunner:
    """Runs per-host tasks on their hosts; a context manager that owns any cluster it started."""

    def __init__(self, *, dask_address: str | None = None, num_local_hosts: int | None = None,
                 local_name: str | None = None):
        self._stack = ExitStack()
        self._client = None
        for name in ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.core",
                     "distributed.worker", "distributed.http.proxy", "distributed.batched"):
            logging.getLogger(name).setLevel(logging.ERROR)
        self.host_names: list[str]
        if dask_address or num_local_hosts:
            if not os.environ.get("PREFECT_API_URL"):
                raise BadInput("several hosts report to Prefect, so they need a Prefect server: set "
                               "PREFECT_API_URL (start one with `prefect server start`), or run on one host.")
            address = dask_address or self._start_local_cluster(num_local_hosts)
            self._connect(address)
        else:
            import socket
            self.host_names = [local_name or socket.gethostname() or "local"]

    def _start_local_cluster(self, n: int) -> str:
        from distributed import Nanny, Scheduler, SpecCluster

        if n < 1:
            raise BadInput(f"--hosts {n}: a cluster needs at least one host.")
        # Loopback only: these "hosts" are processes of this machine.
        workers = {f"host-{i}": {"cls": Nanny, "options": {
            "nthreads": 2, "name": f"host-{i}", "host": "127.0.0.1",
            "resources": {f"{RESOURCE_PREFIX}host-{i}": 1}}} for i in range(n)}
        self._stack.enter_context(_worker_settings())
        cluster = SpecCluster(scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": False}},
                              workers=workers, silence_logs=logging.WARNING)
        self._stack.enter_context(cluster)
        return cluster.scheduler_address

    def _connect(self, address: str) -> None:
        from prefect_dask.client import PrefectDaskClient

        try:
            self._client = self._stack.enter_context(PrefectDaskClient(address, timeout=10, set_as_default=False))
        except (OSError, TimeoutError) as exc:
            raise BadInput(f"cannot reach the Dask scheduler at {address} ({exc}); start it or fix --dask.") from None
        names = self._worker_hosts()
        if not names:
            raise BadInput(f"no Dask worker at {address} names a host; start one worker per host with "
                           f"`dask worker {address} --resources {RESOURCE_PREFIX}NAME=1`.")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise BadInput(f"several Dask workers claim host {dupes[0]}; a host is exactly one worker.")
        self.host_names = sorted(names)

    def _worker_hosts(self) -> list[str]:
        """The hosts the scheduler's workers name, asked now. Not `Client.scheduler_info()`: it returns the
        client's cached copy, which the client's own refresh (every 2 s) overwrites with one that lists no
        worker, so a read between the two saw no host at all and a loaded export took its hosts for lost."""
        names: list[str] = []
        for info in self._client.sync(self._client.scheduler.identity, n_workers=-1)["workers"].values():
            names += [r[len(RESOURCE_PREFIX):] for r in info.get("resources", {}) if r.startswith(RESOURCE_PREFIX)]
        return names

    @property
    def distributed(self) -> bool:
        return self._client is not None

    def alive(self) -> set[str]:
        """Hosts whose worker is connected now (this process is always alive)."""
        return set(self.host_names) if self._client is None else set(self._worker_hosts())

    def cancel(self, future) -> None:
        if self._client is not None:
            self._client.cancel(future)

    def submit(self, on, task, **parameters):
        """Run `task(**parameters)` on host `on` (a HostSpec); returns a future with done() and result()."""
        if self._client is None:
            return _Done(task.submit(**parameters))
        return self._client.submit(task, parameters=parameters, return_type="result", pure=False,
                                   resources={f"{RESOURCE_PREFIX}{on.name}": 1})

    def call(self, on, fn, *args):
        """Run plain `fn(*args)` on host `on` outside Prefect (no task run, no log line): for readings
        such as the memory ledger's, not phases. Returns a future with done() and result()."""
        if self._client is None:
            return _Ready(fn(*args))
        return self._client.submit(fn, *args, pure=False, resources={f"{RESOURCE_PREFIX}{on.name}": 1})

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "HostRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
