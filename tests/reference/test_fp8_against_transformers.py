"""FP8-block checkpoints as published, computed by Kiln, against transformers' own dequantization.

The checkpoint (fp8_checkpoints.write_fp8) is a random-init Qwen3-MoE made here and quantized to 128 x 128
blocks, at widths that give every kind of block: the attention's q rows (256) two whole blocks, one per rank at
tp 2; the dense MLP's 320 rows three blocks, the last partial, and each rank's 160 rows ending or starting
inside a block (ranks share its scale); each expert's 32 rows one partial block, 16 a rank. `kiln export --tp 2
--dtype float32` keeps the weights float8 in every rank's memory and dequantizes them in the graph; `kiln run`
must generate what transformers' dequantized model generates, its logits within 1e-3 (float32).

Eagerly (tp 1, no compile), the same checkpoint, a dense Qwen3 (hidden 192: the columns one whole block and one
of 64, which transformers reads as two 96-column blocks without a word) and DeepSeek-V3 (kv_a_proj_with_mqa's
576 rows: four blocks and one of 64) match transformers' dequantized models within 1e-4 in float32, and in
bfloat16, from the same bytes, stay within twice transformers' own bfloat16 error.
"""

from __future__ import annotations

import json

import pytest
from fp8_checkpoints import dequantize, misread, write_fp8
from hf_models import CLASSES, DEEPSEEK, export_then_run, generates_as_transformers, hf_config, hf_model

PROMPT = [5, 17, 300, 42, 7, 99, 3, 250, 11, 8, 130, 64]
NEW_TOKENS = 6
QWEN3_MOE = dict(head_dim=64, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 intermediate_size=320, mlp_only_layers=[1], norm_topk_prob=True)
EAGER = {"qwen3-moe": ("qwen3_moe", QWEN3_MOE),
         "qwen3": ("qwen3", dict(hidden_size=192, head_dim=64, num_attention_heads=3, num_key_value_heads=1,
                                 intermediate_size=384)),
         "deepseek-v3": ("deepseek_v3", dict(DEEPSEEK, kv_lora_rank=512, qk_rope_head_dim=64, attention_bias=True))}
