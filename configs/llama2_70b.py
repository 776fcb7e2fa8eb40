"""LLaMA 2 70B (Meta's hyper-parameters: 8 kv heads, ffn_dim_multiplier 1.3, multiple_of 4096): 68,976,648,192
parameters. The 7B preset with the 70B sizes; the tensor axis must divide the 8 kv heads."""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "llama2_7b.py"))
  cfg.model.update(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3,
                   remat="full")
  cfg.mesh.update(data=1, fsdp=-1, tensor=8)
  return cfg
