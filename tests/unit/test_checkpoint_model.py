"""Checkpoint I/O and the sharded model, in eager mode (no compilation)."""

import re

import pytest
import torch
import torch.nn.functional as F

from kiln.core.model.config import ModelConfig
from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights, random_checkpoint
from kiln.host.model import ShardedDecoder, example_inputs, random_state_dict, shard_state_dict

SMALL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, intermediate_size=48)


def test_sharded_checkpoint_round_trip(tmp_path):
    random_checkpoint(tmp_path, SMALL, seed=3, num_shards=3)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    assert inspect_checkpoint(tmp_path) == SMALL
    full = random_state_dict(SMALL, seed=3)
    for rank in range(2):
        got = load_rank_weights(tmp_path, SMALL, 2, rank)
        want = shard_state_dict(full, SMALL, 2, rank)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in got)


def test_shard_outputs_sum_to_unsharded_attention_projection():
    """Row-parallel o_proj: the rank partial sums add up to the unsharded projection."""
    full = random_state_dict(SMALL, seed=1)
    x = torch.randn(3, SMALL.num_heads * SMALL.head_dim)
    parts = [shard_state_dict(full, SMALL, 2, r)["model.runs.0.self_attn.o_proj.weight"][0] for r in range(2)]
    half = SMALL.num_heads * SMALL.head_dim // 2
    partial = sum(F.linear(x[:, r * half:(r + 1) * half], parts[r]) for r in range(2))
    torch.testing.assert_close(partial, F.linear(x, full["model.layers.0.self_attn.o_proj.weight"]))


