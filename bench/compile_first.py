"""The fail-fast baseline: compile first, check afterwards (how the incident's export behaved).

`python -m bench.compile_first --model DIR --buckets ... --store URL --json FILE [kiln export flags]`

On the same layout as the refused run (hosts host-0..host-N-1, one rank each,
the same recipe settings and assumed memory), every host sizes its own compile
pool from its memory; a host that cannot create one records a MemoryError and
compiles nothing, the others compile every forward their ranks need in a
`CompilePool` (uploading each to the store), and only then does the outcome
all-gather look at the errors and fail the export, as rank 0's 1310.8 s did.
One process, no Prefect, no Dask: the baseline pays less start-up than the
refused `kiln export`, so the ratio errs against Kiln. Exits 1 after writing
the JSON.
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compile_first")
    p.add_argument("--model", required=True)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--buckets", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--assume-available", action="append", default=[])
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)

    from flows.params import default_host_names, export_params, parse_assume_available, prepare
    from kiln.core.plan import decisions
    from kiln.core.plan.recipe import SETTINGS, parse_buckets
    from kiln.core.plan.settings import parse_assignments
    from kiln.core.plan.sizing import required_mib, worker_capacity
    from kiln.host.phases.host_compile import compile_on_host
    from kiln.host.phases.host_probe import probe_host
    from tasks.store import store_of

    params = export_params(model=args.model, hosts=args.hosts, tp=args.tp, store=args.store,
                           recipe={"buckets": parse_buckets(args.buckets), **parse_assignments(SETTINGS, args.set)},
                           assume_available=parse_assume_available(args.assume_available),
                          export_id=f"bench-compile-first-{int(time.time())}")
    job, hosts = prepare(params, host_names=default_host_names(params))
    t_probe = time.perf_counter()
    probes = [probe_host(job, h, store_of(job)) for h in hosts]
    reports = decisions.host_reports(job, probes)
    errors: dict[str, str] = {}
    compiled: dict[str, int] = {}
    t_compile = time.perf_counter()
    for host, probe, report in zip(hosts, probes, reports):
        cuda = report.device == "cuda"
        workers = min(worker_capacity(job.recipe, available_mib=report.available_mib, unified=report.unified,
                                      num_cpus=report.num_cpus, cuda=cuda, device_free_mib=report.device_free_mib),
                      len(probe.specs))
        if workers == 0:
            need = required_mib(job.recipe, 1, report.unified, cuda=cuda)
            errors[host.name] = (f"MemoryError: {report.available_mib} MiB available, one compile worker "
                                 f"needs {need} MiB")
            continue
        # Each host compiles what its ranks need, whatever the others do (no gate, no lending).
        done = compile_on_host(store_of(job), job, host, probe.specs, workers)
        compiled[host.name] = len(done["forwards"])
    t_check = time.perf_counter()
    # The outcome all-gather, after compiling: any host's error fails the export.
    failed = bool(errors)
    end = time.perf_counter()
    Path(args.json).write_text(json.dumps({
        "failed": failed, "errors": errors, "compiled": compiled,
        "setup_s": t_probe - _START, "probe_s": t_compile - t_probe, "compile_s": t_check - t_compile,
        "probe_to_failure_s": end - t_probe, "in_process_s": end - _START}, indent=2))
    if failed:
        print(f"export failed after compiling {sum(compiled.values())} forward(s) in {t_check - t_compile:.1f} s: "
              + "; ".join(f"{h}: {e}" for h, e in errors.items()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
