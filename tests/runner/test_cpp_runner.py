"""The C++ runner (runner/kiln_runner.cpp) runs a tp 2 export without Python and matches Kiln's eager model.

The test builds the runner (CMake, against the wheel's libtorch), compiles one weightless tp 2 forward,
writes a bf16 checkpoint in two shards (so the runner reads an index and casts to the float32 the
package was compiled for) and a version 5 manifest from kiln.core.model.contract, runs two ranks of the runner
over a TCPStore and compares each rank's logits with `ShardedDecoder(cfg, 1)` on the full weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cpp_runner_harness import build_runner, free_port, run_ranks

pytestmark = pytest.mark.slow

BATCH, TOKENS, PAGE_TOKENS, PAGES_PER_SEQ = 1, 8, 16, 4


@pytest.fixture(scope="module")
def runner() -> Path:
    """The runner, built by `make runner-build` (`make test` leaves the build to this fixture)."""
    return build_runner()


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> dict:
    """A tp 2 export of a 2-layer model (its layers one stacked scan): bf16 checkpoint (2 shards), one 1x8 package, a version 5 manifest."""
    import torch

    from kiln.core.model.config import TINY
    from kiln.core.model.contract import PROCESS_GROUP, weight_layout
    from kiln.core.model.interface import forward_interface
    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.plan.recipe import Bucket
    from kiln.core.forwards.shape_ranges import static_shape
    from kiln.host.weights.checkpoint import write_checkpoint
    from kiln.host.compile.compiler import CompilePool
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS
    from kiln.host.model import random_state_dict

    root = tmp_path_factory.mktemp("cpp-export")
    # head_dim 32: the rotary frequencies are too long for Inductor to inline; they must come from the graph.
    cfg = TINY.replace(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                       intermediate_size=128, vocab_size=128)
    tp = 2
    full = {n: t.to(torch.bfloat16) for n, t in random_state_dict(cfg, seed=3).items()}
    checkpoint = write_checkpoint(root / "model", cfg, full, num_shards=2)
    spec = forward_spec(shapes=static_shape(Bucket(BATCH, TOKENS)), graph={"config": cfg.__dict__, "tp": tp,
                                                            "code": model_code_fingerprint()},
                        target="test", torch_version="test", page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                        compiler=COMPILER_OPTIONS).to_dict()
    forwards = root / "store" / "forwards"
    forwards.mkdir(parents=True)
    with CompilePool(1) as pool:
        [result] = pool.run([(spec, str(forwards / f"{spec['key']}.pt2"))], lambda r: None)
    layout = weight_layout(cfg, tp)
    manifest = {
        "version": 5, "export_id": "cpp-runner-test", "tp": tp,
        "model": {"name": "test", "checkpoint": str(checkpoint), "config": dict(cfg.__dict__)},
        "recipe": {"page_tokens": PAGE_TOKENS, "max_context_tokens": PAGE_TOKENS * PAGES_PER_SEQ},
        "runtime": {"process_group": PROCESS_GROUP, "world_size": tp, "python_free": True},
        "weights": layout,
        "forwards": [{"key": spec["key"], **static_shape(Bucket(BATCH, TOKENS)).to_dict(), "target": "test", "object": f"forwards/{spec['key']}.pt2",
                      "sha256": hashlib.sha256(Path(result.path).read_bytes()).hexdigest(), "python_free": True,
                      "interface": forward_interface(cfg, tp, spec["inputs"]), "constants": sorted(layout)}],
    }
    (root / "store" / "exports" / "cpp").mkdir(parents=True)
    manifest_path = root / "store" / "exports" / "cpp" / "manifest.json"
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return {"root": root, "cfg": cfg, "full": full, "manifest": manifest_path, "forwards": forwards}


def _run_ranks(runner: Path, export: dict, tokens: list[int], out: Path, world_size: int = 2) -> list:
    return run_ranks(runner, export["manifest"], export["forwards"], f"{BATCH}x{TOKENS}", tokens, out, world_size)


def _eager_logits(export: dict, tokens: list[int]):
    import torch

    from kiln.host.model import ShardedDecoder, shard_state_dict

    cfg = export["cfg"]
    model = ShardedDecoder(cfg, 1).eval()
    model.load_state_dict(shard_state_dict({n: t.to(torch.float32) for n, t in export["full"].items()}, cfg, 1, 0))
    num_pages = PAGES_PER_SEQ * BATCH + 1
    cache = torch.zeros(cfg.num_layers, 2, num_pages, PAGE_TOKENS, cfg.num_kv_heads, cfg.head_dim)
    table = torch.arange(BATCH * PAGES_PER_SEQ).reshape(BATCH, PAGES_PER_SEQ)
    with torch.no_grad():
        logits, _ = model(torch.tensor(tokens).reshape(BATCH, TOKENS), torch.zeros(BATCH, dtype=torch.long),
                          cache, table)
    return logits.numpy()


def test_two_cpp_ranks_match_eager(runner, export, tmp_path):
    tokens = [(7 * i + 3) % export["cfg"].vocab_size for i in range(BATCH * TOKENS)]
    results = _run_ranks(runner, export, tokens, tmp_path / "logits-{rank}.f32")
    for rank, (code, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stderr[-3000:]}"
    want = _eager_logits(export, tokens)
    for rank in range(2):
        out = tmp_path / f"logits-{rank}.f32"
        side = json.loads(Path(f"{out}.json").read_text())
        assert side["shape"] == [BATCH, TOKENS, export["cfg"].vocab_size] and side["dtype"] == "float32"
        got = np.fromfile(out, dtype="<f4").reshape(side["shape"])
        diff = float(np.abs(got - want).max())
        print(f"rank {rank}: max |logit diff| vs eager = {diff:.3g}")
        assert diff < 1e-4, f"rank {rank}: logits differ from eager by {diff}"


def test_a_package_that_does_not_match_the_manifest_is_refused(runner, export, tmp_path):
    manifest = json.loads(export["manifest"].read_text())
    manifest["forwards"][0]["sha256"] = "0" * 64
    bad = tmp_path / "manifest.json"
    bad.write_text(json.dumps(manifest))
    results = _run_ranks(runner, {**export, "manifest": bad}, [0] * (BATCH * TOKENS), tmp_path / "x", world_size=2)
    for code, stderr in results:
        assert code == 1 and "does not match the manifest" in stderr, stderr[-2000:]


def test_a_cuda_export_is_refused_by_name(runner, export, tmp_path):
    """The runner runs CPU packages only: a manifest whose runtime device is cuda stops before any package
    or weight is read, saying so (the package here is a CPU one; the device is what is refused)."""
    manifest = json.loads(export["manifest"].read_text())
    manifest["runtime"]["device"] = "cuda"
    bad = tmp_path / "manifest.json"
    bad.write_text(json.dumps(manifest))
    results = _run_ranks(runner, {**export, "manifest": bad}, [0] * (BATCH * TOKENS), tmp_path / "x", world_size=2)
    for code, stderr in results:
        assert code == 1 and "run on cuda; this runner runs CPU packages only" in stderr, stderr[-2000:]


def test_cpp_runner_runs_what_kiln_export_wrote(runner, tp2_export, tmp_path):
    """The manifest and packages of a real `kiln export --tp 2` are enough for the runner, at every corner of
    every forward's range (the runner picks the forward by the consumer contract's rule)."""
    import torch

    from kiln.core.model.config import ModelConfig
    from kiln.host.weights.checkpoint import load_rank_weights
    from kiln.host.model import ShardedDecoder

    root = Path(tp2_export["store"].removeprefix("file://"))
    r = tp2_export["cold_report"]
    manifest = json.loads((root / r["manifest"]).read_text())
    cfg = ModelConfig(**manifest["model"]["config"])
    eager = ShardedDecoder(cfg, 1).eval()
    eager.load_state_dict(load_rank_weights(manifest["model"]["checkpoint"], cfg, 1, 0))
    from kiln.core.forwards.shape_ranges import parse_shape_range

    for f, (batch, tokens) in [(f, (c.batch, c.tokens)) for f in manifest["forwards"]
                               for c in parse_shape_range(f["shapes"]).corners()]:
        bucket = f"{batch}x{tokens}"
        ids = [(7 * i + 3) % cfg.vocab_size for i in range(batch * tokens)]
        port = free_port()
        out = tmp_path / f"{bucket}-{{rank}}.f32"
        procs = [subprocess.Popen([str(runner), "--manifest", str(root / r["manifest"]), "--packages",
                                   str(root / "forwards"), "--bucket", bucket,
                                   "--tokens", ",".join(map(str, ids)), "--rank", str(rank), "--world-size", "2",
                                   "--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout-s", "120",
                                   "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}) for rank in range(2)]
        for rank, p in enumerate(procs):
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, f"{bucket} rank {rank}: {err[-3000:]}"
            assert f"forward {f['key']} ({f['shapes']}) for {bucket}" in err, err[-2000:]
        pages_per_seq = next(i for i in f["interface"]["inputs"] if i["name"] == "block_table")["shape"][1]
        page_tokens = manifest["recipe"]["page_tokens"]
        cache = torch.zeros(cfg.num_layers, 2, pages_per_seq * batch + 1, page_tokens, cfg.num_kv_heads, cfg.head_dim)
        table = torch.arange(batch * pages_per_seq).reshape(batch, pages_per_seq)
        with torch.no_grad():
            want = eager(torch.tensor(ids).reshape(batch, tokens), torch.zeros(batch, dtype=torch.long), cache,
                         table)[0].numpy()
        for rank in range(2):
            got = np.fromfile(str(out).format(rank=rank), dtype="<f4").reshape(want.shape)
            assert float(np.abs(got - want).max()) < 1e-4 * max(1.0, float(np.abs(want).max())), (bucket, rank)
