"""Device mesh (data × fsdp × tensor), logical-axis rules → shardings, and sharded model initialisation.

Layers name their axes logically ("embed", "heads", "activation_batch" ...); the run config maps those names to mesh
axes. Changing the parallelism is a config change. Parameters are never materialised unsharded: the model is
initialised abstractly (``nnx.eval_shape``), shardings are derived from that tree, and the real initialisation runs
under ``jax.jit(out_shardings=...)``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
Rules = Sequence[tuple[str, Any]]

_log = logging.getLogger(__name__)


class ShardingError(ValueError):
  """The mesh does not fit the devices or the model; the message names the values."""


def maybe_initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                                 process_id: int | None = None) -> None:
  """Joins a multi-process JAX job when the arguments or the environment describe one; a no-op on a single host.

  Recognised: explicit arguments (the train CLI's --coordinator_address/--num_processes/--process_id), the same three
  as JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, a multi-host Cloud TPU slice
  (TPU_WORKER_HOSTNAMES lists more than one host), SLURM or Open MPI jobs of more than one task (JAX reads those).
  """
  if jax.distributed.is_initialized():
    return
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
  if num_processes is None and env.get("JAX_NUM_PROCESSES"):
    num_processes = _int_env("JAX_NUM_PROCESSES")
  if process_id is None and env.get("JAX_PROCESS_ID"):
    process_id = _int_env("JAX_PROCESS_ID")
  explicit = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in explicit):
    if None in explicit:
      raise ShardingError(f"a multi-process run needs all of coordinator_address, num_processes and process_id; got "
                          f"coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
                          f"process_id={process_id!r}")
    if not 0 <= process_id < num_processes:
      raise ShardingError(f"process_id must be in [0, num_processes={num_processes}), got {process_id}")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif (len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1
        or int(env.get("SLURM_NTASKS", "1") or 1) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1):
    jax.distributed.initialize()  # JAX detects the cluster's coordinator, size and rank itself
  else:
    return
  _log.info("process %d of %d joined the distributed job", jax.process_index(), jax.process_count())


def _int_env(name: str) -> int:
  try:
    return int(os.environ[name])
  except ValueError:
    raise ShardingError(f"{name} must be an integer, got {os.environ[name]!r}") from None


def resolve_mesh_shape(mesh_cfg: Mapping[str, int], n_devices: int) -> tuple[int, int, int]:
  """Global (data, fsdp, tensor) sizes, one -1 replaced by the devices the other axes leave.

  `dcn_data` (default 1) is the number of slices (multi-slice TPU, or hosts joined by a slower network) that the data
  axis spans: the data axis is dcn_data × data, and the -1 is resolved within one slice.
  """
  unknown = sorted(set(mesh_cfg) - set(MESH_AXES) - {"dcn_data"})
  if unknown:
    raise ShardingError(f"unknown mesh axes {unknown}; the mesh axes are {', '.join(MESH_AXES)} (and dcn_data)")
  dcn = int(mesh_cfg.get("dcn_data", 1))
  if dcn < 1 or n_devices % dcn:
    raise ShardingError(f"mesh.dcn_data must be a positive integer that divides the {n_devices} devices, got {dcn}")
  per_slice = n_devices // dcn
  sizes = [int(mesh_cfg.get(axis, 1)) for axis in MESH_AXES]
  for axis, size in zip(MESH_AXES, sizes):
    if size == 0 or size < -1:
      raise ShardingError(f"mesh.{axis} must be a positive integer or -1 (the rest of the devices), got {size}")
  if sizes.count(-1) > 1:
    raise ShardingError(f"at most one mesh axis may be -1, got data={sizes[0]}, fsdp={sizes[1]}, tensor={sizes[2]}")
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if per_slice % known:
      raise ShardingError(f"mesh axes other than -1 multiply to {known}, which does not divide the "
                          f"{per_slice} devices" + (f" of each of the {dcn} slices" if dcn > 1 else ""))
    sizes[sizes.index(-1)] = per_slice // known
  if math.prod(sizes) != per_slice:
    where = f"devices per slice ({n_devices} devices / dcn_data {dcn})" if dcn > 1 else "devices are available"
    raise ShardingError(f"mesh data×fsdp×tensor = {sizes[0]}×{sizes[1]}×{sizes[2]} = {math.prod(sizes)} "
                        f"devices, but {per_slice} {where}")
  return dcn * sizes[0], sizes[1], sizes[2]


def make_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all processes), axis types Auto."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_cfg, len(devices))
  dcn = int(mesh_cfg.get("dcn_data", 1))
  # Auto axes: the compiler propagates shardings from parameters and constraints (Explicit would demand
  # out_sharding on every gather).
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if dcn == 1:
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
  # Multi-slice: only the data axis crosses the slow network (one gradient all-reduce per step); fsdp and tensor
  # stay inside a slice. Slices are TPU slice indices, or processes where devices have none (GPU hosts, CPU tests).
  by_process = not hasattr(devices[0], "slice_index")
  granules = len({getattr(d, "process_index" if by_process else "slice_index") for d in devices})
  if granules != dcn:
    raise ShardingError(f"mesh.dcn_data is {dcn} but the devices form {granules} "
                        f"{'processes' if by_process else 'slices'}")
  grid = mesh_utils.create_hybrid_device_mesh((shape[0] // dcn, shape[1], shape[2]), (dcn, 1, 1), devices,
                                              process_is_granule=by_process)
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec; a name missing from the rules is an error, never replicated silently."""
  table = dict(rules)
  mesh_axes = []
  for name in logical_axes:
    if name is None:
      mesh_axes.append(None)
    elif name not in table:
      raise ShardingError(f"logical axis {name!r} has no rule; add it to logical_axis_rules "
                          f"(known: {sorted(table)})")
    else:
      mesh_axes.append(table[name])
  return PartitionSpec(*mesh_axes)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules):
  """Mesh + logical rules for tracing: activation constraints in the model are no-ops outside this context."""
  with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(tuple(rules)):
    yield


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """with_sharding_constraint through logical names when a mesh and rules are active (see `activate`)."""
  rules = flax_spmd.get_logical_axis_rules()
  if not rules or jax.sharding.get_abstract_mesh().empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, rules))


