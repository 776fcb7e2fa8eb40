"""Device mesh (data × fsdp × expert × context × tensor), logical-axis rules → shardings, sharded model init.

Layers name their axes logically ("embed", "heads", "activation_batch" ...); the run config maps those names to mesh
axes. Changing the parallelism is a config change. Parameters are never materialised unsharded: the model is
initialised abstractly (``nnx.eval_shape``), shardings are derived from that tree, and the real initialisation runs
under ``jax.jit(out_shardings=...)``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from llama_jax.core.checks import ConfigError
from llama_jax.core.errors import LlamaJaxError
from llama_jax.core.run_config import MESH_AXES, MeshConfig

_log = logging.getLogger(__name__)

Rules = Sequence[tuple[str, Any]]


class ShardingError(LlamaJaxError, ValueError):
  """The mesh does not fit the devices or the model; the message names the values."""


def mesh_config(mesh: MeshConfig | Mapping[str, int]) -> MeshConfig:
  """A checked MeshConfig from a run config's mesh section or a plain mapping such as ``dict(fsdp=-1)``."""
  if isinstance(mesh, MeshConfig):
    return mesh
  values = dict(mesh.to_dict() if hasattr(mesh, "to_dict") else mesh)
  unknown = sorted(set(values) - set(MESH_AXES) - {"dcn_data"})
  if unknown:
    raise ShardingError(f"unknown mesh axes {unknown}; the mesh axes are {', '.join(MESH_AXES)} (and dcn_data)")
  try:
    return MeshConfig(**{axis: 1 for axis in MESH_AXES} | values)
  except ConfigError as e:
    raise ShardingError(str(e)) from None


def resolve_mesh_shape(mesh: MeshConfig | Mapping[str, int], n_devices: int) -> tuple[int, ...]:
  """Global sizes of the MESH_AXES (data, fsdp, expert, context, tensor), one -1 replaced by the devices the other
  axes leave.

  `dcn_data` (default 1) is the number of slices (multi-slice TPU, or hosts joined by a slower network) that the data
  axis spans: the data axis is dcn_data × data, and the -1 is resolved within one slice. Axes missing from a plain
  mapping are 1.
  """
  mesh = mesh_config(mesh)
  dcn = mesh.dcn_data
  if n_devices % dcn:
    raise ShardingError(f"mesh.dcn_data must be a positive integer that divides the {n_devices} devices, got {dcn}")
  per_slice = n_devices // dcn
  sizes = [getattr(mesh, axis) for axis in MESH_AXES]
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if per_slice % known:
      raise ShardingError(
        f"mesh axes other than -1 multiply to {known}, which does not divide the "
        f"{per_slice} devices" + (f" of each of the {dcn} slices" if dcn > 1 else "")
      )
    sizes[sizes.index(-1)] = per_slice // known
  if math.prod(sizes) != per_slice:
    where = f"devices per slice ({n_devices} devices / dcn_data {dcn})" if dcn > 1 else "devices are available"
    raise ShardingError(
      f"mesh {'×'.join(MESH_AXES)} = {'×'.join(map(str, sizes))} = {math.prod(sizes)} devices, but {per_slice} {where}"
    )
  return dcn * sizes[0], *sizes[1:]


def make_mesh(mesh_cfg: MeshConfig | Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, expert, context, tensor) mesh over the devices, its axis types Auto.

  Auto axes let the compiler propagate shardings from the parameters and constraints. On a TPU slice, a shape that
  is no product of whole physical axes is laid out by splitting physical axes, with a warning. With `dcn_data` > 1,
  only the data axis crosses the slices, TPU slices or processes where devices have none: fsdp and tensor stay
  inside a slice.

  Args:
    mesh_cfg: a run config's mesh section or a plain mapping such as ``dict(fsdp=-1)``: each axis's size, one of
      them -1 for the devices the others leave, axes missing from a mapping 1, and `dcn_data` the slices the data
      axis spans.
    devices: the devices to lay out, or None for all devices of all processes.

  Returns:
    The mesh, with the axes `MESH_AXES`.

  Raises:
    ShardingError: an unknown axis or a bad value, axis sizes that do not multiply to the devices (per slice), or a
      `dcn_data` that does not divide the devices or differs from the slices they form.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_cfg, len(devices))
  dcn = mesh_config(mesh_cfg).dcn_data
  # Auto axes: the compiler propagates shardings from parameters and constraints (Explicit would demand
  # out_sharding on every gather).
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if dcn == 1:
    try:
      return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
      # On a TPU slice jax lays each mesh axis over whole physical (ICI) axes; an axis that is no product of them
      # (context 8 × fsdp 8 on v5p-128's 4×4×4 chips) is refused. Splitting a physical axis between two mesh axes
      # still gives every mesh axis neighbouring chips (MaxText's allow_split_physical_axes).
      _log.warning("mesh %s does not map onto whole physical axes of these devices; splitting them", shape)
      grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
      return Mesh(grid, MESH_AXES, axis_types=axis_types)
  # Multi-slice: only the data axis crosses the slow network (one gradient all-reduce per step); fsdp and tensor
  # stay inside a slice. Slices are TPU slice indices, or processes where devices have none (GPU hosts, CPU tests).
  by_process = not hasattr(devices[0], "slice_index")
  granules = len({getattr(d, "process_index" if by_process else "slice_index") for d in devices})
  if granules != dcn:
    raise ShardingError(
      f"mesh.dcn_data is {dcn} but the devices form {granules} {'processes' if by_process else 'slices'}"
    )
  grid = mesh_utils.create_hybrid_device_mesh(
    (shape[0] // dcn, *shape[1:]), (dcn,) + (1,) * (len(shape) - 1), devices, process_is_granule=by_process
  )
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
  """Logical axis names → a PartitionSpec; a name missing from the rules is an error, never replicated silently."""
  table = dict(rules)
  mesh_axes = []
  for name in logical_axes:
    if name is None:
      mesh_axes.append(None)
    elif name not in table:
      raise ShardingError(f"logical axis {name!r} has no rule; add it to logical_axis_rules (known: {sorted(table)})")
    else:
      mesh_axes.append(table[name])
  return PartitionSpec(*mesh_axes)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules):
  """Mesh + logical rules for tracing: activation constraints in the model are no-ops outside this context."""
  with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(tuple(rules)):
    yield


