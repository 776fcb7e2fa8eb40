"""The optimizer of every run: AdamW with weight decay on matrices only, linear warmup + cosine decay, global-norm
clipping (LLaMA 2's recipe: β1 0.9, β2 0.95, decay 0.1, clipping at 1.0, cosine to 10% of the peak)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from llama_jax.core.run_config import TrainConfig


def decay_mask(params: Any) -> Any:
  """AdamW weight decay on matrices only: norm scales (stored stacked, so 2-D) are excluded by name."""
  return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) != "scale", params)


def learning_rate_schedule(train_cfg: TrainConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=train_cfg.lr,
    warmup_steps=train_cfg.warmup_steps,
    decay_steps=max(train_cfg.steps, train_cfg.warmup_steps + 1),
    end_value=train_cfg.lr * train_cfg.min_lr_ratio,
  )


def make_optimizer(train_cfg: TrainConfig) -> optax.GradientTransformation:
  """The optimizer of a run: AdamW on the learning rate schedule, after global-norm clipping when it is set.

  AdamW uses the config's β1, β2, eps and weight decay, with the decay applied to matrices only (`decay_mask`). The
  learning rate warms up linearly from 0 to ``lr`` over ``warmup_steps``, then follows a cosine decay to
  ``lr * min_lr_ratio`` at ``steps`` (`learning_rate_schedule`).

  Args:
    train_cfg: the run config's train section: ``lr``, ``warmup_steps``, ``steps``, ``min_lr_ratio``, ``b1``, ``b2``,
      ``eps``, ``weight_decay`` and ``clip_norm``, where 0 turns clipping off.

  Returns:
    The optax transformation: ``clip_by_global_norm(clip_norm)`` chained before AdamW, or AdamW alone.
  """
  adamw = optax.adamw(
    learning_rate_schedule(train_cfg),
    b1=train_cfg.b1,
    b2=train_cfg.b2,
    eps=train_cfg.eps,
    weight_decay=train_cfg.weight_decay,
    mask=decay_mask,
  )
  if train_cfg.clip_norm:
    return optax.chain(optax.clip_by_global_norm(train_cfg.clip_norm), adamw)
  return adamw
