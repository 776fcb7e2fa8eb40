"""Training a run: the ``Trainer`` that compiles the pure step (step.py) for a mesh (shardings of the state and
batches; ``lower()`` for ahead-of-time plans), and ``train()``, which runs it in a loop of steps plus hooks (loop.py)
on a workdir.

The run is restartable: calling ``train`` again with the same workdir resumes from the latest complete checkpoint,
with the same data order, and reaches bit-identical parameters. ``python -m llama_jax.train`` is its command.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.checkpoint import records, workdir_lock
from llama_jax.checkpoint.train_state import TrainCheckpointer
from llama_jax.core import distributed, paths
from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import RunConfig, run_config_from
from llama_jax.data.batches import eval_batches
from llama_jax.data.preference import PREFERENCE_KEYS
from llama_jax.data.run_data import RunData, prepare_run_data
from llama_jax.data.sft import SFT_KEYS
from llama_jax.data.sources import DataError
from llama_jax.model import lora as lora_lib
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from llama_jax.model.loss import summarize_dpo, summarize_eval
from llama_jax.training import trackers
from llama_jax.training.flops import flops_per_token, peak_flops_per_device
from llama_jax.training.goodput import GoodputLedger, StepClock
from llama_jax.training.loop import (
  CheckpointHook,
  EvalHook,
  Hook,
  MetricsHook,
  NonFiniteHook,
  PreemptionHook,
  ProfileHook,
  ProgressHook,
  RecordBatchesHook,
  TrainLoop,
)
from llama_jax.training.metrics import MetricsWriter
from llama_jax.training.optimizer import learning_rate_schedule, make_optimizer
from llama_jax.training.step import State, eval_step_with_frozen, make_objective, train_step


class Trainer:
  """Everything compiled for one run: shardings of the state and batches, the jitted train and eval steps.

  Builds the optimizer and schedule, the model's abstract parameters and their shardings on `mesh`, and the train
  and eval steps of step.py jitted with those shardings, the train state donated. A LoRA run trains only the
  adapters and keeps the base frozen; a full DPO run keeps its initial parameters as the frozen reference. The frozen
  arrays are read by `load_frozen` before the first step. Nothing is allocated here.

  Args:
    model_cfg: the model to compile, passed separately so a caller can compile a variant of the run's model (the
      memory planner swaps accelerator-only attention kernels).
    run_config: a RunConfig or a ConfigDict, checked here.
    mesh: the device mesh the state and batches are split over.

  Raises:
    ConfigError: `run_config` has an unknown key or a bad value.
    ShardingError: a parameter axis or the micro-batch is not divisible by the mesh axes it is split over, or a
      logical axis has no rule.
  """

  def __init__(self, model_cfg: ModelConfig, run_config: RunConfig | Any, mesh: jax.sharding.Mesh):
    run_config = run_config_from(run_config)
    self.model_cfg, self.run_config, self.mesh = model_cfg, run_config, mesh
    self.rules = run_config.logical_axis_rules
    train_cfg = run_config.train
    self.tx = make_optimizer(train_cfg)
    self.schedule = learning_rate_schedule(train_cfg)
    # LoRA: the model holds adapters too; the state's params are only those, the rest is the frozen base.
    self.lora = train_cfg.lora if train_cfg.lora.rank else None
    self.model_cls = functools.partial(Llama, lora=self.lora)
    self.graphdef, abstract_params = sharding.abstract_params(
      self.model_cls, model_cfg, mesh, self.rules, run_config.seed
    )
    # What the step reads but never trains: a LoRA run's base, a full DPO run's reference (the initial parameters).
    self.dpo_beta = train_cfg.dpo_beta if run_config.data.format == "preference" else None
    self.abstract_frozen: dict[str, Any] = {}
    if self.lora is not None:
      self.abstract_frozen["base"], abstract_params = lora_lib.split(abstract_params)
    elif self.dpo_beta is not None:
      self.abstract_frozen["reference"] = abstract_params
    self.frozen: dict[str, Any] | None = None  # their arrays, once `load_frozen` has read them
    replicated = NamedSharding(mesh, PartitionSpec())
    self.state_shardings = dict(
      step=replicated,
      params=sharding.shardings_of(abstract_params),
      opt_state=_moment_shardings(self.tx, abstract_params, replicated),
      rng=replicated,
    )
    self.batch_sharding = NamedSharding(
      mesh, sharding.logical_to_spec(("activation_batch", "activation_length"), self.rules)
    )
    _check_batch_splits(train_cfg.batch_size, train_cfg.grad_accum, self.batch_sharding, mesh)
    frozen_shardings = sharding.shardings_of(self.abstract_frozen)
    self._train_step = jax.jit(
      functools.partial(
        train_step,
        objective=make_objective(self.graphdef, self.dpo_beta),
        count_name="tokens" if self.dpo_beta is None else "pairs",
        tx=self.tx,
        schedule=self.schedule,
        grad_accum=train_cfg.grad_accum,
      ),
      in_shardings=(self.state_shardings, self.batch_sharding, frozen_shardings),
      out_shardings=(self.state_shardings, replicated),
      donate_argnums=0,
    )
    self._eval_step = jax.jit(
      functools.partial(eval_step_with_frozen, graphdef=self.graphdef, beta=self.dpo_beta),
      in_shardings=(self.state_shardings["params"], self.batch_sharding, replicated, frozen_shardings),
      out_shardings=replicated,
    )

  def abstract_state(self) -> State:
    """The train state of this run as shapes, each with its sharding; nothing is allocated.

    Returns:
      ``step``, ``params``, ``opt_state`` and ``rng`` as ShapeDtypeStructs.
    """
    shapes = jax.eval_shape(self._init_state)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, self.state_shardings)

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    """A global batch of this run as shapes, each ``[batch_size, seq_len]`` with the batch sharding.

    Returns:
      Inputs and targets, plus weights, segment ids and positions for chat; chosen and rejected inputs, targets and
      weights for preference pairs. Weights are float32, the rest int32.
    """
    train_cfg, data_format = self.run_config.train, self.run_config.data.format
    keys = {"chat": SFT_KEYS, "preference": PREFERENCE_KEYS}.get(data_format, ("inputs", "targets"))
    return {
      k: jax.ShapeDtypeStruct(
        (train_cfg.batch_size, train_cfg.seq_len),
        np.float32 if k.endswith("weights") else np.int32,
        sharding=self.batch_sharding,
      )
      for k in keys
    }

  def lower(self, state: State | None = None, batch: dict[str, Any] | None = None) -> jax.stages.Lowered:
    """The train step lowered for this run, for ahead-of-time plans.

    ``.compile()`` on the result gives the executable, its memory analysis and cost (plan.py, bench/train.py).

    Args:
      state: the train state to lower for; None: `abstract_state`, so nothing is allocated.
      batch: the global batch to lower for; None: `abstract_batch`.

    Returns:
      The lowered train step.
    """
    state = self.abstract_state() if state is None else state
    batch = self.abstract_batch() if batch is None else batch
    with sharding.activate(self.mesh, self.rules):
      return self._train_step.lower(state, batch, self.abstract_frozen)

  def _init_state(self) -> State:
    params = nnx.to_pure_dict(nnx.state(self.model_cls(self.model_cfg, rngs=nnx.Rngs(self.run_config.seed))))
    if self.lora is not None:
      params = lora_lib.split(params)[1]  # only the adapters: XLA drops the base's unused initialisation
    return dict(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=self.tx.init(params),
      rng=jax.random.key_data(jax.random.key(self.run_config.seed)),
    )

  def init_state(self) -> State:
    """A fresh train state from the run's seed, built in place on the mesh.

    Returns:
      Step 0, the initial parameters, only the adapters in a LoRA run, the optimizer's state and the RNG key.
    """
    with sharding.activate(self.mesh, self.rules):
      return jax.jit(self._init_state, out_shardings=self.state_shardings)()

  def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """One global array per key from this process's rows, split over the mesh as the batch rules say.

    Args:
      local_batch: this process's rows of the batch, by key.

    Returns:
      The global batch, by key.
    """
    return {
      k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v)) for k, v in local_batch.items()
    }

  def load_frozen(self, init_from: str, step: int | None = None) -> int | None:
    """Read what the step keeps frozen: a LoRA run's base, a full DPO run's reference.

    The arrays are read into their shards and the model's storage dtype, and kept in `frozen`.

    Args:
      init_from: the checkpoint directory to read.
      step: the step to read; None: its latest complete step.

    Returns:
      The step read, or None when the run keeps nothing frozen.

    Raises:
      CheckpointError: `init_from` has no complete step, not `step`, or a step whose digests do not match.
    """
    if not self.abstract_frozen:
      self.frozen = {}
      return None
    ((name, abstract),) = self.abstract_frozen.items()
    step = checkpoint_params.resolve_step(init_from, step)
    params = checkpoint_params.load_params(
      init_from, step, shardings=sharding.shardings_of(abstract), dtype=self.model_cfg.param_dtype
    )[1]
    self.frozen = {name: params}
    return step

  def _frozen(self) -> dict[str, Any]:
    if self.frozen is None:
      if self.abstract_frozen:
        raise RuntimeError(f"this trainer reads a frozen {'/'.join(self.abstract_frozen)}: call load_frozen first")
      self.frozen = {}
    return self.frozen

  def train_step(self, state: State, batch: dict[str, jax.Array]) -> tuple[State, dict]:
    """Run one compiled train step; it returns without waiting for the devices.

    Args:
      state: the train state, donated: its arrays cannot be used after the call.
      batch: a global batch, as `global_batch` makes it.

    Returns:
      The new state and the step's metrics, still on the devices, as ``step.train_step`` returns them.

    Raises:
      RuntimeError: the run keeps a base or a reference frozen and `load_frozen` has not been called.
    """
    with sharding.activate(self.mesh, self.rules):
      return self._train_step(state, batch, self._frozen())

  def evaluate(self, params: Any, batches, token_bytes: jax.Array) -> dict[str, float]:
    """Evaluate `params` on `batches`, summing each batch's metrics before summarizing them.

    Args:
      params: the trained parameters: all of them, or a LoRA run's adapters.
      batches: this process's rows of each evaluation batch.
      token_bytes: each token's length in bytes, for bits per byte.

    Returns:
      The token-loss metrics of ``summarize_eval``, or with DPO the pair metrics of ``summarize_dpo``; empty when
      there are no batches.
    """
    totals = None
    with sharding.activate(self.mesh, self.rules):
      for batch in batches:
        sums = self._eval_step(params, self.global_batch(batch), token_bytes, self._frozen())
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    if totals is None:
      return {}
    summarize = summarize_eval if self.dpo_beta is None else summarize_dpo
    return summarize({k: float(v) for k, v in jax.device_get(totals).items()})


def _moment_shardings(tx: optax.GradientTransformation, abstract_params: Any, replicated: NamedSharding) -> Any:
  """Optimizer moments sharded like their parameters (XLA would replicate the zeros tx.init creates); counts and
  other non-parameter fields replicated."""
  return optax.tree_utils.tree_map_params(
    tx,
    lambda _, s: s,
    jax.eval_shape(tx.init, abstract_params),
    sharding.shardings_of(abstract_params),
    transform_non_params=lambda _: replicated,
  )


def _check_batch_splits(batch_size: int, grad_accum: int, batch_sharding: NamedSharding, mesh) -> None:
  """Refuses a micro-batch that the mesh's batch axes do not divide, naming the axes."""
  batch_axes = batch_sharding.spec[0] or ()
  batch_axes = batch_axes if isinstance(batch_axes, tuple) else (batch_axes,)
  batch_shards = math.prod(mesh.shape[a] for a in batch_axes)
  micro_batch = batch_size // grad_accum
  if micro_batch % batch_shards:
    raise sharding.ShardingError(
      f"the batch of {micro_batch} sequences (train.batch_size {batch_size} / grad_accum {grad_accum}) is not "
      f"divisible by the {batch_shards} batch shards (mesh {'×'.join(f'{a}={mesh.shape[a]}' for a in batch_axes)}); "
      f"change the batch or the mesh"
    )


