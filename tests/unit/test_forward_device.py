"""Which device a forward is compiled for and loaded on: named by the caller, refused by name when the
package or the weights are elsewhere (no package is compiled here)."""

from __future__ import annotations

import pytest

from kiln.core.errors import UnloadablePackage
from kiln.host.compile.inductor_options import forward_device


class FakePackage:
    """What kiln.host.ranks.loader.check_device reads of a loaded package."""

    def __init__(self, device: str | None, names=("w",)):
        self._meta = {} if device is None else {"AOTI_DEVICE_KEY": device}
        self._names = list(names)

    def get_metadata(self) -> dict:
        return self._meta

    def get_constant_fqns(self) -> list[str]:
        return self._names


def test_a_graph_without_a_device_is_a_cpu_forward_and_an_unknown_device_is_refused():
    assert forward_device({"config": {}, "tp": 1}) == "cpu"
    assert forward_device({"device": "cuda"}) == "cuda"
    with pytest.raises(ValueError, match="not 'tpu'"):
        forward_device({"device": "tpu"})


def test_a_package_for_another_device_is_refused_by_name():
    import torch

    from kiln.host.ranks.loader import check_device

    with pytest.raises(UnloadablePackage, match="f.pt2 was compiled for cuda, but it was asked to run on cpu"):
        check_device("f.pt2", FakePackage("cuda"), {"w": torch.zeros(1)}, torch.device("cpu"))
    check_device("f.pt2", FakePackage("cpu"), {"w": torch.zeros(1)}, torch.device("cpu"))
    check_device("f.pt2", FakePackage(None), {"w": torch.zeros(1)}, torch.device("cpu"))  # older metadata


def test_weights_elsewhere_than_the_forward_are_refused_naming_the_tensor():
    import torch

    from kiln.host.ranks.loader import check_device

    weights = {"w": torch.zeros(1, device="meta")}
    with pytest.raises(UnloadablePackage, match="weight w is on meta, but the forward runs on cpu.*place_weights"):
        check_device("f.pt2", FakePackage("cpu"), weights, torch.device("cpu"))


def test_placing_weights_on_the_cpu_keeps_them_as_they_are():
    import torch

    from kiln.host.ranks.loader import place_weights

    weights = {"w": torch.ones(2)}
    assert place_weights(weights, "cpu") is weights


def test_placing_views_on_the_cpu_compacts_them_once_so_every_package_binds_the_same_tensors():
    import torch

    from kiln.host.ranks.loader import _compact, place_weights

    whole = torch.arange(6.0)
    weights = {"w": whole[2:4], "v": torch.ones(3)}
    placed = place_weights(weights, "cpu")
    assert placed["v"] is weights["v"] and torch.equal(placed["w"], whole[2:4])
    assert placed["w"].untyped_storage().nbytes() == placed["w"].nbytes  # owns exactly its bytes
    assert _compact(placed["w"]) is placed["w"]  # load_forward binds it as it is, no copy per package


def test_a_rank_runs_on_its_gpu_round_robin_and_on_the_cpu_as_asked(monkeypatch):
    import torch

    from kiln.host.ranks.verify_ranks import rank_device

    assert rank_device("cpu", 3) == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:0"]  # two ranks share one GPU (gloo)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [rank_device("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]


def test_a_package_records_the_device_it_was_compiled_for(tmp_path):
    import json
    import zipfile

    from kiln.host.trust.package_check import package_device

    path = tmp_path / "f.pt2"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("f/data/aotinductor/model/abc.wrapper_metadata.json", json.dumps({"AOTI_DEVICE_KEY": "cuda"}))
    assert package_device(path) == "cuda"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("f/data/aotinductor/model/abc.wrapper.cpp", "")
    assert package_device(path) is None
