"""Llama 3.2 1B (Meta's hyper-parameters): 1,235,814,400 parameters with the embedding tied to the LM head (262.7M of
them are the 128,256 × 2,048 embedding); 16 layers, 32 heads, 8 kv heads, MLP 8,192 (multiple_of 256,
ffn_dim_multiplier 1.5), RoPE θ 500,000 with llama3 scaling at factor 32 (the 1B and 3B releases' factor), 131,072
positions.

Pure FSDP with full rematerialisation, 32 sequences × 8,192 tokens per step on a Cloud TPU v5e-8 slice (8 chips,
16 GiB each): 4 sequences per chip. The vocabulary's logits dominate a model this small; with the loss in chunks of
1,024 positions (the 8B preset's model.loss_chunk) `python -m llama_jax.plan --config configs/llama3.2_1b.py
--devices 8` puts the step at 15.0 GiB per chip, against 40.0 GiB with the whole-sequence loss."""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "llama3_8b.py"))
  cfg.model.update(
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    multiple_of=256,
    ffn_dim_multiplier=1.5,
    rope_scaling_factor=32.0,
    tie_embeddings=True,
  )
  return cfg
