"""Weights and KV cache for decoding on a mesh: the decode rule set, kv-head replication, and parameters placed
straight into their decode shardings (cast, unstacked, quantized) from a checkpoint or from arrays in memory.

Decoding shards differently from training. Training shards parameters over `fsdp` and gathers each layer before
use; per generated token that gather would move the whole model. Decoding keeps every weight resident and splits it
over `tensor` the Megatron way (query, key, value and MLP-in projections by output heads / columns, output and
MLP-out projections by input rows, the vocabulary of the embedding and LM head), so a step needs two all-reduces of
[B, D] per layer and no weight moves. The batch (rows of the KV cache and of every activation) goes over `data`.

The rule for kv heads: the KV cache and wk/wv are split over `tensor` by kv head. When the tensor axis is larger
than n_kv_heads (70B: 8 kv heads on 16 chips), each kv head is repeated tensor / n_kv_heads times, so every device
holds exactly one kv head and the query heads that read it (the query→kv head grouping is unchanged: query head n
reads kv head n // G before and after). That needs tensor to be a multiple of n_kv_heads and to divide n_heads; the
cache then costs tensor / n_kv_heads times its unrepeated size in total, and one kv head per device.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core.errors import LlamaJaxError
from llama_jax.core.model_config import DTYPES, QUANTIZE_MODES, ModelConfig
from llama_jax.core.run_config import DEFAULT_LOGICAL_AXIS_RULES
from llama_jax.model import quantize as quantize_lib
from llama_jax.model import sharding
from llama_jax.model.layer_layout import stacked_slices
from llama_jax.model.llama import Llama

# Logical axis → mesh axis for decoding: the training rules (tensor over heads, kv heads, MLP and vocabulary) except
# that "embed" is never split (no weight is gathered per token) and batch rows go over `data` alone. "vocab" and
# "kv_heads" are adjusted per model in `decode_rules`.
DECODE_RULES = tuple({**dict(DEFAULT_LOGICAL_AXIS_RULES), "embed": None, "activation_batch": "data"}.items())

# Logical axes of the decode state: the cache by batch row and kv head; the small per-row arrays replicated, so every
# process reads the emitted tokens without a gather of its own.
CACHE_KV_AXES = ("activation_batch", "activation_kv_heads", None, None)
CACHE_POSITIONS_AXES = ("activation_batch", None)


class InferenceError(LlamaJaxError, ValueError):
  """A decode mesh, dtype or quantization does not fit the model; the message names the values."""


def parse_mesh(text: str) -> dict[str, int]:
  """`--mesh data=1,tensor=-1` → {"data": 1, "tensor": -1}."""
  out = {}
  for item in filter(None, (part.strip() for part in text.split(","))):
    name, sep, value = item.partition("=")
    try:
      if not sep:
        raise ValueError
      out[name.strip()] = int(value)
    except ValueError:
      raise InferenceError(f"--mesh takes AXIS=SIZE pairs such as data=1,tensor=-1, got {text!r}") from None
  unknown = sorted(set(out) - {"data", "fsdp", "tensor"})
  if unknown:
    raise InferenceError(f"--mesh names unknown axes {unknown}; decoding uses data and tensor")
  return out


def decode_mesh(mesh: str | Mapping[str, int] | None = None, devices=None) -> Mesh:
  """The (data, fsdp, tensor) decode mesh over `devices`: weights split over `tensor`, batch rows over `data`.

  Default layout: every device on `tensor` when there is more than one; a mesh that names `data` but not `tensor`
  puts the rest of the devices on `tensor`. An explicit mesh of fewer devices takes the first ones (single process).
  fsdp must stay 1: gathering weights per token is what decoding avoids.

  Args:
    mesh: axis sizes as ``--mesh`` text such as ``data=1,tensor=-1`` or a mapping, -1 for the devices the other axes
      leave; None: every device on `tensor`.
    devices: the devices to use; None: all devices of all processes.

  Returns:
    The mesh, axes other than data and tensor of size 1.

  Raises:
    InferenceError: the text is not AXIS=SIZE pairs, names an axis other than data, fsdp and tensor, sets fsdp
      other than 1, or the sizes do not fit the devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  spec = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh or {"tensor": -1})
  if spec.get("fsdp", 1) != 1:
    raise InferenceError(
      f"decoding does not use fsdp (it would gather every weight per token), got fsdp={spec['fsdp']}; "
      "put the devices on tensor (and data for large batches)"
    )
  if spec.get("data", 1) != -1 and "tensor" not in spec:
    spec["tensor"] = -1
  sizes = {"data": 1, "fsdp": 1, "tensor": 1, **spec}
  wanted = math.prod(sizes.values())
  if -1 not in sizes.values() and 0 < wanted < len(devices) and jax.process_count() == 1:
    devices = devices[:wanted]  # a smaller explicit mesh (tensor=1: one device) uses the first devices
  try:
    return sharding.make_mesh(sizes, devices)
  except sharding.ShardingError as e:
    raise InferenceError(str(e)) from None


