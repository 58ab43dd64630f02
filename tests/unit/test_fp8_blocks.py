"""FP8-block checkpoints (kiln.core.model.quant): config.json's quantization_config, the contract's float8 constants
and their scales, each rank's slices of weights and scales against an independent dequantization, the
checkpoint's dtypes checked, and the dequantize in the graph."""

from __future__ import annotations

import json
import math

import pytest

from kiln.core.errors import BadInput
from kiln.core.model.config import TINY
from kiln.core.model.contract import constant_dtype, parameter_shapes, shard_slice, weight_layout
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.core.model.hf_config import from_hf, to_hf
from kiln.core.model.quant import WeightQuant, scale_cut, scale_grid

PUBLISHED = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
"""DeepSeek-V3's quantization_config, as published (Qwen3's FP8 checkpoints add modules_to_not_convert)."""

QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 192,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 48,
         "intermediate_size": 320, "torch_dtype": "bfloat16"}

BLOCKS = WeightQuant("fp8_blocks", (128, 128))
MOE = TINY.replace(architecture="qwen3_moe", qk_norm=True, hidden_size=192, num_heads=4, num_kv_heads=2, head_dim=48,
                   intermediate_size=320, num_layers=3, num_experts=4, experts_per_token=2, moe_intermediate_size=192,
                   moe_layers=(0, 2), vocab_size=256, quant=BLOCKS)
"""Blocks of 128 at widths that are not multiples of it: every projection has a partial block (hidden 192: one
whole column block and one of 64), and at tp 2 each rank's share of q (96 rows), the dense MLP (160) and the
experts (96) starts or ends inside a block, so ranks share the block's scale."""


def test_a_published_fp8_block_config_is_read_and_written_back():
    cfg = from_hf({**QWEN3, "quantization_config": {**PUBLISHED, "modules_to_not_convert": ["lm_head"]}})
    assert cfg.quant == BLOCKS and cfg.dtype == "bfloat16"
    assert from_hf(to_hf(cfg)) == cfg
    assert to_hf(cfg)["quantization_config"] == PUBLISHED
    other = from_hf({**QWEN3, "quantization_config": {**PUBLISHED, "weight_block_size": [64, 32]}})
    assert other.quant.block == (64, 32)


@pytest.mark.parametrize("quant, words", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"quant_method": "mxfp4"}, "quant_method='mxfp4'"),
    ({"quant_method": "compressed-tensors"}, "quant_method='compressed-tensors'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without a weight_block_size"),
    ({**PUBLISHED, "activation_scheme": "static"}, "activation_scheme='static'"),
    ({**PUBLISHED, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**PUBLISHED, "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({**PUBLISHED, "expert_dtype": "fp4"}, "expert_dtype='fp4'"),
    ({**PUBLISHED, "modules_to_convert": ["model.embed_tokens"]}, "modules_to_convert"),
    ({**PUBLISHED, "weight_block_size": [128]}, "weight_block_size=[128]"),
    ({**PUBLISHED, "group_size": 32}, "group_size=32"),
    ("fp8", "must be an object"),
])
def test_other_quantization_is_refused_saying_what_kiln_reads(quant, words):
    with pytest.raises(BadInput, match="quantization_config") as err:
        from_hf({**QWEN3, "quantization_config": quant})
    assert words in str(err.value)
    if isinstance(quant, dict) and "weight_block_size" in words + json.dumps(quant):
        return
    assert isinstance(quant, str) or "Kiln reads FP8 block-quantized weights" in str(err.value)


def test_fp8_blocks_over_phi3s_fused_projections_are_refused():
    phi3 = {**QWEN3, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "quantization_config": PUBLISHED}
    del phi3["head_dim"]
    with pytest.raises(BadInput, match="fused qkv_proj"):
        from_hf(phi3)


