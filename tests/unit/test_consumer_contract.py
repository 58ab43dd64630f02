"""The consumer contract (kiln.core.model.contract) against the torch module it describes, and the outcome check."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kiln.core.model import fused_experts
from kiln.core.model.config import TINY
from kiln.core.model.contract import FUSED, constant_sources, parameter_shapes, shard_slice, weight_layout
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.core.errors import IntegrityError, KilnError, NotPythonFree
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.model.interface import forward_interface
from kiln.core.run.outcome import check_digests, check_outcome, forward_records
from kiln.core.model.param_counts import params_per_rank
from kiln.core.model.quant import WeightQuant
from kiln.core.forwards.shape_ranges import parse_shape_range
from kiln.core.model.dsa_fields import DsaFields

CONFIGS = {
    "tiny": TINY,
    "biases, tied": TINY.replace(qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "gqa hd64": TINY.replace(num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=512, intermediate_size=1024),
    "qwen3: q/k norms, heads x head_dim != hidden": TINY.replace(architecture="qwen3", qk_norm=True, num_heads=4,
                                                                  num_kv_heads=2, head_dim=128),
    "qwen3_moe: a dense run between expert runs": TINY.replace(
        architecture="qwen3_moe", qk_norm=True, num_layers=4, num_experts=4, experts_per_token=2,
        moe_intermediate_size=96, moe_layers=(0, 2, 3)),
    "mixtral: experts on every layer": TINY.replace(architecture="mixtral", num_experts=3, experts_per_token=2,
                                                    moe_intermediate_size=TINY.intermediate_size, moe_layers=(0, 1)),
    "qwen2_moe: a shared expert beside the experts": TINY.replace(
        architecture="qwen2_moe", qkv_bias=True, num_experts=4, experts_per_token=2, moe_intermediate_size=96,
        shared_expert_intermediate_size=192, moe_layers=(1,)),
    "gemma3: sandwich norms, q/k norms": TINY.replace(
        architecture="gemma3_text", qk_norm=True, norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
        activation="gelu_tanh", query_pre_attn_scalar=16.0, sliding_window=8, full_attention_layers=(1,),
        local_rope_theta=1e4, tie_word_embeddings=True),
    "phi3: fused qkv_proj and gate_up_proj, partial rotary": TINY.replace(
        architecture="phi3", rotary_dim=8, sliding_window=8),
    "phi3: longrope, which takes seq_lens": TINY.replace(
        architecture="phi3", rotary_dim=8, rope_type="longrope", rope_short_factor=(1.0,) * 4,
        rope_long_factor=(2.0,) * 4, rope_original_max_position=4),
    "deepseek_v3: latent attention, grouped routing, shared experts": TINY.replace(
        architecture="deepseek_v3", num_heads=4, num_kv_heads=4, head_dim=48, qk_rope_head_dim=16, v_head_dim=32,
        kv_lora_rank=64, q_lora_rank=32, o_bias=True, num_layers=3, num_experts=8, experts_per_token=2,
        moe_intermediate_size=64, moe_layers=(1, 2), shared_expert_intermediate_size=64, router="sigmoid_groups",
        num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5, rope_interleave=True),
    "gpt_oss: sinks, stacked experts with biases, alternating windows": TINY.replace(
        architecture="gpt_oss", qkv_bias=True, o_bias=True, num_experts=4, experts_per_token=2,
        moe_intermediate_size=TINY.intermediate_size, moe_layers=(0, 1), sliding_window=8, full_attention_layers=(1,),
        attention_sinks=True, swiglu_limit=7.0),
    "minimax_m2: q/k norms over all heads, corrected sigmoid routing, partial rotary": TINY.replace(
        architecture="minimax_m2", qk_norm=True, qk_norm_whole=True, rotary_dim=8, num_experts=4, experts_per_token=2,
        moe_intermediate_size=TINY.intermediate_size, moe_layers=(0, 1), router="sigmoid_groups"),
    "mistral4: latent attention, fused 3-D experts, softmax groups, query scale": TINY.replace(
        architecture="mistral4", num_heads=4, num_kv_heads=4, head_dim=48, qk_rope_head_dim=16, v_head_dim=32,
        kv_lora_rank=64, q_lora_rank=32, num_layers=3, num_experts=8, experts_per_token=2, moe_intermediate_size=64,
        moe_layers=(1, 2), shared_expert_intermediate_size=64, router="softmax_groups", num_expert_groups=4,
        topk_groups=2, rope_interleave=True, query_scale_beta=0.1),
    "deepseek_v32: sparse latent attention, a lightning indexer whole on every rank": TINY.replace(
        architecture="deepseek_v32", num_heads=4, num_kv_heads=4, head_dim=48, qk_rope_head_dim=16, v_head_dim=32,
        kv_lora_rank=64, q_lora_rank=32, num_layers=3, num_experts=8, experts_per_token=2, moe_intermediate_size=64,
        moe_layers=(1, 2), shared_expert_intermediate_size=64, router="sigmoid_groups", num_expert_groups=4,
        topk_groups=2, rope_interleave=True, dsa=DsaFields(4, 32, 8, False)),
    "llama4_text: chunks, layers with no rope, input-major fused experts under feed_forward": TINY.replace(
        architecture="llama4_text", num_layers=4, attention_chunk_size=8, nope_layers=(2,), qk_l2_norm=True,
        temperature_floor=4, temperature_scale=0.1, num_experts=4, experts_per_token=1, moe_intermediate_size=96,
        moe_layers=(1, 3), shared_expert_intermediate_size=96, router="sigmoid_input"),
}
CONFIGS["gpt_oss in bfloat16: float32 norms"] = CONFIGS[
    "gpt_oss: sinks, stacked experts with biases, alternating windows"].replace(dtype="bfloat16")
CONFIGS["gpt_oss: MXFP4 experts, each rank's groups of 32"] = CONFIGS[
    "gpt_oss: sinks, stacked experts with biases, alternating windows"].replace(quant=WeightQuant("mxfp4", (1, 32)))
CONFIGS["qwen3_moe: FP8 blocks, a rank's share of the experts inside a block"] = CONFIGS[
    "qwen3_moe: a dense run between expert runs"].replace(quant=WeightQuant("fp8_blocks", (64, 64)))
CONFIGS["deepseek_v3: FP8 blocks, the latent's rows a partial block"] = CONFIGS[
    "deepseek_v3: latent attention, grouped routing, shared experts"].replace(quant=WeightQuant("fp8_blocks", (32, 64)))


@pytest.mark.parametrize("name", CONFIGS)
def test_constants_are_the_torch_modules_own(name):
    """The contract's constants (names, order, per-rank shapes) are the module's state dict; every checkpoint
    tensor parameter_shapes names is the source of exactly one constant, a fused one (FUSED) of one per
    projection it holds."""
    pytest.importorskip("torch")
    from kiln.host.model import ShardedDecoder

    cfg = CONFIGS[name]
    for tp in (1, 2):
        module = {n: list(p.shape) for n, p in ShardedDecoder(cfg, tp).to("meta").state_dict().items()}
        assert [(n, w["shape"]) for n, w in weight_layout(cfg, tp).items()] == list(module.items())
    fused = FUSED.get(cfg.architecture, {})
    gate_and_up = fused_experts.GATE_UP if fused_experts.fused(cfg) else None  # fused 3-D experts: two parts
    holds = {n: 2 if gate_and_up and n.endswith(gate_and_up) else len(fused.get(n.split(".", 3)[-1], ("one",)))
             for n in parameter_shapes(cfg)}
    assert Counter(s for group in constant_sources(cfg).values() for s in group) == Counter(holds)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_parameter_count_is_a_ranks_constants(name):
    """kiln.core.model.param_counts counts what a rank binds: the contract's constants (held to the torch module's
    state dict above), element for element."""
    cfg = CONFIGS[name]
    for tp in (1, 2):
        layout = weight_layout(cfg, tp).values()
        assert params_per_rank(cfg, tp) == sum(math.prod(w["shape"]) for w in layout)
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "uint8": 1}
        assert weight_bytes_per_rank(cfg, tp) == sum(math.prod(w["shape"]) * itemsize[w["dtype"]] for w in layout)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("tp", [1, 2])
def test_weight_layout_cuts_are_the_ranks_own_shards(name, tp):
    """What a consumer builds from the manifest alone (cut each source, stack in order) is bit for bit
    what Kiln's own sharding binds."""
    torch = pytest.importorskip("torch")
    from kiln.host.model import ShardedDecoder, random_state_dict, shard_state_dict

    cfg = CONFIGS[name]
    full = random_state_dict(cfg, seed=3)
    layout = weight_layout(cfg, tp)
    for rank in range(tp):
        mine = shard_state_dict(full, cfg, tp, rank)
        assert set(layout) == set(mine) == set(ShardedDecoder(cfg, tp).state_dict())
        for constant, w in layout.items():
            parts = []
            for src in w["sources"]:
                t = full[src["tensor"]]
                assert list(t.shape) == src["full_shape"]
                if src["cut"] is not None:  # a block scale on a rank's sub-blocks: each entry repeated first
                    t = t.repeat_interleave(src["cut"].get("repeat", 1), dim=src["cut"]["dim"])
                    t = t.narrow(src["cut"]["dim"], src["cut"]["offsets"][rank], src["cut"]["length"])
                parts.append(t)
            t = parts[0] if w["stack"] is None else torch.stack(parts)
            assert list(t.shape) == w["shape"] and torch.equal(t, mine[constant]), constant


