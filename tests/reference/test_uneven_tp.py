"""Any tp: ranks whose shares differ (kiln.core.model.shares) compute, together, what transformers computes.

Each case is a transformers-written checkpoint at a tp that does not divide its heads or its intermediate
sizes; one gloo process per rank holds its own shard (read by Kiln's loader) and sums after attention and the
MLP, as the compiled forwards do. The ranks prefill a prompt through the paged cache, then decode tokens one
at a time from it; rank 0's logits are held to transformers' on the whole sequence (float32: ids equal,
logits within 1e-3). Eager, no compile: the shapes are what the rank's package would bind.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import CLASSES, DEEPSEEK, hf_config, hf_model, transformers

from kiln.core.model.cache_layout import cache_layout
from kiln.core.model.shares import rank_share
from kiln.host.model import decoder_of
from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights

PAGE = 8
PROMPT, DECODED = 13, 4

CASES = {
    # GQA, KV heads split 2, 1, 1 (whole groups of 2 query heads); MLP columns 334, 333, 333.
    "llama-tp3": ("llama", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                intermediate_size=1000, num_hidden_layers=3), 3),
    # Fewer KV heads than ranks: query heads 3, 3, 2; rank 1's straddle both KV heads (runs of 1 and 2).
    "qwen3-tp3-straddle": ("qwen3", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                         intermediate_size=512, num_hidden_layers=2), 3),
    # Experts' columns 34, 33, 33 of 100; KV heads 2, 1, 1.
    "qwen3-moe-tp3": ("qwen3_moe", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                        num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=100), 3),
    # Latent attention: query heads 2, 1, 1; the dense layer's MLP and the experts' columns uneven too.
    "deepseek-v3-tp3": ("deepseek_v3", dict(DEEPSEEK, intermediate_size=250, moe_intermediate_size=40), 3),
    # Phi-3's fused q/k/v and gate/up: each rank's rows of its share cut from the fused tensors; partial rotary.
    "phi3-tp3": ("phi3", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2,
                              intermediate_size=500, partial_rotary_factor=0.75, sliding_window=6,
                              pad_token_id=None, eos_token_id=None, bos_token_id=None), 3),
    # Gemma 3: (1 + weight) norms around attention and MLP, q/k norms, GeGLU, sliding and full layers.
    "gemma3-tp3": ("gemma3_text", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                       intermediate_size=400, num_hidden_layers=3, sliding_window=5,
                                       layer_types=["sliding_attention", "full_attention", "sliding_attention"]), 3),
    # Mixtral's experts (block_sparse_moe) 34, 33, 33 columns; Qwen2-MoE's shared expert behind its gate too.
    "mixtral-tp3": ("mixtral", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                                    num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                                    intermediate_size=100), 3),
    "qwen2-moe-tp3": ("qwen2_moe", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                                        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=100, shared_expert_intermediate_size=152,
                                        intermediate_size=250, mlp_only_layers=[1]), 3),
    # tp 5: KV heads 1 each of 5, query heads 2 each; MLP columns 205, 205, 205, 205, 204.
    "llama-tp5": ("llama", dict(hidden_size=320, num_attention_heads=10, num_key_value_heads=5, head_dim=32,
                                intermediate_size=1024, num_hidden_layers=2), 5),
    # gpt-oss: query heads 3, 3, 2 over 2 KV heads (rank 1's straddle, their sinks cut in runs); each expert's
    # interleaved gate/up columns 68, 66, 66 of 200 and its biases; sliding and full layers alternating.
    "gpt-oss-tp3-straddle": ("gpt_oss", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                                             num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2,
                                             intermediate_size=100, sliding_window=6, swiglu_limit=1.0), 3),
    # MiniMax-M2: KV heads 2, 1 of 3 (query heads 4, 2), so each rank's share of q_norm's and k_norm's sums of
    # squares differs; experts' columns 34, 33, 33 of 100 at tp 3 would need 3 KV heads each: tp 2 here.
    "minimax-m2-tp2": ("minimax_m2", dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=3, head_dim=32,
                                          rotary_dim=16, num_hidden_layers=2, num_local_experts=8,
                                          num_experts_per_tok=2, intermediate_size=100), 2),
    # Mistral 4: latent attention's query heads 2, 1, 1; its fused 3-D experts' columns 14, 13, 13 of 40 (gate and
    # up rows cut from one tensor, down columns from another); queries scaled past position 8.
    "mistral4-tp3": ("mistral4", dict(DEEPSEEK, moe_intermediate_size=40, intermediate_size=250, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5}), 3),
    # Llama 4: KV heads 2, 1, 1; its input-major fused experts' columns 34, 33, 33 of 100 (gate and up columns cut from
    # one tensor, down rows from another), the dense layers' 84, 83, 83 of 250; chunks of 8, layer 2 without rope.
    "llama4-tp3": ("llama4_text", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                       num_hidden_layers=4, intermediate_size=100, intermediate_size_mlp=250,
                                       num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                       no_rope_layer_interval=3, attention_chunk_size=8, floor_scale=4,
                                       attn_scale=0.5), 3),
    # DeepSeek-V3.2: latent attention's query heads 2, 1, 1; every rank runs the whole lightning indexer (8 heads of
    # 48) and attends to the 4 tokens it picks, over the prefill and each decoded token.
    "deepseek-v32-tp3": ("deepseek_v32", dict(DEEPSEEK, moe_intermediate_size=40, intermediate_size=250, index_topk=4,
                                              index_head_dim=48, index_n_heads=8), 3),
}
"""name -> (family, transformers config overrides of hf_models.BASE, tp)."""


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")

    def write(name: str):
        family, overrides, _ = CASES[name]
        path = root / name
        if not (path / "config.json").exists():
            hf_model(family, hf_config(family, overrides, "float32")).save_pretrained(path)
        return path
    return write


def _tokens(vocab: int) -> list[int]:
    return torch.randint(0, vocab, (PROMPT + DECODED,), generator=torch.Generator().manual_seed(3)).tolist()


def _rank_logits(cfg, tp: int, rank: int, path, tokens: list[int]) -> torch.Tensor:
    """[PROMPT + DECODED, vocab]: the rank's view of the logits, the prompt in one step, then a token a step."""
    dtype = getattr(torch, cfg.dtype)
    model = decoder_of(cfg, tp, scan=False, rank=rank).to(dtype).eval()
    model.load_state_dict(load_rank_weights(path, cfg, tp, rank), strict=True)
    pages = -(-len(tokens) // PAGE)
    cache = torch.zeros(cache_layout(cfg, tp, rank=rank).shape(cfg.num_layers, pages, PAGE), dtype=dtype)
    table, rows = torch.arange(pages)[None], []

    def step(ids: list[int], start: int) -> None:
        logits, new = model(torch.tensor([ids]), torch.tensor([start]), cache, table)[:2]
        for i in range(len(ids)):  # new [layers, entries, 1, t, heads, width] into the pages
            cache[:, :, (start + i) // PAGE, (start + i) % PAGE] = new[:, :, 0, i]
        rows.extend(logits[0])

    with torch.no_grad():
        step(tokens[:PROMPT], 0)
        for i in range(PROMPT, len(tokens)):
            step(tokens[i:i + 1], i)
    return torch.stack(rows).float()


def _rank_main(rank: int, tp: int, path: str, init: str, out: str, tokens: list[int]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    try:
        torch.set_num_threads(1)
        cfg = inspect_checkpoint(path)
        rows = _rank_logits(cfg, tp, rank, path, tokens)
        if rank == 0:
            torch.save(rows, out)
        dist.barrier()  # no rank leaves the group while another still talks in it (gloo aborts)
    finally:
        dist.destroy_process_group()


def _ranks(main, tp: int, path, tokens: list[int], tmp_path) -> torch.Tensor:
    """Rank 0's logits of `main` run by `tp` spawned processes in one gloo group."""
    import torch.multiprocessing as mp

    out = tmp_path / "logits.pt"
    mp.start_processes(main, args=(tp, str(path), f"file://{tmp_path / 'rendezvous'}", str(out), tokens), nprocs=tp,
                       start_method="spawn")
    return torch.load(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_of_unequal_shares_compute_what_transformers_computes(case, written, tmp_path):
    family, _, tp = CASES[case]
    path = written(case)
    cfg = inspect_checkpoint(path)
    counts = [rank_share(cfg, tp, r).counts() for r in range(tp)]
    assert len({repr(c) for c in counts}) > 1, f"{case} splits evenly at tp {tp}: {counts}"
    tokens = _tokens(cfg.vocab_size)
    kiln = _ranks(_rank_main, tp, path, tokens, tmp_path)
    reference = getattr(transformers, CLASSES[family][1]).from_pretrained(path).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0].float()
    diff = float((kiln - expected).abs().max())
    print(f"{case} at tp {tp} ({counts}): max |logit diff| {diff:.2e}")
    assert torch.equal(kiln.argmax(-1), expected.argmax(-1))
    assert diff <= 1e-3


def test_a_realistic_bfloat16_model_at_tp_3_stays_within_transformers_own_bfloat16_error(tmp_path):
    """Llama proportions at a real width in bfloat16 (hidden 1024, 16 query and 4 KV heads of 64, MLP 2816, 4
    layers, vocabulary 32000): KV heads 2, 1, 1 and MLP columns 939, 939, 938. Against transformers' float32
    model on the same bfloat16 weights, Kiln's three ranks stay within twice transformers' own bfloat16 error."""
    overrides = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                     intermediate_size=2816, num_hidden_layers=4, vocab_size=32000, initializer_range=0.05)
    path = tmp_path / "llama-bf16"
    hf_model("llama", hf_config("llama", overrides, "bfloat16")).to(torch.bfloat16).save_pretrained(path)
    cfg = inspect_checkpoint(path)
    assert cfg.dtype == "bfloat16" and rank_share(cfg, 3, 0).counts() != rank_share(cfg, 3, 2).counts()
    tokens = _tokens(cfg.vocab_size)
    kiln = _ranks(_rank_main, 3, path, tokens, tmp_path)
    with torch.no_grad():
        exact, theirs = (transformers.LlamaForCausalLM.from_pretrained(path, dtype=d).eval()(
            torch.tensor([tokens])).logits[0].float() for d in (torch.float32, torch.bfloat16))
    ours, own = float((kiln - exact).abs().max()), float((theirs - exact).abs().max())
    print(f"bfloat16 at tp 3: Kiln vs float32 {ours:.3f}; transformers bfloat16 vs float32 {own:.3f}")
    assert ours <= 2 * own and torch.equal(kiln[0].argmax(), exact[0].argmax())


V4_TP3 = {"num_attention_heads": 8, "o_groups": 4, "moe_intermediate_size": 56}
"""bench.hf_checkpoints.V4_SMALL with 8 heads in 4 output groups: groups 2, 1, 1 at tp 3 (heads 4, 2, 2, sinks
with them); the experts' and the shared expert's columns 19, 19, 18 (56: transformers' grouped experts want
rows of whole 16 bytes)."""
FLASH_TP3 = {"num_attention_heads": 8, "o_groups": 4, "head_dim": 128, "o_lora_rank": 128, "moe_intermediate_size": 512}
"""The incident's layout, small: DeepSeek-V4-Flash's FP8 attention (blocks of 128 rows: a head of 128 each) and
FP8 shared expert (columns in whole blocks at tp 3: 256, 128, 128), FP4 routed experts (whole 32-input scale
groups: 192, 160, 160), 8 heads in 4 output groups (4, 2, 2 heads)."""


def _v4_rank_main(rank: int, tp: int, path: str, init: str, out: str, tokens: list[int]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    try:
        torch.set_num_threads(1)
        cfg = inspect_checkpoint(path).replace(dtype="float32")  # V4-Flash's bfloat16 computed in float32
        model = decoder_of(cfg, tp, scan=False, rank=rank).to(torch.float32).eval()
        model.load_state_dict(load_rank_weights(path, cfg, tp, rank), strict=True)
        cache, rows = model.new_cache(1, len(tokens)), []
        with torch.no_grad():
            logits, cache = model.step(torch.tensor([tokens[:PROMPT]]), 0, cache)
            rows.extend(logits[0])
            for i in range(PROMPT, len(tokens)):
                logits, cache = model.step(torch.tensor([tokens[i:i + 1]]), i, cache)
                rows.extend(logits[0])
        if rank == 0:
            torch.save(torch.stack(rows).float(), out)
        dist.barrier()  # no rank leaves the group while another still talks in it (gloo aborts)
    finally:
        dist.destroy_process_group()


def _v4_at_tp3(path, expected_model, tmp_path) -> None:
    cfg = inspect_checkpoint(path)
    counts = [rank_share(cfg, 3, r).counts() for r in range(3)]
    assert len({repr(c) for c in counts}) > 1, counts
    tokens = _tokens(cfg.vocab_size)
    kiln = _ranks(_v4_rank_main, 3, path, tokens, tmp_path)
    with torch.no_grad():
        expected = expected_model.eval()(torch.tensor([tokens])).logits[0].float()
    diff = float((kiln - expected).abs().max())
    print(f"DeepSeek-V4 ({cfg.quant}) at tp 3 ({counts}): max |logit diff| {diff:.2e}")
    assert torch.equal(kiln.argmax(-1), expected.argmax(-1))
    assert diff <= 1e-3


def test_deepseek_v4_at_tp_3_splits_output_groups_and_computes_what_transformers_computes(tmp_path):
    from bench.hf_checkpoints import V4_SMALL, randomise_v4

    config = transformers.DeepseekV4Config(**{**V4_SMALL, **V4_TP3})
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    randomise_v4(model, config.n_routed_experts, 1)
    model.save_pretrained(tmp_path / "v4")
    _v4_at_tp3(tmp_path / "v4", model, tmp_path)


def test_the_published_v4_flash_layout_at_tp_3_computes_what_transformers_dequantized_model_does(tmp_path):
    """FP8 blocks and FP4 groups whole on every rank (kiln.core.model.shares), against transformers' own
    dequantization of the same bytes."""
    from v4_flash_checkpoints import write_v4_flash

    from bench.hf_checkpoints import V4_SMALL, randomise_v4

    config = transformers.DeepseekV4Config(**{**V4_SMALL, **FLASH_TP3, "index_head_dim": 32})
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    randomise_v4(model, config.n_routed_experts, 1)
    path, _ = write_v4_flash(model, tmp_path)
    reference = transformers.DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    _v4_at_tp3(path, reference, tmp_path)
