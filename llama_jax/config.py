"""Configuration in two layers: what a user writes, and the typed config the code reads.

- A run config file ``configs/<name>.py`` returns an ml_collections ``ConfigDict`` from ``get_config()``, built on
  ``base_run_config()``; absl's ``config_flags`` applies ``--config.train.lr=1e-3`` overrides to it. That layer is for
  writing and composing configs (7B = base + sizes), not for checking them.
- ``RunConfig.from_dict`` turns it into frozen dataclasses, one per section (``ModelConfig``, ``TrainConfig``,
  ``DataConfig``, ``MeshConfig``), and that is the one place where values are checked: unknown keys (a typo in a
  file or an override, with the closest valid key), types, ranges and the rules between fields. Every command builds
  the ``RunConfig`` before it writes anything; the library takes the typed config (or converts a ConfigDict itself).

The defaults live once, in the dataclasses; ``base_run_config()`` is made from them. The model only ever sees its
``ModelConfig``, which is hashable and safe as a static argument to ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import typing
from collections.abc import Mapping
from typing import Any

from llama_jax.errors import LlamaJaxError

ROPE_SCALINGS = ("none", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn", "splash")
DATA_FORMATS = ("text", "chat", "preference")
ON_ERROR = ("skip", "stop")
NONFINITE_POLICIES = ("stop", "skip")
QUANTIZE_MODES = ("none", "int8")
NORMS = ("rmsnorm", "layernorm", "none")
NORM_POSITIONS = ("pre", "post")
MESH_AXES = ("data", "fsdp", "tensor")
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the projections LoRA can adapt


class ConfigError(LlamaJaxError, ValueError):
  """A configuration value is out of range; the message names the field and the value."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a LLaMA 2 decoder (Meta's names where they exist)."""

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
  init_std: float = 0.02
  # none | int8: projections and the embedding stored as int8 with a float32 scale per output channel (see
  # quantize.py). For decoding only: made from float weights by quantize.quantize_params; training refuses it.
  quantize: str = "none"

  def __post_init__(self):
    if self.n_kv_heads is None:
      object.__setattr__(self, "n_kv_heads", self.n_heads)
    for name in ("tie_embeddings", "scan_layers"):
      _check_type(self, "", name)
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
    _check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
    _check_choice("dtype", self.dtype, DTYPES)
    _check_choice("param_dtype", self.param_dtype, DTYPES)
    _check_choice("remat", self.remat, REMAT_POLICIES)
    _check_choice("attention", self.attention, ATTENTION_IMPLS)
    _check_choice("quantize", self.quantize, QUANTIZE_MODES)
    _check_choice("norm", self.norm, NORMS)
    _check_choice("norm_position", self.norm_position, NORM_POSITIONS)
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

  def num_params(self) -> int:
    """Number of weights from the shapes alone (the tests check it against the abstract float model). The same
    count whatever the storage: an int8 model holds these weights as int8, plus one float32 scale per output channel
    of each projection and per embedding row, which are not counted."""
    d, f, h = self.dim, self.hidden_dim, self.head_dim
    attention = d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2
    norm = 0 if self.norm == "none" else d  # one scale per norm; post-norm has no final norm
    final_norm = norm if self.norm_position == "pre" else 0
    layer = attention + 3 * d * f + 2 * norm
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.n_layers * layer + final_norm + head

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
    """Builds from a mapping (a ConfigDict's ``model`` field or saved JSON); unknown keys are an error."""
    values = dict(values)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(
        f"unknown model config keys {unknown}{did_you_mean('model', unknown[0], known)}; known keys: {sorted(known)}"
      )
    return cls(**values)


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def model_config_from(run_config: Any) -> ModelConfig:
  """The ModelConfig of a run config (RunConfig, ConfigDict with a ``model`` field) or of a plain mapping."""
  model = run_config.model if hasattr(run_config, "model") else run_config
  if isinstance(model, ModelConfig):
    return model
  if hasattr(model, "to_dict"):
    model = model.to_dict()
  return ModelConfig.from_dict(model)


# ---------------------------------------------------------------------------------------------------------------------
# The run config: one frozen dataclass per section, checked when built


def did_you_mean(section: str, key: str, known) -> str:
  close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
  prefix = f"{section}." if section else ""
  return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _type_name(annotation: Any) -> str:
  return {int: "an integer", float: "a number", bool: "True or False", str: "a string"}[annotation]


