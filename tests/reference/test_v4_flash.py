"""DeepSeek-V4 as DeepSeek-V4-Flash is published (FP8 attention and shared experts with UE8M0 scales, FP4 routed
experts), computed by Kiln from the quantized bytes, against transformers' own dequantization of them.

The checkpoint (v4_flash_checkpoints.write_v4_flash) is the reference tests' small V4 (bench.hf_checkpoints.
V4_SMALL) with experts 64 wide, so every FP4 row holds whole 32-input scale groups and a rank's half of w2's
inputs (tp 2) one group; transformers reads it with FineGrainedFP8Config(dequantize=True), to exactly the
weights an independent dequantization of the bytes gives (checked below, and in ../shared/DESIGN.md).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from v4_flash_checkpoints import write_v4_flash

from bench.hf_checkpoints import CSA, HCA, V4_SMALL, randomise_v4
from kiln.core.model import quant
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.host.model.families.deepseek_v4 import DeepseekV4Decoder
from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights

FLASH = {**V4_SMALL, "moe_intermediate_size": 64}
"""V4_SMALL with experts of 64: two FP4 scale groups a row of w2, one a rank at tp 2."""


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """(the V4-Flash-layout checkpoint, name -> the float32 weight its bytes dequantize to)."""
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**FLASH)).eval()
    randomise_v4(model, FLASH["n_routed_experts"], 1)
    return write_v4_flash(model, tmp_path_factory.mktemp("v4-flash"))


def _tokens(vocab: int, n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _transformers(path, dtype=torch.float32):
    return transformers.DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()


def _kiln(cfg, path, tp=1, rank=0, scan=True):
    model = DeepseekV4Decoder(cfg, tp, scan=scan).to(getattr(torch, cfg.dtype)).eval()
    model.load_state_dict(load_rank_weights(path, cfg, tp, rank), strict=True)
    return model


def test_the_checkpoint_reads_as_v4_flash_and_stays_quantized_in_a_rank(flash):
    path, dequantized = flash
    cfg = inspect_checkpoint(path)
    assert cfg.quant == quant.WeightQuant(quant.FP8_BLOCKS, (128, 128), "ue8m0", "fp4")
    weights = load_rank_weights(path, cfg, 2, 0)
    experts = "model.runs.0.ffn.experts.w1.weight"
    assert weights[experts].dtype == torch.int8 and weights[experts].shape[-1] == FLASH["hidden_size"] // 2
    assert weights["model.runs.0.ffn.experts.w1.scale"].dtype == torch.uint8
    assert weights["model.runs.0.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert weights["model.runs.0.attn.wq_b.scale"].dtype == torch.uint8
    assert weights["model.runs.0.ffn.shared_experts.w2.weight"].dtype == torch.float8_e4m3fn
    assert weights["model.runs.1.attn.compressor.wkv.weight"].dtype == torch.bfloat16
    # What a rank holds of its quantized projections against the same entries in bfloat16: FP8 a byte an
    # entry and a UE8M0 byte per block, FP4 half a byte and a byte per 32 inputs.
    for kind, ratio in (("fp4", 0.27), ("fp8", 0.51)):
        names = [n for n in weights if quant.is_quantized(cfg.quant, n)
                 and quant.is_fp4(cfg.quant, n) == (kind == "fp4")]
        held = sum(weights[n].nbytes + weights[quant.scale_of(n, cfg.quant)].nbytes for n in names)
        bf16 = sum(2 * weights[n].numel() * (2 if kind == "fp4" else 1) for n in names)
        print(f"rank 0 of tp 2, {kind}: {held} bytes, {held / bf16:.3f} of bfloat16's {bf16}")
        assert names and held <= ratio * bf16
    # The gate's and the KV plan's figure for the rank is what it holds.
    assert weight_bytes_per_rank(cfg, 2) == sum(t.nbytes for t in weights.values())


def test_transformers_reads_the_bytes_as_an_independent_dequantization_does(flash):
    path, dequantized = flash
    state = _transformers(path).state_dict()
    assert float((state["model.layers.2.mlp.experts.gate_up_proj"][3, :64]
                  - dequantized["model.layers.2.ffn.experts.3.w1.weight"]).abs().max()) == 0.0
    assert float((state["model.layers.3.mlp.experts.down_proj"][5]
                  - dequantized["model.layers.3.ffn.experts.5.w2.weight"]).abs().max()) == 0.0
    assert float((state["model.layers.1.self_attn.q_b_proj.weight"]
                  - dequantized["model.layers.1.attn.wq_b.weight"]).abs().max()) == 0.0


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_kiln_computes_what_transformers_dequantized_model_computes(flash, scan):
    """float32 compute from the quantized bytes: within 1e-4 of transformers' float32 dequantized model."""
    path, _ = flash
    cfg = inspect_checkpoint(path).replace(dtype="float32")
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        want = _transformers(path)(tokens).logits.float()
        got = _kiln(cfg, path, scan=scan).prompt(tokens).float()
    diff = float((got - want).abs().max())
    print(f"scan={scan}: max |logit diff| against transformers' dequantized model {diff:.2e} "
          f"(logits up to {float(want.abs().max()):.2f})")
    assert diff <= 1e-4 and float(want.abs().max()) > 1.0