def _restore_or_init(
  trainer: Trainer, checkpointer: TrainCheckpointer, data_iter, run_config: RunConfig
) -> tuple[State, int]:
  """(state, start step): the newest intact checkpoint (data iterator restored too; damaged newer steps are set
  aside with a warning), or a fresh state whose parameters come from `init_from` when set."""
  restored = checkpointer.restore_latest(trainer.abstract_state())
  if restored is not None:
    start, state, data_state = restored
    data_iter.set_state(data_state)
    return state, start
  state = trainer.init_state()
  if run_config.init_from and trainer.lora is None:  # LoRA: init_from is the frozen base, the adapters start fresh
    state["params"] = checkpoint_params.load_init_params(
      run_config.init_from, run_config.model, trainer.state_shardings["params"]
    )
  return state, 0


def _load_frozen(
  trainer: Trainer, checkpointer: TrainCheckpointer, run_config: RunConfig, workdir: str, is_main: bool
) -> None:
  """Reads what a LoRA or DPO run keeps frozen from init_from: on a new run its latest step, recorded in lora.json
  (reference.json for full DPO); on a resume the recorded step, refused if its files or the adapter settings changed
  (the adapters fit that base only, and a DPO loss means nothing against another reference)."""
  init_from, lora_cfg = run_config.init_from, trainer.lora
  name = paths.LORA_FILE if lora_cfg is not None else paths.REFERENCE_FILE
  record = records.read_record(workdir, name) if checkpointer.latest_step() is not None else None
  if record is None:
    checkpoint_params.check_same_model(init_from, run_config.model)
    step = trainer.load_frozen(init_from)
    if is_main:
      record = records.frozen_record(init_from, step)
      records.write_record(
        workdir, record if lora_cfg is None else records.base_record(lora_cfg, init_from, step), name
      )
    return
  if (lora_cfg is not None and records.lora_config_of(record) != lora_cfg) or not paths.same_dir(
    record["base"], init_from
  ):
    held = (
      f"adapters of rank {record['rank']}, alpha {record['alpha']}, targets {tuple(record['targets'])}"
      if lora_cfg
      else "a run"
    )
    asked = f"rank {lora_cfg.rank}, alpha {lora_cfg.alpha}, targets {lora_cfg.targets}" if lora_cfg else "a run"
    raise records.LoraError(
      f"workdir {workdir!r} holds {held} on {record['base']!r}; this run asks for {asked} on {init_from!r}: use a "
      f"new --workdir"
    )
  records.check_base(workdir, record)
  trainer.load_frozen(record["base"], record["base_step"])


