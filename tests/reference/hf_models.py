"""Small random-init checkpoints written by transformers' own classes, and their reference outputs.

The reference is independent of Kiln: transformers' LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM,
Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM,
DeepseekV3ForCausalLM and GptOssForCausalLM, built from a config dict and saved
with `save_pretrained` (safetensors). Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]'")

CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
           "phi3": ("Phi3Config", "Phi3ForCausalLM"), "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
           "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
           "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
           "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
           "mistral4": ("Mistral4Config", "Mistral4ForCausalLM"),
           "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM"),
           "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
           "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
           # image-text checkpoints, whose text decoder Kiln exports
           "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration"),
           "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration"),
           "llava": ("LlavaConfig", "LlavaForConditionalGeneration"),
           "kimi_k25": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration"),
           "llama4": ("Llama4Config", "Llama4ForConditionalGeneration")}
TEXT_OF = {"gemma3": "gemma3_text", "mistral3": "mistral", "llava": "llama", "kimi_k25": "deepseek_v3",
           "llama4": "llama4_text"}
"""An image-text family -> the family of its text decoder (the ModelConfig Kiln reads)."""

BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
"""Small enough to compile in seconds; head_dim 32 (> 16, so rotary frequencies are not inlined). Weights
drawn wide enough (initializer_range) that greedy decoding does not repeat one token."""

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
"""A short original context, so the llama3 scaling changes low and medium frequencies at these head dims."""

DEEPSEEK = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=64,
                qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, moe_intermediate_size=32, n_routed_experts=16,
                n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
                routed_scaling_factor=2.5, norm_topk_prob=True)
"""DeepSeek-V3's shape, small: every size DeepseekV3Config would default to a full-size value is given."""

