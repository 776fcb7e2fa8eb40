"""LLaMA 2 13B (Meta's hyper-parameters): 13,015,864,320 parameters, on a Cloud TPU v4-64 slice (32 chips, 32 GiB HBM
each). The 7B preset with the 13B sizes: pure FSDP over the 32 chips, 2 sequences × 4096 tokens per chip, full
rematerialisation; global batch 64 × 4096. `python -m llama_jax.plan --config configs/llama2_13b.py --devices 32`
shows the per-chip plan."""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "llama2_7b.py"))
  cfg.model.update(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40)
  cfg.mesh.update(data=1, fsdp=-1, tensor=1)
  cfg.train.update(batch_size=64, seq_len=4096)
  return cfg
