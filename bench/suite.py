"""`kiln bench [--quick] [PART ...]`: run the suite (or named parts) and write the results.

Writes `<out>/<UTC stamp>.json` (a flat `figures` object of medians, every
figure's samples and spread in `figure_samples`, the targets, raw timings per
sample, what each measurement includes, machine, commit and load),
`<stamp>.md` (the table) and `<stamp>.png` (the chart). Parts run one after
another, never concurrently; the servers are started first and not charged
to any part. The whole list of parts runs once per sample (3 in a full run),
each sample in a fresh work directory, the two sides of a ratio in the
opposite order on every other sample.
Exit 0 when every part ran, 1 when some part failed (its error is recorded,
the others still run), 2 for an unknown part name.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench.context import Context, Settings
from bench.figures import median, render_markdown, round_floats, targets_for
from bench.parts_collective import part_collective
from bench.parts_decode import part_decode_context
from bench.parts_depth import part_depth
from bench.parts_memory import part_rank_peak
from bench.parts_hosts import BUCKET, part_borrow, part_fail_fast, part_gate_scale, s3_client
from bench.parts_mla import part_mla
from bench.parts_checks import part_checks
from bench.parts_quantized import part_quantized
from bench.parts_moe import part_moe
from bench.parts_ranges import part_ranges
from bench.parts_single import part_compile_efficiency, part_dedup, part_overhead, part_pool_vs_loop, part_warm_cold
from bench.parts_s3_read import part_s3_read
from bench.parts_store import part_store
from bench.parts_uneven import part_uneven
from bench.runs import LoadSampler, MotoServer, Workdir
from kiln.core.errors import BadInput

PARTS = {"fail_fast": part_fail_fast, "compile_efficiency": part_compile_efficiency,
         "pool_vs_loop": part_pool_vs_loop, "dedup": part_dedup, "warm_cold": part_warm_cold,
         "overhead": part_overhead, "store": part_store, "borrow": part_borrow, "gate_scale": part_gate_scale,
         "collective": part_collective, "depth": part_depth, "s3_read": part_s3_read,
         "moe": part_moe, "mla": part_mla, "ranges": part_ranges, "rank_peak": part_rank_peak,
         "decode_context": part_decode_context, "checks": part_checks, "quantized": part_quantized,
         "uneven": part_uneven}
REPEATS_INSIDE = {"store", "collective", "gate_scale", "depth", "s3_read", "moe", "mla", "ranges", "rank_peak",
                  "decode_context", "checks", "quantized", "uneven"}
"""Parts that take their own samples in one call (alternating sides inside); the suite runs them once."""
QUICK_SKIPS = ("borrow", "moe", "mla", "ranges", "rank_peak", "decode_context", "checks", "quantized", "uneven")
"""Parts `--quick` leaves out unless named: two cold 3-host exports do not fit in its few minutes, and the
test suite's time has no room for the compiles of moe, mla, ranges, rank_peak, decode_context, checks,
quantized and uneven (`kiln bench --quick moe mla ranges rank_peak decode_context checks quantized uneven` runs
them)."""
NEEDS_PREFECT_SERVER = {"borrow", "warm_cold", "overhead"}
NEEDS_S3 = {"fail_fast", "borrow", "store", "s3_read"}
REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"


def select(parts: list[str], quick: bool) -> list[str]:
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise BadInput(f"unknown bench part(s) {', '.join(unknown)}; parts are: {', '.join(PARTS)}.")
    if parts:
        return [p for p in PARTS if p in parts]
    return [p for p in PARTS if not (quick and p in QUICK_SKIPS)]


MEASURED_CODE = ("kiln", "flows", "tasks", "blocks", "cli", "bench")
"""The folders whose code the figures describe (bench/results and the markdown files excepted)."""


def _git(*args: str) -> str | None:
    try:
        run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout if run.returncode == 0 else None


def code_state() -> dict:
    """The commit measured and whether the measured code had uncommitted changes (`code_changed` lists them)."""
    changed = _git("status", "--porcelain", "--", *MEASURED_CODE, ":(exclude)bench/results", ":(exclude)*.md")
    return {"commit": (_git("rev-parse", "HEAD") or "").strip() or None,
            "code_changed": None if changed is None else [line[3:] for line in changed.splitlines()]}


def _machine() -> dict:
    import psutil

    from kiln.host.machine.probe import num_cpus

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"cpus": num_cpus(), "mem_total_mib": psutil.virtual_memory().total // 2**20,
            "python": platform.python_version(), "platform": platform.platform(), "torch": version("torch"),
            "prefect": version("prefect"), "boto3": version("boto3"), **code_state(),
            "load_start": os.getloadavg()[0]}


def _servers(stack: ExitStack, ctx: Context, selected: list[str], raw: dict) -> None:
    from flows.prefect_server import PrefectServer

    work = ctx.work
    if NEEDS_S3.intersection(selected):
        start = time.perf_counter()
        moto = MotoServer(work.path("logs", "moto_server.log"))
        stack.callback(moto.stop)
        work.s3_endpoint = moto.endpoint_url
        s3_client(ctx).create_bucket(Bucket=BUCKET)
        raw["moto_server_start_s"] = time.perf_counter() - start
    if NEEDS_PREFECT_SERVER.intersection(selected):
        start = time.perf_counter()
        server = PrefectServer(work.path("prefect-server"))
        stack.callback(server.stop)
        work.prefect_url = server.url
        raw["prefect_server_start_s"] = time.perf_counter() - start


def summarize(samples: dict[str, list]) -> tuple[dict, dict]:
    """Each figure's median over its samples, and the samples themselves with their spread."""
    figures, kept = {}, {}
    for name, values in samples.items():
        finite = [v for v in values if v is not None]
        figures[name] = median(finite)
        kept[name] = {"values": values, "n": len(finite), "min": min(finite, default=None),
                      "max": max(finite, default=None)}
    return figures, kept


