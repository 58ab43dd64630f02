"""The loader's memory: one rank's weights read and stacked, peak resident memory against their bytes.

`python -m bench.loader_peak CHECKPOINT TP RANK [S3_ENDPOINT]` loads rank RANK's
package constants with kiln.host.weights.rank_weights.load_rank_weights (a directory:
kiln.host.weights.checkpoint's reader; s3://BUCKET/PREFIX: kiln.host.weights.s3_checkpoint's,
no host cache; stacked constants allocated once, each layer's slice copied in)
in this fresh process and prints
{'weight_bytes', 'peak_growth_bytes', 'peak_over_weights'}: the growth of the
process's peak resident memory over what it held before loading, against the
bytes of the constants it returned. 1.0 means the loader never held more than
the weights themselves; 2.0 would be a second copy.

Pitfall: the peak is the process's own VmHWM (Linux's /proc/self/status),
reset to its resident memory just before loading, never ru_maxrss: that one
also counts what the parent held when it forked this process (bench/scale_1b.py
held its random checkpoint then, so the growth read 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field} (the loader's peak is measured on Linux only)")


def _reset_peak() -> None:
    """Reset VmHWM to the current resident memory (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_growth_bytes(call) -> int:
    """How far the process's peak resident memory rose above what it held while `call()` ran, in bytes."""
    _reset_peak()
    before = _status_bytes("VmRSS")
    call()
    return _status_bytes("VmHWM") - before


def measure(checkpoint: str, tp: int, rank: int, s3_endpoint: str | None = None) -> dict:
    import torch  # noqa: F401  (imported before the baseline: its own memory is not the loader's)

    from kiln.host.weights.rank_weights import inspect, load_rank_weights

    cfg = inspect(checkpoint, s3_endpoint=s3_endpoint)  # boto3 imported and a client made before the baseline
    _reset_peak()
    before = _status_bytes("VmRSS")
    weights = load_rank_weights(checkpoint, cfg, tp, rank, s3_endpoint=s3_endpoint)
    growth = _status_bytes("VmHWM") - before
    weight_bytes = sum(t.nbytes for t in weights.values())
    return {"weight_bytes": weight_bytes, "peak_growth_bytes": growth,
            "peak_over_weights": round(growth / weight_bytes, 3)}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])))