def train(run_config: RunConfig | Any, workdir: str, hooks: Sequence[Hook] = ()) -> dict[str, Any]:
  """Trains, or resumes, a run in `workdir`.

  Calling it again with the same workdir resumes from the latest complete checkpoint, with the same data order. The
  workdir is locked for the run (workdir_lock.py): a second run on it stops with one line naming this one. Every
  config value is checked before anything is written.

  Args:
    run_config: a RunConfig or a ConfigDict.
    workdir: the run's directory, local or ``gs://``: checkpoints, metrics, metadata and the prepared data.
    hooks: run after the run's own, after every step (tests inject faults this way).

  Returns:
    The last train and validation metrics: ``step``, ``train`` and ``val``.

  Raises:
    ConfigError: a bad run config.
    TrackerError: a tracker the run asks for is not installed.
    ShardingError: the mesh does not fit the devices, the model or the batch.
    WorkdirError: the workdir cannot be written; WorkdirLockedError, a subclass, when another run holds it.
    CheckpointError: the workdir holds checkpoints of another model, or damaged ones only.
    LoraError: a resumed LoRA or DPO run asks for other adapters or another base than the workdir holds.
    DataError: the data cannot be prepared, or the tokenizer has more tokens than ``model.vocab_size``.
    NonFiniteError: non-finite losses or gradients that ``train.on_nonfinite`` may not skip.
  """
  started = time.perf_counter()  # the session's start, for goodput.json
  lock = workdir_lock.WorkdirLock(workdir)
  try:
    run_config = run_config_from(run_config)  # every value is checked before anything is written
    trackers.check_available(run_config.train.trackers)
    distributed.maybe_initialize_distributed()
    trainer = Trainer(run_config.model, run_config, sharding.make_mesh(run_config.mesh))  # mesh and shapes too
    lock.acquire()  # creates the workdir, before anything else is written there (metadata, data, metrics, checkpoints)
    checkpointer = TrainCheckpointer(
      workdir,
      keep=run_config.train.keep,
      keep_every=run_config.train.keep_every,
      async_save=run_config.train.async_save,
    )
    run_data, token_bytes = _prepare_workdir(trainer, checkpointer, workdir)
    return _run_loop(trainer, checkpointer, run_data, token_bytes, workdir, hooks, started)
  finally:
    lock.release()


