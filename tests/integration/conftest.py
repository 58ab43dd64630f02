"""Fixtures for tests that run what a user runs: `kiln` and `kiln_env` live in tests/conftest.py,
shared with tests/faults and tests/trust; here, a Dask cluster started as a user starts one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DASK = str(Path(sys.executable).with_name("dask"))


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaskCluster:
    """`dask scheduler` and one `dask worker` per host on loopback, as a user starts them."""

    def __init__(self, env: dict, hosts: dict[str, dict], log_dir: Path, nanny: bool = True):
        import time

        from distributed import Client

        port = free_port()
        self.address = f"tcp://127.0.0.1:{port}"
        self.procs = [subprocess.Popen(
            [DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
            env=env, stdout=open(log_dir / "scheduler.log", "wb"), stderr=subprocess.STDOUT)]
        self.workers = {}
        for name, extra in hosts.items():
            proc = subprocess.Popen(
                [DASK, "worker", self.address, "--host", "127.0.0.1", "--nthreads", "2", "--name", name,
                 "--resources", f"kiln-host-{name}=1", "--no-dashboard", "--nanny" if nanny else "--no-nanny"],
                env={**env, **extra}, stdout=open(log_dir / f"{name}.log", "wb"), stderr=subprocess.STDOUT)
            self.procs.append(proc)
            self.workers[name] = proc
        deadline = time.monotonic() + 120
        with Client(self.address, timeout=60) as client:
            while len(client.scheduler_info()["workers"]) < len(hosts):
                assert time.monotonic() < deadline, "dask workers did not join"
                time.sleep(0.5)

    def stop(self) -> None:
        """The workers first, the scheduler once they are gone: a worker that learns of the scheduler's close
        before its own SIGTERM closes the other way, and hung for its nanny's 8 s before being killed."""
        workers, scheduler = self.procs[1:], self.procs[:1]
        for group in (workers, scheduler):
            for p in group:
                if p.poll() is None:
                    p.terminate()
            for p in group:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()


def cluster_env(kiln_env: dict, prefect_url: str, s3_endpoint: str, signing_key_env: dict) -> dict:
    """What every host of a test cluster has in its environment: Prefect, S3 credentials, no daemon workers,
    and the export's signing key (a compiling host vouches for what it compiles: docs/trust.md)."""
    return {**kiln_env, **signing_key_env, "PREFECT_API_URL": prefect_url, "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
            "AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
