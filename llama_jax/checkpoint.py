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

A training workdir may be a local path or a remote one (``gs://bucket/run``): everything written there goes through
``etils.epath`` and orbax; what must be local (memory-mapped data, a tokenizer being trained) goes to `local_dir`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from llama_jax.config import ModelConfig
from llama_jax.errors import LlamaJaxError
from llama_jax.tokenizer import TOKENIZER_FILE

CONFIG_FILE = "model_config.json"
RUN_CONFIG_FILE = "run_config.json"
STEPS_DIR = "checkpoints"


class CheckpointError(LlamaJaxError, ValueError):
  """A checkpoint directory is missing, incomplete or does not match; the message names the path."""


# Fields that fix parameter shapes and dtypes: a workdir whose checkpoint differs in any of them is refused.
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "tie_embeddings", "param_dtype")


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
  cfg = read_model_config(directory)
  manager = _manager(directory, create=False) if (epath.Path(directory) / STEPS_DIR).is_dir() else None
  steps = manager.all_steps() if manager else []
  if not steps:
    raise CheckpointError(f"checkpoint directory {directory!r} holds no complete checkpoint step")
  step = max(steps) if step is None else step
  if step not in steps:
    raise CheckpointError(f"checkpoint directory {directory!r} has no step {step}; it has {sorted(steps)}")
  from llama_jax import sharding  # checkpoint sits below the model; the restore target needs its shapes
  from llama_jax.model import Llama

  _, target = sharding.abstract_params(Llama, cfg if dtype is None else cfg.replace(param_dtype=dtype))
  if shardings is None:
    # Without shardings orbax would need the saving topology; place everything on the first local device.
    device = jax.local_devices()[0]
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), target)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
  restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
  manager.close()
  _check_finite(restored["params"], f"checkpoint directory {directory!r} step {step}")
  return cfg, restored["params"]


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
  latest complete step. Items: "params", "train" (step, optimizer state, RNG), "data" (iterator state, JSON)."""

  def __init__(self, workdir: str, keep: int = 3, keep_every: int = 0, async_save: bool = True):
    self.workdir = workdir
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, keep_period=keep_every or None, create=True, enable_async_checkpointing=async_save
    )
    self.manager = ocp.CheckpointManager(_steps_path(workdir), options=options, item_names=("params", "train", "data"))

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
    train = {k: v for k, v in state.items() if k != "params"}
    self.manager.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(state["params"]),
        train=ocp.args.StandardSave(train),
        data=ocp.args.JsonSave(data_state),
      ),
      force=True,
    )

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

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