def kv_repeats(cfg: ModelConfig, tensor: int) -> int:
  """How many times each kv head is repeated on a tensor axis of this size (1 when the axis divides the kv heads)."""
  k, n = cfg.n_kv_heads, cfg.n_heads
  if k % tensor == 0:
    return 1
  if tensor % k == 0 and n % tensor == 0:
    return tensor // k
  raise InferenceError(
    f"a tensor axis of {tensor} devices does not fit {k} kv heads and {n} query heads: it must divide "
    f"n_kv_heads, or be a multiple of n_kv_heads that divides n_heads (kv heads are then repeated)"
  )


def decode_rules(cfg: ModelConfig, mesh: Mesh) -> tuple:
  """The decode rules for this model on this mesh: kv heads split over tensor only when it divides them (the
  stacked restore target, before repetition), the vocabulary only when it divides it (a 32000 vocab on 3 devices
  stays whole: the embedding and LM head are replicated, every other weight still split)."""
  tensor = mesh.shape["tensor"]
  table = dict(DECODE_RULES)
  if cfg.vocab_size % tensor:
    table["vocab"] = table["activation_vocab"] = None
  if cfg.n_kv_heads % tensor:
    table["kv_heads"] = table["activation_kv_heads"] = None
  return tuple(table.items())


def decode_config(cfg: ModelConfig, mesh: Mesh, dtype: str | None = None, quantize: str = "none") -> ModelConfig:
  """The model as it decodes on `mesh`: kv heads repeated to fill the tensor axis, weights and compute in `dtype`
  (default: as stored), projections int8 when quantized."""
  if dtype is not None and dtype not in DTYPES:
    raise InferenceError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
  if quantize not in QUANTIZE_MODES:
    raise InferenceError(f"--quantize must be one of {', '.join(QUANTIZE_MODES)}, got {quantize!r}")
  repeats = kv_repeats(cfg, mesh.shape["tensor"])
  changes: dict[str, Any] = dict(n_kv_heads=cfg.n_kv_heads * repeats)
  if dtype is not None:
    changes.update(dtype=dtype, param_dtype=dtype)
  return cfg.replace(**changes)


def _unstacked_llama(cfg, rngs):
  return Llama(cfg, rngs=rngs, stacked_layers=False)


def decode_targets(cfg: ModelConfig, mesh: Mesh) -> Any:
  """Abstract params (shapes, dtypes, decode shardings) of the decoding layout (one entry per layer) of `cfg`."""
  return sharding.abstract_params(_unstacked_llama, cfg, mesh, decode_rules(cfg, mesh))[1]


def is_unstacked(params: Mapping[str, Any]) -> bool:
  return all(isinstance(key, int) for key in params["layers"])


