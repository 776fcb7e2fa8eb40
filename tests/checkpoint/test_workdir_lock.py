"""One writer per workdir: a second run stops at once with one line naming the holder while the first finishes with
a workdir that describes it alone; a lock left by a killed run is taken over with a notice and the rerun resumes.

``python -m tests.checkpoint.test_workdir_lock STEP <train flags>`` is ``python -m llama_jax.train`` that pauses after
step STEP (holding the lock) until a line arrives on stdin: a deterministic "the first run is busy", without sleeps.
"""

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading

import pytest

from llama_jax.checkpoint.workdir_lock import Holder, WorkdirLock, WorkdirLockedError
from llama_jax.core.paths import LOCK_FILE
from llama_jax.training.loop import Hook
from tests.conftest import ROOT, needs_shakespeare
from tests.runs import assert_one_line_error, read_jsonl, run_train, train_args

PAUSED = "paused after step"


def dead_pid() -> int:
  """The pid of a process that has ended (and been reaped), so nothing runs under it."""
  process = subprocess.Popen([sys.executable, "-c", "pass"])
  process.wait()
  return process.pid


def write_record(workdir, holder: Holder) -> None:
  (workdir / LOCK_FILE).write_text(holder.to_json())


def test_a_held_workdir_is_refused_naming_the_holder_and_free_once_released(tmp_path):
  first = WorkdirLock(tmp_path)
  first.acquire()
  assert Holder.parse((tmp_path / LOCK_FILE).read_text()) == first.holder
  with pytest.raises(
    WorkdirLockedError, match=rf"is in use by another run \(pid {os.getpid()} on {re.escape(socket.gethostname())}"
  ):
    WorkdirLock(tmp_path).acquire()  # flock locks belong to open files: even this process is refused
  first.release()
  assert not (tmp_path / LOCK_FILE).exists()
  second = WorkdirLock(tmp_path)
  second.acquire()
  second.release()
  second.release()  # a no-op, as in train()'s finally after a refused start


def test_a_lock_left_by_a_dead_process_on_this_host_is_taken_over_with_a_notice(tmp_path, caplog):
  gone = Holder(socket.gethostname(), dead_pid(), "2026-01-01T00:00:00.000+00:00")
  write_record(tmp_path, gone)
  lock = WorkdirLock(tmp_path)
  with caplog.at_level(logging.WARNING, logger="llama_jax.checkpoint.workdir_lock"):
    lock.acquire()
  assert any("taking over the lock" in r.getMessage() and str(gone) in r.getMessage() for r in caplog.records)
  assert Holder.parse((tmp_path / LOCK_FILE).read_text()) == lock.holder
  lock.release()


def test_a_lock_left_on_another_host_is_refused_with_how_to_clear_it(tmp_path):
  write_record(tmp_path, Holder("some-other-host", 12345, "2026-01-01T00:00:00.000+00:00"))
  with pytest.raises(WorkdirLockedError, match=r"pid 12345 on some-other-host.*once that run has ended, delete"):
    WorkdirLock(tmp_path).acquire()
  assert (tmp_path / LOCK_FILE).exists()  # left for a person to judge


def test_a_remote_workdir_lock_is_a_checked_file(tmp_path, caplog):
  """The gs:// path through epath, exercised on a local directory (epath treats both alike)."""

  def remote_lock():
    lock = WorkdirLock(tmp_path)
    lock.remote = True
    return lock

  first = remote_lock()
  first.acquire()
  with pytest.raises(WorkdirLockedError, match=r"a remote workdir's lock is a plain file"):
    remote_lock().acquire()
  first.release()
  assert not (tmp_path / LOCK_FILE).exists()
  write_record(tmp_path, Holder(socket.gethostname(), dead_pid(), "2026-01-01T00:00:00.000+00:00"))
  with caplog.at_level(logging.WARNING, logger="llama_jax.checkpoint.workdir_lock"):
    taken = remote_lock()
    taken.acquire()
  assert any("taking over the lock" in r.getMessage() for r in caplog.records)
  taken.release()


