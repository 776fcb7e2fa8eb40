"""LLaMA 2 7B pretraining on a Cloud TPU v4-32 slice: 16 chips (4 hosts × 4), 32 GiB HBM each.

Pure FSDP over the 16 chips: float32 params + AdamW moments are 6.74e9 × 12 bytes / 16 = 4.7 GiB per chip; the rest
of HBM holds the activations of 4 sequences × 4096 tokens per chip under full rematerialisation. Global batch
64 × 4096 = 262,144 tokens per step. `python -m llama_jax.plan --config configs/tpu_v4.py --devices 16` shows the
per-chip plan (BENCHMARKS.md has its output). Point data.sources and data.tokenizer at your corpus and its
sentencepiece model (multi-host runs need a prepared tokenizer), and --workdir at a gs:// path.
"""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "llama2_7b.py"))
  cfg.mesh.update(data=1, fsdp=16, tensor=1)
  cfg.train.update(batch_size=64, seq_len=4096)
  cfg.model.attention = "auto"  # splash attention on TPU
  return cfg
