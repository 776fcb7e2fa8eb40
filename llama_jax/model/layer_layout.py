"""The stacked and unstacked layouts of a model's `layers` params as pure dicts, and the maps between them.

Stacked (training): every leaf has a leading axis over the layers, or, when only every `moe.every`-th block is a
mixture of experts, over groups of `every` blocks ("blocks"/<j>/... inside: block i is group i // every's block
i % every). Unstacked (decoding): {0: block 0's params, 1: ...}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llama_jax.core.model_config import ModelConfig


def blocks_per_unit(cfg: ModelConfig) -> int:
  """Blocks per step of the stacked model's scan: 1, or `moe.every` when only every `every`-th block is MoE (the
  steps of a scan must be alike, so it scans groups)."""
  return cfg.moe.every if cfg.moe.enabled and cfg.moe.every > 1 else 1


def unstack_layers(params: dict) -> dict:
  """The pure-dict params of a stacked Llama, rearranged for ``llama.Llama(cfg, stacked_layers=False)``.

  The stacked layout, which training uses, gives every `layers` leaf a leading axis over the layers, or over groups
  of `moe.every` blocks when only every `moe.every`-th block is a mixture of experts. The unstacked layout, which
  decoding uses, holds one dict per layer: {0: block 0's params, 1: ...}, each a slice of the stacked leaves, in
  order. The other entries of `params` are passed through as they are.

  Args:
    params: pure-dict params of a stacked Llama, such as ``nnx.to_pure_dict`` of its state.

  Returns:
    A new dict: `params` with `layers` replaced by one dict per layer.
  """
  return dict(params, layers=dict(enumerate(layer_params(params["layers"]))))


def layer_params(stacked: dict) -> list[dict]:
  """The stacked `layers` params (pure dict) → one dict per block, in order: slices of the leading axis, or of
  each group's blocks (``llama.BlockGroup``: block i is group i // every's block i % every)."""
  n_units = jax.tree.leaves(stacked)[0].shape[0]
  units = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n_units)]
  if "blocks" not in stacked:
    return units
  every = len(stacked["blocks"])
  return [unit["blocks"][j] for unit in units for j in range(every)]


def stacked_slices(cfg: ModelConfig, path: tuple) -> tuple[tuple, list[int]]:
  """A stacked `layers` leaf's path below "layers" → (its path in one block, the block index of each slice of its
  leading axis): (path, 0..L-1), or for a BlockGroup's ("blocks", j, ...) (..., [j, every + j, 2·every + j, ...])."""
  every = blocks_per_unit(cfg)
  if every == 1:
    return path, list(range(cfg.n_layers))
  j = int(path[1])
  return path[2:], [g * every + j for g in range(cfg.n_layers // every)]


def stack_layer_params(per_layer: list[dict], cfg: ModelConfig) -> dict:
  """One dict per block (in order) → the stacked `layers` params of `cfg`'s layout (``layer_params``' inverse)."""
  every = blocks_per_unit(cfg)
  if every == 1:
    return jax.tree.map(lambda *rows: jnp.stack(rows), *per_layer)
  return {"blocks": {j: jax.tree.map(lambda *rows: jnp.stack(rows), *per_layer[j::every]) for j in range(every)}}