def test_the_contract_holds_projections_in_float8_beside_their_scales():
    shapes = parameter_shapes(MOE)
    assert shapes["model.layers.0.self_attn.q_proj.weight_scale_inv"] == (2, 2)  # 192 rows and columns: 1.5 blocks
    assert shapes["model.layers.1.mlp.down_proj.weight_scale_inv"] == (2, 3)  # [192, 320]
    assert shapes["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"] == (2, 2)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.self_attn.q_norm.weight"):
        assert constant_dtype(MOE, name) == MOE.dtype and name.removesuffix("weight") + "weight_scale_inv" not in shapes
    layout = weight_layout(MOE, 2)
    q, scales = layout["model.runs.0.self_attn.q_proj.weight"], layout["model.runs.0.self_attn.q_proj.weight_scale_inv"]
    assert q["dtype"] == "float8_e4m3fn" and q["shape"][1:] == [96, 192]
    # 96 rows a rank: sub-blocks of gcd(128, 96) = 32 rows, each repeating its block's scale (rank 1's rows
    # 96..191 are sub-blocks 3..5: the end of block 0, then block 1)
    assert scales["dtype"] == "float32" and scales["shape"][1:] == [3, 2]
    assert scales["sources"][0]["cut"] == {"dim": 0, "length": 3, "offsets": [0, 3], "repeat": 4}
    o = layout["model.runs.0.self_attn.o_proj.weight_scale_inv"]["sources"][0]["cut"]
    assert o == {"dim": 1, "length": 3, "offsets": [0, 3], "repeat": 4}
    assert weight_layout(MOE.replace(hidden_size=256, head_dim=64), 2)[
        "model.runs.0.self_attn.q_proj.weight_scale_inv"]["sources"][0]["cut"] == {"dim": 0, "length": 1,
                                                                                 "offsets": [0, 1]}  # whole blocks
    assert weight_layout(MOE, 1)["model.runs.0.self_attn.q_proj.weight_scale_inv"]["sources"][0]["cut"] is None


