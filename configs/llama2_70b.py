"""LLaMA 2 70B (Meta's hyper-parameters: 8 kv heads, ffn_dim_multiplier 1.3, multiple_of 4096): 68,976,648,192
parameters. The tensor axis must divide the 8 kv heads."""

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.base_run_config()
  cfg.model.update(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096,
                   ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096,
                   tie_embeddings=False, dtype="bfloat16", param_dtype="float32", remat="full")
  cfg.mesh.update(data=1, fsdp=-1, tensor=8)
  return cfg
