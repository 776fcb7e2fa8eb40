"""Training: a pure, jitted ``train_step(state, batch) -> (state, metrics)``, evaluation, and the loop around them.

    python -m llama_jax.train --config configs/tiny.py [--workdir DIR] [--config.train.steps=...]

The loop is restartable: rerunning the same command with the same workdir resumes from the latest complete
checkpoint, with the same data order, and reaches bit-identical parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import signal
import sys
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from llama_jax import checkpoint as checkpoint_lib
from llama_jax import data as data_lib
from llama_jax import sharding
from llama_jax.config import ConfigError, ModelConfig, model_config_from
from llama_jax.model import Llama

_log = logging.getLogger(__name__)
# Tests set this to a step number: the process kills itself right after that step's async save starts.
KILL_AFTER_SAVE_ENV = "LLAMA_JAX_TEST_KILL_AFTER_SAVE"
State = dict[str, Any]  # {"step": int32[], "params": pure dict, "opt_state": optax state, "rng": uint32[2]}

# Dense bf16 peak FLOP/s per chip, for MFU when train.peak_flops_per_device is 0.
PEAK_FLOPS_BY_DEVICE_KIND = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
    "NVIDIA H100": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100": 312e12,
}


# ---------------------------------------------------------------------------------------------------------------------
# Optimizer and FLOPs


def decay_mask(params: Any) -> Any:
  """AdamW weight decay on matrices only: norm scales (stored stacked, so 2-D) are excluded by name."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) != "scale", params)


