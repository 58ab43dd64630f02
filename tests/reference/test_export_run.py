"""What a user runs, against transformers: `kiln export --tp 2`, then `kiln run`, then the same greedy decode
in transformers (`generate(do_sample=False)`) on the same checkpoint.

Two buckets (1x4, 1x8) per export, served by one forward over a range of
tokens (1x4-8, compiled for 1x8: kiln.core.forwards.shape_ranges): the 12-token prompt is
fed as a chunk of 8 and a chunk of 4, and every decode step is a padded 1x4
call, so a range's smallest and largest shapes, chunked prefill, padding and
the paged cache all take part.
"""

from __future__ import annotations

import json

import pytest
from hf_models import reference_generate, write_case

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 300, 42, 7, 99, 3, 250, 11, 8, 130, 64]
NEW_TOKENS = 6
BUCKETS = "1x4,1x8"
"""One forward, 1x4-8@1x8: every step of every case runs on a range package."""
E2E = {
    # case: why it is exported end to end (each feature alone is checked in eager mode too). DeepSeek-V3 is
    # exported as DeepSeek-V3.2 (its layer, sparse) here and at tp 3 (test_uneven_export). Mistral, dense
    # Qwen3 and dense Qwen2 are eager only (test_eager_reference): a window over the paged cache is exported with
    # Qwen2-MoE's and Phi-3's, q/k norms with Qwen3-MoE's, Qwen2's attention (sharded q/k/v biases, its window
    # from max_window_layers, yarn) with Qwen2-MoE's; one export less is about 3 CPU-minutes. gpt-oss is exported
    # from its published MXFP4 layout (test_mxfp4), which computes every part of its bfloat16 one.
    "llama32-deep-biases": "Llama 3.2 shape (tied embeddings, llama3 rope scaling, head_dim 64) with attention_bias "
                           "and mlp_bias (row-parallel biases added once after the all-reduce), 24 layers: one "
                           "scanned layer body over 24 layers' stacked weights",
    "qwen3-moe": "Qwen3-MoE: 64 experts, top 2 (every step of the 1x4-8 range gathers the chosen ones), a dense layer between, each "
                 "expert's columns sharded, the router replicated",
    "qwen2-moe-window-yarn": "Qwen2-MoE: a shared expert behind its sigmoid gate beside 8 experts (top 2), each "
                             "sharded; Qwen2's attention: sharded q/k/v biases, a sliding window shorter than the "
                             "prompt from layer 1, yarn (factor 4 over an original context of 16: cos and sin scaled "
                             "by its attention factor)",
    "gemma2": "Gemma 2: GeGLU, (1 + weight) norms around attention and MLP, scaled embeddings, soft-capped scores "
              "and logits, query_pre_attn_scalar, sliding and full layers interleaved",
    "gemma3-image-text": "Gemma 3 as published, an image-text checkpoint (Gemma3ForConditionalGeneration): its text "
                         "decoder, Gemma's layers with q/k norms, full layers rotating at 1e6 scaled by 8, sliding "
                         "ones at 1e4; the vision tower left out, the manifest naming the checkpoint's own tensors",
    "phi3-longrope": "Phi-3.5: fused qkv_proj and gate_up_proj cut into each rank's q/k/v and gate/up rows, a "
                     "partial rotary (48 of 64 dims), a sliding window of 6, and longrope: the 12-token prompt is "
                     "fed with the short factors (its length is 12), the decode steps past the original context of "
                     "14 with the long ones, the cache rebuilt at the switch as transformers' Phi-3 does (the "
                     "forward takes each sequence's length, seq_lens)",
    "minimax-m2": "MiniMax-M2: q and k each normalised over all heads (each rank's sums of squares summed over "
                  "the ranks), half of each head rotating, 8 experts on every layer chosen by corrected sigmoid "
                  "scores",
    "mistral4": "Mistral 4: DeepSeek-V3's latent attention with queries growing past positions 8 and 16, experts "
                "read from fused 3-D tensors (each rank's gate and up rows cut from gate_up_proj, its down columns "
                "from down_proj) and routed by a softmax within the best groups, a shared expert",
    "llama4": "Llama 4: layers that rotate pairs of dims and norm q and k without a weight, attending within chunks of "
              "8 (the prompt and the decode cross two), a layer with no rope whose queries grow with the attention "
              "temperature, every other layer experts read from input-major fused tensors, each chosen expert taking "
              "its token scaled by its sigmoid, a shared expert beside",
    "deepseek-v32": "DeepSeek-V3.2: DeepSeek-V3's layer (latent attention: the cache holds each token's latent and "
                    "rotary key, the same on every rank, q and kv up-projections split by heads; a dense layer then "
                    "16 experts chosen by corrected sigmoid scores within the best 2 of 4 groups, scaled, plus a "
                    "shared expert) made sparse: each query attends to the 4 tokens a lightning indexer (whole on "
                    "every rank, its key cached after the latent) scores best, the picks a choice output",
    "llama-realistic-bf16": "bfloat16, head_dim 128, 4 layers, vocabulary 32000",
}


