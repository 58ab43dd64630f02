"""`kiln run`: greedy decoding with an export's compiled forwards, across all its ranks.

The export is fetched and checked as `kiln verify` checks it (signature,
sha256, package members), then `tp` spawned processes join one gloo group;
each loads every forward through the checked loader with its own weight
shard and keeps its own paged KV cache (its share of the KV heads). The
prompt is fed in the export's buckets as a server would (kiln.core.run.decode), then
one decode step per new token; each step runs on the forward whose range holds
its bucket, chosen by the consumer contract's rule (kiln.core.forwards.shape_ranges.choose_forward). Rank 0 picks each token (argmax of the last
position's logits) and broadcasts it, so every rank feeds the same one. That
broadcast runs on a process group of its own: the default world group belongs
to the packages' collectives (kiln.host.model.host_group says why).
"""

from __future__ import annotations

import json
import os

from cli.verify import open_export
from kiln.core.model.cache_layout import cache_layout
from kiln.core.run.decode import check_request, prefill_steps, refills_cache, step_bucket
from kiln.core.trust.manifest import manifest_device
from kiln.core.plan.recipe import Bucket, parse_buckets
from kiln.core.forwards.shape_ranges import choose_forward, parse_shape_range
from kiln.host.ranks.verify_ranks import RankLink, join_ranks, rank_artifacts, rank_device, spawn_ranks


def run_export(store_url: str | None, export_id: str, *, prompt: list[int], max_new_tokens: int,
               json_path: str | None = None, **options) -> dict:
    """Decode `max_new_tokens` tokens after `prompt`; returns {'prompt', 'generated', 'logits'}.

    `logits` holds, for each generated token, the full-vocabulary logits (as
    floats) of the position that chose it. `options` are open_export's.
    """
    manifest, checkpoint, cfg, artifacts, _ = open_export(store_url, export_id, "run", **options)
    recipe = manifest["recipe"]
    check_request(prompt, max_new_tokens, vocab_size=cfg.vocab_size, context_tokens=recipe["max_context_tokens"])
    job = {"checkpoint": str(checkpoint), "s3_endpoint": options.get("s3_endpoint"), "config": cfg.to_dict(),
           "artifacts": artifacts, "buckets": ",".join(manifest["buckets"]), "prompt": prompt,
           "device": manifest_device(manifest),
           "max_new_tokens": max_new_tokens, "page_tokens": recipe["page_tokens"],
           "pages_per_seq": recipe["max_context_tokens"] // recipe["page_tokens"]}
    result = spawn_ranks(_run_rank, manifest["tp"], job, timeout_s=1800)[0]
    out = {"prompt": list(prompt), "generated": result["generated"], "logits": result["logits"]}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f)
    return out


def _run_rank(rank: int, tp: int, rendezvous: str, job: dict, link: RankLink) -> dict | None:
    """One rank of `kiln run` (kiln.host.ranks.verify_ranks.spawn_ranks): rank 0 returns the tokens and logits."""
    import torch
    import torch.distributed as dist

    from kiln.core.model.config import ModelConfig
    from kiln.host.weights.rank_weights import load_rank_weights
    from kiln.host.ranks.loader import load_forward, place_weights
    from kiln.host.model import host_group

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    link.doing("joining the gloo group")
    join_ranks(rank, tp, rendezvous)
    cfg = ModelConfig(**job["config"])
    link.doing("loading weights")
    device = rank_device(job["device"], rank)
    # One copy of the rank's weights on its device, bound by every bucket's package (kiln.host.ranks.loader).
    weights = place_weights(load_rank_weights(job["checkpoint"], cfg, tp, rank, s3_endpoint=job.get("s3_endpoint")),
                            device)
    link.doing("loading the forwards")
    forwards = {parse_shape_range(name): load_forward(art["path"], weights, art["sha256"], device=device)
                for name, art in rank_artifacts(job["artifacts"], rank).items()}
    side = host_group()
    generated, logits = _decode(forwards, cfg, tp, job, torch, dist, side, link, device, rank)
    link.doing("leaving the gloo group")
    dist.barrier(group=side)
    dist.destroy_process_group()
    return {"generated": generated, "logits": logits} if rank == 0 else None


