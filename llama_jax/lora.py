"""LoRA: low-rank adapters on the model's projections, trained while the base model stays frozen.

A targeted projection W [in..., out...] (``wq`` [D, N, H], ``wo`` [N, H, D], ``w_down`` [F, D] ...) gets
A [in..., R] and B [R, out...] (R the rank) and computes ``x·W + (alpha / R)·(x·A)·B`` in ``model.project``: the
product through the rank never forms a [in, out] matrix, in the forward or in the gradients. A starts as peft does
(uniform in ±1/sqrt(in), its kaiming-uniform with a=√5) and B at zeros, so an untrained adapter changes nothing. A
and B follow the sharding of W's input and output axes; the rank axis is never sharded. Adapters are float32 whatever
the base's storage dtype: their Adam moments are tiny, and bf16 adapters would round away small updates.

In a params tree the adapters are leaves ``<weight>_lora_a`` / ``<weight>_lora_b`` beside their weight
(``layers/attention/wq_lora_a``); `split` and `combine` separate and join them, `merge` folds them into the weights
(W + scale·A·B), which is what sampling, evaluation, serving and conversion load: decoding pays nothing for them.

A LoRA training workdir holds only the adapters (its checkpoints' "params") and ``lora.json``: the rank, alpha and
targets, and the base directory with the step and the digest of the checkpoint it adapts. ``checkpoint.load_params``
reads such a workdir as the merged model; a changed base is refused instead of silently adapted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from llama_jax.config import LORA_TARGETS, LoraConfig
from llama_jax.errors import LlamaJaxError

LORA_FILE = "lora.json"
# A full (not LoRA) DPO workdir's record of its reference model, the same fields less the adapter settings.
REFERENCE_FILE = "reference.json"
A_SUFFIX, B_SUFFIX = "_lora_a", "_lora_b"

# Where each target sits in the params tree, its number of input axes, and its HF / peft module name.
TARGET_MODULES = {
  "wq": ("attention", 1, "self_attn.q_proj"),
  "wk": ("attention", 1, "self_attn.k_proj"),
  "wv": ("attention", 1, "self_attn.v_proj"),
  "wo": ("attention", 2, "self_attn.o_proj"),
  "w_gate": ("mlp", 1, "mlp.gate_proj"),
  "w_up": ("mlp", 1, "mlp.up_proj"),
  "w_down": ("mlp", 1, "mlp.down_proj"),
}
assert tuple(TARGET_MODULES) == LORA_TARGETS


class LoraError(LlamaJaxError, ValueError):
  """A LoRA workdir or adapter does not fit its base model; the message names the file and the difference."""


def adapter_pair(
  rngs: nnx.Rngs, name: str, shape: tuple[int, ...], logical_axes: tuple, lora: LoraConfig | None
) -> tuple[nnx.Param | None, nnx.Param | None]:
  """(A, B) for weight `name` of `shape` when `lora` targets it, else (None, None)."""
  if lora is None or not lora.rank or name not in lora.targets:
    return None, None
  n_in = TARGET_MODULES[name][1]
  in_shape, out_shape = shape[:n_in], shape[n_in:]
  bound = 1.0 / math.sqrt(math.prod(in_shape))
  a = jax.random.uniform(rngs.params(), (*in_shape, lora.rank), jnp.float32, -bound, bound)
  b = jnp.zeros((lora.rank, *out_shape), jnp.float32)
  return (
    nnx.Param(a, out_sharding=(*logical_axes[:n_in], None), eager_sharding=False),
    nnx.Param(b, out_sharding=(None, *logical_axes[n_in:]), eager_sharding=False),
  )


def factors(module: nnx.Module, name: str) -> tuple[jax.Array, jax.Array, float] | None:
  """(A, B, scale) of weight `name` of `module` for ``model.project``, or None when it has no adapter."""
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


def delta(a: Any, b: Any, scale: float, n_in: int, xp=jnp) -> Any:
  """scale·A·B as a weight of the base's shape: A [lead..., in..., R], B [lead..., R, out...] with `n_in` input
  axes (lead: the stacked layers axis, or none) → [lead..., in..., out...], as one batched matrix product."""
  rank, lead = a.shape[-1], a.shape[: a.ndim - n_in - 1]
  in_shape, out_shape = a.shape[len(lead) : -1], b.shape[len(lead) + 1 :]
  product = xp.matmul(a.reshape(*lead, -1, rank), b.reshape(*lead, rank, -1))
  return scale * product.reshape(*lead, *in_shape, *out_shape)


def merge(base: Mapping, adapters: Mapping, scale: float, xp=jnp) -> dict:
  """The base params with every adapter folded in: W + scale·A·B, in W's dtype (the tree has no adapter leaves)."""
  out = {}
  for key, value in base.items():
    sub = adapters.get(key, {})
    out[key] = merge(value, sub, scale, xp) if isinstance(value, Mapping) else value
    if not isinstance(value, Mapping) and key + A_SUFFIX in adapters:
      change = delta(adapters[key + A_SUFFIX], adapters[key + B_SUFFIX], scale, TARGET_MODULES[key][1], xp)
      out[key] = (value.astype(xp.float32) + change).astype(value.dtype)
  return out