@pytest.fixture(scope="module")
def export_and_run(kiln, hf_root, prefect_server, dev_verify_key, tmp_path_factory):
    """case -> {'export', 'run', 'result', 'path', 'store', 'verify_key' (the public key that signed it)}:
    each case exported and run once."""
    store = f"file://{tmp_path_factory.mktemp('reference-store')}"
    env = {"PREFECT_API_URL": prefect_server}
    done = {}

    def get(case: str) -> dict:
        if case not in done:
            path = write_case(case, hf_root)
            out = tmp_path_factory.mktemp(case)
            exported = kiln("export", "--model", str(path), "--tp", "2", "--buckets", BUCKETS, "--store", store,
                            "--export-id", f"ref-{case}", "--report", str(out / "report.json"), env=env)
            assert exported.code == 0, exported.err[-3000:]
            ran = kiln("run", f"ref-{case}", "--store", store, "--tokens", ",".join(map(str, PROMPT)),
                       "--max-new-tokens", str(NEW_TOKENS), "--json", str(out / "run.json"), env=env)
            assert ran.code == 0, ran.err[-3000:]
            done[case] = {"export": exported, "run": ran, "path": path, "store": store, "verify_key": dev_verify_key,
                          "report": json.loads((out / "report.json").read_text()),
                          "result": json.loads((out / "run.json").read_text())}
        return done[case]

    return get


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("case", [c for c in E2E if not c.endswith("bf16")])
def test_float32_export_runs_what_transformers_generates(case, export_and_run):
    got = export_and_run(case)
    result = got["result"]
    want = reference_generate(got["path"], PROMPT, NEW_TOKENS)
    assert result["prompt"] == PROMPT
    assert got["run"].out.strip() == ",".join(map(str, result["generated"]))
    assert result["generated"] == want["generated"]
    assert len(set(want["generated"])) > 1, "a degenerate reference (one token repeated) proves little"
    assert len(result["logits"]) == NEW_TOKENS and len(result["logits"][0]) == len(want["logits"][0])
    diff = max_diff(result["logits"], want["logits"])
    compile_s = [f["compile_s"] for f in got["report"]["forwards"] if f.get("compile_s")]
    print(f"{case}: max |logit diff| vs transformers {diff:.2e}; compile s per bucket {compile_s}")
    assert diff < 1e-4


