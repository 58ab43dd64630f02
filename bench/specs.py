"""The forward spec a bench compiles: a model, its tp, one bucket and its paging, with Kiln's compiler options."""

from __future__ import annotations


def bench_spec(cfg, *, tp: int, bucket: tuple[int, int] = (1, 1), page_tokens: int, pages_per_seq: int,
               share: dict | None = None) -> dict:
    """kiln.core.forwards.forward_keys.forward_spec of `cfg` at `bucket` (batch, tokens), target and torch 'bench';
    `share`: the rank shape it is for where tp splits unevenly (kiln.core.model.shares.graph_shares)."""
    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.plan.recipe import Bucket
    from kiln.core.forwards.shape_ranges import static_shape
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS

    graph = {"config": cfg.to_dict(), "tp": tp, "code": model_code_fingerprint(), **({"share": share} if share else {})}
    return forward_spec(shapes=static_shape(Bucket(*bucket)), graph=graph,
                        target="bench", torch_version="bench", page_tokens=page_tokens, pages_per_seq=pages_per_seq,
                        compiler=COMPILER_OPTIONS).to_dict()
