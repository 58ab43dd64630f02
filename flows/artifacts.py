"""The run's Prefect artifacts: one of each kind per export, updated in place across tries.

Purpose: the flow run's Artifacts tab shows one summary, one forwards table,
one memory picture and one manifest address, whatever the number of tries;
each description names the try it shows ("try 2 of 3", or "final, try 1" when none follows).

Contracts: keys are `<export id>-<kind>` (lower case, Prefect's key rules); a
try finds the artifact its flow run already made under a key and updates it
(PATCH), else creates it. Links open in a browser: an S3 store's objects as
presigned URLs (their expiry stated), a local store's as paths shown as text.
Publishing never fails an export: a problem is one warning in the run's log.
"""

from __future__ import annotations

import json

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.context import FlowRunContext

from flows import report_out
from kiln.core.run import run_page
from kiln.core.plan.job import ExportJob
from kiln.core.run.report import Report
from tasks.store import store_of

KINDS = ("summary", "forwards", "memory", "manifest")


def artifact_key(export_id: str, kind: str) -> str:
    """`<export id>-<kind>` in the characters Prefect allows in artifact keys."""
    return f"{export_id.lower().replace('_', '-').replace('.', '-')}-{kind}"[:200]


def _existing(key: str):
    """This flow run's artifact under `key` (made by an earlier try), or None."""
    ctx = FlowRunContext.get()
    run_id = ctx.flow_run.id if ctx and ctx.flow_run else None
    if run_id is None:
        return None
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])), limit=1)
    return found[0] if found else None


def progress(export_id: str, description: str):
    """The id of the run's compile progress artifact (0 %), reused across tries."""
    key = artifact_key(export_id, "progress")
    found = _existing(key)
    if found is None:
        return create_progress_artifact(0.0, key=key, description=description)
    update_progress_artifact(found.id, 0.0, description=description)
    return found.id


def _put(kind: str, report: Report, data, description: str) -> None:
    """Update this flow run's artifact of `kind`, or create it (markdown, or a table for 'forwards')."""
    key = artifact_key(report.export_id, kind)
    found = _existing(key)
    if found is not None:
        body = json.dumps(data) if kind == "forwards" else data
        with get_client(sync_client=True) as client:
            client.update_artifact(found.id, ArtifactUpdate(data=body, description=description))
        return
    if kind == "forwards":
        create_table_artifact(data, key=key, description=description)
    else:
        create_markdown_artifact(data, key=key, description=description)


def publish(report: Report, job: ExportJob, *, max_tries: int, picture: bytes | None = None, final: bool = False,
            changed: dict[str, str] | None = None) -> None:
    """The run's artifacts for `report` (this try of `job`), with links into its store.

    `final`: no try follows this one (it completed, or its failure is not retried): the descriptions
    say "final" instead of "try N of M". `changed`: the settings that differ from the defaults.
    """
    try:
        store = store_of(job)
        expires_s = int(job.recipe.artifact_link_s)
        links = {k: store.link(k, expires_s) for k in (report.ledger_picture, report.manifest) if k}
        expiry = (f" Links are presigned URLs, valid {_duration(expires_s)} from publishing (recipe setting "
                  "artifact_link_s)." if any(url for _, url in links.values()) else "")
        tries = f"final, try {report.attempt}" if final else f"try {report.attempt} of {max_tries}"
        _put("summary", report, report.markdown(links, changed) + (f"\n\n{expiry.strip()}" if expiry else ""),
             f"Kiln export summary ({tries})")
        if report.forwards:
            _put("forwards", report, run_page.forward_rows(report.forwards),
                 f"Forwards ({tries})")
        if picture:
            text, url = links.get(report.ledger_picture, (None, None))
            _put("memory", report, report_out.markdown(picture, text, url), f"Memory ledger, drawn ({tries})")
        if report.manifest:
            text, url = links[report.manifest]
            where = f"[{text}]({url})" if url else f"`{text}`"
            body = (run_page.manifest_markdown(report.manifest_doc, f"Stored at {where}{expiry}")
                    if report.manifest_doc else f"# Manifest\n\n{where}{expiry}\n")
            _put("manifest", report, body, f"The export's manifest ({tries})")
    except Exception as exc:  # artifacts are a convenience; never fail an export over them
        get_run_logger().warning("could not publish Prefect artifacts: %s", exc)


def _duration(seconds: int) -> str:
    """'12 hours', '90 minutes', '1 hour': how long a link stays valid, in words."""
    if seconds % 3600 == 0:
        return f"{seconds // 3600} hour{'s' if seconds != 3600 else ''}"
    return f"{round(seconds / 60)} minutes"
