"""The flow's probe phase settles the export's device before anything compiles (flows.export._probe), with
a fake runner standing for the hosts: no server, no GPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from flows.export import _probe
from kiln.core.model.config import TINY
from kiln.core.errors import BadInput
from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.plan.probe_result import HostProbe
from kiln.core.plan.recipe import Recipe
from kiln.core.run.report import Report
from kiln.core.machine.target import host_device


@dataclass
class Done:
    value: object

    def result(self):
        return self.value


class FakeHosts:
    """Each host answers the probe as kiln.host.phases.host_probe.probe_host would with `gpus` GPUs; records each probe."""

    def __init__(self, gpus: dict[str, int]):
        self.gpus, self.probed = gpus, []

    def submit(self, where: HostSpec, task, *, host: HostSpec, job: ExportJob, **_):
        n = self.gpus[host.name]
        device = host_device(job.recipe.device, n) if n else "cpu"
        self.probed.append((host.name, job.recipe.device))
        return Done(HostProbe(name=host.name, ranks=host.ranks, memory={"host_available_mib": 60_000},
                              num_cpus=8, unified=True, target=f"{device}-t", specs=(), local_keys=(),
                              store_keys=(), cache={}, num_gpus=n, device=device))


def run(device: str, gpus: dict[str, int]) -> tuple[list[HostProbe], FakeHosts]:
    hosts = [HostSpec(name=n, ranks=(i,)) for i, n in enumerate(gpus)]
    job = ExportJob(export_id="e", model_name="tiny", checkpoint="/none", config=TINY.to_dict(), tp=len(hosts),
                    recipe=Recipe(device=device), store_url="file:///none")
    runner = FakeHosts(gpus)
    return _probe(job, hosts, runner, Report("e", model="tiny", tp=len(hosts), store="file:///none")), runner


def test_auto_on_gpu_hosts_probes_once_for_cuda():
    probes, runner = run("auto", {"a": 1, "b": 2})
    assert [p.device for p in probes] == ["cuda", "cuda"] and len(runner.probed) == 2


def test_auto_with_one_host_lacking_a_gpu_probes_the_others_again_for_cpu():
    probes, runner = run("auto", {"a": 1, "b": 0})
    assert [p.device for p in probes] == ["cpu", "cpu"]
    assert runner.probed[2:] == [("a", "cpu")]  # only the host that chose cuda, with the device settled


def test_cuda_with_a_host_lacking_a_gpu_is_refused_by_name():
    with pytest.raises(BadInput, match="device=cuda but b has no GPU"):
        run("cuda", {"a": 1, "b": 0})
