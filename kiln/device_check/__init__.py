"""The device check: `python -m kiln.device_check --device cuda --json FILE` (or `--device cpu`).

Purpose: every claim Kiln makes about a device, measured on that device with
Kiln's own compile, load and compare code, in one run that needs only torch,
transformers, safetensors and psutil (no Prefect, store, boto3, dask or
cryptography, no network). Each step appends one JSON line to FILE as it
finishes, {"step", "ok", "seconds", ...its figures}, with the error's text
when it failed, so a run cut short still leaves what was done:

- `versions`: Python, torch, CUDA, Triton, transformers; the torch APIs Kiln
  relies on (load_constants' parameters); on a GPU its name, arch and the size
  of one process's CUDA context;
- `compile_tiny`: the tiny model (kiln.core.model.config.TINY), one bucket, compiled
  for the device in a compile worker (kiln.host.compile.compiler.CompilePool): seconds,
  host and device peak of the worker, and the package against eager;
- `hf_checkpoint` and `compile_hf`: a random-init transformers LlamaForCausalLM
  (bfloat16, head_dim 128, GQA, 4 layers) saved with save_pretrained, compiled
  at tp 1 in float32 and bfloat16, at tp 2, and for a decode step;
- `tp1_vs_transformers`: max |logit diff| of the tp 1 packages against
  transformers on the device, in float32 and bfloat16;
- `tp2_gloo`: the tp 2 package as two ranks on one device under gloo: ranks
  equal, and equal to the unsharded model;
- `nccl_rank0` (GPU only): rank 0 of the tp 2 package under a one-rank NCCL
  group, in a fresh interpreter that has torch alone;
- `decode_time`: a decode step's time, package against eager;
- `tuning` (GPU only): max-autotune GEMMs measured on a first compile, none on
  a second.

`--quick` narrows the transformers model (CI's CPU run). The module layout:
`__main__` runs the steps and writes the lines, `steps` holds them,
`llama` builds the transformers model and its reference logits, `ranks` runs
the tp 2 ranks and the torch-only NCCL script.
"""
