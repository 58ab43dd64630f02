"""Parts about several hosts and the gate: fail-fast, borrow, and the gate at scale on paper.

The 3-host runs use a local Dask cluster (`kiln export --hosts 3`), the
suite's Prefect server and its moto S3 server, each with a fresh Inductor
cache, KILN_HOME and store prefix.
"""

from __future__ import annotations

import json

import boto3

from bench.context import INCIDENT_ASSUME, INCIDENT_SETTINGS, Context
from bench.figures import median, ratio
from bench.parts_single import measured_compile_s
from bench.runs import FAKE_AWS, KILN, PYTHON, BenchFailed
from bench.scale import simulate
from kiln.core.trust import layout

BUCKET = "kiln-bench"


def s3_client(ctx: Context):
    return boto3.client("s3", endpoint_url=ctx.work.s3_endpoint, region_name=FAKE_AWS["AWS_DEFAULT_REGION"],
                        aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"])


def _stored(ctx: Context, prefix: str) -> list[str]:
    listing = s3_client(ctx).list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/{layout.FORWARDS}")
    return [o["Key"] for o in listing.get("Contents", [])]


def _layout(ctx: Context, *extra: str, buckets: str | None = None) -> list[str]:
    flags = ["--model", ctx.model, "--hosts", str(ctx.s.hosts_tp), "--tp", str(ctx.s.hosts_tp),
             "--buckets", buckets or ctx.s.buckets, "--set", "shape_policy=static"]  # one forward per bucket
    for item in INCIDENT_SETTINGS:
        flags += ["--set", item]
    return flags + list(extra)


def _assume() -> list[str]:
    return [a for item in INCIDENT_ASSUME for a in ("--assume-available", item)]


def _phases(report: dict) -> dict[str, float]:
    return {p["name"]: p["duration_s"] for p in report["phases"]}


def part_fail_fast(ctx: Context) -> dict:
    ctx.warm_up()
    w = ctx.work
    report_path = w.path("fail-fast", "refused.json")
    refused_prefix, baseline_prefix = ctx.tag("ff-refused"), ctx.tag("ff-baseline")
    out = w.path("fail-fast", "baseline.json")
    runs = {}

    def refuse() -> None:
        runs["refused"] = w.run("fail-fast-refused",
                                [*KILN, "export", *_layout(ctx, *_assume(), "--policy", "fail"),
                                 "--store", f"s3://{BUCKET}/{refused_prefix}", "--report", str(report_path)],
                                w.env(inductor="ff-refused", kiln_home="fail-fast/refused-home")).expect(3)

    def compile_first() -> None:
        runs["baseline"] = w.run("fail-fast-compile-first",
                                 [PYTHON, "-m", "bench.compile_first", *_layout(ctx, *_assume()),
                                  "--store", f"s3://{BUCKET}/{baseline_prefix}", "--json", str(out)],
                                 w.env(inductor="ff-baseline", kiln_home="fail-fast/baseline-home")).expect(1)

    order = ctx.ordered([("refused", refuse), ("baseline", compile_first)])
    for _, side in order:
        side()
    refused, baseline_run = runs["refused"], runs["baseline"]
    report = json.loads(report_path.read_text())
    phases = _phases(report)
    home = w.root / "fail-fast" / "refused-home"
    evidence = {"phases": list(phases), "gate_decision": report["gate"]["decision"],
                "forwards_in_store": len(_stored(ctx, refused_prefix)),
                "pt2_in_host_caches": sum(1 for _ in home.rglob("*.pt2")) if home.exists() else 0,
                "inductor_cache_files": w.inductor_files("ff-refused"),
                "baseline_forwards_in_store": len(_stored(ctx, baseline_prefix))}
    nothing_compiled = (evidence["phases"] == ["probe", "tune", "kv-plan", "gate"]
                        and evidence["gate_decision"] == "refused" and evidence["forwards_in_store"] == 0
                        and evidence["pt2_in_host_caches"] == 0 and evidence["inductor_cache_files"] == 0)
    if not nothing_compiled:
        raise BenchFailed(f"the refused run compiled something or did not stop at the gate: {evidence}")
    baseline = json.loads(out.read_text())
    if not baseline["failed"]:
        raise BenchFailed(f"the compile-first baseline did not fail: {baseline}")
    # Both sides' no-start-up figure is unbroken wall time from the probe's start, measured in-process: the
    # CLI's pre-flight records it for a refusal decided there; a flow's refusal has only phase sums.
    refusal_s = report["gate"].get("probe_to_decision_s")
    if refusal_s is None:
        raise BenchFailed("the refused export was decided in a flow run, not by `kiln export` itself: "
                          f"{report['gate'].get('decided_in')}")
    # Where the refused run's seconds go, from its Prefect log (seconds since the process started); all None
    # when `kiln export` refused before starting Prefect (gate.decided_in 'cli').
    milestones = refused.milestones({"flow_run_began_s": r"Beginning flow run",
                                     "first_host_task_done_s": r"Task run 'probe-.*Completed",
                                     "gate_refused_s": r"Task run 'gate-.*Finished in state Failed",
                                     "flow_run_failed_s": r"Flow run '.*Finished in state Failed"})
    return {"figures": {"fail_fast_ratio": ratio(refused.wall_s, baseline_run.wall_s),
                        "fail_fast_ratio_no_startup": ratio(refusal_s, baseline["probe_to_failure_s"])},
            "raw": {"order": [name for name, _ in order], "refused_wall_s": refused.wall_s,
                    "refused_phases_s": phases, "refusal_message": report["error"],
                    "refused_milestones_s": milestones, "refused_decided_in": report["gate"].get("decided_in"),
                    "evidence": evidence,
                    "baseline_wall_s": baseline_run.wall_s, "baseline": baseline},
            "notes": "refused = `kiln export --hosts 3 --tp 3` on the incident layout with --policy fail, run as "
                     "a user runs it (default recipe, no Prefect server given, flow retries as they come): from "
                     "process start to exit 3, i.e. Python and imports, then, as the hosts are this machine, the "
                     "probe of every host, KV plan and gate in the CLI before any Prefect server, Dask cluster or "
                     "flow run starts. 0 compile processes: no forward in the store or a host cache, an untouched "
                     "Inductor cache, phases stop at the gate. baseline = bench/compile_first.py on the same layout "
                     "and settings: host-0 compiles every forward in its pool (uploads included), hosts 1 and 2 "
                     "cannot create a pool, then the outcome check fails; one process, no Dask or Prefect. "
                     "no_startup: unbroken wall time from the probe's start to the refusal (the CLI's "
                     "gate.probe_to_decision_s) against the baseline's from its probe's start to its failed check"}


def part_borrow(ctx: Context) -> dict:
    ctx.warm_up()
    w = ctx.work
    compile_s, source = measured_compile_s(ctx)
    estimate = ["--set", f"compile_s_estimate={compile_s:.3f}"]
    runs = {}
    order = ctx.ordered([("lend", _assume()), ("all-compile", [*_assume(), "--set", "headroom_floor_mib=6144"])])
    for name, extra in order:
        report_path = w.path("borrow", f"{name}.json")
        argv = [*KILN, "export", *_layout(ctx, *extra, *estimate, buckets=ctx.s.borrow_buckets), "--policy",
                "borrow", "--store", f"s3://{BUCKET}/{ctx.tag('borrow-' + name)}", "--report", str(report_path)]
        run = w.run(f"borrow-{name}", argv,
                    w.env(inductor=f"borrow-{name}", kiln_home=f"borrow/{name}-home", server=True)).expect(0)
        r = json.loads(report_path.read_text())
        runs[name] = {"wall_s": run.wall_s, "phases_s": _phases(r), "predicted_s": r["gate"]["predicted_s"],
                      "workers": {h["name"]: h["workers"] for h in r["hosts"]},
                      "compiled_by": sorted({f["compiled_by"] for f in r["forwards"] if f["compiled_by"]}),
                      "per_forward_compile_s": [f["compile_s"] for f in r["forwards"]]}
    lend, every = runs["lend"], runs["all-compile"]
    return {"figures": {"borrow_ratio": ratio(lend["phases_s"]["compile"], every["phases_s"]["compile"]),
                        "borrow_export_ratio": ratio(lend["wall_s"], every["wall_s"]),
                        "borrow_predicted_vs_measured": ratio(lend["predicted_s"], lend["phases_s"]["compile"])},
            "raw": {**runs, "order": [name for name, _ in order], "compile_s_estimate": compile_s,
                    "compile_s_source": source,
                    "all_compile_predicted_vs_measured": ratio(every["predicted_s"], every["phases_s"]["compile"])},
            "notes": "lend = the incident layout with --policy borrow: host-1 and host-2 cannot run a worker and "
                     "lend every forward to host-0; all-compile = the same with headroom_floor_mib=6144, so every "
                     "host runs a worker. The gate predicts with compile_s_estimate set to " + source + ". The "
                     "three 'hosts' share this machine's CPUs, so all-compile cannot be faster than the CPUs "
                     "allow: on one machine the ratio measures lending's cost, not a multi-host speed-up"}


def part_gate_scale(ctx: Context) -> dict:
    compile_s, source = measured_compile_s(ctx)
    sim = simulate(compile_s, repeats=5)
    return {"figures": {"gate_scale_s": median(sim["gate_run_s"]), "gate_scale_predicted_s": sim["predicted_s"]},
            "samples": {"gate_scale_s": sim["gate_run_s"]},
            "raw": {**sim, "compile_s_source": source},
            "notes": "kiln.core.plan.gate.decide on paper: 64 GB10-like hosts x 8 ranks, 67 buckets (1, 2, 4, 8..512 step "
                     "8), the incident's memory settings with host memory spread over 10-20 GiB (some hosts "
                     f"lend), every forward at {compile_s:.1f} s ({source}); run time is the median of 5 calls"}
