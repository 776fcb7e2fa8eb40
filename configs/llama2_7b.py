"""LLaMA 2 7B (Meta's hyper-parameters): 6,738,415,616 parameters."""

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.base_run_config()
  cfg.model.update(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, multiple_of=256,
                   norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096, tie_embeddings=False,
                   dtype="bfloat16", param_dtype="float32", remat="dots_no_batch")
  return cfg
