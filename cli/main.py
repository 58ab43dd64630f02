"""`kiln`: export, serve, announce, plan, verify, run, checkpoint, keygen and bench.

Every input is checked before Prefect starts or anything is written, so bad
input exits with code 2 in about a second. Exit codes: 0 done, 2 bad input,
3 the gate refused or a check would not fit in memory, 1 anything else.
Expected errors print one or two plain sentences to stderr, no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kiln.core.model.config import BUNDLED_MODEL, DTYPE_BYTES
from kiln.core.errors import BadInput, KilnError
from kiln.core.plan.job import CHECKSUM_MODES, DEFAULT_TP
from kiln.core.plan.recipe import SETTING, SETTINGS
from kiln.host.processes.procs import Reaper


def _params(args):
    from flows.params import export_params, parse_assume_available
    return export_params(hosts=args.hosts, dask=args.dask, store_block=args.store_block,
                         recipe_block=args.recipe_block, s3_checksum=args.s3_checksum, model=args.model,
                         tp=args.tp, store=args.store, s3_endpoint=args.s3_endpoint, recipe=_recipe_settings(args),
                         assume_available=parse_assume_available(args.assume_available),
                         export_id=getattr(args, "export_id", None), report=args.report,
                         sign=not getattr(args, "unsigned", False),
                         signing_key_block=getattr(args, "signing_key_block", None), dtype=args.dtype)


def _recipe_settings(args) -> dict:
    """{setting: typed value} from the recipe flags and `--set NAME=VALUE` (one spelling per setting)."""
    from kiln.core.plan.settings import parse_assignments
    flags = {s.name: v for s in SETTINGS if (v := getattr(args, _dest(s))) is not None}
    sets = parse_assignments(SETTINGS, args.set)
    both = sorted(set(flags) & set(sets))
    if both:
        raise BadInput(f"{SETTING[both[0]].flag} and --set {both[0]}=... both set {both[0]}; give one.")
    return {**flags, **sets}


def _dest(s) -> str:
    return f"recipe_{s.name}"


def _typed(s):
    """argparse type for setting `s`: its own parser, with argparse's error (exit 2) on bad input."""
    def parse(text: str):
        try:
            return s.parse(text)
        except BadInput as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = s.kind
    return parse


def _recipe_flags(p: argparse.ArgumentParser) -> None:
    """One flag per recipe setting, derived from its declaration (kiln/core/plan/recipe.py)."""
    g = p.add_argument_group("recipe settings", "each defaults to the recipe's (see docs/recipe.md); "
                             "--set NAME=VALUE sets any of them too")
    for s in SETTINGS:
        kind = {"choices": s.choices} if s.kind == "choice" else {"type": _typed(s)}
        metavar = {"choice": None, "bool": "true|false", "text": s.example}.get(s.kind, (s.unit or "N").upper())
        if s.nullable and s.kind != "choice":
            metavar = f"{metavar}|auto"
        g.add_argument(s.flag, dest=_dest(s), metavar=metavar, **kind,
                       help=f"{s.describe().rstrip('.')}; default: {s.show(s.default)}".replace("%", "%%"))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=BUNDLED_MODEL, help="'tiny', a Hugging Face-layout checkpoint directory, or "
                   "s3://BUCKET/PREFIX holding one (each host reads its ranks' slices; at --s3-endpoint)")
    p.add_argument("--tp", type=int, default=DEFAULT_TP, help=f"tensor-parallel degree (default {DEFAULT_TP})")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES),
                   help="compile and run in this dtype (default: the checkpoint's config.json dtype)")
    p.add_argument("--store", help="file://DIR or s3://BUCKET/PREFIX (default: KILN_HOME/store)")
    p.add_argument("--s3-endpoint", help="S3 endpoint URL (default: AWS_ENDPOINT_URL)")
    p.add_argument("--s3-checksum", choices=CHECKSUM_MODES, default=CHECKSUM_MODES[0],
                   help="boto3 checksum mode (some S3-compatible servers reject when_supported)")
    p.add_argument("--store-block", help="name of a 'Kiln Store' Prefect block")
    p.add_argument("--recipe-block", help="name of a 'Kiln Recipe' Prefect block")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="set a recipe setting (any of the recipe settings below)")
    p.add_argument("--assume-available", action="append", default=[], metavar="HOST=MIB",
                   help="replace a host's available-memory reading")
    p.add_argument("--report", help="write the JSON report here (also on failure)")
    p.add_argument("--hosts", type=int, help="start a local Dask cluster of N workers standing for hosts host-0..")
    p.add_argument("--dask", metavar="ADDRESS", help="Dask scheduler whose workers are the hosts")
    _recipe_flags(p)


