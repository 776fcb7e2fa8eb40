"""The decoding cache: explicit pytrees passed into and returned from the model's `decode` (never module state).
Axis letters: llama.py's legend."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from llama_jax.core.model_config import ModelConfig

Array = jax.Array

# Position stored in empty cache slots: larger than any query position, so the causal test hides them.
EMPTY_POSITION = 2**30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
  """One layer's view of the KV cache: either the stacked k, v [L, B, K, S, H] and this layer's index in them, or
  (layer None) the layer's own k, v [B, K, S, H]; slot positions [B, S]; the next slot to write."""

  k: Array
  v: Array
  layer: Array | int | None
  positions: Array
  index: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """The decoding cache, an explicit pytree passed into and returned from `Llama.decode` (never module state).

  Two layouts, one per layout of the model: the stacked model's layer scan indexes one buffer [L, B, K, S, H], and
  ``Llama(stacked_layers=False)`` takes a tuple of L buffers [B, K, S, H] (`per_layer`), so that each layer reads and
  updates its own buffers in place, with no slice copied per step. S is the slot axis; [K, S, H] is the layout the
  attention products read without a transpose. `empty` makes a cache of either layout.

  Attributes:
    k: the rotated keys, [L, B, K, S, H] for the stacked model, or a tuple of L buffers [B, K, S, H] (`per_layer`).
    v: the values, in the layout of `k`.
    positions: [B, S] the position of the token in each slot; `EMPTY_POSITION` where the slot is empty or holds
      padding, larger than any query position, so the causal test hides it.
    index: int32 scalar, the next slot to write.
  """

  k: Array | tuple[Array, ...]
  v: Array | tuple[Array, ...]
  positions: Array
  index: Array

  @classmethod
  def empty(cls, cfg: ModelConfig, batch: int, length: int, per_layer: bool = False) -> KVCache:
    """A cache with every slot empty, in the layout of the stacked model or, with `per_layer`, of the unstacked one.

    Args:
      cfg: the model's config: its layers, kv heads, head dim and compute dtype give the buffers' shapes and dtype.
      batch: the rows B.
      length: the slots S of each row, the most tokens a row can hold.
      per_layer: a tuple of L buffers [B, K, S, H], for ``Llama(stacked_layers=False)``, instead of one stacked
        buffer [L, B, K, S, H].

    Returns:
      The cache: k and v zero, every position `EMPTY_POSITION`, index 0.
    """
    shape = (batch, cfg.n_kv_heads, length, cfg.head_dim)
    if per_layer:
      k = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layers))
      v = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layers))
    else:
      k = jnp.zeros((cfg.n_layers, *shape), cfg.dtype)
      v = jnp.zeros((cfg.n_layers, *shape), cfg.dtype)
    return cls(k=k, v=v, positions=jnp.full((batch, length), EMPTY_POSITION, jnp.int32), index=jnp.zeros((), jnp.int32))
