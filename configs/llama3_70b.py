"""Llama 3.1 70B (Meta's hyper-parameters): 70,553,706,496 parameters; the 8B preset's vocabulary, kv heads and
RoPE scaling with the 70B sizes (dim 8,192, 80 layers, 64 heads, MLP 28,672 from multiple_of 4,096 and
ffn_dim_multiplier 1.3).

On a Cloud TPU v5p-128 slice (64 chips): pure FSDP, full rematerialisation, 1 sequence × 8,192 tokens per chip; global
batch 64 × 8,192 = 524,288 tokens (the LLaMA 2 70B preset's tokens per step).
`python -m llama_jax.plan --config configs/llama3_70b.py --devices 64` puts it at 55.6 GiB per chip (the loss in
chunks of 1,024 positions, as the 8B preset; 59.2 GiB with the whole-sequence loss)."""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "llama3_8b.py"))
  cfg.model.update(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3)
  cfg.train.update(batch_size=64, seq_len=8192)
  return cfg
