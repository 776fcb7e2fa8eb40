"""Mixtral 8x7B's shape (Mistral AI's hyper-parameters): 46,702,792,704 parameters, 12,879,925,248 of them active
per token (top-2 of 8 SwiGLU experts in every block), 8 kv heads, RoPE θ 1,000,000, 32,768-token context.

Trained here at 4,096 tokens per sequence, 64 sequences per step (the 7B preset's 262,144 tokens), bf16 compute
with float32 parameters and full rematerialisation, on a Cloud TPU v5p-128 slice (64 chips): experts over an expert
axis of 4 (2 experts per chip), everything else FSDP over the other 16. `python -m llama_jax.plan --config
configs/mixtral_8x7b.py --topology v5p-128` puts the step at 24.4 GiB per chip (dropless exchange;
docs/guides/moe.md). The balance-loss weight is Mixtral's released router_aux_loss_coef (0.02). To fine-tune the
released weights, convert them (`python -m llama_jax.convert --from_hf`) and pass `--config.init_from=DIR`; their
config must equal this one."""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "llama2_7b.py"))
  cfg.model.update(
    n_kv_heads=8,
    ffn_hidden_dim=14336,
    rope_theta=1_000_000.0,
    max_seq_len=32768,
  )
  cfg.model.moe.update(num_experts=8, top_k=2, aux_loss_weight=0.02)
  cfg.mesh.update(data=1, fsdp=-1, expert=4, tensor=1)
  return cfg
