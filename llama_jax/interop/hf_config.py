"""HF transformers' Llama and Mixtral ``config.json`` ↔ ``ModelConfig``: every key checked by name and kind, features
llama_jax lacks refused by name, and the config transformers needs for an export."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llama_jax.core.checks import ConfigError
from llama_jax.core.model_config import ModelConfig
from llama_jax.interop.output import ConvertError

DTYPES_FROM_HF = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def check_hf_expressible(cfg: ModelConfig, where: str = "the model") -> None:
  """Refuses a norm variant (config.NORMS, NORM_POSITIONS) for HF conversion: transformers' LlamaForCausalLM is
  RMSNorm before each sub-layer plus a final norm, and has no place for a layernorm, a post-norm or no norm."""
  if (cfg.norm, cfg.norm_position) != ("rmsnorm", "pre"):
    raise ConvertError(
      f"{where} has norm={cfg.norm!r}, norm_position={cfg.norm_position!r}; HF Llama has only norm='rmsnorm', "
      f"norm_position='pre', so it cannot be converted"
    )
  if cfg.moe.enabled and (not cfg.moe.normalize_top_k or cfg.tie_embeddings):
    raise ConvertError(
      f"{where} is a mixture of experts with normalize_top_k={cfg.moe.normalize_top_k}, "
      f"tie_embeddings={cfg.tie_embeddings}; HF Mixtral renormalises the top-k weights and has its own LM head"
    )
  if cfg.moe.enabled and cfg.moe.every > 1:
    raise ConvertError(
      f"{where} has a mixture of experts in every {cfg.moe.every}th block (model.moe.every={cfg.moe.every}); HF "
      "Mixtral has one in every block, so it cannot be converted"
    )


# model_type of a config.json → what it is read as; Mixtral is LLaMA with a mixture of experts in every block.
MODEL_TYPES = ("llama", "mixtral")


# The keys of a transformers Llama config.json that have no default (shapes follow from them).
_HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_REQUIRED = object()
_JSON_KINDS = {  # what a config.json value must be → test
  "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
  "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
  "true or false": lambda v: isinstance(v, bool),
  "a string": lambda v: isinstance(v, str),
  "an object": lambda v: isinstance(v, dict),
}


def hf_value(hf: Mapping[str, Any], key: str, kind: str, where: str, default: Any = _REQUIRED, why: str = "") -> Any:
  """hf[key] checked to be `kind` (`default` when absent, or null where a default exists): a string where a number
  belongs would otherwise fail later with a traceback, and the string "false" would tie the embeddings."""
  if key not in hf or (hf[key] is None and default is not _REQUIRED):
    if default is _REQUIRED:
      raise ConvertError(f"{where} has no {key!r}" + (f" ({why})" if why else ""))
    return default
  value = hf[key]
  if not _JSON_KINDS[kind](value):
    shown = json.dumps(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ConvertError(f"{where}: {key} must be {kind}, got {shown}")
  return value


def model_config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> ModelConfig:
  """The ModelConfig of a transformers Llama or Mixtral ``config.json``.

  Features llama_jax lacks are refused by name, and so is a missing or mistyped key; optional keys take a default
  when absent. RoPE theta and scaling are read from ``rope_parameters`` too, where transformers 5 keeps them. Long
  because it reads the config key by key, each checked where it is read: a table would hide the checks that differ
  per key.

  Args:
    hf: the parsed config.json.
    where: what to call it in messages, e.g. its path.

  Returns:
    The model config, its dtype and param_dtype the config's dtype, float32 when it names none.

  Raises:
    ConvertError: a missing required key, a value of the wrong kind, a model type other than llama or mixtral, a
      feature llama_jax does not support (biases, an activation other than silu, a sliding window, router jitter, a
      head_dim other than hidden_size / num_attention_heads), or values that do not describe a valid model.
  """
  model_type = hf_value(hf, "model_type", "a string", where, "llama")
  if model_type not in MODEL_TYPES:
    raise ConvertError(f"{where} has model_type={model_type!r}; supported: {', '.join(MODEL_TYPES)}")
  mixtral = model_type == "mixtral"
  for key in ("attention_bias", "mlp_bias"):
    if hf_value(hf, key, "true or false", where, False):
      raise ConvertError(f"{where} sets {key}=true; LLaMA 2 has no biases and llama_jax does not support them")
  hidden_act = hf_value(hf, "hidden_act", "a string", where, "silu")
  if hidden_act != "silu":
    raise ConvertError(f"{where} hidden_act={hidden_act!r}; only 'silu' (SwiGLU) is supported")
  required = f"required: {', '.join(_HF_REQUIRED)}"
  vocab_size, dim, n_layers, n_heads, ffn_hidden_dim = (
    hf_value(hf, key, "an integer", where, why=required) for key in _HF_REQUIRED
  )
  head_dim = hf_value(hf, "head_dim", "an integer", where, None)
  dtype = hf_value(hf, "dtype", "a string", where, None) or hf_value(hf, "torch_dtype", "a string", where, None)
  dtype = dtype or "float32"
  if dtype not in DTYPES_FROM_HF:
    raise ConvertError(f"{where} dtype {dtype!r} is not one of {sorted(DTYPES_FROM_HF)}")
  rope_where = f"{where} rope_scaling"
  rope = hf_value(hf, "rope_scaling", "an object", where, {})
  # transformers ≥ 5 keeps theta and scaling together in rope_parameters.
  rope_parameters = hf_value(hf, "rope_parameters", "an object", where, {})
  theta = hf_value(rope_parameters, "rope_theta", "a number", f"{where} rope_parameters", None)
  theta = hf_value(hf, "rope_theta", "a number", where, 1e6 if mixtral else 10000.0) if theta is None else theta
  if hf_value(rope_parameters, "rope_type", "a string", f"{where} rope_parameters", "default") != "default":
    rope, rope_where = rope_parameters, f"{where} rope_parameters"
  kind = "none"
  if rope:
    kind = hf_value(rope, "rope_type", "a string", rope_where, None) or hf_value(
      rope, "type", "a string", rope_where, "none"
    )
  kind = "none" if kind == "default" else kind
  fields = dict(
    vocab_size=vocab_size,
    dim=dim,
    n_layers=n_layers,
    n_heads=n_heads,
    n_kv_heads=hf_value(hf, "num_key_value_heads", "an integer", where, None),  # None: n_heads
    ffn_hidden_dim=ffn_hidden_dim,
    norm_eps=float(hf_value(hf, "rms_norm_eps", "a number", where, 1e-6)),
    rope_theta=float(theta),
    max_seq_len=hf_value(hf, "max_position_embeddings", "an integer", where, 4096),
    tie_embeddings=hf_value(hf, "tie_word_embeddings", "true or false", where, False),
    dtype=DTYPES_FROM_HF[dtype],
    param_dtype=DTYPES_FROM_HF[dtype],
    rope_scaling=kind,
  )

  if mixtral:
    fields["moe"] = _moe_from_hf(hf, where)

  def rope_number(key: str) -> Any:
    return hf_value(rope, key, "a number", rope_where, why=f"required for rope_type {kind!r}")

  if kind in ("linear", "llama3"):
    fields["rope_scaling_factor"] = float(rope_number("factor"))
  if kind == "llama3":
    fields.update(
      rope_low_freq_factor=float(rope_number("low_freq_factor")),
      rope_high_freq_factor=float(rope_number("high_freq_factor")),
      rope_original_max_len=hf_value(
        rope, "original_max_position_embeddings", "an integer", rope_where, why="required for rope_type 'llama3'"
      ),
    )
  try:
    cfg = ModelConfig(**fields)
  except ConfigError as e:
    raise ConvertError(f"{where} does not describe a valid model: {e}") from e
  if head_dim not in (None, cfg.head_dim):
    raise ConvertError(
      f"{where} head_dim={head_dim} differs from hidden_size/num_attention_heads={cfg.head_dim}; not supported"
    )
  return cfg


def _moe_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
  """model.moe of a Mixtral config.json (transformers' MixtralConfig defaults where a key is absent); the features
  of Mixtral's config that llama_jax does not run are refused by name."""
  window = hf_value(hf, "sliding_window", "an integer", where, None)
  if window is not None:
    raise ConvertError(f"{where} sets sliding_window={window}; llama_jax attends over the whole context (use null)")
  jitter = hf_value(hf, "router_jitter_noise", "a number", where, 0.0)
  if jitter:
    raise ConvertError(f"{where} sets router_jitter_noise={jitter}; llama_jax's router adds no noise (use 0)")
  return dict(
    num_experts=hf_value(hf, "num_local_experts", "an integer", where, 8),
    top_k=hf_value(hf, "num_experts_per_tok", "an integer", where, 2),
    aux_loss_weight=float(hf_value(hf, "router_aux_loss_coef", "a number", where, 0.001)),
    balance_loss="transformers",  # the loss this coefficient was chosen for (a fine-tune may set per_layer)
  )


def hf_config_from_model_config(cfg: ModelConfig) -> dict[str, Any]:
  """A transformers ``config.json`` for LlamaForCausalLM (MixtralForCausalLM for a mixture of experts) with these
  hyper-parameters."""
  rope_scaling = None
  if cfg.rope_scaling == "linear":
    rope_scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
  elif cfg.rope_scaling == "llama3":
    rope_scaling = {
      "rope_type": "llama3",
      "factor": cfg.rope_scaling_factor,
      "low_freq_factor": cfg.rope_low_freq_factor,
      "high_freq_factor": cfg.rope_high_freq_factor,
      "original_max_position_embeddings": cfg.rope_original_max_len,
    }
  if cfg.moe.enabled:
    architecture = dict(
      architectures=["MixtralForCausalLM"],
      model_type="mixtral",
      num_local_experts=cfg.moe.num_experts,
      num_experts_per_tok=cfg.moe.top_k,
      router_aux_loss_coef=cfg.moe.aux_loss_weight,
      router_jitter_noise=0.0,
      sliding_window=None,
    )
  else:
    architecture = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False)
  return {
    **architecture,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.dim,
    "intermediate_size": cfg.hidden_dim,
    "num_hidden_layers": cfg.n_layers,
    "num_attention_heads": cfg.n_heads,
    "num_key_value_heads": cfg.n_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_seq_len,
    "rms_norm_eps": cfg.norm_eps,
    "rope_theta": cfg.rope_theta,
    "rope_scaling": rope_scaling,
    "tie_word_embeddings": cfg.tie_embeddings,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": cfg.param_dtype,
  }