def test_a_ranks_scale_cut_keeps_each_blocks_scale():
    assert scale_grid(BLOCKS, (0, 96, 192)) == (32, 128) and scale_grid(BLOCKS, None) == (128, 128)
    assert scale_cut(BLOCKS, (0, 96, 192)) == (0, 3, 6, 4)
    assert scale_cut(BLOCKS, (1, 256, 512)) == (1, 2, 4, 1)
    # DeepSeek-V3's 576-row kv_a_proj_with_mqa is replicated: its 5 scale rows whole, the last block 64 rows
    ds = TINY.replace(architecture="deepseek_v3", hidden_size=256, num_heads=4, num_kv_heads=4, head_dim=192,
                      qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512, q_lora_rank=128, quant=BLOCKS)
    assert parameter_shapes(ds)["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == (5, 2)
    assert shard_slice("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv", ds, 2, 1) is None


def _independent_dequantize(weight, scales, block):
    """weight x scale, element by element: row i, column j takes the scale of block (i // rows, j // cols)."""
    import torch

    rows, cols = weight.shape
    every = scales.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.to(torch.float32) * every


@pytest.mark.parametrize("tp", [1, 2])
def test_each_ranks_weights_and_scales_dequantize_to_its_slice_of_the_whole(tp):
    """Each rank's float8 slices and scales (partial blocks at the edges, a rank's share starting inside a block)
    dequantized in the graph's way equal the independent dequantization of the whole tensor, cut for the rank."""
    torch = pytest.importorskip("torch")
    from kiln.core.model import quant
    from kiln.core.model.contract import scale_grid as rank_grid
    from kiln.host.model import random_state_dict, shard_state_dict
    from kiln.host.model.layers.quantized import dequantize

    full = random_state_dict(MOE, seed=5)
    assert full["model.layers.2.mlp.experts.1.down_proj.weight"].dtype == torch.float8_e4m3fn
    checked = set()
    for rank in range(tp):
        mine = shard_state_dict(full, MOE, tp, rank)
        for name, sources in weight_layout(MOE, tp).items():
            if not quant.is_quantized(MOE.quant, name):
                continue
            assert mine[name].dtype == torch.float8_e4m3fn and mine[quant.scale_of(name)].dtype == torch.float32
            suffix = name.split(".", 3)[-1]
            got = dequantize(mine[name], mine[quant.scale_of(name)], rank_grid(MOE, tp, suffix), torch.float32)
            for i, src in enumerate(sources["sources"]):
                whole = _independent_dequantize(full[src["tensor"]], full[quant.scale_of(src["tensor"])],
                                                MOE.quant.block)
                cut = src["cut"]
                want = whole if cut is None else whole.narrow(cut["dim"], cut["offsets"][rank], cut["length"])
                assert torch.equal(got[i], want), (name, rank, src["tensor"])
                checked.add((name, cut is not None and any(o % 128 for o in cut["offsets"])))
    assert any(inside for _, inside in checked) == (tp > 1)  # a share that starts inside a block was among them


@pytest.mark.parametrize("experts, batch, tokens", [(4, 2, 5), (8, 1, 1)], ids=["every-expert", "gathered"])
def test_the_dequantized_model_computes_what_the_dense_one_does(experts, batch, tokens):
    """A quantized model's eager forward (tp 1, float32) is the same model with independently dequantized
    weights (to float32's rounding): the dequantize happens where each layer reads its weights. A decode step of few pairs
    against the experts (1 token, top 2 of 8) gathers the chosen experts' float8 bytes and scales and
    dequantizes only those."""
    torch = pytest.importorskip("torch")
    from kiln.core.model import quant
    from kiln.host.model import ShardedDecoder, example_inputs, random_state_dict, shard_state_dict, solo_group
    from kiln.host.model.layers import moe

    model_cfg = MOE.replace(num_experts=experts)
    assert (moe.GATHER_BELOW * batch * tokens * 2 <= experts) == (experts == 8)
    full = random_state_dict(model_cfg, seed=2)
    dense = {n: _independent_dequantize(t, full[quant.scale_of(n)], model_cfg.quant.block)
             if quant.is_quantized(model_cfg.quant, n) else t for n, t in full.items() if not quant.is_scale(n)}
    plain = model_cfg.replace(quant=None)
    args = example_inputs(model_cfg, 1, batch, tokens, page_tokens=4, pages_per_seq=2, num_pages=5)
    with solo_group(), torch.no_grad():
        outs = []
        for cfg, weights, scan in ((model_cfg, full, True), (model_cfg, full, False), (plain, dense, True)):
            model = ShardedDecoder(cfg, 1, scan=scan).eval()
            model.load_state_dict(shard_state_dict(weights, cfg, 1, 0))
            outs.append(model(*args))
    diffs = [max(float((o[i] - outs[2][i]).abs().max()) for i in (0, 1)) for o in outs[:2]]
    assert max(diffs) <= 1e-5, diffs  # float32's rounding: a batched multiply's kernel may sum in another order
    assert outs[0][0].abs().max() > 1


def test_a_checkpoint_is_read_per_rank_kept_in_float8(tmp_path):
    torch = pytest.importorskip("torch")
    from kiln.host.model import random_state_dict, shard_state_dict
    from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights, write_checkpoint

    cfg = MOE.replace(dtype="bfloat16")
    full = random_state_dict(cfg, seed=1)
    write_checkpoint(tmp_path / "ckpt", cfg, full, num_shards=2)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"] == PUBLISHED
    assert inspect_checkpoint(tmp_path / "ckpt") == cfg
    f32 = cfg.replace(dtype="float32")  # --dtype float32: the same bytes, computed in float32
    held = {}
    for c in (cfg, f32):
        got = load_rank_weights(tmp_path / "ckpt", c, 2, 1)
        want = shard_state_dict(full, c, 2, 1)
        assert got.keys() == want.keys()
        for name, t in got.items():
            assert t.dtype == getattr(torch, constant_dtype(c, name)) and torch.equal(t, want[name].to(t.dtype)), name
        held[c.dtype] = sum(t.numel() * t.element_size() for t in got.values())
        assert held[c.dtype] == weight_bytes_per_rank(c, 2)
    dense = sum(math.prod(w["shape"]) for w in weight_layout(cfg.replace(quant=None), 2).values()) * 2
    print(f"rank 1 of 2 holds {held} bytes quantized against {dense} bytes in bfloat16")
    assert held["bfloat16"] < 0.6 * dense


def _rewrite(path, edit) -> None:
    """Rewrite the single-file checkpoint at `path` with `edit(tensors)` applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize("case, words", [
    ("bf16 projection", "is BF16, but config.json's quantization_config says"),
    ("fp8 router", "is FP8 (F8_E4M3), but Kiln reads only a decoder layer's projections quantized"),
    ("bf16 scales", "weight_scale_inv is BF16; Kiln reads float32"),
    ("no config", "FP8 block scales"),
    ("no scales", "lacks"),
])
def test_a_checkpoint_whose_dtypes_are_not_its_configs_is_refused_naming_the_tensor(tmp_path, case, words):
    torch = pytest.importorskip("torch")
    from kiln.host.model import random_state_dict
    from kiln.host.weights.checkpoint import inspect_checkpoint, write_checkpoint

    cfg = MOE.replace(dtype="bfloat16", num_layers=1, moe_layers=(0,))
    path = write_checkpoint(tmp_path / case.replace(" ", "-"), cfg, random_state_dict(cfg, seed=1))
    q = "model.layers.0.self_attn.q_proj.weight"
    edits = {"bf16 projection": lambda t: t.update({q: t[q].to(torch.bfloat16)}),
             "fp8 router": lambda t: t.update({"model.layers.0.mlp.gate.weight":
                                               t["model.layers.0.mlp.gate.weight"].to(torch.float8_e4m3fn)}),
             "bf16 scales": lambda t: t.update({q + "_scale_inv": t[q + "_scale_inv"].to(torch.bfloat16)}),
             "no config": lambda t: None,
             "no scales": lambda t: [t.pop(n) for n in [n for n in t if n.endswith("_scale_inv")]]}
    _rewrite(path, edits[case])
    if case == "no config":
        raw = json.loads((path / "config.json").read_text())
        del raw["quantization_config"]
        (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(BadInput, match="tensor|holds|lacks") as err:
        inspect_checkpoint(path)
    assert words in str(err.value)