def test_layout_says_which_tensors_are_stacked_and_cut_and_how():
    cfg = CONFIGS["biases, tied"]
    layout = weight_layout(cfg, 2)
    q = layout["model.runs.0.self_attn.q_proj.weight"]
    assert q["stack"] == cfg.num_layers == len(q["sources"])
    assert [s["tensor"] for s in q["sources"]] == [f"model.layers.{i}.self_attn.q_proj.weight"
                                                  for i in range(cfg.num_layers)]
    rows = cfg.num_heads // 2 * cfg.head_dim
    assert q["shape"] == [cfg.num_layers, rows, cfg.hidden_size]
    assert q["sources"][1]["cut"] == {"dim": 0, "length": rows, "offsets": [0, rows]}
    assert layout["model.runs.0.self_attn.o_proj.weight"]["sources"][0]["cut"]["dim"] == 1
    assert layout["model.runs.0.self_attn.o_proj.bias"]["sources"][0]["cut"] is None  # added once, after the sum
    assert layout["model.runs.0.self_attn.q_proj.bias"]["sources"][0]["cut"]["dim"] == 0
    embed = layout["model.embed_tokens.weight"]
    assert embed["stack"] is None and [s["tensor"] for s in embed["sources"]] == ["model.embed_tokens.weight"]
    assert "lm_head.weight" not in layout  # tied: the head reads the embedding
    assert shard_slice("model.norm.weight", cfg, 2, 1) is None