def cmd_export(args) -> int:
    from flows.embedded_api import embedded_api
    params = _params(args)
    # One host and no server named: Prefect's embedded API starts now, while the rest imports and checks.
    with embedded_api(start=not (params.hosts or params.dask)) as api:
        from cli.start_export import export_with
        return export_with(params, api)


def cmd_serve(args) -> int:
    from flows.params import prepare
    params = _params(args)
    prepare(params)  # the deployment's defaults must make a valid export
    from flows.serve import serve
    serve(params, name=args.name, cron=args.cron, interval_s=args.interval, limit=args.limit,
          on_checkpoint=args.on_checkpoint)
    return 0


def cmd_announce(args) -> int:
    """Emit kiln.checkpoint.ready for a checkpoint; bad input (no checkpoint there, no server) exits 2 and
    sends nothing."""
    from flows.params import export_params, model_name
    from flows.prefect_server import check_server
    from kiln.core.run.events import CHECKPOINT_READY
    from kiln.core.forwards.forward_keys import check_export_id
    params = export_params(model=args.model, export_id=args.export_id)
    if params.export_id:
        check_export_id(params.export_id)
    model = params.model
    if model != BUNDLED_MODEL:
        from pathlib import Path

        from kiln.host.weights import rank_weights as weights
        if not weights.is_s3(model):
            model = str(Path(model).expanduser().resolve())  # the serving process may run elsewhere
        weights.inspect(model, s3_endpoint=args.s3_endpoint)
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise BadInput("kiln announce sends an event to a Prefect server: set PREFECT_API_URL (e.g. "
                       "http://127.0.0.1:4200/api), the server a deployment served with --on-checkpoint uses.")
    check_server(url)
    from flows.outcome_events import announce
    try:
        event = announce(model, model_name(params), params.export_id)
    except RuntimeError as exc:
        raise KilnError(f"could not send {CHECKPOINT_READY} to {url}: {exc}") from None
    print(f"announced {CHECKPOINT_READY} for {model} (event {event.id}, resource {event.resource.id}); "
          "a deployment served with `kiln serve --on-checkpoint` exports it")
    return 0


def cmd_plan(args) -> int:
    from cli.plan import plan_only
    params = _params(args)
    result = plan_only(params)
    print(result["text"])
    if args.report:
        with open(args.report, "w") as f:
            json.dump(result["report"], f, indent=2)
    return 0 if result["feasible"] else 3


def cmd_verify(args) -> int:
    from cli.verify import verify_export
    result = verify_export(args.store, args.export_id, model=args.model, s3_endpoint=args.s3_endpoint,
                           verify_keys=args.verify_key, verify_key_block=args.verify_key_block,
                           allow_unsigned=args.allow_unsigned, pin=args.pin)
    for line in result["lines"]:
        print(line)
    return 0


def cmd_run(args) -> int:
    from cli.run import run_export
    from kiln.core.run.decode import parse_tokens
    result = run_export(args.store, args.export_id, prompt=parse_tokens(args.tokens),
                        max_new_tokens=args.max_new_tokens, json_path=args.json, model=args.model,
                        s3_endpoint=args.s3_endpoint, verify_keys=args.verify_key,
                        verify_key_block=args.verify_key_block, allow_unsigned=args.allow_unsigned)
    print(",".join(map(str, result["generated"])))
    return 0


