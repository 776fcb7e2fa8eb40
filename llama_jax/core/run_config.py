"""The run config: what a user writes, and the typed config the code reads.

- A run config file ``configs/<name>.py`` returns an ml_collections ``ConfigDict`` from ``get_config()``, built on
  ``base_run_config()``; absl's ``config_flags`` applies ``--config.train.lr=1e-3`` overrides to it. That layer is for
  writing and composing configs (7B = base + sizes), not for checking them.
- ``RunConfig.from_dict`` turns it into frozen dataclasses, one per section (``ModelConfig``, ``TrainConfig``,
  ``DataConfig``, ``MeshConfig``), and that is the one place where values are checked: unknown keys (a typo in a
  file or an override, with the closest valid key), types, ranges and the rules between fields. Every command builds
  the ``RunConfig`` before it writes anything; the library takes the typed config (or converts a ConfigDict itself).

The defaults live once, in the dataclasses; ``base_run_config()`` is made from them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections

from llama_jax.core.checks import ConfigError, check_choice, check_range, check_type, did_you_mean
from llama_jax.core.model_config import LORA_TARGETS, ModelConfig, unsupported_context_kernel

DATA_FORMATS = ("text", "chat", "preference")
ON_ERROR = ("skip", "stop")
NONFINITE_POLICIES = ("stop", "skip")
TRACKERS = ("tensorboard", "wandb", "mlflow")
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")


class Section:
  """A run-config section: frozen fields with types checked by annotation, unknown keys refused by name. A field
  that is itself a section (``train.lora``) is built from its mapping and checked the same way."""

  SECTION = ""

  def check_types(self) -> None:
    hints = typing.get_type_hints(type(self))
    for field in dataclasses.fields(self):
      sub = hints[field.name]
      if isinstance(sub, type) and issubclass(sub, Section):
        value = getattr(self, field.name)
        if isinstance(value, Mapping) or hasattr(value, "to_dict"):
          value = sub.from_dict(value.to_dict() if hasattr(value, "to_dict") else value)
        if not isinstance(value, sub):
          raise ConfigError(f"{sub.SECTION} must be a section of keys, got {value!r}")
        object.__setattr__(self, field.name, value)
      else:
        check_type(self, self.SECTION, field.name)

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]):
    values = dict(values)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in sorted(values):
      if key not in known:
        raise ConfigError(f"unknown run config key {cls.SECTION}.{key}{did_you_mean(cls.SECTION, key, known)}")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class LoraConfig(Section):
  """Low-rank adapters (``train.lora``): only the adapters train, and the base model, `init_from`, stays frozen.

  Each targeted projection W gets A [in, rank], random, and B [rank, out], zeros, and computes
  x·W + (alpha / rank)·(x·A)·B (lora.py). Checked when built: a bad value is refused with a `ConfigError`.

  Attributes:
    rank: the adapters' rank; 0: no adapters, every parameter trains.
    alpha: the adapters' scale numerator, > 0; their product is multiplied by alpha / rank.
    targets: the projections that get adapters, distinct names from `LORA_TARGETS`; all of them by default.
  """

  SECTION = "train.lora"
  rank: int = 0  # 0: no adapters, every parameter trains
  alpha: float = 16.0
  targets: tuple[str, ...] = LORA_TARGETS

  def __post_init__(self):
    self.check_types()
    check_range("train.lora.rank", self.rank, 0)
    check_range("train.lora.alpha", self.alpha, 0, low_open=True)
    unknown = [t for t in self.targets if t not in LORA_TARGETS]
    if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
      raise ConfigError(
        f"train.lora.targets must be distinct names from {', '.join(LORA_TARGETS)}; got {self.targets!r}"
      )

  @property
  def scale(self) -> float:
    """alpha / rank, the factor of the adapters' product (rank > 0)."""
    return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
  """Optimisation, cadence and bookkeeping of a training run.

  The ``train`` section, checked when built: a bad value, or a rule between fields broken, is a `ConfigError`. Every
  field, with its default, its allowed values and its meaning, is in the run-config reference.
  """

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
  # Metrics sinks beside metrics.jsonl (process 0): any of "tensorboard", "wandb" (extra wandb), "mlflow" (extra
  # mlflow). W&B reads WANDB_MODE / WANDB_ENTITY / its key from the environment; MLflow its tracking URI.
  trackers: tuple[str, ...] = ("tensorboard",)
  tracker_project: str = "llama_jax"  # the W&B project / MLflow experiment
  run_name: str = ""  # the tracker run's display name; empty: the workdir's name
  mlflow_tracking_uri: str = ""  # empty: MLflow's own (MLFLOW_TRACKING_URI, or its default)
  profile_steps: tuple[int, ...] = ()  # (start, count): a jax.profiler trace of steps start .. start+count-1
  # A step whose loss or gradients are not finite is never applied. "stop": the run ends with one line and exit 2,
  # saving nothing after it; "skip": it is skipped (counted in the log) unless max_skipped_steps follow in a row.
  on_nonfinite: str = "stop"
  max_skipped_steps: int = 10
  dpo_beta: float = 0.1  # data.format "preference": the DPO β (how far the policy may move from the reference)
  # LoRA fine-tuning of the init_from model (rank 0: off): e.g. --config.train.lora.rank=8.
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

  def __post_init__(self):
    self.check_types()
    for name in ("batch_size", "seq_len", "grad_accum", "steps", "log_every", "save_every", "keep"):
      check_range(f"train.{name}", getattr(self, name), 1)
    for name in ("warmup_steps", "eval_every", "eval_batches", "keep_every"):
      check_range(f"train.{name}", getattr(self, name), 0)
    check_range("train.lr", self.lr, 0, low_open=True)
    check_range("train.min_lr_ratio", self.min_lr_ratio, 0, 1)
    check_range("train.b1", self.b1, 0, 1, high_open=True)
    check_range("train.b2", self.b2, 0, 1, high_open=True)
    check_range("train.eps", self.eps, 0, low_open=True)
    for name in ("weight_decay", "clip_norm", "peak_flops_per_device"):
      check_range(f"train.{name}", getattr(self, name), 0)
    check_choice("train.on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
    for tracker in self.trackers:
      check_choice("train.trackers", tracker, TRACKERS)
    if len(set(self.trackers)) != len(self.trackers):
      raise ConfigError(f"train.trackers names a tracker twice: {self.trackers!r}")
    check_range("train.max_skipped_steps", self.max_skipped_steps, 1)
    check_range("train.dpo_beta", self.dpo_beta, 0, low_open=True)
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
class DataConfig(Section):
  """Where the tokens come from and how they are split.

  The ``data`` section, checked when built: a bad value, or a rule between fields broken, is a `ConfigError`. `specs`
  and `weights` read a mixture's (spec, weight) pairs apart. Every field, with its default, its allowed values and its
  meaning, is in the run-config reference.
  """

  SECTION = "data"
  # Files, directories or globs, local or gs:// (text, .jsonl[.gz|.zst], .parquet, ArrayRecord), or
  # "shakespeare[:play,play]". Each may carry a weight, (("web/*.parquet", 0.7), ("code/*.jsonl.zst", 0.3)): a
  # mixture, whose weights are shares of the training windows (so of tokens), drawn in a fixed pattern by seed.
  sources: tuple[str | tuple, ...] = ("shakespeare",)
  val_sources: tuple[str, ...] = ()  # documents for validation (removed from training); empty: val_fraction
  val_fraction: float = 0.0  # a seeded hash split of documents (text) or conversations (chat)
  text_field: str = "text"  # JSONL field holding the document text
  tokenizer: str = ""  # a sentencepiece .model, a tokenizer.json or a directory with one; empty: train one
  vocab_size: int = 4096  # for a trained tokenizer
  prepared_dir: str = ""  # where tokenized shards go; empty: <workdir>/data
  format: str = "text"  # text: pretraining documents | chat: conversations for SFT (chat template, assistant loss)
  # | preference: prompt + chosen/rejected responses for DPO (preference_data.py)
  # A bad line (chat, preference), bad document or damaged file (text) is skipped and counted ("skip") or stops the
  # run ("stop").
  on_error: str = "skip"
  # Reused shards are always size-checked; True also checks each one's sha256 and all its token ids (a full read).
  verify: bool = False
  # True: no preparation step; each process reads its own files, tokenized and packed in data.workers grain worker
  # processes (0: in the training process), windows shuffled in a buffer of data.shuffle_window (data/streaming.py).
  # Resumes exactly at the same process count and workers. Needs a tokenizer (data.tokenizer).
  streaming: bool = False
  workers: int = 0
  shuffle_window: int = 1024
  # Streaming: each window carries its documents' segment ids and positions, so attention stays inside a document
  # (as packed SFT rows); False attends across document boundaries within a window, as prepared data does.
  document_mask: bool = False

  def __post_init__(self):
    object.__setattr__(self, "sources", _sources(self.sources))
    self.check_types()
    check_range("data.val_fraction", self.val_fraction, 0, 1, high_open=True)
    check_range("data.vocab_size", self.vocab_size, 1)
    if not self.text_field:
      raise ConfigError("data.text_field must name a JSONL field, got ''")
    check_choice("data.format", self.format, DATA_FORMATS)
    check_choice("data.on_error", self.on_error, ON_ERROR)
    if self.val_sources and self.val_fraction:
      raise ConfigError(
        f"set data.val_sources or data.val_fraction, not both (got {self.val_sources!r} and {self.val_fraction})"
      )
    if self.weights is not None and self.format != "text":
      raise ConfigError(
        f"data.sources with weights (a mixture) are for data.format='text'; data.format={self.format!r} takes "
        f"plain sources"
      )
    check_range("data.workers", self.workers, 0, 256)
    check_range("data.shuffle_window", self.shuffle_window, 0)
    if self.streaming and self.format != "text":
      raise ConfigError(f"data.streaming is for data.format='text' (pretraining); got data.format={self.format!r}")
    if self.streaming and self.prepared_dir:
      raise ConfigError(f"data.streaming reads the sources directly: unset data.prepared_dir {self.prepared_dir!r}")
    if self.document_mask and not self.streaming:
      raise ConfigError("data.document_mask needs data.streaming=True (prepared text windows carry no documents)")
    if self.val_sources and self.format != "text":
      raise ConfigError(
        f"data.val_sources {self.val_sources!r} is not used with data.format={self.format!r}: conversations "
        f"and pairs are held out by data.val_fraction"
      )

  @property
  def specs(self) -> tuple[str, ...]:
    """The source specs, without their weights."""
    return tuple(s if isinstance(s, str) else s[0] for s in self.sources)

  @property
  def weights(self) -> tuple[float, ...] | None:
    """The mixture's weights, normalised to sum to 1; None when the sources carry none."""
    if all(isinstance(s, str) for s in self.sources):
      return None
    total = sum(s[1] for s in self.sources)
    return tuple(s[1] / total for s in self.sources)


def _sources(value: Any) -> tuple:
  """data.sources checked and normalised (JSON's lists to tuples): all plain specs, or all (spec, weight > 0)."""
  example = "data.sources=(('web/*.parquet', 0.7), ('code/*.jsonl.zst', 0.3))"
  if isinstance(value, str) or not isinstance(value, (tuple, list)) or not value:
    raise ConfigError(
      f"data.sources must name at least one source, as a tuple, e.g. data.sources=('corpus/*.txt',); got {value!r}"
    )
  out = []
  for entry in value:
    if isinstance(entry, (tuple, list)):
      ok = len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], (int, float))
      ok = ok and not isinstance(entry[1], bool) and math.isfinite(entry[1]) and entry[1] > 0
      if not ok:
        raise ConfigError(f"a weighted source is (spec, weight > 0), e.g. {example}; got {entry!r}")
      entry = (entry[0], float(entry[1]))
    elif not isinstance(entry, str):
      raise ConfigError(f"data.sources entries are strings or (spec, weight) pairs; got {entry!r}")
    spec = entry if isinstance(entry, str) else entry[0]
    if not spec.strip():
      raise ConfigError(f"data.sources must name at least one source, none empty; got {value!r}")
    out.append(entry)
  if len({isinstance(e, str) for e in out}) > 1:
    raise ConfigError(f"give every source a weight (a mixture, e.g. {example}) or none; got {value!r}")
  specs = [e if isinstance(e, str) else e[0] for e in out]
  if not isinstance(out[0], str) and len(set(specs)) < len(specs):
    raise ConfigError(f"a mixture names a source twice (one weight each): {value!r}")
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
  """Devices as data × fsdp × expert × context × tensor; -1 takes the devices the other axes leave.

  The ``mesh`` section, checked when built: an axis neither positive nor -1, two -1s or `dcn_data` below 1 is a
  `ConfigError`.

  Attributes:
    data: data parallelism: the batch is split over it.
    fsdp: fully sharded data parallelism: the batch and the parameters are split over it.
    expert: shards a mixture's experts (expert parallelism: tokens go to their experts' devices by all-to-all) and,
      like data and fsdp, the batch outside the experts.
    context: splits each sequence's tokens; attention exchanges keys and values by `model.context_strategy`.
    tensor: splits heads, the MLP's width and the vocabulary within each layer.
    dcn_data: > 1 spans the data axis over that many slices (multi-slice TPU, or GPU hosts): the other axes then stay
      within a slice.
  """

  SECTION = "mesh"
  data: int = 1
  fsdp: int = -1
  expert: int = 1
  # Splits each sequence's tokens (activations' "activation_length"): attention then exchanges keys and values
  # between the shards by model.context_strategy. For sequences too long for one device's activations.
  context: int = 1
  tensor: int = 1
  dcn_data: int = 1

  def __post_init__(self):
    self.check_types()
    sizes = [getattr(self, axis) for axis in MESH_AXES]
    for axis, size in zip(MESH_AXES, sizes):
      if size == 0 or size < -1:
        raise ConfigError(f"mesh.{axis} must be a positive integer or -1 (the rest of the devices), got {size}")
    if sizes.count(-1) > 1:
      given = ", ".join(f"{axis}={size}" for axis, size in zip(MESH_AXES, sizes))
      raise ConfigError(f"at most one mesh axis may be -1, got {given}")
    check_range("mesh.dcn_data", self.dcn_data, 1)

  def to_dict(self) -> dict[str, int]:
    """Each axis's size by name, `dcn_data` included."""
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
  ("expert", "expert"),  # a mixture's experts (each expert's own weights split by "embed" and "mlp" as the MLP's)
  ("norm", None),
  ("layers", None),
  # activations
  ("activation_batch", ("data", "fsdp", "expert")),
  ("activation_length", "context"),
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
  """Everything about a run, typed and checked: build it with ``run_config_from`` (from a ConfigDict or JSON).

  One frozen dataclass per section, and the rules between sections checked when built, a broken one a `ConfigError`:
  e.g. `train.seq_len` within `model.max_seq_len`, LoRA and DPO only with `init_from`, mesh axes that divide what they
  split. Every field, with its default, its allowed values and its meaning, is in the run-config reference.

  Attributes:
    model: the model's hyper-parameters.
    train: optimisation, cadence and bookkeeping.
    data: where the tokens come from and how they are split.
    mesh: how the devices are laid out.
    logical_axis_rules: (logical axis name, target) pairs, each target a mesh axis, None or a tuple of mesh axes:
      how parameters and activations are sharded over the mesh.
    init_from: a checkpoint directory whose parameters, only, initialise a new run, e.g. for SFT; empty: none.
    seed: the run's random seed, ≥ 0.
  """

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
      check_type(self, "", name)
    check_range("seed", self.seed, 0)
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
      on_experts = [t for t in self.train.lora.targets if t in ("w_gate", "w_up", "w_down")]
      if self.model.moe.enabled and on_experts:
        raise ConfigError(
          f"train.lora.targets {on_experts} are a mixture of experts' weights here, which LoRA does not adapt; "
          "use --config.train.lora.targets=\"('wq','wk','wv','wo')\""
        )
      if self.train.lora.rank > self.model.dim:
        raise ConfigError(
          f"train.lora.rank must be in [1, model.dim={self.model.dim}] (a rank past the width adds nothing), "
          f"got {self.train.lora.rank}"
        )
    experts, expert_axis = self.model.moe.num_experts, self.mesh.expert
    if expert_axis != 1 and not experts:
      raise ConfigError(
        f"mesh.expert={expert_axis} shards a mixture's experts, but model.moe.num_experts is 0 (a dense model)"
      )
    if expert_axis > 1 and experts % expert_axis:
      raise ConfigError(f"mesh.expert={expert_axis} does not divide model.moe.num_experts={experts}")
    if self.mesh.context > 1 and self.train.seq_len % self.mesh.context:
      raise ConfigError(
        f"mesh.context={self.mesh.context} must divide train.seq_len={self.train.seq_len} (each device holds an "
        "equal slice of every sequence)"
      )
    if (
      self.mesh.context > 1 and self.model.context_strategy == "zigzag" and self.train.seq_len % (2 * self.mesh.context)
    ):
      raise ConfigError(
        f"model.context_strategy='zigzag' needs 2 × mesh.context={2 * self.mesh.context} to divide "
        f"train.seq_len={self.train.seq_len} (each device holds two equal chunks of every sequence)"
      )
    if self.mesh.context > 1 and (
      problem := unsupported_context_kernel(self.model.attention, self.model.context_strategy)
    ):
      raise ConfigError(
        f"model.attention={self.model.attention!r} cannot run inside a context slice (mesh.context="
        f"{self.mesh.context}, model.context_strategy={self.model.context_strategy!r}): {problem}; use attention="
        "'auto' (splash with all_gather on TPU, else the XLA blocks)"
      )
    if self.train.seq_len > self.model.max_seq_len:
      raise ConfigError(
        f"train.seq_len {self.train.seq_len} is longer than model.max_seq_len "
        f"{self.model.max_seq_len}; raise --config.model.max_seq_len or lower train.seq_len"
      )

  SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "mesh": MeshConfig}

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> RunConfig:
    """Builds the checked config from a ConfigDict's ``to_dict()`` or a saved run_config.json.

    Args:
      values: section or top-level field name → value, a section as a mapping; missing keys take their defaults.

    Returns:
      The checked `RunConfig`.

    Raises:
      ConfigError: when a key is unknown, naming the closest known one, a section is not a mapping, or a value or a
        rule between fields fails its check.
    """
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
    """Every section and field as nested dicts: what `from_dict` takes back."""
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    """`to_dict` as indented JSON with sorted keys: what a workdir's run_config.json holds."""
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  def replace(self, **sections: Any) -> RunConfig:
    """A copy with whole sections or fields replaced, checked again: ``replace(train=dict(steps=5))``.

    Args:
      **sections: section or top-level field name → new value; a section's mapping changes the fields it names.

    Returns:
      The new `RunConfig`.

    Raises:
      ConfigError: when a changed section or the whole config fails a check.
    """
    changes = {
      k: dataclasses.replace(getattr(self, k), **v) if isinstance(v, Mapping) else v for k, v in sections.items()
    }
    return dataclasses.replace(self, **changes)