def run_suite(parts: list[str], *, quick: bool = False, out_dir: str | None = None, keep: bool = False,
              samples: int | None = None) -> int:
    """Run the selected parts; write JSON, markdown and PNG; print the table. See the module docstring."""
    selected = select(parts, quick)
    settings = Settings.for_mode(quick, samples)
    started = dt.datetime.now(dt.timezone.utc)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    out = Path(out_dir) if out_dir else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"kiln-bench-{stamp}-"))
    ctx = Context(Workdir(root), settings, tuple(selected))
    result: dict = {"stamp": stamp, "started_utc": started.isoformat(), "mode": "quick" if quick else "full",
                    "parts": selected, "settings": settings.to_dict(), "machine": _machine(), "figures": {},
                    "targets": {}, "raw": {"suite": {}}, "notes": {}, "errors": {}}
    print(f"kiln bench ({result['mode']}): {', '.join(selected)}; work dir {root}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    taken: dict[str, list] = {}
    with LoadSampler() as load, ExitStack() as stack:
        try:
            _servers(stack, ctx, selected, result["raw"]["suite"])
        except Exception as exc:  # no servers: every part that needs one fails below, with this reason
            result["errors"]["servers"] = f"{type(exc).__name__}: {exc}"[:2000]
        for index in range(settings.samples):
            ctx.begin_sample(index)
            for name in selected:
                if name in result["errors"] or (index > 0 and name in REPEATS_INSIDE):
                    continue  # a part that failed once is not measured again
                print(f"bench: {name} (sample {index + 1} of {settings.samples})", file=sys.stderr, flush=True)
                part_start = time.perf_counter()
                try:
                    got = PARTS[name](ctx)
                except Exception as exc:
                    result["errors"][name] = f"{type(exc).__name__}: {exc}"[:3000]
                    print(f"bench: {name} failed: {result['errors'][name]}", file=sys.stderr, flush=True)
                    continue
                for figure, value in got["figures"].items():
                    taken.setdefault(figure, []).append(value)
                taken.update({figure: list(values) for figure, values in got.get("samples", {}).items()})
                result["raw"].setdefault(name, {"samples": []})["samples"].append(
                    {**got["raw"], "part_s": time.perf_counter() - part_start})
                result["notes"][name] = got["notes"]
    result["figures"], result["figure_samples"] = summarize(taken)
    result["suite_s"] = time.perf_counter() - t0
    result["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat()
    result["machine"].update(load_mean=median(load.samples) if load.samples else None,
                             load_max=max(load.samples, default=None), load_end=os.getloadavg()[0])
    result["targets"] = {n: {"op": t.op, "bound": t.bound} for n, t in targets_for(settings.tp).items()}
    if ctx.notes:
        result["notes"].update(ctx.notes)
    result["raw"]["commands"] = ctx.work.commands
    result = round_floats(result)
    paths = write_results(result, out)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    if result["errors"]:
        print(f"kiln bench: {len(result['errors'])} part(s) failed; logs kept in {root}", file=sys.stderr)
        return 1
    if keep:
        print(f"kiln bench: work directory kept: {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def write_results(result: dict, out: Path) -> dict[str, Path]:
    """`<stamp>.json`, `<stamp>.md` and (when there are figures) `<stamp>.png` in `out`."""
    from bench.chart import write_chart

    paths = {"json": out / f"{result['stamp']}.json", "md": out / f"{result['stamp']}.md"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    paths["md"].write_text(render_markdown(result))
    png = write_chart(result, out / f"{result['stamp']}.png")
    if png is not None:
        paths["png"] = png
    return paths