CASES = {
    # name: (family, config overrides, weight dtype)
    "llama": ("llama", {}, "float32"),
    "llama-hd64": ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2), "float32"),
    "llama-hd128": ("llama", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                                  intermediate_size=512), "float32"),
    "llama-bf16": ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2), "bfloat16"),
    "llama3-rope": ("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0), "float32"),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), "float32"),
    "llama-tied": ("llama", dict(tie_word_embeddings=True), "float32"),
    "llama-theta": ("llama", dict(rope_theta=50.0), "float32"),
    # yarn over a short original context (16), so these head dims span extrapolated, ramped and interpolated
    # frequencies: Qwen2.5's spelling (factor 4, the attention factor from it), and DeepSeek's mscale pair with
    # its own betas, untruncated.
    "qwen2-yarn": ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16}), "float32"),
    "llama-yarn-mscale": ("llama", dict(hidden_size=256, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.707,
        "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False}), "float32"),
    "llama-attention-bias": ("llama", dict(attention_bias=True), "float32"),
    "llama-mlp-bias": ("llama", dict(mlp_bias=True), "float32"),
    "llama32-like": ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
                     "float32"),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True), "float32"),
    # llama32-like with both biases (llama32-deep-biases below runs them end to end).
    "llama32-biases": ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0,
                                     attention_bias=True, mlp_bias=True), "float32"),
    "llama-realistic-bf16": ("llama", dict(vocab_size=32000, hidden_size=512, num_attention_heads=4,
                                           num_key_value_heads=2, intermediate_size=1024, num_hidden_layers=4,
                                           initializer_range=0.05), "bfloat16"),
    # Llama 3.2's shape and biases at depth: the export test's one Llama compile shows both points.
    "llama32-deep-biases": ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                          num_hidden_layers=24, initializer_range=0.08, tie_word_embeddings=True,
                                          rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, attention_bias=True,
                                          mlp_bias=True), "float32"),
    "mistral-window": ("mistral", dict(sliding_window=6), "float32"),
    "qwen2": ("qwen2", {}, "float32"),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1), "float32"),
    # Both, as the tp 2 export test runs Qwen2 (Qwen2.5's long-context yarn, one compile for both points).
    "qwen2-window-yarn": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 16}), "float32"),
    # Qwen3: 4 heads of 64 over a hidden size of 128 (heads x head_dim != hidden, as in Qwen3's own sizes).
    "qwen3": ("qwen3", dict(head_dim=64, num_hidden_layers=3), "float32"),
    "qwen3-bias-window": ("qwen3", dict(head_dim=64, attention_bias=True, use_sliding_window=True, sliding_window=5,
                                        max_window_layers=1), "float32"),
    "qwen3-bf16": ("qwen3", dict(hidden_size=256, head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=4, vocab_size=32000, initializer_range=0.05), "bfloat16"),
    # Mixtral: 8 experts, top 2, head_dim 64; with Mistral's sliding window.
    "mixtral": ("mixtral", dict(hidden_size=256, num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2,
                                intermediate_size=128), "float32"),
    "mixtral-window": ("mixtral", dict(hidden_size=256, num_local_experts=4, num_experts_per_tok=2, intermediate_size=128,
                                       sliding_window=5), "float32"),
    "mixtral-bf16": ("mixtral", dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                                     num_local_experts=8, num_experts_per_tok=2, intermediate_size=256,
                                     vocab_size=32000, initializer_range=0.05), "bfloat16"),
    # Qwen3-MoE: Qwen3's attention (q/k norms, head_dim 64); layer 1 dense (mlp_only_layers), the others 64 experts
    # of width 32, top 2 renormalised: a 1x8 step gathers its 16 chosen experts, 20 tokens run every expert.
    "qwen3-moe": ("qwen3_moe", dict(head_dim=64, num_hidden_layers=4, num_experts=64, num_experts_per_tok=2,
                                    moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True), "float32"),
    # Every other layer sparse (decoder_sparse_step 2), the top-k weights not renormalised (the default).
    "qwen3-moe-step": ("qwen3_moe", dict(head_dim=64, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=64, decoder_sparse_step=2), "float32"),
    # Qwen2-MoE: Qwen2's q/k/v biases; 8 experts of width 64, top 2 not renormalised, and a shared expert of
    # width 96 behind its sigmoid gate on the expert layers; layer 1 dense.
    "qwen2-moe": ("qwen2_moe", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                    shared_expert_intermediate_size=96, mlp_only_layers=[1]), "float32"),
    # The same with Qwen2's window and yarn (qwen2-window-yarn's): its one export end to end shows both. layer_types
    # as Qwen2 lays them out (full, then sliding from max_window_layers), which Qwen2MoeConfig would otherwise
    # derive its own way (every other layer below max_window_layers).
    "qwen2-moe-window-yarn": ("qwen2_moe", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, mlp_only_layers=[1], use_sliding_window=True, sliding_window=5,
        max_window_layers=1, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}), "float32"),
    # Gemma 2: head_dim 32 with query_pre_attn_scalar 24 (the scale is not head_dim's), sliding and full layers
    # interleaved (window 6), soft caps low enough that these small weights reach them.
    "gemma2": ("gemma2", dict(head_dim=32, num_hidden_layers=4, sliding_window=6, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0), "float32"),
    # Gemma 2's own defaults (caps 50 and 30, query_pre_attn_scalar 256) at a real shape, in bfloat16.
    "gemma2-bf16": ("gemma2", dict(hidden_size=256, head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=4, vocab_size=32000, sliding_window=6, initializer_range=0.05),
                    "bfloat16"),
    # Gemma 3 at a real shape in bfloat16: head_dim 128, vocabulary 32000, a full layer every sixth (layer 5 of 6).
    "gemma3-bf16": ("gemma3_text", dict(hidden_size=256, head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                                        num_hidden_layers=6, vocab_size=32000, sliding_window=6,
                                        initializer_range=0.05), "bfloat16"),
    # Gemma 3: q/k norms, full layers rotating at theta 1e6 scaled linearly by 8 (as Gemma 3 4B), sliding ones at
    # their own 1e4, unscaled; layer 2 full among sliding layers of window 5.
    "gemma3": ("gemma3_text", dict(head_dim=32, num_hidden_layers=4, sliding_window=5,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                "sliding_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1000000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10000.0}}), "float32"),
    # Phi-3: fused qkv_proj and gate_up_proj; head_dim 64 of which the leading 48 rotate (partial_rotary_factor
    # 0.75, as Phi-4-mini's), a sliding window of 6 on every layer.
    # (Phi3Config's token ids default to 32000; none here, within this vocabulary.)
    "phi3": ("phi3", dict(hidden_size=256, num_hidden_layers=3, partial_rotary_factor=0.75, sliding_window=6,
                          pad_token_id=None, eos_token_id=None, bos_token_id=None), "float32"),
    # Phi-3.5 / Phi-4-mini's longrope over an original context of 14 (factor 4: attention factor sqrt(1.5)), the
    # leading 48 of 64 dims rotating, phi3's window of 6: the end-to-end test's 12-token prompt decodes across the
    # switch from the short to the long factors.
    "phi3-longrope": ("phi3", dict(hidden_size=256, num_hidden_layers=3, partial_rotary_factor=0.75, sliding_window=6,
                                   max_position_embeddings=56, original_max_position_embeddings=14,
                                   rope_scaling={"rope_type": "longrope",
                                                 "short_factor": [1.0 + 0.05 * i for i in range(24)],
                                                 "long_factor": [1.0 + 0.6 * i for i in range(24)]},
                                   pad_token_id=None, eos_token_id=None, bos_token_id=None), "float32"),
    # The dynamic (NTK) rope past max_position_embeddings 16: the base grows with the sequence's length.
    "llama-dynamic": ("llama", dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
                      "float32"),
    # Phi-3 at a real shape in bfloat16: head_dim 128, Phi-3's vocabulary of 32064, no window (Phi-3-mini's rope).
    "phi3-bf16": ("phi3", dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                               vocab_size=32064, intermediate_size=1024, initializer_range=0.05), "bfloat16"),
    # DeepSeek-V3: latent attention (q through a rank-48 bottleneck, a latent of 64, heads of 64 + 32 rotating dims,
    # values of 64, interleaved rotary pairs), layer 0 dense, then 16 experts in 4 groups: top 3 within the best
    # 2 groups by sigmoid scores corrected per expert, scaled by 2.5, plus a shared expert; biases on q_a, kv_a, o.
    "deepseek-v3": ("deepseek_v3", dict(DEEPSEEK, attention_bias=True), "float32"),
    # No q bottleneck (q_lora_rank null, as DeepSeek-V2-Lite), yarn with DeepSeek's mscale pair: the attention's
    # scale grows by mscale(factor, mscale_all_dim) squared; the rotary pairs as halves (rope_interleave false).
    "deepseek-v3-yarn": ("deepseek_v3", dict(DEEPSEEK, q_lora_rank=None, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}), "float32"),
    # At a real shape in bfloat16: heads of 128 + 64 rotating dims, values of 128, a latent of 128, vocabulary 32000.
    "deepseek-v3-bf16": ("deepseek_v3", dict(DEEPSEEK, hidden_size=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                             v_head_dim=128, kv_lora_rank=128, q_lora_rank=96, vocab_size=32000,
                                             initializer_range=0.05), "bfloat16"),
    # gpt-oss: heads of 64 with a sink each (drawn N(0, 1)), biases on q/k/v/o; sliding (window 6) and full layers
    # alternating; 8 experts of width 64, top 2, a clamp of 1 that these weights reach; yarn over an original
    # context of 16, untruncated (GptOssConfig's kind of rope, scaled down).
    "gpt-oss": ("gpt_oss", dict(num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                                sliding_window=6, swiglu_limit=1.0, rope_parameters={
                                    "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 16,
                                    "rope_theta": 150000.0}), "float32"),
    # MiniMax-M2: q and k each normalised over all heads before the split, the leading 16 of 32 dims rotating
    # (the published rotary_dim), 8 experts (w1/w3/w2) top 2 by corrected sigmoid scores on every layer.
    "minimax-m2": ("minimax_m2", dict(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2,
                                      intermediate_size=64, head_dim=32, rotary_dim=16), "float32"),
    # At a real shape in bfloat16: heads of 128 (64 rotating, as MiniMax-M2's), vocabulary 32000, 16 experts top 4.
    "minimax-m2-bf16": ("minimax_m2", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=128, rotary_dim=64, num_hidden_layers=3, vocab_size=32000,
                                           num_local_experts=16, num_experts_per_tok=4, intermediate_size=128,
                                           initializer_range=0.05), "bfloat16"),
    # Mistral 4: DeepSeek-V3's latent attention and shape, its experts fused 3-D tensors routed by a softmax within
    # the best 2 of 4 groups (scaled by 2.5), yarn over an original context of 8 (factor 4, mscale_all_dim 1) and
    # llama_4_scaling_beta 0.5: queries past position 8 and 16 grow (the 20-token prompt crosses both).
    "mistral4": ("mistral4", dict(DEEPSEEK, n_shared_experts=1, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
        "llama_4_scaling_beta": 0.5, "partial_rotary_factor": 32 / 96}), "float32"),
    # At a real shape in bfloat16: heads of 128 + 64 rotating dims, values of 128, vocabulary 32000; its router's
    # softmax in bfloat16, as Mistral4TopkRouter takes it.
    "mistral4-bf16": ("mistral4", dict(DEEPSEEK, hidden_size=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                       v_head_dim=128, kv_lora_rank=128, q_lora_rank=96, vocab_size=32000,
                                       initializer_range=0.05, rope_parameters={
                                           "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5}),
                      "bfloat16"),
    # Llama 4: layers 0, 1 and 3 rotate (pairs of dims, then q and k normed without a weight) within chunks of 8
    # positions; layer 2 has no rope and attends to everything, its queries scaled by the attention temperature
    # (floor_scale 4: past position 3 it grows); layers 1 and 3 are 8 experts (fused, input-major) of which the
    # top 2 by logit each take the token scaled by its sigmoid, beside a shared expert; llama3's rope.
    "llama4": ("llama4_text", dict(num_hidden_layers=4, head_dim=32, intermediate_size=64, intermediate_size_mlp=256,
                                   num_local_experts=8, num_experts_per_tok=2, interleave_moe_layer_step=2,
                                   no_rope_layer_interval=3, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
                                   rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0}), "float32"),
    # At a real shape in bfloat16 (Llama 4 Scout's kind): heads of 128, vocabulary 32000, 16 experts top 1 on every
    # layer, the fourth layer without rope.
    "llama4-bf16": ("llama4_text", dict(hidden_size=256, head_dim=128, num_hidden_layers=4, vocab_size=32000,
                                        intermediate_size=128, intermediate_size_mlp=256, num_local_experts=16,
                                        num_experts_per_tok=1, attention_chunk_size=8, floor_scale=4, attn_scale=0.1,
                                        initializer_range=0.05), "bfloat16"),
    # DeepSeek sparse attention: DeepSeek-V3's shape, each query attending to the 4 tokens (of up to 20) its lightning
    # indexer (8 heads of 48, the leading 32 dims rotated in halves; GLM-5's in interleaved pairs) scores best;
    # DeepSeek-V3.2 with attention_bias (q_a, kv_a and o), as the "deepseek-v3" case.
    "deepseek-v32": ("deepseek_v32", dict(DEEPSEEK, attention_bias=True, index_topk=4, index_head_dim=48,
                                          index_n_heads=8), "float32"),
    "glm5": ("glm_moe_dsa", dict(DEEPSEEK, index_topk=4, index_head_dim=48, index_n_heads=8), "float32"),
    # At a real shape in bfloat16: heads of 128 + 64 rotating dims, the indexer's 16 heads of 128 keeping 8 tokens.
    "deepseek-v32-bf16": ("deepseek_v32", dict(DEEPSEEK, hidden_size=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                               v_head_dim=128, kv_lora_rank=128, q_lora_rank=96, vocab_size=32000,
                                               index_topk=8, index_head_dim=128, index_n_heads=16,
                                               initializer_range=0.05), "bfloat16"),
    # Image-text checkpoints (save_pretrained's layout: language_model.model.*, vision_tower.*,
    # multi_modal_projector.*), each a small vision tower beside a text decoder Kiln computes (Llama 4's below): Gemma 3's (the
    # "gemma3" case's text model; the head tied, Gemma3Config's default), Mistral 3's (a window of 6, the head
    # untied), LLaVA's (Llama's, untied by default) and Kimi K2.5's (DeepSeek-V3's, text_config's model_type kimi_k2).
    "gemma3-image-text": ("gemma3", dict(text_config=("gemma3", {}), vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
        mm_tokens_per_image=4), "float32"),
    "mistral3-image-text": ("mistral3", dict(text_config=("mistral-window", {"model_type": "mistral"}),
                                             tie_word_embeddings=False, vision_config=dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8, head_dim=16)), "float32"),
    "llava-image-text": ("llava", dict(text_config=("llama3-rope", {"model_type": "llama"}), vision_config=dict(
        model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)), "float32"),
    "kimi-k25-image-text": ("kimi_k25", dict(text_config=("deepseek-v3", {"model_type": "kimi_k2"}),
                                             tie_word_embeddings=False, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=8,
        pos_emb_height=8, pos_emb_width=8)), "float32"),
    # Llama 4's (the "llama4" case's text model, untied as Llama4Config is by default) beside its vision model.
    "llama4-image-text": ("llama4", dict(text_config=("llama4", {"model_type": "llama4_text"}), vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8,
        vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)), "float32"),
    # At a real shape in bfloat16: hidden 256, heads of 64, vocabulary 32000, 16 experts top 4, GptOssConfig's own
    # rope and clamp.
    "gpt-oss-bf16": ("gpt_oss", dict(hidden_size=256, num_hidden_layers=4, vocab_size=32000, num_local_experts=16,
                                     num_experts_per_tok=4, intermediate_size=128, sliding_window=6,
                                     initializer_range=0.05), "bfloat16"),
}
"""name -> (family, config overrides, weight dtype)."""


