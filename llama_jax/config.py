"""Model configuration: one frozen, hashable dataclass, validated when it is built.

The run config (an ml_collections ConfigDict from ``configs/<name>.py``) holds everything about a run; the model only
ever sees the ``ModelConfig`` built from its ``model`` field, which is safe to pass as a static argument to ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

ROPE_SCALINGS = ("none", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn", "splash")


class ConfigError(ValueError):
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

  def __post_init__(self):
    if self.n_kv_heads is None:
      object.__setattr__(self, "n_kv_heads", self.n_heads)
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "max_seq_len",
                 "rope_original_max_len"):
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
      raise ConfigError(f"head_dim = dim / n_heads must be even for rotary embeddings, got {self.head_dim} "
                        f"(dim={self.dim}, n_heads={self.n_heads})")
    _check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
    _check_choice("dtype", self.dtype, DTYPES)
    _check_choice("param_dtype", self.param_dtype, DTYPES)
    _check_choice("remat", self.remat, REMAT_POLICIES)
    _check_choice("attention", self.attention, ATTENTION_IMPLS)
    if self.rope_scaling == "llama3":
      if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
        raise ConfigError("llama3 rope scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
                          f"rope_low_freq_factor={self.rope_low_freq_factor}, "
                          f"rope_high_freq_factor={self.rope_high_freq_factor}")

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
    """Parameter count from the shapes alone (the tests check it against the abstract model)."""
    d, f, h = self.dim, self.hidden_dim, self.head_dim
    attention = d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2
    layer = attention + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.n_layers * layer + d + head

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
    """Builds from a mapping (a ConfigDict's ``model`` field or saved JSON); unknown keys are an error."""
    values = dict(values)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"unknown model config keys {unknown}; known keys: {sorted(known)}")
    return cls(**values)


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def model_config_from(run_config: Any) -> ModelConfig:
  """The ModelConfig of a run config (ConfigDict with a ``model`` field) or of a plain mapping."""
  model = run_config.model if hasattr(run_config, "model") else run_config
  if hasattr(model, "to_dict"):
    model = model.to_dict()
  return ModelConfig.from_dict(model)


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


def base_run_config():
  """Defaults that every ``configs/<name>.py`` starts from and then overrides."""
  import ml_collections  # local import: the model must not need ml_collections

  cfg = ml_collections.ConfigDict()
  cfg.model = ml_collections.ConfigDict(ModelConfig().to_dict())
  cfg.model.n_kv_heads = ml_collections.FieldReference(None, field_type=int)
  cfg.model.ffn_dim_multiplier = ml_collections.FieldReference(None, field_type=float)
  cfg.model.ffn_hidden_dim = ml_collections.FieldReference(None, field_type=int)
  # Devices are arranged as data × fsdp × tensor; -1 takes the devices the other axes leave. dcn_data > 1 spans the
  # data axis over that many slices (multi-slice TPU, or GPU hosts): fsdp and tensor then stay within a slice.
  cfg.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1, dcn_data=1))
  cfg.logical_axis_rules = DEFAULT_LOGICAL_AXIS_RULES
  cfg.train = ml_collections.ConfigDict(dict(
      batch_size=8,  # global batch: sequences per optimizer step, over all devices and processes
      seq_len=256,  # tokens per sequence
      grad_accum=1,  # micro-batches per step (lax.scan); batch_size must be divisible by it
      steps=1000,
      lr=3e-4, warmup_steps=100, min_lr_ratio=0.1,  # linear warmup, then cosine decay to lr·min_lr_ratio
      b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,  # AdamW; decay on matrices only (not norm scales)
      clip_norm=1.0,  # global gradient-norm clipping (0: off)
      log_every=10, eval_every=200, eval_batches=50,  # eval_batches 0: the whole validation split
      save_every=200, keep=3, keep_every=0, async_save=True,  # keep the last `keep` plus every `keep_every`-th
      peak_flops_per_device=0.0,  # for MFU; 0: a table by device kind, or a measured matmul peak on CPU
      record_batches=False,  # append each step's batch digest to batches.jsonl (data provenance, resume checks)
  ))
  cfg.data = ml_collections.ConfigDict(dict(
      sources=("shakespeare",),  # files, directories, globs, *.jsonl, "shakespeare" or "shakespeare:play,play"
      val_sources=(),  # documents for validation (removed from training); empty: a val_fraction hash split
      val_fraction=0.0,
      text_field="text",  # JSONL field holding the document text
      tokenizer="",  # a sentencepiece .model to use; empty: train one on the training documents
      vocab_size=4096,  # for a trained tokenizer
      prepared_dir="",  # where tokenized shards go; empty: <workdir>/data
      format="text",  # text: pretraining documents | chat: conversations for SFT (chat template, assistant loss)
      on_error="skip",  # chat: a bad conversation is skipped and counted ("skip") or stops the run ("stop")
  ))
  # A checkpoint directory whose parameters (only: the optimizer starts fresh) initialise a new run, e.g. for SFT.
  cfg.init_from = ""
  cfg.seed = 0
  return cfg


def load_run_config(path: str):
  """Imports ``configs/<name>.py`` and returns its ``get_config()`` (what absl's config_flags does, for library use)."""
  import importlib.util
  import os

  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path!r}")
  spec = importlib.util.spec_from_file_location(f"llama_jax_config_{os.path.basename(path)[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def parse_flags_or_exit(argv: list[str]) -> list[str]:
  """absl flag parsing (``flags_parser`` for ``app.run``) that turns a bad flag or ``--config.x=`` override into a
  one-line error and exit status 2, instead of a traceback."""
  import sys

  from absl import flags

  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    cause = e
    while cause.__context__ is not None and isinstance(e, AttributeError):
      cause = cause.__context__  # ml_collections wraps the KeyError that holds the "did you mean" hint
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    what = f"unknown config key {cause}" if isinstance(cause, KeyError) else str(cause)
    print(f"error: bad flag or config override {overrides or argv[1:]}: {what}", file=sys.stderr)
    sys.exit(2)


def run_config_from_flag_or_exit(config_flag) -> tuple[Any, ModelConfig]:
  """(run config, model config) of a ``DEFINE_config_file`` flag; a missing file or a bad value exits with status 2
  and one line that names it."""
  import sys

  try:
    run_config = config_flag.value
    return run_config, model_config_from(run_config)
  except (OSError, ConfigError) as e:
    message = f"cannot load config file {str(e).split()[-1]}" if isinstance(e, OSError) else str(e)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> None:
  """``python -m llama_jax.config --config configs/X.py [--config.a.b=v]``: print the resolved run config."""
  from absl import app, flags
  from ml_collections import config_flags

  config_flag = config_flags.DEFINE_config_file("config", None, "run config file, e.g. configs/tiny.py")
  flags.mark_flags_as_required(["config"])

  def show(_):
    run_config, model = run_config_from_flag_or_exit(config_flag)
    print(run_config)
    print(f"model ({model.num_params():,} parameters, MLP width {model.hidden_dim}):")
    print(model.to_json())

  app.run(show, argv, flags_parser=parse_flags_or_exit)


if __name__ == "__main__":
  main()