def test_a_fused_tensor_is_cut_into_its_projections_rows_then_the_ranks_share():
    """Phi-3's qkv_proj holds q, k and v along its rows, gate_up_proj gate then up: each projection's constant
    reads its own rows of the fused tensor, at tp 1 too, and a rank its share of them."""
    cfg = CONFIGS["phi3: fused qkv_proj and gate_up_proj, partial rotary"]
    q, kv, mlp = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = parameter_shapes(cfg)
    assert shapes["model.layers.1.self_attn.qkv_proj.weight"] == (q + 2 * kv, cfg.hidden_size)
    assert shapes["model.layers.1.mlp.gate_up_proj.weight"] == (2 * mlp, cfg.hidden_size)
    assert not any(n.endswith((".q_proj.weight", ".gate_proj.weight", ".up_proj.weight")) for n in shapes)
    for tp in (1, 2):
        layout = weight_layout(cfg, tp)

        def cut(constant: str) -> dict:
            [tensor] = {s["tensor"].split(".", 3)[-1] for s in layout[constant]["sources"]}
            return {"tensor": tensor, **layout[constant]["sources"][1]["cut"]}

        share = [r * q // tp for r in range(tp)]
        assert cut("model.runs.0.self_attn.q_proj.weight") == {
            "tensor": "self_attn.qkv_proj.weight", "dim": 0, "length": q // tp, "offsets": share}
        assert cut("model.runs.0.self_attn.k_proj.weight")["offsets"] == [q + r * kv // tp for r in range(tp)]
        assert cut("model.runs.0.self_attn.v_proj.weight")["offsets"] == [q + kv + r * kv // tp for r in range(tp)]
        assert cut("model.runs.0.mlp.gate_proj.weight")["offsets"] == [r * mlp // tp for r in range(tp)]
        assert cut("model.runs.0.mlp.up_proj.weight") == {
            "tensor": "mlp.gate_up_proj.weight", "dim": 0, "length": mlp // tp,
            "offsets": [mlp + r * mlp // tp for r in range(tp)]}


@pytest.mark.parametrize("name", ["gqa hd64", "phi3: longrope, which takes seq_lens",
                                  "deepseek_v3: latent attention, grouped routing, shared experts"])
def test_interface_matches_the_inputs_and_outputs_of_a_real_step(name):
    """Every input and output the interface names, in order, with its shape and dtype: the KV cache's layout
    (per-head keys and values, or latent attention's one whole entry), seq_lens where the rope needs it; a
    dimension the forward takes a range of (here batch 2-5) is named, with its bounds."""
    torch = pytest.importorskip("torch")
    from kiln.host.model import ShardedDecoder, example_inputs, solo_group

    cfg, tp = CONFIGS[name], 2
    inputs = {"batch": [2, 5], "tokens": [4, 4], "hint": [5, 4], "page_tokens": 16, "pages_per_seq": 3}
    face = forward_interface(cfg, tp, inputs)
    assert face["dynamic_dims"] == {"num_pages": {"min": 2}, "batch": {"min": 2, "max": 5}}
    args = example_inputs(cfg, tp, 2, 4, page_tokens=16, pages_per_seq=3, num_pages=7)
    with solo_group(), torch.no_grad():
        outs = ShardedDecoder(cfg, tp).eval()(*args)
    assert len(face["inputs"]) == len(args) == (5 if cfg.length_dependent_rope else 4)
    assert face["kv_cache"]["sharded"] != cfg.latent
    for spec, t in zip(face["inputs"] + face["outputs"], list(args) + list(outs)):
        shape = [{"num_pages": 7, "batch": 2}.get(d, d) for d in spec["shape"]]
        assert (shape, spec["dtype"]) == (list(t.shape), str(t.dtype).removeprefix("torch.")), spec["name"]
    assert face["process_group"] == "0" and forward_interface(cfg, 1, inputs)["process_group"] is None


def _found(python_free=True):
    return {"sha256": "a" * 64, "size_bytes": 10, "object": "forwards/k1/" + "a" * 64 + ".pt2",
            "calls": {"python_free": python_free, "ops": ["aoti_torch_cpu_mm_out"],
                      "why": None if python_free else "it calls ops that have no C shim (1 proxy-executor call(s))"}}


SPECS = {"k1": ForwardSpec(key="k1", shapes=parse_shape_range("1x8"), target="t", graph={}, compiler={},
                           inputs={"batch": [1, 1], "tokens": [8, 8], "hint": [1, 8], "page_tokens": 16,
                                   "pages_per_seq": 4})}


def test_outcome_refuses_a_missing_forward_and_one_that_needs_python():
    with pytest.raises(KilnError, match="not in the store"):
        check_outcome({}, ["k1"], SPECS)
    with pytest.raises(NotPythonFree, match=r"k1 \(1x8\).*proxy-executor"):
        check_outcome({"k1": _found(False)}, [], SPECS)
    assert check_outcome({"k1": _found()}, [], SPECS)["k1"]["calls"]["python_free"]


def test_forward_records_carry_the_contract_and_who_compiled():
    [rec] = forward_records(SPECS, {"k1": _found()}, {"k1": {"compiled_by": "h0", "compile_s": 2.0}}, TINY, 2)
    assert rec["object"] == "forwards/k1/" + "a" * 64 + ".pt2" and rec["compiled_by"] == "h0" and rec["compile_attempts"] == 1
    assert (rec["shapes"], rec["batch"], rec["tokens"], rec["hint"]) == ("1x8", [1, 1], [8, 8], [1, 8])
    assert rec["python_free"] and rec["interface"]["process_group"] == "0"
    assert rec["constants"] == sorted(constant_sources(TINY))
    [reused] = forward_records(SPECS, {"k1": _found()}, {}, TINY, 2)
    assert reused["compiled_by"] is None and reused["compile_attempts"] == 0


def test_a_cpu_forward_records_the_cpu_it_needs_from_the_probes():
    from dataclasses import replace

    from kiln.core.machine.cpu_target import cpu_isa
    from kiln.core.plan.probe_result import HostProbe
    from kiln.core.run.outcome import target_cpus

    cpu = cpu_isa("x86_64", "AVX2", "flags\t: sse2 avx avx2 fma hypervisor\n")
    specs = {"k1": replace(SPECS["k1"], target=cpu.fingerprint)}
    probe = HostProbe(name="h0", ranks=(0,), memory={}, num_cpus=1, unified=False, target=cpu.fingerprint,
                      specs=(), local_keys=(), store_keys=(), cache={}, cpu_isa=cpu)
    [rec] = forward_records(specs, {"k1": _found()}, {}, TINY, 2, target_cpus([probe]))
    assert rec["target_cpu"] == {"arch": "x86_64", "isa_level": "avx2", "isa_flags": ["avx", "avx2", "fma", "sse2"]}
    assert "target_cpu" not in forward_records(specs, {"k1": _found()}, {}, TINY, 2)[0]  # undescribed: none
    gpu = replace(probe, target="cuda-sm_90-cu13.0-triton3.6.0-x86-64-v3", device="cuda")
    assert target_cpus([gpu]) == {}  # a CUDA forward loads on its own target only: no CPU to record


def test_a_forward_compiled_here_must_be_stored_with_its_compilers_digest():
    compiled = {"k1": {"compiled_by": "h0", "compile_s": 2.0, "sha256": "a" * 64}}
    [rec] = forward_records(SPECS, {"k1": _found()}, compiled, TINY, 2)
    assert rec["sha256"] == "a" * 64
    swapped = {"k1": {**_found(), "sha256": "b" * 64}}  # the store's metadata changed behind the export
    with pytest.raises(IntegrityError, match=r"forward k1: the store's metadata says sha256 b{64}.*reported a{64}"):
        forward_records(SPECS, swapped, compiled, TINY, 2)
    [reused] = forward_records(SPECS, swapped, {}, TINY, 2)  # compiled elsewhere: the store's digest is all there is
    assert reused["sha256"] == "b" * 64


def test_check_digests_compares_only_keys_both_hold():
    check_digests({"k1": "a" * 64, "k2": "c" * 64}, {"k1": "a" * 64, "k3": "d" * 64}, "x")
    with pytest.raises(IntegrityError, match="forward k2: the compile record says"):
        check_digests({"k1": "a" * 64, "k2": "c" * 64}, {"k2": "e" * 64}, "the compile record")