def test_bfloat16_export_stays_within_transformers_own_bfloat16_error(export_and_run):
    got = export_and_run("llama-realistic-bf16")
    assert got["report"]["forwards"] and json.loads((got["path"] / "config.json").read_text())["dtype"] == "bfloat16"
    result = got["result"]
    exact = reference_generate(got["path"], PROMPT, NEW_TOKENS, "float32")
    theirs = reference_generate(got["path"], PROMPT, NEW_TOKENS, "bfloat16")
    # Compare the steps whose prefixes agree (greedy paths of two roundings may part later).
    same = 1
    while same < NEW_TOKENS and result["generated"][:same] == exact["generated"][:same] \
            == theirs["generated"][:same]:
        same += 1
    ours = max_diff(result["logits"][:same], exact["logits"][:same])
    own = max_diff(theirs["logits"][:same], exact["logits"][:same])
    print(f"bfloat16 over {same} step(s): Kiln vs float32 reference {ours:.3f}; transformers bfloat16 {own:.3f}")
    assert ours <= 2 * own
    assert result["generated"][0] == exact["generated"][0]


def test_verify_passes_on_a_real_checkpoint_export(kiln, export_and_run, prefect_server):
    got = export_and_run("llama32-deep-biases")
    verified = kiln("verify", "ref-llama32-deep-biases", "--store", got["store"],
                    env={"PREFECT_API_URL": prefect_server})
    assert verified.code == 0, verified.err[-3000:]
    assert "verify ok: 2 ranks match the unsharded model" in verified.out


def test_a_verify_mismatch_is_final_not_retried(kiln, export_and_run, prefect_server):
    """A forward that differs from eager fails the same way every time: one try, no 30 s retry delay."""
    got = export_and_run("llama32-deep-biases")
    failed = kiln("export", "--model", str(got["path"]), "--tp", "2", "--buckets", BUCKETS, "--store", got["store"],
                  "--set", "verify_atol=1e-12", "--export-id", "ref-mismatch", env={"PREFECT_API_URL": prefect_server})
    assert failed.code == 1
    assert "differs from eager" in failed.err and "not retried" in failed.err
    assert "try 2" not in failed.err


def test_a_realistic_bfloat16_export_runs_with_torch_alone(export_and_run, tmp_path):
    """The consumer contract at a real shape (bfloat16, head_dim 128, vocabulary 32000), from the manifest alone."""
    from pathlib import Path

    import torch
    from torch_only_harness import run_torch_only, run_with_kiln

    got = export_and_run("llama-realistic-bf16")
    root = Path(got["store"].removeprefix("file://"))
    manifest_path = root / got["report"]["manifest"]
    manifest = json.loads(manifest_path.read_text())
    assert manifest["runtime"]["python_free"] and manifest["model"]["config"]["dtype"] == "bfloat16"
    assert {w["dtype"] for w in manifest["weights"].values()} == {"bfloat16"}
    run_torch_only(manifest_path, root / "forwards", manifest["model"]["checkpoint"], tmp_path / "alone",
                   verify_key=got["verify_key"])
    run_with_kiln(manifest_path, root / "forwards", tmp_path / "kiln")
    alone = [torch.load(tmp_path / "alone" / f"rank{r}.pt") for r in range(2)]
    kiln_ = torch.load(tmp_path / "kiln" / "rank0.pt")
    for bucket, logits in alone[0].items():
        assert logits.dtype == torch.bfloat16 and logits.shape[-1] == 32000
        assert torch.equal(logits, alone[1][bucket])  # the all-reduced result is the same on every rank
        assert torch.equal(logits, kiln_[bucket]), f"{bucket}: torch alone and Kiln's loader differ"


def torch_alone_is_kiln(manifest_path, root, manifest, tmp_path, verify_key) -> None:
    """Every package of the export (signed by `verify_key`'s key) run by torch alone from the manifest on both
    ranks gives Kiln's loader's logits, the same on every rank."""
    import torch
    from torch_only_harness import run_torch_only, run_with_kiln

    run_torch_only(manifest_path, root / "forwards", manifest["model"]["checkpoint"], tmp_path / "alone",
                   verify_key=verify_key)
    run_with_kiln(manifest_path, root / "forwards", tmp_path / "kiln")
    alone = [torch.load(tmp_path / "alone" / f"rank{r}.pt") for r in range(2)]
    kiln_ = torch.load(tmp_path / "kiln" / "rank0.pt")
    for bucket, logits in alone[0].items():
        assert torch.equal(logits, alone[1][bucket])
        assert torch.equal(logits, kiln_[bucket]), f"{bucket}: torch alone and Kiln's loader differ"


