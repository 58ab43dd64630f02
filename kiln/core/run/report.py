"""The export report: one JSON document, written also when the export fails. Pure."""

from __future__ import annotations

from kiln.core.run import run_page


class Report:
    """Accumulates what an export did; `to_dict` is the `--report` JSON."""

    def __init__(self, export_id: str, *, model: str, tp: int, store: str, attempt: int = 1):
        self.export_id = export_id
        self.attempt = attempt
        """Which try of the export's flow run wrote this report (1 for the first)."""
        self.model = model
        self.tp = tp
        self.store = store
        self.status = "running"
        self.error: str | None = None
        self.phases: list[dict] = []
        self.hosts: dict[str, dict] = {}
        self.gate: dict = {"decision": None, "policy": None, "assignments": {}, "message": None,
                           "decided_in": "flow"}
        """`decided_in`: 'flow' (the flow run's gate) or 'cli' (`kiln export` refused before starting Prefect)."""
        self.counts = {"forwards": 0, "compiled": 0, "reused": 0, "tuning_measured": 0}
        self.forwards: list[dict] = []
        self.kv_plan: dict | None = None
        self.verify: dict = {}
        self.checkpoint_identity: dict | None = None
        """A checkpoint directory's files as the hosts' checks read them (names, sizes, digests), for the
        manifest; None for a checkpoint in S3 (the job holds its identity) or before the checks."""
        self.manifest: str | None = None
        self.manifest_doc: dict | None = None
        """The manifest written (its contents, for the run's page; not part of the JSON report)."""
        self.ledger_picture: str | None = None
        """Store key of the memory ledger drawn as a PNG (flows.report_out)."""
        self.signing: dict = {"signed": None}
        """{'signed', 'key_fingerprint', 'source', 'signature', 'note'}: how the manifest is signed."""
        self.warnings: list[str] = []
        """What the user should know of this export, one sentence each, on the run's page and in the JSON: recipe
        settings that had no effect (kiln.core.plan.decisions.settings_without_effect), packages left alone,
        what of an image-text checkpoint was left out (kiln.core.model.hf_config.multimodal)."""

    @classmethod
    def of_job(cls, job, hosts, *, attempt: int = 1) -> "Report":
        """The report of a starting export of `job` (an ExportJob) on `hosts` (HostSpecs): signing and ranks."""
        report = cls(job.export_id, model=job.model_name, tp=job.tp, store=job.store_url, attempt=attempt)
        report.signing = {"signed": job.signing.sign, "key_fingerprint": job.signing.fingerprint,
                          "source": job.signing.source, "signature": None, "note": job.signing.describe()}
        for h in hosts:
            report.host(h.name, ranks=h.ranks)
        return report

    def phase(self, name: str, status: str, duration_s: float, **extra) -> None:
        self.phases.append({"name": name, "status": status, "duration_s": round(duration_s, 3), **extra})

    def host(self, name: str, *, ranks=(), workers: int | None = None, target: str | None = None) -> dict:
        entry = self.hosts.setdefault(name, {"name": name, "ranks": list(ranks), "workers": 0,
                                             "target": target, "memory": []})
        if workers is not None:
            entry["workers"] = workers
        if target is not None:
            entry["target"] = target
        return entry

    def memory(self, host: str, phase: str, snapshot: dict, *, assumed_available_mib: int | None = None) -> None:
        """One memory-ledger entry: the host's figures at a phase boundary (kiln.host.machine.probe.memory_snapshot);
        where the host has a GPU also gpu_count, device_total_mib and device_unified."""
        entry = {"phase": phase, "host_available_mib": snapshot.get("host_available_mib"),
                 "device_free_mib": snapshot.get("device_free_mib"),
                 "allocated_mib": snapshot.get("allocated_mib"), "reserved_mib": snapshot.get("reserved_mib")}
        if snapshot.get("gpu_count"):
            entry.update({k: snapshot.get(k) for k in ("gpu_count", "device_total_mib", "device_unified")})
        if assumed_available_mib is not None:
            entry["assumed_available_mib"] = assumed_available_mib
        self.host(host)["memory"].append(entry)

    def to_dict(self) -> dict:
        return {"export_id": self.export_id, "attempt": self.attempt, "model": self.model, "tp": self.tp,
                "store": self.store, "status": self.status, "error": self.error, "phases": self.phases,
                "hosts": [self.hosts[n] for n in sorted(self.hosts)], "gate": self.gate,
                "counts": self.counts, "forwards": self.forwards, "kv_plan": self.kv_plan,
                "verify": self.verify, "manifest": self.manifest, "ledger_picture": self.ledger_picture,
                "signing": self.signing, "warnings": self.warnings}

    def summary(self) -> str:
        """The few lines `kiln export` prints at the end."""
        lines = [f"export {self.export_id}: {self.status}" + (f" ({self.error})" if self.error else "")]
        for p in self.phases:
            lines.append(f"  {p['name']:<14} {p['status']:<8} {p['duration_s']:8.1f} s")
        c = self.counts
        lines.append(f"  {run_page.forward_counts(self.forwards) if self.forwards else 'forwards 0'}; "
                     f"tuning measured {c['tuning_measured']}")
        if self.manifest:
            lines.append(f"  manifest {self.manifest}")
        if self.signing.get("note"):
            lines.append(f"  {self.signing['note']}")
        return "\n".join(lines)

    def record_probes(self, probes) -> None:
        """Each probed host's compile target, cache status and what set its memory and CPU figures ('host', or
        the cgroup file whose limit allows less) (probes: kiln.core.plan.probe_result.HostProbe)."""
        for p in probes:
            entry = self.host(p.name, target=p.target)
            entry["cache"] = p.cache
            entry["limits"] = {"memory": p.memory_source, "cpus": p.cpus_source}

    def record_plan(self, plan) -> None:
        """The gate's plan (kiln.core.plan.gate.Plan): its decision, assignments, estimate and each host's figures."""
        self.gate.update(decision=plan.decision, assignments=plan.assignments, message=plan.message,
                         predicted_s=plan.predicted_s, hosts={n: h.to_dict() for n, h in plan.hosts.items()})
        for name, hp in plan.hosts.items():
            self.host(name, workers=hp.workers).update(worker_mib=hp.worker_mib, worker_mib_source=hp.worker_mib_source,
                                                       worker_words=hp.worker_words,
                                                       required_one_mib=hp.required_one_mib)

    def record_compile(self, during: dict[str, dict], lost: set[str], assumed: dict[str, int]) -> None:
        """What each host went through while compiling (its lowest available memory, the leases it waited
        for) as a ledger point 'compile (lowest)', and the hosts lost midway."""
        for name, d in during.items():
            m = d["memory"]
            self.host(name).update(compile_memory=m, waited_for_lease=d["waited_for_lease"])
            self.memory(name, "compile (lowest)", {"host_available_mib": m["min_available_mib"]},
                        assumed_available_mib=assumed.get(name))
        for name in lost:
            self.host(name)["lost"] = True

    def record_forwards(self, forwards: list[dict], compiled: dict) -> None:
        """The export's forwards (kiln.core.run.outcome.forward_records) and how many this export compiled."""
        self.forwards = forwards
        self.counts.update(forwards=len(forwards), compiled=len(compiled), reused=len(forwards) - len(compiled))

    def record_shortfall(self, short_hosts: dict[str, dict]) -> None:
        """Each short host's figures from a refusal (GateRefused.short_hosts): what one compile worker
        needed and by how much the host fell short; the ledger picture draws them."""
        for name, figures in short_hosts.items():
            self.host(name).update(required_one_mib=figures["required_one_mib"], short_mib=figures["short_mib"],
                                   worker_words=figures.get("worker_words"))

    def markdown(self, links: dict[str, tuple[str, str | None]] | None = None,
                 changed: dict[str, str] | None = None) -> str:
        """The Prefect artifact: phases, gate decision, forwards by origin, checks, memory per compile
        worker, every host's memory at every boundary and the settings that differ from the defaults.

        `links`: store key -> (text, URL a browser opens, or None) for the picture and the manifest;
        without a URL the text is shown as a path, never as a dead link. `changed`: form title -> value.
        """
        links = links or {}
        out = [f"# Kiln export `{self.export_id}`: {self.status}", ""]
        if self.error:
            out += [f"**Error:** {self.error}", ""]
        out += [f"**Warning:** {w}" for w in self.warnings] + ([""] if self.warnings else [])
        estimate = self.gate.get("predicted_s")
        out += ["| phase | status | seconds |", "|---|---|---|"]
        out += [f"| {p['name']} | {p['status']} | {p['duration_s']:.1f}"
                f"{f' (the gate estimated {estimate:.0f})' if p['name'] == 'compile' and estimate else ''} |"
                for p in self.phases]
        out += ["", run_page.gate_line(self.gate, self.error)]  # the refusal, once
        if self.forwards:
            out += ["", f"**Forwards:** {run_page.forward_counts(self.forwards)}; kernel tuning measured "
                    f"{self.counts['tuning_measured']}"]
        if self.verify:
            out += ["", "**Checks** (each rank's compiled forwards against eager on the same weights):", ""]
            out += run_page.checks_lines(self.verify)
        workers = run_page.worker_lines(self.hosts)
        if workers:
            out += ["", "**Memory per compile worker:**", ""] + workers
        if changed is not None:
            out += ["", "**Settings changed from the defaults:**", ""] + run_page.changed_lines(changed)
        out += ["", "## Memory ledger (MiB)", "",
                "| host | phase | host available | device free |", "|---|---|---|---|"]
        for name in sorted(self.hosts):
            for m in self.hosts[name]["memory"]:
                avail = m["host_available_mib"]
                if "assumed_available_mib" in m:
                    avail = f"{avail} (assumed {m['assumed_available_mib']})"
                out.append(f"| {name} | {m['phase']} | {avail} | {m['device_free_mib'] or '-'} |")
        limited = []
        for name in sorted(self.hosts):
            limits = self.hosts[name].get("limits") or {}
            for what, source in (("host available", limits.get("memory")), ("CPUs", limits.get("cpus"))):
                if source not in (None, "host"):
                    limited.append(f"- {name}: {what} limited by {source}")
        if limited:
            out += [""] + limited
        for label, key in (("Memory ledger picture", self.ledger_picture), ("Manifest", self.manifest)):
            if key:
                text, url = links.get(key, (self.store_url(key), None))
                out += ["", f"{label}: [{text}]({url})" if url else f"{label}: `{text}`"]
        if self.manifest and self.signing.get("note"):
            out += ["", f"Signing: {self.signing['note']}"]
        elif self.signing.get("note"):
            out += ["", "Signing: nothing was signed: the export stopped before writing its manifest."]
        return "\n".join(out)

    def store_url(self, key: str) -> str:
        """Where `key` lives in the store, as its URL (file://... or s3://...)."""
        return f"{self.store.rstrip('/')}/{key}"