def hf_config(family: str, overrides: dict, dtype: str):
    """The transformers config of a case; an image-text family's text_config is (a text case, its overrides)."""
    import torch
    cls = getattr(transformers, CLASSES[family][0])
    if family in TEXT_OF:
        case, more = overrides["text_config"]
        text = {**BASE, **CASES[case][1], **more, "dtype": dtype}
        cfg = cls(**{**overrides, "text_config": text})
    else:
        cfg = cls(**{**BASE, **overrides})
    cfg.dtype = getattr(torch, dtype)
    return cfg


def hf_model(family: str, config, seed: int = 0):
    """A random-init transformers model; biases (DeepSeek's routing correction too) and norms randomised,
    so they matter in every output."""
    import torch
    from bench.hf_checkpoints import randomise

    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[family][1])(config).eval()
    randomise(model)
    return model


def write_case(name: str, root: Path, seed: int = 0) -> Path:
    """Write case `name` with save_pretrained under root/name; returns the directory."""
    import torch
    family, overrides, dtype = CASES[name]
    path = root / name
    if (path / "config.json").exists():
        return path
    model = hf_model(family, hf_config(family, overrides, dtype), seed)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    if family in PUBLISHED_NAMES:
        from safetensors.torch import load_file, save_file
        old, new = PUBLISHED_NAMES[family]
        for file in path.glob("*.safetensors"):
            save_file({k.replace(old, new): v for k, v in load_file(file).items()}, str(file),
                      metadata={"format": "pt"})
    return path


