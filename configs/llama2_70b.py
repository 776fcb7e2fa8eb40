"""LLaMA 2 70B (Meta's hyper-parameters: 8 kv heads, ffn_dim_multiplier 1.3, multiple_of 4096): 68,976,648,192
parameters, on a Cloud TPU v5p-128 slice (64 chips, 95 GiB HBM each).

Pure FSDP over the 64 chips (params + AdamW moments 12.1 GiB per chip), 2 sequences × 4096 tokens per chip, full
rematerialisation; global batch 128 × 4096 = 524,288 tokens. Tensor parallelism (mesh.tensor, which must divide the
8 kv heads) trades parameter memory for activations: the planner puts fsdp 32 × tensor 4 on 128 chips at 69 GiB per
chip against 25 GiB for fsdp 128, because activations are replicated over the tensor axis.
`python -m llama_jax.plan --config configs/llama2_70b.py --devices 64` shows the per-chip plan."""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "llama2_7b.py"))
  cfg.model.update(
    dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3, remat="full"
  )
  cfg.mesh.update(data=1, fsdp=-1, tensor=1)
  cfg.train.update(batch_size=128, seq_len=4096)
  return cfg
