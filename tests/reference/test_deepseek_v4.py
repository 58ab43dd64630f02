"""DeepSeek-V4 in Kiln's eager model against transformers' DeepseekV4ForCausalLM, and its refusals.

The checkpoint is written by transformers (`save_pretrained`, the published checkpoints' own tensor names)
from a small random-init model whose every part is live: sinks, the compressors' position biases, the
hyper-connections' biases and scales, the correction bias and the norms drawn away from their init, and
`tid2eid` filled with a non-trivial table (random init leaves it zero). All three attention kinds, hash
and top-k expert layers, hc_mult 3, a prompt of 40 tokens: five sliding windows of 8, ten CSA entries (of
which the indexer keeps 3 per query) and five HCA entries. Each piece is also switched off in Kiln's
model alone, and the logits move, so the match cannot come from a piece that computes nothing.

Compiled and run by what users run (`kiln export --tp 2`, `kiln run`, `kiln verify`, torch alone, the C++
runner): test_v4_flash.py, on this small V4 in DeepSeek-V4-Flash's published layout, one export for all of
them (a quantized projection is dequantized where a layer reads it; the layers' code is the same).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_models import transformers

from bench.hf_checkpoints import V4_SMALL
from kiln.core.errors import BadInput
from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights
from kiln.host.model.families.deepseek_v4 import DeepseekV4Decoder

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
V4 = V4_SMALL
PROMPT = 40


def write_v4(path, overrides: dict | None = None, dtype: str = "float32", seed: int = 0):
    """Write the random-init V4 checkpoint (every part perturbed, tid2eid a real table) at `path`."""
    if (path / "config.json").exists():
        return path
    cfg = transformers.DeepseekV4Config(**{**V4, **(overrides or {})})
    from bench.hf_checkpoints import randomise_v4

    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    randomise_v4(model, cfg.n_routed_experts, seed + 1)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    return write_v4(tmp_path_factory.mktemp("v4") / "v4")


def _tokens(cfg, n=PROMPT):
    return torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))


def kiln_logits(cfg, weights, tokens, scan=True):
    model = DeepseekV4Decoder(cfg, 1, scan=scan).eval()
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return model.prompt(tokens).float()


def reference_logits(path, tokens, dtype="float32"):
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def test_kiln_computes_what_transformers_computes(v4_path):
    cfg = inspect_checkpoint(v4_path)
    assert cfg.architecture == "deepseek_v4" and len(set(cfg.v4.layer_types)) == 3 and cfg.v4.hc_mult == 3
    weights = load_rank_weights(v4_path, cfg, 1, 0)
    assert weights["model.runs.0.ffn.gate.tid2eid"].dtype == torch.int64
    tokens = _tokens(cfg)
    want = reference_logits(v4_path, tokens)
    for scan in (True, False):
        got = kiln_logits(cfg, weights, tokens, scan)
        assert float((got - want).abs().max()) <= 1e-4, f"scan={scan}"
    assert float(want.std()) > 0.1


def _off(cfg, **changes):
    return cfg.replace(v4=dataclasses.replace(cfg.v4, **changes))


ABLATIONS = {
    "sinks": lambda cfg, w: (cfg, {k: torch.zeros_like(v) if k.endswith("attn_sink") else v for k, v in w.items()}),
    "indexer top-k": lambda cfg, w: (_off(cfg, index_topk=PROMPT), w),  # every ready entry instead of the best 3
    "Sinkhorn iterations": lambda cfg, w: (_off(cfg, hc_sinkhorn_iters=1), w),
    "hash routing": lambda cfg, w: (cfg, {k: (v + 1) % cfg.num_experts if k.endswith("tid2eid") else v
                                          for k, v in w.items()}),  # each token routed to other experts
    "clipping": lambda cfg, w: (_off(cfg, swiglu_limit=1e9), w),
}


@pytest.mark.parametrize("piece", sorted(ABLATIONS))
def test_each_piece_moves_the_logits(piece, v4_path):
    cfg = inspect_checkpoint(v4_path)
    weights = load_rank_weights(v4_path, cfg, 1, 0)
    tokens = _tokens(cfg)
    got = kiln_logits(cfg, weights, tokens, scan=False)
    without = kiln_logits(*ABLATIONS[piece](cfg, weights), tokens, scan=False)
    assert float((without - got).abs().max()) > 1e-3, f"{piece}: switching it off does not change these logits"


def test_bfloat16_stays_within_transformers_own_error(tmp_path):
    path = write_v4(tmp_path / "bf16", dtype="bfloat16")
    cfg = inspect_checkpoint(path)
    assert cfg.dtype == "bfloat16"
    tokens = _tokens(cfg)
    exact = reference_logits(path, tokens, "float32")
    theirs = float((reference_logits(path, tokens, "bfloat16") - exact).abs().max())
    model = DeepseekV4Decoder(cfg, 1, scan=False).to(torch.bfloat16).eval()
    model.load_state_dict(load_rank_weights(path, cfg, 1, 0), strict=True)
    with torch.no_grad():
        ours = float((model.prompt(tokens).float() - exact).abs().max())
    assert ours <= 2 * theirs, f"Kiln bfloat16 is off by {ours:.2e}; transformers' own by {theirs:.2e}"


def test_an_export_without_a_one_token_bucket_or_with_ranges_is_refused_by_name(v4_path, kiln_main, tmp_path):
    """A step of V4's slot cache takes no padding (every token rewrites its state) and ranges are not checked
    for V4 yet: the default buckets (no 1-token bucket, ranges) are refused before anything starts."""
    store = tmp_path / "store"
    run = kiln_main("export", "--model", str(v4_path), "--tp", "2", "--store", f"file://{store}")
    assert run.code == 2, run.err[-2000:]
    assert "DeepSeek-V4" in run.err and "a bucket of 1 token" in run.err and "shape_policy=static" in run.err
    assert "Traceback" not in run.err
    assert not store.exists() or not any(store.rglob("*.json"))


def test_tp_3_is_refused_naming_the_counts_and_the_tp_values_that_work(v4_path, kiln_main):
    run = kiln_main("plan", "--model", str(v4_path), "--tp", "3")
    assert run.code == 2, run.err[-2000:]
    assert ("--tp 3 cannot split the model: it has 2 output groups (o_groups), fewer than 3 ranks; use a tp of "
            "1, 2.") in run.err, run.err


def test_decoding_matches_transformers_generate_across_compression_boundaries(v4_path):
    """Greedy decode of 20 tokens after the 40-token prompt, one step per token over Kiln's compressed cache:
    the same ids as transformers' generate() and its logits within 1e-4 at every step. The steps cross five
    CSA windows (4) and two HCA windows (8) and run far past the sliding window (8); the prompt itself is fed
    in two chunks (13 + 27 tokens: partial windows carried in the cache)."""
    cfg = inspect_checkpoint(v4_path)
    prompt = _tokens(cfg)[0].tolist()
    new_tokens = 20
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(v4_path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)
    want_ids = out.sequences[0, len(prompt):].tolist()
    model = DeepseekV4Decoder(cfg, 1, scan=False).eval()  # scanned: test_kiln_computes_what_transformers_computes
    model.load_state_dict(load_rank_weights(v4_path, cfg, 1, 0), strict=True)
    cache = model.new_cache(1, len(prompt) + new_tokens)
    got_ids, worst = [], 0.0
    with torch.no_grad():
        _, cache = model.step(torch.tensor([prompt[:13]]), 0, cache)
        logits, cache = model.step(torch.tensor([prompt[13:]]), 13, cache)
        for i in range(new_tokens):
            last = logits[0, -1]
            worst = max(worst, float((last - out.logits[i][0]).abs().max()))
            got_ids.append(int(last.argmax()))
            logits, cache = model.step(torch.tensor([[want_ids[i]]]), len(prompt) + i, cache)
    assert got_ids == want_ids
    assert worst <= 1e-4, worst
    print(f"decode: max |logit diff| {worst:.2e} over {new_tokens} steps")
    assert len(set(want_ids)) > 3, "greedy decoding repeats itself: the check would show little"


def _prefill_and_decode(model, prompt: list[int], steps: list[int]) -> torch.Tensor:
    """[1 + len(steps), vocab]: the last position's logits after `prompt`, then after each of `steps` fed alone."""
    cache, rows = model.new_cache(1, len(prompt) + len(steps)), []
    with torch.no_grad():
        logits, cache = model.step(torch.tensor([prompt]), 0, cache)
        rows.append(logits[0, -1])
        for i, token in enumerate(steps):
            logits, cache = model.step(torch.tensor([[token]]), len(prompt) + i, cache)
            rows.append(logits[0, -1])
    return torch.stack(rows)


