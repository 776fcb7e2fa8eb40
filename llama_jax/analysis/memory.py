"""What the memory plans share: their error, byte arithmetic over abstract sharded trees, and the model as a plan
compiles it for the target platform."""

from __future__ import annotations

import math
from typing import Any

import jax

from llama_jax.core.errors import LlamaJaxError
from llama_jax.model import attention as attention_lib

GIB = 2**30


class PlanError(LlamaJaxError, ValueError):
  """A plan cannot be made as asked (unknown topology, no TPU compiler installed); the message says what to do."""


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
