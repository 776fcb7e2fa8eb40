"""Self-describing llama_jax checkpoint directories, written and read with orbax.

Layout of a checkpoint directory (from training or from ``convert --from_hf``):

    DIR/model_config.json      the ModelConfig (everything needed to rebuild the model)
    DIR/tokenizer.model        the sentencepiece model, when there is one
    DIR/run_config.json        the run config, when the directory is a training workdir
    DIR/checkpoints/<step>/    orbax CheckpointManager steps; item "params" holds the parameters as a plain
                               nested dict (``nnx.to_pure_dict``) so leaf paths read like ``layers/attention/wq``;
                               training adds "train" (step, optimizer state, RNG) and "data" (grain iterator state)

Only complete steps are visible: orbax writes a step under a temporary name and renames it when every item is
written, so a process killed mid-save leaves the previous step as the latest.

Each step carries DIR/checkpoints/<step>/digests.json: the size and sha256 of every file of its items, written once
they are all written (for async saves before the rename that makes the step visible). Reading a step checks them
first, so a truncated, deleted or overwritten file is named instead of read; a step without the file (written by an
older version) is read unchecked. Training falls back to the newest intact step and moves damaged newer ones aside
(``<step>.damaged``), never deleting them; sample, evaluate, serve and convert refuse them and take ``--step N``.

A training workdir may be a local path or a remote one (``gs://bucket/run``): everything written there goes through
``etils.epath`` and orbax; what must be local (memory-mapped data, a tokenizer being trained) goes to `local_dir`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from llama_jax import lora
from llama_jax.config import ModelConfig
from llama_jax.errors import LlamaJaxError
from llama_jax.tokenizer import TOKENIZER_FILE

CONFIG_FILE = "model_config.json"
RUN_CONFIG_FILE = "run_config.json"
STEPS_DIR = "checkpoints"
DIGESTS_FILE = "digests.json"
DAMAGED_SUFFIX = ".damaged"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a step being written (atomicity_types.TMP_DIR_SUFFIX)
_HASH_CHUNK = 1 << 22

_log = logging.getLogger(__name__)


class CheckpointError(LlamaJaxError, ValueError):
  """A checkpoint directory is missing, incomplete or does not match; the message names the path."""


# Fields that fix parameter shapes and dtypes: a workdir whose checkpoint differs in any of them is refused. The norm
# fields decide which parameters exist (norm "none", post-norm's missing final norm) and what a scale multiplies;
# model configs saved before they existed read as rmsnorm / pre, the defaults, which is what those models were.
SHAPE_FIELDS = (
  "vocab_size",
  "dim",
  "n_layers",
  "n_heads",
  "n_kv_heads",
  "hidden_dim",
  "tie_embeddings",
  "param_dtype",
  "norm",
  "norm_position",
)


def is_remote(path: str) -> bool:
  return "://" in str(path)


def _steps_path(directory: str) -> str:
  # gs:// and other remote paths go to orbax as they are; local paths are made absolute (orbax requires it).
  return os.path.join(directory if is_remote(directory) else os.path.abspath(directory), STEPS_DIR)


def local_dir(workdir: str, name: str) -> str:
  """`workdir/name` for a local workdir; for a remote one, a directory under ~/.cache/llama_jax named after it."""
  if not is_remote(workdir):
    return os.path.join(workdir, name)
  key = hashlib.sha256(str(workdir).encode()).hexdigest()[:12]
  return os.path.join(
    os.path.expanduser("~/.cache/llama_jax"), f"{os.path.basename(str(workdir).rstrip('/'))}-{key}", name
  )


def local_file(path: str) -> str:
  """A local path holding the file `path` (copied into the local cache when `path` is remote)."""
  if not is_remote(path):
    return path
  local = os.path.join(local_dir(os.path.dirname(path), "files"), os.path.basename(path))
  os.makedirs(os.path.dirname(local), exist_ok=True)
  with open(local, "wb") as f:
    f.write(epath.Path(path).read_bytes())
  return local


# ---------------------------------------------------------------------------------------------------------------------
# Digests: what each file of a step held when it was saved


def _item_files(step_dir: epath.Path) -> Iterable[tuple[str, epath.Path]]:
  """(path relative to the step, path) of every file inside the step's items, sorted. Files at the step's top level
  (orbax's _CHECKPOINT_METADATA and commit_success.txt, digests.json itself) are left out: orbax rewrites the first
  two while committing, after the digests are taken."""
  found = []
  for root, _, names in step_dir.walk():
    root = epath.Path(root)
    if root == step_dir:
      continue
    found += [(str(root.relative_to(step_dir) / name), root / name) for name in names]
  return sorted(found)


def _sha256(path: epath.Path) -> str:
  digest = hashlib.sha256()
  with path.open("rb") as f:
    while chunk := f.read(_HASH_CHUNK):
      digest.update(chunk)
  return digest.hexdigest()


def write_digests(step_dir: epath.Path) -> None:
  """Writes `step_dir`/digests.json (size and sha256 of every item file), whole then renamed: never half a list."""
  step_dir = epath.Path(step_dir)
  files = {rel: {"bytes": path.stat().length, "sha256": _sha256(path)} for rel, path in _item_files(step_dir)}
  tmp = step_dir / (DIGESTS_FILE + ".tmp")
  tmp.write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1))
  tmp.replace(step_dir / DIGESTS_FILE)


def step_damage(step_dir: epath.Path, items: Iterable[str] | None = None) -> str | None:
  """Why the files of a step (of `items`, default all) differ from its digests.json, naming the first such file; None
  when they match, or when the step has no digests.json (steps written before there were digests are not checked)."""
  step_dir = epath.Path(step_dir)
  manifest = step_dir / DIGESTS_FILE
  if not manifest.exists():
    return None
  try:
    files = json.loads(manifest.read_text())["files"]
    expected = {rel: (int(want["bytes"]), str(want["sha256"])) for rel, want in files.items()}
  except (ValueError, KeyError, TypeError, AttributeError):
    return f"{DIGESTS_FILE} is unreadable"
  wanted = None if items is None else set(items)
  for rel, (size, sha256) in sorted(expected.items()):
    if wanted is not None and rel.split("/")[0] not in wanted:
      continue
    path = step_dir / rel
    if not path.is_file():
      return f"{rel} is missing"
    actual = path.stat().length
    if actual != size:
      return f"{rel} is {actual} bytes, {size} when saved"
    if _sha256(path) != sha256:
      return f"{rel} does not match its sha256 digest (its content changed after the save)"
  return None


def _step_dir(directory: str, step: int) -> epath.Path:
  return epath.Path(_steps_path(directory)) / str(step)


def checked_step(directory: str, steps: Iterable[int], step: int | None, items: Iterable[str]) -> int:
  """The latest (or given) step of `steps` after checking its digests: a damaged step is refused with the file that
  differs and the --step that would read an earlier one."""
  steps = sorted(steps)
  if not steps:
    raise CheckpointError(f"checkpoint directory {directory!r} holds no complete checkpoint step")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise CheckpointError(f"checkpoint directory {directory!r} has no step {step}; it has {steps}")
  reason = step_damage(_step_dir(directory, step), items)
  if reason is not None:
    raise CheckpointError(
      f"checkpoint directory {directory!r} step {step} is damaged: {reason}; {_earlier(steps, step)}"
    )
  return step


def _earlier(steps: list[int], step: int) -> str:
  older = [s for s in steps if s < step]
  return f"pass --step {older[-1]} to read an earlier step" if older else "there is no earlier step to read"


@contextlib.contextmanager
def restore_errors(directory: str, step: int):
  """Turns what orbax raises on files it cannot read (a step written before there were digests, or damage the
  digests do not cover) into a CheckpointError naming the step: one line, not a tensorstore traceback."""
  try:
    yield
  except (ValueError, OSError, KeyError) as e:
    if isinstance(e, CheckpointError):
      raise
    raise CheckpointError(
      f"checkpoint directory {directory!r} step {step} could not be read ({_first_line(e)}); pass --step N "
      f"for an earlier step"
    ) from None


def _first_line(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0] if text else ''}"[:500]


def _manager(directory: str, create: bool) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(create=create, enable_async_checkpointing=False)
  return ocp.CheckpointManager(_steps_path(directory), options=options, item_names=("params",))


def save_params_dir(
  directory: str, cfg: ModelConfig, params: Any, step: int = 0, tokenizer_path: str | None = None
) -> None:
  """Writes a new checkpoint directory holding only parameters (conversion output). Refuses a non-empty directory.

  Adds next to nothing to the memory `params` hold: orbax's defaults would deep-copy every numpy array and keep the
  zstd-compressed copies until the commit, about twice the model on top of it (measured by bench/convert_memory.py).
  The save is synchronous, so the arrays cannot change under it; weights barely compress (~7%) anyway."""
  import numpy as np

  if os.path.exists(directory) and os.listdir(directory):
    raise CheckpointError(f"output directory {directory!r} exists and is not empty; choose a new one")
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    f.write(cfg.to_json())
  if tokenizer_path:
    shutil.copyfile(tokenizer_path, os.path.join(directory, TOKENIZER_FILE))
  handlers = ocp.type_handlers.create_type_handler_registry(
    (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
    (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)),
  )
  handler = ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=handlers)
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  manager = ocp.CheckpointManager(_steps_path(directory), options=options, item_handlers={"params": handler})
  manager.save(step, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params)))
  manager.wait_until_finished()
  manager.close()
  write_digests(epath.Path(_steps_path(directory)) / str(step))


def read_model_config(directory: str) -> ModelConfig:
  path = epath.Path(directory) / CONFIG_FILE
  if not epath.Path(directory).is_dir():
    raise CheckpointError(f"checkpoint directory {directory!r} does not exist")
  if not path.is_file():
    raise CheckpointError(f"{directory!r} is not a llama_jax checkpoint directory: {CONFIG_FILE} is missing")
  return ModelConfig.from_dict(json.loads(path.read_text()))


def load_params(
  directory: str, step: int | None = None, shardings: Any = None, dtype: str | None = None
) -> tuple[ModelConfig, Any]:
  """(model config, params) of the latest (or given) complete step of a checkpoint directory, each array restored
  straight into its sharding (default: the first local device) and, with `dtype`, cast as it is read (a bf16
  restore of float32 weights never holds them in float32). The returned config is the stored one."""
  from llama_jax import sharding  # checkpoint sits below the model; the restore target needs its shapes
  from llama_jax.model import Llama

  record = lora.read_record(directory)
  if record is not None:
    return _load_merged_lora(directory, record, step, shardings, dtype)
  cfg = read_model_config(directory)
  manager = _manager(directory, create=False) if (epath.Path(directory) / STEPS_DIR).is_dir() else None
  step = checked_step(directory, manager.all_steps() if manager else [], step, items=("params",))

  _, target = sharding.abstract_params(Llama, cfg if dtype is None else cfg.replace(param_dtype=dtype))
  if shardings is None:
    # Without shardings orbax would need the saving topology; place everything on the first local device.
    device = jax.local_devices()[0]
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), target)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
  with restore_errors(directory, step):
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
  manager.close()
  _check_finite(restored["params"], f"checkpoint directory {directory!r} step {step}")
  return cfg, restored["params"]


def resolve_step(directory: str, step: int | None = None) -> int:
  """The step `load_params` reads: the latest complete one (or `step`), its digests checked."""
  if not (epath.Path(directory) / STEPS_DIR).is_dir():
    raise CheckpointError(f"checkpoint directory {directory!r} holds no complete checkpoint step")
  manager = _manager(directory, create=False)
  try:
    return checked_step(directory, manager.all_steps(), step, items=("params",))
  finally:
    manager.close()


def _load_merged_lora(
  directory: str, record: dict[str, Any], step: int | None, shardings: Any, dtype: str | None
) -> tuple[ModelConfig, Any]:
  """A LoRA workdir read as a plain model: its base (the step lora.json names, checked unchanged) with the adapters
  of this directory's step folded into the weights, each merged weight placed as the base's."""
  lora.check_base(directory, record)
  lora_cfg = lora.config_of(record)
  cfg, base = load_params(record["base"], step=record["base_step"], shardings=shardings, dtype=dtype)
  _, adapters = read_adapters(directory, cfg, lora_cfg, step)
  target = jax.tree.map(lambda a: a.sharding, base)
  merge = jax.jit(lambda b, a: lora.merge(b, a, lora_cfg.scale), out_shardings=target, donate_argnums=0)
  return cfg, merge(base, adapters)


def read_adapters(directory: str, cfg: ModelConfig, lora_cfg: Any, step: int | None = None) -> tuple[int, Any]:
  """(step, adapters) of a LoRA workdir's latest (or given) complete step, digests checked, refused if non-finite.
  Adapters are small: restored as host (numpy) arrays, so they join a base on any devices, or none (conversion)."""
  import numpy as np

  from llama_jax import sharding
  from llama_jax.model import Llama

  step = resolve_step(directory, step)
  item = lora.split(sharding.abstract_params(functools.partial(Llama, lora=lora_cfg), cfg)[1])[1]
  restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), item)
  manager = _manager(directory, create=False)
  try:
    with restore_errors(directory, step):
      adapters = manager.restore(
        step, args=ocp.args.Composite(params=ocp.args.PyTreeRestore(item, restore_args=restore_args))
      )["params"]
  finally:
    manager.close()
  _check_finite(adapters, f"LoRA workdir {directory!r} step {step}")
  return step, adapters


def _check_finite(params: Any, where: str) -> None:
  """Refuses parameters holding NaN or infinity (a diverged run's, or a damaged file's): sampling, evaluating,
  converting or fine-tuning them would only pass the damage on."""
  from llama_jax.sharding import path_name

  flags = jax.tree.map(lambda a: jax.numpy.isfinite(a).all(), params)
  for path, ok in jax.tree_util.tree_leaves_with_path(jax.device_get(flags)):
    if not ok:
      raise CheckpointError(
        f"{where} holds non-finite values (NaN or infinity) in {path_name(path)}; use an earlier step"
      )


def shape_differences(saved: ModelConfig, current: ModelConfig) -> list[str]:
  return [
    f"{name} {getattr(saved, name)} → {getattr(current, name)}"
    for name in SHAPE_FIELDS
    if getattr(saved, name) != getattr(current, name)
  ]


def load_init_params(init_from: str, model_cfg: ModelConfig, shardings: Any) -> Any:
  """Parameters (only) of another checkpoint directory to start a run from, refused unless the shapes match."""
  differences = shape_differences(read_model_config(init_from), model_cfg)
  if differences:
    raise CheckpointError(
      f"init_from {init_from!r} holds a different model ({', '.join(differences)}); its model "
      f"config must match this run's"
    )
  return load_params(init_from, shardings=shardings)[1]


class TrainCheckpointer:
  """Training checkpoints of a workdir: async saves, the last `keep` steps plus every `keep_every`-th, resume from the
  newest intact step. Items: "params", "train" (step, optimizer state, RNG), "data" (iterator state, JSON).

  A save that cannot be written (a full disk, a denied permission) ends the run with a CheckpointError naming the
  path: orbax never commits the step, so the previous one stays the latest and a rerun resumes from it."""

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
    self.manager = ocp.CheckpointManager(_steps_path(workdir), options=options, item_names=("params", "train", "data"))
    # For the rest of the process: orbax's save threads may still log after a failure is reported and closed.
    logging.getLogger("absl").addFilter(_QUIET_ORBAX)
    if not isinstance(sys.unraisablehook, _IgnoreClosedLoops):
      sys.unraisablehook = _IgnoreClosedLoops(sys.unraisablehook)

  def check_compatible(self, cfg: ModelConfig) -> None:
    """Refuses a workdir holding checkpoints of another model shape: they are never overwritten."""
    if not (epath.Path(self.workdir) / CONFIG_FILE).is_file():
      if self.manager.latest_step() is not None:
        raise CheckpointError(f"workdir {self.workdir!r} holds checkpoints but no {CONFIG_FILE}; use a new --workdir")
      return
    saved = read_model_config(self.workdir)
    differences = shape_differences(saved, cfg)
    if differences and self.manager.latest_step() is not None:
      raise CheckpointError(
        f"workdir {self.workdir!r} holds a checkpoint of a different model "
        f"({', '.join(differences)}); use a new --workdir or the saved model config"
      )

  def write_metadata(self, cfg: ModelConfig, run_config_json: str, tokenizer_bytes: bytes | None) -> None:
    """Process 0 only: the files that make the workdir self-describing, each written whole then renamed."""
    workdir = epath.Path(self.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for name, content in (
      (CONFIG_FILE, cfg.to_json().encode()),
      (RUN_CONFIG_FILE, run_config_json.encode()),
      (TOKENIZER_FILE, tokenizer_bytes),
    ):
      if content is not None:
        tmp = workdir / (name + ".tmp")
        tmp.write_bytes(content)
        tmp.replace(workdir / name)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: dict[str, Any], data_state: dict[str, Any]) -> None:
    """Starts a save of the train state; returns once the arrays are copied off the devices (async write after)."""
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
        write_digests(_step_dir(self.workdir, step))  # committed already: a crash right here leaves no digests
    except (OSError, ValueError) as e:
      raise self._write_failure(step, e) from None

  def _probe_writable(self, step: int) -> None:
    """Creates and removes an empty file where the step will go. A directory orbax may not write to fails its async
    save only after the save's threads have started, and those then wait forever for a directory that never comes
    (the process hangs at exit); failing here, before orbax starts anything, ends the run at once."""
    failure = None
    if jax.process_index() == 0:
      probe = epath.Path(_steps_path(self.workdir)) / f".write-probe-{step}"
      try:
        probe.write_text("")
        probe.unlink()
      except OSError as e:
        failure = e
    # Every process learns the verdict: the others would otherwise enter orbax's collective save and wait at its
    # barrier until a timeout ends them.
    if not _agree(failure is None, everywhere=False):
      raise failure or OSError(f"process 0 cannot write to {_steps_path(self.workdir)}")

  def _digest_before_commit(self) -> None:
    """orbax's post-finalization callback, on process 0 once every process has written its part of the step and
    before the rename that makes it visible: a step is committed with its digests.json or not at all."""
    steps_dir = epath.Path(_steps_path(self.workdir))
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
    path, reason = _failed_write(error, _steps_path(self.workdir))
    self.manager.reload()  # what is committed on disk, not what orbax had started
    latest = self.manager.latest_step()
    kept = f"the latest checkpoint is still step {latest}" if latest is not None else "no checkpoint is saved yet"
    message = (
      f"could not write checkpoint step {step} to {path or os.path.join(_steps_path(self.workdir), str(step))} "
      f"({reason}); {kept}. Free disk space or fix the permissions, then rerun the same command to resume"
    )
    return CheckpointError(" ".join(message.split()))  # one line, whatever the writer's error text held

  def restore(self, step: int, abstract_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
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
    is no step. Newer damaged steps are moved aside to checkpoints/<step>.damaged with a warning, never deleted: no
    longer steps to orbax, so saving that step again works and `keep` rotates intact steps only."""
    damaged: list[tuple[int, str]] = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      # Process 0 reads the files once; every process follows its verdict, so all restore the same step.
      reason = step_damage(_step_dir(self.workdir, step)) if jax.process_index() == 0 else None
      intact = _agree(reason is None, everywhere=False)
      if intact:
        try:
          state, data_state = self.restore(step, abstract_state)
        except (ValueError, OSError, KeyError) as e:
          if (_step_dir(self.workdir, step) / DIGESTS_FILE).exists():
            # The files are as saved: not damage but a failed read (a transient I/O error, a train state that no
            # longer matches this run's optimizer settings). Falling back would roll the run back and set a good
            # step aside; stop instead, moving nothing.
            raise CheckpointError(
              f"checkpoint step {step} of workdir {self.workdir!r} matches its digests but does not restore "
              f"({_first_line(e)}); nothing was moved. Check the run config against run_config.json, or retry"
            ) from None
          reason, intact = f"it does not restore ({_first_line(e)})", False
        intact = _agree(intact, everywhere=True)
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
    steps_dir = epath.Path(_steps_path(self.workdir))
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
      _agree(True, everywhere=True)  # every process waits for the moves before reading the steps again
      self.manager.reload()

  def close(self) -> None:
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
  return path, _first_line(error)[:300]


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


def _agree(ok: bool, everywhere: bool) -> bool:
  """Across processes: `ok` of process 0 (everywhere False) or of every process (True); plain `ok` in one process."""
  if jax.process_count() == 1:
    return ok
  import numpy as np
  from jax.experimental import multihost_utils

  if not everywhere:
    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))
  return bool(np.asarray(multihost_utils.process_allgather(np.int32(ok))).all())
