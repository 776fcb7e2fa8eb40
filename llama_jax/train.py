"""Training: a pure, jitted ``train_step(state, batch) -> (state, metrics)``, the ``Trainer`` that compiles it for a
mesh, and ``train()``, which runs it in a loop of steps plus hooks (``loop.py``).

    python -m llama_jax.train --config configs/tiny.py [--workdir DIR] [--config.train.steps=...]

The run is restartable: rerunning the same command with the same workdir resumes from the latest complete
checkpoint, with the same data order, and reaches bit-identical parameters.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from llama_jax import checkpoint as checkpoint_lib
from llama_jax import cli, distributed, sharding, workdir_lock
from llama_jax import config as config_lib
from llama_jax import data as data_lib
from llama_jax import lora as lora_lib
from llama_jax.chat_data import SFT_KEYS
from llama_jax.config import ModelConfig, RunConfig
from llama_jax.errors import run_or_exit
from llama_jax.flops import flops_per_token, peak_flops_per_device
from llama_jax.loop import (
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
from llama_jax.loss import dpo_eval_step, dpo_losses, eval_step, summarize_dpo, summarize_eval, token_losses
from llama_jax.metrics import MetricsWriter
from llama_jax.model import Llama
from llama_jax.optimizer import learning_rate_schedule, make_optimizer
from llama_jax.preference_data import PREFERENCE_KEYS
from llama_jax.run_data import prepare_run_data

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

  `objective(params, micro, frozen) -> (loss sum, (count, metric sums))` (see `make_objective`): gradients are of
  the *summed* loss and divided by the total count (weighted tokens, or preference pairs) at the end, so
  accumulation gives the gradient of the whole batch's mean loss, whatever the split. `frozen` holds what the step
  reads but never trains or donates: a LoRA run's base model, a DPO run's reference.
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
  """The loss a run trains: next-token cross-entropy (pretraining, SFT), or with `dpo_beta` the DPO loss of
  preference pairs. With LoRA (`frozen["base"]`) the policy is the base plus the trained adapters and DPO's reference
  is the base alone (the adapters at zero: no second copy of the model); otherwise the reference is
  `frozen["reference"]`, the initial parameters."""

  def objective(params, micro, frozen):
    policy = policy_params(params, frozen)
    if dpo_beta is None:
      losses, weights = token_losses(policy, graphdef, micro)
      return jnp.sum(losses * weights), (jnp.sum(weights), {})
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


class Trainer:
  """Everything compiled for one run: shardings of the state and batches, the jitted train and eval steps.

  `run_config` may be a RunConfig or a ConfigDict (checked here); `model_cfg` is passed separately so a caller can
  compile a variant of the run's model (the memory planner swaps accelerator-only attention kernels).
  """

  def __init__(self, model_cfg: ModelConfig, run_config: RunConfig | Any, mesh: jax.sharding.Mesh):
    run_config = config_lib.run_config_from(run_config)
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
    param_shardings = sharding.shardings_of(abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    # Optimizer moments are sharded like their parameters (XLA would replicate the zeros tx.init creates); counts
    # and other non-parameter fields are replicated.
    opt_shardings = optax.tree_utils.tree_map_params(
      self.tx,
      lambda _, s: s,
      jax.eval_shape(self.tx.init, abstract_params),
      param_shardings,
      transform_non_params=lambda _: replicated,
    )
    self.state_shardings = dict(step=replicated, params=param_shardings, opt_state=opt_shardings, rng=replicated)
    self.batch_sharding = NamedSharding(
      mesh, sharding.logical_to_spec(("activation_batch", "activation_length"), self.rules)
    )
    batch_axes = self.batch_sharding.spec[0] or ()
    batch_axes = batch_axes if isinstance(batch_axes, tuple) else (batch_axes,)
    batch_shards = math.prod(mesh.shape[a] for a in batch_axes)
    micro_batch = train_cfg.batch_size // train_cfg.grad_accum
    if micro_batch % batch_shards:
      raise sharding.ShardingError(
        f"the batch of {micro_batch} sequences (train.batch_size {train_cfg.batch_size} / grad_accum "
        f"{train_cfg.grad_accum}) is not divisible by the {batch_shards} batch shards (mesh "
        f"{'×'.join(f'{a}={mesh.shape[a]}' for a in batch_axes)}); change the batch or the mesh"
      )
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
    graphdef, beta = self.graphdef, self.dpo_beta

    def eval_with_frozen(params, batch, token_bytes, frozen):
      policy = policy_params(params, frozen)
      if beta is None:
        return eval_step(policy, batch, token_bytes, graphdef=graphdef)
      reference = reference_params(params, frozen)
      return dpo_eval_step(policy, batch, graphdef=graphdef, beta=beta, reference_params=reference)

    self._eval_step = jax.jit(
      eval_with_frozen,
      in_shardings=(param_shardings, self.batch_sharding, replicated, frozen_shardings),
      out_shardings=replicated,
    )

  def abstract_state(self) -> State:
    shapes = jax.eval_shape(self._init_state)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, self.state_shardings)

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    """A global batch of this run as shapes: inputs and targets, plus weights, segment ids and positions for chat;
    chosen and rejected inputs, targets and weights for preference pairs."""
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
    """The train step lowered for this run (abstract state and batch unless given, so nothing is allocated);
    ``.compile()`` gives the executable, its memory analysis and cost (plan.py, bench/train.py)."""
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
    with sharding.activate(self.mesh, self.rules):
      return jax.jit(self._init_state, out_shardings=self.state_shardings)()

  def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows → one global array per key, split over the mesh as the batch rules say."""
    return {
      k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v)) for k, v in local_batch.items()
    }

  def load_frozen(self, init_from: str, step: int | None = None) -> int | None:
    """Reads what the step keeps frozen from `init_from` (its latest step unless `step`), into its shards and
    storage dtype: a LoRA run's base, a full DPO run's reference. Returns the step read (None: nothing to read)."""
    if not self.abstract_frozen:
      self.frozen = {}
      return None
    ((name, abstract),) = self.abstract_frozen.items()
    step = checkpoint_lib.resolve_step(init_from, step)
    params = checkpoint_lib.load_params(
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
    with sharding.activate(self.mesh, self.rules):
      return self._train_step(state, batch, self._frozen())

  def evaluate(self, params: Any, batches, token_bytes: jax.Array) -> dict[str, float]:
    totals = None
    with sharding.activate(self.mesh, self.rules):
      for batch in batches:
        sums = self._eval_step(params, self.global_batch(batch), token_bytes, self._frozen())
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    if totals is None:
      return {}
    summarize = summarize_eval if self.dpo_beta is None else summarize_dpo
    return summarize({k: float(v) for k, v in jax.device_get(totals).items()})


def _restore_or_init(
  trainer: Trainer, checkpointer: checkpoint_lib.TrainCheckpointer, data_iter, run_config: RunConfig
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
    state["params"] = checkpoint_lib.load_init_params(
      run_config.init_from, run_config.model, trainer.state_shardings["params"]
    )
  return state, 0


def _load_frozen(
  trainer: Trainer, checkpointer: checkpoint_lib.TrainCheckpointer, run_config: RunConfig, workdir: str, is_main: bool
) -> None:
  """Reads what a LoRA or DPO run keeps frozen from init_from: on a new run its latest step, recorded in lora.json
  (reference.json for full DPO); on a resume the recorded step, refused if its files or the adapter settings changed
  (the adapters fit that base only, and a DPO loss means nothing against another reference)."""
  init_from, lora_cfg = run_config.init_from, trainer.lora
  name = lora_lib.LORA_FILE if lora_cfg is not None else lora_lib.REFERENCE_FILE
  record = lora_lib.read_record(workdir, name) if checkpointer.latest_step() is not None else None
  if record is None:
    differences = checkpoint_lib.shape_differences(checkpoint_lib.read_model_config(init_from), run_config.model)
    if differences:
      raise checkpoint_lib.CheckpointError(
        f"init_from {init_from!r} holds a different model ({', '.join(differences)}); its model config must match "
        f"this run's"
      )
    step = trainer.load_frozen(init_from)
    if is_main:
      record = lora_lib.frozen_record(init_from, step)
      lora_lib.write_record(
        workdir, record if lora_cfg is None else lora_lib.base_record(lora_cfg, init_from, step), name
      )
    return
  if (lora_cfg is not None and lora_lib.config_of(record) != lora_cfg) or not lora_lib.same_dir(
    record["base"], init_from
  ):
    held = (
      f"adapters of rank {record['rank']}, alpha {record['alpha']}, targets {tuple(record['targets'])}"
      if lora_cfg
      else "a run"
    )
    asked = f"rank {lora_cfg.rank}, alpha {lora_cfg.alpha}, targets {lora_cfg.targets}" if lora_cfg else "a run"
    raise lora_lib.LoraError(
      f"workdir {workdir!r} holds {held} on {record['base']!r}; this run asks for {asked} on {init_from!r}: use a "
      f"new --workdir"
    )
  lora_lib.check_base(workdir, record)
  trainer.load_frozen(record["base"], record["base_step"])


def train(run_config: RunConfig | Any, workdir: str, hooks: Sequence[Hook] = ()) -> dict[str, Any]:
  """Trains (or resumes) a run in `workdir`; returns the last train and validation metrics. `hooks` run after the
  run's own, after every step (tests inject faults this way). The workdir is locked for the run (workdir_lock.py): a
  second run on it stops with one line naming this one."""
  lock = workdir_lock.WorkdirLock(workdir)
  try:
    return _locked_train(run_config, workdir, hooks, lock)
  finally:
    lock.release()


def _locked_train(
  run_config: RunConfig | Any, workdir: str, hooks: Sequence[Hook], lock: workdir_lock.WorkdirLock
) -> dict[str, Any]:
  """`train`'s body: `lock` is taken once the config and mesh are checked, and released by `train` however it ends."""
  run_config = config_lib.run_config_from(run_config)  # every value is checked before anything is written
  distributed.maybe_initialize_distributed()
  model_cfg, train_cfg, is_main = run_config.model, run_config.train, distributed.is_main_process()
  trainer = Trainer(model_cfg, run_config, sharding.make_mesh(run_config.mesh))  # mesh and shapes checked too
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  lock.acquire()  # before anything else is written to the workdir (metadata, data, metrics, checkpoints)
  checkpointer = checkpoint_lib.TrainCheckpointer(
    workdir, keep=train_cfg.keep, keep_every=train_cfg.keep_every, async_save=train_cfg.async_save
  )
  checkpointer.check_compatible(model_cfg)  # before anything is written to the workdir
  if trainer.abstract_frozen:  # a LoRA base or a DPO reference, checked and read before any data is prepared
    _load_frozen(trainer, checkpointer, run_config, workdir, is_main)
  tokenizer, run_data = prepare_run_data(run_config, workdir)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise data_lib.DataError(
      f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
      f"{model_cfg.vocab_size}; set --config.model.vocab_size={tokenizer.vocab_size}"
    )
  if is_main:
    checkpointer.write_metadata(model_cfg, run_config.to_json(), tokenizer.serialized())
  data_iter = iter(run_data.dataset)
  state, start = _restore_or_init(trainer, checkpointer, data_iter, run_config)
  token_bytes = jax.device_put(
    np.asarray(tokenizer.token_byte_lengths(), np.float32), NamedSharding(trainer.mesh, PartitionSpec())
  )

  progress = ProgressHook(start, train_cfg.steps) if is_main and sys.stderr.isatty() else None
  echo = progress.bar.write if progress is not None else functools.partial(print, flush=True)
  writer = MetricsWriter(
    workdir,
    is_main,
    log_every=train_cfg.log_every,
    echo=echo,
    start_step=start,
    tokens_per_step=train_cfg.batch_size * train_cfg.seq_len,
    flops_per_step=flops_per_token(model_cfg, train_cfg.seq_len) * train_cfg.batch_size * train_cfg.seq_len,
    peak_flops=peak_flops_per_device(train_cfg.peak_flops_per_device) * jax.device_count(),
  )
  evaluator = EvalHook(
    lambda params: trainer.evaluate(
      params,
      data_lib.eval_batches(
        run_data.val_examples, train_cfg.batch_size, train_cfg.eval_batches, jax.process_index(), jax.process_count()
      ),
      token_bytes,
    ),
    writer,
    train_cfg.eval_every,
  )
  fine_tune_start = start == 0 and bool(run_config.init_from)
  if is_main:
    echo(
      f"model {model_cfg.num_params():,} params"
      + (
        f" | LoRA rank {trainer.lora.rank} on {','.join(trainer.lora.targets)}: "
        f"{lora_lib.num_adapter_params(model_cfg, trainer.lora):,} trainable"
        if trainer.lora
        else ""
      )
      + f" | mesh {dict(trainer.mesh.shape)} | {run_data.summary} | steps {start} → {train_cfg.steps}"
      + (f" | init from {run_config.init_from}" if fine_tune_start else "")
    )

  loop = TrainLoop(
    lambda s, b: trainer.train_step(s, trainer.global_batch(b)), data_iter, state, start, train_cfg.steps
  )
  run_hooks = [
    progress,
    RecordBatchesHook(workdir) if train_cfg.record_batches and is_main else None,
    MetricsHook(writer),
    NonFiniteHook(train_cfg.on_nonfinite, train_cfg.max_skipped_steps, train_cfg.save_every, checkpointer.latest_step),
    evaluator if train_cfg.eval_every else None,
    CheckpointHook(checkpointer, data_iter.get_state, train_cfg.save_every),
    PreemptionHook(echo if is_main else None),
    ProfileHook(checkpoint_lib.local_dir(workdir, "profile"), *train_cfg.profile_steps)
    if train_cfg.profile_steps
    else None,
    *hooks,
  ]
  for hook in run_hooks:
    if hook is not None:
      loop.add_hook(hook)
  if fine_tune_start and train_cfg.eval_every:
    evaluator.run(0, state["params"])  # the starting point of a fine-tune, for a before/after comparison
  loop.run()
  return dict(step=loop.step, train=writer.last_train, val=evaluator.last)


def main(argv=None, hooks: Sequence[Hook] = ()) -> None:
  from absl import app, flags
  from ml_collections import config_flags

  config_flag = config_flags.DEFINE_config_file("config", None, "run config file, e.g. configs/tiny.py")
  workdir_flag = flags.DEFINE_string(
    "workdir", None, "run directory (checkpoints, metrics, data); default runs/<config name>"
  )
  coordinator_flag = flags.DEFINE_string(
    "coordinator_address",
    None,
    "multi-process runs (e.g. several GPU hosts): "
    "HOST:PORT of process 0; not needed on Cloud TPU slices, SLURM or Open MPI",
  )
  num_processes_flag = flags.DEFINE_integer("num_processes", None, "multi-process runs: the number of processes")
  process_id_flag = flags.DEFINE_integer("process_id", None, "multi-process runs: this process's index, from 0")
  flags.mark_flags_as_required(["config"])

  def run(_):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("absl", "orbax", "jax"):
      logging.getLogger(noisy).setLevel(logging.WARNING)
    run_config = cli.run_config_from_flag_or_exit(config_flag)
    config_path = flags.FLAGS["config"].config_filename
    workdir = workdir_flag.value or os.path.join("runs", os.path.splitext(os.path.basename(config_path))[0])
    run_or_exit(
      distributed.maybe_initialize_distributed, coordinator_flag.value, num_processes_flag.value, process_id_flag.value
    )
    result = run_or_exit(train, run_config, workdir, hooks)
    if jax.process_index() == 0 and result["val"]:
      val = result["val"]
      detail = (
        f"bits/byte {val['bits_per_byte']:.4f}"
        if "bits_per_byte" in val
        else f"reward accuracy {val['reward_accuracy']:.4f}, margin {val['margin']:.4f}"
      )
      print(f"done: step {result['step']}, validation loss {val['loss']:.4f}, {detail} (workdir {workdir})")

  app.run(run, argv, flags_parser=cli.parse_flags_or_exit)


if __name__ == "__main__":
  main()
