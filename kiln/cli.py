"""`kiln`: export, plan, verify, checkpoint and bench.

Every input is checked before Prefect starts or anything is written, so bad
input exits with code 2 in about a second. Exit codes: 0 done, 2 bad input,
3 the gate refused, 1 anything else. Expected errors print one or two plain
sentences to stderr, no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager

from kiln.errors import BadInput, KilnError


def _assume(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        host, sep, mib = item.partition("=")
        if not sep or not host or not mib.strip().isdigit():
            raise BadInput(f"--assume-available {item!r}: expected HOST=MIB, e.g. host-1=12038.")
        out[host] = int(mib)
    return out


def _params(args):
    from kiln.params import ExportParams
    return ExportParams(hosts=args.hosts, dask=args.dask, store_block=args.store_block,
                        recipe_block=args.recipe_block, s3_checksum=args.s3_checksum, model=args.model, tp=args.tp, buckets=args.buckets, store=args.store,
                        s3_endpoint=args.s3_endpoint, policy=args.policy, tuning=getattr(args, "tuning", None),
                        settings=args.set, assume_available=_assume(args.assume_available),
                        export_id=getattr(args, "export_id", None), report=args.report)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face-layout checkpoint directory")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    p.add_argument("--buckets", help="BATCHxTOKENS,... (default: the recipe's)")
    p.add_argument("--store", help="file://DIR or s3://BUCKET/PREFIX (default: KILN_HOME/store)")
    p.add_argument("--s3-endpoint", help="S3 endpoint URL (default: AWS_ENDPOINT_URL)")
    p.add_argument("--s3-checksum", choices=["when_required", "when_supported"], default="when_required",
                   help="boto3 checksum mode (some S3-compatible servers reject when_supported)")
    p.add_argument("--store-block", help="name of a 'Kiln Store' Prefect block")
    p.add_argument("--recipe-block", help="name of a 'Kiln Recipe' Prefect block")
    p.add_argument("--policy", choices=["borrow", "fail"], help="gate policy (default: borrow)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a recipe setting")
    p.add_argument("--assume-available", action="append", default=[], metavar="HOST=MIB",
                   help="replace a host's available-memory reading")
    p.add_argument("--report", help="write the JSON report here (also on failure)")
    p.add_argument("--hosts", type=int, help="start a local Dask cluster of N workers standing for hosts host-0..")
    p.add_argument("--dask", metavar="ADDRESS", help="Dask scheduler whose workers are the hosts")


def cmd_export(args) -> int:
    from kiln.params import default_host_names, prepare
    params = _params(args)
    prepare(params, host_names=default_host_names(params))  # fail fast on bad input, before Prefect starts
    with prefect_server_for(params):
        if params.dask:
            from flows.hosts import HostRunner
            with HostRunner(dask_address=params.dask):  # an unreachable scheduler is bad input: say so now
                pass
        from flows.export import export
        report = export(params)
    print(_summary(report))
    return 0


@contextmanager
def prefect_server_for(params):
    """Several hosts need a real Prefect server: check the one named, or start one for --hosts N."""
    from kiln.prefect_server import check_server, local_server
    url = os.environ.get("PREFECT_API_URL")
    if url:
        check_server(url)
        yield url
    elif params.hosts:
        with local_server() as started:
            yield started
    elif params.dask:
        raise BadInput("a multi-host export (--dask) needs a Prefect server that every host reaches: "
                       "start `prefect server start` and set PREFECT_API_URL.")
    else:
        yield None


def _summary(report: dict) -> str:
    lines = [f"export {report['export_id']}: {report['status']}"]
    for p in report["phases"]:
        lines.append(f"  {p['name']:<14} {p['status']:<8} {p['duration_s']:8.1f} s")
    c = report["counts"]
    lines.append(f"  forwards {c['forwards']}: compiled {c['compiled']}, reused {c['reused']}; "
                 f"tuning measured {c['tuning_measured']}")
    lines.append(f"  manifest {report['store'].rstrip('/')}/{report['manifest']}")
    return "\n".join(lines)


def cmd_plan(args) -> int:
    from kiln.plan import plan_only
    params = _params(args)
    result = plan_only(params)
    print(result["text"])
    if args.report:
        with open(args.report, "w") as f:
            json.dump(result["report"], f, indent=2)
    return 0 if result["feasible"] else 3


def cmd_verify(args) -> int:
    from kiln.verify import verify_export
    result = verify_export(args.store, args.export_id, model=args.model, s3_endpoint=args.s3_endpoint)
    for line in result["lines"]:
        print(line)
    return 0


def cmd_checkpoint(args) -> int:
    from kiln.checkpoint import random_checkpoint
    from kiln.config import TINY
    cfg = TINY.replace(**{k: v for k, v in {
        "num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads,
        "num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "intermediate_size": args.intermediate,
        "vocab_size": args.vocab}.items() if v is not None})
    path = random_checkpoint(args.dir, cfg, seed=args.seed, num_shards=args.shards)
    print(f"wrote {path} ({cfg.num_params() / 1e6:.1f} M parameters, {args.shards} shard(s))")
    return 0


def cmd_bench(args) -> int:
    from bench.suite import run_suite
    return run_suite(args.parts, quick=args.quick, out_dir=args.out, keep=args.keep)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="Fail-fast multi-host AOTInductor export on Prefect.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="run an export")
    _common(e)
    e.add_argument("--tuning", choices=["off", "cached", "full"], help="kernel tuning mode")
    e.add_argument("--export-id", help="name of the export (default: model, tp and time)")
    e.set_defaults(func=cmd_export)
    pl = sub.add_parser("plan", help="probe, plan KV and run the gate without compiling")
    _common(pl)
    pl.set_defaults(func=cmd_plan)
    v = sub.add_parser("verify", help="re-check a finished export: digests and all ranks against eager")
    v.add_argument("export_id")
    v.add_argument("--store", help="file://DIR or s3://BUCKET/PREFIX (default: KILN_HOME/store)")
    v.add_argument("--s3-endpoint")
    v.add_argument("--model", help="checkpoint directory (default: the one the manifest names)")
    v.set_defaults(func=cmd_verify)
    c = sub.add_parser("checkpoint", help="write a small random Llama-style checkpoint")
    c.add_argument("dir")
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab"):
        c.add_argument(f"--{flag}", type=int)
    c.add_argument("--shards", type=int, default=1)
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=cmd_checkpoint)
    b = sub.add_parser("bench", help="run the benchmark suite (or named parts); write bench/results/<stamp>.*")
    b.add_argument("parts", nargs="*", metavar="PART", help="fail_fast, compile_efficiency, pool_vs_loop, dedup, "
                   "warm_cold, overhead, store, borrow, gate_scale (default: all)")
    b.add_argument("--quick", action="store_true", help="fewer buckets, one repetition, no borrow part (minutes)")
    b.add_argument("--out", help="results directory (default: bench/results)")
    b.add_argument("--keep", action="store_true", help="keep the work directory (logs, stores, caches)")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KilnError as exc:
        print(f"kiln: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