def _prepare_workdir(trainer: Trainer, checkpointer: TrainCheckpointer, workdir: str) -> tuple[RunData, jax.Array]:
  """Checks the workdir against the run, reads what the run keeps frozen, prepares the data and writes the
  workdir's metadata (process 0): everything before the first step. Returns the data and the tokens' byte lengths."""
  run_config, model_cfg, is_main = trainer.run_config, trainer.model_cfg, distributed.is_main_process()
  checkpointer.check_compatible(model_cfg)  # before anything is written to the workdir
  if trainer.abstract_frozen:  # a LoRA base or a DPO reference, checked and read before any data is prepared
    _load_frozen(trainer, checkpointer, run_config, workdir, is_main)
  tokenizer, run_data = prepare_run_data(run_config, workdir)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise DataError(
      f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
      f"{model_cfg.vocab_size}; set --config.model.vocab_size={tokenizer.vocab_size}"
    )
  if is_main:
    checkpointer.write_metadata(model_cfg, run_config.to_json(), tokenizer.files())
  token_bytes = jax.device_put(
    np.asarray(tokenizer.token_byte_lengths(), np.float32), NamedSharding(trainer.mesh, PartitionSpec())
  )
  return run_data, token_bytes


def _run_loop(
  trainer: Trainer,
  checkpointer: TrainCheckpointer,
  run_data: RunData,
  token_bytes: jax.Array,
  workdir: str,
  hooks: Sequence[Hook],
  started: float,
) -> dict[str, Any]:
  """Restores or initialises the state and runs the loop with the run's hooks, then `hooks`. `started`: the
  session's start (perf_counter), from which goodput counts."""
  run_config, model_cfg, train_cfg = trainer.run_config, trainer.model_cfg, trainer.run_config.train
  is_main = distributed.is_main_process()
  data_iter = iter(run_data.dataset)
  state, start = _restore_or_init(trainer, checkpointer, data_iter, run_config)
  progress = ProgressHook(start, train_cfg.steps) if is_main and sys.stderr.isatty() else None
  echo = progress.bar.write if progress is not None else functools.partial(print, flush=True)
  clock, ledger = StepClock(), GoodputLedger(workdir, start, started, is_main)
  sinks = []
  if is_main:
    sinks = trackers.open_trackers(
      train_cfg.trackers,
      workdir,
      json.loads(run_config.to_json()),
      project=train_cfg.tracker_project,
      run_name=train_cfg.run_name,
      mlflow_tracking_uri=train_cfg.mlflow_tracking_uri,
    )
  writer = MetricsWriter(
    workdir,
    is_main,
    log_every=train_cfg.log_every,
    echo=echo,
    start_step=start,
    clock=clock,
    ledger=ledger,
    trackers=sinks,
    tokens_per_step=train_cfg.batch_size * train_cfg.seq_len,
    flops_per_step=flops_per_token(model_cfg, train_cfg.seq_len) * train_cfg.batch_size * train_cfg.seq_len,
    peak_flops=peak_flops_per_device(train_cfg.peak_flops_per_device) * jax.device_count(),
  )
  evaluator = EvalHook(
    lambda params: trainer.evaluate(
      params,
      eval_batches(
        run_data.val_examples, train_cfg.batch_size, train_cfg.eval_batches, jax.process_index(), jax.process_count()
      ),
      token_bytes,
    ),
    writer,
    train_cfg.eval_every,
  )
  fine_tune_start = start == 0 and bool(run_config.init_from)
  if is_main:
    echo(_start_line(trainer, run_data, start, fine_tune_start))
  loop = TrainLoop(
    lambda s, b: trainer.train_step(s, trainer.global_batch(b)), data_iter, state, start, train_cfg.steps, clock
  )
  run_hooks = [
    progress,
    RecordBatchesHook(workdir) if train_cfg.record_batches and is_main else None,
    MetricsHook(writer),
    NonFiniteHook(train_cfg.on_nonfinite, train_cfg.max_skipped_steps, train_cfg.save_every, checkpointer.latest_step),
    evaluator if train_cfg.eval_every else None,
    CheckpointHook(checkpointer, data_iter.get_state, train_cfg.save_every),
    PreemptionHook(echo if is_main else None),
    ProfileHook(paths.local_dir(workdir, "profile"), *train_cfg.profile_steps) if train_cfg.profile_steps else None,
    *hooks,
  ]
  for hook in run_hooks:
    if hook is not None:
      loop.add_hook(hook)
  ledger.startup_done()
  writer.restart_clock(start)
  if fine_tune_start and train_cfg.eval_every:
    with clock.measure("eval"):
      evaluator.run(0, state["params"])  # the starting point of a fine-tune, for a before/after comparison
  try:
    loop.run()
  finally:
    close = getattr(data_iter, "close", None)
    if close is not None:  # grain's worker processes and their shared memory (data.workers), ended now, not at exit
      close()
  writer.end_session(loop.step)
  return dict(step=loop.step, train=writer.last_train, val=evaluator.last)


def _start_line(trainer: Trainer, run_data: RunData, start: int, fine_tune_start: bool) -> str:
  model_cfg, run_config = trainer.model_cfg, trainer.run_config
  lora = trainer.lora
  return (
    f"model {model_cfg.num_params():,} params"
    + (
      f" ({model_cfg.num_active_params():,} active: top-{model_cfg.moe.top_k} of {model_cfg.moe.num_experts} experts)"
      if model_cfg.moe.enabled
      else ""
    )
    + (
      f" | LoRA rank {lora.rank} on {','.join(lora.targets)}: "
      f"{lora_lib.num_adapter_params(model_cfg, lora):,} trainable"
      if lora
      else ""
    )
    + f" | mesh {dict(trainer.mesh.shape)} | {run_data.summary} | steps {start} → {run_config.train.steps}"
    + (f" | init from {run_config.init_from}" if fine_tune_start else "")
  )
