"""LLaMA 2 7B (Meta's hyper-parameters): 6,738,415,616 parameters, 4096-token sequences.

Full rematerialisation (only each layer's input is kept for the backward pass): at 4 sequences × 4096 tokens per
device, `python -m llama_jax.plan` puts the saved matmul outputs of "dots_no_batch" at ~96 GiB of temporaries per
device against ~17 GiB with "full". The slice-specific configs (tpu_v4.py, gpu_h100x8.py) start from this one."""

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.base_run_config()
  cfg.model.update(
    vocab_size=32000,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=32,
    multiple_of=256,
    norm_eps=1e-5,
    rope_theta=10000.0,
    max_seq_len=4096,
    tie_embeddings=False,
    dtype="bfloat16",
    param_dtype="float32",
    remat="full",
  )
  cfg.train.update(
    seq_len=4096,
    batch_size=64,
    warmup_steps=2000,
    steps=250_000,
    lr=3e-4,
    save_every=1000,
    eval_every=2000,
    log_every=50,
  )
  return cfg