def place_params(
  cfg: ModelConfig,
  params: Any,
  mesh: Mesh,
  *,
  dtype: str | None = None,
  quantize: str = "none",
  donate: bool = False,
) -> tuple[ModelConfig, Any]:
  """Place a model's params on `mesh` in the decoding layout: one entry per layer, kv heads repeated, cast, quantized.

  The params may be of `cfg` in either layout, stacked or unstacked, held anywhere: numpy on the host (sliced and
  cast there, each device receiving only its shard), or jax arrays on any devices (transformed leaf by leaf under
  jit into their target shardings; with `donate` each source leaf is deleted once used, so the peak is the model plus
  one stacked leaf, never two models). A jax array already in its target sharding and dtype is kept as it is. Its
  inner `layer_leaf` is the one transformation of a leaf, whichever layout and wherever it is held; the loop around
  it only walks the tree.

  Args:
    cfg: the model config the params are of.
    params: the params as a pure nested dict.
    mesh: the decode mesh, as `decode_mesh` makes it.
    dtype: cast the weights and compute to this dtype; None: as stored.
    quantize: "int8" quantizes the projections and the embedding to int8 with per-output-channel scales; "none"
      keeps them float.
    donate: delete each source jax array once it is placed.

  Returns:
    The decode config (kv heads repeated to fill the tensor axis, `dtype`, quantization) and the placed params.

  Raises:
    InferenceError: `dtype` is not a known dtype, the tensor axis does not fit the model's heads, or a parameter is
      missing, unknown or of the wrong shape for `cfg`.
    QuantizeError: int8 is asked for params that are already quantized.
  """
  out_cfg = decode_config(cfg, mesh, dtype)
  repeats = out_cfg.n_kv_heads // cfg.n_kv_heads
  targets = decode_targets(out_cfg, mesh)
  stacked = not is_unstacked(params)
  mesh_devices = set(mesh.devices.flat)

  def layer_leaf(path: tuple, leaf: Any, layer: int | None, target: jax.ShapeDtypeStruct, n_slices: int = 0):
    # `layer`: the slice of a stacked leaf's leading axis (of its n_slices) to place; None for a leaf placed whole.
    # K is axis -2 of wk, wv [..., D, K, H] and of their int8 scales [..., K, H].
    repeat_axis = -2 if path[-1] in ("wk", "wv", "wk_scale", "wv_scale") and repeats > 1 else None
    shape = list(leaf.shape[1:] if layer is not None else leaf.shape)
    if repeat_axis is not None and shape:
      shape[repeat_axis] *= repeats
    if tuple(shape) != target.shape or (layer is not None and leaf.shape[0] != n_slices):
      raise InferenceError(
        f"parameter {'/'.join(map(str, path))} has shape {tuple(leaf.shape)}, which does not fit the model "
        f"config (expected {target.shape}{f' for each of {n_slices} layers' if layer is not None else ''})"
      )
    if isinstance(leaf, jax.Array) and leaf.sharding.device_set == mesh_devices:
      if layer is None and repeat_axis is None and leaf.dtype == target.dtype:
        if leaf.sharding.is_equivalent_to(target.sharding, leaf.ndim):
          return leaf  # already placed (a sampler built from params that were loaded for it)
      return _transform(leaf, None if layer is None else jnp.int32(layer), repeat_axis, repeats, target)
    host = np.asarray(leaf if layer is None else leaf[layer])
    if repeat_axis is not None:
      host = np.repeat(host, repeats, axis=repeat_axis)
    host = host.astype(target.dtype)
    return jax.make_array_from_callback(target.shape, target.sharding, lambda index: host[index])

  flat_targets = dict(_flatten(targets))
  placed: dict[tuple, Any] = {}
  for path, leaf in _flatten(params):
    in_layer, layers = stacked_slices(cfg, path[1:]) if path[0] == "layers" and stacked else (None, [0])
    known = path if in_layer is None else ("layers", layers[0], *in_layer)
    if known not in flat_targets:
      raise InferenceError(f"parameter {'/'.join(map(str, path))} is not part of a model with this config")
    if in_layer is not None:
      outs = {("layers", i, *in_layer): None for i in layers}
      for index, out_path in enumerate(outs):
        outs[out_path] = layer_leaf(out_path, leaf, index, flat_targets[out_path], len(layers))
    else:
      outs = {path: layer_leaf(path, leaf, None, flat_targets[path])}
    placed.update(outs)
    if donate and isinstance(leaf, jax.Array) and all(out is not leaf for out in outs.values()):
      leaf.delete()  # freed before the next leaf is placed: the peak is the model plus one stacked leaf
  missing = sorted(map(str, set(flat_targets) - set(placed)))
  if missing:
    raise InferenceError(f"the parameters lack {len(missing)} entries of the model, e.g. {missing[0]}")
  placed = _unflatten(placed)
  if quantize == "int8":
    int8_cfg = out_cfg.replace(quantize="int8")
    shardings = sharding.shardings_of(decode_targets(int8_cfg, mesh))
    # The float leaves placed here are freed as they are quantized, unless some are the caller's own arrays (already
    # in place) that the caller keeps.
    given = {id(leaf) for leaf in jax.tree.leaves(params)}
    ours = donate or not any(id(leaf) in given for leaf in jax.tree.leaves(placed))
    out_cfg, placed = quantize_lib.quantize_params(placed, out_cfg, shardings=shardings, donate=ours)
  return out_cfg, placed


def _flatten(tree: Mapping[str, Any], prefix: tuple = ()) -> list[tuple[tuple, Any]]:
  """(path, leaf) of a nested dict, paths as tuples of keys."""
  out = []
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out += _flatten(value, (*prefix, key))
    else:
      out.append(((*prefix, key), value))
  return out


