"""Self-describing llama_jax checkpoint directories, written and read with orbax.

Layout of a checkpoint directory (from training or from ``convert --from_hf``):

    DIR/model_config.json      the ModelConfig (everything needed to rebuild the model)
    DIR/tokenizer.model        the sentencepiece model, when there is one
    DIR/checkpoints/<step>/    orbax CheckpointManager steps; item "params" holds the parameters as a plain
                               nested dict (``nnx.to_pure_dict``) so leaf paths read like ``layers/attention/wq``
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from llama_jax.config import ModelConfig

CONFIG_FILE = "model_config.json"
TOKENIZER_FILE = "tokenizer.model"
STEPS_DIR = "checkpoints"


class CheckpointError(ValueError):
  """A checkpoint directory is missing, incomplete or does not match; the message names the path."""


def _manager(directory: str, create: bool) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(create=create, enable_async_checkpointing=False)
  return ocp.CheckpointManager(os.path.join(os.path.abspath(directory), STEPS_DIR), options=options,
                               item_names=("params",))


def save_params_dir(directory: str, cfg: ModelConfig, params: Any, step: int = 0,
                    tokenizer_path: str | None = None) -> None:
  """Writes a new checkpoint directory holding only parameters (conversion output). Refuses a non-empty directory."""
  if os.path.exists(directory) and os.listdir(directory):
    raise CheckpointError(f"output directory {directory!r} exists and is not empty; choose a new one")
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    f.write(cfg.to_json())
  if tokenizer_path:
    shutil.copyfile(tokenizer_path, os.path.join(directory, TOKENIZER_FILE))
  manager = _manager(directory, create=True)
  manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
  manager.wait_until_finished()
  manager.close()


def read_model_config(directory: str) -> ModelConfig:
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isdir(directory):
    raise CheckpointError(f"checkpoint directory {directory!r} does not exist")
  if not os.path.isfile(path):
    raise CheckpointError(f"{directory!r} is not a llama_jax checkpoint directory: {CONFIG_FILE} is missing")
  with open(path) as f:
    return ModelConfig.from_dict(json.load(f))


def abstract_params(cfg: ModelConfig, shardings: Any = None) -> Any:
  """The params tree as ShapeDtypeStructs (optionally with shardings), as restore targets."""
  from llama_jax.model import Llama  # model imports sharding; keep this module importable without it

  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  tree = nnx.to_pure_dict(nnx.state(abstract))
  if shardings is None:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def load_params(directory: str, step: int | None = None, shardings: Any = None) -> tuple[ModelConfig, Any]:
  """(model config, params) of the latest (or given) complete step of a checkpoint directory."""
  cfg = read_model_config(directory)
  manager = _manager(directory, create=False) if os.path.isdir(os.path.join(directory, STEPS_DIR)) else None
  steps = manager.all_steps() if manager else []
  if not steps:
    raise CheckpointError(f"checkpoint directory {directory!r} holds no complete checkpoint step")
  step = max(steps) if step is None else step
  if step not in steps:
    raise CheckpointError(f"checkpoint directory {directory!r} has no step {step}; it has {sorted(steps)}")
  if shardings is None:
    # Without shardings orbax would need the saving topology; place everything on the first local device.
    device = jax.local_devices()[0]
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), abstract_params(cfg))
  target = abstract_params(cfg, shardings)
  restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
  manager.close()
  return cfg, restored["params"]
