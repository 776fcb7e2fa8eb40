"""Weight-only int8 for decoding: symmetric per-output-channel scales, the weight table, and weight byte counts.

An int8 model (``ModelConfig.quantize == "int8"``) stores every projection as int8 with a float32 scale per output
channel, a separate parameter ``<weight>_scale`` whose logical axes are the weight's output axes (so the sharding
rules place it with its weight). Products widen the int8 weight to the compute dtype inside the matmul and scale the
output (``llama.project``): the same math as scaling the weight's output channels, without a float copy of it. The
embedding table is quantized per row (per vocab entry), which serves both the lookup and the tied LM head. Norm
scales stay float. The point is memory (a quarter of float32 weights, half of bf16); on XLA:CPU the widening is not
fused into the product and int8 decodes slower than float (see ../shared/CPU_NOTES.md).

Float checkpoints are quantized at load time by `quantize_params`; training refuses an int8 config.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from llama_jax.core.errors import LlamaJaxError
from llama_jax.core.model_config import ModelConfig

# The one table of quantized weights, read by llama.py (which parameters get a scale, and its logical axes) and by
# `quantize_params`: parameter name → its contraction (input) axes. Axes count from the end, so they hold for a
# layer's own weight and for the stacked [L, ...] one alike. The scale has the remaining (output) axes.
INT8_CONTRACT_AXES: dict[str, tuple[int, ...]] = {
  "wq": (-3,),  # [D, N, H] → scale [N, H]
  "wk": (-3,),  # [D, K, H] → scale [K, H]
  "wv": (-3,),  # [D, K, H] → scale [K, H]
  "wo": (-3, -2),  # [N, H, D] → scale [D]
  "w_gate": (-2,),  # [D, F] → scale [F]
  "w_up": (-2,),  # [D, F] → scale [F]
  "w_down": (-2,),  # [F, D] → scale [D]
  "lm_head": (-2,),  # [D, V] → scale [V]
  "embed": (-1,),  # [V, D] → scale [V]: per row, for the lookup and the tied head (per vocab entry = output)
}
SCALE_SUFFIX = "_scale"
INT8_MAX = 127  # symmetric: -128 is never used, so negating a weight never overflows


class QuantizeError(LlamaJaxError, ValueError):
  """Parameters cannot be quantized as asked; the message names the value."""


def scale_name(weight_name: str) -> str:
  return weight_name + SCALE_SUFFIX


def scale_layout(
  weight_name: str, shape: tuple[int, ...], logical_axes: tuple[str | None, ...]
) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
  """(shape, logical axes) of a weight's scale: the weight's with the contraction axes removed (its output axes)."""
  contracted = {axis % len(shape) for axis in INT8_CONTRACT_AXES[weight_name]}
  kept = [i for i in range(len(shape)) if i not in contracted]
  return tuple(shape[i] for i in kept), tuple(logical_axes[i] for i in kept)


def quantize_int8(w: jax.Array, contract_axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """(int8 q, float32 scale) with w ≈ q · scale, the scale per output channel (w reduced over `contract_axes`).

  scale = max|w| / 127 over each channel's inputs, so |w − q·scale| ≤ scale / 2 (round to nearest) and the channel's
  largest weight maps to ±127. An all-zero channel gets scale 1: no division by zero, and its zeros stay zeros.
  """
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=contract_axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
  q = jnp.clip(jnp.round(w32 / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return q, jnp.squeeze(scale, contract_axes)


def dequantize(q: jax.Array, scale: jax.Array, contract_axes: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
  """q · scale in `dtype`, the scale broadcast back over the contraction axes (for tests and inspection: the model
  never materialises a dequantized weight)."""
  return q.astype(dtype) * jnp.expand_dims(scale, contract_axes).astype(dtype)


_quantize_leaf = jax.jit(quantize_int8, static_argnums=1)


@functools.lru_cache(maxsize=64)
def _quantize_leaf_into(contract_axes: tuple[int, ...], q_sharding: Any, scale_sharding: Any):
  return jax.jit(quantize_int8, static_argnums=1, out_shardings=(q_sharding, scale_sharding))


def quantize_params(
  params: Mapping[str, Any], cfg: ModelConfig, shardings: Any = None, *, donate: bool = False
) -> tuple[ModelConfig, dict]:
  """Weight-only int8 params of a float model, for decoding.

  Each weight `INT8_CONTRACT_AXES` names becomes int8 with a float32 scale per output channel, ``<weight>_scale``;
  the embedding is quantized per row. Either layout is taken: stacked, with `layers` leaves that have a leading L
  axis, or unstacked, `layers` {0: {...}, ...} as ``layer_layout.unstack_layers`` gives. The result has the
  structure of ``nnx.to_pure_dict`` of ``Llama(int8 cfg)`` in the same layout.

  Leaf by leaf, each under jit: sharded arrays stay sharded, and the peak is the float model plus one leaf's work.
  With `donate`, each float weight is deleted once its int8 copy exists, so the peak stays near the float model's
  size. Leaves that stay float, the norm scales, are passed through as they are, or placed into their `shardings`.

  Args:
    params: float pure-dict params of `cfg`.
    cfg: the float model's config.
    shardings: a tree of shardings matching the output, each leaf and scale placed into its own, or None to keep
      each array where the computation puts it.
    donate: delete each float weight once its int8 copy exists.

  Returns:
    A tuple: `cfg` with quantize="int8", and the int8 params.

  Raises:
    QuantizeError: `cfg` is quantized already: quantize_params takes float params.
  """
  if cfg.quantize != "none":
    raise QuantizeError(f"params are already quantized (quantize={cfg.quantize!r}); quantize_params takes float ones")

  def convert(tree: Mapping[Any, Any], out_shardings: Any) -> dict:
    out: dict[Any, Any] = {}
    for key, value in tree.items():
      if isinstance(value, Mapping):
        out[key] = convert(value, None if out_shardings is None else out_shardings[key])
        continue
      if key not in INT8_CONTRACT_AXES:
        out[key] = value if out_shardings is None else jax.device_put(value, out_shardings[key])
        continue
      axes = INT8_CONTRACT_AXES[key]
      if out_shardings is None:
        q, scale = _quantize_leaf(value, axes)
      else:
        q, scale = _quantize_leaf_into(axes, out_shardings[key], out_shardings[scale_name(key)])(value, axes)
      if donate and isinstance(value, jax.Array):
        value.delete()
      out[key], out[scale_name(key)] = q, scale
    return out

  return cfg.replace(quantize="int8"), convert(params, shardings)


def _nbytes(leaf: Any) -> int:
  return math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize


def weight_bytes(params: Any) -> int:
  """Total bytes of a params tree (arrays or ShapeDtypeStructs: a 7B model's figure from shapes alone)."""
  return sum(_nbytes(leaf) for leaf in jax.tree.leaves(params))