"""case -> (family, config overrides): FP8-block checkpoints compared eagerly at tp 1."""


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(the published FP8 checkpoint, the directory transformers' dequantization reads)."""
    model = hf_model("qwen3_moe", hf_config("qwen3_moe", QWEN3_MOE, "float32"))
    return write_fp8(model, tmp_path_factory.mktemp("qwen3-moe-fp8"))


@pytest.fixture(scope="module")
def eager_case(fp8, tmp_path_factory):
    """case -> (family, published, reference), each written once."""
    done = {"qwen3-moe": ("qwen3_moe", *fp8)}

    def get(case: str):
        if case not in done:
            family, overrides = EAGER[case]
            model = hf_model(family, hf_config(family, overrides, "float32"))
            done[case] = (family, *write_fp8(model, tmp_path_factory.mktemp(case)))
        return done[case]

    return get


def _transformers(path, family: str = "qwen3_moe", dtype: str = "float32"):
    import torch
    import transformers

    return getattr(transformers, CLASSES[family][1]).from_pretrained(
        path, dtype=getattr(torch, dtype), quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()


def test_the_reference_is_transformers_dequantization_but_where_it_misreads_blocks(fp8):
    """transformers' FP8 dequantization reads the published checkpoint's whole and single partial blocks as
    DeepSeek's convention does, bit for bit; the dense MLP's tensors (three blocks, the last partial) it refuses,
    so the reference holds them dequantized by the convention."""
    import torch
    from safetensors.torch import load_file

    published, reference = fp8
    with pytest.raises(Exception, match="conversion|divisible"):
        _transformers(published)
    tensors = load_file(published / "model.safetensors")
    assert tensors["model.layers.1.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.gate_proj.weight_scale_inv"].shape == (3, 1)
    theirs = _transformers(reference).state_dict()
    read_by_them = 0
    for name, q in tensors.items():
        if q.dtype != torch.float8_e4m3fn or ".experts." in name:  # experts: fused in transformers' model
            continue
        assert torch.equal(theirs[name], dequantize(q, tensors[name + "_scale_inv"])), name
        read_by_them += not misread(q.shape)
    assert read_by_them and any(misread(t.shape) for t in tensors.values())
    e = 5
    mine = torch.cat([dequantize(tensors[f"model.layers.2.mlp.experts.{e}.{p}.weight"],
                                 tensors[f"model.layers.2.mlp.experts.{e}.{p}.weight_scale_inv"])
                      for p in ("gate_proj", "up_proj")])
    assert torch.equal(theirs["model.layers.2.mlp.experts.gate_up_proj"][e], mine)


def test_transformers_reads_a_partial_block_of_two_wrong_without_a_word(eager_case):
    """Why the reference is built by DeepSeek's convention where a tensor has several blocks, the last partial: a
    192-column tensor (blocks of 128 and 64) loads, but as two 96-column blocks."""
    import torch
    from safetensors.torch import load_file

    _, published, _ = eager_case("qwen3")
    tensors = load_file(published / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert tensors[name].shape == (192, 192) and tensors[name + "_scale_inv"].shape == (2, 2)
    theirs = _transformers(published, "qwen3").state_dict()[name]
    assert not torch.equal(theirs, dequantize(tensors[name], tensors[name + "_scale_inv"]))


def _kiln_logits(path, dtype: str, tokens):
    import torch

    from kiln.core.model.cache_layout import cache_layout
    from kiln.host.model import ShardedDecoder
    from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights

    cfg = inspect_checkpoint(path).replace(dtype=dtype)  # --dtype: the same bytes, computed in `dtype`
    model = ShardedDecoder(cfg, 1).to(getattr(torch, dtype)).eval()
    model.load_state_dict(load_rank_weights(path, cfg, 1, 0))
    assert model.model.runs[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    cache = torch.zeros(cache_layout(cfg, 1).shape(cfg.num_layers, 3, 16), dtype=getattr(torch, dtype))
    with torch.no_grad():
        return model(tokens, torch.tensor([0]), cache, torch.arange(2)[None])[0].float()


@pytest.mark.parametrize("case", sorted(EAGER))
def test_kiln_computes_what_transformers_dequantized_model_computes(case, eager_case):
    import torch

    family, published, reference = eager_case(case)
    tokens = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = _transformers(reference, family)(tokens).logits.float()
        theirs = _transformers(reference, family, "bfloat16")(tokens).logits.float()
    assert float((_kiln_logits(published, "float32", tokens) - exact).abs().max()) < 1e-4
    ours, own = (float((x - exact).abs().max()) for x in (_kiln_logits(published, "bfloat16", tokens), theirs))
    print(f"{case}: bfloat16 from FP8 blocks {ours:.3f} against float32, transformers' own bfloat16 {own:.3f}")
    assert ours <= 2 * own


@pytest.mark.slow
def test_an_fp8_export_in_float32_generates_what_transformers_dequantized_model_does(fp8, kiln, prefect_server,
                                                                                      tmp_path):
    import transformers

    published, reference = fp8
    report, got = export_then_run(kiln, published, tmp_path, "fp8-blocks", prefect_server, PROMPT, NEW_TOKENS)
    diff = generates_as_transformers(got, reference, PROMPT, NEW_TOKENS,
                                     quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    print(f"FP8 blocks, float32: max |logit diff| vs transformers {diff:.2e}; compile s "
          f"{[f.get('compile_s') for f in report['forwards']]}")
    assert diff < 1e-3
    # The contract: float8 projections beside float32 scales; a rank's share of the dense MLP's 320 rows (160)
    # is five 32-row sub-blocks, each repeating its block's scale.
    root = tmp_path / "store"
    weights = json.loads((root / report["manifest"]).read_text())["weights"]
    assert weights["model.runs.0.self_attn.q_proj.weight"]["dtype"] == "float8_e4m3fn"
    dense = weights["model.runs.1.mlp.gate_proj.weight_scale_inv"]
    assert dense["dtype"] == "float32" and dense["shape"] == [1, 5, 1]
    assert dense["sources"][0]["cut"] == {"dim": 0, "length": 5, "offsets": [0, 5], "repeat": 4}
    assert weights["model.embed_tokens.weight"]["dtype"] == "float32"
