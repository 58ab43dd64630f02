"""gpt-oss as published, its experts MXFP4 (mxfp4_checkpoints), against transformers' own dequantization of the
same bytes (`Mxfp4Config(dequantize=True)`): kept quantized in a rank's memory, dequantized in the graph."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hf_models import export_then_run, generates_as_transformers, hf_config, hf_model, transformers
from mxfp4_checkpoints import dequantized_reference, write_mxfp4
from test_uneven_tp import _rank_logits, _ranks, _tokens

from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.core.model.shares import rank_share
from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights

TP3 = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2, num_local_experts=8,
           num_experts_per_tok=2, intermediate_size=160, sliding_window=6, swiglu_limit=1.0)
"""Query heads 3, 3, 2 over 2 KV heads; each expert's 160 columns split by whole groups of 32: 64, 64, 32."""
REAL = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4, vocab_size=32000,
            num_local_experts=16, num_experts_per_tok=4, intermediate_size=256, sliding_window=6,
            initializer_range=0.05)
"""A real shape in bfloat16: heads of 64, 16 experts (top 4) of width 256, vocabulary 32000."""


def _written(overrides: dict, root):
    return write_mxfp4(hf_model("gpt_oss", hf_config("gpt_oss", overrides, "float32")), root)


def _rank_main32(rank: int, tp: int, path: str, init: str, out: str, tokens: list[int]) -> None:
    """test_uneven_tp's rank, computing in float32 from the MXFP4 bytes (the checkpoint says bfloat16)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    try:
        torch.set_num_threads(1)
        cfg = inspect_checkpoint(path).replace(dtype="float32")
        rows = _rank_logits(cfg, tp, rank, path, tokens)
        if rank == 0:
            torch.save(rows, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_mxfp4_at_tp_3_in_float32_computes_what_transformers_dequantized_model_does(tmp_path):
    """Three gloo ranks of unequal shares prefill 13 tokens and decode 4 from the paged cache; rank 0's logits
    against transformers' dequantized float32 model: ids equal, within 1e-3."""
    path = _written(TP3, tmp_path)
    cfg = inspect_checkpoint(path)
    assert cfg.quant.method == "mxfp4" and cfg.dtype == "bfloat16"
    assert [rank_share(cfg, 3, r).experts for r in range(3)] == [(0, 64), (64, 128), (128, 160)]
    tokens = _tokens(cfg.vocab_size)
    kiln = _ranks(_rank_main32, 3, path, tokens, tmp_path)
    with torch.no_grad():
        expected = dequantized_reference(path)(torch.tensor([tokens])).logits[0].float()
    diff = float((kiln - expected).abs().max())
    print(f"MXFP4 gpt-oss at tp 3, float32: max |logit diff| vs transformers' dequantized model {diff:.2e}")
    assert torch.equal(kiln.argmax(-1), expected.argmax(-1))
    assert diff <= 1e-3


def test_mxfp4_in_bfloat16_at_a_real_shape_stays_within_transformers_own_bfloat16_error(tmp_path):
    """Kiln's bfloat16 from the MXFP4 bytes, and transformers' own bfloat16 dequantized model, both against its
    float32 dequantized model: Kiln within twice transformers' own error."""
    path = _written(REAL, tmp_path)
    cfg = inspect_checkpoint(path)
    tokens = _tokens(cfg.vocab_size)
    ours = _rank_logits(cfg, 1, 0, path, tokens)
    with torch.no_grad():
        exact = dequantized_reference(path)(torch.tensor([tokens])).logits[0].float()
        theirs = dequantized_reference(path, "bfloat16")(torch.tensor([tokens])).logits[0].float()
    ours_off, theirs_off = float((ours - exact).abs().max()), float((theirs - exact).abs().max())
    print(f"MXFP4 gpt-oss in bfloat16: Kiln {ours_off:.3f}, transformers' own bfloat16 {theirs_off:.3f}")
    assert ours_off <= 2 * theirs_off


def test_a_rank_holds_the_experts_as_published_bytes(tmp_path):
    """A rank's constants keep the MXFP4 bytes and scales (uint8), what the gate counts is what the rank binds,
    and the experts weigh about a quarter of their bfloat16 selves (4.25 bits a weight against 16)."""
    path = _written(REAL, tmp_path)
    cfg = inspect_checkpoint(path)
    bf16 = inspect_checkpoint(tmp_path / "bf16")
    for tp in (1, 2):
        held = load_rank_weights(path, cfg, tp, 0)
        plain = load_rank_weights(tmp_path / "bf16", bf16, tp, 0)
        assert {held[n].dtype for n in held if n.endswith(("_blocks", "_scales"))} == {torch.uint8}
        nbytes = {n: t.numel() * t.element_size() for n, t in held.items()}
        assert sum(nbytes.values()) == weight_bytes_per_rank(cfg, tp)
        experts = sum(b for n, b in nbytes.items() if n.endswith(("_blocks", "_scales")))
        plain_experts = sum(t.numel() * t.element_size() for n, t in plain.items()
                            if n.endswith((".experts.gate_up_proj", ".experts.down_proj")))
        assert experts / plain_experts == pytest.approx(4.25 / 16)
        on_disk = json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"]
        print(f"tp {tp} ({on_disk}): a rank's weights {sum(nbytes.values()) / 2**20:.2f} MiB, experts "
              f"{experts / 2**20:.2f} MiB against {plain_experts / 2**20:.2f} MiB in bfloat16")
        assert math.prod(held["model.runs.0.mlp.experts.gate_up_proj_blocks"].shape[-2:]) * 2 == cfg.hidden_size


