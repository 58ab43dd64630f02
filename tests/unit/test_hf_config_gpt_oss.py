"""gpt-oss's config.json, read as transformers' GptOssConfig reads it, and its layout's cuts."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput
from kiln.core.model.contract import parameter_shapes, shard_slice
from kiln.core.model.hf_config import from_hf, to_hf
from kiln.core.model.shares import rank_share

SMALL = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 512, "hidden_size": 128,
         "intermediate_size": 100, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 6, "swiglu_limit": 1.0,
         "hidden_act": "silu", "router_aux_loss_coef": 0.9, "output_router_logits": False}


def test_gpt_oss_reads_as_gptossconfig():
    """Field by field against transformers' own GptOssConfig: a small one as save_pretrained writes it, the
    defaults of a file that leaves every field out (gpt-oss's own sizes, its yarn), and to_hf's file read
    back by GptOssConfig."""
    transformers = pytest.importorskip("transformers")
    sizes = {k: v for k, v in SMALL.items() if k not in ("model_type", "architectures")}
    hf = transformers.GptOssConfig(**sizes)
    cfg = from_hf(hf.to_diff_dict())
    assert cfg == from_hf(SMALL)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias, cfg.o_bias, cfg.attention_sinks) == \
        (8, 2, 64, True, True, True)
    assert [cfg.window_of(i) for i in range(4)] == [6, None, 6, None]  # sliding first, then alternating
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.moe_layers) == (8, 2, 100,
                                                                                                 (0, 1, 2, 3))
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.rope_type, cfg.rope_theta, cfg.rope_truncate) == \
        (1.0, 1.702, "yarn", 150000.0, False)
    assert (cfg.rope_factor, cfg.rope_original_max_position) == (32.0, 4096)
    full = from_hf({"model_type": "gpt_oss"})
    assert full == from_hf(transformers.GptOssConfig().to_diff_dict())
    assert (full.vocab_size, full.hidden_size, full.num_layers, full.num_heads, full.num_kv_heads, full.num_experts,
            full.experts_per_token, full.sliding_window) == (201088, 2880, 36, 64, 8, 128, 4, 128)
    for c in (cfg, full):
        assert from_hf(transformers.GptOssConfig(**to_hf(c)).to_diff_dict()) == c


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"swiglu_limit": "7"}, "swiglu_limit"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "bitsandbytes"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_gpt_oss_values_outside_what_kiln_computes_are_refused_by_name(change, words):
    with pytest.raises(BadInput, match=words):
        from_hf({**SMALL, **change})


MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"]}


def test_mxfp4_is_read_for_gpt_oss_and_refused_elsewhere():
    """gpt-oss's published quantization_config: its experts MXFP4, nothing else; the same in another family, a
    list that leaves the experts unconverted, a field mxfp4 does not have, or sizes not in groups of 32 are
    refused by name."""
    cfg = from_hf({**SMALL, "intermediate_size": 96, "quantization_config": MXFP4})
    assert (cfg.quant.method, cfg.quant.block) == ("mxfp4", (1, 32))
    assert from_hf(to_hf(cfg)) == cfg
    shapes = parameter_shapes(cfg)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj_blocks"] == (8, 192, 4, 16)
    assert shapes["model.layers.0.mlp.experts.down_proj_scales"] == (8, 128, 3)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in shapes
    llama = {k: v for k, v in SMALL.items() if k not in ("num_local_experts", "num_experts_per_tok", "sliding_window",
                                                          "swiglu_limit", "router_aux_loss_coef",
                                                          "output_router_logits")}
    with pytest.raises(BadInput, match="gpt-oss's format"):
        from_hf({**llama, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "quantization_config": MXFP4})
    with pytest.raises(BadInput, match="model.layers.*.mlp.experts"):
        from_hf({**SMALL, "quantization_config": {**MXFP4, "modules_to_not_convert": ["model.layers.*.mlp.experts"]}})
    with pytest.raises(BadInput, match="group_size"):
        from_hf({**SMALL, "quantization_config": {**MXFP4, "group_size": 64}})
    with pytest.raises(BadInput, match="multiples of 32"):
        from_hf({**SMALL, "quantization_config": MXFP4})  # intermediate 100


def test_a_ranks_cut_of_the_interleaved_experts_holds_its_own_gate_and_up_columns():
    """gate_up_proj interleaves gate and up columns, so a rank's span [s, e) of each is the contiguous columns
    [2s, 2e); the down projection's rows [s, e); its bias and the router whole; the sinks follow the heads."""
    cfg = from_hf(SMALL)
    shapes = parameter_shapes(cfg)
    p = "model.layers.0"
    assert shapes[f"{p}.mlp.experts.gate_up_proj"] == (8, 128, 200)
    assert shapes[f"{p}.self_attn.sinks"] == (8,)
    cuts = [{n: shard_slice(f"{p}.{n}", cfg, 3, r) for n in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                                                           "mlp.experts.down_proj", "mlp.experts.down_proj_bias",
                                                           "mlp.router.weight", "mlp.router.bias", "self_attn.sinks")}
            for r in range(3)]
    spans = [rank_share(cfg, 3, r) for r in range(3)]
    assert [s.experts for s in spans] == [(0, 34), (34, 67), (67, 100)]
    for cut, share in zip(cuts, spans):
        s, e = share.experts
        assert cut["mlp.experts.gate_up_proj"] == (2, 2 * s, 2 * e)
        assert cut["mlp.experts.gate_up_proj_bias"] == (1, 2 * s, 2 * e)
        assert cut["mlp.experts.down_proj"] == (1, s, e)
        assert cut["self_attn.sinks"] == (0, *share.heads)
        assert cut["mlp.experts.down_proj_bias"] is cut["mlp.router.weight"] is cut["mlp.router.bias"] is None
