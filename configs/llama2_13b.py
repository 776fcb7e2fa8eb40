"""LLaMA 2 13B (Meta's hyper-parameters): 13,015,864,320 parameters."""

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.base_run_config()
  cfg.model.update(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, multiple_of=256,
                   norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096, tie_embeddings=False,
                   dtype="bfloat16", param_dtype="float32", remat="dots_no_batch")
  return cfg