def cmd_keygen(args) -> int:
    from kiln.host.trust.signers import keygen
    key, pub, fp = keygen(args.dir, args.name)
    print(f"wrote {key} (private, mode 0600) and {pub} (public); fingerprint {fp}")
    print("sign exports:  export KILN_SIGNING_KEY=\"$(cat " + str(key) + ")\"   "
          "(or keep it in a Prefect Secret block and pass --signing-key-block NAME)")
    print(f"verify them:   kiln verify EXPORT_ID --verify-key {pub}   (or set KILN_VERIFY_KEY)")
    return 0


def cmd_checkpoint(args) -> int:
    from kiln.core.model.config import TINY
    from kiln.host.weights.checkpoint import random_checkpoint
    cfg = TINY.replace(**{k: v for k, v in {
        "num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads,
        "num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "intermediate_size": args.intermediate,
        "vocab_size": args.vocab}.items() if v is not None})
    path = random_checkpoint(args.dir, cfg, seed=args.seed, num_shards=args.shards)
    print(f"wrote {path} ({cfg.num_params() / 1e6:.1f} M parameters, {args.shards} shard(s))")
    return 0


def cmd_bench(args) -> int:
    from bench.suite import run_suite
    return run_suite(args.parts, quick=args.quick, out_dir=args.out, keep=args.keep, samples=args.samples)


