"""gpt-oss's own parts against transformers' GptOssForCausalLM, in eager mode (its whole model: test_eager_reference's
cases `gpt-oss` and `gpt-oss-bf16`; at tp 3 with decode: test_uneven_tp; exported: test_export_run)."""

from __future__ import annotations

import torch
from hf_models import write_case
from test_eager_reference import moved_by

from kiln.host.model import ShardedDecoder
from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights


def test_each_way_of_computing_its_experts_computes_the_same(hf_root):
    """kiln.host.model.layers.oss_experts: in float32 one token alone gathers its experts' stacked weights, the
    same token among many runs every expert over every token; in bfloat16 the grouped multiplies over the pairs
    sorted by expert match each pair's gathered expert."""
    from kiln.host.model.layers import oss_experts as oss

    path = write_case("gpt-oss", hf_root)
    cfg = inspect_checkpoint(path)
    model = ShardedDecoder(cfg, 1).eval()
    model.load_state_dict(load_rank_weights(path, cfg, 1, 0), strict=True)
    layer = {n: w[0] for n, w in model.model.runs[0].stacked().items()}
    half = {n: w.to(torch.bfloat16) for n, w in layer.items()}
    many = cfg.num_experts // cfg.experts_per_token + 1
    assert oss.GATHER_BELOW * cfg.experts_per_token <= cfg.num_experts < many * cfg.experts_per_token
    h = torch.randn(1, many, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    x = h[0].bfloat16()
    assert not oss._groups_trace(h[0], layer[oss.GATE_UP], layer[oss.DOWN])
    assert oss._groups_trace(x, half[oss.GATE_UP], half[oss.DOWN])
    with torch.no_grad():
        alone = oss.oss_experts(cfg, 1, layer, h[:, :1])
        among = oss.oss_experts(cfg, 1, layer, h)
        _, chosen = oss.route(cfg, half, x)
        pairs = oss._grouped(cfg, x, chosen, half[oss.GATE_UP], half[oss.GATE_UP_BIAS], half[oss.DOWN]).float()
        flat = chosen.reshape(-1)
        rows = x.repeat_interleave(chosen.shape[1], dim=0)[:, None]
        gathered = torch.bmm(oss.swiglu(cfg, torch.bmm(rows, half[oss.GATE_UP][flat])
                                        + half[oss.GATE_UP_BIAS][flat][:, None]), half[oss.DOWN][flat])[:, 0].float()
    assert float(alone.abs().max()) > 1e-2
    assert float((alone - among[:, :1]).abs().max()) < 1e-5
    assert float((pairs - gathered).abs().max()) < 1e-2 * float(gathered.abs().max())


def test_the_sinks_matter(hf_root):
    """A sink takes its share of each head's softmax: with every sink pushed to -1e4 (a share of 0), the logits
    move; the reference case draws them N(0, 1), as a trained model's are not negligible."""
    assert moved_by("gpt-oss", hf_root, "self_attn.sinks", lambda w: torch.full_like(w, -1e4)) > 1e-2
