"""DeepSeek-V4-Flash's weight layout (kiln.core.model.quant: UE8M0 scales, FP4 experts): read from config.json,
laid out in the contract (stored shapes, dtypes, a rank's cuts of bytes and scales), and the FP4 and UE8M0
arithmetic the graph does, held to an independent reading of the bits."""

from __future__ import annotations

import pytest
import torch

from kiln.core.errors import BadInput
from kiln.core.model import quant
from kiln.core.model.contract import constant_dtype, constant_shapes, parameter_shapes, rank_reads
from kiln.core.model.hf_config import from_hf, to_hf
from kiln.host.model.layers.quantized import dequantize, quantize, quantize_fp4, scale_values, unpack_fp4
from test_hf_config_v4 import SMALL

FLASH_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
               "scale_fmt": "ue8m0"}
FLASH = {**SMALL, "quantization_config": FLASH_QUANT, "expert_dtype": "fp4"}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_v4_flash_config_reads_and_writes_back():
    cfg = from_hf(FLASH)
    assert cfg.quant == quant.WeightQuant(quant.FP8_BLOCKS, (128, 128), "ue8m0", "fp4")
    again = from_hf(to_hf(cfg))
    assert again.quant == cfg.quant and to_hf(cfg)["quantization_config"]["expert_dtype"] == "fp4"
    # transformers' own spelling (V4.1): expert_dtype inside the quantization_config
    inside = {**SMALL, "quantization_config": {**FLASH_QUANT, "expert_dtype": "fp4"}}
    assert from_hf(inside).quant == cfg.quant
    # FP8 experts with UE8M0 scales are a layout too
    assert from_hf({**SMALL, "quantization_config": FLASH_QUANT}).quant.experts == "fp8"


def test_ue8m0_and_fp4_are_refused_outside_deepseek_v4():
    qwen3 = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "quantization_config": FLASH_QUANT}
    with pytest.raises(BadInput, match="scale_fmt='ue8m0'"):
        from_hf(qwen3)


