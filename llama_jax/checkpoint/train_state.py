"""Training checkpoints of a workdir: async saves of the whole train state, the last `keep` steps plus every
`keep_every`-th, resume from the newest intact step, and a save that cannot be written reported as one line.

Items of a step: "params", "train" (step, optimizer state, RNG) and "data" (the grain iterator state, JSON). Each step
is committed with its digests.json (digests.py) or not at all. Training falls back to the newest intact step and
moves damaged newer ones aside (``<step>.damaged``), never deleting them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from llama_jax.checkpoint.digests import CheckpointError, first_line, step_damage, write_digests
from llama_jax.checkpoint.params import read_model_config, shape_differences
from llama_jax.core import distributed, paths
from llama_jax.core.model_config import ModelConfig

DAMAGED_SUFFIX = ".damaged"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a step being written (atomicity_types.TMP_DIR_SUFFIX)

_log = logging.getLogger(__name__)


class TrainCheckpointer:
  """Training checkpoints of a workdir, saved asynchronously and resumed from the newest intact step.

  Keeps the last `keep` steps plus every `keep_every`-th. Items of a step: "params", "train" (step, optimizer state,
  RNG), "data" (iterator state, JSON); each step is committed with its digests.json or not at all. A save that cannot
  be written (a full disk, a denied permission) ends the run with a CheckpointError naming the path: orbax never
  commits the step, so the previous one stays the latest and a rerun resumes from it. Constructing one also quiets,
  for the rest of the process, orbax's own error logs and the "Event loop is closed" errors a failed save leaves, which
  that one CheckpointError line reports already.

  Args:
    workdir: the run's workdir, local or gs://; the steps go under its ``checkpoints/`` folder, created if missing.
    keep: how many of the latest steps to keep.
    keep_every: also keep every step that is a multiple of this; 0: none.
    async_save: write each save in the background once its arrays are copied off the devices; False: `save` returns
      once the step is written.
  """

  def __init__(self, workdir: str, keep: int = 3, keep_every: int = 0, async_save: bool = True):
    self.workdir, self.async_save = workdir, async_save
    self._saving: int | None = None  # the step of the save started last (in flight until the next wait)
    self._failed = False  # a save failed and was reported: closing must not report it again
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      keep_period=keep_every or None,
      create=True,
      enable_async_checkpointing=async_save,
      async_options=ocp.AsyncOptions(post_finalization_callback=self._digest_before_commit) if async_save else None,
    )
    self.manager = ocp.CheckpointManager(
      paths.steps_path(workdir), options=options, item_names=("params", "train", "data")
    )
    # For the rest of the process: orbax's save threads may still log after a failure is reported and closed.
    logging.getLogger("absl").addFilter(_QUIET_ORBAX)
    if not isinstance(sys.unraisablehook, _IgnoreClosedLoops):
      sys.unraisablehook = _IgnoreClosedLoops(sys.unraisablehook)

  def check_compatible(self, cfg: ModelConfig) -> None:
    """Refuses a workdir holding checkpoints of another model shape: they are never overwritten.

    Args:
      cfg: the run's model config, compared with the workdir's model_config.json in the fields that fix shapes.

    Raises:
      CheckpointError: when the workdir holds checkpoints but no model_config.json, or checkpoints of a model that
        differs in a shape field.
    """
    if not paths.path(self.workdir, paths.CONFIG_FILE).is_file():
      if self.manager.latest_step() is not None:
        raise CheckpointError(
          f"workdir {self.workdir!r} holds checkpoints but no {paths.CONFIG_FILE}; use a new --workdir"
        )
      return
    saved = read_model_config(self.workdir)
    differences = shape_differences(saved, cfg)
    if differences and self.manager.latest_step() is not None:
      raise CheckpointError(
        f"workdir {self.workdir!r} holds a checkpoint of a different model "
        f"({', '.join(differences)}); use a new --workdir or the saved model config"
      )

  def write_metadata(self, cfg: ModelConfig, run_config_json: str, tokenizer_files: Mapping[str, bytes]) -> None:
    """Process 0 only: the files that make the workdir self-describing (model and run config, the tokenizer's files),
    each written whole then renamed.

    Args:
      cfg: the model config, written as model_config.json.
      run_config_json: the run config as JSON, written as run_config.json.
      tokenizer_files: file name → bytes of the tokenizer's files.
    """
    workdir = epath.Path(self.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    files = {paths.CONFIG_FILE: cfg.to_json(), paths.RUN_CONFIG_FILE: run_config_json, **tokenizer_files}
    for name, content in files.items():
      paths.write_atomically(workdir / name, content)

  def latest_step(self) -> int | None:
    """The newest committed step, or None when there is none."""
    return self.manager.latest_step()

  def save(self, step: int, state: dict[str, Any], data_state: dict[str, Any]) -> None:
    """Starts a save of the train state; returns once the arrays are copied off the devices (async write after).

    Waits for the previous save first, and reports its failure as that step's. Process 0 then checks that the steps
    folder can be written, and every process follows its verdict, so that a save that cannot be written fails at once
    on all of them. Every process must call it, at the same step.

    Args:
      step: the step the state is of.
      state: the train state: "params", saved as the "params" item, and the rest (step, optimizer state, RNG), saved as
        the "train" item.
      data_state: the data iterator's state, saved as JSON.

    Raises:
      CheckpointError: when this save or the previous one cannot be written, naming the path and the latest step still
        saved.
    """
    self._wait()  # orbax would wait for the previous save anyway; a failure of it is reported as that step's
    train = {k: v for k, v in state.items() if k != "params"}
    self._saving = step
    try:
      self._probe_writable(step)
      self.manager.save(
        step,
        args=ocp.args.Composite(
          params=ocp.args.StandardSave(state["params"]),
          train=ocp.args.StandardSave(train),
          data=ocp.args.JsonSave(data_state),
        ),
        force=True,
      )
      if not self.async_save and jax.process_index() == 0:
        write_digests(paths.step_path(self.workdir, step))  # committed already: a crash right here leaves no digests
    except (OSError, ValueError) as e:
      raise self._write_failure(step, e) from None

  def _probe_writable(self, step: int) -> None:
    """Creates and removes an empty file where the step will go. A directory orbax may not write to fails its async
    save only after the save's threads have started, and those then wait forever for a directory that never comes
    (the process hangs at exit); failing here, before orbax starts anything, ends the run at once."""
    failure = None
    if jax.process_index() == 0:
      probe = epath.Path(paths.steps_path(self.workdir)) / f".write-probe-{step}"
      try:
        probe.write_text("")
        probe.unlink()
      except OSError as e:
        failure = e
    # Every process learns the verdict: the others would otherwise enter orbax's collective save and wait at its
    # barrier until a timeout ends them.
    if not distributed.agree(failure is None, "process 0"):
      raise failure or OSError(f"process 0 cannot write to {paths.steps_path(self.workdir)}")

  def _digest_before_commit(self) -> None:
    """orbax's post-finalization callback, on process 0 once every process has written its part of the step and
    before the rename that makes it visible: a step is committed with its digests.json or not at all."""
    steps_dir = epath.Path(paths.steps_path(self.workdir))
    pending = sorted(steps_dir.glob(f"{self._saving}{_TMP_SUFFIX}*"), key=lambda p: (p.stat().mtime, p.name))
    # No temporary directory: a store where orbax commits in place with a marker file (gs://).
    write_digests(pending[-1] if pending else steps_dir / str(self._saving))

  def _wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except (OSError, ValueError) as e:
      raise self._write_failure(self._saving, e) from None

  def _write_failure(self, step: int | None, error: Exception) -> CheckpointError:
    self._failed = True
    # The save's coroutines that never ran are garbage now; Python would warn of each as the process ends.
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    # Its failed write tasks are garbage too: asyncio logs each one's traceback when it is collected ("Task exception
    # was never retrieved"), 0 to 115 lines after the one-line error in disk-full runs of the micro config, by timing.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    path, reason = _failed_write(error, paths.steps_path(self.workdir))
    self.manager.reload()  # what is committed on disk, not what orbax had started
    latest = self.manager.latest_step()
    kept = f"the latest checkpoint is still step {latest}" if latest is not None else "no checkpoint is saved yet"
    remote = paths.is_remote(self.workdir)
    fix = "Check the bucket and this machine's access to it" if remote else "Free disk space or fix the permissions"
    message = (
      f"could not write checkpoint step {step} to {path or paths.step_path(self.workdir, step)} "
      f"({reason}); {kept}. {fix}, then rerun the same command to resume"
    )
    return CheckpointError(" ".join(message.split()))  # one line, whatever the writer's error text held

  def restore(self, step: int, abstract_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores one step as it is, its digests unchecked: `restore_latest` checks them and falls back.

    Args:
      step: the step to restore.
      abstract_state: the train state's abstract arrays (shapes, dtypes, shardings), laid out as `save` takes it.

    Returns:
      A pair: the train state, "params" and the "train" item's entries in one dict, and the data iterator's state.
    """
    abstract_train = {k: v for k, v in abstract_state.items() if k != "params"}
    restored = self.manager.restore(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_state["params"]),
        train=ocp.args.StandardRestore(abstract_train),
        data=ocp.args.JsonRestore(),
      ),
    )
    return {"params": restored["params"], **restored["train"]}, restored["data"]

  def restore_latest(self, abstract_state: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
    """(step, state, data iterator state) of the newest step that matches its digests and restores; None when there
    is no step.

    Newer damaged steps are moved aside to checkpoints/<step>.damaged with a warning, never deleted: no longer steps
    to orbax, so saving that step again works and `keep` rotates intact steps only. Process 0 checks the digests and
    every process follows its verdict, so all restore the same step; every process must call it.

    Args:
      abstract_state: the train state's abstract arrays (shapes, dtypes, shardings), laid out as `save` takes it.

    Returns:
      The step restored, its train state and its data iterator's state; None when the workdir has no step.

    Raises:
      CheckpointError: when a step matches its digests but does not restore (nothing is moved then), or when every
        step is damaged.
    """
    damaged: list[tuple[int, str]] = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      # Process 0 reads the files once; every process follows its verdict, so all restore the same step.
      reason = step_damage(paths.step_path(self.workdir, step)) if jax.process_index() == 0 else None
      intact = distributed.agree(reason is None, "process 0")
      if intact:
        try:
          state, data_state = self.restore(step, abstract_state)
        except (ValueError, OSError, KeyError) as e:
          if (paths.step_path(self.workdir, step) / paths.DIGESTS_FILE).exists():
            # The files are as saved: not damage but a failed read (a transient I/O error, a train state that no
            # longer matches this run's optimizer settings). Falling back would roll the run back and set a good
            # step aside; stop instead, moving nothing.
            raise CheckpointError(
              f"checkpoint step {step} of workdir {self.workdir!r} matches its digests but does not restore "
              f"({first_line(e)}); nothing was moved. Check the run config against run_config.json, or retry"
            ) from None
          reason, intact = f"it does not restore ({first_line(e)})", False
        intact = distributed.agree(intact, "all")
      if intact:
        self._set_aside(damaged, step)
        return step, state, data_state
      damaged.append((step, reason or "another process could not read it"))
    if damaged:
      listed = "; ".join(f"step {s}: {r}" for s, r in damaged)
      raise CheckpointError(
        f"every checkpoint step of workdir {self.workdir!r} is damaged ({listed}); nothing was moved or deleted. "
        f"Restore the files or use a new --workdir"
      )
    return None

  def _set_aside(self, damaged: list[tuple[int, str]], resumed: int) -> None:
    steps_dir = epath.Path(paths.steps_path(self.workdir))
    for step, reason in damaged:
      if jax.process_index() == 0:
        target = steps_dir / f"{step}{DAMAGED_SUFFIX}"
        for n in range(2, 1000):
          if not target.exists():
            break
          target = steps_dir / f"{step}{DAMAGED_SUFFIX}-{n}"
        (steps_dir / str(step)).rename(target)
        _log.warning(
          "checkpoint step %d is damaged: %s; resuming from step %d. The damaged step is kept as %s",
          step,
          reason,
          resumed,
          target,
        )
    if damaged:
      distributed.agree(True, "all")  # every process waits for the moves before reading the steps again
      self.manager.reload()

  def close(self) -> None:
    """Waits for the save in flight, then closes; after a failed save, which is reported already, just closes.

    Raises:
      CheckpointError: when the save in flight cannot be written.
    """
    if not self._failed:
      try:
        self._wait()
      except CheckpointError:
        self._close_failed()
        raise
      self.manager.close()
    else:
      self._close_failed()

  def _close_failed(self) -> None:
    with contextlib.suppress(Exception):  # orbax re-raises the failed save, which is reported already
      self.manager.close()


def _failed_write(error: Exception, steps_dir: str) -> tuple[str | None, str]:
  """(the file or directory a failed save names, why in a few words) from an OSError or a tensorstore error, whose
  message quotes paths and ends in the OS error: ``Failed writing: "/…/d/24bc…": … [os_error_code='27']``."""
  text = str(error)
  quoted = [p for p in re.findall(r'"([^"]+)"', text) if p.startswith(steps_dir)]
  path = getattr(error, "filename", None) or (max(quoted, key=len) if quoted else None)
  code = re.search(r"os_error_code='(\d+)'", text)
  if code:
    return path, os.strerror(int(code.group(1)))
  if isinstance(error, OSError) and error.strerror:
    return path, f"{type(error).__name__}: {error.strerror}"
  return path, first_line(error)[:300]


class _QuietOrbaxErrors(logging.Filter):
  """Drops orbax's own error records (logged through absl, tracebacks included, from its save threads): a failed
  save reaches the run as the exception TrainCheckpointer turns into one CheckpointError line."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


_QUIET_ORBAX = _QuietOrbaxErrors()  # one instance: adding it again is a no-op


class _IgnoreClosedLoops:
  """sys.unraisablehook that drops ``RuntimeError: Event loop is closed`` and passes on everything else. When one
  write of a save fails, orbax closes its event loops while tensorstore still finishes the others, and tensorstore
  reports each late callback's error as unraisable: a traceback per array around the one line that reports it."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, unraisable) -> None:
    value = unraisable.exc_value
    if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
      self.previous(unraisable)
