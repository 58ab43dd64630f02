"""DeepSeek-V4's compile time against depth: each segment of layers is one scanned body (kiln.core.model.layer_runs).

`python -m bench.v4_depth OUT_DIR [LAYERS,...]` compiles the 1x8 forward of a small DeepSeek-V4 (the
reference test's width: hidden 128, 4 heads of 64, 8 experts, hc_mult 3) with the config's default
schedule (transformers' DeepseekV4Config: two HCA layers, then HCA and CSA in turn; the first three layers
hash-routed), at each depth (default 4, 16 and 32), each in a fresh process with a fresh Inductor cache, and
writes OUT_DIR/v4-depth.json: {layers: {'compile_s', 'peak_mib', 'segments'}}. From 16 layers on, the
alternating layers are one segment whose body runs an HCA and a CSA layer. Not part of bench.suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DEPTHS = (4, 16, 32)
V4 = dict(model_type="deepseek_v4", vocab_size=512, hidden_size=128, moe_intermediate_size=48, num_attention_heads=4,
          head_dim=64, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=8, routed_scaling_factor=1.5,
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, hc_mult=3,
          hc_sinkhorn_iters=6, sliding_window=8, o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32,
          index_topk=3, partial_rotary_factor=0.25, swiglu_limit=0.6, max_position_embeddings=256,
          compress_rope_theta=1000.0)


def compile_one(layers: int, out: Path) -> dict:
    """Compile the 1x8 forward at `layers` in this process, as a compile worker does."""
    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.model.hf_config import from_hf
    from kiln.core.model.layer_runs import segments
    from kiln.core.plan.recipe import Bucket
    from kiln.core.forwards.shape_ranges import static_shape
    from kiln.host.compile.compiler import _warm, compile_forward
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS

    _warm()
    cfg = from_hf({**V4, "num_hidden_layers": layers})
    spec = forward_spec(shapes=static_shape(Bucket(1, 8)), graph={"config": cfg.to_dict(), "tp": 1,
                                                                  "code": model_code_fingerprint()},
                        target="bench", torch_version="bench", page_tokens=16, pages_per_seq=4,
                        compiler=COMPILER_OPTIONS).to_dict()
    result = compile_forward(spec, str(out / f"v4-{layers}.pt2"))
    return {"compile_s": result.compile_s, "peak_mib": result.peak_mib,
            "segments": [[s.start, s.stop, s.period] for s in segments(cfg)]}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    if len(sys.argv) > 3 and sys.argv[2] == "one":
        print(json.dumps(compile_one(int(sys.argv[3]), out)))
        sys.exit(0)
    depths = [int(d) for d in sys.argv[2].split(",")] if len(sys.argv) > 2 else list(DEPTHS)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for layers in depths:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(out / f"inductor-{layers}")}
        proc = subprocess.run([sys.executable, "-m", "bench.v4_depth", str(out), "one", str(layers)], env=env,
                              capture_output=True, text=True, check=True)
        results[layers] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{layers} layers: {results[layers]}", flush=True)
    (out / "v4-depth.json").write_text(json.dumps(results, indent=2))
