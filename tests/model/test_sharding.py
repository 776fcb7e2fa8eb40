"""Mesh shape resolution and logical-axis rules (the 8-device checks live in tests/multidevice)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from llama_jax.core import distributed
from llama_jax.core.run_config import DEFAULT_LOGICAL_AXIS_RULES
from llama_jax.model import sharding


def test_minus_one_is_the_rest_of_the_devices():
  # (data, fsdp, expert, context, tensor)
  assert sharding.resolve_mesh_shape(dict(data=2, fsdp=-1, tensor=2), 16) == (2, 4, 1, 1, 2)
  assert sharding.resolve_mesh_shape(dict(data=1, fsdp=-1, tensor=1), 1) == (1, 1, 1, 1, 1)
  assert sharding.resolve_mesh_shape(dict(tensor=8), 8) == (1, 1, 1, 1, 8)
  assert sharding.resolve_mesh_shape(dict(fsdp=2, context=-1), 8) == (1, 2, 1, 4, 1)


@pytest.mark.parametrize(
  "mesh,devices,message",
  [
    (
      dict(data=2, fsdp=2, tensor=2),
      4,
      "mesh data×fsdp×expert×context×tensor = 2×2×1×1×2 = 8 devices, but 4 devices are available",
    ),
    (dict(data=3, fsdp=-1, tensor=1), 8, "mesh axes other than -1 multiply to 3, which does not divide the 8 devices"),
    (dict(data=-1, fsdp=-1, tensor=1), 8, "at most one mesh axis may be -1"),
    (dict(data=0, fsdp=-1, tensor=1), 8, "mesh.data must be a positive integer or -1"),
    (dict(data=1, pipeline=2), 2, "unknown mesh axes ['pipeline']"),
    (
      dict(data=1, fsdp=-1, dcn_data=3),
      8,
      "mesh.dcn_data must be a positive integer that divides the 8 devices, got 3",
    ),
    (
      dict(data=2, fsdp=4, dcn_data=2),
      8,
      "mesh data×fsdp×expert×context×tensor = 2×4×1×1×1 = 8 devices, but 4 devices per slice",
    ),
  ],
)
def test_bad_mesh_is_rejected_naming_the_numbers(mesh, devices, message):
  with pytest.raises(sharding.ShardingError) as excinfo:
    sharding.resolve_mesh_shape(mesh, devices)
  assert message in str(excinfo.value)


def test_dcn_data_multiplies_the_data_axis_and_minus_one_fills_a_slice():
  assert sharding.resolve_mesh_shape(dict(data=1, fsdp=-1, tensor=2, dcn_data=4), 32) == (4, 4, 1, 1, 2)
  assert sharding.resolve_mesh_shape(dict(data=2, fsdp=-1, tensor=1, dcn_data=2), 16) == (4, 4, 1, 1, 1)


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (
      dict(coordinator_address="localhost:1234"),
      "needs all of coordinator_address, num_processes and process_id; "
      "got coordinator_address='localhost:1234', num_processes=None",
    ),
    (
      dict(coordinator_address="localhost:1234", num_processes=2, process_id=2),
      "process_id must be in [0, num_processes=2), got 2",
    ),
  ],
)
def test_incomplete_multi_process_arguments_are_rejected(monkeypatch, kwargs, message):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  with pytest.raises(distributed.DistributedError) as excinfo:
    distributed.maybe_initialize_distributed(**kwargs)
  assert message in str(excinfo.value)


def test_logical_names_map_through_the_rules_and_unknown_names_fail():
  spec = sharding.logical_to_spec(
    ("activation_batch", "activation_length", "activation_vocab"), DEFAULT_LOGICAL_AXIS_RULES
  )
  assert spec == PartitionSpec(("data", "fsdp", "expert"), "context", "tensor")
  with pytest.raises(sharding.ShardingError, match="logical axis 'experts' has no rule"):
    sharding.logical_to_spec(("experts",), DEFAULT_LOGICAL_AXIS_RULES)


def test_constraints_are_a_no_op_without_an_active_mesh():
  x = jnp.ones((2, 3))
  assert sharding.constrain(x, ("activation_batch", "activation_length")) is x


def test_single_device_mesh_and_no_distributed_init_on_one_host(monkeypatch):
  for name in (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "TPU_WORKER_HOSTNAMES",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
  ):
    monkeypatch.delenv(name, raising=False)
  distributed.maybe_initialize_distributed()
  assert jax.process_count() == 1
  mesh = sharding.make_mesh(dict(data=1, fsdp=-1, tensor=1))
  assert mesh.axis_names == ("data", "fsdp", "expert", "context", "tensor") and mesh.size == jax.device_count()