def _check_type(config: Any, section: str, name: str) -> None:
  """Checks one field against its annotation (int, float, bool, str, tuple[str|int, ...]); normalises ints given
  for floats and lists given for tuples (JSON has no tuples), so equal configs compare and hash equal."""
  annotation = typing.get_type_hints(type(config))[name]
  value = getattr(config, name)
  where = f"{section}.{name}" if section else name
  if typing.get_origin(annotation) is tuple:
    item = typing.get_args(annotation)[0]
    ok = isinstance(value, (tuple, list)) and all(
      isinstance(v, item) and not (item is int and isinstance(v, bool)) for v in value
    )
    if not ok:
      example = "('x',)" if item is str else "(1, 2)"
      raise ConfigError(
        f"{where} must be a tuple of {_type_name(item).split()[-1]}s, e.g. {where}={example}, got {value!r}"
      )
    object.__setattr__(config, name, tuple(value))
    return
  ok = isinstance(value, annotation) and not (annotation is not bool and isinstance(value, bool))
  if annotation is float and isinstance(value, int) and not isinstance(value, bool):
    object.__setattr__(config, name, float(value))
    ok = True
  if not ok:
    raise ConfigError(f"{where} must be {_type_name(annotation)}, got {value!r}")
  if annotation is float and not math.isfinite(value):
    raise ConfigError(f"{where} must be finite, got {value!r}")


def _check_range(
  where: str,
  value: float,
  low: float | None = None,
  high: float | None = None,
  *,
  low_open: bool = False,
  high_open: bool = False,
) -> None:
  too_low = low is not None and (value <= low if low_open else value < low)
  too_high = high is not None and (value >= high if high_open else value > high)
  if too_low or too_high:
    if low is not None and high is not None:
      allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
      allowed = f"{'>' if low_open else '≥'} {low:g}"
    else:
      allowed = f"{'<' if high_open else '≤'} {high:g}"
    raise ConfigError(f"{where} must be {allowed}, got {value!r}")


