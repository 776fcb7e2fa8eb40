"""The model's hyper-parameters: ``ModelConfig``, a frozen dataclass built once and checked when built (hashable, so
safe as a static argument to ``jax.jit``). Modules only ever see it, never the whole run config.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from llama_jax.core.checks import ConfigError, check_choice, check_type, did_you_mean

ROPE_SCALINGS = ("none", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn", "splash")
CONTEXT_STRATEGIES = ("all_gather", "ring", "zigzag")
LOSS_HEAD_ONCE = ("none", "weights", "weights_and_gradient")
QUANTIZE_MODES = ("none", "int8")
NORMS = ("rmsnorm", "layernorm", "none")
NORM_POSITIONS = ("pre", "post")
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the projections LoRA can adapt
MOE_COMPUTES = ("dropless", "capacity", "dense")
MOE_GROUPED = ("auto", "ragged_dot", "tiles")
MOE_BALANCE_LOSSES = ("per_layer", "transformers")


def unsupported_context_kernel(requested: str, strategy: str) -> str | None:
  """Why model.attention=`requested` cannot run inside a context slice under `strategy`, or None when it can. A kernel
  named that no strategy's slice can run is refused, not replaced (shapes alone that do not fit fall back to the XLA
  blocks, as `attention.choose_implementation` falls back without context parallelism)."""
  if requested == "cudnn":
    return "cuDNN's causal mask cannot place a slice of the queries against the whole sequence's keys"
  return None


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """A mixture of experts in place of the SwiGLU MLP of every block, or of every `every`-th block (``model.moe``;
  num_experts 0: a dense model).

  Mixtral's choices: a linear router d_model → num_experts, softmax over the experts, the top_k kept and their
  weights renormalised to sum to 1 (`normalize_top_k`), each expert a SwiGLU MLP of the model's MLP width."""

  num_experts: int = 0
  top_k: int = 2
  # MoE in blocks every-1, 2·every-1, ... (the last of each group of `every`; the rest keep the dense MLP): Switch's
  # every other layer is every=2, and it is the rule of Llama 4's interleave_moe_layer_step and Qwen-MoE's
  # decoder_sparse_step. n_layers must be a multiple, so the stacked model scans identical groups of blocks.
  every: int = 1
  normalize_top_k: bool = True
  # dropless: tokens sorted by expert, grouped matmuls, nothing dropped | capacity: at most capacity_factor·fair share
  # of the assignments per expert (equal-size einsums; the rest dropped and counted) | dense: every expert on every
  # token, weighted by the routing (the reference path of the tests; top_k/num_experts of its work is used).
  compute: str = "dropless"
  # The grouped matmul of the dropless path: ragged_dot (XLA's ragged dot; TPU and GPU kernels) | tiles (groups padded
  # to row tiles, one dense product per tile; faster than ragged_dot on XLA:CPU, which computes every group on every
  # row: (BENCHMARKS.md, "Figures behind the code")) | auto (tiles on CPU, ragged_dot elsewhere).
  grouped: str = "auto"
  capacity_factor: float = 1.25
  # Weight of the load-balancing loss (Switch: num_experts · Σ_e share of assignments_e · mean router probability_e)
  # and of the router z-loss (ST-MoE: mean logsumexp(router logits)²), both added to the training objective.
  aux_loss_weight: float = 0.01
  z_loss_weight: float = 0.0
  # per_layer: the balance loss of each MoE layer, averaged over layers (Switch's definition, per layer) |
  # transformers: one loss over the tokens of every layer together, as transformers' load_balancing_loss_func (its
  # shares add expert e of every layer, so a layer may idle experts that another layer's e makes up for: on the
  # plays, 5 of the tiny model's 32 experts got under 0.5% of their layer's assignments at step 150).
  balance_loss: str = "per_layer"

  def __post_init__(self):
    for name in ("num_experts", "top_k", "every", "normalize_top_k", "compute", "grouped", "balance_loss"):
      check_type(self, "model.moe", name)
    for name in ("capacity_factor", "aux_loss_weight", "z_loss_weight"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"model.moe.{name} must be a finite number ≥ 0, got {value!r}")
      object.__setattr__(self, name, float(value))
    if self.num_experts < 0:
      raise ConfigError(f"model.moe.num_experts must be ≥ 0 (0: a dense MLP), got {self.num_experts}")
    if self.every < 1:
      raise ConfigError(f"model.moe.every must be ≥ 1 (1: every block; k: every k-th block), got {self.every}")
    if self.num_experts and not 1 <= self.top_k <= self.num_experts:
      raise ConfigError(f"model.moe.top_k must be between 1 and num_experts={self.num_experts}, got {self.top_k}")
    check_choice("model.moe.compute", self.compute, MOE_COMPUTES)
    check_choice("model.moe.grouped", self.grouped, MOE_GROUPED)
    check_choice("model.moe.balance_loss", self.balance_loss, MOE_BALANCE_LOSSES)
    if self.compute == "capacity" and self.capacity_factor <= 0:
      raise ConfigError(f"model.moe.capacity_factor must be > 0 for compute='capacity', got {self.capacity_factor}")

  @property
  def enabled(self) -> bool:
    return self.num_experts > 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a LLaMA 2 decoder (Meta's names where they exist).

  Frozen and checked when built: a bad value is refused with a `ConfigError`, and `n_kv_heads` None becomes
  `n_heads`. Hashable, so safe as a static argument to ``jax.jit``; modules only ever see it, never the whole run
  config. Build it from a mapping with `from_dict`, and change it with `replace`. Every field, with its default, its
  allowed values and its meaning, is in the run-config reference's `model` section, written from the comments here.

  Raises:
    ConfigError: when a field has the wrong type or is out of range, ``moe`` has an unknown key, or fields contradict
      each other, e.g. `dim` not divisible by `n_heads`, or int8 quantization of a mixture of experts.
  """

  vocab_size: int = 32000
  dim: int = 4096
  n_layers: int = 32
  n_heads: int = 32
  n_kv_heads: int | None = None  # None: equal to n_heads (multi-head attention)
  multiple_of: int = 256  # MLP hidden size is rounded up to a multiple of this
  ffn_dim_multiplier: float | None = None
  ffn_hidden_dim: int | None = None  # explicit MLP width (HF `intermediate_size`); overrides the rule above
  norm_eps: float = 1e-5
  # rmsnorm (LLaMA) | layernorm (mean and variance, scale only: no bias) | none. Statistics in float32 either way.
  norm: str = "rmsnorm"
  # pre: x + f(norm(x)), then a final norm (LLaMA) | post: norm(x + f(x)) (the original Transformer), no final norm
  norm_position: str = "pre"
  rope_theta: float = 10000.0
  rope_scaling: str = "none"  # none | linear | llama3
  rope_scaling_factor: float = 1.0  # linear and llama3: wavelengths are stretched by this factor
  rope_low_freq_factor: float = 1.0  # llama3 only
  rope_high_freq_factor: float = 4.0  # llama3 only
  rope_original_max_len: int = 8192  # llama3 only: context length the frequencies were trained for
  max_seq_len: int = 4096
  tie_embeddings: bool = False
  dtype: str = "float32"  # compute dtype of matmuls and activations
  param_dtype: str = "float32"  # storage dtype of parameters and optimizer moments
  scan_layers: bool = True  # run the stacked layers with lax.scan (False: a Python loop, same numbers)
  remat: str = "none"  # none | full | dots | dots_no_batch
  attention: str = "auto"  # auto (by backend) | xla | chunked | cudnn | splash
  # With mesh.context > 1 (each device holding a slice of every sequence), how attention sees the other slices' keys:
  # all_gather (every device gathers the whole sequence's keys and values once per layer; MaxText's default) | ring
  # (each device's block of keys and values passed round the ring by ppermute, one block per step, the softmax
  # merged online: only two blocks alive per device) | zigzag (the ring on a layout that gives every device an early
  # and a late chunk of the sequence, so that it computes only the causally visible half-blocks: n+1 blocks of
  # scores per layer instead of 2n; needs 2 × mesh.context to divide train.seq_len). See model/context.py.
  context_strategy: str = "all_gather"
  # Tokens per chunk of the training and evaluation loss (0: the whole sequence at once). The LM head and the
  # cross-entropy run chunk by chunk, rematerialised in the backward pass, so the float32 logits [B, T, V] never exist
  # whole: with Llama 3's vocabulary they are 128,256 float32s per token of every sequence, twice with their gradient.
  loss_chunk: int = 0
  # With loss_chunk, how the LM head's weights reach the chunks (when an fsdp axis splits them): none (gathered in
  # each chunk's forward and rematerialised forward, its gradient reduced in each chunk's backward) | weights
  # (gathered once per step for every chunk; the gradient still reduced per chunk) | weights_and_gradient (also the
  # float32 gradient accumulated whole and reduced once). What each costs and saves on Llama 3 8B:
  # docs/guides/long-context.md.
  loss_head_once: str = "none"
  init_std: float = 0.02
  # none | int8: projections and the embedding stored as int8 with a float32 scale per output channel (see
  # quantize.py). For decoding only: made from float weights by quantize.quantize_params; training refuses it.
  quantize: str = "none"
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)  # mixture of experts (num_experts 0: none)

  def __post_init__(self):
    if isinstance(self.moe, Mapping):  # from a ConfigDict or saved JSON
      unknown = sorted(set(self.moe) - {f.name for f in dataclasses.fields(MoEConfig)})
      if unknown:
        known = {f.name for f in dataclasses.fields(MoEConfig)}
        raise ConfigError(
          f"unknown model.moe keys {unknown}{did_you_mean('model.moe', unknown[0], known)}; known keys: {sorted(known)}"
        )
      object.__setattr__(self, "moe", MoEConfig(**self.moe))
    if not isinstance(self.moe, MoEConfig):
      raise ConfigError(f"model.moe must be a mapping of MoE settings, got {self.moe!r}")
    if self.moe.enabled and self.quantize != "none":
      raise ConfigError("quantize='int8' is not built for mixture-of-experts models (model.moe.num_experts > 0)")
    if self.n_kv_heads is None:
      object.__setattr__(self, "n_kv_heads", self.n_heads)
    if self.moe.enabled and isinstance(self.n_layers, int) and self.n_layers % self.moe.every:
      raise ConfigError(
        f"model.moe.every={self.moe.every} must divide n_layers={self.n_layers} (the layers are scanned in groups "
        "of `every` blocks, the last of each a mixture of experts)"
      )
    for name in ("tie_embeddings", "scan_layers"):
      check_type(self, "", name)
    for name in (
      "vocab_size",
      "dim",
      "n_layers",
      "n_heads",
      "n_kv_heads",
      "multiple_of",
      "max_seq_len",
      "rope_original_max_len",
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
      raise ConfigError(f"loss_chunk must be an integer ≥ 0 (0: no chunks), got {self.loss_chunk!r}")
    if self.ffn_hidden_dim is not None and (not isinstance(self.ffn_hidden_dim, int) or self.ffn_hidden_dim <= 0):
      raise ConfigError(f"ffn_hidden_dim must be a positive integer or None, got {self.ffn_hidden_dim!r}")
    if self.ffn_dim_multiplier is not None and not self.ffn_dim_multiplier > 0:
      raise ConfigError(f"ffn_dim_multiplier must be > 0 or None, got {self.ffn_dim_multiplier!r}")
    for name in ("norm_eps", "rope_theta", "rope_scaling_factor", "init_std"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    if self.dim % self.n_heads:
      raise ConfigError(f"dim must be divisible by n_heads, got dim={self.dim}, n_heads={self.n_heads}")
    if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
      raise ConfigError(f"n_kv_heads must divide n_heads, got n_kv_heads={self.n_kv_heads}, n_heads={self.n_heads}")
    if self.head_dim % 2:
      raise ConfigError(
        f"head_dim = dim / n_heads must be even for rotary embeddings, got {self.head_dim} "
        f"(dim={self.dim}, n_heads={self.n_heads})"
      )
    check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
    check_choice("dtype", self.dtype, DTYPES)
    check_choice("param_dtype", self.param_dtype, DTYPES)
    check_choice("remat", self.remat, REMAT_POLICIES)
    check_choice("attention", self.attention, ATTENTION_IMPLS)
    check_choice("context_strategy", self.context_strategy, CONTEXT_STRATEGIES)
    check_choice("loss_head_once", self.loss_head_once, LOSS_HEAD_ONCE)
    check_choice("quantize", self.quantize, QUANTIZE_MODES)
    check_choice("norm", self.norm, NORMS)
    check_choice("norm_position", self.norm_position, NORM_POSITIONS)
    if self.norm == "none" and self.norm_position == "post":
      raise ConfigError(
        "norm_position 'post' normalises each residual sum, but norm is 'none'; use norm_position='pre'"
      )
    if self.rope_scaling == "llama3":
      if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
        raise ConfigError(
          "llama3 rope scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
          f"rope_low_freq_factor={self.rope_low_freq_factor}, "
          f"rope_high_freq_factor={self.rope_high_freq_factor}"
        )

  @property
  def head_dim(self) -> int:
    """Width of one attention head: `dim` / `n_heads`."""
    return self.dim // self.n_heads

  @property
  def hidden_dim(self) -> int:
    """Width of the SwiGLU MLP: Meta's rule 4·dim·2/3, times the multiplier, rounded up to `multiple_of`."""
    if self.ffn_hidden_dim is not None:
      return self.ffn_hidden_dim
    hidden = int(2 * (4 * self.dim) / 3)
    if self.ffn_dim_multiplier is not None:
      hidden = int(self.ffn_dim_multiplier * hidden)
    return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

  def is_moe_layer(self, layer: int) -> bool:
    """Whether block `layer` has a mixture of experts: the last block of each group of `moe.every`.

    Args:
      layer: the block's index, from 0.

    Returns:
      True for a mixture-of-experts block; False for a dense block, and for every block of a dense model.
    """
    return self.moe.enabled and (layer + 1) % self.moe.every == 0

  @property
  def n_moe_layers(self) -> int:
    """How many blocks have a mixture of experts: `n_layers` / `moe.every`, or 0 for a dense model."""
    return self.n_layers // self.moe.every if self.moe.enabled else 0

  def num_active_params(self) -> int:
    """Weights used per token: a mixture of experts runs top_k of its experts' MLPs (the rest, and the embedding
    rows of other tokens, are counted in `num_params` only; the embedding is counted here as in `num_params`)."""
    unused = self.moe.num_experts - self.moe.top_k if self.moe.enabled else 0
    return self.num_params() - self.n_moe_layers * unused * 3 * self.dim * self.hidden_dim

  def num_params(self) -> int:
    """Number of weights from the shapes alone (the tests check it against the abstract float model). The same
    count whatever the storage: an int8 model holds these weights as int8, plus one float32 scale per output channel
    of each projection and per embedding row, which are not counted."""
    d, f, h = self.dim, self.hidden_dim, self.head_dim
    attention = d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2
    norm = 0 if self.norm == "none" else d  # one scale per norm; post-norm has no final norm
    final_norm = norm if self.norm_position == "pre" else 0
    layer = attention + 3 * d * f + 2 * norm  # a dense block
    moe_extra = (self.moe.num_experts - 1) * 3 * d * f + d * self.moe.num_experts  # its MLP as experts + router
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.n_layers * layer + self.n_moe_layers * moe_extra + final_norm + head

  def replace(self, **changes: Any) -> ModelConfig:
    """A copy with some fields changed, checked again.

    Args:
      **changes: field name → new value.

    Returns:
      The new `ModelConfig`.

    Raises:
      ConfigError: when the changed config fails a check.
    """
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """Every field by name, ``moe`` as a nested dict: what `from_dict` takes back."""
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    """`to_dict` as indented JSON with sorted keys: what a checkpoint directory's model_config.json holds."""
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
    """Builds a checked config from a mapping: a ConfigDict's ``model`` field or saved JSON.

    Args:
      values: field name → value; ``moe`` may be a mapping of its own fields.

    Returns:
      The checked `ModelConfig`; fields missing from `values` take their defaults.

    Raises:
      ConfigError: when a key is unknown, naming the closest known one, or a value fails a check.
    """
    values = dict(values)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(
        f"unknown model config keys {unknown}{did_you_mean('model', unknown[0], known)}; known keys: {sorted(known)}"
      )
    return cls(**values)


def model_config_from(run_config: Any) -> ModelConfig:
  """The ModelConfig of a run config (RunConfig, ConfigDict with a ``model`` field) or of a plain mapping."""
  model = run_config.model if hasattr(run_config, "model") else run_config
  if isinstance(model, ModelConfig):
    return model
  if hasattr(model, "to_dict"):
    model = model.to_dict()
  return ModelConfig.from_dict(model)
