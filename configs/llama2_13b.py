"""LLaMA 2 13B (Meta's hyper-parameters): 13,015,864,320 parameters. The 7B preset with the 13B sizes."""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "llama2_7b.py"))
  cfg.model.update(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40)
  return cfg
