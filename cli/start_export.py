"""`kiln export` after its flags: every input checked, the gate's refusal before Prefect where it would come, the
flow run on the Prefect server it needs, and its summary printed."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from kiln.core.errors import BadInput, GateRefused


def export_with(params, api) -> int:
    """`kiln export` once its flags are parsed: check everything, refuse before Prefect where the gate would,
    run the flow on the server it needs (`api`: the embedded API Kiln started, or None), print the summary."""
    from kiln.host.trust.signers import DEV_KEY_NAME
    from flows.params import default_host_names, prepare
    from kiln.core.machine.home import kiln_home
    dev_key = kiln_home() / "keys" / f"{DEV_KEY_NAME}.key"
    had_dev_key = dev_key.exists()
    job, hosts = prepare(params, host_names=default_host_names(params))  # fail fast on bad input, before Prefect starts
    _refuse_before_flow(params, job, hosts, on_feasible=_start_workers_early if api is not None else None)
    created = " (created now)" if job.signing.source == "dev" and not had_dev_key else ""
    print(f"kiln: the manifest will be {job.signing.describe()}{created}", file=sys.stderr)
    if job.signing.source == "dev":
        print("kiln: the development key is for local stores on this machine; for S3 stores or other machines "
              "create a key with `kiln keygen DIR` and set KILN_SIGNING_KEY.", file=sys.stderr)
    if api is not None:
        _while_the_api_starts()
    with prefect_server_for(params, api):
        if params.dask:
            from flows.hosts import HostRunner
            with HostRunner(dask_address=params.dask):  # an unreachable scheduler is bad input: say so now
                pass
        from flows.export import export
        report = export(**params.flow_parameters())
    print(_summary(report))
    return 0


def _while_the_api_starts() -> None:
    """What the export imports later anyway, imported while the embedded API starts (this process would wait)."""
    import matplotlib.figure  # noqa: F401  (the ledger picture)

    import flows.export  # noqa: F401  (Prefect's client and the flow)


def _start_workers_early(probes) -> None:
    """Where this process will compile (a forward the store lacks), start the compile workers' server
    (kiln.host.compile.worker_start) now: its imports overlap the embedded API's start instead of the compile phase."""
    if any(spec.key not in probe.store_keys for probe in probes for spec in probe.specs):
        from kiln.host.compile import worker_start

        worker_start.prepare()


def _refuse_before_flow(params, job, hosts, on_feasible=None) -> None:
    """Raise the gate's refusal now, as fast as `kiln plan`, when this machine's hosts would be refused
    (or the BadInput of a host cache that cannot take the forwards it lacks).

    Only where the hosts are this machine (not --dask) and a refusal is final (not retry_refusals):
    then no flow run starts, and the report (`gate.decided_in` 'cli') records the refusal.
    """
    if params.dask or job.recipe.retry_refusals:
        return
    from cli.plan import refusal_before_flow
    try:
        stopped = refusal_before_flow(job, hosts, on_feasible=on_feasible)
    except BadInput:
        raise
    except Exception:  # the flow probes again, with its I/O retries, and reports what fails
        return
    if stopped is None:
        return
    report, error = stopped
    if params.report:
        from flows.report_out import write_report
        write_report(report, params.report)
    if isinstance(error, GateRefused):
        print("kiln: refused by the gate before starting Prefect (the probe and gate of `kiln plan`); no flow "
              "run was started and nothing was compiled.", file=sys.stderr)
    raise error


@contextmanager
def prefect_server_for(params, api=None):
    """Several hosts need a real Prefect server: check the one named, or start one for --hosts N. One host
    uses `api` (flows.embedded_api.EmbeddedAPI, once it answers) when Kiln started it, else Prefect's."""
    from flows.prefect_server import check_server, local_server
    url = os.environ.get("PREFECT_API_URL")
    if api is not None:
        api.wait_ready()
        yield api.url
    elif url:
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
    sig = report.get("signing") or {}
    lines.append(f"  signed: {'yes, ' + sig['key_fingerprint'] if sig.get('signed') else 'NO (--unsigned)'}")
    lines += [f"  warning: {w}" for w in report.get("warnings", [])]
    return "\n".join(lines)