def run_config_from(config: Any) -> RunConfig:
  """The typed, checked `RunConfig` of a `RunConfig`, an ml_collections ConfigDict or a plain mapping.

  Every command builds it before it writes anything. A `RunConfig` comes back as it is.

  Args:
    config: a `RunConfig`, a ConfigDict such as a config file's ``get_config()``, or a mapping such as a loaded
      run_config.json.

  Returns:
    The `RunConfig`.

  Raises:
    ConfigError: when a key is unknown, naming the closest known one, or a value or a rule fails its check.
  """
  if isinstance(config, RunConfig):
    return config
  return RunConfig.from_dict(config.to_dict() if hasattr(config, "to_dict") else config)


def base_run_config():
  """Defaults that every ``configs/<name>.py`` starts from and then overrides, as an ml_collections ConfigDict.

  Made from the dataclasses' defaults, so that the defaults live in one place. A ConfigDict is the layer that config
  files write and ``--config.x.y=`` overrides change; the fields whose default is None get a declared type, so that an
  override can set them. Nothing is checked here: `run_config_from` checks the result.

  Returns:
    (ml_collections.ConfigDict): a section per `RunConfig.SECTIONS`, and the top-level fields.
  """
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
  """Imports ``configs/<name>.py`` and returns its ``get_config()`` ConfigDict.

  What absl's config_flags does, for library use and for config files built on other config files. Nothing is
  checked: `run_config_from` does that. An error the file itself raises reaches the caller as it is.

  Args:
    path: the config file, a Python file with a ``get_config()`` function.

  Returns:
    (ml_collections.ConfigDict): what the file's ``get_config()`` returns.

  Raises:
    ConfigError: when `path` is not a file.
  """
  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path!r}")
  spec = importlib.util.spec_from_file_location(f"llama_jax_config_{os.path.basename(path)[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()