def test_a_mixture_of_experts_export_runs_with_torch_alone(export_and_run, tmp_path):
    """The consumer contract of experts: each stacked expert constant holds layers x experts in order (its
    manifest entry lists them), which torch alone fills from the checkpoint as Kiln's loader does."""
    from pathlib import Path

    got = export_and_run("qwen3-moe")
    root = Path(got["store"].removeprefix("file://"))
    manifest_path = root / got["report"]["manifest"]
    manifest = json.loads(manifest_path.read_text())
    experts = manifest["weights"]["model.runs.0.mlp.experts.down_proj.weight"]
    assert experts["stack"] == 64 and experts["shape"] == [64, 128, 16]  # layer 0's 64 experts, half a column each
    assert experts["sources"][1]["tensor"] == "model.layers.0.mlp.experts.1.down_proj.weight"
    torch_alone_is_kiln(manifest_path, root, manifest, tmp_path, got["verify_key"])


def test_a_fused_checkpoint_export_runs_with_torch_alone(export_and_run, tmp_path):
    """The consumer contract of fused tensors: Phi-3's q, k and v constants each list qkv_proj, cut to their
    own rows (a cut at every rank, so a consumer that only cuts at tp > 1 would bind the whole tensor); torch
    alone also passes this longrope model's seq_lens."""
    from pathlib import Path

    got = export_and_run("phi3-longrope")
    root = Path(got["store"].removeprefix("file://"))
    manifest_path = root / got["report"]["manifest"]
    manifest = json.loads(manifest_path.read_text())
    k = manifest["weights"]["model.runs.0.self_attn.k_proj.weight"]
    assert k["sources"][0]["tensor"] == "model.layers.0.self_attn.qkv_proj.weight"
    assert k["sources"][0]["cut"] == {"dim": 0, "length": 64, "offsets": [256, 320]}  # after q's 256 rows
    torch_alone_is_kiln(manifest_path, root, manifest, tmp_path, got["verify_key"])


def test_a_latent_attention_export_caches_latents(export_and_run, kiln, prefect_server, tmp_path):
    """DeepSeek-V3.2's export keeps the latent cache: its interface states one entry per token of the latent, the
    rotary key and the indexer's key (kv_lora_rank + qk_rope_head_dim + index_head_dim wide, one for every head,
    not split over the ranks), and the indexer's picks as an output; `kiln verify` runs both ranks on one whole
    cache and finds their latents alike and the unsharded model's; torch alone runs it from the manifest as Kiln's
    loader does."""
    from pathlib import Path

    got = export_and_run("deepseek-v32")
    root = Path(got["store"].removeprefix("file://"))
    manifest_path = root / got["report"]["manifest"]
    manifest = json.loads(manifest_path.read_text())
    interface = manifest["forwards"][0]["interface"]
    assert interface["kv_cache"] == {"entries": ["latent_rope_and_index_key"], "heads": 1, "width": 64 + 32 + 48,
                                     "sharded": False,
                                     "dims": ["layers", "entries", "num_pages", "page_tokens", "heads", "width"]}
    shapes = {a["name"]: a["shape"] for a in interface["inputs"] + interface["outputs"]}
    # tokens is a range (1x4-8): named, with its bounds under dynamic_dims
    assert shapes["kv_cache"] == [3, 1, "num_pages", 16, 1, 144] and shapes["new_kv"] == [3, 1, 1, "tokens", 1, 144]
    assert shapes["indexer_picks"] == [3, 1, "tokens", 4]  # every layer's picks, index_topk wide
    assert interface["dynamic_dims"]["tokens"] == {"min": 4, "max": 8}
    verified = kiln("verify", "ref-deepseek-v32", "--store", got["store"], env={"PREFECT_API_URL": prefect_server})
    assert verified.code == 0 and "verify ok: 2 ranks match the unsharded model" in verified.out, verified.err[-3000:]
    torch_alone_is_kiln(manifest_path, root, manifest, tmp_path, got["verify_key"])


