"""Tiny LLaMA for the CPU demo: trains on Shakespeare in minutes on two cores."""

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.base_run_config()
  cfg.model.update(vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, multiple_of=32, max_seq_len=256,
                   tie_embeddings=True, dtype="bfloat16", param_dtype="float32")
  return cfg
