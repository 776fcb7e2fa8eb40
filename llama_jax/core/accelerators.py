"""The accelerators llama_jax plans and measures against, in one table: what JAX calls each device, its dense bf16
peak (for MFU in the training log) and its memory per chip or GPU (for the memory plans' "fits" verdicts)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str  # as the plans print it
  device_kinds: tuple[str, ...]  # prefixes of jax's `device.device_kind` for it
  peak_flops: float  # dense bf16 FLOP/s per chip or GPU
  hbm_gib: float | None  # memory per chip or GPU; None: not a target of the memory plans


ACCELERATORS = (
  Accelerator("TPU v4", ("TPU v4",), 275e12, 32),
  Accelerator("TPU v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 16),
  Accelerator("TPU v5p", ("TPU v5p",), 459e12, 95),
  Accelerator("TPU v6e", ("TPU v6 lite", "TPU v6e"), 918e12, 32),
  Accelerator("H100", ("NVIDIA H100",), 989e12, 80),
  Accelerator("H200", ("NVIDIA H200",), 989e12, 141),
  Accelerator("A100", ("NVIDIA A100",), 312e12, None),
)
"""Every accelerator the training log's MFU and the memory plans know; `by_device_kind` returns the first entry whose
`device_kinds` prefixes a device's kind."""

# The memory plans' targets: name → GiB per device.
HBM_GIB = {a.name: a.hbm_gib for a in ACCELERATORS if a.hbm_gib is not None}


def by_device_kind(device_kind: str) -> Accelerator | None:
  """The table's entry for a device (`jax.devices()[0].device_kind`, e.g. "TPU v5 lite", "NVIDIA H100 80GB HBM3")."""
  for accelerator in ACCELERATORS:
    if device_kind.startswith(accelerator.device_kinds):
      return accelerator
  return None
