"""The training loop as steps plus hooks: the loop runs steps; logging, evaluation, checkpoints, batch records,
preemption and profiling are hooks attached to it (Levanter's ``Trainer.add_hook(fn, every=N)`` shape).

A hook sees each step through a ``StepInfo`` (the step number, the state after it, its device metrics, the host batch
it consumed) and may ask the loop to stop. Hooks run in the order they were added, after the step is dispatched.

The loop keeps a ``StepClock`` (goodput.py): the wait for each batch is timed as ``data``, and a hook with a ``phase``
(checkpoint saves, evaluation) is timed as that phase, so each logged window says where its time went.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import signal
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from llama_jax.checkpoint.train_state import TrainCheckpointer
from llama_jax.core import distributed, paths
from llama_jax.core.errors import LlamaJaxError
from llama_jax.training.goodput import StepClock
from llama_jax.training.metrics import MetricsWriter


@dataclasses.dataclass
class StepInfo:
  step: int  # steps done so far (the step just dispatched)
  state: Any  # the train state after that step (on the devices; reading it waits for the step)
  metrics: dict[str, Any]  # that step's metrics, still on the devices
  batch: dict[str, np.ndarray] | None  # the host batch it consumed (this process's rows)
  last: bool  # the run's final step (train.steps reached)


class Hook:
  """Something the loop calls around its steps; subclass it and override the calls you need, each a no-op here.

  The loop calls `begin` before the first step, `after_step` after each step that is a multiple of `every` (and
  after the last one when `at_last`), `end` once after the last step (also after a stop), and `close` always, even
  when a step raised. Hooks run in the order they were added, after the step is dispatched.

  Attributes:
    every: call `after_step` after each step that is a multiple of this; 0: never after a step.
    at_last: also call `after_step` after the run's final step.
    phase: the goodput phase its calls are timed as, e.g. ``checkpoint`` or ``eval``; None: part of the step's own
      time.
  """

  every: int = 1  # 0: never after a step
  at_last: bool = False
  phase: str | None = None  # the goodput phase its calls are timed as (None: part of the step's own time)

  def begin(self, loop: TrainLoop) -> None:
    """Called once before the first step.

    Args:
      loop: the loop that runs the hook; a hook may keep it to call `TrainLoop.request_stop` later.
    """
    pass

  def after_step(self, info: StepInfo) -> None:
    """Called after a step is dispatched, when the step is a multiple of `every` or the last with `at_last`.

    Args:
      info: the step number, the state after it and its metrics, both still on the devices, and the host batch.
    """
    pass

  def end(self, info: StepInfo) -> None:
    """Called once after the last step, or after the step where a stop was requested; not when a step raised.

    Args:
      info: the loop's final step and state.
    """
    pass

  def close(self) -> None:
    """Called always at the end of `TrainLoop.run`, even when a step or a hook raised: release resources here."""
    pass


class FunctionHook(Hook):
  def __init__(self, fn: Callable[[StepInfo], None], every: int, at_last: bool):
    self.fn, self.every, self.at_last = fn, every, at_last

  def after_step(self, info: StepInfo) -> None:
    self.fn(info)


class TrainLoop:
  """Runs `step_fn(state, batch) -> (state, metrics)` from step `start` to `steps` over `batches`, calling hooks.

  The wait for each batch is timed as the ``data`` phase of `clock`, and a hook's calls as its ``phase``, so each
  logged window says where its time went.

  Args:
    step_fn: one train step, ``step_fn(state, batch) -> (state, metrics)``; it dispatches without waiting.
    batches: the host batches, one taken per step.
    state: the train state to start from.
    start: the step `state` is at, 0 or the step resumed from.
    steps: the step to stop at, ``train.steps``.
    clock: the phase clock shared with the metrics writer; None makes a new `StepClock`.

  Attributes:
    step: steps done so far.
    state: the train state after `step`.
    failed: a step or a hook raised; set before the hooks' `close` calls run.
  """

  def __init__(
    self,
    step_fn: Callable,
    batches: Iterator[dict[str, np.ndarray]],
    state: Any,
    start: int,
    steps: int,
    clock: StepClock | None = None,
  ):
    self.step_fn, self.batches, self.state = step_fn, batches, state
    self.start, self.step, self.steps = start, start, steps
    self.clock = clock or StepClock()
    self.hooks: list[Hook] = []
    self.stop_requested = False
    self.failed = False  # a step or a hook raised: the close calls run as the error propagates

  def add_hook(self, hook: Hook | Callable[[StepInfo], None], every: int = 1, at_last: bool = False) -> None:
    """Add a hook, run after the hooks added before it.

    Args:
      hook: a `Hook`, or a function of a `StepInfo` that becomes a hook's `after_step`.
      every: for a function, call it after each step that is a multiple of this; a `Hook` keeps its own.
      at_last: for a function, also call it after the run's final step.
    """
    self.hooks.append(hook if isinstance(hook, Hook) else FunctionHook(hook, every, at_last))

  def request_stop(self) -> None:
    """Stop after the current step (the end hooks still run: a final save, the last metrics)."""
    self.stop_requested = True

  def run(self) -> Any:
    """Run the steps from `step` to `steps`, or until a stop is requested, calling the hooks.

    Returns:
      The train state after the last step run.

    Raises:
      Exception: whatever a step or a hook raises, e.g. ``NonFiniteError`` from `NonFiniteHook`, after every
        hook's `close` has run.
    """
    info = StepInfo(self.step, self.state, {}, None, self.step >= self.steps)
    try:
      for hook in self.hooks:
        hook.begin(self)
      while self.step < self.steps and not self.stop_requested:
        with self.clock.measure("data"):
          batch = next(self.batches)
        self.state, metrics = self.step_fn(self.state, batch)
        self.step += 1
        info = StepInfo(self.step, self.state, metrics, batch, self.step == self.steps)
        for hook in self.hooks:
          if (hook.every and self.step % hook.every == 0) or (hook.at_last and info.last):
            self._timed(hook, hook.after_step, info)
      info = dataclasses.replace(info, step=self.step, state=self.state)
      for hook in self.hooks:
        self._timed(hook, hook.end, info)
    except BaseException:
      self.failed = True
      raise
    finally:
      for hook in self.hooks:
        self._timed(hook, hook.close)
    return self.state

  def _timed(self, hook: Hook, call: Callable, *args) -> None:
    if hook.phase is None:
      call(*args)
      return
    with self.clock.measure(hook.phase):
      call(*args)


# ---------------------------------------------------------------------------------------------------------------------
# The hooks of a training run


class MetricsHook(Hook):
  """Hands each step's device metrics to the writer, which writes them one step late; the rest at the end."""

  def __init__(self, writer: MetricsWriter):
    self.writer, self._loop = writer, None

  def begin(self, loop: TrainLoop) -> None:
    self._loop = loop

  def after_step(self, info: StepInfo) -> None:
    self.writer.add_step(info.step, info.metrics)

  def end(self, info: StepInfo) -> None:
    self.writer.finish()

  def close(self) -> None:
    self.writer.close(failed=self._loop is not None and self._loop.failed)