def _rank_main(rank: int, path: str, init: str, out: str, prompt: list[int], steps: list[int]) -> None:
    """One of two ranks (gloo): the rank's shard prefills `prompt` and decodes `steps`; rank 0 saves logits."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        cfg = inspect_checkpoint(path)
        model = DeepseekV4Decoder(cfg, 2, scan=False).eval()
        model.load_state_dict(load_rank_weights(path, cfg, 2, rank), strict=True)
        rows = _prefill_and_decode(model, prompt, steps)
        if rank == 0:
            torch.save(rows, out)
        dist.barrier()  # no rank leaves the group while another still talks in it (gloo aborts)
    finally:
        dist.destroy_process_group()


def test_two_ranks_compute_what_one_does(v4_path, tmp_path):
    """--tp 2 splits the query heads, sinks, output groups and the experts' columns (kiln.core.model.shares);
    two gloo ranks, each its own shard and a sum after attention and experts, prefill and decode the same
    logits as one rank holding everything."""
    import torch.multiprocessing as mp

    cfg = inspect_checkpoint(v4_path)
    prompt, steps = _tokens(cfg)[0].tolist(), [5, 77, 300, 12, 9, 41]
    out = tmp_path / "tp2.pt"
    mp.start_processes(_rank_main, args=(str(v4_path), f"file://{tmp_path / 'rendezvous'}", str(out), prompt, steps),
                       nprocs=2, start_method="spawn")
    model = DeepseekV4Decoder(cfg, 1, scan=False).eval()
    model.load_state_dict(load_rank_weights(v4_path, cfg, 1, 0), strict=True)
    diff = float((torch.load(out) - _prefill_and_decode(model, prompt, steps)).abs().max())
    print(f"tp 2 against tp 1: max |logit diff| {diff:.2e}")
    assert diff <= 1e-4


def test_sequences_at_different_positions_step_together(v4_path):
    """A step's positions are one start per sequence (tensors, so the graph's shapes depend only on the token
    count): two sequences' caches side by side, at positions 40 (the first of a CSA and an HCA window) and 17
    (mid-window), step together as each steps alone."""
    cfg = inspect_checkpoint(v4_path)
    model = DeepseekV4Decoder(cfg, 1, scan=False).eval()
    model.load_state_dict(load_rank_weights(v4_path, cfg, 1, 0), strict=True)
    prompts = [_tokens(cfg)[0].tolist(), _tokens(cfg, 57)[0, 40:].tolist()]
    alone, caches = [], []
    with torch.no_grad():
        for prompt, token in zip(prompts, (7, 8)):
            _, cache = model.step(torch.tensor([prompt]), 0, model.new_cache(1, 48))
            caches.append(cache)
            alone.append(model.step(torch.tensor([[token]]), len(prompt), cache)[0][0, -1])
        both = [{n: torch.cat((a[n], b[n]), dim=1) for n in a} for a, b in zip(*caches)]
        together, _ = model.step(torch.tensor([[7], [8]]), torch.tensor([40, 17]), both)
    assert float((together[:, -1] - torch.stack(alone)).abs().max()) <= 1e-5


def test_the_compiled_step_reads_and_writes_each_sequence_slot(v4_path):
    """forward(tokens, start_pos, kv_cache, slots), the step Kiln compiles, is `step` over the states its slots
    hold (kiln.core.model.contract.cache_layout), returning each sequence's slot after the step; two sequences at
    other positions in slots 2 and 0 of 3."""
    from kiln.core.model.cache_layout import cache_layout
    from kiln.host.model.families.deepseek_v4 import pack, unpack

    cfg = inspect_checkpoint(v4_path)
    # Unrolled: Kiln against Kiln, the same layers (dynamo traces a scanned V4 on every call: 31 s of 32 here; the
    # scanned forward is what test_v4_flash.py's export compiles).
    model = DeepseekV4Decoder(cfg, 1, scan=False).eval()
    model.load_state_dict(load_rank_weights(v4_path, cfg, 1, 0), strict=True)
    layout = cache_layout(cfg, 1, 48)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(3, layout.slot_values, generator=gen)
    slots, start, tokens = torch.tensor([2, 0]), torch.tensor([17, 32]), _tokens(cfg, 16).view(2, 8)
    assert torch.equal(pack(layout, unpack(layout, cache)), cache)
    with torch.no_grad():
        logits, new_kv, *_ = model(tokens, start, cache, slots)  # then its choices
        want, after = model.step(tokens, start, unpack(layout, cache[slots]))
    assert new_kv.shape == (2, layout.slot_values)
    assert torch.equal(logits, want) and torch.equal(new_kv, pack(layout, after))
    assert not torch.equal(new_kv, cache[slots])


def test_a_random_checkpoint_written_by_kiln_reads_back(tmp_path):
    """`kiln checkpoint`'s writer (random weights, config.json by to_hf) makes a V4 checkpoint that reads back as
    the same config, with tid2eid as expert ids, and runs."""
    from kiln.core.model.hf_config import from_hf
    from kiln.host.weights.checkpoint import random_checkpoint

    cfg = from_hf({**{k: v for k, v in V4.items() if k != "initializer_range"}, "model_type": "deepseek_v4"})
    random_checkpoint(tmp_path / "ckpt", cfg)
    assert inspect_checkpoint(tmp_path / "ckpt") == cfg
    weights = load_rank_weights(tmp_path / "ckpt", cfg, 1, 0)
    table = weights["model.runs.0.ffn.gate.tid2eid"]
    assert table.dtype == torch.int64 and 0 <= int(table.min()) and int(table.max()) < cfg.num_experts
    assert torch.isfinite(kiln_logits(cfg, weights, _tokens(cfg, 12), scan=False)).all()
