"""The export call: how a forward spec becomes a program, and a program a package.

Purpose: what lies between a forward's spec and its package besides the model
code itself: the model built in the config's dtype with storage that is never
read, its example inputs at the hint, the dynamic dimensions (batch and tokens
over the forward's range, the KV page count) and their bounds,
torch.export, the constants metadata and the Inductor call with the spec's
options.

Contracts: runs in a compile worker (imports torch), under the collectives'
group (kiln.host.model.solo_group), on the graph's device
(kiln.host.compile.inductor_options.forward_device: 'cpu' or 'cuda', the worker's
current GPU). This module is a key source
(kiln.host.compile.key_sources), hashed whole: the pool, retries, file handling and
error messages stay in kiln.host.compile.compiler, so editing them keeps every key.
"""

from __future__ import annotations

import json

from kiln.host.compile.inductor_options import forward_device

CONSTANTS_METADATA = "kiln.constants"
"""Package metadata key: JSON {name: [dtype, shape, 'weight' | 'buffer']} of the module's tensors compiled for."""

MAX_PAGES = 1 << 24
"""Upper bound of the dynamic KV page count a package accepts."""


def dynamic_shapes(inputs: dict, num_args: int, slots: bool = False) -> tuple:
    """torch.export's dynamic_shapes of the forward's `num_args` inputs (tokens, start_pos, kv_cache,
    block_table[, seq_lens]; with `slots`, DeepSeek-V4's tokens, start_pos, kv_cache, slots): batch and tokens
    as Dims over the spec's [min, max] where those differ (static where equal), the KV page (slot) count
    always dynamic."""
    from torch.export import Dim

    (b0, b1), (t0, t1) = inputs["batch"], inputs["tokens"]
    batch = Dim("batch", min=b0, max=b1) if b0 < b1 else None
    tokens = Dim("tokens", min=t0, max=t1) if t0 < t1 else None
    per_seq = {0: batch} if batch is not None else {}
    first = {**per_seq, **({1: tokens} if tokens is not None else {})}
    if slots:  # DeepSeek-V4: kv_cache [num_slots, slot_values], slots [batch]
        return (first, per_seq, {0: Dim("num_slots", min=2, max=MAX_PAGES)}, per_seq)
    num_pages = Dim("num_pages", min=2, max=MAX_PAGES)
    return (first, per_seq, {2: num_pages}, per_seq, *[per_seq] * (num_args - 4))


def export_forward(spec: dict):
    """The torch.export program of one forward over its range of shapes (an ExportedProgram), traced at its
    hint, its tensors on the graph's device."""
    import torch

    from kiln.core.model.config import ModelConfig
    from kiln.core.model.shares import share_rank
    from kiln.host.model import decoder_of, example_inputs

    cfg = ModelConfig(**spec["graph"]["config"])
    tp, rank = spec["graph"]["tp"], share_rank(spec["graph"])  # the rank shape it is for (kiln.core.model.shares)
    inputs = spec["inputs"]
    device = forward_device(spec["graph"])
    # Built on the meta device, then given storage that is never touched: the worker's memory depends on
    # the graph, not on the weights (the package holds none of them anyway).
    with torch.device("meta"):
        model = decoder_of(cfg, tp, rank=rank).to(getattr(torch, cfg.dtype)).eval()
    model = model.to_empty(device=device)
    args = example_inputs(cfg, tp, *inputs["hint"], page_tokens=inputs["page_tokens"],
                          pages_per_seq=inputs["pages_per_seq"], num_pages=inputs["pages_per_seq"] + 2, rank=rank)
    args = tuple(a.to(device) for a in args)
    with torch.no_grad():
        return torch.export.export(model, args, dynamic_shapes=dynamic_shapes(inputs, len(args), cfg.v4 is not None))


def compile_package(program, package_path: str, options: dict) -> None:
    """AOTInductor-compile `program` with the Inductor `options` into `package_path`.

    The package records the dtype and shape of each constant it expects, so a
    loader can refuse weights that do not fit (load_constants would take them
    and compute garbage), and keeps every constant, however small, as one the
    loader supplies.
    """
    import torch

    constants = {name: [str(t.dtype).removeprefix("torch."), list(t.shape), kind]
                 for kind, tensors in (("buffer", program.constants), ("weight", program.state_dict))
                 for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    # A weightless package must read every weight at run time: Inductor would otherwise inline a constant of
    # at most 8 values (DeepSeek-V4's hyper-head base and scale) into its kernels at the placeholder's value.
    configs = {**options, "always_keep_tensor_constants": True,
               "aot_inductor.metadata": {CONSTANTS_METADATA: json.dumps(constants)}}
    torch._inductor.aoti_compile_and_package(program, package_path=package_path, inductor_configs=configs)