def learning_rate_schedule(train_cfg) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train_cfg.lr, warmup_steps=train_cfg.warmup_steps,
      decay_steps=max(train_cfg.steps, train_cfg.warmup_steps + 1), end_value=train_cfg.lr * train_cfg.min_lr_ratio)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
  adamw = optax.adamw(learning_rate_schedule(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2, eps=train_cfg.eps,
                      weight_decay=train_cfg.weight_decay, mask=decay_mask)
  if train_cfg.clip_norm:
    return optax.chain(optax.clip_by_global_norm(train_cfg.clip_norm), adamw)
  return adamw


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward = 3 × forward): 6 per matmul weight, plus attention's QKᵀ and PV
  (counted in full, as PaLM's MFU does, though the causal half is masked)."""
  d, h = cfg.dim, cfg.head_dim
  per_layer = d * h * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.hidden_dim
  matmul_weights = cfg.n_layers * per_layer + cfg.vocab_size * d  # + LM head; the embedding lookup is no matmul
  return 6.0 * matmul_weights + 12.0 * cfg.n_layers * cfg.n_heads * h * seq_len


def peak_flops_per_device(configured: float) -> float:
  if configured:
    return configured
  kind = jax.devices()[0].device_kind
  for name, flops in PEAK_FLOPS_BY_DEVICE_KIND.items():
    if kind.startswith(name):
      return flops
  return measured_matmul_flops()


@functools.lru_cache(maxsize=1)
def measured_matmul_flops(size: int = 1024, repeats: int = 5) -> float:
  """A float32 matmul's FLOP/s on this device: the peak MFU is quoted against on CPU."""
  a = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


# ---------------------------------------------------------------------------------------------------------------------
# Steps


def token_losses(params: Any, graphdef: nnx.GraphDef, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """Per-token cross-entropy [B, T] (float32) and the per-token weights (loss mask; 1 where absent)."""
  model = nnx.merge(graphdef, params)
  logits = model(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
  targets = batch["targets"]
  # log-sum-exp minus the target logit: the same value as log_softmax + gather, without a second [B, T, V] array.
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  losses = jax.nn.logsumexp(logits, axis=-1) - target_logits
  weights = batch.get("weights")
  weights = jnp.ones_like(losses) if weights is None else weights.astype(jnp.float32)
  return losses, weights


def train_step(state: State, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
               tx: optax.GradientTransformation, schedule: optax.Schedule, grad_accum: int) -> tuple[State, dict]:
  """One optimizer step on a global batch, split into `grad_accum` micro-batches scanned in order.

  Gradients are of the *summed* token loss and divided by the total weight at the end, so accumulation gives the
  gradient of the whole batch's mean loss, whatever the split.
  """
  params = state["params"]
  # No dropout in LLaMA, but every step gets its own key so that stochastic additions stay reproducible on resume.
  _ = jax.random.fold_in(state["rng"], state["step"])

  def summed_loss(params, micro):
    losses, weights = token_losses(params, graphdef, micro)
    return jnp.sum(losses * weights), jnp.sum(weights)

  grad_fn = jax.value_and_grad(summed_loss, has_aux=True)
  if grad_accum == 1:
    (loss_sum, weight_sum), grads = grad_fn(params, batch)
  else:
    micro_batches = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

    def accumulate(carry, micro):
      (loss_sum, weight_sum), grads = grad_fn(params, micro)
      return jax.tree.map(jnp.add, carry, (loss_sum, weight_sum, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
             jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    (loss_sum, weight_sum, grads), _ = jax.lax.scan(accumulate, zeros, micro_batches)
  denominator = jnp.maximum(weight_sum, 1.0)
  grads = jax.tree.map(lambda g, p: (g / denominator).astype(p.dtype), grads, params)
  updates, opt_state = tx.update(grads, state["opt_state"], params)
  new_state = dict(state, step=state["step"] + 1, params=optax.apply_updates(params, updates), opt_state=opt_state)
  metrics = dict(loss=loss_sum / denominator, grad_norm=optax.tree.norm(grads), lr=schedule(state["step"]),
                 tokens=weight_sum)
  return new_state, metrics


def eval_step(params: Any, batch: dict[str, jax.Array], token_bytes: jax.Array, *,
              graphdef: nnx.GraphDef) -> dict[str, jax.Array]:
  """Sums over a batch: loss (nats), tokens, and the UTF-8 bytes those tokens stand for (for bits per byte)."""
  losses, weights = token_losses(params, graphdef, batch)
  return dict(loss_sum=jnp.sum(losses * weights), tokens=jnp.sum(weights),
              bytes=jnp.sum(token_bytes[batch["targets"]] * weights))


def summarize_eval(sums: dict[str, float]) -> dict[str, float]:
  loss = sums["loss_sum"] / max(sums["tokens"], 1.0)
  return dict(loss=loss, perplexity=math.exp(min(loss, 50.0)),
              bits_per_byte=sums["loss_sum"] / math.log(2) / max(sums["bytes"], 1.0))


# ---------------------------------------------------------------------------------------------------------------------
# Trainer: state shardings, initialisation, compiled steps


class Trainer:
  """Everything compiled for one run: shardings of the state and batches, the jitted train and eval steps."""

  def __init__(self, model_cfg: ModelConfig, run_config, mesh: jax.sharding.Mesh):
    self.model_cfg, self.run_config, self.mesh = model_cfg, run_config, mesh
    self.rules = tuple(tuple(rule) for rule in run_config.logical_axis_rules)
    train_cfg = run_config.train
    if train_cfg.batch_size % train_cfg.grad_accum:
      raise ConfigError(f"train.batch_size {train_cfg.batch_size} is not divisible by train.grad_accum "
                       f"{train_cfg.grad_accum}")
    self.tx = make_optimizer(train_cfg)
    self.schedule = learning_rate_schedule(train_cfg)
    self.graphdef, abstract_state = sharding.abstract_model(Llama, model_cfg, run_config.seed)
    param_shardings = nnx.to_pure_dict(sharding.state_shardings(abstract_state, mesh, self.rules))
    abstract_params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   nnx.to_pure_dict(abstract_state), param_shardings)
    replicated = NamedSharding(mesh, PartitionSpec())
    # Optimizer moments are sharded like their parameters (XLA would replicate the zeros tx.init creates); counts
    # and other non-parameter fields are replicated.
    opt_shardings = optax.tree_utils.tree_map_params(
        self.tx, lambda _, s: s, jax.eval_shape(self.tx.init, abstract_params), param_shardings,
        transform_non_params=lambda _: replicated)
    self.state_shardings = dict(step=replicated, params=param_shardings, opt_state=opt_shardings, rng=replicated)
    self.batch_sharding = NamedSharding(mesh, sharding.logical_to_spec(
        ("activation_batch", "activation_length"), self.rules))
    batch_axes = self.batch_sharding.spec[0] or ()
    batch_axes = batch_axes if isinstance(batch_axes, tuple) else (batch_axes,)
    batch_shards = math.prod(mesh.shape[a] for a in batch_axes)
    micro_batch = train_cfg.batch_size // train_cfg.grad_accum
    if micro_batch % batch_shards:
      raise sharding.ShardingError(
          f"the batch of {micro_batch} sequences (train.batch_size {train_cfg.batch_size} / grad_accum "
          f"{train_cfg.grad_accum}) is not divisible by the {batch_shards} batch shards (mesh "
          f"{'×'.join(f'{a}={mesh.shape[a]}' for a in batch_axes)}); change the batch or the mesh")
    self._train_step = jax.jit(
        functools.partial(train_step, graphdef=self.graphdef, tx=self.tx, schedule=self.schedule,
                          grad_accum=train_cfg.grad_accum),
        in_shardings=(self.state_shardings, self.batch_sharding), out_shardings=(self.state_shardings, replicated),
        donate_argnums=0)
    self._eval_step = jax.jit(functools.partial(eval_step, graphdef=self.graphdef),
                              in_shardings=(param_shardings, self.batch_sharding, replicated),
                              out_shardings=replicated)

  def abstract_state(self) -> State:
    shapes = jax.eval_shape(self._init_state)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                        self.state_shardings)

  def _init_state(self) -> State:
    params = nnx.to_pure_dict(nnx.state(Llama(self.model_cfg, rngs=nnx.Rngs(self.run_config.seed))))
    return dict(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                rng=jax.random.key_data(jax.random.key(self.run_config.seed)))

  def init_state(self) -> State:
    with sharding.activate(self.mesh, self.rules):
      return jax.jit(self._init_state, out_shardings=self.state_shardings)()

  def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows → one global array per key, split over the mesh as the batch rules say."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
            for k, v in local_batch.items()}

  def train_step(self, state: State, batch: dict[str, jax.Array]) -> tuple[State, dict]:
    with sharding.activate(self.mesh, self.rules):
      return self._train_step(state, batch)

  def evaluate(self, params: Any, batches, token_bytes: jax.Array) -> dict[str, float]:
    totals = None
    with sharding.activate(self.mesh, self.rules):
      for batch in batches:
        sums = self._eval_step(params, self.global_batch(batch), token_bytes)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    if totals is None:
      return {}
    return summarize_eval({k: float(v) for k, v in jax.device_get(totals).items()})


# ---------------------------------------------------------------------------------------------------------------------
# Metrics output


def append_line(path: str, line: str) -> None:
  """Appends one line to a local or remote (gs://) file; object stores cannot append, so those are rewritten whole
  (metrics files are small)."""
  if checkpoint_lib.is_remote(path):
    target = epath.Path(path)
    target.write_text((target.read_text() if target.exists() else "") + line + "\n")
    return
  with open(path, "a") as f:
    f.write(line + "\n")


class MetricsWriter:
  """One line to stdout, metrics.jsonl and TensorBoard events in the workdir; process 0 only."""

  def __init__(self, workdir: str, enabled: bool):
    self.enabled = enabled
    self._jsonl = os.path.join(workdir, "metrics.jsonl")
    self._tensorboard = None
    if enabled:
      try:
        from tensorboardX import SummaryWriter
        self._tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError as e:  # tensorboardX itself, or google-cloud-storage for a gs:// workdir
        _log.warning("no TensorBoard events: %s", e)

  def write(self, step: int, metrics: dict[str, float], prefix: str = "",
            echo: Callable[[str], None] = functools.partial(print, flush=True)):
    if not self.enabled:
      return
    append_line(self._jsonl, json.dumps({"step": step, **{f"{prefix}{k}": v for k, v in metrics.items()}}))
    if self._tensorboard is not None:
      for key, value in metrics.items():
        self._tensorboard.add_scalar(f"{prefix}{key}", value, step)
      self._tensorboard.flush()
    echo(f"step {step:>6d} | " + " | ".join(f"{prefix}{k} {_format(v)}" for k, v in metrics.items()))

  def close(self):
    if self._tensorboard is not None:
      self._tensorboard.close()


def _format(value: float) -> str:
  if isinstance(value, int) or (abs(value) >= 1000 and float(value).is_integer()):
    return f"{int(value):,}"
  return f"{value:.4g}"


# ---------------------------------------------------------------------------------------------------------------------
# The run


def load_tokenizer_for_run(run_config, workdir: str, texts: Callable[[], Iterator[str]]) -> "Tokenizer":  # noqa: F821
  """The configured tokenizer, the workdir's (on resume), init_from's, or one trained on the training texts."""
  from llama_jax.tokenizer import Tokenizer, train_tokenizer

  if run_config.data.tokenizer:
    return Tokenizer(run_config.data.tokenizer)
  for directory in (workdir, run_config.init_from):
    if directory and (epath.Path(directory) / checkpoint_lib.TOKENIZER_FILE).is_file():
      return Tokenizer(checkpoint_lib.local_file(os.path.join(directory, checkpoint_lib.TOKENIZER_FILE)))
  if jax.process_count() > 1:
    raise data_lib.DataError("multi-process runs need a prepared tokenizer: set data.tokenizer to a .model file")
  corpus_dir = checkpoint_lib.local_dir(workdir, "tokenizer")
  os.makedirs(corpus_dir, exist_ok=True)
  corpus = os.path.join(corpus_dir, "corpus.txt")
  has_text = False
  with open(corpus, "w", encoding="utf-8") as f:
    for text in texts():
      has_text = has_text or bool(text.strip())
      f.write(text + "\n")
  if not has_text:
    os.remove(corpus)
    raise data_lib.DataError(f"the training sources {list(run_config.data.sources)} contain no text")
  path = train_tokenizer([corpus], run_config.data.vocab_size, corpus_dir, overwrite=True)
  os.remove(corpus)
  return Tokenizer(path)


@dataclasses.dataclass
class RunData:
  """What the loop needs from the data, for either format: train batches, validation examples, summary counts."""
  dataset: Any
  val_examples: Any
  summary: str


def prepare_run_data(run_config, workdir: str) -> tuple["Tokenizer", RunData]:  # noqa: F821
  data_cfg, train_cfg = run_config.data, run_config.train
  prepared_dir = data_cfg.prepared_dir or checkpoint_lib.local_dir(workdir, "data")
  if data_cfg.format == "chat":
    def texts():
      for _, messages in data_lib.load_conversations(data_cfg.sources, "skip")[0]:
        yield from (m["content"] for m in messages)
    tokenizer = load_tokenizer_for_run(run_config, workdir, texts)
    meta = data_lib.prepare_sft(data_cfg.sources, tokenizer, prepared_dir, seq_len=train_cfg.seq_len,
                                val_fraction=data_cfg.val_fraction, seed=run_config.seed, on_error=data_cfg.on_error)
    dataset = data_lib.sft_train_dataset(prepared_dir, train_cfg.batch_size, run_config.seed, jax.process_index(),
                                         jax.process_count())
    val = data_lib.PackedRows(prepared_dir, "val")
    summary = (f"conversations: train {meta['train']['conversations']:,} ({meta['train']['rows']:,} packed rows), "
               f"val {meta['val']['conversations']:,}; skipped {meta['skipped']:,} bad, "
               f"{meta['train']['dropped_exchanges'] + meta['val']['dropped_exchanges']:,} old exchanges dropped "
               f"and {meta['train']['truncated_prompts'] + meta['val']['truncated_prompts']:,} prompts cut to fit, "
               f"{meta['train']['too_long'] + meta['val']['too_long']:,} too long")
    return tokenizer, RunData(dataset, val, summary)
  if data_cfg.format != "text":
    raise ConfigError(f"data.format must be 'text' or 'chat', got {data_cfg.format!r}")
  train_docs, _ = data_lib.split_documents(data_cfg.sources, data_cfg.val_sources, data_cfg.val_fraction,
                                           run_config.seed, data_cfg.text_field)
  tokenizer = load_tokenizer_for_run(
      run_config, workdir, lambda: (data_lib.read_document(ref, data_cfg.text_field)[0] for ref in train_docs))
  meta = data_lib.prepare(data_cfg.sources, data_cfg.val_sources, tokenizer, prepared_dir,
                          val_fraction=data_cfg.val_fraction, seed=run_config.seed, text_field=data_cfg.text_field)
  dataset = data_lib.train_dataset(prepared_dir, train_cfg.seq_len, train_cfg.batch_size, run_config.seed,
                                   jax.process_index(), jax.process_count())
  summary = f"train {meta['train']['tokens']:,} tokens, val {meta['val']['tokens']:,} tokens"
  return tokenizer, RunData(dataset, data_lib.validation_windows(prepared_dir, train_cfg.seq_len), summary)


def load_init_params(init_from: str, model_cfg: ModelConfig, shardings: Any) -> Any:
  """Parameters (only) of another checkpoint directory, refused unless the model shapes match."""
  saved = checkpoint_lib.read_model_config(init_from)
  differences = checkpoint_lib.shape_differences(saved, model_cfg)
  if differences:
    raise checkpoint_lib.CheckpointError(f"init_from {init_from!r} holds a different model ({', '.join(differences)});"
                                         f" its model config must match this run's")
  return checkpoint_lib.load_params(init_from, shardings=shardings)[1]


def train(run_config, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) a run in `workdir`; returns the last train and validation metrics."""
  sharding.maybe_initialize_distributed()
  model_cfg = model_config_from(run_config)
  train_cfg = run_config.train
  is_main = jax.process_index() == 0
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  checkpointer = checkpoint_lib.TrainCheckpointer(workdir, keep=train_cfg.keep, keep_every=train_cfg.keep_every,
                                                  async_save=train_cfg.async_save)
  checkpointer.check_compatible(model_cfg)  # before anything is written to the workdir

  # Process 0 tokenizes first; the others then find its cache where the disk is shared, or prepare their own copy.
  if not is_main:
    multihost_utils.sync_global_devices("llama_jax: data prepared by process 0")
  tokenizer, run_data = prepare_run_data(run_config, workdir)
  if is_main and jax.process_count() > 1:
    multihost_utils.sync_global_devices("llama_jax: data prepared by process 0")
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise data_lib.DataError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
                             f"{model_cfg.vocab_size}; set --config.model.vocab_size={tokenizer.vocab_size}")
  if is_main:
    checkpointer.write_metadata(model_cfg, run_config.to_json_best_effort(), tokenizer.serialized())

  mesh = sharding.make_mesh(run_config.mesh)
  trainer = Trainer(model_cfg, run_config, mesh)
  data_iter = iter(run_data.dataset)
  start = checkpointer.latest_step()
  if start is None:
    state = trainer.init_state()
    start = 0
    if run_config.init_from:
      state["params"] = load_init_params(run_config.init_from, model_cfg, trainer.state_shardings["params"])
  else:
    state, data_state = checkpointer.restore(start, trainer.abstract_state())
    data_iter.set_state(data_state)
  token_bytes = jax.device_put(np.asarray(tokenizer.token_byte_lengths(), np.float32),
                               NamedSharding(mesh, PartitionSpec()))

  writer = MetricsWriter(workdir, is_main)
  tokens_per_step = train_cfg.batch_size * train_cfg.seq_len
  model_flops = flops_per_token(model_cfg, train_cfg.seq_len) * tokens_per_step
  peak = peak_flops_per_device(train_cfg.peak_flops_per_device) * jax.device_count()
  stop = _StopFlag()
  progress = _progress_bar(start, train_cfg.steps, is_main)
  echo = progress.write if progress is not None else functools.partial(print, flush=True)
  if is_main:
    echo(f"model {model_cfg.num_params():,} params | mesh {dict(mesh.shape)} | {run_data.summary} | steps {start} → "
         f"{train_cfg.steps}" + (f" | init from {run_config.init_from}" if run_config.init_from and start == 0 else ""))

  # Metrics stay on the device until the *next* step has been dispatched, so reading them never leaves the device
  # idle; a window's line is written one step after it ends.
  pending: list[tuple[int, dict]] = []
  log_due: int | None = None
  last_train: dict[str, float] = {}
  last_eval: dict[str, float] = {}
  window_start, window_step = time.perf_counter(), start

  def log_window(until: int) -> None:
    nonlocal last_train, window_start, window_step
    fetched = jax.device_get([m for s, m in pending if s <= until])
    pending[:] = [(s, m) for s, m in pending if s > until]
    now = time.perf_counter()
    elapsed, steps_done = now - window_start, until - window_step
    last_train = dict(
        loss=float(np.mean([m["loss"] for m in fetched])), grad_norm=float(fetched[-1]["grad_norm"]),
        lr=float(fetched[-1]["lr"]), tokens_per_s=tokens_per_step * steps_done / elapsed,
        step_time_s=elapsed / steps_done, mfu=model_flops * steps_done / elapsed / peak)
    last_train["perplexity"] = math.exp(min(last_train["loss"], 50.0))
    writer.write(until, last_train, echo=echo)
    window_start, window_step = now, until

  def evaluate_and_log(step: int) -> dict[str, float]:
    metrics = trainer.evaluate(state["params"], data_lib.eval_batches(
        run_data.val_examples, train_cfg.batch_size, train_cfg.eval_batches, jax.process_index(), jax.process_count()),
        token_bytes)
    if metrics:
      writer.write(step, metrics, prefix="val_", echo=echo)
    return metrics

  step = start
  if start == 0 and run_config.init_from and train_cfg.eval_every:
    evaluate_and_log(0)  # the starting point of a fine-tune, for a before/after comparison
    window_start = time.perf_counter()
  try:
    while step < train_cfg.steps and not stop.requested:
      local_batch = next(data_iter)
      if train_cfg.record_batches and is_main:
        _record_batch(workdir, step + 1, local_batch)
      batch = trainer.global_batch(local_batch)
      state, metrics = trainer.train_step(state, batch)
      step += 1
      pending.append((step, metrics))
      if progress is not None:
        progress.update(1)
      if log_due is not None:
        log_window(log_due)
        log_due = None
      if step % train_cfg.log_every == 0:
        log_due = step
      if train_cfg.eval_every and (step % train_cfg.eval_every == 0 or step == train_cfg.steps):
        if log_due is not None:
          log_window(log_due)
          log_due = None
        last_eval = evaluate_and_log(step)
        window_start, window_step = time.perf_counter(), step  # evaluation time is not training throughput
      if step % train_cfg.save_every == 0 and step < train_cfg.steps:
        checkpointer.save(step, state, data_iter.get_state())
        if os.environ.get(KILL_AFTER_SAVE_ENV) == str(step):
          os.kill(os.getpid(), signal.SIGKILL)  # tests: a crash while the async write is in flight
    if pending:
      log_window(pending[-1][0])
    if step > (checkpointer.latest_step() or 0):
      checkpointer.save(step, state, data_iter.get_state())
    if stop.requested and is_main:
      echo(f"stopped by signal at step {step}; checkpoint saved, rerun the same command to resume")
  finally:
    checkpointer.close()
    writer.close()
    stop.restore()
    if progress is not None:
      progress.close()
  return dict(step=step, train=last_train, val=last_eval)


def _record_batch(workdir: str, step: int, batch: dict[str, np.ndarray]) -> None:
  digest = hashlib.sha256(np.ascontiguousarray(batch["inputs"]).tobytes()).hexdigest()[:16]
  append_line(os.path.join(workdir, "batches.jsonl"), json.dumps({"step": step, "inputs_sha256": digest}))


class _StopFlag:
  """SIGTERM (preemption) asks the loop to save and stop after the current step."""

  def __init__(self):
    self.requested = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    self.requested = True

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)


def _progress_bar(start: int, total: int, is_main: bool):
  if not (is_main and sys.stderr.isatty()):
    return None
  from tqdm import tqdm
  return tqdm(initial=start, total=total, unit="step", dynamic_ncols=True)


def main(argv=None) -> None:
  from absl import app, flags
  from ml_collections import config_flags

  from llama_jax.config import ConfigError, parse_flags_or_exit, run_config_from_flag_or_exit
  from llama_jax.tokenizer import TokenizerError

  config_flag = config_flags.DEFINE_config_file("config", None, "run config file, e.g. configs/tiny.py")
  workdir_flag = flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics, data); default "
                                     "runs/<config name>")
  coordinator_flag = flags.DEFINE_string("coordinator_address", None, "multi-process runs (e.g. several GPU hosts): "
                                         "HOST:PORT of process 0; not needed on Cloud TPU slices, SLURM or Open MPI")
  num_processes_flag = flags.DEFINE_integer("num_processes", None, "multi-process runs: the number of processes")
  process_id_flag = flags.DEFINE_integer("process_id", None, "multi-process runs: this process's index, from 0")
  flags.mark_flags_as_required(["config"])

  def run(_):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("absl", "orbax", "jax"):
      logging.getLogger(noisy).setLevel(logging.WARNING)
    run_config, _ = run_config_from_flag_or_exit(config_flag)
    config_path = flags.FLAGS["config"].config_filename
    workdir = workdir_flag.value or os.path.join("runs", os.path.splitext(os.path.basename(config_path))[0])
    try:
      sharding.maybe_initialize_distributed(coordinator_flag.value, num_processes_flag.value, process_id_flag.value)
      result = train(run_config, workdir)
    except (ConfigError, data_lib.DataError, checkpoint_lib.CheckpointError, sharding.ShardingError,
            TokenizerError) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    if jax.process_index() == 0 and result["val"]:
      print(f"done: step {result['step']}, validation loss {result['val']['loss']:.4f}, "
            f"bits/byte {result['val']['bits_per_byte']:.4f} (workdir {workdir})")

  app.run(run, argv, flags_parser=parse_flags_or_exit)


if __name__ == "__main__":
  main()