PUBLISHED_NAMES = {"kimi_k25": ("language_model.model.blocks.", "language_model.model.layers.")}
"""family -> (a name part transformers' save_pretrained writes, the published checkpoints' spelling): transformers
5.25 saves Kimi K2.5's decoder layers as `blocks` (its vision tower's rename of blocks to layers, reversed over
every name), which it reads back either way; Kimi-K2.5 as published names them `layers`."""


def reference_generate(path: Path, prompt: list[int], max_new_tokens: int, dtype: str = "float32",
                       **loading) -> dict:
    """transformers' greedy decode of `prompt` from the checkpoint at `path`, loaded in `dtype` (`loading`:
    from_pretrained's other arguments, e.g. a quantization_config).

    Returns {'generated': ids, 'logits': [last position's logits per step]} (float lists).
    """
    import torch
    family = json.loads((path / "config.json").read_text())["model_type"]
    cls = getattr(transformers, CLASSES[family][1])
    model = cls.from_pretrained(path, dtype=getattr(torch, dtype), **loading).eval()
    # Plain greedy decoding of exactly max_new_tokens: no end-of-sequence stop, no processor that bans it.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return {"generated": out.sequences[0, len(prompt):].tolist(),
            "logits": [step[0].float().tolist() for step in out.logits]}


