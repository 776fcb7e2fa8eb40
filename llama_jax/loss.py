"""Losses and evaluation sums: what training, evaluation and fine-tuning share.

Every loss is a per-token cross-entropy in float32 with per-token weights (the SFT loss mask, or padding at 0), so a
batch's loss is sum(loss · weight) / sum(weight) whatever packs it, and sums from several batches or micro-batches add.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# exp() of a mean loss past this many nats is reported as exp(50) (≈ 5e21): an early, diverging model's perplexity
# stays a finite number in logs and JSON instead of inf.
MAX_LOG_PERPLEXITY = 50.0


def token_losses(params: Any, graphdef: nnx.GraphDef, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """Per-token cross-entropy [B, T] (float32) and the per-token weights (loss mask; 1 where absent)."""
  model = nnx.merge(graphdef, params)
  logits_BTV = model(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
  with jax.named_scope("loss"):
    targets_BT = batch["targets"]
    # log-sum-exp minus the target logit: the same value as log_softmax + gather, without a second [B, T, V] array.
    target_logits_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    losses_BT = jax.nn.logsumexp(logits_BTV, axis=-1) - target_logits_BT
    weights_BT = batch.get("weights")
    weights_BT = jnp.ones_like(losses_BT) if weights_BT is None else weights_BT.astype(jnp.float32)
  return losses_BT, weights_BT


def eval_step(
  params: Any, batch: dict[str, jax.Array], token_bytes: jax.Array, *, graphdef: nnx.GraphDef
) -> dict[str, jax.Array]:
  """Sums over a batch: loss (nats), tokens, and the UTF-8 bytes those tokens stand for (for bits per byte)."""
  losses, weights = token_losses(params, graphdef, batch)
  return dict(
    loss_sum=jnp.sum(losses * weights), tokens=jnp.sum(weights), bytes=jnp.sum(token_bytes[batch["targets"]] * weights)
  )


def perplexity(mean_loss: float) -> float:
  return math.exp(min(mean_loss, MAX_LOG_PERPLEXITY))


def summarize_eval(sums: dict[str, float]) -> dict[str, float]:
  """Loss per token, perplexity and bits per byte from summed `eval_step` outputs."""
  loss = sums["loss_sum"] / max(sums["tokens"], 1.0)
  return dict(
    loss=loss, perplexity=perplexity(loss), bits_per_byte=sums["loss_sum"] / math.log(2) / max(sums["bytes"], 1.0)
  )