def _fetch_flags(p: argparse.ArgumentParser) -> None:
    """Where a finished export is and whom to trust: shared by verify and run."""
    p.add_argument("--store", help="file://DIR or s3://BUCKET/PREFIX (default: KILN_HOME/store)")
    p.add_argument("--s3-endpoint")
    p.add_argument("--model", help="checkpoint directory or s3://BUCKET/PREFIX (default: the one the manifest names)")
    p.add_argument("--verify-key", action="append", default=[], metavar="FILE",
                   help="trusted Ed25519 public key(s), PEM or base64 (repeatable; default: KILN_VERIFY_KEY, "
                        "else the public half of KILN_SIGNING_KEY or of the local development key)")
    p.add_argument("--verify-key-block", metavar="NAME", help="Prefect Secret block holding trusted public key(s)")
    p.add_argument("--allow-unsigned", action="store_true",
                   help="accept an export made with --unsigned (sha256s are still checked)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="Fail-fast multi-host AOTInductor export on Prefect.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="run an export")
    _common(e)
    e.add_argument("--export-id", help="name of the export (default: model, tp and time)")
    e.add_argument("--signing-key-block", metavar="NAME",
                   help="Prefect Secret block holding the Ed25519 signing key (default: KILN_SIGNING_KEY, "
                        "or the local development key for a local store)")
    e.add_argument("--unsigned", action="store_true",
                   help="do not sign the manifest (kiln verify then needs --allow-unsigned)")
    e.add_argument("--verbose", action="store_true", help="show Prefect's own INFO logs (default: warnings only)")
    e.set_defaults(func=cmd_export)
    s = sub.add_parser("serve", help="serve the export flow as a Prefect deployment (schedules, UI runs)")
    _common(s)
    when = s.add_mutually_exclusive_group()
    when.add_argument("--cron", metavar="EXPR", help="schedule: cron expression, e.g. '0 3 * * *'")
    when.add_argument("--interval", type=float, metavar="SECONDS", help="schedule: every SECONDS")
    s.add_argument("--name", default="default", help="deployment name (default: default)")
    s.add_argument("--limit", type=int, help="most flow runs this process runs at once")
    s.add_argument("--on-checkpoint", action="store_true",
                   help="also run an export of each checkpoint announced (event kiln.checkpoint.ready, "
                        "`kiln announce`); its model comes from the event, the rest from these flags")
    s.set_defaults(func=cmd_serve)
    a = sub.add_parser("announce", help="emit kiln.checkpoint.ready: served --on-checkpoint deployments export it")
    a.add_argument("model", help="'tiny', a Hugging Face-layout checkpoint directory or s3://BUCKET/PREFIX")
    a.add_argument("--s3-endpoint", help="S3 endpoint URL to check an s3:// checkpoint at (default: AWS_ENDPOINT_URL)")
    a.add_argument("--export-id", help="name of the export it starts (default: model, tp and time)")
    a.set_defaults(func=cmd_announce)
    pl = sub.add_parser("plan", help="probe, plan KV and run the gate without compiling")
    _common(pl)
    pl.set_defaults(func=cmd_plan)
    v = sub.add_parser("verify", help="re-check a finished export: digests and all ranks against eager")
    v.add_argument("export_id")
    _fetch_flags(v)
    v.add_argument("--pin", metavar="DIR", help="after verifying, copy the manifest, its signature and this host's "
                   "packages into DIR (new or empty; mode 0700) for the C++ runner and torch alone to load from")
    v.set_defaults(func=cmd_verify)
    r = sub.add_parser("run", help="decode greedily with an export's forwards across all its ranks")
    r.add_argument("export_id")
    r.add_argument("--tokens", required=True, help="the prompt as comma-separated token ids, e.g. 1,2,3")
    r.add_argument("--max-new-tokens", type=int, default=8, help="tokens to generate (default 8)")
    r.add_argument("--json", metavar="FILE", help="write {prompt, generated, logits} here (logits: the full "
                   "vocabulary at the position that chose each generated token)")
    _fetch_flags(r)
    r.set_defaults(func=cmd_run)
    k = sub.add_parser("keygen", help="write an Ed25519 key pair for signing manifests")
    k.add_argument("dir")
    k.add_argument("--name", default="kiln-signing", help="file name stem (default kiln-signing)")
    k.set_defaults(func=cmd_keygen)
    c = sub.add_parser("checkpoint", help="write a small random Llama-style checkpoint")
    c.add_argument("dir")
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab"):
        c.add_argument(f"--{flag}", type=int)
    c.add_argument("--shards", type=int, default=1)
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=cmd_checkpoint)
    b = sub.add_parser("bench", help="run the benchmark suite (or named parts); write bench/results/<stamp>.*")
    b.add_argument("parts", nargs="*", metavar="PART", help="fail_fast, compile_efficiency, pool_vs_loop, dedup, "
                   "warm_cold, overhead, store, borrow, gate_scale, collective, depth, s3_read, moe, mla, ranges, rank_peak, "
                   "decode_context, checks, quantized, uneven (default: all)")
    b.add_argument("--quick", action="store_true", help="fewer buckets, one repetition, no borrow, moe, mla, ranges, rank_peak, decode_context, checks, quantized or uneven part "
                   "unless named (minutes)")
    b.add_argument("--samples", type=int, metavar="N",
                   help="samples per side of every ratio, sides alternating (default: 3; 1 with --quick)")
    b.add_argument("--out", help="results directory (default: bench/results)")
    b.add_argument("--keep", action="store_true", help="keep the work directory (logs, stores, caches)")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command of `argv` (default: this program's arguments) and return its exit code; as the program
    itself (`argv` None) this process ends here, without tearing down what it imported (`_end_process`)."""
    code = _main(argv)
    if argv is None:
        _end_process(code)
    return code


def _end_process(code: int) -> None:
    """End the process as the interpreter would, less its teardown: wait for its non-daemon threads, run the
    exit handlers (Prefect's, logging's, multiprocessing's), flush the standard streams, then exit. Freeing
    every module and object of torch, Prefect and matplotlib one by one took seconds of a warm export."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    from flows.prefect_server import prefect_environment
    prefect_environment(quiet=args.func is cmd_export and not args.verbose)  # before Prefect is imported
    # Whatever this command starts (compile workers, ranks, Prefect's embedded server) dies with it.
    reaper = Reaper() if args.func not in (cmd_keygen, cmd_checkpoint) else None
    try:
        return args.func(args)
    except KilnError as exc:
        print(f"kiln: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
    finally:
        if reaper:
            reaper.close()


if __name__ == "__main__":
    sys.exit(main())
