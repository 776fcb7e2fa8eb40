"""Llama 3.1 8B (Meta's hyper-parameters): 8,030,261,248 parameters, 128,256-token vocabulary, 8 kv heads,
RoPE θ 500,000 with llama3 scaling (factor 8, low/high frequency factors 1 and 4, original context 8,192), so
positions up to 131,072 (max_seq_len) keep the released model's frequencies.

Trained here at 8,192 tokens per sequence: 32 sequences per step = 262,144 tokens, the 7B preset's tokens per step.
Pure FSDP with full rematerialisation on a Cloud TPU v4-32 slice (16 chips, 32 GiB each): 2 sequences per chip. The
128,256-entry vocabulary makes a sequence's float32 logits 4 GiB, so the loss runs in chunks of 1,024 positions
(model.loss_chunk): `python -m llama_jax.plan --config configs/llama3_8b.py --devices 16` puts the step at 24.6 GiB
per chip, against 36.0 GiB with the whole-sequence loss. To fine-tune the
released weights, convert them (`python -m llama_jax.convert --from_hf` or `--from_meta`) and pass
`--config.init_from=DIR`; their config must equal this one."""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "llama2_7b.py"))
  cfg.model.update(
    vocab_size=128256,
    n_kv_heads=8,
    multiple_of=1024,
    ffn_dim_multiplier=1.3,
    rope_theta=500000.0,
    rope_scaling="llama3",
    rope_scaling_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_len=8192,
    max_seq_len=131072,
    loss_chunk=1024,
  )
  cfg.mesh.update(data=1, fsdp=-1, tensor=1)
  cfg.train.update(seq_len=8192, batch_size=32)
  return cfg
