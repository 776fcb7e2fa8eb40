"""ModelConfig validation, the presets' parameter counts (abstract, nothing allocated), and run-config overrides."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from llama_jax.core import model_config as model_config_lib
from llama_jax.core import run_config as run_config_lib
from llama_jax.core.checks import ConfigError
from llama_jax.core.model_config import ModelConfig
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from tests.conftest import ROOT

SMALL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)

BAD_CONFIGS = [
  (dict(dim=60, n_heads=8), "dim must be divisible by n_heads"),
  (dict(n_heads=4, n_kv_heads=3), "n_kv_heads must divide n_heads, got n_kv_heads=3"),
  (dict(n_heads=4, n_kv_heads=8), "n_kv_heads must divide n_heads, got n_kv_heads=8"),
  (dict(dim=36, n_heads=4, n_kv_heads=4), "head_dim = dim / n_heads must be even for rotary embeddings, got 9"),
  (dict(vocab_size=0), "vocab_size must be a positive integer, got 0"),
  (dict(n_layers=-2), "n_layers must be a positive integer, got -2"),
  (dict(dim=64.0), "dim must be a positive integer, got 64.0"),
  (dict(multiple_of=0), "multiple_of must be a positive integer, got 0"),
  (dict(max_seq_len=0), "max_seq_len must be a positive integer, got 0"),
  (dict(norm_eps=0.0), "norm_eps must be a finite number > 0, got 0.0"),
  (dict(rope_theta=-1.0), "rope_theta must be a finite number > 0, got -1.0"),
  (dict(rope_scaling="yarn"), "rope_scaling must be one of none, linear, llama3; got 'yarn'"),
  (
    dict(rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0),
    "rope_low_freq_factor=4.0, rope_high_freq_factor=1.0",
  ),
  (dict(dtype="float8"), "dtype must be one of float32, bfloat16, float16; got 'float8'"),
  (dict(param_dtype="int8"), "param_dtype must be one of float32, bfloat16, float16; got 'int8'"),
  (dict(remat="some"), "remat must be one of none, full, dots, dots_no_batch; got 'some'"),
  (dict(attention="flash"), "attention must be one of auto, xla, chunked, cudnn, splash; got 'flash'"),
  (dict(ffn_dim_multiplier=-1.0), "ffn_dim_multiplier must be > 0 or None, got -1.0"),
  (dict(ffn_hidden_dim=0), "ffn_hidden_dim must be a positive integer or None, got 0"),
]


@pytest.mark.parametrize("changes,message", BAD_CONFIGS, ids=[m.split(" ")[0] for _, m in BAD_CONFIGS])
def test_bad_model_config_is_rejected_naming_field_and_value(changes, message):
  with pytest.raises(ConfigError) as excinfo:
    ModelConfig(**{**SMALL, **changes})
  assert message in str(excinfo.value)


def test_unknown_model_config_key_is_rejected():
  with pytest.raises(ConfigError, match=r"unknown model config keys \['hidden'\]"):
    ModelConfig.from_dict({**SMALL, "hidden": 3})


def test_model_config_is_hashable_and_round_trips_through_json():
  cfg = ModelConfig(**SMALL)
  assert hash(cfg) == hash(ModelConfig(**SMALL))
  assert cfg.n_kv_heads == 2 and ModelConfig(**{**SMALL, "n_kv_heads": None}).n_kv_heads == 4
  import json

  assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg


def abstract_param_count(cfg: ModelConfig) -> int:
  _, state = sharding.abstract_model(Llama, cfg)
  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nnx.to_pure_dict(state)))


@pytest.mark.parametrize(
  "name,expected", [("llama2_7b", 6_738_415_616), ("llama2_13b", 13_015_864_320), ("llama2_70b", 68_976_648_192)]
)
def test_preset_parameter_counts_from_abstract_init(name, expected):
  cfg = model_config_lib.model_config_from(run_config_lib.load_run_config(os.path.join(ROOT, "configs", f"{name}.py")))
  assert abstract_param_count(cfg) == expected
  assert cfg.num_params() == expected


def test_70b_preset_uses_metas_hyper_parameters():
  cfg = model_config_lib.model_config_from(
    run_config_lib.load_run_config(os.path.join(ROOT, "configs", "llama2_70b.py"))
  )
  assert (cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim_multiplier, cfg.multiple_of, cfg.hidden_dim) == (
    64,
    8,
    1.3,
    4096,
    28672,
  )


# The devices each config is written for (its docstring names the slice); the rest run anywhere (8 here).
CONFIG_DEVICES = {
  "tpu_v4.py": 16,
  "gpu_h100x8.py": 8,
  "llama2_13b.py": 32,
  "llama2_70b.py": 64,
  "llama3_8b.py": 16,
  "llama3_70b.py": 64,
  "mixtral_8x7b.py": 64,
}


def test_every_config_file_builds_a_valid_model_config_and_mesh():
  for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
    if name.endswith(".py"):
      run_config = run_config_lib.load_run_config(os.path.join(ROOT, "configs", name))
      model = model_config_lib.model_config_from(run_config)
      data, fsdp, expert, context, tensor = sharding.resolve_mesh_shape(run_config.mesh, CONFIG_DEVICES.get(name, 8))
      assert run_config.train.batch_size % (data * fsdp * expert) == 0, name
      assert run_config.train.seq_len % context == 0, name
      assert model.n_kv_heads % tensor == 0, name
      assert model.moe.num_experts % expert == 0, name


def test_tpu_v4_config_is_7b_on_16_chips():
  run_config = run_config_lib.load_run_config(os.path.join(ROOT, "configs", "tpu_v4.py"))
  assert model_config_lib.model_config_from(run_config).num_params() == 6_738_415_616
  assert sharding.resolve_mesh_shape(run_config.mesh, 16) == (1, 16, 1, 1, 1)
  assert run_config.train.batch_size % 16 == 0


def run_show(*args):
  return subprocess.run(
    [sys.executable, "-m", "llama_jax.config", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
  )


def test_command_line_overrides_go_through_absl_config_flags():
  result = run_show(
    "--config", "configs/tiny.py", "--config.model.dim=256", "--config.model.n_kv_heads=2", "--config.mesh.tensor=2"
  )
  assert result.returncode == 0, result.stderr
  assert '"dim": 256' in result.stdout and '"n_kv_heads": 2' in result.stdout
  assert "tensor: 2" in result.stdout


def test_command_line_rejects_unknown_key_and_bad_value():
  result = run_show("--config", "configs/tiny.py", "--config.model.hidden=3")
  assert result.returncode != 0 and "hidden" in result.stderr
  result = run_show("--config", "configs/tiny.py", "--config.model.n_heads=3")
  assert result.returncode == 2
  assert "dim must be divisible by n_heads, got dim=128, n_heads=3" in result.stderr