def test_bfloat16_from_the_same_bytes_stays_within_transformers_own_error(flash):
    path, _ = flash
    cfg = inspect_checkpoint(path)
    assert cfg.dtype == "bfloat16"
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        exact = _transformers(path)(tokens).logits.float()
        theirs = float((_transformers(path, torch.bfloat16)(tokens).logits.float() - exact).abs().max())
        ours = float((_kiln(cfg, path).prompt(tokens).float() - exact).abs().max())
    print(f"bfloat16: Kiln {ours:.3f} from transformers' float32; transformers' own bfloat16 {theirs:.3f}")
    assert ours <= 2 * theirs


REAL_WIDTHS = dict(vocab_size=32000, num_hidden_layers=2, layer_types=[CSA, HCA], mlp_layer_types=["hash_moe", "moe"],
                   n_routed_experts=6, num_experts_per_tok=4, index_topk=16)
"""DeepSeek-V4-Flash's own widths (DeepseekV4Config's defaults: hidden 4096, 64 heads of 512 with 64 rotating
dims, q_lora_rank 1024, 8 output groups of 1024, experts 2048 wide, an indexer of 64 heads of 128, hc_mult 4,
compress rates 4 and 128, a window of 128) at 2 layers (a CSA layer routed by hash, an HCA layer by top-k), 6
experts (top 4), a vocabulary of 32000 and an indexer top 16 (of its 512: 160 tokens compress to 40 CSA entries,
so the indexer chooses)."""


@pytest.mark.slow
def test_v4_flash_at_its_own_widths_in_bfloat16_stays_within_transformers_own_error(tmp_path):
    """The published layout at V4-Flash's widths: 160 tokens (past the window and one HCA compression), Kiln's
    bfloat16 from the FP8 and FP4 bytes against transformers' dequantized float32 model, within twice
    transformers' own bfloat16 error; the rank holds the bytes as published."""
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**REAL_WIDTHS)
    assert (config.hidden_size, config.head_dim, config.moe_intermediate_size, config.o_groups) == (4096, 512, 2048, 8)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    randomise_v4(model, config.n_routed_experts, 1)
    path, _ = write_v4_flash(model, tmp_path, dequantized_too=False)
    del model
    cfg = inspect_checkpoint(path)
    assert cfg.dtype == "bfloat16" and cfg.quant.experts == "fp4"
    tokens = _tokens(cfg.vocab_size, 160)
    with torch.no_grad():
        exact = _transformers(path)(tokens).logits.float()
        theirs = float((_transformers(path, torch.bfloat16)(tokens).logits.float() - exact).abs().max())
        ours = float((_kiln(cfg, path).prompt(tokens).float() - exact).abs().max())
    held = sum(t.nbytes for t in load_rank_weights(path, cfg, 1, 0).values())
    print(f"V4-Flash widths, bfloat16, 160 tokens: Kiln {ours:.3f} from transformers' float32 dequantized model; "
          f"transformers' own bfloat16 {theirs:.3f}; the rank holds {held / 2**20:.0f} MiB")
    assert held == weight_bytes_per_rank(cfg, 1)
    assert ours <= 2 * theirs


