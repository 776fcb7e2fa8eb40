"""``python -m tests.fault_injection STEP <train flags>``: ``python -m llama_jax.train`` with one more hook, which
SIGKILLs the process right after step STEP's checkpoint save has started (the async write still in flight): what a
crash mid-save leaves behind. Test-only; the production loop knows nothing of it."""

import os
import signal
import sys

from llama_jax import train
from llama_jax.loop import Hook


class KillAfterSave(Hook):
  """Runs after the run's own hooks, so after the checkpoint hook has started the save of `step`."""

  def __init__(self, step: int):
    self.step = step

  def after_step(self, info) -> None:
    if info.step == self.step:
      os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
  train.main([sys.argv[0], *sys.argv[2:]], hooks=[KillAfterSave(int(sys.argv[1]))])
