"""`kiln export --set device=cuda` on a GPU host, then `kiln verify` and `kiln run` of what it wrote: the
export a GPU user runs. Marked `gpu`: skipped without a CUDA device (CPU CI runs the refusal instead,
tests/integration/test_bad_input.py), saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def cuda_export(kiln, tmp_path_factory):
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})")
    d = tmp_path_factory.mktemp("cuda-export")
    store = f"file://{d / 'store'}"
    run = kiln("export", "--model", "tiny", "--tp", "2", "--buckets", "1x8,2x16", "--set", "device=cuda",
               "--store", store, "--report", str(d / "report.json"))
    assert run.code == 0, run.err[-3000:]
    return {"store": store, "report": run.json(d / "report.json"), "root": d / "store"}


def test_the_forwards_are_cuda_packages_and_the_manifest_says_so(cuda_export):
    r = cuda_export["report"]
    assert r["status"] == "completed" and all(f["target"].startswith("cuda-sm_") for f in r["forwards"])
    manifest = json.loads((Path(cuda_export["root"]) / r["manifest"]).read_text())
    assert manifest["runtime"]["device"] == "cuda"
    # The rank check ran on the GPU (two ranks sharing it under gloo) and passed.
    host = next(iter(r["verify"].values()))
    assert len(host) == 2 * 2 and all(c["diff"] <= c["limit"] for c in host.values())


def test_verify_and_run_load_the_cuda_packages_on_the_gpu(kiln, cuda_export, tmp_path):
    export_id = cuda_export["report"]["export_id"]
    v = kiln("verify", "--store", cuda_export["store"], export_id)
    assert v.code == 0 and "device cuda: 2 forward(s)" in v.out and "verify ok" in v.out, v.err[-3000:]
    out = tmp_path / "run.json"
    ran = kiln("run", export_id, "--store", cuda_export["store"], "--tokens", "1,2,3,4,5", "--max-new-tokens", "4",
               "--json", str(out))
    assert ran.code == 0, ran.err[-3000:]
    assert len(json.loads(out.read_text())["generated"]) == 4