def active_specs(named_axes: Mapping[str, Sequence[str | None]]) -> dict[str, PartitionSpec] | None:
  """PartitionSpecs of logical axes under the active mesh and rules, or None when none are active."""
  rules = flax_spmd.get_logical_axis_rules()
  if not rules or jax.sharding.get_abstract_mesh().empty:
    return None
  return {key: logical_to_spec(axes, rules) for key, axes in named_axes.items()}


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def state_shardings(abstract_state: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings of a (possibly abstract) nnx state from each Variable's logical axes, checking divisibility."""

  def one(path, variable):
    logical = variable.get_metadata().get("out_sharding") or (None,) * len(variable.shape)
    spec = logical_to_spec(logical, rules)
    for dim, size, axes in zip(range(len(variable.shape)), variable.shape, tuple(spec) + (None,) * 8):
      if axes is None:
        continue
      axes = axes if isinstance(axes, tuple) else (axes,)
      shards = math.prod(mesh.shape[a] for a in axes)
      if size % shards:
        raise ShardingError(
            f"parameter {_path_name(path)} has shape {tuple(variable.shape)}: axis {dim} ({logical[dim]!r}) of size "
            f"{size} is not divisible by mesh axes {'×'.join(axes)} = {shards}; change the mesh or the rules")
    return variable.replace(NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_model(model_cls, cfg, seed: int = 0):
  """(graphdef, abstract state) of a model without allocating a parameter."""
  abstract = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(seed)))
  return nnx.split(abstract)


def init_model(model_cls, cfg, mesh: Mesh, rules: Rules, seed: int = 0):
  """Builds the model with every parameter created directly in its shards."""
  graphdef, abstract_state = abstract_model(model_cls, cfg, seed)
  shardings = state_shardings(abstract_state, mesh, rules)

  def init():
    return nnx.state(model_cls(cfg, rngs=nnx.Rngs(seed)))

  with activate(mesh, rules):
    state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def shard_batch(batch: Any, mesh: Mesh, rules: Rules, logical_axes=("activation_batch", "activation_length")) -> Any:
  """Places host arrays [B, T, ...] on the mesh with the batch axis split as the activation rules say."""
  spec = logical_to_spec(logical_axes, rules)
  return jax.tree.map(lambda x: jax.device_put(np.asarray(x), NamedSharding(mesh, spec)), batch)
