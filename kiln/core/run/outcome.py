"""The compile phase's outcome, decided: is every forward stored and runnable without Python. Pure.

`check_outcome` is the check that makes the compile phase OK (every key in the
store with a sha256, every package Python-free); `forward_records` joins what
was planned, stored and compiled into the forwards of the report and manifest,
each with the consumer contract of kiln.core.model.contract (interface and constants).
"""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.model.contract import constant_sources
from kiln.core.errors import ForwardsMissing, IntegrityError, NotPythonFree, VerifyMismatch
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.model.interface import forward_interface
from kiln.core.model.shares import share_rank
from kiln.core.machine.cpu_target import CpuIsa
from kiln.core.machine.target import device_of


def check_outcome(found: dict[str, dict], missing: list[str], specs: dict[str, ForwardSpec]) -> dict[str, dict]:
    """`found` key -> {'sha256', 'size_bytes', 'object', 'calls'}; raises unless every spec's forward is stored
    and Python-free. Returns `found`."""
    if missing:
        raise ForwardsMissing(f"{len(missing)} forward(s) are not in the store after compilation, e.g. {missing[0]}; "
                        "the compile phase failed on some host (see its log); re-run to resume.")
    impure = sorted(k for k in specs if not found[k]["calls"]["python_free"])
    if impure:
        key = impure[0]
        raise NotPythonFree(f"{len(impure)} forward(s) would need Python to run, e.g. {key} "
                            f"({specs[key].shapes}): {found[key]['calls']['why']}. Kiln's forwards call only "
                            "native ops; this model or compiler setting brings in one without a C shim.")
    return found


def check_digests(held: dict[str, str], recorded: dict[str, str], what: str) -> None:
    """Raise IntegrityError naming the first key whose sha256 in `recorded` (`what`, e.g. the store's
    metadata) differs from the one the flow holds in `held`; keys absent from either are not compared."""
    for key in sorted(held.keys() & recorded.keys()):
        if held[key] != recorded[key]:
            raise IntegrityError(f"forward {key}: {what} says sha256 {recorded[key]}, but its compiler reported "
                                 f"{held[key]}; the store was changed behind this export. Delete the object "
                                 "and export again.")


def forward_records(specs: dict[str, ForwardSpec], stored: dict[str, dict], compiled: dict[str, dict],
                    cfg: ModelConfig, tp: int, cpus: dict[str, CpuIsa] | None = None) -> list[dict]:
    """One record per forward, ordered by (target, shapes): what it is, the shapes it takes (its range's
    'batch' and 'tokens' [min, max] and the 'hint' [batch, tokens] it was compiled for), where it lives, who compiled
    it and how, and its consumer contract (interface, process group, constants). A CPU forward whose target
    `cpus` describes (target fingerprint -> CpuIsa: `target_cpus` of the probes) carries it as `target_cpu`,
    what a consumer's CPU must have to run it. A forward this export
    compiled must be stored with the sha256 its compiler reported (IntegrityError otherwise): the checks and
    the manifest then use the compiler's digest, not only the store's metadata."""
    check_digests({k: c["sha256"] for k, c in compiled.items() if c.get("sha256")},
                  {k: s["sha256"] for k, s in stored.items()}, "the store's metadata")
    constants = sorted(constant_sources(cfg))
    out = []
    for key, spec in sorted(specs.items(), key=lambda kv: (kv[1].target, str(kv[1].shapes))):
        c = compiled.get(key) or {}
        s = stored[key]
        out.append({"key": key, "shapes": str(spec.shapes), "batch": spec.inputs["batch"],
                    "tokens": spec.inputs["tokens"], "hint": spec.inputs["hint"], "target": spec.target,
                    "sha256": s["sha256"],
                    "size_bytes": s["size_bytes"], "object": s["object"],
                    "compiled_by": c.get("compiled_by"), "compile_s": c.get("compile_s"),
                    "autotune": c.get("autotune"), "tuning": (spec.tuning or {}).get("digest"),
                    "compile_attempts": c.get("attempts", 1) if c else 0,
                    "compile_peak_mib": c.get("compile_peak_mib"),
                    "python_free": s["calls"]["python_free"], "ops": s["calls"]["ops"],
                    "interface": forward_interface(cfg, tp, spec.inputs, share_rank(spec.graph)),
                    "constants": constants})
        if "share" in spec.graph:  # ranks of unequal shares: this forward is theirs alone (kiln.core.model.shares)
            out[-1]["ranks"] = list(spec.graph["share"]["ranks"])
        if device_of(spec.target) == "cpu" and spec.target in (cpus or {}):
            out[-1]["target_cpu"] = cpus[spec.target].to_dict()
    return out


def target_cpus(probes) -> dict[str, CpuIsa]:
    """Target fingerprint -> its CPU, of the CPU targets among `probes` (kiln.core.plan.probe_result.HostProbe)
    that describe their CPU: forward_records' `cpus`."""
    return {p.target: p.cpu_isa for p in probes if p.cpu_isa is not None and device_of(p.target) == "cpu"}


def check_verified(checks: dict[str, dict], host_name: str, dtype: str) -> None:
    """Raise VerifyMismatch naming the worst forward whose difference from eager exceeds its limit, or whose
    choices the dtype does not allow (`checks`: name -> {'diff', 'limit', 'wrong_choice'?}, from the host's
    per-rank check); nothing when all are within."""
    chose = {name: c for name, c in checks.items() if c.get("wrong_choice")}
    if chose:
        name, c = sorted(chose.items())[0]
        raise VerifyMismatch(f"compiled forward {name} on {host_name} made a choice {dtype} does not allow: "
                             f"{c['wrong_choice']}; the artifact is not trustworthy.")
    failed = {name: c for name, c in checks.items() if not passed(c)}
    if failed:
        name, c = max(failed.items(), key=lambda kv: kv[1]["diff"] / kv[1]["limit"])
        raise VerifyMismatch(f"compiled forward {name} on {host_name} differs from eager by {c['diff']:.2e} "
                             f"(scaled; limit {c['limit']:.2e} for {dtype}{routing_note(c)}); the artifact is not "
                             "trustworthy.")


def passed(check: dict) -> bool:
    """A check passed: within its limit, and every choice one its dtype allows."""
    return check["diff"] <= check["limit"] and not check.get("wrong_choice")


def worst_shape(checks: dict[str, dict]) -> dict:
    """The check of a forward over a range: of `checks` (shape name -> {'diff', 'limit', ...}, one per shape
    its range is compared with eager at: kiln.core.forwards.shape_ranges.ShapeRange.checked_shapes), the one
    furthest over (or nearest to) its limit (a wrong choice first), with 'at': its shape and 'shapes': how
    many were compared."""
    at, worst = max(checks.items(), key=lambda kv: (bool(kv[1].get("wrong_choice")), kv[1]["diff"] / kv[1]["limit"]))
    return {**worst, "at": at, "shapes": len(checks)}


def routing_note(check: dict) -> str:
    """', against float32 forced to its N choices (D of them not float32's own)' when the forward made
    discrete choices (kiln.host.ranks.routing_ties); '' otherwise."""
    if not check.get("choices"):
        return ""
    return (f", against float32 forced to its {check['choices']} choice(s), {check.get('differ', 0)} of them "
            "not float32's own")