def test_transformers_reads_these_checkpoints_as_mxfp4(tmp_path):
    """The reference is transformers' dequantization of the published names: loading the MXFP4 directory
    without dequantize=True on CPU is not what the tests compare with, and the bytes differ from the bfloat16
    weights they came from (the quantization is real)."""
    path = _written(TP3, tmp_path)
    ref = dequantized_reference(path)
    plain = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    a = ref.model.layers[0].mlp.experts.gate_up_proj
    b = plain.model.layers[0].mlp.experts.gate_up_proj
    assert a.shape == b.shape and 0 < float((a - b).abs().max()) < float(b.abs().max())


def test_an_mxfp4_checkpoint_without_its_quantization_config_is_refused_by_name(tmp_path):
    """The bytes without the config.json that says what they are: refused before anything is read, naming the
    format and the fix."""
    from kiln.core.errors import BadInput

    path = _written(TP3, tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match="MXFP4 experts.*quant_method mxfp4"):
        inspect_checkpoint(path)


@pytest.mark.slow
def test_an_mxfp4_export_generates_what_transformers_dequantized_model_does(kiln, prefect_server, dev_verify_key,
                                                                            tmp_path):
    """`kiln export --tp 2 --dtype float32` of the published layout, then `kiln run`: transformers' dequantized
    model's greedy ids, logits within 1e-3; the package binds the MXFP4 bytes (uint8 constants, each rank's
    groups), torch alone, from the manifest, computes what Kiln's loader does on both ranks, `kiln verify`
    passes, and the C++ runner steps the package."""
    from test_export_run import NEW_TOKENS, PROMPT, torch_alone_is_kiln

    path = _written(dict(TP3, num_hidden_layers=4, intermediate_size=128), tmp_path / "ckpt")
    report, got = export_then_run(kiln, path, tmp_path, "mxfp4", prefect_server, PROMPT, NEW_TOKENS)
    diff = generates_as_transformers(got, path, PROMPT, NEW_TOKENS,
                                     quantization_config=transformers.Mxfp4Config(dequantize=True))
    print(f"MXFP4, float32, tp 2: max |logit diff| vs transformers {diff:.2e}; compile s "
          f"{[f.get('compile_s') for f in report['forwards']]}")
    assert diff < 1e-3
    root = tmp_path / "store"
    manifest_path = root / report["manifest"]
    manifest = json.loads(manifest_path.read_text())
    blocks = manifest["weights"]["model.runs.0.mlp.experts.down_proj_blocks"]
    assert blocks["dtype"] == "uint8" and blocks["shape"] == [4, 8, 256, 2, 16]  # 2 of the 4 groups of 32
    assert blocks["sources"][0]["cut"] == {"dim": 2, "length": 2, "offsets": [0, 2]}
    torch_alone_is_kiln(manifest_path, root, manifest, tmp_path, dev_verify_key)
    verified = kiln("verify", "mxfp4", "--store", f"file://{root}", env={"PREFECT_API_URL": prefect_server})
    assert verified.code == 0, verified.err[-3000:]
    assert "verify ok: 2 ranks match the unsharded model" in verified.out
    _cpp_runner_steps_it(path, root, manifest_path, dev_verify_key, tmp_path)


def _cpp_runner_steps_it(path, root, manifest_path, verify_key, tmp_path) -> None:
    """The C++ runner's 1x8 prefill on both ranks (uint8 blocks and scales bound from the checkpoint's bytes,
    each rank's groups) gives Kiln's eager float32 logits, within 1e-4."""
    import numpy as np
    from cpp_runner_harness import build_runner, run_ranks
    from test_eager_reference import kiln_logits

    runner = build_runner()
    tokens = list(range(3, 11))
    out = tmp_path / "logits-{rank}.f32"
    results = run_ranks(runner, manifest_path, root / "forwards", "1x8", tokens, out,
                        extra=("--verify-key", str(verify_key)))
    for rank, (code, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stderr[-3000:]}"
    cfg = inspect_checkpoint(path).replace(dtype="float32")
    want = kiln_logits(cfg, load_rank_weights(path, cfg, 1, 0), torch.tensor([tokens])).numpy()
    for rank in range(2):
        got = np.fromfile(str(out).format(rank=rank), dtype="<f4").reshape(want.shape)
        diff = float(np.abs(got - want).max())
        print(f"C++ runner rank {rank}: max |logit diff| vs eager {diff:.2e}")
        assert diff <= 1e-4, f"rank {rank}: {diff}"
