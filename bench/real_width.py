"""Every family at a real width, in its published dtype (issue 42): does the export's own check pass, and
does `kiln run` compute what transformers computes?

For each family: a 2-layer checkpoint written by transformers' own class at
the published model's width (random init, norms randomised, bfloat16,
`save_pretrained`; nothing downloaded), then, as a user runs it:

1. `kiln export --model DIR --tp 2 --buckets 1x16`: its check compares the
   compiled forward with eager at that width (exit 1 when it fails; exit 3
   when the gate says the check would not fit this machine's memory);
2. `kiln run` on a 16-token prompt: the logits of its first new token;
3. transformers on the same checkpoint and prompt, in float32 and in bfloat16;
4. for a mixture of experts, the check must still catch a wrong forward at this
   width: rank 1's compiled package bound to its weights with one expert's down
   projection sign-flipped (the expert the check's inputs choose most in the last
   layer), compared with eager on the right weights as the export's check does.

Each family's line (JSON, appended to --out as it finishes) holds the export's
exit code and check (diff, limit, choices), its compile seconds, and the first
step's max |logit difference| from transformers' float32 logits for Kiln and
for transformers' own bfloat16 run, with the float32 logits' scale and whether
the three agree on the next token. Where a published width cannot fit this
machine, the line says what was reduced (`reduced`).

Usage: .venv/bin/python bench/real_width.py [FAMILY ...] [--workdir DIR] [--out FILE]
(make bench-widths; each family takes minutes and up to ~14 GiB; run it on a quiet machine)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}

WIDTHS = {
    # name: (transformers config class, model class, config, what is reduced from the published width)
    "llama31-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, rope_parameters=LLAMA3_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-5), None),
    "qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False), None),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=40960,
        rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[]), None),
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=32768,
        rms_norm_eps=1e-5), None),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
        n_group=8, topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, moe_intermediate_size=256, intermediate_size=2048, vocab_size=32000,
        max_position_embeddings=4096, rms_norm_eps=1e-6),
        "expert width 256 (published 2048), dense MLP 2048 (18432), vocabulary 32000 (129280): at the published "
        "widths one layer of 256 experts alone is 11 B parameters"),
    "gemma3-4b": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        vocab_size=262144, query_pre_attn_scalar=256, sliding_window=1024,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        max_position_embeddings=131072, rms_norm_eps=1e-6), None),
    "phi3-mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=4096,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=32000), None),
}
"""2 layers each. Published widths: Llama 3.1 8B, Qwen3 8B, Qwen3-30B-A3B, Mixtral 8x7B, DeepSeek-V3 (reduced as
said), Gemma 3 4B (one sliding, one full layer), Phi-3 mini."""

LAYERS = 2
PROMPT_TOKENS = 16


def write_checkpoint(name: str, path: Path) -> dict:
    """Write family `name`'s checkpoint at `path` (in this process: run it in a child); its parameter count."""
    import torch
    import transformers

    config_cls, model_cls, fields, _ = WIDTHS[name]
    config = getattr(transformers, config_cls)(num_hidden_layers=LAYERS, **fields)
    config.dtype = torch.bfloat16
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # never a float32 copy of the whole model
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms away from 1, so they matter
        for pname, p in model.named_parameters():
            if "norm" in pname and pname.endswith("weight"):
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if "gemma" in name else 1.0))
    model.save_pretrained(path)
    return {"parameters": sum(p.numel() for p in model.parameters())}


