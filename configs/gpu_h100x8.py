"""LLaMA 2 7B pretraining on one node of 8 NVIDIA H100 (80 GB) GPUs.

FSDP over the 8 GPUs: params + AdamW moments are 6.74e9 × 12 bytes / 8 = 9.4 GiB per GPU; 8 sequences × 4096 tokens
per GPU under full rematerialisation; cuDNN flash attention in bfloat16. Global batch 64 × 4096 = 262,144 tokens.
`python -m llama_jax.plan --config configs/gpu_h100x8.py --devices 8` shows the per-GPU plan. For several nodes run
launch/gpu.sh on each (it passes --coordinator_address/--num_processes/--process_id) and set --config.mesh.fsdp=-1
or --config.mesh.dcn_data=<nodes> to keep FSDP inside a node.
"""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "llama2_7b.py"))
  cfg.mesh.update(data=1, fsdp=8, tensor=1)
  cfg.train.update(batch_size=64, seq_len=4096)
  cfg.model.attention = "auto"  # cuDNN flash attention on GPU
  return cfg
