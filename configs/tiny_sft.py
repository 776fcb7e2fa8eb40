"""Supervised fine-tuning of the tiny Shakespeare model on the conversation corpora that ship in pip packages.

    python -m llama_jax.train --config configs/tiny_sft.py --config.init_from=runs/tiny

Parameters come from `init_from` (the optimizer starts fresh); the tokenizer too. Conversations use the LLaMA 2 chat
template, the loss is on assistant tokens only, several conversations are packed per row with segment ids, and 2% of
the conversations are held out for validation.
"""

import os

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.load_run_config(os.path.join(os.path.dirname(__file__), "tiny.py"))
  cfg.init_from = "runs/tiny"
  cfg.data.update(
    format="chat",
    sources=("chitchat", "chatterbot:english,chinese"),
    val_sources=(),
    val_fraction=0.02,
    on_error="skip",
  )
  cfg.train.update(
    steps=600, lr=1e-3, warmup_steps=30, min_lr_ratio=0.1, log_every=50, eval_every=200, eval_batches=0, save_every=200
  )
  return cfg
