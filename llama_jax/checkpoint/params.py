"""Model parameters in checkpoint directories: written once (conversion output), and read by one reader that every
command shares, whole (restored straight into shardings) or one leaf at a time (exports), a LoRA workdir as its
merged model.

A directory holds ``model_config.json`` and orbax steps under ``checkpoints/`` (core/paths.py lists the layout); item
"params" of a step is the parameters as a plain nested dict (``nnx.to_pure_dict``), so leaf paths read like
``layers/attention/wq``. Only complete steps are visible: orbax writes a step under a temporary name and renames it
when every item is written, so a process killed mid-save leaves the previous step as the latest. A step's digests are
checked before it is read (digests.py); sample, evaluate, serve and convert refuse a damaged step and take ``--step N``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from llama_jax.checkpoint import records
from llama_jax.checkpoint.digests import CheckpointError, checked_step, restore_errors, write_digests
from llama_jax.core import paths
from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import LoraConfig
from llama_jax.data.tokenization import TokenizerBase
from llama_jax.data.tokenizer_files import load_tokenizer_dir
from llama_jax.model import lora, sharding
from llama_jax.model.llama import Llama

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
  "moe.num_experts",
  "moe.every",
)
# Fields that change the function the parameters compute but not their shapes: a fine-tune whose config differs from
# its init_from in one of them is warned about, not refused (raising rope_theta to extend the context is a known
# fine-tune). norm_eps compares within 1e-6 relative: HF configs converted from float32 files hold 9.9999997e-06.
FUNCTION_FIELDS = (
  "norm_eps",
  "rope_theta",
  "rope_scaling",
  "rope_scaling_factor",
  "rope_low_freq_factor",
  "rope_high_freq_factor",
  "rope_original_max_len",
  "moe.top_k",
  "moe.normalize_top_k",
)
# A host leaf is checked for NaN and infinity this many bytes at a time: a mask of a whole 7B leaf would be a large
# temporary.
_FINITE_CHUNK_BYTES = 8 * 2**20


def read_model_config(directory: str) -> ModelConfig:
  """The model config a checkpoint directory holds in its model_config.json.

  Args:
    directory: a checkpoint directory or training workdir, local or remote (gs://).

  Returns:
    The stored `ModelConfig`, checked.

  Raises:
    CheckpointError: when `directory` does not exist or has no model_config.json.
    ConfigError: when the stored config has an unknown key or a value that fails a check.
  """
  path = paths.path(directory, paths.CONFIG_FILE)
  if not paths.path(directory).is_dir():
    raise CheckpointError(f"checkpoint directory {directory!r} does not exist")
  if not path.is_file():
    raise CheckpointError(f"{directory!r} is not a llama_jax checkpoint directory: {paths.CONFIG_FILE} is missing")
  return ModelConfig.from_dict(json.loads(path.read_text()))


def load_tokenizer(directory: str, purpose: str) -> TokenizerBase:
  """The tokenizer a checkpoint directory holds (local or remote) with its generation config's stop tokens, or
  CheckpointError naming what needs it."""
  tokenizer = load_tokenizer_dir(directory)
  if tokenizer is None:
    raise CheckpointError(
      f"{directory!r} has no tokenizer ({paths.TOKENIZER_FILE} or {paths.HF_TOKENIZER_FILE}); {purpose}"
    )
  if paths.path(directory, paths.CONFIG_FILE).is_file():
    rows = read_model_config(directory).vocab_size
    if tokenizer.vocab_size > rows:
      raise CheckpointError(
        f"{tokenizer.path} has {tokenizer.vocab_size} tokens but the model in {directory!r} has {rows} embedding "
        "rows: they are not the same model's"
      )
  return tokenizer


def config_field(cfg: ModelConfig, name: str):
  """A model config field by name, "moe.top_k" for a field of a section."""
  for part in name.split("."):
    cfg = getattr(cfg, part)
  return cfg


def shape_differences(saved: ModelConfig, current: ModelConfig) -> list[str]:
  return [
    f"{name} {config_field(saved, name)} → {config_field(current, name)}"
    for name in SHAPE_FIELDS
    if config_field(saved, name) != config_field(current, name)
  ]


def check_same_model(init_from: str, model_cfg: ModelConfig) -> None:
  """Refuses a run's `init_from` whose model differs from the run's in a shape field (its parameters would not fit),
  and warns when it differs in a function field (FUNCTION_FIELDS: the run would tune another function)."""
  saved_cfg = read_model_config(init_from)
  differences = shape_differences(saved_cfg, model_cfg)
  if differences:
    raise CheckpointError(
      f"init_from {init_from!r} holds a different model ({', '.join(differences)}); its model config must match "
      f"this run's"
    )
  changed = [
    f"{name} {saved} → {current}"
    for name in FUNCTION_FIELDS
    for saved, current in [(config_field(saved_cfg, name), config_field(model_cfg, name))]
    if not (saved == current or (isinstance(saved, float) and math.isclose(saved, current, rel_tol=1e-6)))
  ]
  if changed:
    logging.warning(
      "init_from %r computes with other settings (%s): this run trains the model with its own",
      init_from,
      ", ".join(changed),
    )


def save_params_dir(
  directory: str,
  cfg: ModelConfig,
  params: Any,
  step: int = 0,
  tokenizer_path: str | None = None,
  extra_files: Mapping[str, bytes] | None = None,
) -> None:
  """Writes a new checkpoint directory holding only parameters, as a conversion outputs them.

  The directory gets model_config.json, the tokenizer at `tokenizer_path`, `extra_files` and one orbax step of
  `params` with its digests. The save adds next to nothing to the memory `params` hold: orbax's defaults would
  deep-copy every numpy array and keep the zstd-compressed copies until the commit, about twice the model on top of it
  (measured by bench/convert_memory.py). The save is synchronous, so the arrays cannot change under it; weights barely
  compress anyway, so they are written uncompressed.

  Args:
    directory: the new directory, local or gs://; it must not exist, or be empty.
    cfg: the model config, written as model_config.json.
    params: the parameters as a plain nested dict of numpy or JAX arrays, ``nnx.to_pure_dict``'s layout.
    step: the step number to save them as.
    tokenizer_path: a tokenizer file, local or remote, copied in as tokenizer.model; None: no tokenizer.
    extra_files: file name → bytes, written beside them, e.g. the generation config.

  Raises:
    CheckpointError: when `directory` exists and is not empty.
  """
  out = epath.Path(directory)  # local or gs://
  if out.exists() and any(out.iterdir()):
    raise CheckpointError(f"output directory {directory!r} exists and is not empty; choose a new one")
  out.mkdir(parents=True, exist_ok=True)
  (out / paths.CONFIG_FILE).write_text(cfg.to_json())
  if tokenizer_path:
    (out / paths.TOKENIZER_FILE).write_bytes(epath.Path(tokenizer_path).read_bytes())
  for name, content in (extra_files or {}).items():
    (out / name).write_bytes(content)
  handlers = ocp.type_handlers.create_type_handler_registry(
    (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
    (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)),
  )
  handler = ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=handlers)
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  manager = ocp.CheckpointManager(paths.steps_path(directory), options=options, item_handlers={"params": handler})
  manager.save(step, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params)))
  manager.wait_until_finished()
  manager.close()
  write_digests(paths.step_path(directory, step))


# ---------------------------------------------------------------------------------------------------------------------
# Reading


def check_finite(tree: Any, where: str) -> None:
  """Refuses parameters holding NaN or infinity (a diverged run's, or a damaged file's): sampling, evaluating,
  converting or fine-tuning them would only pass the damage on. Device arrays are checked on their devices (one
  host sync for the tree), host arrays a block at a time."""
  flags = jax.device_get(jax.tree.map(_all_finite, tree))
  for path, ok in jax.tree_util.tree_leaves_with_path(flags):
    if not ok:
      raise CheckpointError(
        f"{where} holds non-finite values (NaN or infinity) in {sharding.path_name(path)}; use an earlier step"
      )


def _all_finite(leaf: Any) -> Any:
  if not isinstance(leaf, np.ndarray):
    return jnp.isfinite(leaf).all()
  flat, step = leaf.reshape(-1), max(1, _FINITE_CHUNK_BYTES // leaf.itemsize)
  return all(np.isfinite(flat[i : i + step]).all() for i in range(0, flat.size, step))


def _manager(directory: str) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
  return ocp.CheckpointManager(paths.steps_path(directory), options=options, item_names=("params",))


def _steps(directory: str) -> tuple[ocp.CheckpointManager | None, list[int]]:
  if not paths.path(directory, paths.STEPS_DIR).is_dir():
    return None, []
  manager = _manager(directory)
  return manager, list(manager.all_steps())


def resolve_step(directory: str, step: int | None = None) -> int:
  """The step a reader of `directory` reads: the latest complete one (or `step`), its digests checked."""
  manager, steps = _steps(directory)
  try:
    return checked_step(directory, steps, step, items=("params",))
  finally:
    if manager is not None:
      manager.close()


def _leaf(tree: Any, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def _one_leaf_tree(path: tuple[str, ...], leaf: Any) -> dict:
  tree: dict = {}
  node = tree
  for key in path[:-1]:
    node = node.setdefault(key, {})
  node[path[-1]] = leaf
  return tree


class _LeafByLeaf:
  """`read_leaf` of a reader, remembering the last leaf: an export asks for a stacked leaf once per layer. The
  previous leaf is dropped before the next is read, so at most one is held."""

  _last: tuple[tuple[str, ...], np.ndarray] | None = None

  def read_leaf(self, path: tuple[str, ...]) -> np.ndarray:
    """One parameter (its path in the params tree) as a host array in its stored dtype."""
    if self._last is None or self._last[0] != path:
      self._last = None
      self._last = (path, self._restore_leaf(path))
    return self._last[1]

  def _restore_leaf(self, path: tuple[str, ...]) -> np.ndarray:
    raise NotImplementedError


class CheckpointReader(_LeafByLeaf):
  """The params of the latest complete (or given) step of a checkpoint directory, its digests checked first: whole,
  each array restored straight into its sharding (`read_all`), or one leaf at a time as numpy (`read_leaf`, so an
  export never holds the whole model twice). Refused if non-finite, either way."""

  def __init__(self, directory: str, step: int | None = None):
    self.directory = directory
    self.cfg = read_model_config(directory)
    self._manager, steps = _steps(directory)
    try:
      self.step = checked_step(directory, steps, step, items=("params",))
    except CheckpointError:
      self.close()
      raise
    self._target = sharding.abstract_params(Llama, self.cfg)[1]
    self.where = f"checkpoint directory {directory!r} step {self.step}"

  def read_all(self, shardings: Any = None, dtype: str | None = None) -> Any:
    """Every parameter, restored into `shardings` (default: the first local device) and, with `dtype`, cast as it is
    read (a bf16 restore of float32 weights never holds them in float32)."""
    target = self._target if dtype is None else sharding.abstract_params(Llama, self.cfg.replace(param_dtype=dtype))[1]
    if shardings is None:
      # Without shardings orbax would need the saving topology; place everything on the first local device.
      device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      shardings = jax.tree.map(lambda _: device, target)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
    with restore_errors(self.directory, self.step):
      params = self._manager.restore(self.step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    check_finite(params["params"], self.where)
    return params["params"]

  def _restore_leaf(self, path: tuple[str, ...]) -> np.ndarray:
    item = _one_leaf_tree(path, _leaf(self._target, path))
    restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), item)
    with restore_errors(self.directory, self.step):
      restored = self._manager.restore(
        self.step,
        args=ocp.args.Composite(params=ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True)),
      )
    value = _leaf(restored["params"], path)
    check_finite(_one_leaf_tree(path, value), self.where)
    return value

  def close(self) -> None:
    self._last = None
    if self._manager is not None:
      self._manager.close()


class MergedReader(_LeafByLeaf):
  """A LoRA workdir read as a plain model, with CheckpointReader's interface: its base (the step lora.json names,
  checked unchanged) with the adapters of this directory's step folded into each targeted weight by
  ``lora.merged_weight``, the one merge, so every reader (load, export) gets the same bits. The adapters are small and
  read whole; the base is read as the caller asks."""

  def __init__(self, directory: str, record: dict[str, Any], step: int | None = None):
    records.check_base(directory, record)
    self.lora = records.lora_config_of(record)
    self.directory = directory
    self.base = CheckpointReader(record["base"], record["base_step"])
    self.cfg = self.base.cfg
    try:
      self.step, self.adapters = read_adapters(directory, self.cfg, self.lora, step)
    except BaseException:
      self.base.close()
      raise

  def _merged(self, path: tuple[str, ...], value: Any) -> Any:
    name = path[-1]
    if path[0] != "layers" or name not in self.lora.targets:
      return value
    node = self.adapters
    for key in path[:-1]:  # ("layers", "attention"), or ("layers", "blocks", j, "attention") in groups of blocks
      node = node[key]
    a, b = node[name + lora.A_SUFFIX], node[name + lora.B_SUFFIX]
    return lora.merged_weight(name, value, a, b, self.lora.scale)

  def read_all(self, shardings: Any = None, dtype: str | None = None) -> Any:
    """The merged params, each weight merged where its base leaf was placed and the base leaf then freed: the peak is
    the model plus one leaf."""

    def merge_leaf(key_path, value):
      path = tuple(k.key for k in key_path)
      merged = self._merged(path, value)
      if merged is not value:
        merged = jax.device_put(merged, value.sharding)
        value.delete()
      return merged

    return jax.tree_util.tree_map_with_path(merge_leaf, self.base.read_all(shardings, dtype))

  def _restore_leaf(self, path: tuple[str, ...]) -> np.ndarray:
    return np.asarray(self._merged(path, self.base._restore_leaf(path)))

  def close(self) -> None:
    self._last = None
    self.base.close()


def open_reader(directory: str, step: int | None = None) -> CheckpointReader | MergedReader:
  """The reader of a checkpoint directory's params: a LoRA workdir's merged into its base.

  Opening reads the model config and checks the step's digests; the parameters are read when asked, whole with
  `read_all` or one leaf at a time with `read_leaf`, and refused if they hold NaN or infinity. Close the reader when
  done, e.g. with ``contextlib.closing``.

  Args:
    directory: a checkpoint directory: a training workdir, a conversion output, or a LoRA workdir, whose lora.json
      names its base.
    step: the step to read; None: the latest complete one.

  Returns:
    A `CheckpointReader`, or for a LoRA workdir a `MergedReader` with the same interface.

  Raises:
    CheckpointError: when the directory or its model config is missing, it has no complete step or not `step`, the
      step's files differ from its digests, or a LoRA workdir's adapters cannot be read or hold NaN or infinity.
    LoraError: when a LoRA workdir's base checkpoint step changed since the run started from it.
  """
  record = records.read_record(directory)
  return MergedReader(directory, record, step) if record is not None else CheckpointReader(directory, step)


def load_params(
  directory: str, step: int | None = None, shardings: Any = None, dtype: str | None = None
) -> tuple[ModelConfig, Any]:
  """Reads the model config and parameters of a checkpoint directory's latest or given complete step.

  A LoRA workdir's adapters come merged into its base's weights. Each array is restored straight into its sharding
  and, with `dtype`, cast as it is read, so a bf16 load of float32 weights never holds them in float32. The returned
  config is the stored one.

  Args:
    directory: a checkpoint directory, local or gs://: a training workdir, a conversion output or a LoRA workdir.
    step: the step to read; None: the latest complete one.
    shardings: the params' shardings, a tree of the params' layout; None: every array on the first local device.
    dtype: a dtype name such as "bfloat16" to cast the weights to; None: the stored dtype.

  Returns:
    A pair: the stored `ModelConfig`, and the params as a plain nested dict of arrays.

  Raises:
    CheckpointError: when the directory, its model config or a complete step is missing, the step's files differ
      from its digests or cannot be read, or the parameters hold NaN or infinity.
    LoraError: when a LoRA workdir's base checkpoint step changed since the run started from it.
  """
  with contextlib.closing(open_reader(directory, step)) as reader:
    return reader.cfg, reader.read_all(shardings, dtype)


def read_adapters(directory: str, cfg: ModelConfig, lora_cfg: LoraConfig, step: int | None = None) -> tuple[int, Any]:
  """(step, adapters) of a LoRA workdir's latest (or given) complete step, digests checked, refused if non-finite.
  Adapters are small: restored as host (numpy) arrays, so they join a base on any devices, or none (conversion)."""
  step = resolve_step(directory, step)
  item = lora.split(sharding.abstract_params(functools.partial(Llama, lora=lora_cfg), cfg)[1])[1]
  restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), item)
  manager = _manager(directory)
  try:
    with restore_errors(directory, step):
      adapters = manager.restore(
        step, args=ocp.args.Composite(params=ocp.args.PyTreeRestore(item, restore_args=restore_args))
      )["params"]
  finally:
    manager.close()
  check_finite(adapters, f"LoRA workdir {directory!r} step {step}")
  return step, adapters


def load_init_params(init_from: str, model_cfg: ModelConfig, shardings: Any) -> Any:
  """Parameters (only) of another checkpoint directory to start a run from, refused unless the shapes match."""
  check_same_model(init_from, model_cfg)
  return load_params(init_from, shardings=shardings)[1]