def test_paged_step_matches_full_context_recompute():
    """Feeding tokens in two steps through the paged cache equals one step over all tokens."""
    torch.manual_seed(0)
    model = ShardedDecoder(SMALL, 1).eval()
    model.load_state_dict(shard_state_dict(random_state_dict(SMALL, seed=2), SMALL, 1, 0))
    page_tokens, pages_per_seq = 4, 4
    tokens = torch.randint(0, SMALL.vocab_size, (1, 8))
    cache = torch.zeros(SMALL.num_layers, 2, 6, page_tokens, SMALL.num_kv_heads, SMALL.head_dim)
    table = torch.tensor([[3, 1, 5, 0]])
    with torch.no_grad():
        whole, _ = model(tokens, torch.tensor([0]), cache, table)
        first, kv = model(tokens[:, :4], torch.tensor([0]), cache, table)
        cache[:, :, 3] = kv[:, :, 0]  # the first 4 tokens fill page table[0] = 3
        second, _ = model(tokens[:, 4:], torch.tensor([4]), cache, table)
    torch.testing.assert_close(second, whole[:, 4:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(first, whole[:, :4], atol=1e-5, rtol=1e-4)


def _prefill_then_decode(cfg: ModelConfig, tokens, prefilled: int):
    """(logits of one step over all of `tokens` [b, n], logits of decode steps from position `prefilled` on
    after a prefill of the first `prefilled` tokens) of SMALL's weights in cfg.dtype: [b, n - prefilled, vocab]
    each, in float32."""
    dtype, page_tokens = getattr(torch, cfg.dtype), 4
    model = ShardedDecoder(cfg, 1).eval().to(dtype)
    model.load_state_dict(shard_state_dict(random_state_dict(cfg.replace(dtype="float32"), seed=3), cfg, 1, 0))
    cache = torch.zeros(cfg.num_layers, 2, 9, page_tokens, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
    table = torch.tensor([[3, 1, 5, 0], [2, 8, 6, 4]])
    zero = torch.zeros(tokens.shape[0], dtype=torch.int64)
    steps = []
    with torch.no_grad():
        whole, _ = model(tokens, zero, cache, table)
        _, kv = model(tokens[:, :prefilled], zero, cache, table)
        for i in range(prefilled):  # position i of sequence b lives in page table[b, i // 4] at slot i % 4
            cache[:, :, table[:, i // page_tokens], i % page_tokens] = kv[:, :, :, i]
        for i in range(prefilled, tokens.shape[1]):
            step, kv = model(tokens[:, i:i + 1], zero + i, cache, table)
            cache[:, :, table[:, i // page_tokens], i % page_tokens] = kv[:, :, :, 0]
            steps.append(step[:, 0])
    return whole[:, prefilled:].float(), torch.stack(steps, dim=1).float()


@pytest.mark.parametrize("changes", [
    {},  # grouped-query attention: 2 query heads per KV head
    {"attn_softcap": 2.0, "query_pre_attn_scalar": 24, "sliding_window": 5, "first_sliding_layer": 1},
    {"dtype": "bfloat16"},
], ids=["gqa", "softcap-window", "bf16"])
def test_a_decode_step_reading_its_pages_in_place_computes_what_a_whole_recompute_does(changes):
    """Decode steps (one token: kiln.host.model.layers.paged_attention reads the cached pages where they lie) after a
    prefill give the logits of one step over the whole sequence (its cached pages gathered); in bfloat16 they
    are no farther from float32's than that step itself is."""
    cfg = SMALL.replace(**changes)
    tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    whole, decoded = _prefill_then_decode(cfg, tokens, 8)
    if cfg.dtype == "float32":
        torch.testing.assert_close(decoded, whole, atol=1e-5, rtol=1e-4)
    else:
        exact, _ = _prefill_then_decode(cfg.replace(dtype="float32"), tokens, 8)
        assert float((decoded - exact).abs().max()) <= float((whole - exact).abs().max())


def test_scanned_layers_compute_what_unrolled_ones_do():
    """The scan over stacked layers (what is compiled) equals the same layers unrolled, windows included."""
    cfg = SMALL.replace(num_layers=3, architecture="qwen2", qkv_bias=True, sliding_window=3, first_sliding_layer=1)
    weights = shard_state_dict(random_state_dict(cfg, seed=5), cfg, 1, 0)
    scanned, unrolled = ShardedDecoder(cfg, 1).eval(), ShardedDecoder(cfg, 1, scan=False).eval()
    scanned.load_state_dict(weights)
    unrolled.load_state_dict(weights)
    args = example_inputs(cfg, 1, 2, 5, page_tokens=4, pages_per_seq=3, num_pages=7, seed=2)
    with torch.no_grad():
        for got, want in zip(scanned(*args), unrolled(*args)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        windowless = ShardedDecoder(cfg.replace(sliding_window=None), 1, scan=False).eval()
        windowless.load_state_dict(weights)
        assert not torch.allclose(windowless(*args)[0], unrolled(*args)[0], atol=1e-4)  # the window matters


def test_example_inputs_shapes():
    tok, start, cache, table = example_inputs(SMALL, 2, 3, 5, page_tokens=4, pages_per_seq=2, num_pages=7)
    assert tok.shape == (3, 5) and start.shape == (3,) and table.shape == (3, 2)
    assert cache.shape == (2, 2, 7, 4, 1, 8)
    assert int(start.max()) <= 8


def test_checkpoint_tensors_must_match_the_config(tmp_path):
    """A tensor the config does not account for (a bias) is refused; a tied head needs no lm_head.weight."""
    import pytest

    from kiln.core.errors import BadInput
    from kiln.host.weights.checkpoint import write_checkpoint

    state = random_state_dict(SMALL, seed=0)
    write_checkpoint(tmp_path / "extra", SMALL, {**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})
    with pytest.raises(BadInput, match="q_proj.bias"):
        inspect_checkpoint(tmp_path / "extra")
    untied = {k: v for k, v in state.items() if k != "lm_head.weight"}
    write_checkpoint(tmp_path / "untied", SMALL, untied)
    with pytest.raises(BadInput, match="tie_word_embeddings"):
        inspect_checkpoint(tmp_path / "untied")
    tied = SMALL.replace(tie_word_embeddings=True)
    write_checkpoint(tmp_path / "tied", tied, untied)
    assert inspect_checkpoint(tmp_path / "tied") == tied
    write_checkpoint(tmp_path / "tied-with-copy", tied, state)  # a saved copy of the tied head is fine
    assert inspect_checkpoint(tmp_path / "tied-with-copy") == tied


def test_biases_shard_with_their_projection():
    """Column-parallel biases (q, k, v, gate, up) split with their rows; row-parallel ones (o, down) stay whole."""
    cfg = SMALL.replace(qkv_bias=True, o_bias=True, mlp_bias=True)
    full = random_state_dict(cfg, seed=4)
    ranks = [shard_state_dict(full, cfg, 2, r) for r in range(2)]
    for name in ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias"):
        stacked = f"model.runs.0.{name}"  # layer 1 is the stack's second entry
        assert torch.equal(torch.cat([r[stacked][1] for r in ranks]), full[f"model.layers.1.{name}"])
    for name in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
        assert all(torch.equal(r[f"model.runs.0.{name}"][1], full[f"model.layers.1.{name}"]) for r in ranks)
    assert set(ranks[0]) == set(ShardedDecoder(cfg, 2).state_dict())


def test_direct_reader_cuts_and_converts_as_slicing_does(tmp_path, monkeypatch):
    """Reading into a preallocated tensor (no memory map) gives what slicing the loaded tensor gives: whole, cut
    along rows, cut along columns a few rows at a time, converted from bfloat16; a truncated file is named."""
    import pytest
    from safetensors.torch import save_file

    from kiln.core.errors import BadInput
    from kiln.host.weights import safetensors_io

    t = torch.randn(37, 24).to(torch.bfloat16)
    save_file({"w": t}, str(tmp_path / "a.safetensors"))
    monkeypatch.setattr(safetensors_io, "_CHUNK_BYTES", 5 * 24 * 2)  # 5 rows per read: several chunks
    f = safetensors_io.SafetensorsFile(tmp_path / "a.safetensors")
    for cut, want in ((None, t), ((0, 3, 20), t[3:20]), ((1, 8, 16), t[:, 8:16])):
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(want.shape, dtype=dtype)
            f.read_into("w", cut, out)
            assert torch.equal(out, want.to(dtype)), (cut, dtype)
    f.close()
    data = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "b.safetensors").write_bytes(data[:-10])
    with pytest.raises(BadInput, match="truncated"):
        safetensors_io.SafetensorsFile(tmp_path / "b.safetensors").read_into("w", None, torch.empty(37, 24,
                                                                                                     dtype=torch.bfloat16))


def test_loading_a_ranks_weights_checks_the_files_it_reads(tmp_path):
    """A host reads its own copy of the checkpoint, which the flow never inspected: load_rank_weights makes
    inspect_checkpoint's checks (index, headers, shapes) on it, BadInput naming the file and the field."""
    import json

    import pytest

    from kiln.core.errors import BadInput

    def tampered(name: str, edit_index=None, edit_header=None):
        path = random_checkpoint(tmp_path / name, SMALL, seed=1, num_shards=2)
        index = path / "model.safetensors.index.json"
        if edit_index:
            raw = json.loads(index.read_text())
            edit_index(raw["weight_map"])
            index.write_text(json.dumps(raw))
        shard = sorted(path.glob("*.safetensors"))[0]
        if edit_header:
            data = shard.read_bytes()
            length = int.from_bytes(data[:8], "little")
            header = json.loads(data[8:8 + length])
            edit_header(header[sorted(n for n in header if n != "__metadata__")[0]])
            raw = json.dumps(header).encode()
            shard.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length:])
        return path, shard

    def misplace(weight_map: dict) -> None:
        """The first tensor placed in the other shard."""
        name = next(iter(weight_map))
        weight_map[name] = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])

    assert load_rank_weights(tampered("clean")[0], SMALL, 2, 1)
    cases = [({"edit_index": lambda m: m.update({next(iter(m)): "../x.safetensors"})}, "'../x.safetensors'"),
             ({"edit_index": lambda m: m.update({next(iter(m)): None})}, "-> None"),
             ({"edit_index": misplace}, "whose header does not hold it"),
             ({"edit_header": lambda t: t.update(dtype="F8_E5M2")}, "dtype F8_E5M2"),
             ({"edit_header": lambda t: t.update(dtype="U4")}, "dtype 'U4'"),
             ({"edit_header": lambda t: t.update(shape=[t["shape"][0] + 1, *t["shape"][1:]])}, "data_offsets"),
             ({"edit_header": lambda t: t.update(shape=t["shape"][::-1] if len(t["shape"]) == 2
                                                 and t["shape"][0] != t["shape"][1] else [1, 0])},
              "config.json implies")]
    for i, (edit, needle) in enumerate(cases):
        path, shard = tampered(f"bad{i}", **edit)
        with pytest.raises(BadInput, match=re.escape(needle)) as err:
            load_rank_weights(path, SMALL, 2, 1)
        assert path.name in str(err.value), str(err.value)
