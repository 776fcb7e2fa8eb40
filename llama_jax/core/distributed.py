"""Several JAX processes as one job: joining it, and what the processes agree on (who writes, who goes first, at
which step they all stop when one of them is preempted).

One process per host (TPU VM worker, GPU node); each sees its own local devices, and together they form the global
mesh. Process 0 writes logs, metrics and the workdir's metadata; orbax writes checkpoints collectively.

What waits on other processes, and what bounds each wait (the distributed runtime's coordination service runs in
process 0; every process sends it heartbeats from a background thread):

  joining          ``initialization_timeout`` (LLAMA_JAX_INIT_TIMEOUT_S, default 300 s): a process other than 0 that
                   finds no coordinator ends with a one-line DistributedError naming the address; one that found it,
                   or process 0, waiting for processes that never come is ended by JAX ("... DEADLINE_EXCEEDED ...
                   RegisterTask", SIGABRT).
  a process dies   (killed, crashed, host lost; also a stopped one, whose heartbeats stop too) while the others wait in
                   a collective (a train step's all-reduce, a barrier, a checkpoint's commit): after
                   ``heartbeat_timeout_seconds`` (LLAMA_JAX_HEARTBEAT_TIMEOUT_S, default 100 s) the service declares it
                   dead and JAX ends every other process (SIGABRT) with "Terminating process because the JAX
                   distributed service detected fatal errors. This most likely indicates that another task died ...
                   The following tasks are unhealthy (stopped sending heartbeats)".
  preemption sync  JAX's own barrier, 3 minutes (see ``reached_preemption_sync_point``).
  orbax barriers   orbax's own timeout (300 s by default), then an error.
  exit             ``shutdown_timeout_seconds`` (JAX's 300 s): each process waits at exit for the others.

Not bounded: a process that is alive but never reaches the next collective (a Python deadlock, an endless loop in
one process's data pipeline). Its heartbeats go on, so the others wait inside the collective as long as the backend's
collectives library does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from llama_jax.core.errors import LlamaJaxError

_log = logging.getLogger(__name__)

# JAX's defaults, named here because the error messages quote them; the environment overrides them (tests shrink them).
INIT_TIMEOUT_ENV, INIT_TIMEOUT_S = "LLAMA_JAX_INIT_TIMEOUT_S", 300
HEARTBEAT_TIMEOUT_ENV, HEARTBEAT_TIMEOUT_S = "LLAMA_JAX_HEARTBEAT_TIMEOUT_S", 100


class DistributedError(LlamaJaxError, ValueError):
  """The multi-process settings are incomplete or inconsistent; the message names them."""


def maybe_initialize_distributed(
  coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
  """Joins a multi-process JAX job when the arguments or the environment describe one; a no-op on a single host.

  Recognised: explicit arguments (the train CLI's --coordinator_address/--num_processes/--process_id), the same three
  as JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, a multi-host Cloud TPU slice
  (TPU_WORKER_HOSTNAMES lists more than one host), SLURM or Open MPI jobs of more than one task (JAX reads those).
  A no-op too when `jax.distributed` is initialized already. Joining waits at most LLAMA_JAX_INIT_TIMEOUT_S for the
  others, and a process silent for LLAMA_JAX_HEARTBEAT_TIMEOUT_S counts as dead (see the module docstring). A process
  other than 0 first waits for the coordinator's port, so that a coordinator that never answers ends it with one
  line; a join that times out after that is ended by JAX itself, which aborts the process rather than raising.

  Args:
    coordinator_address: HOST:PORT of the coordinator, which runs in process 0; None: JAX_COORDINATOR_ADDRESS, if set.
    num_processes: how many processes the job has; None: JAX_NUM_PROCESSES, if set.
    process_id: this process's index, in [0, num_processes); None: JAX_PROCESS_ID, if set.

  Raises:
    DistributedError: when only some of the three settings are given, `process_id` is out of range, JAX_NUM_PROCESSES
      or JAX_PROCESS_ID is not an integer, or a timeout variable is not a whole number of seconds ≥ 1; on a process
      other than 0, also when `coordinator_address` is not HOST:PORT or the coordinator does not answer in time.
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
    _join(coordinator_address, num_processes, process_id)
  elif (
    len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1
    or int(env.get("SLURM_NTASKS", "1") or 1) > 1
    or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
  ):
    _join()  # JAX detects the cluster's coordinator, size and rank itself
  else:
    return
  _log.info("process %d of %d joined the distributed job", jax.process_index(), jax.process_count())


def _join(address: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> None:
  """jax.distributed.initialize with our timeouts. JAX does not raise when joining times out: it aborts the process
  with "Terminating process because the JAX distributed service detected fatal errors ... DEADLINE_EXCEEDED ...
  RegisterTask", so a line before it says what was being waited for, and the processes other than 0 first wait for
  the coordinator's port themselves, to end in one line where it never opens (the usual mistake: process 0 not
  started, or another address)."""
  timeouts = dict(
    initialization_timeout=_seconds_env(INIT_TIMEOUT_ENV, INIT_TIMEOUT_S),
    heartbeat_timeout_seconds=_seconds_env(HEARTBEAT_TIMEOUT_ENV, HEARTBEAT_TIMEOUT_S),
  )
  if process_id:
    _wait_for_port(address, timeouts["initialization_timeout"])
  _log.info(
    "joining the multi-process job at %s; waiting up to %d s for every process (%s)",
    address or "the coordinator the cluster names",
    timeouts["initialization_timeout"],
    INIT_TIMEOUT_ENV,
  )
  jax.distributed.initialize(address, num_processes, process_id, **timeouts)


def _wait_for_port(address: str, timeout_s: int) -> None:
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise DistributedError(f"coordinator_address must be HOST:PORT, got {address!r}")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=max(1.0, min(5.0, timeout_s))):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise DistributedError(
          f"the coordinator at {address} did not answer within {timeout_s} s ({INIT_TIMEOUT_ENV}; {e}): start "
          f"process 0 with the same --coordinator_address, and check that its host and port are reachable from here"
        ) from None
      time.sleep(0.25)


def _seconds_env(name: str, default: int) -> int:
  value = os.environ.get(name, "")
  if not value:
    return default
  if not value.isdigit() or int(value) < 1:
    raise DistributedError(f"{name} must be a whole number of seconds ≥ 1, got {value!r}")
  return int(value)


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


def preemption_sync_available() -> bool:
  """Whether JAX's preemption service runs here (jax.distributed is initialized and jax_enable_preemption_service is
  on): then JAX's C++ SIGTERM handler is installed, and a Python handler must not replace it."""
  if not jax.distributed.is_initialized():
    return False
  try:
    multihost_utils.reached_preemption_sync_point(0)  # 0 is also the service's own starting count: nothing changes
  except RuntimeError:
    return False
  return True


def reached_preemption_sync_point(count: int) -> bool:
  """True on every process at the same `count` once any process got SIGTERM: the processes must stop together, since
  a save is collective. `count` goes up by one per call, from 1, in step with the other processes.

  JAX's preemption service catches SIGTERM in each process (a C++ handler) and tells the coordinator; a background
  thread in every process then reports its latest count and, after a barrier (3 minutes at most), all take the highest
  plus one. Counting from 1 per run, not by train step, keeps a SIGTERM that comes before the loop: the counts are
  then 0, and the first step stops. The call itself is local (a mutex and a comparison, no message
  (BENCHMARKS.md, "Figures behind the code")): it can run every step.
  """
  return multihost_utils.reached_preemption_sync_point(count)


AGREEMENTS = ("process 0", "all", "any")


def agree(flag: bool, rule: str) -> bool:
  """What every process concludes from its own `flag`: process 0's (`rule` "process 0": one process decides, the
  others follow its verdict), whether every process's is true ("all"), or any process's ("any"). One collective and a
  host sync; `flag` itself with one process. Every process must call it, at the same point."""
  if rule not in AGREEMENTS:
    raise ValueError(f"rule must be one of {AGREEMENTS}, got {rule!r}")
  if jax.process_count() == 1:
    return bool(flag)
  if rule == "process 0":
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))
  flags = np.asarray(multihost_utils.process_allgather(np.int32(flag)))
  return bool(flags.all() if rule == "all" else flags.any())


def gather_json(value: Any) -> list[Any]:
  """Every process's `value` (JSON-serialisable), in process order, on every process: two collectives (the lengths,
  then the bytes padded to the longest). `[value]` with one process. Every process must call it, at the same point."""
  if jax.process_count() == 1:
    return [value]
  raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
  lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(raw)))).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[: len(raw)] = raw
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
  return [json.loads(row[:n].tobytes()) for row, n in zip(rows, lengths)]
