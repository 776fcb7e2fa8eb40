"""The optimizer step of a run, in process on one CPU device: gradient accumulation equals one big batch, and the
AdamW update (β1, β2, eps, weight decay on matrices only, global-norm clipping, warmup + cosine) equals a numpy
AdamW written out here."""

import math

import jax
import numpy as np
import optax
import pytest

from llama_jax.core import run_config as run_config_lib
from llama_jax.model import sharding
from llama_jax.training.trainer import Trainer

VOCAB, SEQ_LEN, BATCH = 64, 16, 8


def tiny_trainer(**train) -> Trainer:
  # A Python loop over the layers and whole-sequence attention: the same step, compiled in half the time on CPU.
  run_config = run_config_lib.RunConfig().replace(
    model=dict(
      vocab_size=VOCAB,
      dim=32,
      n_layers=2,
      n_heads=2,
      n_kv_heads=1,
      multiple_of=16,
      max_seq_len=SEQ_LEN,
      scan_layers=False,
      attention="xla",
    ),
    train={**dict(batch_size=BATCH, seq_len=SEQ_LEN, steps=10, warmup_steps=1, lr=1e-2), **train},
  )
  return Trainer(run_config.model, run_config, sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1]))


def random_params(trainer: Trainer, seed: int = 0) -> dict:
  """Parameters of the trainer's model, drawn in numpy (jitting the model's own init costs seconds per trainer)."""
  rng = np.random.default_rng(seed)
  shapes = trainer.abstract_state()["params"]
  return jax.tree.map(lambda a: (0.02 * rng.standard_normal(a.shape)).astype(a.dtype), shapes)


def random_batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
  """Batches whose rows carry very different numbers of weighted tokens (as SFT loss masks do), so that averaging
  per micro-batch instead of over the whole batch would change the gradient."""
  rng = np.random.default_rng(seed)
  density = np.linspace(0.05, 1.0, BATCH)[:, None]
  return [
    dict(
      inputs=rng.integers(0, VOCAB, (BATCH, SEQ_LEN), dtype=np.int32),
      targets=rng.integers(0, VOCAB, (BATCH, SEQ_LEN), dtype=np.int32),
      weights=(rng.random((BATCH, SEQ_LEN)) < density).astype(np.float32),
    )
    for _ in range(n)
  ]


def train_steps(grad_accum: int, batches) -> tuple[dict, list[dict]]:
  trainer = tiny_trainer(grad_accum=grad_accum)
  params = random_params(trainer)
  state = dict(step=np.int32(0), params=params, opt_state=trainer.tx.init(params), rng=np.zeros(2, np.uint32))
  state, metrics = jax.device_put(state, trainer.state_shardings), []
  for batch in batches:
    state, step_metrics = trainer.train_step(state, trainer.global_batch(batch))
    metrics.append(jax.device_get(step_metrics))
  return jax.device_get(state["params"]), metrics


def test_gradient_accumulation_equals_one_big_batch():
  batches = random_batches(3)
  params_1, metrics_1 = train_steps(1, batches)
  for grad_accum in (2, 4):
    params, metrics = train_steps(grad_accum, batches)
    for step, (got, want) in enumerate(zip(metrics, metrics_1), start=1):
      # The loss and the (pre-clipping) gradient norm are of the whole batch, whatever the split: a gradient scaled
      # by the number of micro-batches would hide behind clipping and Adam's scale invariance, but not here.
      for key in ("loss", "grad_norm", "tokens"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), (grad_accum, step, key)
    for path, want in jax.tree_util.tree_leaves_with_path(params_1):
      got = params
      for key in path:
        got = got[key.key]
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=f"grad_accum {grad_accum}: {path}")


def reference_adamw(params, grad_steps, *, lr, warmup, steps, min_lr_ratio, b1, b2, eps, weight_decay, clip_norm):
  """AdamW as in Loshchilov & Hutter, in float64 over flat {name: array} dicts: the gradient clipped to a global norm,
  Adam moments with bias correction, decoupled weight decay on matrices only, at a warmup + cosine learning rate."""
  params = {k: v.astype(np.float64) for k, v in params.items()}
  mu = {k: np.zeros_like(v) for k, v in params.items()}
  nu = {k: np.zeros_like(v) for k, v in params.items()}
  for count, grads in enumerate(grad_steps):
    if count < warmup:
      rate = lr * count / warmup
    else:
      end = lr * min_lr_ratio
      rate = end + (lr - end) * 0.5 * (1 + math.cos(math.pi * (count - warmup) / (steps - warmup)))
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    scale = min(1.0, clip_norm / norm)
    t = count + 1
    for name, p in params.items():
      g = grads[name].astype(np.float64) * scale
      mu[name] = b1 * mu[name] + (1 - b1) * g
      nu[name] = b2 * nu[name] + (1 - b2) * g * g
      adam = (mu[name] / (1 - b1**t)) / (np.sqrt(nu[name] / (1 - b2**t)) + eps)
      # A matrix is a parameter with ≥ 2 axes per layer (layer parameters are stacked on a leading axis): the norm
      # scales are vectors and are not decayed.
      per_layer_ndim = p.ndim - (1 if name.startswith("layers/") else 0)
      decay = weight_decay * p if per_layer_ndim >= 2 else 0.0
      params[name] = p - rate * (adam + decay)
  return params


def flat(tree) -> dict[str, np.ndarray]:
  return {"/".join(k.key for k in path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_adamw_step_matches_a_numpy_adamw_with_decay_on_matrices_only():
  # Settings away from the defaults, so each one is seen to be used; eps large enough to matter for small gradients.
  settings = dict(
    lr=0.1, warmup_steps=2, steps=10, min_lr_ratio=0.1, b1=0.8, b2=0.9, eps=1e-3, weight_decay=0.3, clip_norm=0.5
  )
  trainer = tiny_trainer(**settings)
  params = random_params(trainer)
  assert any(name.endswith("scale") for name in flat(params))  # norm scales are there, to be left undecayed
  rng = np.random.default_rng(1)
  # Global norms ≈ 100, 0.1, 1, 0.01: clipped, not clipped, clipped, not clipped; counts 0..3 cover warmup (lr 0 at
  # count 0, half at 1) and the start of the cosine.
  grad_steps = [
    jax.tree.map(lambda p, s=s: (s * rng.standard_normal(p.shape)).astype(np.float32), params)
    for s in (1.0, 1e-3, 1e-2, 1e-4)
  ]
  opt_state, got, update = trainer.tx.init(params), params, jax.jit(trainer.tx.update)
  for grads in grad_steps:
    updates, opt_state = update(grads, opt_state, got)
    got = jax.device_get(optax.apply_updates(got, updates))
  want = reference_adamw(
    flat(params),
    [flat(g) for g in grad_steps],
    lr=settings["lr"],
    warmup=settings["warmup_steps"],
    steps=settings["steps"],
    min_lr_ratio=settings["min_lr_ratio"],
    b1=settings["b1"],
    b2=settings["b2"],
    eps=settings["eps"],
    weight_decay=settings["weight_decay"],
    clip_norm=settings["clip_norm"],
  )
  for name, value in flat(got).items():
    np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
