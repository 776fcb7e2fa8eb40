"""``python -m tests.stress.fuzz_child <train flags>``: ``python -m llama_jax.train`` that reports where it is, for
crash_fuzz.py to SIGKILL it at a chosen moment of a chosen phase. Test-only; what the run computes is unchanged.

Each event is one line ``<time.monotonic()> <phase> <begin|end|at> [n]`` (the machine's monotonic clock, which the
fuzzer shares) written with one ``os.write`` to the file descriptor named by CRASH_FUZZ_EVENTS_FD (a pipe: whatever
was written before a kill is still there to be read):

  tokenizer begin/end   load_tokenizer_for_run: writing the corpus and training the tokenizer (or loading one)
  data begin/end        text.prepare: tokenizing the splits into the prepared shards (or finding them prepared)
  restore begin/end N   restoring checkpoint N
  train begin N         the loop starts after step N; ``step at K`` after step K is dispatched and its hooks ran
                        (its evaluation and save begin before it); ``train end K``
  save begin/end K      an async save of step K, from its start to orbax's commit (the rename out of the tmp name)
  eval begin/end K      the evaluation at step K
"""

import functools
import os
import sys
import time

from orbax.checkpoint._src.path import atomicity

from llama_jax import train
from llama_jax.checkpoint import train_state
from llama_jax.data import run_data, text
from llama_jax.training import loop

EVENTS_FD_ENV = "CRASH_FUZZ_EVENTS_FD"


def report(phase: str, what: str, n: object = "") -> None:
  fd = int(os.environ[EVENTS_FD_ENV])
  os.write(fd, f"{time.monotonic():.6f} {phase} {what} {n}".rstrip().encode() + b"\n")


def around(owner, name: str, phase: str, label=None, end: bool = True) -> None:
  """Reports `phase` begin (and end, unless something else does) around every call of `owner.name`; label(*args)
  names the call."""
  original = getattr(owner, name)

  @functools.wraps(original)
  def wrapper(*args, **kwargs):
    n = label(*args) if label else ""
    report(phase, "begin", n)
    result = original(*args, **kwargs)
    if end:
      report(phase, "end", n)
    return result

  setattr(owner, name, wrapper)


def report_commits() -> None:
  """`save end K` once orbax has renamed checkpoints/K.orbax-checkpoint-tmp-* to checkpoints/K (a background thread
  when saves are async)."""
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def reporting_finalize(self, *args, **kwargs):
    result = await finalize(self, *args, **kwargs)
    final = self.get_final()
    if final.parent.name == "checkpoints" and final.name.isdigit():
      report("save", "end", final.name)
    return result

  atomicity.AtomicRenameTemporaryPath.finalize = reporting_finalize


class ReportSteps(loop.Hook):
  def begin(self, loop) -> None:
    report("train", "begin", loop.step)

  def after_step(self, info) -> None:
    report("step", "at", info.step)

  def end(self, info) -> None:
    report("train", "end", info.step)


def install() -> None:
  around(run_data, "load_tokenizer_for_run", "tokenizer")
  around(text, "prepare", "data")
  around(train_state.TrainCheckpointer, "restore", "restore", label=lambda self, step, *_: step)
  around(train_state.TrainCheckpointer, "save", "save", label=lambda self, step, *_: step, end=False)
  report_commits()  # a save ends at its commit
  around(loop.EvalHook, "run", "eval", label=lambda self, step, *_: step)


if __name__ == "__main__":
  install()
  train.main([sys.argv[0], *sys.argv[1:]], hooks=[ReportSteps()])
