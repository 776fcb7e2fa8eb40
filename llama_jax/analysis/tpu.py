"""Cloud TPU slices for the TPU compiler: their names, and the abstract devices of a slice (or of several), on any
host and with no TPU (libtpu, the ``tpu-aot`` extra)."""

from __future__ import annotations

import importlib.util
import os

from llama_jax.analysis.memory import PlanError

# Cloud TPU slice names → (topology for the TPU compiler, chip config, chips per host). v4 and v5p names count
# TensorCores (two per chip, "megacore"): v4-32 is 16 chips; v5e and v6e names count chips.
TOPOLOGIES = {
  "v4-8": ("v4:2x2x1", "megacore", (2, 2, 1)),
  "v4-16": ("v4:2x2x2", "megacore", (2, 2, 1)),
  "v4-32": ("v4:2x2x4", "megacore", (2, 2, 1)),
  "v4-64": ("v4:2x4x4", "megacore", (2, 2, 1)),
  "v4-128": ("v4:4x4x4", "megacore", (2, 2, 1)),
  "v5e-1": ("v5e:1x1", "default", (1, 1, 1)),
  "v5e-8": ("v5e:2x4", "default", (2, 4, 1)),
  "v5e-16": ("v5e:4x4", "default", (2, 2, 1)),
  "v5e-256": ("v5e:16x16", "default", (2, 2, 1)),
  "v5p-8": ("v5p:2x2x1", "megacore", (2, 2, 1)),
  "v5p-128": ("v5p:4x4x4", "megacore", (2, 2, 1)),
  "v5p-256": ("v5p:4x4x8", "megacore", (2, 2, 1)),
  "v6e-1": ("v6e:1x1", "default", (1, 1, 1)),
  "v6e-8": ("v6e:2x4", "default", (2, 4, 1)),
  "v6e-256": ("v6e:16x16", "default", (2, 2, 1)),
}
TPU_AOT_INSTALL = 'pip install -e ".[tpu-aot]"'


def tpu_devices(topology: str, slices: int = 1) -> list:
  """The abstract devices of a Cloud TPU slice (or `slices` of them), for the TPU compiler; no TPU needed.

  Compiling only: before libtpu loads, it sets the environment variables that let several processes load libtpu at
  once and that describe this host to libtpu, so that it does not look for a TPU VM's metadata; each only where unset.

  Args:
    topology: a Cloud TPU slice name of `TOPOLOGIES`, e.g. "v5p-128".
    slices: how many such slices, for a multi-slice job.

  Returns:
    The slices' devices, to compile against ahead of time.

  Raises:
    PlanError: when `topology` is unknown, `slices` is below 1, or the TPU compiler, libtpu, is not installed.
  """
  if topology not in TOPOLOGIES:
    raise PlanError(f"unknown --topology {topology!r}; known: {', '.join(TOPOLOGIES)}")
  if slices < 1:
    raise PlanError(f"--slices must be ≥ 1, got {slices}")
  if importlib.util.find_spec("libtpu") is None:
    raise PlanError(f"--topology needs the TPU compiler (libtpu), which is not installed: {TPU_AOT_INSTALL}")
  # Compiling only: several processes may load libtpu at once (it locks the TPU hardware otherwise), and this host
  # is described to libtpu so that it does not look for a TPU VM's metadata (and print five lines of warnings).
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  from jax.experimental import topologies  # after the environment above: it is read when libtpu loads

  name, chip_config, host_bounds = TOPOLOGIES[topology]
  return list(
    topologies.get_topology_desc(
      platform="tpu",
      topology_name=name,
      chip_config_name=chip_config,
      chips_per_host_bounds=host_bounds,
      num_slices=slices,
    ).devices
  )
