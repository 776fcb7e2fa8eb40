"""What the memory plans share: their error, the header every plan carries and prints first and last (where it was
compiled, its collectives and kernels, how long it took), byte arithmetic over abstract sharded trees, and the model
as a plan compiles it for the target platform."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from llama_jax.core.accelerators import HBM_GIB
from llama_jax.core.errors import LlamaJaxError
from llama_jax.model import attention as attention_lib

GIB = 2**30


class PlanError(LlamaJaxError, ValueError):
  """A plan cannot be made as asked (unknown topology, no TPU compiler installed); the message says what to do."""


@dataclasses.dataclass
class PlanHeader:
  """What every plan (the train step's, decoding's) states about the programs it compiled."""

  mesh: dict[str, int]
  devices: int
  device_kind: str  # e.g. "cpu" (simulated) or "TPU v4"
  compiler: str  # "XLA:CPU estimate" or "TPU compiler"
  n_params: int
  collectives: dict[str, dict[str, int]]  # kind → {"count", "bytes"} per device (hlo.summarize)
  kernels: dict[str, int]  # custom kernels in the program (splash ...) → executions
  compile_seconds: float
  seconds: float

  @staticmethod
  def fields(mesh, devices, n_params: int, program, compile_seconds: float, seconds: float) -> dict[str, Any]:
    """The header's fields of a plan whose programs compiled for `devices` on `mesh`.

    Args:
      mesh: the `jax.sharding.Mesh` the programs were compiled for.
      devices: its devices; the first one's platform names the compiler.
      n_params: the model's parameter count.
      program: the compiled program's `hlo.summarize` result (its collectives and kernels).
      compile_seconds: the time the compiles took.
      seconds: the time the whole plan took.

    Returns:
      The keyword arguments of `PlanHeader` (and so of the plans extending it).
    """
    platform = devices[0].platform
    return dict(
      mesh=dict(mesh.shape),
      devices=len(devices),
      device_kind=devices[0].device_kind,
      compiler="TPU compiler" if platform == "tpu" else f"XLA:{platform.upper()} estimate",
      n_params=n_params,
      collectives=program.to_dict()["collectives"],
      kernels=program.kernels,
      compile_seconds=compile_seconds,
      seconds=seconds,
    )

  def mesh_line(self) -> str:
    """The report's line naming the mesh, the devices and the compiler whose figures follow."""
    mesh = " × ".join(f"{axis} {size}" for axis, size in self.mesh.items())
    devices = f"{self.devices} devices ({self.device_kind})"
    return f"mesh      {mesh} = {devices}; memory and collectives from the {self.compiler}"

  def collective_lines(self, executed_only: bool = False) -> list[str]:
    """One line per kind of collective: executions and the size of the arrays they produce (with `executed_only`,
    kinds never executed are left out, and "none" stands for no collective at all)."""
    lines = [
      f"  {kind:<25} {c['count']:>6}   {format_bytes(c['bytes']):>11}"
      for kind, c in self.collectives.items()
      if c["count"] or not executed_only
    ]
    return lines or ["  none"]

  def kernel_lines(self, per: str) -> list[str]:
    """The custom kernels' line (none when the program has none); `per` names the unit ("step", "token")."""
    if not self.kernels:
      return []
    return [f"custom kernels per {per}: " + ", ".join(f"{name} × {n}" for name, n in self.kernels.items())]

  def timing_line(self, other_compilers: str) -> str:
    """How long planning took; an estimate (not the TPU compiler's) says that `other_compilers` differ."""
    caveat = "" if self.compiler == "TPU compiler" else f"; {other_compilers} differ in temporaries"
    return f"planned in {self.seconds:.1f} s, of which compile {self.compile_seconds:.1f} s ({self.compiler}{caveat})"


def report_unit(peak_bytes: int) -> tuple[str, int]:
  """("GiB", bytes per GiB) for a plan whose peak is a GiB or more, else ("MiB", bytes per MiB)."""
  return ("GiB", GIB) if peak_bytes >= GIB else ("MiB", 2**20)


def hbm_targets(hbm_gib: float | None) -> dict[str, float]:
  """The accelerators a plan is checked against (name → GiB of HBM), with `--hbm_gib` when it is given."""
  targets = dict(HBM_GIB)
  if hbm_gib:
    targets[f"--hbm_gib {hbm_gib:g}"] = hbm_gib
  return targets


def device_bytes(abstract_tree: Any) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest shard of each array)."""
  total = 0
  for leaf in jax.tree.leaves(abstract_tree):
    shard_shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shard_shape) * leaf.dtype.itemsize
  return total


def model_config_for_plan(model_cfg, platform: str, seq_len: int):
  """The model as it will be compiled for `platform` (the target devices'): on CPU, accelerator-only attention
  kernels are modelled by "chunked" (the XLA kernel where the sequence is too short to chunk)."""
  if platform == "cpu" and model_cfg.attention in ("auto", "splash", "cudnn"):
    return model_cfg.replace(attention="chunked" if attention_lib.chunk_size(seq_len) else "xla")
  return model_cfg


def format_bytes(n: float) -> str:
  for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"
