"""The right forward passes its check draw after draw, at a real router width (issue 53).

For Qwen3-MoE at Qwen3-30B-A3B's width (128 experts of 768, top 8 renormalised, hidden 2048, 32 heads over 4
KV heads of 128) and DeepSeek-V3's router (256 experts in 8 groups, the best 4 groups, top 8, scaled 2.5; at a
hidden 2048), 2 layers, every one routed, bfloat16, tp 2, bucket 1x16:

1. draw 0 is written by transformers' own class (random init, biases and norms drawn live) and exported as a
   user exports it: `kiln export --tp 2 --buckets 1x16` compiles the one weightless forward every rank shares
   and checks it against eager (its exit code and check are recorded);
2. each further draw is the same architecture from another seed: its checkpoint written by transformers, both
   ranks' weights bound to that same compiled package, each rank checked as the export checks a rank
   (kiln.host.ranks.loader.compare_with_eager: float32 forced to the forward's reported choices, each choice
   held to the dtype's slack).

Every draw's checks must pass: a correct compiled forward that rounds differently from eager, and so takes
other experts where scores are closer than bfloat16's rounding, is right. Each family's line (JSON) holds
every draw's checks per rank (diff, own, limit, choices, how many differed from float32's own), its seconds
and the measuring process's peak, the commit measured (`code`), and what was reduced from the published width (`reduced`: vocabulary,
expert width, DeepSeek's hidden size and attention; the routers are as published).

Usage: python -m bench.check_draws OUT.jsonl [--draws N] [FAMILY ...] (bench part `checks`; make bench-draws)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from bench.real_width import WIDTHS, _code


def _width(name: str, **changes) -> dict:
    """bench.real_width's published config of `name`, with `changes`."""
    return {**WIDTHS[name][2], **changes}


FAMILIES = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _width("qwen3-30b-a3b", vocab_size=32000),
                      "vocabulary 32000 (151936)"),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _width(
        "deepseek-v3", hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768,
        first_k_dense_replace=0),
        "hidden 2048 (7168), 16 heads (128), q rank 768 (1536), expert width 256 (2048), vocabulary 32000 "
        "(129280), both layers routed"),
}
"""bench.real_width's Qwen3-30B-A3B and DeepSeek-V3 (its routers as published), reduced as each says."""
LAYERS, TP, TOKENS = 2, 2, 16


def write(name: str, path: Path, seed: int) -> None:
    """Draw `seed` of family `name`, written by transformers at `path` in bfloat16 (no float32 copy)."""
    import torch
    import transformers

    from bench.hf_checkpoints import randomise

    config_cls, model_cls, fields, _ = FAMILIES[name]
    config = getattr(transformers, config_cls)(num_hidden_layers=LAYERS, **fields)
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    model = getattr(transformers, model_cls)(config).eval()
    randomise(model)
    model.save_pretrained(path)


def check_draw(path: Path, package: Path, sha256: str) -> list[dict]:
    """Each rank's check of the compiled `package` bound to the checkpoint at `path` (in this process)."""
    import torch

    from kiln.core.plan.recipe import Bucket, Recipe
    from kiln.core.run.outcome import passed
    from kiln.host.model import solo_group
    from kiln.host.ranks.loader import compare_with_eager, load_forward
    from kiln.host.weights.checkpoint import read_config
    from kiln.host.weights.rank_weights import load_rank_weights

    cfg, recipe, out = read_config(path), Recipe(), []
    for rank in range(TP):
        start = time.perf_counter()
        with solo_group(), torch.no_grad():
            weights = load_rank_weights(str(path), cfg, TP, rank)
            check = compare_with_eager(load_forward(package, weights, sha256), cfg, TP, rank, weights,
                                       Bucket(1, TOKENS), page_tokens=recipe.page_tokens,
                                       pages_per_seq=recipe.pages_per_seq, atol=recipe.verify_atol,
                                       half_ratio=recipe.verify_half_ratio)
        del weights
        out.append({"rank": rank, "passed": passed(check), "check_s": round(time.perf_counter() - start, 1),
                    **{k: check.get(k) for k in ("diff", "own", "limit", "choices", "differ", "wrong_choice")}})
    return out


def _child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.check_draws", *args], capture_output=True, text=True,
                          cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(name: str, work: Path, draws: int) -> dict:
    """Family `name`'s line: its export of draw 0, then every draw's check."""
    path, store, report = work / name / "draw", work / name / "store", work / name / "report.json"
    env = {**os.environ, "KILN_HOME": str(work / name / "home"), "PREFECT_HOME": str(work / "prefect"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / name / "inductor"), "HF_HUB_OFFLINE": "1"}
    env.pop("PREFECT_API_URL", None)
    line = {"family": name, "layers": LAYERS, "dtype": "bfloat16", "tp": TP, "bucket": f"1x{TOKENS}",
            "reduced": FAMILIES[name][3], "draws": []}
    _child("write", name, str(path), "0")
    start = time.perf_counter()
    exported = subprocess.run([sys.executable, "-m", "cli.main", "export", "--model", str(path), "--tp", str(TP),
                               "--buckets", f"1x{TOKENS}", "--store", f"file://{store}", "--export-id", name,
                               "--report", str(report)], env=env, capture_output=True, text=True, cwd=ROOT)
    line["export_s"], line["export_exit"] = round(time.perf_counter() - start, 1), exported.returncode
    if not report.exists():
        line["export_error"] = exported.stderr.strip()[-2000:]
        return line
    r = json.loads(report.read_text())
    line["export_check"] = r.get("verify")
    forward = r["forwards"][0]
    line["compile_s"] = forward.get("compile_s")
    package = work / name / "forward.pt2"
    from kiln.store import open_store

    open_store(f"file://{store}").get_file(forward["object"], package, forward["sha256"])
    for seed in range(draws):
        if seed:
            shutil.rmtree(path, ignore_errors=True)
            _child("write", name, str(path), str(seed))
        checked = _child("check", str(path), str(package), forward["sha256"])
        line["draws"].append({"seed": seed, "passed": all(c["passed"] for c in checked["ranks"]), **checked})
        print(json.dumps({"family": name, **line["draws"][-1]}), file=sys.stderr, flush=True)
    line["passed"] = sum(d["passed"] for d in line["draws"])
    line["of"] = len(line["draws"])
    return line


def main() -> int:
    if sys.argv[1:2] == ["write"]:
        write(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
        print("{}")
        return 0
    if sys.argv[1:2] == ["check"]:
        ranks = check_draw(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
        print(json.dumps({"ranks": ranks, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="JSON lines, one per family")
    ap.add_argument("families", nargs="*", default=list(FAMILIES), help=f"some of {', '.join(FAMILIES)}")
    ap.add_argument("--draws", type=int, default=10)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kiln-check-draws-"))
    for name in args.families:
        code = _code()  # what this family's export and checks run, before any of it starts
        try:
            line = measure(name, work, args.draws)
        except RuntimeError as exc:
            line = {"family": name, "error": str(exc)}
        line["code"] = code
        with args.out.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)
        shutil.rmtree(work / name, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