def target_platform() -> str:
  """The platform the program being traced will run on: that of the active mesh's devices, else the default
  backend. Kernels are chosen by it, so a TPU program compiled on a CPU host (``plan --topology``: abstract TPU
  devices) gets the TPU kernels."""
  device = jax.sharding.get_abstract_mesh().abstract_device  # also inside jit, where the concrete mesh is not
  return device.platform if device is not None else jax.default_backend()


def active_rules() -> Rules | None:
  """The logical axis rules when a mesh and rules are active (see `activate`), else None: what is traced then runs
  on that mesh (the trainer, the sampler, evaluation)."""
  rules = flax_spmd.get_logical_axis_rules()
  return rules if rules and not jax.sharding.get_abstract_mesh().empty else None


def context_axes() -> tuple[tuple[str, ...], int]:
  """(the mesh axes that split the activations' sequence axis "activation_length", how many shards they make)
  under the active mesh and rules: ((), 1) when no mesh is active or the sequence is whole on every device."""
  rules = active_rules()
  target = None if rules is None else dict(rules).get("activation_length")
  axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
  shards = math.prod(jax.sharding.get_abstract_mesh().shape[axis] for axis in axes)
  return (axes, shards) if shards > 1 else ((), 1)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """with_sharding_constraint through logical names when a mesh and rules are active (see `activate`)."""
  rules = active_rules()
  if rules is None:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, rules))


def active_specs(named_axes: Mapping[str, Sequence[str | None]]) -> dict[str, PartitionSpec] | None:
  """PartitionSpecs of logical axes under the active mesh and rules, or None when none are active."""
  rules = active_rules()
  if rules is None:
    return None
  return {key: logical_to_spec(axes, rules) for key, axes in named_axes.items()}


def path_name(path) -> str:
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
          f"parameter {path_name(path)} has shape {tuple(variable.shape)}: axis {dim} ({logical[dim]!r}) of size "
          f"{size} is not divisible by mesh axes {'×'.join(axes)} = {shards}; change the mesh or the rules"
        )
    return variable.replace(NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_model(model_cls, cfg, seed: int = 0):
  """(graphdef, abstract nnx state) of a model without allocating a parameter; variables keep their logical axes."""
  abstract = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(seed)))
  return nnx.split(abstract)


def abstract_params(model_cls, cfg, mesh: Mesh | None = None, rules: Rules = (), seed: int = 0):
  """The graphdef and the params' shapes, dtypes and shardings of a model, with nothing allocated.

  The one abstract-state builder: the trainer's state and shardings, checkpoint restore targets, evaluation and the
  memory planner all start from it, so they cannot disagree on a shape, a dtype or a sharding.

  Args:
    model_cls: the model class, built as ``model_cls(cfg, rngs=...)``, e.g. `Llama`.
    cfg: the model's config.
    mesh: the mesh to shard over, or None for no shardings.
    rules: the logical axis rules, (logical name, mesh axes) pairs, that map each parameter's axes onto `mesh`.
    seed: the seed of the model's ``nnx.Rngs``.

  Returns:
    A tuple: the graphdef, and the params as a plain nested dict of ShapeDtypeStructs, each with its NamedSharding
      from its logical axes under a mesh, none without one.

  Raises:
    ShardingError: under a mesh, a logical axis with no rule, or a parameter axis the mesh does not divide, named
      by parameter.
  """
  graphdef, abstract_state = abstract_model(model_cls, cfg, seed)
  shapes = nnx.to_pure_dict(abstract_state)
  if mesh is None:
    return graphdef, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), shapes)
  shardings = nnx.to_pure_dict(state_shardings(abstract_state, mesh, rules))
  return graphdef, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def shardings_of(abstract_tree: Any) -> Any:
  """The sharding of every leaf of a tree of ShapeDtypeStructs (e.g. from `abstract_params`)."""
  return jax.tree.map(lambda a: a.sharding, abstract_tree)


def init_model(model_cls, cfg, mesh: Mesh, rules: Rules, seed: int = 0):
  """Builds the model with every parameter created directly in its shards.

  The model is initialised abstractly first, its shardings derived from the parameters' logical axes, and the real
  initialisation runs under ``jax.jit(out_shardings=...)`` with the mesh and rules active: no parameter is ever
  materialised unsharded.

  Args:
    model_cls: the model class, built as ``model_cls(cfg, rngs=...)``, e.g. `Llama`.
    cfg: the model's config.
    mesh: the mesh to shard over, e.g. from `make_mesh`.
    rules: the logical axis rules, (logical name, mesh axes) pairs, that map each parameter's axes onto `mesh`.
    seed: the seed of the model's ``nnx.Rngs``, which the parameters are drawn from.

  Returns:
    The model, its parameters sharded over `mesh`.

  Raises:
    ShardingError: a logical axis with no rule, or a parameter axis the mesh does not divide, named by parameter.
  """
  graphdef, abstract_state = abstract_model(model_cls, cfg, seed)
  shardings = state_shardings(abstract_state, mesh, rules)

  def init():
    return nnx.state(model_cls(cfg, rngs=nnx.Rngs(seed)))

  with activate(mesh, rules):
    state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)