def _rank_main(rank: int, path: str, init: str, out: str, tokens: list[int]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        cfg = inspect_checkpoint(path).replace(dtype="float32")
        with torch.no_grad():
            logits = _kiln(cfg, path, 2, rank, scan=False).prompt(torch.tensor([tokens]))
        if rank == 0:
            torch.save(logits, out)
        dist.barrier()  # no rank leaves the group while another still talks in it (gloo aborts)
    finally:
        dist.destroy_process_group()


def test_two_ranks_of_the_quantized_bytes_compute_what_one_does(flash, tmp_path):
    """tp 2 cuts w2's FP4 bytes along its inputs (a scale group a rank) and the FP8 wq_b, wo_a and wo_b with their
    UE8M0 block scales, each rank's share inside one 128-block (ranks repeat its scale)."""
    import torch.multiprocessing as mp

    path, _ = flash
    cfg = inspect_checkpoint(path).replace(dtype="float32")
    tokens = _tokens(cfg.vocab_size)[0].tolist()
    out = tmp_path / "tp2.pt"
    mp.start_processes(_rank_main, args=(str(path), f"file://{tmp_path / 'rendezvous'}", str(out), tokens),
                       nprocs=2, start_method="spawn")
    with torch.no_grad():
        one = _kiln(cfg, path, scan=False).prompt(torch.tensor([tokens]))
    diff = float((torch.load(out) - one).abs().max())
    print(f"tp 2 against tp 1 from the quantized bytes: {diff:.2e}")
    assert diff <= 1e-4 and math.isfinite(diff)


FLASH_EXPORT = ("--tp", "2", "--dtype", "float32", "--buckets", "1x1,1x8", "--shape-policy", "static",
                "--set", "max_context_tokens=64", "--set", "page_tokens=16")
"""Two static forwards: the 20-token prompt is fed as 8 + 8 + 1 x 4 (no padding: a V4 step rewrites every
token's state), then 1 token per step."""


@pytest.fixture(scope="module")
def flash_export(flash, kiln, prefect_server, tmp_path_factory) -> dict:
    """`kiln export` of the V4-Flash-layout checkpoint at tp 2 in float32 (FLASH_EXPORT): {'store', 'root' (its
    directory), 'env', 'report'}. The suite's one DeepSeek-V4 export: test_deepseek_v4.py holds the unquantized
    model to transformers eagerly, at tp 1 and tp 2; its layers are these (the quantized projections
    dequantized where a layer reads them)."""
    import json

    root = tmp_path_factory.mktemp("flash-export")
    store, env = f"file://{root / 'store'}", {"PREFECT_API_URL": prefect_server}
    exported = kiln("export", "--model", str(flash[0]), *FLASH_EXPORT, "--store", store, "--export-id", "flash",
                    "--report", str(root / "report.json"), env=env)
    assert exported.code == 0, exported.err[-3000:]
    return {"store": store, "root": root / "store", "env": env,
            "report": json.loads((root / "report.json").read_text())}


@pytest.mark.slow
def test_kiln_export_and_run_of_the_published_layout_generate_what_transformers_does(flash, flash_export, kiln,
                                                                                      dev_verify_key, tmp_path):
    """`kiln export --tp 2 --dtype float32` of the V4-Flash-layout checkpoint keeps the weights quantized in each
    rank and the package, and `kiln run` generates what transformers' dequantized model generates: ids equal,
    logits within 1e-4, over a 20-token prompt (8 + 8 + 1 x 4) and 12 steps (past the window of 8, across CSA
    windows of 4 and HCA windows of 8). `kiln verify` finds both ranks' forwards match the unsharded model;
    torch alone (examples/torch_only.py) binds the int8, uint8 and float8 constants from the manifest and the
    checkpoint's bytes and steps both forwards as Kiln's loader does."""
    import json

    from hf_models import reference_generate

    path, _ = flash
    store, env, report, root = (flash_export[k] for k in ("store", "env", "report", "root"))
    manifest = json.loads((root / report["manifest"]).read_text())
    dtypes = {w["dtype"] for w in manifest["weights"].values()}
    assert {"int8", "uint8", "float8_e4m3fn"} <= dtypes, dtypes
    prompt, new_tokens = _tokens(FLASH["vocab_size"], 20, seed=3)[0].tolist(), 12  # seed 1's greedy path repeats
    ran = kiln("run", "flash", "--store", store, "--tokens", ",".join(map(str, prompt)),
               "--max-new-tokens", str(new_tokens), "--json", str(tmp_path / "run.json"), env=env)
    assert ran.code == 0, ran.err[-3000:]
    got = json.loads((tmp_path / "run.json").read_text())
    want = reference_generate(path, prompt, new_tokens,
                              quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    assert len(set(want["generated"])) > 4, "greedy decoding repeats itself: the check would show little"
    assert got["generated"] == want["generated"]
    diff = max(abs(x - y) for a, b in zip(got["logits"], want["logits"]) for x, y in zip(a, b))
    print(f"V4-Flash layout, tp 2, float32: max |logit diff| against transformers' dequantized model {diff:.2e}; "
          f"compile s per forward {[f.get('compile_s') for f in report['forwards']]}")
    assert diff <= 1e-4
    verified = kiln("verify", "flash", "--store", store, env=env)
    assert verified.code == 0, verified.err[-3000:]
    assert "verify ok: 2 ranks match the unsharded model" in verified.out
    from torch_only_harness import run_torch_only, run_with_kiln

    manifest_path, packages = root / report["manifest"], root / "forwards"
    run_torch_only(manifest_path, packages, str(path), tmp_path / "torch-only", verify_key=dev_verify_key)
    run_with_kiln(manifest_path, packages, tmp_path / "with-kiln")
    alone, ours = (torch.load(tmp_path / d / "rank0.pt") for d in ("torch-only", "with-kiln"))
    assert sorted(alone) == ["1x1", "1x8"] and all(torch.equal(alone[b], ours[b]) for b in alone)


@pytest.mark.slow
def test_the_cpp_runner_steps_the_flash_export_as_kiln_computes(flash, flash_export, dev_verify_key, tmp_path):
    """The C++ runner's 1x8 prefill of the tp 2 export (two ranks, each sequence's slot from the manifest's
    cache layout; int8, uint8 and float8 constants bound from the checkpoint's bytes) gives Kiln's eager
    float32 logits on every rank, within 1e-4."""
    import numpy as np
    from cpp_runner_harness import build_runner, run_ranks

    runner = build_runner()
    path, _ = flash
    cfg = inspect_checkpoint(path).replace(dtype="float32")
    tokens = _tokens(cfg.vocab_size, 8)
    root, report = flash_export["root"], flash_export["report"]
    out = tmp_path / "logits-{rank}.f32"
    results = run_ranks(runner, root / report["manifest"], root / "forwards", "1x8", tokens[0].tolist(), out,
                        extra=("--verify-key", str(dev_verify_key)))
    for rank, (code, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stderr[-3000:]}"
    with torch.no_grad():
        want = _kiln(cfg, path, scan=False).prompt(tokens).float().numpy()  # Kiln against Kiln: unrolled
    for rank in range(2):
        got = np.fromfile(str(out).format(rank=rank), dtype="<f4").reshape(want.shape)
        diff = float(np.abs(got - want).max())
        print(f"C++ runner rank {rank}: max |logit diff| vs eager {diff:.2e}")
        assert diff <= 1e-4, f"rank {rank}: {diff}"
