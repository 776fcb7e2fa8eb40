"""``python -m tests.fault_injection MODE STEP <train flags>``: ``python -m llama_jax.train`` with one more hook, run
after the run's own hooks once step STEP is done. MODE is one of

  sigkill  SIGKILL the process while step STEP's checkpoint save is in flight: everything of it is written but orbax's
           final commit (locally the atomic rename of ``checkpoints/STEP.orbax-checkpoint-tmp-*`` to
           ``checkpoints/STEP``; on gs:// the ``commit_success.txt`` marker written into ``checkpoints/STEP``), which is
           held back until the kill. What a crash mid-save leaves behind, deterministically.
  sigterm  send SIGTERM to the process itself, as a preempting scheduler would.
  nan      make the loss of step STEP not finite (STEP:N: of N steps from STEP on), through per-token weights of NaN:
           what a diverging learning rate or a damaged batch does to a step.

Test-only; the production loop knows nothing of it.
"""

import itertools
import os
import signal
import sys
import threading

import jax
import numpy as np
from orbax.checkpoint._src.path import atomicity

from llama_jax import train as train_lib
from llama_jax.training import trainer
from llama_jax.training.loop import Hook

COMMIT_TIMEOUT_S = 300


def hold_back_commit(step: int) -> threading.Event:
  """Makes orbax never commit checkpoint step `step`; the event is set when the commit is reached, i.e. once every
  item of the step is written into its temporary directory."""
  reached = threading.Event()

  def hold(finalize):
    async def held_finalize(self):
      final = self.get_final()
      if final.name != str(step) or final.parent.name != "checkpoints":  # other steps, and items inside a step
        return await finalize(self)
      reached.set()
      if threading.current_thread() is threading.main_thread():  # a synchronous save: nothing else to wait for
        os.kill(os.getpid(), signal.SIGKILL)
      threading.Event().wait()  # the background save thread waits here until the kill

    return held_finalize

  # orbax commits local steps by a rename, gs:// ones (where a rename is a copy) by a marker file.
  for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
    cls.finalize = hold(cls.finalize)
  return reached


class KillAfterSave(Hook):
  """SIGKILL once the save of `step` (started by the checkpoint hook, which runs before this one) reaches its commit."""

  def __init__(self, step: int):
    self.step = step
    self.commit_reached = hold_back_commit(step)

  def after_step(self, info) -> None:
    if info.step != self.step:
      return
    if not self.commit_reached.wait(COMMIT_TIMEOUT_S):
      # Not a SIGKILL, so the test says what went wrong instead of finding a complete step.
      print(f"fault_injection: the step-{self.step} save never reached its commit", file=sys.stderr, flush=True)
      os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


class TerminateAfterStep(Hook):
  """SIGTERM to this process after `step`: the run's preemption hook should stop the loop right there."""

  def __init__(self, step: int):
    self.step = step

  def after_step(self, info) -> None:
    if info.step == self.step:
      os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler in this thread before the next step starts


def poison_steps(first: int, count: int) -> None:
  """Every train step gets per-token weights (1, which changes nothing: the same compiled step throughout), NaN for
  steps first .. first+count-1 (counted from the first step this process runs)."""
  original = trainer.Trainer.train_step
  steps = itertools.count(1)

  def train_step(self, state, batch):
    value = np.nan if first <= next(steps) < first + count else 1.0
    targets = batch["targets"]
    weights = jax.make_array_from_callback(
      targets.shape, targets.sharding, lambda index: np.full(targets.shape, value, np.float32)[index]
    )
    return original(self, state, {**batch, "weights": weights})

  trainer.Trainer.train_step = train_step


HOOKS = {"sigkill": KillAfterSave, "sigterm": TerminateAfterStep}

if __name__ == "__main__":
  mode, step, *train_flags = sys.argv[1:]
  if mode == "nan":
    first, _, count = step.partition(":")
    poison_steps(int(first), int(count or 1))
    train_lib.main([sys.argv[0], *train_flags])
  else:
    train_lib.main([sys.argv[0], *train_flags], hooks=[HOOKS[mode](int(step))])