class EvalHook(Hook):
  """Every `every` steps and after the last: validation metrics, written after the train line that is due."""

  at_last = True
  phase = "eval"

  def __init__(self, evaluate: Callable[[Any], dict[str, float]], writer: MetricsWriter, every: int):
    self.evaluate, self.writer, self.every = evaluate, writer, every
    self.last: dict[str, float] = {}

  def run(self, step: int, params: Any) -> None:
    self.writer.flush()
    metrics = self.evaluate(params)
    if metrics:
      self.writer.write(step, metrics, prefix="val_")
      self.last = metrics

  def after_step(self, info: StepInfo) -> None:
    self.run(info.step, info.state["params"])


class NonFiniteError(LlamaJaxError, ValueError):
  """Training met non-finite losses or gradients it may not skip; the message names the step and what was kept."""


class NonFiniteHook(Hook):
  """Acts on steps whose loss or gradients were not finite (train_step never applies them): "stop" ends the run at the
  first, "skip" goes on unless `max_skipped` follow in a row. Flags are read one step late, like the metrics, except
  at save steps and at the end, where they are read at once: so no checkpoint is written after such a step, and
  `keep` never rotates a good one out because of it. Run before the checkpoint hook."""

  def __init__(self, policy: str, max_skipped: int, save_every: int, latest_step: Callable[[], int | None]):
    self.policy, self.max_skipped, self.save_every, self.latest_step = policy, max_skipped, save_every, latest_step
    self._pending: list[tuple[int, Any]] = []
    self.in_a_row = self.skipped = 0

  def after_step(self, info: StepInfo) -> None:
    self._pending.append((info.step, info.metrics["nonfinite"]))
    saving = info.last or info.step % self.save_every == 0
    self._check(info.step if saving else info.step - 1)

  def end(self, info: StepInfo) -> None:
    self._check(info.step)

  def _check(self, until: int) -> None:
    ready = [(s, flag) for s, flag in self._pending if s <= until]
    self._pending = [(s, flag) for s, flag in self._pending if s > until]
    for step, flag in zip([s for s, _ in ready], jax.device_get([flag for _, flag in ready])):
      if not flag:
        self.in_a_row = 0
        continue
      self.skipped += 1
      self.in_a_row += 1
      latest = self.latest_step()
      kept = f"nothing after step {step - 1} is saved; " + (
        f"the latest checkpoint is step {latest}" if latest is not None else "no checkpoint is saved yet"
      )
      if self.policy == "stop":
        raise NonFiniteError(
          f"step {step}: the loss or the gradients are not finite, so training stopped "
          f"(train.on_nonfinite='stop'); {kept}. Lower train.lr, check the data, or set "
          f"--config.train.on_nonfinite=skip"
        )
      if self.in_a_row >= self.max_skipped:
        raise NonFiniteError(
          f"steps {step - self.in_a_row + 1}–{step}: {self.in_a_row} steps in a row with non-finite "
          f"loss or gradients, train.max_skipped_steps is {self.max_skipped}; {kept}. Lower "
          f"train.lr or check the data"
        )


