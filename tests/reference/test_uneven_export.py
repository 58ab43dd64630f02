"""What a user runs at a tp that splits the model unevenly: `kiln export --tp 3`, then `kiln run`, `kiln verify`
and torch alone, against transformers' greedy decode of the same checkpoint.

Two models (tests/reference/test_uneven_tp.py's cases): Qwen3 whose 8 query heads share 2 KV heads at tp 3 (query
heads 3, 3, 2; rank 1's straddle both KV heads; MLP columns 171, 171, 170: three rank shapes, a package each
per bucket) and DeepSeek-V3 with latent attention and experts (query heads 2, 1, 1; MLP, experts and shared
expert columns uneven: two rank shapes). One bucket (1x4) each: the prompt in chunks of 4, every decode step
padded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_models import hf_config, hf_model, reference_generate
from test_uneven_tp import CASES

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 300, 42, 7, 99, 3, 250, 11, 8, 130, 64]
NEW_TOKENS = 6
EXPORTED = ("qwen3-tp3-straddle", "deepseek-v3-tp3")


@pytest.fixture(scope="module")
def uneven(kiln, prefect_server, dev_verify_key, tmp_path_factory):
    """case -> its export at tp 3 and `kiln run`'s result; each made once."""
    store = f"file://{tmp_path_factory.mktemp('uneven-store')}"
    env = {"PREFECT_API_URL": prefect_server}
    done = {}

    def get(case: str) -> dict:
        if case not in done:
            family, overrides, tp = CASES[case]
            out = tmp_path_factory.mktemp(case)
            path = out / "checkpoint"
            hf_model(family, hf_config(family, overrides, "float32")).save_pretrained(path)
            exported = kiln("export", "--model", str(path), "--tp", str(tp), "--buckets", "1x4", "--store", store,
                            "--export-id", f"uneven-{case}", "--report", str(out / "report.json"), env=env)
            assert exported.code == 0, exported.err[-3000:]
            ran = kiln("run", f"uneven-{case}", "--store", store, "--tokens", ",".join(map(str, PROMPT)),
                       "--max-new-tokens", str(NEW_TOKENS), "--json", str(out / "run.json"), env=env)
            assert ran.code == 0, ran.err[-3000:]
            done[case] = {"path": path, "store": store, "env": env, "verify_key": dev_verify_key,
                          "report": json.loads((out / "report.json").read_text()),
                          "result": json.loads((out / "run.json").read_text())}
        return done[case]

    return get


@pytest.mark.parametrize("case", EXPORTED)
def test_an_uneven_export_runs_what_transformers_generates(case, uneven):
    got = uneven(case)
    forwards = got["report"]["forwards"]
    ranks = sorted(tuple(f["ranks"]) for f in forwards)
    assert len(forwards) > 1 and sorted(r for rs in ranks for r in rs) == [0, 1, 2], ranks  # a package per shape
    want = reference_generate(got["path"], PROMPT, NEW_TOKENS)
    assert got["result"]["generated"] == want["generated"] and len(set(want["generated"])) > 1
    diff = max(abs(x - y) for a, b in zip(got["result"]["logits"], want["logits"]) for x, y in zip(a, b))
    print(f"{case} at tp 3 ({len(forwards)} packages for ranks {ranks}): max |logit diff| vs transformers {diff:.2e}")
    assert diff < 1e-3


def test_verify_and_torch_alone_bind_each_rank_its_own_package(uneven, kiln, tmp_path):
    """`kiln verify` runs the three ranks' packages together against the unsharded model (rank 1's straddling
    heads gathered back into the whole KV cache); torch alone picks each rank's package and shapes from the
    manifest (`ranks`, `shapes`, `lengths`) and computes what Kiln's loader does."""
    import torch
    from torch_only_harness import run_torch_only, run_with_kiln

    got = uneven("qwen3-tp3-straddle")
    verified = kiln("verify", "uneven-qwen3-tp3-straddle", "--store", got["store"], env=got["env"])
    assert verified.code == 0 and "verify ok: 3 ranks match the unsharded model" in verified.out, verified.err[-3000:]
    root = Path(got["store"].removeprefix("file://"))
    manifest_path = root / got["report"]["manifest"]
    manifest = json.loads(manifest_path.read_text())
    q = manifest["weights"]["model.runs.0.self_attn.q_proj.weight"]
    assert q["shapes"] == [[2, 192, 256], [2, 192, 256], [2, 128, 256]] and "shape" not in q
    assert manifest["weights"]["model.runs.0.self_attn.k_proj.weight"]["sources"][0]["cut"]["offsets"] == [0, 0, 64]
    run_torch_only(manifest_path, root / "forwards", str(got["path"]), tmp_path / "alone", 3,
                   verify_key=got["verify_key"])
    run_with_kiln(manifest_path, root / "forwards", tmp_path / "kiln", 3)
    alone = [torch.load(tmp_path / "alone" / f"rank{r}.pt") for r in range(3)]
    kiln_ = torch.load(tmp_path / "kiln" / "rank0.pt")
    for bucket, logits in alone[0].items():
        assert all(torch.equal(logits, other[bucket]) for other in alone[1:])  # all-reduced: alike on every rank
        assert torch.equal(logits, kiln_[bucket]), f"{bucket}: torch alone and Kiln's loader differ"
