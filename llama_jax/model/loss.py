"""Losses and evaluation sums: what training, evaluation and fine-tuning share.

Every loss is a per-token cross-entropy in float32 with per-token weights (the SFT loss mask, or padding at 0), so a
batch's loss is sum(loss · weight) / sum(weight) whatever packs it, and sums from several batches or micro-batches add.
The DPO loss is built on the same cross-entropy (a response's log-prob is minus its weighted sum) and is likewise
returned as a sum over pairs with the pair count, to be divided once per step.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from llama_jax.core.model_config import ModelConfig
from llama_jax.model import moe as moe_lib
from llama_jax.model import sharding

# exp() of a mean loss past this many nats is reported as exp(50) (≈ 5e21): an early, diverging model's perplexity
# stays a finite number in logs and JSON instead of inf.
MAX_LOG_PERPLEXITY = 50.0


def token_losses(params: Any, graphdef: nnx.GraphDef, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """Per-token cross-entropy of a batch and its per-token weights: the loss of pretraining, SFT and evaluation.

  A batch's loss is sum(loss · weight) / sum(weight), so sums over several batches or micro-batches add. With the
  model's `loss_chunk` the head and the cross-entropy run over a chunk of positions at a time: see
  `losses_and_router`, which also returns a mixture of experts' balance terms.

  Args:
    params: the model's params, as ``nnx.merge`` takes them with `graphdef`.
    graphdef: the model's graph definition.
    batch: "inputs" and "targets" [B, T] token ids; optional "positions" and "segment_ids" [B, T] for the forward,
      and "weights" [B, T], such as the SFT loss mask.

  Returns:
    A tuple: the cross-entropy [B, T] in float32, and the weights [B, T] in float32, 1 where the batch has none.
  """
  losses_BT, weights_BT, _ = losses_and_router(params, graphdef, batch)
  return losses_BT, weights_BT


def losses_and_router(
  params: Any, graphdef: nnx.GraphDef, batch: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Per-token cross-entropy [B, T] (float32), the per-token weights (loss mask; 1 where absent), and a mixture of
  experts' balance terms of this batch (`moe_terms`; an empty dict for a dense model).

  With the model's `loss_chunk` > 0 the head and the cross-entropy run over that many positions at a time in a scan
  whose body is rematerialised: the backward pass recomputes a chunk's logits instead of keeping them, so at most one
  chunk's [B, loss_chunk, V] logits (and their gradient) exist at once (per context slice: `_chunked_cross_entropy`).
  The last chunk is padded; its extra positions are cut off. Each position's loss is the same function of its own
  logits row either way."""
  model = nnx.merge(graphdef, params)
  targets_BT = batch["targets"]
  x_BTD, router = model.forward(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
  chunk = model.cfg.loss_chunk
  with jax.named_scope("loss"):
    if not chunk or chunk >= x_BTD.shape[1]:
      losses_BT = _cross_entropy(model.logits(x_BTD), targets_BT)
    else:
      losses_BT = _chunked_cross_entropy(model, x_BTD, targets_BT, chunk)
    weights_BT = batch.get("weights")
    weights_BT = jnp.ones_like(losses_BT) if weights_BT is None else weights_BT.astype(jnp.float32)
  return losses_BT, weights_BT, moe_terms(router, model.cfg) if router else {}


def moe_terms(router: dict[str, jax.Array], cfg: ModelConfig) -> dict[str, jax.Array]:
  """What a mixture of experts adds to a batch's objective, from its MoE blocks' router sums: `objective`, the
  weighted balance and z losses added to the mean token loss; `moe_balance`, `moe_z` the two losses unweighted;
  `moe_imbalance` the worst layer's max/min assignments; `moe_load/<layer>` [E] that block's share of assignments per
  expert (named by block index, so with moe.every=2 they are layers 1, 3, ...); `moe_dropped` the share of
  assignments dropped (capacity path only)."""
  moe = cfg.moe
  losses = moe_lib.balance_losses(router, moe.top_k, moe.balance_loss)
  terms = dict(
    objective=moe.aux_loss_weight * losses["balance"] + moe.z_loss_weight * losses["z"],
    moe_balance=losses["balance"],
    moe_z=losses["z"],
    moe_imbalance=losses["imbalance"],
  )
  moe_layers = [layer for layer in range(cfg.n_layers) if cfg.is_moe_layer(layer)]
  terms.update({f"moe_load/{layer}": load_E for layer, load_E in zip(moe_layers, losses["load"], strict=True)})
  if "dropped" in router:
    terms["moe_dropped"] = jnp.mean(router["dropped"])
  return terms


def _cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  # log-sum-exp minus the target logit: the same value as log_softmax + gather, without a second [B, T, V] array.
  target_logits_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits_BTV, axis=-1) - target_logits_BT


