"""The export without Prefect: the same phases, compile pool and store, driven by a plain script.

`python -m bench.direct --model DIR --tp N --buckets ... --store URL --json FILE`

Kiln's overhead is `kiln export` against this: both probe, plan KV, run the
gate, compile in the same `CompilePool` (through `kiln.host`'s host work), check the
outcome, fetch and verify every rank against eager, and write the manifest to
the same kind of store; this script does it in one process on one host, with
no flow, no tasks, no API server and no artifacts.
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.direct")
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--buckets", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)

    from kiln.host.trust.signers import write_signed_manifest
    from flows.params import ExportParams, default_host_names, prepare
    from kiln.core.plan import decisions
    from kiln.core.run import outcome
    from kiln.core.model.contract import weight_layout
    from kiln.core.machine.home import kiln_home
    from kiln.core.trust.manifest import build_manifest
    from kiln.host.machine import probe
    from kiln.host.phases import host_compile, host_probe, rank_check, share
    from tasks.store import store_of

    phases: dict[str, float] = {}
    ledger: list[dict] = []
    params = ExportParams(model=args.model, tp=args.tp, recipe={"buckets": args.buckets, "shape_policy": "static"}, store=args.store,
                          export_id=f"bench-direct-{int(time.time())}")
    job, hosts = prepare(params, host_names=default_host_names(params))
    (host,) = hosts
    store = store_of(job)

    def phase(name: str, started: float) -> None:
        phases[name] = time.perf_counter() - started
        ledger.append({"phase": name, **probe.memory_snapshot()})

    t = time.perf_counter()
    probes = [host_probe.probe_host(job, host, store)]
    phase("probe", t)
    t = time.perf_counter()
    decision = decisions.decide_export(job, probes)
    if decision.refusal:
        raise decision.refusal
    kv, plan = decision.kv_plan, decision.plan
    phases["kv-plan"], phases["gate"] = decision.kv_plan_s, decision.gate_s
    ledger.append({"phase": "gate", **probe.memory_snapshot()})
    specs = {s.key: s for s in probes[0].specs}
    t = time.perf_counter()
    hp = plan.hosts[host.name]
    done = host_compile.compile_on_host(store, job, host, [specs[k] for k in hp.compile], hp.workers)
    compiled = {e["key"]: e for e in done["forwards"]}
    phase("compile", t)
    t = time.perf_counter()
    own = share.trusted_packages(store, sorted(specs), {}, {k: e["sha256"] for k, e in compiled.items()})[0]
    found, missing = share.stored_forwards(store, sorted(specs), own)
    stored = outcome.check_outcome(found, missing, specs)
    phase("outcome-check", t)
    forwards = outcome.forward_records(specs, stored, compiled, job.model_config, job.tp, outcome.target_cpus(probes))
    t = time.perf_counter()
    share.fetch_missing(store, job, host, forwards)
    diffs = rank_check.check_ranks(job, host, forwards)["checks"]
    if not all(outcome.passed(c) for c in diffs.values()):
        raise SystemExit(f"a compiled forward differs from eager: {diffs}")
    phase("share-verify", t)
    t = time.perf_counter()
    manifest = build_manifest(export_id=job.export_id, model={"name": job.model_name, "checkpoint": job.checkpoint},
                              recipe=job.recipe.to_dict(), tp=job.tp, buckets=[str(b) for b in job.recipe.buckets],
                              forwards=forwards, weights=weight_layout(job.model_config, job.tp), kv_plan=kv, hosts=[{"name": host.name, "memory": ledger}],
                              phases=[{"name": n, "duration_s": s} for n, s in phases.items()],
                              signing=job.signing.manifest_entry())
    write_signed_manifest(store, job.export_id, manifest, job.signing, kiln_home())  # signed, as the flow does
    phase("manifest", t)
    Path(args.json).write_text(json.dumps({
        "phases_s": phases, "workers": hp.workers, "compiled": len(compiled),
        "per_forward_compile_s": {str(specs[k].shapes): e["compile_s"] for k, e in compiled.items()},
        "in_process_s": time.perf_counter() - _START}, indent=2))


if __name__ == "__main__":
    main()