class CheckpointHook(Hook):
  """Saves every `every` steps (asynchronously), and at the end when the last step is not saved yet (the run's final
  step, or the step where a stop was requested). Timed as the checkpoint phase: what an asynchronous save blocks
  (the copy to host, waiting for the previous save) and, at the end, the wait for the last save to be written."""

  phase = "checkpoint"

  def __init__(self, checkpointer: TrainCheckpointer, data_state: Callable[[], Any], every: int):
    self.checkpointer, self.data_state, self.every = checkpointer, data_state, every

  def after_step(self, info: StepInfo) -> None:
    if not info.last:
      self.checkpointer.save(info.step, info.state, self.data_state())

  def end(self, info: StepInfo) -> None:
    if info.step > (self.checkpointer.latest_step() or 0):
      self.checkpointer.save(info.step, info.state, self.data_state())

  def close(self) -> None:
    self.checkpointer.close()


class RecordBatchesHook(Hook):
  """Appends each step's batch digest to batches.jsonl: which data a step saw (provenance, resume checks)."""

  def __init__(self, workdir: str):
    self.path = str(paths.path(workdir, paths.BATCHES_FILE))

  def after_step(self, info: StepInfo) -> None:
    digest = hashlib.sha256(np.ascontiguousarray(info.batch["inputs"]).tobytes()).hexdigest()[:16]
    paths.append_line(self.path, json.dumps({"step": info.step, "inputs_sha256": digest}))


class PreemptionHook(Hook):
  """SIGTERM (a preempted VM, a cluster scheduler) stops the loop after a step; the checkpoint hook then saves that
  step, and rerunning the same command resumes.

  One process: a Python handler stops the loop after the current step. Several: the signal may reach only some of
  them, yet all must stop at the same step (the save is collective; one that trained on would wait in the next step's
  all-reduce). JAX's preemption service, on with jax.distributed, then owns SIGTERM and picks the step: a local check
  after every step (no message). Where that service is off, a Python handler notes the signal and the processes
  compare notes every `agree_every` steps (an all-gather and a host sync, too dear for every step).
  """

  def __init__(self, echo: Callable[[str], None] | None, agree_every: int = 10):
    self.echo, self.agree_every = echo, agree_every
    self.requested = self.signalled = False
    self._loop, self._previous, self._start, self._service, self._alone = None, None, 0, False, True

  def begin(self, loop: TrainLoop) -> None:
    self._loop, self._start, self._alone = loop, loop.step, jax.process_count() == 1
    self._service = distributed.preemption_sync_available()
    if not self._service:  # a Python handler would replace the service's C++ one, and the service would never know
      self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame) -> None:
    self.signalled = True
    if self._alone:
      self._stop()

  def after_step(self, info: StepInfo) -> None:
    if self._service:
      # Steps run by this process, from 1: what the service counts in (all processes start at the same step).
      if distributed.reached_preemption_sync_point(info.step - self._start):
        self._stop()
    elif not self._alone and info.step % self.agree_every == 0 and distributed.agree(self.signalled, "any"):
      self._stop()

  def _stop(self) -> None:
    self.requested = True
    self._loop.request_stop()

  def end(self, info: StepInfo) -> None:
    if self.requested and self.echo is not None:
      who = "" if self._alone else f" (SIGTERM reached one or more of the {jax.process_count()} processes)"
      self.echo(f"stopped by signal at step {info.step}{who}; checkpoint saved, rerun the same command to resume")

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


class ProfileHook(Hook):
  """A jax.profiler trace of steps start .. start+count-1 into `log_dir` (TensorBoard's profile plugin reads it)."""

  def __init__(self, log_dir: str, start: int, count: int):
    self.log_dir, self.first, self.final = log_dir, start, start + count - 1
    self.tracing = False

  def begin(self, loop: TrainLoop) -> None:
    if self.first <= loop.step + 1 <= self.final:
      self._start()

  def after_step(self, info: StepInfo) -> None:
    if info.step == self.first - 1:
      self._start()
    elif self.tracing and info.step >= self.final:
      jax.block_until_ready(info.state)  # the trace ends when the traced steps' device work has
      self._stop()

  def _start(self) -> None:
    paths.path(self.log_dir).mkdir(parents=True, exist_ok=True)  # local or gs://, as the workdir is
    jax.profiler.start_trace(self.log_dir)
    self.tracing = True

  def _stop(self) -> None:
    jax.profiler.stop_trace()
    self.tracing = False

  def close(self) -> None:
    if self.tracing:
      self._stop()


class ProgressHook(Hook):
  """A tqdm bar on a terminal (process 0); its `write` keeps log lines above the bar."""

  def __init__(self, start: int, total: int):
    from tqdm import tqdm

    self.bar = tqdm(initial=start, total=total, unit="step", dynamic_ncols=True)

  def after_step(self, info: StepInfo) -> None:
    self.bar.update(1)

  def close(self) -> None:
    self.bar.close()
