"""The recipe: every per-cluster, per-run choice of an export, validated up front.

Pure: no torch, prefect or boto3 import. `Recipe.with_overrides` applies
`--set NAME=VALUE` strings; `parse_buckets` reads `--buckets 1x16,4x64`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from kiln.errors import BadInput

POLICIES = ("borrow", "fail")
TUNING_MODES = ("off", "cached", "full")


@dataclass(frozen=True, order=True)
class Bucket:
    """One input shape class the serving engine needs: `batch` sequences of `tokens` new tokens."""

    batch: int
    tokens: int

    def __str__(self) -> str:
        return f"{self.batch}x{self.tokens}"


def parse_buckets(spec: str) -> tuple[Bucket, ...]:
    """Parse `BxT,BxT,...` into sorted, distinct buckets; BadInput on anything else."""
    if not isinstance(spec, str) or not spec.strip():
        raise BadInput("--buckets is empty; give at least one bucket as BATCHxTOKENS, e.g. 1x16,4x64.")
    out = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", part)
        if not m or int(m[1]) <= 0 or int(m[2]) <= 0:
            raise BadInput(f"bucket {part.strip()!r} is not BATCHxTOKENS with positive integers; "
                           "write buckets like 1x16,4x64.")
        out.add(Bucket(int(m[1]), int(m[2])))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Recipe:
    """Choices of one export. Memory settings are MiB; see DESIGN.md 'Worker sizing'."""

    buckets: tuple[Bucket, ...] = (Bucket(1, 16), Bucket(2, 16), Bucket(4, 32), Bucket(8, 64))
    """Shape classes to compile, one forward each."""
    headroom_floor_mib: int = 2048
    """Memory a host keeps free whatever else runs (the incident's fixed 8 GiB floor)."""
    recipe_headroom_mib: int = 1024
    """Memory the recipe's own preparation needs; the larger of this and the floor applies."""
    worker_host_mib: int | None = None
    """Host memory one compile worker takes at its peak, its compiler children included. None (the
    default): the peak measured for this graph and target (from the store) times worker_mib_margin,
    or worker_host_estimate_mib when nothing was measured yet. A number always wins."""
    worker_host_estimate_mib: int = 1024
    """The per-worker figure used before any compile of this graph on this target was measured."""
    worker_mib_margin: float = 1.15
    """Factor over the largest measured worker peak (the next forwards may be a little larger)."""
    process_base_mib: int = 512
    """Memory of a process that has imported torch and loaded compiled forwards, before any weights."""
    max_compile_workers: int = 0
    """Most compile workers a host starts (0: as many as memory and CPUs allow)."""
    worker_device_mib: int = 0
    """Device memory one compile worker takes (its CUDA context); 0 on CPU-only hosts."""
    activation_reserve_mib: int = 256
    """Memory each rank keeps for activations when serving; not given to the KV cache."""
    unified_memory: bool | None = None
    """Whether device memory is the host's pool (GB10, CPU-only); None: as probed."""
    page_tokens: int = 16
    """Tokens per KV-cache page."""
    max_context_tokens: int = 256
    """Longest context a sequence can attend to; pages per sequence = this / page_tokens."""
    kv_max_pages: int = 4096
    """Upper bound on KV pages per rank, whatever the memory would allow."""
    policy: str = "borrow"
    """What the gate does when a host can run no compile worker: lend its forwards ('borrow') or refuse ('fail')."""
    tuning: str = "cached"
    """Kernel tuning: 'off', 'cached' (measure only what the store lacks) or 'full'."""
    compile_s_estimate: float = 30.0
    """Predicted seconds to compile one forward when nothing was measured yet."""
    max_compile_attempts: int = 2
    """Times one forward is tried when its compile worker dies."""
    verify_atol: float = 1e-3
    """Largest difference allowed between a compiled forward and eager, as
    max |compiled - eager| / max(1, max |eager|) (absolute for outputs up to 1, relative above)."""
    verify_half_ratio: float = 2.0
    """bfloat16 / float16 forwards: compared with eager in float32 on the same weights, they may be off by
    this many times eager's own error in their dtype (and always by verify_atol)."""
    lease_ttl_s: float = 900.0
    """Seconds a compile lease protects a key from other exports; a stale lease is taken over."""
    flow_retries: int = 2
    """Times a failed export is tried again, with a fresh probe; bad input, gate refusals (unless
    retry_refusals), integrity and verification failures are never retried."""
    flow_retry_delay_s: float = 30.0
    """Seconds between a failed try of the export and the next one."""
    retry_refusals: bool = False
    """Whether a gate refusal counts as a failure that flow_retries try again, flow_retry_delay_s
    apart, with a fresh probe each time: for a deployment that waits for memory to be freed. Off
    (the default): a refusal is final, and `kiln export` refuses before starting Prefect."""
    artifact_mib_estimate: int = 16
    """Disk one compiled forward takes in a host's cache; a host needs this times the forwards it lacks free."""

    def __post_init__(self) -> None:
        if not self.buckets:
            raise BadInput("the recipe has no buckets; give at least one, e.g. --buckets 1x16.")
        for name in ("headroom_floor_mib", "recipe_headroom_mib", "worker_host_estimate_mib", "process_base_mib",
                     "page_tokens", "max_context_tokens", "kv_max_pages", "max_compile_attempts"):
            _positive(name, getattr(self, name))
        if self.worker_host_mib is not None:
            _positive("worker_host_mib", self.worker_host_mib)
        if not self.worker_mib_margin >= 1:
            raise BadInput(f"recipe setting worker_mib_margin must be >= 1, got {self.worker_mib_margin!r}.")
        for name in ("worker_device_mib", "activation_reserve_mib", "artifact_mib_estimate", "max_compile_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadInput(f"recipe setting {name} must be a whole number of MiB >= 0, got {value!r}.")
        if self.max_context_tokens % self.page_tokens:
            raise BadInput(f"max_context_tokens ({self.max_context_tokens}) must be a multiple of "
                           f"page_tokens ({self.page_tokens}).")
        if self.policy not in POLICIES:
            raise BadInput(f"unknown policy {self.policy!r}; use one of: {', '.join(POLICIES)}.")
        if self.tuning not in TUNING_MODES:
            raise BadInput(f"unknown tuning mode {self.tuning!r}; use one of: {', '.join(TUNING_MODES)}.")
        if not self.compile_s_estimate > 0 or not self.verify_atol > 0 or not self.lease_ttl_s > 0 \
                or not self.verify_half_ratio > 0:
            raise BadInput("compile_s_estimate, verify_atol, verify_half_ratio and lease_ttl_s must be > 0.")
        if not isinstance(self.flow_retries, int) or isinstance(self.flow_retries, bool) or self.flow_retries < 0:
            raise BadInput(f"recipe setting flow_retries must be a whole number >= 0, got {self.flow_retries!r}.")
        if not isinstance(self.retry_refusals, bool):
            raise BadInput(f"recipe setting retry_refusals must be true or false, got {self.retry_refusals!r}.")
        if not self.flow_retry_delay_s >= 0:
            raise BadInput(f"recipe setting flow_retry_delay_s must be >= 0 seconds, got {self.flow_retry_delay_s!r}.")

    @property
    def pages_per_seq(self) -> int:
        return self.max_context_tokens // self.page_tokens

    def worker_mib(self, unified: bool, measured_host_mib: int | None = None) -> int:
        """Memory one compile worker takes out of the pool that host sizing looks at.

        `measured_host_mib` (a worker's measured peak, margin included) applies unless
        worker_host_mib is set.
        """
        return self.worker_host_source(measured_host_mib)[0] + (self.worker_device_mib if unified else 0)

    def worker_host_source(self, measured_host_mib: int | None) -> tuple[int, str]:
        """(host MiB of one worker, where it comes from: 'recipe', 'measured' or 'estimate')."""
        if self.worker_host_mib is not None:
            return self.worker_host_mib, "recipe"
        if measured_host_mib is not None:
            return measured_host_mib, "measured"
        return self.worker_host_estimate_mib, "estimate"

    def floor_mib(self) -> int:
        return max(self.headroom_floor_mib, self.recipe_headroom_mib)

    def with_overrides(self, assignments: list[str] | tuple[str, ...] = ()) -> "Recipe":
        """Apply `NAME=VALUE` strings (the CLI's `--set`), typed after the field they name."""
        changes: dict = {}
        fields = {f.name: f for f in dataclasses.fields(self)}
        for item in assignments:
            name, sep, raw = item.partition("=")
            name = name.strip()
            if not sep or name not in fields:
                known = ", ".join(sorted(fields))
                raise BadInput(f"--set {item!r}: expected NAME=VALUE with NAME one of: {known}.")
            changes[name] = _coerce(name, raw.strip(), getattr(self, name))
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["buckets"] = [str(b) for b in self.buckets]
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "Recipe":
        """Inverse of `to_dict`; unknown names are bad input."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - fields)
        if unknown:
            raise BadInput(f"unknown recipe setting(s): {', '.join(unknown)}; known: {', '.join(sorted(fields))}.")
        raw = dict(raw)
        if "buckets" in raw and not isinstance(raw["buckets"], tuple):
            b = raw["buckets"]
            raw["buckets"] = parse_buckets(",".join(b) if isinstance(b, (list, tuple)) else str(b))
        return cls(**raw)


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BadInput(f"recipe setting {name} must be a positive whole number, got {value!r}.")


def _coerce(name: str, raw: str, current):
    if name == "buckets":
        return parse_buckets(raw)
    if name == "worker_host_mib" and raw.lower() in ("auto", "none", ""):
        return None
    if name == "worker_host_mib":
        current = 0
    if name == "unified_memory" or isinstance(current, bool):
        low = raw.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        if name == "unified_memory" and low in ("auto", "none", ""):
            return None
        raise BadInput(f"--set {name}={raw}: expected true or false.")
    if isinstance(current, int):
        try:
            return int(raw)
        except ValueError:
            raise BadInput(f"--set {name}={raw}: expected a whole number.") from None
    if isinstance(current, float):
        try:
            return float(raw)
        except ValueError:
            raise BadInput(f"--set {name}={raw}: expected a number.") from None
    return raw
