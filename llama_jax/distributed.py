"""Several JAX processes as one job: joining it, and what the processes agree on (who writes, who goes first).

One process per host (TPU VM worker, GPU node); each sees its own local devices, and together they form the global
mesh. Process 0 writes logs, metrics and the workdir's metadata; orbax writes checkpoints collectively.
"""

from __future__ import annotations

import contextlib
import logging
import os

import jax
from jax.experimental import multihost_utils

from llama_jax.errors import LlamaJaxError

_log = logging.getLogger(__name__)


class DistributedError(LlamaJaxError, ValueError):
  """The multi-process settings are incomplete or inconsistent; the message names them."""


def maybe_initialize_distributed(
  coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
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
      raise DistributedError(
        f"a multi-process run needs all of coordinator_address, num_processes and process_id; "
        f"got coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
        f"process_id={process_id!r}"
      )
    if not 0 <= process_id < num_processes:
      raise DistributedError(f"process_id must be in [0, num_processes={num_processes}), got {process_id}")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif (
    len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1
    or int(env.get("SLURM_NTASKS", "1") or 1) > 1
    or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
  ):
    jax.distributed.initialize()  # JAX detects the cluster's coordinator, size and rank itself
  else:
    return
  _log.info("process %d of %d joined the distributed job", jax.process_index(), jax.process_count())


def _int_env(name: str) -> int:
  try:
    return int(os.environ[name])
  except ValueError:
    raise DistributedError(f"{name} must be an integer, got {os.environ[name]!r}") from None


def is_main_process() -> bool:
  """Process 0: the one that writes logs, metrics and the workdir's metadata."""
  return jax.process_index() == 0


@contextlib.contextmanager
def main_process_first(name: str):
  """Process 0 runs the body first and the others after it (e.g. tokenizing data once, where the disk is shared:
  the others then find the cache); a no-op with one process."""
  if jax.process_count() == 1:
    yield
    return
  if not is_main_process():
    multihost_utils.sync_global_devices(f"llama_jax: {name}")
  yield
  if is_main_process():
    multihost_utils.sync_global_devices(f"llama_jax: {name}")