def test_an_image_text_export_says_what_it_left_out_and_runs_with_torch_alone(export_and_run, tmp_path):
    """The text decoder of an image-text checkpoint: the report says the vision tower was left out; the manifest
    names the checkpoint's own tensors (save_pretrained's language_model.model.*), which torch alone reads."""
    from pathlib import Path

    got = export_and_run("gemma3-image-text")
    assert any("Gemma3ForConditionalGeneration checkpoint: Kiln exported its text decoder and left out" in w
               and "vision_tower" in w for w in got["report"]["warnings"])
    root = Path(got["store"].removeprefix("file://"))
    manifest_path = root / got["report"]["manifest"]
    manifest = json.loads(manifest_path.read_text())
    assert manifest["model"]["image_text"]["prefixes"] == {"model.": "language_model.model."}
    sources = {s["tensor"] for w in manifest["weights"].values() for s in w["sources"]}
    assert sources and all(t.startswith("language_model.model.") for t in sources)
    torch_alone_is_kiln(manifest_path, root, manifest, tmp_path, got["verify_key"])


FUSED_CUTS = {
    # case: (the experts' module, a run's up constant's shape, the cuts of its first source and of down's)
    "mistral4": ("mlp", [2, 16, 16, 128],  # 2 layers x 16 experts, 16 of 32 rows each
                 {"dim": 1, "length": 16, "offsets": [32, 48]},  # after the 32 gate rows
                 {"dim": 2, "length": 16, "offsets": [0, 16]}),
    "llama4": ("feed_forward", [2, 8, 128, 32],  # layers 1 and 3 x 8 experts, 32 of 64 columns each
               {"dim": 2, "length": 32, "offsets": [64, 96]},  # after the 64 gate columns
               {"dim": 1, "length": 32, "offsets": [0, 32]}),
}


@pytest.mark.parametrize("case", sorted(FUSED_CUTS))
def test_a_fused_experts_export_runs_with_torch_alone(case, export_and_run, tmp_path):
    """The consumer contract of fused 3-D experts: each run's expert constants stack one source per layer, the
    layer's gate_up_proj cut to the rank's gate (or up) part, its down_proj to the rank's share: Mistral 4's
    [E, 2I, H] rows along dimension 1 and [E, H, I] columns along 2, Llama 4's input-major [E, H, 2I] columns
    along dimension 2 and [E, I, H] rows along 1. torch alone binds them from the checkpoint as Kiln's loader
    does."""
    from pathlib import Path

    module, shape, up_cut, down_cut = FUSED_CUTS[case]
    got = export_and_run(case)
    root = Path(got["store"].removeprefix("file://"))
    manifest_path = root / got["report"]["manifest"]
    manifest = json.loads(manifest_path.read_text())
    weights = manifest["weights"]
    run = next(n.rsplit(f".{module}.", 1)[0] for n in weights if n.endswith(f"{module}.experts.up_proj.weight"))
    up, down = (weights[f"{run}.{module}.experts.{p}_proj.weight"] for p in ("up", "down"))
    assert up["stack"] == 2 and up["shape"] == shape
    assert up["sources"][0]["tensor"] == f"model.layers.1.{module}.experts.gate_up_proj"
    assert up["sources"][0]["cut"] == up_cut and down["sources"][0]["cut"] == down_cut
    torch_alone_is_kiln(manifest_path, root, manifest, tmp_path, got["verify_key"])