def _decode(forwards: dict, cfg, tp: int, job: dict, torch, dist, side,
            link: RankLink, device: str, rank: int = 0) -> tuple[list[int], list]:
    """The decode loop of one rank: prefill in chunks of the export's buckets, then one step per token, each on
    the forward (`forwards`: ShapeRange -> loaded package) the contract's rule picks; the cache is this rank's,
    on `device` with every step's inputs. Each step says its forward and position on `link`
    (kiln.host.ranks.verify_ranks.RankLink)."""
    page_tokens, pages_per_seq = job["page_tokens"], job["pages_per_seq"]
    dtype = getattr(torch, cfg.dtype)
    layout = cache_layout(cfg, tp, page_tokens * pages_per_seq, rank)  # its own KV heads
    # Sequence 0 owns pages 0..pages_per_seq-1 (a slot cache: slot 0, of 2, the fewest a forward takes);
    # padding rows of a wider bucket read the same pages or slot, write none.
    cache = torch.zeros(layout.shape(cfg.num_layers, pages_per_seq + 1 if layout.paged else 2, page_tokens),
                        dtype=dtype, device=device)
    pages = torch.arange(pages_per_seq, device=device)
    buckets = list(parse_buckets(job["buckets"]))
    sequence = list(job["prompt"])
    generated, logits_out = [], []

    def step(start: int, count: int, bucket: Bucket, length: int) -> torch.Tensor:
        tokens = torch.zeros(bucket.batch, bucket.tokens, dtype=torch.int64, device=device)
        tokens[0, :count] = torch.tensor(sequence[start:start + count])
        start_pos = torch.zeros(bucket.batch, dtype=torch.int64, device=device)
        start_pos[0] = start
        table = pages[None].expand(bucket.batch, -1).contiguous() if layout.paged \
            else torch.zeros(bucket.batch, dtype=torch.int64, device=device)
        # A rope that goes by the sequence's length sees what transformers sees in one call: the whole prompt's
        # length while the prompt is fed, a decoded token's position + 1 after.
        lengths = [torch.full((bucket.batch,), length, dtype=torch.int64, device=device)] \
            if cfg.length_dependent_rope else []
        shapes = choose_forward(forwards, bucket)
        link.doing(f"running forward {shapes} as {bucket} on positions {start}..{start + count - 1}")
        with torch.no_grad():
            logits, new_kv = forwards[shapes](tokens, start_pos, cache, table, *lengths)[:2]  # then its choices
        if not layout.paged:  # the sequence's slot after the step replaces it
            cache[0] = new_kv[0]
        for i in range(count if layout.paged else 0):  # the real tokens' entries (keys and values, or latents)
            pos = start + i
            cache[:, :, pos // page_tokens, pos % page_tokens] = new_kv[:, :, 0, i]
        return logits[0, count - 1].float().cpu()

    for s in prefill_steps(buckets, len(sequence), padded=layout.paged):
        last = step(s.start, s.count, s.bucket, len(job["prompt"]))
    for n in range(job["max_new_tokens"]):
        choice = torch.tensor([int(last.argmax())])
        dist.broadcast(choice, src=0, group=side)  # every rank feeds rank 0's choice (a CPU tensor: gloo)  # every rank feeds rank 0's choice
        generated.append(int(choice))
        logits_out.append(last.tolist())
        if n + 1 == job["max_new_tokens"]:
            break
        sequence.append(int(choice))
        if refills_cache(cfg, len(sequence)):  # longrope's switch: every key again, under the long factors
            for s in prefill_steps(buckets, len(sequence)):
                last = step(s.start, s.count, s.bucket, len(sequence))
        else:
            last = step(len(sequence) - 1, 1, step_bucket(buckets, 1, padded=layout.paged), len(sequence))
    return generated, logits_out
