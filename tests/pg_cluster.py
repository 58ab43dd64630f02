"""A throwaway PostgreSQL cluster on loopback, for the Prefect server the ops tests start.

`start()` runs `initdb` in a fresh temp dir and `pg_ctl start` on a given
127.0.0.1 port (its Unix socket in that dir too), creates the database
`prefect` owned by the superuser `prefect` (password auth, as
infra/compose.yaml's Postgres) with the `pg_trgm` extension Prefect's
migrations use, and returns the `postgresql+asyncpg://` URL that
PREFECT_API_DATABASE_CONNECTION_URL takes. `stop()` stops it and removes the
dir. PostgreSQL refuses to run as root: as root the cluster belongs to, and
its server runs as, the user `nobody`.

The binaries come from PATH, else from where Debian's postgresql package puts
them (/usr/lib/postgresql/<major>/bin, the newest); `make test-setup`
installs that package where both are missing. The cluster trades durability
for speed (fsync off): it lives for one test session.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 120  # pg_ctl -w waits this long for the server to accept connections
_TOOLS = ("initdb", "pg_ctl", "psql")
_DEBIAN_BIN = Path("/usr/lib/postgresql")


@dataclass
class Cluster:
    url: str
    """postgresql+asyncpg://prefect:PASSWORD@127.0.0.1:PORT/prefect"""
    root: Path
    log: Path
    port: int
    password: str
    """The superuser prefect's (scram-sha-256 over TCP)."""
    bin_dir: Path
    run_as: tuple[int, int] | None
    """(uid, gid) the server runs as when this process is root, else None."""


def find_bin_dir() -> Path | None:
    """The directory holding initdb, pg_ctl and psql: PATH's initdb's (links resolved), else Debian's newest."""
    candidates = []
    if on_path := shutil.which("initdb"):
        candidates.append(Path(on_path).resolve().parent)
    if _DEBIAN_BIN.is_dir():
        versions = [p for p in _DEBIAN_BIN.iterdir() if p.name.isdigit()]
        candidates += [p / "bin" for p in sorted(versions, key=lambda p: int(p.name), reverse=True)]
    return next((d for d in candidates if all((d / tool).exists() for tool in _TOOLS)), None)


def _run(cluster: Cluster, tool: str, *args: str, as_owner: bool = False, env: dict | None = None,
         timeout_s: float = START_TIMEOUT_S + 30) -> str:
    """Run one of the cluster's binaries (as the cluster's owner if `as_owner`); its stdout, or RuntimeError."""
    uid, gid = cluster.run_as if as_owner and cluster.run_as else (None, None)
    if as_owner:
        env = {"HOME": str(cluster.root), **(env or {})}
    proc = subprocess.run([str(cluster.bin_dir / tool), *args], capture_output=True, text=True, timeout=timeout_s,
                          user=uid, group=gid, env={**os.environ, "LC_ALL": "C", **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)} failed ({proc.returncode}): {proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    return proc.stdout


def query(cluster: Cluster, sql: str, database: str = "prefect") -> str:
    """`psql -tAc sql` as the superuser over TCP: the rows, unaligned, one a line."""
    client = {"PGPASSWORD": cluster.password, "PGHOST": "127.0.0.1", "PGPORT": str(cluster.port), "PGUSER": "prefect"}
    return _run(cluster, "psql", "-v", "ON_ERROR_STOP=1", "-d", database, "-tAc", sql, env=client, timeout_s=60)


def start(bin_dir: Path, port: int) -> Cluster:
    """initdb, start and prepare a cluster listening on 127.0.0.1:`port` (see the module docstring);
    RuntimeError with the server's log if it fails."""
    run_as = None
    root = Path(tempfile.mkdtemp(prefix="kiln-pg-"))  # not under pytest's tmp dirs: those are root-only (0700)
    if os.geteuid() == 0:
        try:
            nobody = pwd.getpwnam("nobody")
        except KeyError:
            raise RuntimeError("PostgreSQL refuses to run as root and this machine has no user 'nobody' to run "
                               "it as; run the tests as another user or add one (useradd nobody)") from None
        run_as = (nobody.pw_uid, nobody.pw_gid)
        os.chown(root, *run_as)
    password = secrets.token_hex(16)
    (root / "pw").write_text(password)
    if run_as:
        os.chown(root / "pw", *run_as)
    log = root / "postgres.log"
    cluster = Cluster(f"postgresql+asyncpg://prefect:{password}@127.0.0.1:{port}/prefect", root, log, port,
                      password, bin_dir, run_as)
    try:
        _run(cluster, "initdb", "-D", str(root / "data"), "-U", "prefect", f"--pwfile={root / 'pw'}",
             "--auth=scram-sha-256", "-E", "UTF8", "--locale=C", as_owner=True)
        options = (f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={root} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        _run(cluster, "pg_ctl", "-D", str(root / "data"), "-l", str(log), "-w", "-t", str(START_TIMEOUT_S),
             "-o", options, "start", as_owner=True)
        query(cluster, "CREATE DATABASE prefect", database="postgres")
        query(cluster, "CREATE EXTENSION IF NOT EXISTS pg_trgm")
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        server_log = log.read_text()[-3000:] if log.exists() else "(no server log)"
        stop(cluster)
        raise RuntimeError(f"PostgreSQL cluster in {root} did not start: {e}; server log: {server_log}") from None
    return cluster


def stop(cluster: Cluster) -> None:
    """Stop the server (fast shutdown: sessions are cut) and remove the cluster's directory."""
    pid_file = cluster.root / "data" / "postmaster.pid"
    if pid_file.exists():
        try:
            _run(cluster, "pg_ctl", "-D", str(cluster.root / "data"), "-m", "fast", "-w", "stop",
                 as_owner=True, timeout_s=60)
        except (RuntimeError, subprocess.TimeoutExpired):
            try:  # SIGQUIT: PostgreSQL's immediate shutdown, which does not wait for anything
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGQUIT)
            except (OSError, ValueError, IndexError):
                pass
    shutil.rmtree(cluster.root, ignore_errors=True)