def export_then_run(kiln, path: Path, tmp_path: Path, export_id: str, prefect_server: str, prompt: list[int],
                    new_tokens: int) -> tuple[dict, dict]:
    """`kiln export --tp 2 --dtype float32 --buckets 1x4,1x8` of the checkpoint at `path` into a store under
    tmp_path, then `kiln run` of `prompt`: (the export's report, the run's JSON)."""
    store = f"file://{tmp_path / 'store'}"
    env = {"PREFECT_API_URL": prefect_server}
    exported = kiln("export", "--model", str(path), "--tp", "2", "--dtype", "float32", "--buckets", "1x4,1x8",
                    "--store", store, "--export-id", export_id, "--report", str(tmp_path / "report.json"), env=env)
    assert exported.code == 0, exported.err[-3000:]
    ran = kiln("run", export_id, "--store", store, "--tokens", ",".join(map(str, prompt)),
               "--max-new-tokens", str(new_tokens), "--json", str(tmp_path / "run.json"), env=env)
    assert ran.code == 0, ran.err[-3000:]
    return json.loads((tmp_path / "report.json").read_text()), json.loads((tmp_path / "run.json").read_text())


def generates_as_transformers(got: dict, path: Path, prompt: list[int], new_tokens: int, **loading) -> float:
    """Assert `kiln run`'s JSON `got` generated transformers' greedy ids (reference_generate of the checkpoint at
    `path`, `loading` e.g. its dequantizing quantization_config), not a degenerate repetition; return the largest
    logit difference over the steps."""
    want = reference_generate(path, prompt, new_tokens, **loading)
    assert got["generated"] == want["generated"] and len(set(want["generated"])) > 1
    return max(abs(x - y) for a, b in zip(got["logits"], want["logits"]) for x, y in zip(a, b))