FIRST_FLAGS = (
  "--config.train.steps=8",
  "--config.train.save_every=2",
  "--config.train.keep=2",
  "--config.train.eval_every=0",
)


@pytest.fixture(scope="module")
def contested(tmp_path_factory, small_tokenizer):
  """(workdir, first run's output, second run's result): the first run pauses after step 3 holding the lock, a second
  run with another learning rate and save_every=1 starts on the same workdir, then the first run finishes."""
  workdir = tmp_path_factory.mktemp("contested") / "shared"
  args = train_args(workdir, small_tokenizer, *FIRST_FLAGS, module=("tests.checkpoint.test_workdir_lock", "3"))
  first = subprocess.Popen(
    args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  watchdog = threading.Timer(300, first.kill)  # whatever goes wrong, the first run dies within the limit
  watchdog.start()
  try:
    seen = []
    for line in first.stdout:
      seen.append(line)
      if line.startswith(PAUSED):
        break
    assert seen and seen[-1].startswith(PAUSED), "".join(seen)
    second = run_train(workdir, small_tokenizer, "--config.train.lr=5e-3", "--config.train.save_every=1", check=False)
    held_by = Holder.parse((workdir / LOCK_FILE).read_text())
    output = "".join(seen) + first.communicate("\n")[0]
  finally:
    watchdog.cancel()
    if first.poll() is None:  # an assertion above failed while the first run waits: end it
      first.kill()
  assert first.returncode == 0, output
  return workdir, first.pid, held_by, second


@needs_shakespeare
def test_a_second_run_stops_at_once_and_the_first_finishes_with_a_consistent_workdir(contested):
  workdir, first_pid, held_by, second = contested
  assert_one_line_error(second, "is in use by another run", f"pid {first_pid} on {socket.gethostname()}")
  assert held_by.pid == first_pid  # the refusal left the first run's lock alone
  assert sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()) == [6, 8]  # keep=2, no others
  with open(workdir / "run_config.json") as f:
    run_config = json.load(f)
  assert run_config["train"]["lr"] == 1e-2 and run_config["train"]["save_every"] == 2  # the first run's
  train_steps = [r["step"] for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r]
  assert train_steps == list(range(1, 9))  # each step once, all of the first run
  assert not (workdir / LOCK_FILE).exists()


@needs_shakespeare
def test_a_lock_left_by_a_sigkilled_run_is_taken_over_and_the_rerun_resumes(contested, tmp_path, small_tokenizer):
  """The holder is killed with SIGKILL while it holds the lock (test_train's SIGKILL tests kill whole training runs,
  whose reruns take their locks over the same way)."""
  workdir = tmp_path / "killed"
  shutil.copytree(contested[0], workdir)
  hold_and_die = (
    "import os, signal, sys; from llama_jax.checkpoint import workdir_lock; "
    "workdir_lock.WorkdirLock(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)"
  )
  killed = subprocess.run([sys.executable, "-c", hold_and_die, str(workdir)], cwd=ROOT, capture_output=True, text=True)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  holder = Holder.parse((workdir / LOCK_FILE).read_text())
  assert holder is not None and holder.host == socket.gethostname()  # SIGKILL released the flock, not the file
  resumed = run_train(workdir, small_tokenizer, *FIRST_FLAGS, "--config.train.steps=10")
  assert "steps 8 → 10" in resumed.stdout, resumed.stdout
  assert "notice: taking over the lock" in resumed.stderr and str(holder) in resumed.stderr, resumed.stderr[-3000:]
  assert not (workdir / LOCK_FILE).exists()


class PauseAfterStep(Hook):
  """Holds the run (and its lock) after `step` until a line arrives on stdin."""

  def __init__(self, step: int):
    self.step = step

  def after_step(self, info) -> None:
    if info.step == self.step:
      print(f"{PAUSED} {self.step}", flush=True)
      sys.stdin.readline()


if __name__ == "__main__":
  from llama_jax import train

  step, *train_flags = sys.argv[1:]
  train.main([sys.argv[0], *train_flags], hooks=[PauseAfterStep(int(step))])
