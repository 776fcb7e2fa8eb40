"""The tiny demo model with a mixture of experts in every block, at the dense model's active parameters: 8 SwiGLU
experts of width 176, top-2, so each token runs 2 × 176 = 352 hidden units, the dense tiny MLP's width (plus a
128 × 8 router per layer). Same data, batch and schedule as configs/tiny.py, so both see the same tokens.

    python -m llama_jax.train --config configs/tiny_moe.py --workdir runs/tiny_moe
    python -m llama_jax.train --config configs/tiny_moe.py --workdir runs/tiny_moe_nobalance \\
        --config.model.moe.aux_loss_weight=0
    python -m llama_jax.viz experts runs/tiny_moe runs/tiny_moe_nobalance --out experts.png
"""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "tiny.py"))
  cfg.model.update(ffn_hidden_dim=176)
  cfg.model.moe.update(num_experts=8, top_k=2, aux_loss_weight=0.01)
  return cfg
