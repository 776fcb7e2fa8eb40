"""The pure train step: ``train_step(state, batch) -> (state, metrics)``, gradient accumulation by a scan over
micro-batches, the objectives a run trains (next-token cross-entropy, DPO), and the evaluation step beside it. Nothing
here is compiled or placed: ``trainer.Trainer`` jits these for a mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from llama_jax.model import lora as lora_lib
from llama_jax.model.loss import dpo_eval_step, dpo_losses, eval_step, losses_and_router

State = dict[str, Any]  # {"step": int32[], "params": pure dict, "opt_state": optax state, "rng": uint32[2]}


def train_step(
  state: State,
  batch: dict[str, jax.Array],
  frozen: dict[str, Any] | None = None,
  *,
  objective: Callable,
  count_name: str,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  grad_accum: int,
) -> tuple[State, dict]:
  """One optimizer step on a global batch, split into `grad_accum` micro-batches scanned in order.

  Gradients are of the *summed* loss and divided by the total count, weighted tokens or preference pairs, at the
  end, so accumulation gives the gradient of the whole batch's mean loss, whatever the split. A non-finite loss or
  gradient norm never reaches the state: the step keeps the old parameters and optimizer moments, still counts the
  step, and reports it in the ``nonfinite`` metric. Pure and not compiled: ``trainer.Trainer`` jits it for a mesh.

  Args:
    state: the train state: ``step``, ``params``, ``opt_state`` and ``rng``.
    batch: the global batch, each array's leading axis divisible by `grad_accum`.
    frozen: what the step reads but never trains or donates: a LoRA run's base model, a DPO run's reference.
    objective: ``objective(params, micro, frozen) -> (loss sum, (count, metric sums))``, see `make_objective`.
    count_name: the metric name of the count, e.g. ``tokens`` or ``pairs``.
    tx: the optimizer, as `optimizer.make_optimizer` builds it.
    schedule: the learning rate schedule, read at the state's step for the ``lr`` metric.
    grad_accum: the number of micro-batches; 1 runs the whole batch at once, with no scan.

  Returns:
    The new state and the step's metrics: ``loss`` and each of the objective's metric sums as means over the count,
    ``grad_norm``, ``lr``, the count under `count_name`, and ``nonfinite``, 1 when the update was dropped.
  """
  params = state["params"]
  grad_fn = jax.value_and_grad(lambda params, micro: objective(params, micro, frozen), has_aux=True)
  if grad_accum == 1:
    (loss_sum, (count, sums)), grads = grad_fn(params, batch)
  else:
    micro_batches = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

    def accumulate(carry, micro):
      (loss_sum, (count, sums)), grads = grad_fn(params, micro)
      return jax.tree.map(jnp.add, carry, (loss_sum, count, sums, grads)), None

    shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro_batches))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), (shapes[0][0], *shapes[0][1], shapes[1]))
    (loss_sum, count, sums, grads), _ = jax.lax.scan(accumulate, zeros, micro_batches)
  denominator = jnp.maximum(count, 1.0)
  grads = jax.tree.map(lambda g, p: (g / denominator).astype(p.dtype), grads, params)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = tx.update(grads, state["opt_state"], params)
  # A non-finite loss or gradient (a diverging lr, a bad batch) never reaches the state: the step keeps the old
  # parameters and moments, so no checkpoint can hold NaNs (the loop's NonFiniteHook then stops or skips).
  finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
  keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
  new_params, opt_state = keep(optax.apply_updates(params, updates), params), keep(opt_state, state["opt_state"])
  new_state = dict(state, step=state["step"] + 1, params=new_params, opt_state=opt_state)
  metrics = dict(
    loss=loss_sum / denominator,
    **{name: total / denominator for name, total in sums.items()},
    grad_norm=grad_norm,
    lr=schedule(state["step"]),
    **{count_name: count},
    nonfinite=(~finite).astype(jnp.int32),
  )
  return new_state, metrics


def make_objective(graphdef: nnx.GraphDef, dpo_beta: float | None) -> Callable:
  """The loss a run trains: next-token cross-entropy (pretraining, SFT; plus a mixture of experts' weighted balance
  losses, as transformers' Mixtral adds them, with the losses and expert loads as metrics), or with `dpo_beta` the
  DPO loss of preference pairs. With LoRA (`frozen["base"]`) the policy is the base plus the trained adapters and
  DPO's reference is the base alone (the adapters at zero: no second copy of the model); otherwise the reference is
  `frozen["reference"]`, the initial parameters."""

  def objective(params, micro, frozen):
    policy = policy_params(params, frozen)
    if dpo_beta is None:
      losses, weights, moe = losses_and_router(policy, graphdef, micro)
      count = jnp.sum(weights)
      # A mixture of experts' balance losses are means over the micro-batch: weighted by its count like the token
      # losses, so the step's division by the whole count averages them over micro-batches too.
      objective_sum = jnp.sum(losses * weights) + moe.pop("objective", 0.0) * count
      return objective_sum, (count, {name: value * count for name, value in moe.items()})
    reference = reference_params(params, frozen)
    loss_sum, pairs, sums = dpo_losses(policy, graphdef, micro, beta=dpo_beta, reference_params=reference)
    return loss_sum, (pairs, sums)

  return objective


def policy_params(params: Any, frozen: dict[str, Any] | None) -> Any:
  """The params the model runs with: the trained ones, joined to the frozen base in a LoRA run."""
  return lora_lib.with_frozen(params, (frozen or {}).get("base"))


def reference_params(params: Any, frozen: dict[str, Any]) -> Any:
  """DPO's reference: the frozen initial parameters, or in a LoRA run the base with the adapters at zero."""
  if "base" not in frozen:
    return frozen["reference"]
  return lora_lib.with_frozen(jax.tree.map(jnp.zeros_like, params), frozen["base"])


def eval_step_with_frozen(
  params: Any, batch: dict[str, jax.Array], token_bytes: jax.Array, frozen: dict[str, Any], *, graphdef, beta
) -> dict[str, jax.Array]:
  """Evaluation sums of a batch for the model a run trains: token losses, or with DPO's `beta` the pair metrics
  against the run's reference (see `make_objective`)."""
  policy = policy_params(params, frozen)
  if beta is None:
    return eval_step(policy, batch, token_bytes, graphdef=graphdef)
  reference = reference_params(params, frozen)
  return dpo_eval_step(policy, batch, graphdef=graphdef, beta=beta, reference_params=reference)
