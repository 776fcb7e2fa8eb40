"""Tiny LLaMA for the CPU demo: a 1.3M-parameter model trained on Shakespeare in minutes on two cores.

The run is token-bound (about 1.8M training tokens), so a *small* model wins the 15-minute budget; validation is on
four held-out plays, removed from the training documents.
"""

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.base_run_config()
  cfg.model.update(
    vocab_size=4096,
    dim=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    multiple_of=32,
    max_seq_len=256,
    tie_embeddings=True,
    dtype="float32",
    param_dtype="float32",
    # Four layers unroll cheaply, and XLA then fuses across them: ~13% faster per step on CPU.
    scan_layers=False,
  )
  cfg.data.update(
    sources=("shakespeare",), val_sources=("shakespeare:hamlet,macbeth,tempest,twelfth_night",), vocab_size=4096
  )
  # float32 compute: this CPU has no bf16 matmul units, so bf16 only adds conversions.
  cfg.train.update(
    batch_size=8,
    seq_len=256,
    steps=2000,
    lr=3e-3,
    warmup_steps=100,
    min_lr_ratio=0.1,
    weight_decay=0.1,
    log_every=50,
    eval_every=500,
    eval_batches=0,
    save_every=500,
  )
  return cfg
