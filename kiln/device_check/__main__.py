"""`python -m kiln.device_check --device {cpu,cuda} --json FILE [--quick] [--work DIR] [--only STEP ...]`.

Runs the steps of kiln.device_check.steps in order and appends one JSON line
per step to FILE as it finishes: {"step", "ok", "seconds", ...figures}, or
{"step", "ok": false, "error"} with the exception's text. A step skipped on
this device is ok with its reason under "skipped". Exits 0 when every step is
ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from kiln.device_check import steps


def _append(path: Path, line: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")
        f.flush()


def run(device: str, json_path: Path, *, quick: bool = False, work: Path | None = None,
        only: tuple[str, ...] = ()) -> bool:
    """Run the steps (or those named in `only`); True when every one was ok."""
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="kiln-device-check-")) if own_work else work
    work.mkdir(parents=True, exist_ok=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    check = steps.Check(device=device, quick=quick, work=work)
    all_ok = True
    try:
        for name, fn in steps.STEPS:
            if only and name not in only:
                continue
            start = time.perf_counter()
            try:
                line = {"step": name, "ok": True, **fn(check)}
            except steps.Needs as exc:
                line = {"step": name, "ok": False, "error": str(exc)}
            except Exception as exc:  # every step's failure is a figure; the next step still runs
                line = {"step": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-4000:]}
            line["seconds"] = round(time.perf_counter() - start, 2)
            all_ok &= line["ok"]
            _append(json_path, {"device": device, **line})
            print(json.dumps({k: line[k] for k in ("step", "ok", "seconds")} | (
                {"error": line["error"][:300]} if "error" in line else {})), flush=True)
    finally:
        if check.pool is not None:
            check.pool.close()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    return all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.device_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True, help="the device to check")
    parser.add_argument("--json", type=Path, required=True, help="file to append one JSON line per step to")
    parser.add_argument("--quick", action="store_true", help="a narrower transformers model and one compile "
                        "worker (CI's CPU run)")
    parser.add_argument("--work", type=Path, help="keep packages and checkpoints here (default: a temporary "
                        "directory, removed at the end)")
    parser.add_argument("--only", nargs="+", choices=[name for name, _ in steps.STEPS], default=(),
                        help="run only these steps (with the ones they need named too)")
    args = parser.parse_args(argv)
    return 0 if run(args.device, args.json, quick=args.quick, work=args.work, only=tuple(args.only)) else 1


if __name__ == "__main__":
    sys.exit(main())