class _Section:
  """A run-config section: frozen fields with types checked by annotation, unknown keys refused by name. A field
  that is itself a section (``train.lora``) is built from its mapping and checked the same way."""

  SECTION = ""

  def _check_types(self) -> None:
    hints = typing.get_type_hints(type(self))
    for field in dataclasses.fields(self):
      sub = hints[field.name]
      if isinstance(sub, type) and issubclass(sub, _Section):
        value = getattr(self, field.name)
        if isinstance(value, Mapping) or hasattr(value, "to_dict"):
          value = sub.from_dict(value.to_dict() if hasattr(value, "to_dict") else value)
        if not isinstance(value, sub):
          raise ConfigError(f"{sub.SECTION} must be a section of keys, got {value!r}")
        object.__setattr__(self, field.name, value)
      else:
        _check_type(self, self.SECTION, field.name)

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]):
    values = dict(values)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in sorted(values):
      if key not in known:
        raise ConfigError(f"unknown run config key {cls.SECTION}.{key}{did_you_mean(cls.SECTION, key, known)}")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class LoraConfig(_Section):
  """Low-rank adapters (lora.py): each targeted projection W gets A [in, rank] (random) and B [rank, out] (zeros),
  and computes x·W + (alpha / rank)·(x·A)·B; only A and B train, the base model (init_from) stays frozen."""

  SECTION = "train.lora"
  rank: int = 0  # 0: no adapters, every parameter trains
  alpha: float = 16.0
  targets: tuple[str, ...] = LORA_TARGETS

  def __post_init__(self):
    self._check_types()
    _check_range("train.lora.rank", self.rank, 0)
    _check_range("train.lora.alpha", self.alpha, 0, low_open=True)
    unknown = [t for t in self.targets if t not in LORA_TARGETS]
    if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
      raise ConfigError(
        f"train.lora.targets must be distinct names from {', '.join(LORA_TARGETS)}; got {self.targets!r}"
      )

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Section):
  """Optimisation, cadence and bookkeeping of a training run."""

  SECTION = "train"
  batch_size: int = 8  # global batch: sequences per optimizer step, over all devices and processes
  seq_len: int = 256  # tokens per sequence
  grad_accum: int = 1  # micro-batches per step (lax.scan); batch_size must be divisible by it
  steps: int = 1000
  lr: float = 3e-4  # linear warmup to lr, then cosine decay to lr·min_lr_ratio
  warmup_steps: int = 100
  min_lr_ratio: float = 0.1
  b1: float = 0.9  # AdamW; weight decay on matrices only (not norm scales)
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float = 1.0  # global gradient-norm clipping (0: off)
  log_every: int = 10
  eval_every: int = 200  # 0: no evaluation
  eval_batches: int = 50  # 0: the whole validation split
  save_every: int = 200
  keep: int = 3  # keep the last `keep` checkpoints ...
  keep_every: int = 0  # ... plus every `keep_every`-th step (a multiple of save_every; 0: none)
  async_save: bool = True
  peak_flops_per_device: float = 0.0  # for MFU; 0: a table by device kind, or a measured matmul peak on CPU
  record_batches: bool = False  # append each step's batch digest to batches.jsonl (data provenance, resume checks)
  profile_steps: tuple[int, ...] = ()  # (start, count): a jax.profiler trace of steps start .. start+count-1
  # A step whose loss or gradients are not finite is never applied. "stop": the run ends with one line and exit 2,
  # saving nothing after it; "skip": it is skipped (counted in the log) unless max_skipped_steps follow in a row.
  on_nonfinite: str = "stop"
  max_skipped_steps: int = 10
  dpo_beta: float = 0.1  # data.format "preference": the DPO β (how far the policy may move from the reference)
  # LoRA fine-tuning of the init_from model (rank 0: off): e.g. --config.train.lora.rank=8.
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

  def __post_init__(self):
    self._check_types()
    for name in ("batch_size", "seq_len", "grad_accum", "steps", "log_every", "save_every", "keep"):
      _check_range(f"train.{name}", getattr(self, name), 1)
    for name in ("warmup_steps", "eval_every", "eval_batches", "keep_every"):
      _check_range(f"train.{name}", getattr(self, name), 0)
    _check_range("train.lr", self.lr, 0, low_open=True)
    _check_range("train.min_lr_ratio", self.min_lr_ratio, 0, 1)
    _check_range("train.b1", self.b1, 0, 1, high_open=True)
    _check_range("train.b2", self.b2, 0, 1, high_open=True)
    _check_range("train.eps", self.eps, 0, low_open=True)
    for name in ("weight_decay", "clip_norm", "peak_flops_per_device"):
      _check_range(f"train.{name}", getattr(self, name), 0)
    _check_choice("train.on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
    _check_range("train.max_skipped_steps", self.max_skipped_steps, 1)
    _check_range("train.dpo_beta", self.dpo_beta, 0, low_open=True)
    if self.batch_size % self.grad_accum:
      raise ConfigError(f"train.batch_size {self.batch_size} is not divisible by train.grad_accum {self.grad_accum}")
    if self.keep_every % self.save_every:
      raise ConfigError(
        f"train.keep_every {self.keep_every} must be a multiple of train.save_every "
        f"{self.save_every} (only saved steps can be kept), or 0"
      )
    if self.profile_steps:
      if len(self.profile_steps) != 2 or self.profile_steps[0] < 1 or self.profile_steps[1] < 1:
        raise ConfigError(
          f"train.profile_steps must be (start, count) with start ≥ 1 and count ≥ 1, or () for no "
          f"profile; got {self.profile_steps!r}"
        )
      if sum(self.profile_steps) - 1 > self.steps:
        raise ConfigError(
          f"train.profile_steps {self.profile_steps!r} ends at step {sum(self.profile_steps) - 1}, "
          f"past train.steps {self.steps}"
        )


@dataclasses.dataclass(frozen=True)
class DataConfig(_Section):
  """Where the tokens come from and how they are split."""

  SECTION = "data"
  sources: tuple[str, ...] = ("shakespeare",)  # files, directories, globs, *.jsonl, "shakespeare[:play,play]" ...
  val_sources: tuple[str, ...] = ()  # documents for validation (removed from training); empty: val_fraction
  val_fraction: float = 0.0  # a seeded hash split of documents (text) or conversations (chat)
  text_field: str = "text"  # JSONL field holding the document text
  tokenizer: str = ""  # a sentencepiece .model to use; empty: train one on the training documents
  vocab_size: int = 4096  # for a trained tokenizer
  prepared_dir: str = ""  # where tokenized shards go; empty: <workdir>/data
  format: str = "text"  # text: pretraining documents | chat: conversations for SFT (chat template, assistant loss)
  # | preference: prompt + chosen/rejected responses for DPO (preference_data.py)
  on_error: str = "skip"  # chat, preference: a bad line is skipped and counted ("skip") or stops the run ("stop")
  # Reused shards are always size-checked; True also checks each one's sha256 and all its token ids (a full read).
  verify: bool = False

  def __post_init__(self):
    self._check_types()
    if not self.sources or not all(s.strip() for s in self.sources):
      raise ConfigError(f"data.sources must name at least one source, none empty; got {self.sources!r}")
    _check_range("data.val_fraction", self.val_fraction, 0, 1, high_open=True)
    _check_range("data.vocab_size", self.vocab_size, 1)
    if not self.text_field:
      raise ConfigError("data.text_field must name a JSONL field, got ''")
    _check_choice("data.format", self.format, DATA_FORMATS)
    _check_choice("data.on_error", self.on_error, ON_ERROR)
    if self.val_sources and self.val_fraction:
      raise ConfigError(
        f"set data.val_sources or data.val_fraction, not both (got {self.val_sources!r} and {self.val_fraction})"
      )
    if self.val_sources and self.format != "text":
      raise ConfigError(
        f"data.val_sources {self.val_sources!r} is not used with data.format={self.format!r}: conversations "
        f"and pairs are held out by data.val_fraction"
      )


@dataclasses.dataclass(frozen=True)
class MeshConfig(_Section):
  """Devices as data × fsdp × tensor; -1 takes the devices the other axes leave. dcn_data > 1 spans the data axis over
  that many slices (multi-slice TPU, or GPU hosts): fsdp and tensor then stay within a slice."""

  SECTION = "mesh"
  data: int = 1
  fsdp: int = -1
  tensor: int = 1
  dcn_data: int = 1

  def __post_init__(self):
    self._check_types()
    sizes = [getattr(self, axis) for axis in MESH_AXES]
    for axis, size in zip(MESH_AXES, sizes):
      if size == 0 or size < -1:
        raise ConfigError(f"mesh.{axis} must be a positive integer or -1 (the rest of the devices), got {size}")
    if sizes.count(-1) > 1:
      raise ConfigError(f"at most one mesh axis may be -1, got data={sizes[0]}, fsdp={sizes[1]}, tensor={sizes[2]}")
    _check_range("mesh.dcn_data", self.dcn_data, 1)

  def to_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


# Logical axis → mesh axis rules. Parameters and activations use different logical names so that the batch axis
# (sharded over data and fsdp) and the fsdp-sharded parameter axis never claim the same mesh axis in one array.
DEFAULT_LOGICAL_AXIS_RULES = (
  # parameters
  ("vocab", "tensor"),
  ("embed", "fsdp"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("mlp", "tensor"),
  ("norm", None),
  ("layers", None),
  # activations
  ("activation_batch", ("data", "fsdp")),
  ("activation_length", None),
  ("activation_embed", None),
  ("activation_heads", "tensor"),
  ("activation_kv_heads", "tensor"),
  ("activation_mlp", "tensor"),
  ("activation_vocab", "tensor"),
)


def _logical_axis_rules(rules: Any) -> tuple:
  """Rules as a tuple of (logical name, mesh axis | None | tuple of mesh axes), mesh axes checked by name."""
  out = []
  for rule in rules if isinstance(rules, (tuple, list)) else [rules]:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ConfigError(
        f"logical_axis_rules entries must be (logical name, mesh axis or None or tuple of mesh axes), got {rule!r}"
      )
    target = rule[1]
    axes = () if target is None else tuple(target) if isinstance(target, (tuple, list)) else (target,)
    for axis in axes:
      if axis not in MESH_AXES:
        raise ConfigError(
          f"logical_axis_rules maps {rule[0]!r} to unknown mesh axis {axis!r}; the mesh axes are {', '.join(MESH_AXES)}"
        )
    out.append((rule[0], tuple(target) if isinstance(target, (tuple, list)) else target))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything about a run, typed and checked: build it with ``run_config_from`` (from a ConfigDict or JSON)."""

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  logical_axis_rules: tuple = DEFAULT_LOGICAL_AXIS_RULES
  # A checkpoint directory whose parameters (only: the optimizer starts fresh) initialise a new run, e.g. for SFT.
  init_from: str = ""
  seed: int = 0

  def __post_init__(self):
    for name in ("init_from", "seed"):
      _check_type(self, "", name)
    _check_range("seed", self.seed, 0)
    object.__setattr__(self, "logical_axis_rules", _logical_axis_rules(self.logical_axis_rules))
    if self.model.quantize != "none":
      raise ConfigError(
        "model.quantize is for decoding (sample/evaluate --quantize int8); training needs float weights"
      )
    if self.data.format == "preference" and not self.init_from:
      raise ConfigError(
        "data.format='preference' (DPO) tunes a trained model against itself: set init_from to its checkpoint "
        "directory, e.g. the SFT run's workdir"
      )
    if self.train.lora.rank:
      if not self.init_from:
        raise ConfigError(
          f"train.lora.rank {self.train.lora.rank} adapts a trained model: set init_from to its checkpoint "
          f"directory (or train.lora.rank=0 to train every parameter)"
        )
      if self.train.lora.rank > self.model.dim:
        raise ConfigError(
          f"train.lora.rank must be in [1, model.dim={self.model.dim}] (a rank past the width adds nothing), "
          f"got {self.train.lora.rank}"
        )
    if self.train.seq_len > self.model.max_seq_len:
      raise ConfigError(
        f"train.seq_len {self.train.seq_len} is longer than model.max_seq_len "
        f"{self.model.max_seq_len}; raise --config.model.max_seq_len or lower train.seq_len"
      )

  SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "mesh": MeshConfig}

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> RunConfig:
    """From a ConfigDict's ``to_dict()`` or a saved run_config.json; every unknown key is refused by name."""
    values = dict(values)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in sorted(values):
      if key not in known:
        raise ConfigError(f"unknown run config key {key}{did_you_mean('', key, known)}")
    for name, section in cls.SECTIONS.items():
      if name in values:
        if not isinstance(values[name], Mapping):
          raise ConfigError(f"{name} must be a section of keys, got {values[name]!r}")
        values[name] = section.from_dict(values[name])
    return cls(**values)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  def replace(self, **sections: Any) -> RunConfig:
    """A copy with whole sections or fields replaced, checked again: ``replace(train=dict(steps=5))``."""
    changes = {
      k: dataclasses.replace(getattr(self, k), **v) if isinstance(v, Mapping) else v for k, v in sections.items()
    }
    return dataclasses.replace(self, **changes)


def run_config_from(config: Any) -> RunConfig:
  """The typed, checked RunConfig of a RunConfig, an ml_collections ConfigDict or a plain mapping."""
  if isinstance(config, RunConfig):
    return config
  return RunConfig.from_dict(config.to_dict() if hasattr(config, "to_dict") else config)


def base_run_config():
  """Defaults that every ``configs/<name>.py`` starts from and then overrides: the dataclasses' defaults as a
  ConfigDict (the layer that config files write and ``--config.x.y=`` overrides change)."""
  import ml_collections  # local import: the model must not need ml_collections

  defaults = RunConfig()
  cfg = ml_collections.ConfigDict()
  for name in RunConfig.SECTIONS:
    cfg[name] = ml_collections.ConfigDict(dataclasses.asdict(getattr(defaults, name)))
  # Fields whose default is None need a declared type, or an override could not set them.
  cfg.model.n_kv_heads = ml_collections.FieldReference(None, field_type=int)
  cfg.model.ffn_dim_multiplier = ml_collections.FieldReference(None, field_type=float)
  cfg.model.ffn_hidden_dim = ml_collections.FieldReference(None, field_type=int)
  cfg.logical_axis_rules = defaults.logical_axis_rules
  cfg.init_from = defaults.init_from
  cfg.seed = defaults.seed
  return cfg


def load_run_config(path: str):
  """Imports ``configs/<name>.py`` and returns its ``get_config()`` ConfigDict (what absl's config_flags does, for
  library use and for config files built on other config files)."""
  import importlib.util

  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path!r}")
  spec = importlib.util.spec_from_file_location(f"llama_jax_config_{os.path.basename(path)[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def main(argv=None) -> None:
  """``python -m llama_jax.config --config configs/X.py [--config.a.b=v]``: print the resolved run config."""
  from absl import app, flags
  from ml_collections import config_flags

  from llama_jax import cli  # the command line sits on top of this module

  config_flag = config_flags.DEFINE_config_file("config", None, "run config file, e.g. configs/tiny.py")
  flags.mark_flags_as_required(["config"])

  def show(_):
    run_config = cli.run_config_from_flag_or_exit(config_flag)
    print(config_flag.value)
    model = run_config.model
    print(f"model ({model.num_params():,} parameters, MLP width {model.hidden_dim}):")
    print(model.to_json())

  app.run(show, argv, flags_parser=cli.parse_flags_or_exit)


if __name__ == "__main__":
  main()