def _unflatten(flat: Mapping[tuple, Any]) -> dict:
  out: dict = {}
  for path, leaf in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return out


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _transform(leaf, layer, repeat_axis, repeats, target):
  """One leaf (or one layer of a stacked leaf; `layer` is traced, so one program serves every layer) cast, kv heads
  repeated, into its target sharding."""
  value = leaf if layer is None else jax.lax.dynamic_index_in_dim(leaf, layer, keepdims=False)
  if repeat_axis is not None:
    value = jnp.repeat(value, repeats, axis=repeat_axis)
  return jax.lax.with_sharding_constraint(value.astype(target.dtype), target.sharding)


def load_decode_params(
  checkpoint_dir: str,
  mesh: Mesh,
  *,
  dtype: str | None = None,
  quantize: str = "none",
  step: int | None = None,
  stacked: bool = False,
) -> tuple[ModelConfig, Any]:
  """(model config, params on `mesh`) of a checkpoint directory: restored by orbax straight into shards of the
  stacked layout under the decode rules (cast to `dtype` on the way in: no float32 copy of bf16 weights). For the
  sampler (default) they are then unstacked, kv-repeated and quantized leaf by leaf, each stacked leaf freed once
  used; `stacked` keeps the stored layout (the full forward of evaluation) and only quantizes."""
  cfg = checkpoint_params.read_model_config(checkpoint_dir)
  decode_config(cfg, mesh, dtype, quantize)  # refuse a bad mesh, dtype or mode before reading anything
  stored_cfg = cfg if dtype is None else cfg.replace(param_dtype=dtype, dtype=dtype)
  rules = decode_rules(cfg, mesh)
  _, target = sharding.abstract_params(Llama, stored_cfg, mesh, rules)
  _, params = checkpoint_params.load_params(
    checkpoint_dir, step=step, shardings=sharding.shardings_of(target), dtype=dtype
  )
  if not stacked:
    return place_params(stored_cfg, params, mesh, quantize=quantize, donate=True)
  if quantize == "int8":
    int8_target = sharding.abstract_params(Llama, stored_cfg.replace(quantize="int8"), mesh, rules)[1]
    return quantize_lib.quantize_params(params, stored_cfg, shardings=sharding.shardings_of(int8_target))
  return stored_cfg, params


def per_device_bytes(tree: Any) -> int:
  """The most bytes any one device of this process holds of `tree` (arrays or ShapeDtypeStructs with shardings):
  max over devices of the sum of their shards. Leaves with no sharding (numpy) count whole on every device."""
  totals: collections.Counter = collections.Counter()
  everywhere = 0
  for leaf in jax.tree.leaves(tree):
    leaf_sharding = getattr(leaf, "sharding", None)
    itemsize = np.dtype(leaf.dtype).itemsize
    if leaf_sharding is None:
      everywhere += math.prod(leaf.shape) * itemsize
      continue
    for device in leaf_sharding.addressable_devices:
      totals[device] += math.prod(leaf_sharding.shard_shape(leaf.shape)) * itemsize
  return everywhere + max(totals.values(), default=0)


def padded_rows(batch: int, mesh: Mesh) -> int:
  """Rows actually decoded: the batch padded to a multiple of the data axis (the Sampler repeats the first prompt)."""
  data = mesh.shape["data"]
  return -(-batch // data) * data


def cache_shardings(mesh: Mesh, rules) -> dict[str, NamedSharding]:
  """NamedShardings of the KV cache's parts (k and v buffers, slot positions, the scalar index)."""
  return {
    "kv": NamedSharding(mesh, sharding.logical_to_spec(CACHE_KV_AXES, rules)),
    "positions": NamedSharding(mesh, sharding.logical_to_spec(CACHE_POSITIONS_AXES, rules)),
    "index": NamedSharding(mesh, PartitionSpec()),
  }


def cache_bytes_per_device(cfg: ModelConfig, mesh: Mesh, batch: int, length: int) -> int:
  """Bytes of one device's share of a per-layer KV cache for `batch` rows of `length` slots."""
  rules = decode_rules(cfg, mesh)
  spec = sharding.logical_to_spec(CACHE_KV_AXES, rules)
  kv = NamedSharding(mesh, spec).shard_shape((batch, cfg.n_kv_heads, length, cfg.head_dim))
  rows = NamedSharding(mesh, sharding.logical_to_spec(CACHE_POSITIONS_AXES, rules)).shard_shape((batch, length))
  return 2 * cfg.n_layers * math.prod(kv) * jnp.dtype(cfg.dtype).itemsize + math.prod(rows) * 4 + 4
