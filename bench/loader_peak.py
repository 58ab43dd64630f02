"""The loader's memory: one rank's weights read and stacked, peak resident memory against their bytes.

`python -m bench.loader_peak CHECKPOINT TP RANK` loads rank RANK's package
constants with kiln.host.checkpoint.load_rank_weights (stacked constants
allocated once, each layer's slice copied in) in this fresh process and prints
{'weight_bytes', 'peak_growth_bytes', 'peak_over_weights'}: the growth of the
process's peak resident memory (ru_maxrss) over what it was before loading,
against the bytes of the constants it returned. 1.0 means the loader never held
more than the weights themselves; 2.0 would be a second copy.
"""

from __future__ import annotations

import json
import resource
import sys


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure(checkpoint: str, tp: int, rank: int) -> dict:
    import torch  # noqa: F401  (imported before the baseline: its own memory is not the loader's)

    from kiln.host.checkpoint import inspect_checkpoint, load_rank_weights

    cfg = inspect_checkpoint(checkpoint)
    before = _peak_bytes()
    weights = load_rank_weights(checkpoint, cfg, tp, rank)
    growth = _peak_bytes() - before
    weight_bytes = sum(t.nbytes for t in weights.values())
    return {"weight_bytes": weight_bytes, "peak_growth_bytes": growth,
            "peak_over_weights": round(growth / weight_bytes, 3)}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