def num_adapter_params(cfg, lora: LoraConfig) -> int:
  """Trainable parameters of `lora` on a model of `cfg`: rank·(in + out) per targeted weight and layer."""
  shapes = _weight_shapes(cfg)
  return cfg.n_layers * sum(
    lora.rank * (math.prod(shapes[t][: TARGET_MODULES[t][1]]) + math.prod(shapes[t][TARGET_MODULES[t][1] :]))
    for t in lora.targets
  )


# ---------------------------------------------------------------------------------------------------------------------
# The workdir's record of its base


def base_record(lora: LoraConfig, base_dir: str, base_step: int) -> dict[str, Any]:
  """What lora.json says: the adapter settings and the base checkpoint step they adapt (with its digest, so a
  base retrained or replaced under the same path is noticed)."""
  return dict(rank=lora.rank, alpha=lora.alpha, targets=list(lora.targets), **frozen_record(base_dir, base_step))


def frozen_record(base_dir: str, base_step: int) -> dict[str, Any]:
  """The checkpoint step a run keeps frozen (a LoRA base, a DPO reference) and the digest of its files."""
  from llama_jax import checkpoint

  return dict(
    base=os.path.abspath(base_dir) if not checkpoint.is_remote(base_dir) else base_dir,
    base_step=base_step,
    base_digest=_step_digest(base_dir, base_step),
  )


def _step_digest(directory: str, step: int) -> str | None:
  from llama_jax import checkpoint

  digests = epath.Path(checkpoint._steps_path(directory)) / str(step) / checkpoint.DIGESTS_FILE
  if not digests.exists():
    return None
  files = json.loads(digests.read_text())["files"]  # the sizes and sha256 of the step's files, however laid out
  return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_record(workdir: str, record: dict[str, Any], name: str = LORA_FILE) -> None:
  path = epath.Path(workdir) / name
  tmp = epath.Path(workdir) / (name + ".tmp")
  tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
  tmp.replace(path)


def read_record(directory: str, name: str = LORA_FILE) -> dict[str, Any] | None:
  """lora.json of a LoRA workdir (or another record `name`), or None where there is none."""
  path = epath.Path(directory) / name
  if not path.is_file():
    return None
  return json.loads(path.read_text())