def _chunked_cross_entropy(model: Any, x_BTD: jax.Array, targets_BT: jax.Array, chunk: int) -> jax.Array:
  """`losses_and_router`'s scan over chunks. With the sequence split over context axes into slices, the chunks are
  cut within each slice and every scan step takes one chunk from each ([B, slices·chunk] positions, each device its
  own chunk): chunks of the whole sequence put each step's positions on one device, so the devices took turns, and
  the head's weights were gathered and reduced at every step (BENCHMARKS.md, "Figures behind the code")."""
  batch, length = targets_BT.shape
  _, slices = sharding.context_axes()
  slices = slices if length % slices == 0 else 1
  per_slice = length // slices
  n_chunks = -(-per_slice // chunk)
  pad = n_chunks * chunk - per_slice

  def chunked(x_BT):
    """[B, T, ...] → [chunks, B, slices·chunk, ...]: chunk w of every slice side by side, each slice's last chunk
    padded."""
    rest = x_BT.shape[2:]
    padded = jnp.pad(x_BT.reshape(batch, slices, per_slice, *rest), [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * len(rest))
    by_chunk = padded.reshape(batch, slices, n_chunks, chunk, *rest)  # [B, slices, chunks, chunk, ...]
    return jnp.moveaxis(by_chunk, 2, 0).reshape(n_chunks, batch, slices * chunk, *rest)

  head = None  # model.loss_head_once "none": each chunk reads (and gathers) the head itself
  if model.cfg.loss_head_once != "none":
    head_DV, head_scale_V = model.head()
    gather = _gathered_for_every_chunk if model.cfg.loss_head_once == "weights" else _gathered
    head = gather(head_DV), head_scale_V

  @jax.checkpoint
  def one_chunk(_, inputs):
    chunk_x_BTD, chunk_targets_BT = inputs  # T: this step's slices·chunk positions
    chunk_x_BTD = sharding.constrain(chunk_x_BTD, ("activation_batch", "activation_length", "activation_embed"))
    return None, _cross_entropy(model.logits(chunk_x_BTD, head), chunk_targets_BT)

  _, chunk_losses = jax.lax.scan(one_chunk, None, (chunked(x_BTD), chunked(targets_BT)))  # [chunks, B, slices·chunk]
  losses_by_chunk = jnp.moveaxis(chunk_losses.reshape(n_chunks, batch, slices, chunk), 0, 2)
  return losses_by_chunk.reshape(batch, slices, n_chunks * chunk)[:, :, :per_slice].reshape(batch, length)


def _gathered(head_DV: jax.Array) -> jax.Array:
  """The head whole along its embedding axis (the vocabulary split as the rules say), for every chunk to read. Its
  gradient, this value's cotangent, is then accumulated whole over the chunks and reduced once
  (loss_head_once="weights_and_gradient")."""
  return sharding.constrain(head_DV, (None, "vocab"))


@jax.custom_vjp
def _gathered_for_every_chunk(head_DV: jax.Array) -> jax.Array:
  """`_gathered`, whose cotangent is constrained back to the weight's own sharding (loss_head_once="weights"): the
  compiler then reduces each chunk's gradient into the split accumulator instead of holding a whole float32 one
  (BENCHMARKS.md, "Figures behind the code")."""
  return _gathered(head_DV)


def _gathered_fwd(head_DV: jax.Array) -> tuple[jax.Array, None]:
  return _gathered(head_DV), None


def _gathered_bwd(_, grad_DV: jax.Array) -> tuple[jax.Array]:
  return (sharding.constrain(grad_DV, ("embed", "vocab")),)


_gathered_for_every_chunk.defvjp(_gathered_fwd, _gathered_bwd)


def eval_step(
  params: Any,
  batch: dict[str, jax.Array],
  token_bytes: jax.Array,
  *,
  graphdef: nnx.GraphDef,
  by_position: bool = False,
) -> dict[str, jax.Array]:
  """Sums over a batch: loss (nats), tokens, and the UTF-8 bytes those tokens stand for (for bits per byte). With
  `by_position`, also loss_by_position and tokens_by_position [T]: the same sums per position in the window (how the
  loss depends on context length, e.g. evaluated past the training length)."""
  losses, weights = token_losses(params, graphdef, batch)
  sums = dict(
    loss_sum=jnp.sum(losses * weights), tokens=jnp.sum(weights), bytes=jnp.sum(token_bytes[batch["targets"]] * weights)
  )
  if by_position:
    sums.update(loss_by_position=jnp.sum(losses * weights, axis=0), tokens_by_position=jnp.sum(weights, axis=0))
  return sums


def perplexity(mean_loss: float) -> float:
  return math.exp(min(mean_loss, MAX_LOG_PERPLEXITY))


def summarize_eval(sums: dict[str, float]) -> dict[str, float]:
  """Loss per token, perplexity and bits per byte from summed `eval_step` outputs."""
  loss = sums["loss_sum"] / max(sums["tokens"], 1.0)
  return dict(
    loss=loss, perplexity=perplexity(loss), bits_per_byte=sums["loss_sum"] / math.log(2) / max(sums["bytes"], 1.0)
  )


# ---------------------------------------------------------------------------------------------------------------------
# Preference tuning (DPO, Rafailov et al. 2023)

PREFERENCE_SIDES = ("chosen", "rejected")


def sequence_logps(
  params: Any, graphdef: nnx.GraphDef, inputs_BT: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array
) -> jax.Array:
  """Summed log-probability [B] (float32) of each row's weighted tokens: log π(response | prompt) when the weights
  are 1 exactly on the response. The same cross-entropy as the SFT loss (token_losses), so both read one model."""
  losses_BT, weights_BT = token_losses(params, graphdef, dict(inputs=inputs_BT, targets=targets_BT, weights=weights_BT))
  return -jnp.sum(losses_BT * weights_BT, axis=-1)


def _pair_logps(params: Any, graphdef: nnx.GraphDef, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """(chosen [B], rejected [B]) log-probs from ONE forward of the 2B rows: one compiled call, twice the batch.

  The rows are interleaved (pair b's chosen at 2b, its rejected at 2b + 1) rather than concatenated: with the batch
  axis sharded, each device's pairs then stay on that device, where a concatenation would move half the rows."""

  def rows(key: str) -> jax.Array:
    x_B2T = jnp.stack([batch[f"{side}_{key}"] for side in PREFERENCE_SIDES], axis=1)
    return x_B2T.reshape(-1, x_B2T.shape[-1])

  logps_2B = sequence_logps(params, graphdef, rows("inputs"), rows("targets"), rows("weights"))
  logps_B2 = logps_2B.reshape(-1, 2)
  return logps_B2[:, 0], logps_B2[:, 1]


def dpo_losses(
  params: Any, graphdef: nnx.GraphDef, batch: dict[str, jax.Array], *, beta: float, reference_params: Any
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """The DPO loss of a batch of preference pairs, summed, with the pair count and the metric sums.

  Per pair: -log σ(β((π_w − π_l) − (ref_w − ref_l))), where π is the policy's summed log-prob of a response and ref
  the reference's, which gets no gradient. Both sides of every pair run in one forward of the 2B rows. Sums, not
  means, so micro-batches add up; the caller divides by the pair count. Padding pairs, with no weighted token on
  either side as eval_batches pads them, count nothing.

  Metric sums: reward_chosen = β(π_w − ref_w), reward_rejected = β(π_l − ref_l), margin = their difference,
  reward_accuracy = 1 when reward_chosen > reward_rejected, 0 when below, and 0.5 for a tie. At step 0 the policy is
  the reference, every reward is exactly 0 and every pair ties: the loss reads log 2 ≈ 0.693 and accuracy 0.5, not
  0, which would read as "always wrong". Also chosen_logps and rejected_logps, π_w and π_l: a DPO run that lowers
  both is a known failure mode that the margin alone hides.

  Args:
    params: the policy's params, as ``nnx.merge`` takes them with `graphdef`.
    graphdef: the model's graph definition, shared by the policy and the reference.
    batch: chosen_inputs, chosen_targets, chosen_weights and the same three for rejected, each [B, T]; the weights
      are 1 exactly on the response's tokens.
    beta: β, how far the policy may move from the reference.
    reference_params: the reference's params for the same graphdef, e.g. the frozen initial parameters, or with LoRA
      the base with zeroed adapters.

  Returns:
    A tuple: the loss summed over the valid pairs, their count, and a dict of the metric sums over them.
  """
  chosen_B, rejected_B = _pair_logps(params, graphdef, batch)
  ref_chosen_B, ref_rejected_B = jax.lax.stop_gradient(
    _pair_logps(jax.lax.stop_gradient(reference_params), graphdef, batch)
  )
  with jax.named_scope("dpo_loss"):
    valid_B = (
      (jnp.sum(batch["chosen_weights"], axis=-1) > 0) & (jnp.sum(batch["rejected_weights"], axis=-1) > 0)
    ).astype(jnp.float32)
    reward_chosen_B = beta * (chosen_B - ref_chosen_B)
    reward_rejected_B = beta * (rejected_B - ref_rejected_B)
    margin_B = reward_chosen_B - reward_rejected_B
    # log_sigmoid is -softplus(-x): finite for any margin, where log(sigmoid(x)) underflows to -inf past x ≈ -88.
    losses_B = -jax.nn.log_sigmoid(margin_B)
    accuracy_B = jnp.where(margin_B > 0, 1.0, jnp.where(margin_B == 0, 0.5, 0.0))

    def total(x_B):
      return jnp.sum(x_B * valid_B)

  metrics = dict(
    reward_chosen=total(reward_chosen_B),
    reward_rejected=total(reward_rejected_B),
    reward_accuracy=total(accuracy_B),
    margin=total(margin_B),
    chosen_logps=total(chosen_B),
    rejected_logps=total(rejected_B),
  )
  return total(losses_B), jnp.sum(valid_B), metrics


def dpo_eval_step(
  params: Any, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef, beta: float, reference_params: Any
) -> dict[str, jax.Array]:
  """Sums over a batch of held-out pairs: loss_sum, pairs and the metric sums of `dpo_losses` (they add over
  batches; `summarize_dpo` turns the totals into means)."""
  loss_sum, pairs, metrics = dpo_losses(params, graphdef, batch, beta=beta, reference_params=reference_params)
  return dict(loss_sum=loss_sum, pairs=pairs, **metrics)


def summarize_dpo(sums: dict[str, float]) -> dict[str, float]:
  """Means per pair of summed `dpo_eval_step` outputs: loss, rewards, reward accuracy, margin, log-probs."""
  pairs = max(sums["pairs"], 1.0)
  means = {k: v / pairs for k, v in sums.items() if k not in ("loss_sum", "pairs")}
  return dict(loss=sums["loss_sum"] / pairs, **means)