def test_the_contract_lays_out_what_v4_flash_publishes():
    cfg = from_hf(FLASH)
    shapes = parameter_shapes(cfg)
    h, e = cfg.hidden_size, cfg.moe_intermediate_size
    p = "model.layers.2"
    assert shapes[f"{p}.ffn.experts.0.w1.weight"] == (e, h // 2)  # FP4: two inputs a byte
    assert shapes[f"{p}.ffn.experts.0.w1.scale"] == (e, h // 32)
    assert shapes[f"{p}.ffn.experts.0.w2.weight"] == (h, e // 2) and shapes[f"{p}.ffn.experts.0.w2.scale"] == (h, 1)
    assert shapes[f"{p}.ffn.shared_experts.w2.weight"] == (h, e)  # FP8 blocks
    assert shapes[f"{p}.ffn.shared_experts.w2.scale"] == (1, 1)
    csa = f"model.layers.{cfg.v4.layer_types.index('compressed_sparse_attention')}"
    assert f"{p}.attn.wq_b.scale" in shapes and f"{csa}.attn.indexer.wq_b.scale" in shapes
    for unquantized in ("attn.compressor.wkv", "attn.compressor.wgate", "attn.indexer.compressor.wkv",
                        "attn.indexer.weights_proj", "ffn.gate"):
        assert f"{csa}.{unquantized}.scale" not in shapes and f"{csa}.{unquantized}.weight" in shapes
    assert constant_dtype(cfg, f"{p}.ffn.experts.0.w1.weight") == "int8"
    assert constant_dtype(cfg, f"{p}.ffn.experts.0.w1.scale") == "uint8"
    assert constant_dtype(cfg, f"{p}.attn.wkv.weight") == "float8_e4m3fn"
    assert constant_dtype(cfg, f"{p}.attn.wkv.scale") == "uint8"
    assert constant_dtype(cfg, f"{p}.attn.compressor.wkv.weight") == cfg.dtype


def test_a_rank_cuts_whole_bytes_of_fp4_inputs_and_repeats_a_shared_scale():
    """tp 2 at experts 32 wide: a rank's 16 inputs of w2 are 8 bytes, half a 32-input scale group, so both
    ranks hold that group's scale (repeat 2: a scale per 16 inputs) and each cuts its own bytes."""
    cfg = from_hf(FLASH)
    shapes = constant_shapes(cfg, 2)
    w2 = "model.runs.0.ffn.experts.w2.weight"
    assert shapes[w2][-2:] == (cfg.hidden_size, cfg.moe_intermediate_size // 4)
    assert shapes["model.runs.0.ffn.experts.w2.scale"][-2:] == (cfg.hidden_size, 1)
    for rank in (0, 1):
        reads = rank_reads(cfg, 2, rank)
        (source, cut), *_ = reads[w2]
        assert source.endswith("ffn.experts.0.w2.weight") and cut == (1, rank * 8, (rank + 1) * 8)
        (source, cut), *_ = reads["model.runs.0.ffn.experts.w2.scale"]
        assert cut == (1, rank, rank + 1, 2)  # scale column 0 repeated twice, the rank's one of them
        (_, cut), *_ = reads["model.runs.0.ffn.experts.w1.weight"]
        assert cut == (0, rank * 16, (rank + 1) * 16)  # rows: whole bytes whatever the cut


def test_a_tp_that_splits_an_fp4_byte_is_refused_naming_the_count():
    cfg = from_hf({**FLASH, "moe_intermediate_size": 34, "num_attention_heads": 2, "o_groups": 2})
    with pytest.raises(BadInput, match=r"does not split its 34 expert intermediate size evenly in whole bytes, "
                                       r"and an uneven split needs whole quantization blocks of 32 columns"):
        cfg.check_tp(2)


def test_every_fp4_code_unpacks_to_its_e2m1_value():
    codes = torch.arange(256, dtype=torch.int32)
    packed = codes.to(torch.uint8).view(torch.int8)[None]
    values = unpack_fp4(packed)[0].view(256, 2)
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    assert torch.equal(values[:, 0], table[codes & 15]) and torch.equal(values[:, 1], table[codes >> 4])


def test_ue8m0_bytes_are_powers_of_two():
    s = torch.tensor([1, 120, 127, 128, 140], dtype=torch.uint8)
    assert torch.equal(scale_values(s), torch.tensor([2.0 ** -126, 2.0 ** -7, 1.0, 2.0, 2.0 ** 13]))


def test_fp4_and_ue8m0_round_trips_are_exact_on_representable_weights():
    gen = torch.Generator().manual_seed(0)
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    # FP4: each row's 32-input groups hold e2m1 values times a power of two, which come back exactly
    groups = table[torch.randint(0, 16, (6, 4, 32), generator=gen)]
    groups[..., 0] = 6.0  # every group's amax is 6: its scale is its power of two
    exact = (groups * 2.0 ** torch.randint(-4, 4, (6, 4, 1), generator=gen)).reshape(6, 128)
    packed, scales = quantize_fp4(exact)
    assert packed.dtype == torch.int8 and packed.shape == (6, 64) and scales.shape == (6, 4)
    assert torch.equal(dequantize(packed, scales, (1, 16), torch.float32), exact)
    # FP8 with UE8M0 scales: float8 values times powers of two, partial edge blocks
    w = torch.randn(200, 130, generator=gen)
    q, s = quantize(w, (128, 128), ue8m0=True)
    assert s.dtype == torch.uint8 and s.shape == (2, 2)
    back = dequantize(q, s, (128, 128), torch.float32)
    assert torch.equal(quantize(back, (128, 128), ue8m0=True)[0].float(), q.float())
    assert float((back - w).abs().max()) <= 0.07 * float(w.abs().max())
