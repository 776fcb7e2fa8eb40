"""LoRA: low-rank adapters on the model's projections, trained while the base model stays frozen.

A targeted projection W [in..., out...] (``wq`` [D, N, H], ``wo`` [N, H, D], ``w_down`` [F, D] ...) gets
A [in..., rank] and B [rank, out...] and computes ``x·W + (alpha / rank)·(x·A)·B`` in ``llama.project``: the
product through the rank never forms a [in, out] matrix, in the forward or in the gradients. A starts as peft does
(uniform in ±1/sqrt(in), its kaiming-uniform with a=√5) and B at zeros, so an untrained adapter changes nothing. A
and B follow the sharding of W's input and output axes; the rank axis is never sharded. Adapters are float32 whatever
the base's storage dtype: their Adam moments are tiny, and bf16 adapters would round away small updates.

In a params tree the adapters are leaves ``<weight>_lora_a`` / ``<weight>_lora_b`` beside their weight
(``layers/attention/wq_lora_a``); `split` and `combine` separate and join them, `merged_weight` folds one weight's
adapter into it (W + scale·A·B), which is what sampling, evaluation, serving and conversion load: decoding pays
nothing for them. It is the one merge: the checkpoint reader applies it leaf by leaf to whatever reads a LoRA workdir
(``checkpoint.params``), so every reader sees the same merged weights, bit for bit.

What a LoRA workdir records of its base is ``checkpoint/records.py``'s; peft's names and files are
``interop/peft.py``'s.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from llama_jax.core.model_config import LORA_TARGETS
from llama_jax.core.run_config import LoraConfig

A_SUFFIX, B_SUFFIX = "_lora_a", "_lora_b"

# Where each target sits in the params tree (the sub-module under "layers"), and its number of input axes.
TARGETS = {
  "wq": ("attention", 1),
  "wk": ("attention", 1),
  "wv": ("attention", 1),
  "wo": ("attention", 2),
  "w_gate": ("mlp", 1),
  "w_up": ("mlp", 1),
  "w_down": ("mlp", 1),
}
assert tuple(TARGETS) == LORA_TARGETS


def adapter_pair(
  rngs: nnx.Rngs, name: str, shape: tuple[int, ...], logical_axes: tuple, lora: LoraConfig | None
) -> tuple[nnx.Param | None, nnx.Param | None]:
  """(A, B) for weight `name` of `shape` when `lora` targets it, else (None, None)."""
  if lora is None or not lora.rank or name not in lora.targets:
    return None, None
  n_in = TARGETS[name][1]
  in_shape, out_shape = shape[:n_in], shape[n_in:]
  bound = 1.0 / math.sqrt(math.prod(in_shape))
  a = jax.random.uniform(rngs.params(), (*in_shape, lora.rank), jnp.float32, -bound, bound)
  b = jnp.zeros((lora.rank, *out_shape), jnp.float32)
  return (
    nnx.Param(a, out_sharding=(*logical_axes[:n_in], None), eager_sharding=False),
    nnx.Param(b, out_sharding=(None, *logical_axes[n_in:]), eager_sharding=False),
  )


def factors(module: nnx.Module, name: str) -> tuple[jax.Array, jax.Array, float] | None:
  """(A, B, scale) of weight `name` of `module` for ``llama.project``, or None when it has no adapter."""
  a = getattr(module, name + A_SUFFIX, None)
  if a is None:
    return None
  return a[...], getattr(module, name + B_SUFFIX)[...], module.lora_scale


def _is_adapter(key: Any) -> bool:
  return str(key).endswith((A_SUFFIX, B_SUFFIX))


def _partition(tree: Mapping, keep) -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      sub = _partition(value, keep)
      if sub:
        out[key] = sub
    elif keep(key):
      out[key] = value
  return out


def split(params: Mapping) -> tuple[dict, dict]:
  """(base, adapters) of a params tree of a model with adapters: two trees of the same nesting."""
  return _partition(params, lambda k: not _is_adapter(k)), _partition(params, _is_adapter)


def combine(base: Mapping, adapters: Mapping) -> dict:
  """One params tree from `split`'s two parts (the model with adapters reads it)."""
  out = dict(base)
  for key, value in adapters.items():
    out[key] = combine(base.get(key, {}), value) if isinstance(value, Mapping) else value
  return out


def with_frozen(params: Any, frozen: Any) -> Any:
  """The params a model with adapters reads: `params` alone, or the trained adapters joined to the frozen base."""
  return params if frozen is None else combine(frozen, params)


def delta(a: Any, b: Any, scale: float, n_in: int) -> jax.Array:
  """scale·A·B as a weight of the base's shape: A [lead..., in..., rank], B [lead..., rank, out...] with `n_in` input
  axes (lead: the stacked layers axis, or none) → [lead..., in..., out...], as one batched matrix product."""
  rank, lead = a.shape[-1], a.shape[: a.ndim - n_in - 1]
  in_shape, out_shape = a.shape[len(lead) : -1], b.shape[len(lead) + 1 :]
  product = jnp.matmul(a.reshape(*lead, -1, rank), b.reshape(*lead, rank, -1))
  return scale * product.reshape(*lead, *in_shape, *out_shape)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _merged(weight: jax.Array, a: jax.Array, b: jax.Array, scale: float, n_in: int) -> jax.Array:
  return (weight.astype(jnp.float32) + delta(a, b, scale, n_in)).astype(weight.dtype)


def merged_weight(name: str, weight: Any, a: Any, b: Any, scale: float) -> jax.Array:
  """W + scale·A·B in float32, returned in W's dtype, for the weight `name` (a LORA_TARGETS entry), stacked or one
  layer's. The one merge of the package: one compiled program per shape, on W's devices (its sharding kept), so two
  readers of the same weights get the same bits."""
  return _merged(weight, a, b, scale, TARGETS[name][1])


def merge(base: Mapping, adapters: Mapping, scale: float) -> dict:
  """The base params with every adapter folded in by `merged_weight` (the tree has no adapter leaves)."""
  out = {}
  for key, value in base.items():
    if isinstance(value, Mapping):
      out[key] = merge(value, adapters.get(key, {}), scale)
    elif key + A_SUFFIX in adapters:
      out[key] = merged_weight(key, value, adapters[key + A_SUFFIX], adapters[key + B_SUFFIX], scale)
    else:
      out[key] = value
  return out


def num_adapter_params(cfg, lora: LoraConfig) -> int:
  """Trainable parameters of `lora` on a model of `cfg`: rank·(in + out) per targeted weight and layer."""
  shapes = weight_shapes(cfg)
  return cfg.n_layers * sum(
    lora.rank * (math.prod(shapes[t][: TARGETS[t][1]]) + math.prod(shapes[t][TARGETS[t][1] :])) for t in lora.targets
  )


def weight_shapes(cfg) -> dict[str, tuple[int, ...]]:
  d, f, h = cfg.dim, cfg.hidden_dim, cfg.head_dim
  return {
    "wq": (d, cfg.n_heads, h),
    "wk": (d, cfg.n_kv_heads, h),
    "wv": (d, cfg.n_kv_heads, h),
    "wo": (cfg.n_heads, h, d),
    "w_gate": (d, f),
    "w_up": (d, f),
    "w_down": (f, d),
  }