def reference(path: Path, prompt: list[int], kiln_logits: list[float]) -> dict:
    """transformers' last-position logits of `prompt` in float32 and bfloat16 (in this process: run it in a
    child), against Kiln's."""
    import torch
    import transformers

    config = json.loads((path / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    logits = {}
    for dtype in ("float32", "bfloat16"):
        model = cls.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        with torch.no_grad():
            logits[dtype] = model(torch.tensor([prompt])).logits[0, -1].float()
        del model
    exact, ours = logits["float32"], torch.tensor(kiln_logits)
    return {"kiln_vs_float32": float((ours - exact).abs().max()),
            "transformers_bfloat16_vs_float32": float((logits["bfloat16"] - exact).abs().max()),
            "float32_logit_scale": float(exact.abs().max()),
            "next_token": {"kiln": int(ours.argmax()), "float32": int(exact.argmax()),
                           "bfloat16": int(logits["bfloat16"].argmax())}}


def wrong_forward(path: Path, store_url: str, report: Path) -> dict:
    """The export's check (rank 1 alone, as the flow checks a rank) of its compiled forward bound to weights with
    one expert's down projection sign-flipped (in this process: run it in a child)."""
    import collections

    import torch

    from kiln.core.model.config import ModelConfig
    from kiln.core.model.contract import EXPERTS
    from kiln.core.plan.recipe import Bucket, Recipe
    from kiln.core.run import outcome
    from kiln.host.weights.checkpoint import read_config
    from kiln.host.ranks.loader import compare_with_eager, eager_model, load_forward
    from kiln.host.model import example_inputs, solo_group
    from kiln.host.ranks.routing_ties import ChoiceProbe, probing
    from kiln.host.weights.rank_weights import load_rank_weights
    from kiln.store import open_store

    forward = json.loads(report.read_text())["forwards"][0]
    package = report.parent / "rank1.pt2"
    open_store(store_url).get_file(forward["object"], package, forward["sha256"])
    cfg: ModelConfig = read_config(path)
    recipe, tp, rank, bucket = Recipe(), 2, 1, Bucket(1, PROMPT_TOKENS)
    check = dict(page_tokens=recipe.page_tokens, pages_per_seq=recipe.pages_per_seq, atol=recipe.verify_atol,
                 half_ratio=recipe.verify_half_ratio)
    with solo_group(), torch.no_grad():
        weights = load_rank_weights(str(path), cfg, tp, rank)
        args = example_inputs(cfg, tp, bucket.batch, bucket.tokens, page_tokens=recipe.page_tokens,
                              pages_per_seq=recipe.pages_per_seq,
                              num_pages=recipe.pages_per_seq * bucket.batch + 3, seed=1)  # compare_with_eager's
        with probing(ChoiceProbe()) as seen:
            eager_model(cfg, tp, weights)(*args)
        expert = collections.Counter(seen.chosen["experts"][-1].flatten().tolist()).most_common(1)[0][0]
        module, (_, _, down) = EXPERTS[cfg.architecture]
        name = sorted(n for n in weights if n.endswith(f".{module}.experts.{down}.weight"))[-1]
        flipped = dict(weights)
        flipped[name] = weights[name].clone()
        flipped[name][-cfg.num_experts + expert] *= -1  # the last layer of the last run of expert layers
        right = compare_with_eager(load_forward(package, weights, forward["sha256"]), cfg, tp, rank, weights,
                                   bucket, **check)
        wrong = compare_with_eager(load_forward(package, flipped, forward["sha256"]), cfg, tp, rank, weights,
                                   bucket, **check)
    keep = ("diff", "own", "limit", "choices", "differ", "wrong_choice")
    return {"sign_flip": {"expert": expert, "tensor": name, "right": {k: right.get(k) for k in keep},
                          "wrong": {k: wrong.get(k) for k in keep}, "caught": not outcome.passed(wrong)}}


def _child(*args: str) -> dict:
    """Run this script's `args` step in a fresh process; its JSON answer."""
    proc = subprocess.run([sys.executable, "-m", "bench.real_width", *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kiln(args: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "cli.main", *args], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    return proc, round(time.perf_counter() - start, 1)


def measure(name: str, work: Path) -> dict:
    """One family's line: its export, its first step and transformers' own bfloat16 error."""
    path, store = work / name / "checkpoint", work / name / "store"
    env = {**os.environ, "KILN_HOME": str(work / name / "home"), "PREFECT_HOME": str(work / "prefect"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / name / "inductor"), "HF_HUB_OFFLINE": "1"}
    env.pop("PREFECT_API_URL", None)
    line = {"family": name, "layers": LAYERS, "dtype": "bfloat16", "tp": 2, "bucket": f"1x{PROMPT_TOKENS}",
            "reduced": WIDTHS[name][3], **_child("write", name, str(path))}
    report = work / name / "report.json"
    exported, line["export_s"] = _kiln(["export", "--model", str(path), "--tp", "2", "--buckets",
                                        f"1x{PROMPT_TOKENS}", "--store", f"file://{store}", "--export-id", name,
                                        "--report", str(report)], env)
    line["export_exit"] = exported.returncode
    if report.exists():
        r = json.loads(report.read_text())
        line["check"] = r.get("verify")
        line["compile_s"] = [f.get("compile_s") for f in r.get("forwards", [])]
    if exported.returncode:
        line["export_error"] = exported.stderr.strip().splitlines()[-1] if exported.stderr.strip() else ""
        return line
    prompt = [(7919 * i + 13) % 30000 + 100 for i in range(PROMPT_TOKENS)]
    out = work / name / "run.json"
    ran, line["run_s"] = _kiln(["run", name, "--store", f"file://{store}", "--tokens", ",".join(map(str, prompt)),
                                "--max-new-tokens", "1", "--json", str(out)], env)
    if ran.returncode:
        line["run_error"] = ran.stderr.strip()[-2000:]
        return line
    (work / name / "prompt.json").write_text(json.dumps(prompt))
    line.update(_child("reference", str(path), str(work / name / "prompt.json"), str(out)))
    if "Moe" in WIDTHS[name][1] or "Mixtral" in WIDTHS[name][1] or "Deepseek" in WIDTHS[name][1]:
        line.update(_child("wrong", str(path), f"file://{store}", str(report)))
    return line


def _code() -> str:
    """The commit measured, with '+changes' when the working tree differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "write":
        print(json.dumps(write_checkpoint(sys.argv[2], Path(sys.argv[3]))))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "wrong":
        print(json.dumps(wrong_forward(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "reference":
        prompt = json.loads(Path(sys.argv[3]).read_text())
        logits = json.loads(Path(sys.argv[4]).read_text())["logits"][0]
        print(json.dumps(reference(Path(sys.argv[2]), prompt, logits)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=list(WIDTHS), help=f"some of {', '.join(WIDTHS)}")
    ap.add_argument("--workdir", type=Path, default=None, help="where checkpoints and stores go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                    f"real-width-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.jsonl")
    ap.add_argument("--keep", action="store_true", help="keep each family's checkpoint and store")
    args = ap.parse_args()
    unknown = [f for f in args.families if f not in WIDTHS]
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {', '.join(WIDTHS)}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kiln-real-width-"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.families:
        code = _code()  # what this family's export runs, before any of it starts
        try:
            line = measure(name, work)
        except RuntimeError as exc:
            line = {"family": name, "error": str(exc)}
        line["code"] = code
        with args.out.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)
        if not args.keep:
            shutil.rmtree(work / name, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
