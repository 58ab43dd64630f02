"""The incident, replayed (../shared/BACKGROUND.md): DeepSeek-V4 in the layout DeepSeek-V4-Flash is published in
(FP8 attention and shared expert with UE8M0 scales, FP4 routed experts), exported at --tp 3 on three hosts, one
rank each, hosts 1 and 2 told they cannot fit a compile worker. The export that failed after 22 minutes.

The model is small (tests/reference/test_uneven_tp.py's FLASH_TP3: 8 heads in 4 output groups, so tp 3 splits
them 2, 1, 1; FP8 rows and FP4 groups whole on every rank); the hosts are a local Dask cluster of three
worker processes, the store a real S3 server process, Prefect a real server. The gate lends host-1's and
host-2's forwards to host-0, which compiles one package per rank shape; every host checks its rank against
eager; `kiln run` generates what transformers' own dequantization of the bytes generates.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from hf_models import reference_generate
from incident_hosts import INCIDENT
from test_uneven_tp import FLASH_TP3
from v4_flash_checkpoints import write_v4_flash

pytestmark = pytest.mark.slow

V4_EXPORT = ["--dtype", "float32", "--buckets", "1x1", "--shape-policy", "static", "--set", "max_context_tokens=64",
             "--set", "page_tokens=16"]


def test_v4_flash_at_tp_3_on_three_hosts_borrows_host_0s_compilers_and_runs_what_transformers_does(
        kiln, prefect_server, s3_bucket, signing_key_env, tmp_path):
    from bench.hf_checkpoints import V4_SMALL, randomise_v4

    config = transformers.DeepseekV4Config(**{**V4_SMALL, **FLASH_TP3, "index_head_dim": 32})
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    randomise_v4(model, config.n_routed_experts, 1)
    path, _ = write_v4_flash(model, tmp_path)
    env = {**{k: os.environ[k] for k in os.environ if k.startswith("AWS_")}, **signing_key_env,
           "PREFECT_API_URL": prefect_server}
    report = tmp_path / "report.json"
    run = kiln("export", "--model", str(path), *INCIDENT, *V4_EXPORT, "--store", s3_bucket, "--export-id", "incident",
               "--report", str(report), env=env)
    assert run.code == 0, run.err[-3000:]
    r = json.loads(report.read_text())
    assert sorted(tuple(f["ranks"]) for f in r["forwards"]) == [(0,), (1, 2)]  # groups 2, 1, 1: two rank shapes
    assert {f["compiled_by"] for f in r["forwards"]} == {"host-0"}
    hosts = {h["name"]: h for h in r["hosts"]}
    assert hosts["host-1"]["workers"] == 0 and hosts["host-2"]["workers"] == 0
    assert r["gate"]["assignments"]["host-1"] == [] and r["gate"]["assignments"]["host-2"] == []
    assert sorted(r["gate"]["assignments"]["host-0"]) == sorted(f["key"] for f in r["forwards"])
    # Seed 3's path reaches an indexer near-tie at position 19, where transformers' own generate and full
    # forward part by 0.1: the reference is held to itself first (below), and this prompt has no tie.
    prompt = torch.randint(0, config.vocab_size, (16,), generator=torch.Generator().manual_seed(7)).tolist()
    new_tokens = 6
    ran = kiln("run", "incident", "--store", s3_bucket, "--tokens", ",".join(map(str, prompt)), "--max-new-tokens",
               str(new_tokens), "--json", str(tmp_path / "run.json"), env=env)
    assert ran.code == 0, ran.err[-3000:]
    got = json.loads((tmp_path / "run.json").read_text())
    want = reference_generate(path, prompt, new_tokens,
                              quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    with torch.no_grad():  # transformers' generate and its full forward agree: no routing tie on this path
        full = transformers.DeepseekV4ForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)
        ).eval()(torch.tensor([prompt + want["generated"][:-1]])).logits[0, len(prompt) - 1:]
    assert float((full - torch.tensor(want["logits"])).abs().max()) < 1e-4, "the reference is at a tie"
    assert len(set(want["generated"])) > 2 and got["generated"] == want["generated"]
    diff = max(abs(x - y) for a, b in zip(got["logits"], want["logits"]) for x, y in zip(a, b))
    print(f"the incident replayed: V4-Flash layout at tp 3 on 3 hosts, host-0 compiling "
          f"{len(r['forwards'])} packages ({[f.get('compile_s') for f in r['forwards']]} s); max |logit diff| "
          f"against transformers' dequantized model {diff:.2e}")
    assert diff <= 1e-3
