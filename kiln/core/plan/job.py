"""The description of one export that every task and host receives. Pure and picklable."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kiln.core.model.config import ModelConfig
from kiln.core.model.shares import graph_shares
from kiln.core.forwards.forward_keys import ForwardSpec, forward_spec
from kiln.core.plan.recipe import Recipe
from kiln.core.trust.signing import SigningPlan

DEFAULT_TP = 2
"""Tensor-parallel ranks when none are given (the CLI, the run form)."""
CHECKSUM_MODES = ("when_required", "when_supported")
"""When S3 uploads send a checksum (boto3's request_checksum_calculation); the first is the default, which
S3-compatible servers accept."""


@dataclass(frozen=True)
class HostSpec:
    """One host of the export: its name, the ranks it holds and its local cache directory."""

    name: str
    ranks: tuple[int, ...]
    cache_dir: str = ""
    """Local cache directory; empty: KILN_HOME/cache/<name>, resolved on the host itself."""


@dataclass(frozen=True)
class ExportJob:
    export_id: str
    model_name: str
    checkpoint: str
    """The Hugging Face-layout checkpoint: an absolute directory path or s3://BUCKET/PREFIX."""
    config: dict
    """ModelConfig fields."""
    tp: int
    recipe: Recipe
    store_url: str
    s3_endpoint: str | None = None
    checksum_mode: str = CHECKSUM_MODES[0]
    store_block: str | None = None
    """A 'Kiln Store' Prefect block each host loads itself, so secrets never travel in task parameters."""
    assume_available: dict[str, int] = field(default_factory=dict)
    """host name -> MiB that replaces the probed available memory ("what if")."""
    signing: SigningPlan | None = None
    """How the manifest is signed (no secret: the key is loaded where it signs); None: not decided (plan)."""
    checkpoint_identity: dict | None = None
    """An S3 checkpoint's objects (name, size, ETag) when the export was prepared (the manifest records
    it; verify checks it again); None for a directory (its files' digests are read by the hosts' checks:
    kiln.core.run.report.Report.checkpoint_identity)."""
    image_text: dict | None = None
    """An image-text checkpoint's {'left_out': what the export leaves out (its vision tower and projector), the
    report's sentence; 'prefixes': decoder prefix -> the checkpoint's, for the manifest's tensor names}
    (kiln.core.model.hf_config.multimodal.text_tensors); None for a text-only checkpoint."""

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.config)

    def specs(self, *, target: str, torch_version: str, code: str, compiler: dict,
              tuning: dict[str, dict] | None = None,
              inductor_env: dict[str, str] | None = None, device: str = "cpu") -> list[ForwardSpec]:
        """One forward spec per forward shapes of the recipe (Recipe.shapes) for hosts of `target`, and, where
        tp splits the model unevenly, per distinct rank shape (kiln.core.model.shares.graph_shares: its graph's
        'share'); `tuning` maps the shapes' name -> its tuning.

        `code` is the code fingerprint (kiln.host.compile.key_sources); `inductor_env` the TORCHINDUCTOR_* settings
        the compile workers inherit (kiln.host.compile.inductor_options.inductor_env), in the graph when given.
        `device` ('cpu' or 'cuda', the host's: kiln.core.machine.target.host_device) goes into the graph as its
        'device' for cuda; a CPU graph names none, so CPU keys are what they were before CUDA exports."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"a forward's device is 'cpu' or 'cuda', not {device!r}")
        graph = {"config": self.config, "tp": self.tp, "code": code, **({"device": device} if device != "cpu" else {})}
        if inductor_env is not None:
            graph["inductor_env"] = dict(inductor_env)
        return [forward_spec(shapes=r, graph=graph if share is None else {**graph, "share": share}, target=target,
                             torch_version=torch_version, page_tokens=self.recipe.page_tokens,
                             pages_per_seq=self.recipe.pages_per_seq, compiler=compiler,
                             tuning=None if tuning is None else tuning[str(r)])
                for r in self.recipe.shapes for share in graph_shares(self.model_config, self.tp)]

    def replace(self, **changes) -> "ExportJob":
        return dataclasses.replace(self, **changes)


def place_ranks(tp: int, host_names: list[str]) -> dict[str, tuple[int, ...]]:
    """Rank r goes to host r mod N."""
    return {name: tuple(r for r in range(tp) if r % len(host_names) == i) for i, name in enumerate(host_names)}