def check_base(directory: str, record: Mapping[str, Any]) -> None:
  """Refuses a base (or DPO reference) whose checkpoint step changed since the run started from it."""
  now = _step_digest(record["base"], record["base_step"])
  if record.get("base_digest") and now != record["base_digest"]:
    what = (
      f"{os.path.join(directory, LORA_FILE)} adapts"
      if "rank" in record
      else (f"{os.path.join(directory, REFERENCE_FILE)} takes its DPO reference from")
    )
    raise LoraError(
      f"{what} step {record['base_step']} of {record['base']!r}, whose files have changed since (digest "
      f"{str(now)[:12]} ≠ {record['base_digest'][:12]}); restore that checkpoint or start a new run"
    )


def same_dir(recorded: str, given: str) -> bool:
  """Whether two spellings of a base directory are the same directory (remote paths compared as written)."""
  from llama_jax import checkpoint

  if checkpoint.is_remote(recorded) or checkpoint.is_remote(given):
    return recorded.rstrip("/") == given.rstrip("/")
  return os.path.abspath(recorded) == os.path.abspath(given)


def config_of(record: Mapping[str, Any]) -> LoraConfig:
  return LoraConfig(rank=record["rank"], alpha=record["alpha"], targets=tuple(record["targets"]))


# ---------------------------------------------------------------------------------------------------------------------
# HF peft adapters


def peft_tensors(adapters: Mapping, cfg) -> dict[str, np.ndarray]:
  """peft's ``adapter_model.safetensors`` tensors of stacked adapters: lora_A [R, in], lora_B [out, R] per layer
  (torch Linear layout), named as peft saves them for LlamaForCausalLM."""
  out = {}
  for name, (group, _, module) in TARGET_MODULES.items():
    node = adapters.get("layers", {}).get(group, {})
    if name + A_SUFFIX not in node:
      continue
    a, b = np.asarray(node[name + A_SUFFIX], np.float32), np.asarray(node[name + B_SUFFIX], np.float32)
    for i in range(cfg.n_layers):
      rank = a.shape[-1]
      prefix = f"base_model.model.model.layers.{i}.{module}"
      out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, rank).T)
      out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(rank, -1).T)
  return out


def adapters_from_peft(tensors: Mapping[str, np.ndarray], cfg, lora: LoraConfig) -> dict:
  """Stacked adapters (this package's layout) from peft's tensors: the inverse of `peft_tensors`."""
  shapes = _weight_shapes(cfg)
  out: dict[str, dict[str, dict[str, np.ndarray]]] = {"layers": {}}
  for name in lora.targets:
    group, n_in, module = TARGET_MODULES[name]
    in_shape, out_shape = shapes[name][:n_in], shapes[name][n_in:]
    a = np.stack([tensors[f"base_model.model.model.layers.{i}.{module}.lora_A.weight"].T for i in range(cfg.n_layers)])
    b = np.stack([tensors[f"base_model.model.model.layers.{i}.{module}.lora_B.weight"].T for i in range(cfg.n_layers)])
    node = out["layers"].setdefault(group, {})
    node[name + A_SUFFIX] = a.reshape(cfg.n_layers, *in_shape, lora.rank).astype(np.float32)
    node[name + B_SUFFIX] = b.reshape(cfg.n_layers, lora.rank, *out_shape).astype(np.float32)
  return out


def _weight_shapes(cfg) -> dict[str, tuple[int, ...]]:
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


def peft_config(lora: LoraConfig, base_model: str) -> dict[str, Any]:
  """peft's adapter_config.json for these adapters: plain LoRA (no dropout, no bias, no rsLoRA)."""
  return dict(
    peft_type="LORA",
    task_type="CAUSAL_LM",
    base_model_name_or_path=base_model,
    r=lora.rank,
    lora_alpha=lora.alpha,
    lora_dropout=0.0,
    target_modules=sorted(TARGET_MODULES[t][2].split(".")[-1] for t in lora.targets),
    bias="none",
    fan_in_fan_out=False,
    use_rslora=False,
    use_dora=False,
    init_lora_weights=True,
    inference_mode=True,
    modules_to_save=None,
    layers_to_transform=None,
    layers_pattern=None,
    rank_pattern={},
    alpha_pattern={},
  )
