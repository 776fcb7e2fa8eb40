"""The typed run config: every bad value is refused in one place, as one line with exit status 2 from the train CLI,
before anything is written; typos in config files and overrides name the closest valid key."""

import json
import os
import textwrap

import pytest

from llama_jax import train
from llama_jax.core import run_config as run_config_lib
from llama_jax.core.checks import ConfigError
from llama_jax.core.run_config import RunConfig, run_config_from
from tests.conftest import ROOT
from tests.runs import run_main

TINY = "configs/tiny.py"
# (config file, overrides, the error line's fragment). tiny.py: steps 2000, save_every 500, max_seq_len 256,
# val_sources set; tiny_sft.py: data.format "chat".
BAD_RUN_CONFIGS = {
  "override_unknown_key": (TINY, ["--config.train.stpes=5"], "unknown config key 'stpes' (did you mean train.steps?)"),
  "override_unknown_section": (TINY, ["--config.trian.lr=1.0"], "unknown config key 'trian' (did you mean train?)"),
  "override_wrong_type": (TINY, ["--config.train.lr=abc"], "could not convert string to float: 'abc'"),
  "steps_zero": (TINY, ["--config.train.steps=0"], "train.steps must be ≥ 1, got 0"),
  "batch_not_divisible_by_accum": (
    TINY,
    ["--config.train.batch_size=6", "--config.train.grad_accum=4"],
    "train.batch_size 6 is not divisible by train.grad_accum 4",
  ),
  "negative_lr": (TINY, ["--config.train.lr=-0.1"], "train.lr must be > 0, got -0.1"),
  "b2_one": (TINY, ["--config.train.b2=1.0"], "train.b2 must be in [0, 1), got 1.0"),
  "min_lr_ratio": (TINY, ["--config.train.min_lr_ratio=1.5"], "train.min_lr_ratio must be in [0, 1], got 1.5"),
  "keep_every_off_cadence": (
    TINY,
    ["--config.train.keep_every=300"],
    "train.keep_every 300 must be a multiple of train.save_every 500",
  ),
  "negative_eval_every": (TINY, ["--config.train.eval_every=-1"], "train.eval_every must be ≥ 0, got -1"),
  "profile_start_zero": (
    TINY,
    ["--config.train.profile_steps=(0,3)"],
    "train.profile_steps must be (start, count) with start ≥ 1 and count ≥ 1",
  ),
  "profile_past_end": (
    TINY,
    ["--config.train.profile_steps=(1999,5)"],
    "train.profile_steps (1999, 5) ends at step 2003, past train.steps 2000",
  ),
  "seq_len_past_model": (
    TINY,
    ["--config.train.seq_len=512"],
    "train.seq_len 512 is longer than model.max_seq_len 256",
  ),
  "data_format": (TINY, ["--config.data.format=tsv"], "data.format must be one of text, chat, preference; got 'tsv'"),
  "on_error": (TINY, ["--config.data.on_error=ignore"], "data.on_error must be one of skip, stop; got 'ignore'"),
  "val_fraction_one": (
    TINY,
    ["--config.data.val_sources=()", "--config.data.val_fraction=1.0"],
    "data.val_fraction must be in [0, 1), got 1.0",
  ),
  "val_sources_and_fraction": (
    TINY,
    ["--config.data.val_fraction=0.1"],
    "set data.val_sources or data.val_fraction, not both",
  ),
  "no_sources": (TINY, ["--config.data.sources=()"], "data.sources must name at least one source"),
  "chat_with_val_sources": (
    "configs/tiny_sft.py",
    ["--config.data.val_sources=('x.jsonl',)", "--config.data.val_fraction=0.0"],
    "is not used with data.format='chat'",
  ),
  "mesh_zero": (
    TINY,
    ["--config.mesh.data=0"],
    "mesh.data must be a positive integer or -1 (the rest of the devices), got 0",
  ),
  "mesh_two_minus_one": (TINY, ["--config.mesh.data=-1"], "at most one mesh axis may be -1"),
  "negative_seed": (TINY, ["--config.seed=-1"], "seed must be ≥ 0, got -1"),
  "model_heads": (TINY, ["--config.model.n_heads=3"], "dim must be divisible by n_heads, got dim=128, n_heads=3"),
  "moe_top_k": (
    TINY,
    ["--config.model.moe.num_experts=4", "--config.model.moe.top_k=5"],
    "model.moe.top_k must be between 1 and num_experts=4, got 5",
  ),
  "expert_axis_on_dense": (TINY, ["--config.mesh.expert=2"], "mesh.expert=2 shards a mixture's experts"),
  "expert_axis_indivisible": (
    TINY,
    ["--config.model.moe.num_experts=6", "--config.mesh.expert=4"],
    "mesh.expert=4 does not divide model.moe.num_experts=6",
  ),
  "moe_lora_on_experts": (
    TINY,
    ["--config.model.moe.num_experts=4", "--config.train.lora.rank=4", "--config.init_from=/nonexistent"],
    "train.lora.targets ['w_gate', 'w_up', 'w_down'] are a mixture of experts' weights here",
  ),
  "file_unknown_key": (
    "typo_train.py",
    [],
    "typo_train.py: unknown run config key train.stpes (did you mean train.steps?)",
  ),
  "file_unknown_top_level_key": ("typo_seed.py", [], "typo_seed.py: unknown run config key sed (did you mean seed?)"),
  # ConfigDict's own type check fires inside the file: still one line, naming the file and the field.
  "file_string_for_tuple": (
    "string_sources.py",
    [],
    "string_sources.py: TypeError: Could not override field 'sources'",
  ),
}
CONFIG_FILES = {
  "typo_train.py": "cfg.train.update(stpes=5)",  # the typo that used to train 1,000 steps silently
  "typo_seed.py": "cfg.sed = 3",
  "string_sources.py": "cfg.data.sources = 'shakespeare'",
}


@pytest.fixture(scope="module")
def config_files(tmp_path_factory):
  """CONFIG_FILES written once into a directory."""
  base = tmp_path_factory.mktemp("bad_configs")
  for name, line in CONFIG_FILES.items():
    # An unlocked ConfigDict accepts the new key or value; the typed RunConfig built from it refuses it.
    (base / name).write_text(
      textwrap.dedent(f"""\
        from llama_jax import config as config_lib


        def get_config():
          cfg = config_lib.base_run_config()
          {line}
          return cfg
        """)
    )
  return base


@pytest.mark.parametrize("case", BAD_RUN_CONFIGS)
def test_bad_run_config_is_one_line_exit_2_and_nothing_is_written(config_files, case, tmp_path, capfd):
  """Each bad config through the train command's main in this process (its checks, not its process, are tested)."""
  config, overrides, message = BAD_RUN_CONFIGS[case]
  path = os.path.join(ROOT, config) if config.startswith("configs/") else str(config_files / config)
  workdir = tmp_path / "workdir"
  returncode, stdout, stderr = run_main(
    train.main, ["train", "--config", path, "--workdir", str(workdir), *overrides], capfd
  )
  lines = stderr.strip().splitlines()
  assert returncode == 2, (returncode, stdout[-2000:], stderr[-2000:])
  assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
  assert message in lines[0], lines[0]
  assert not workdir.exists()


def test_every_shipped_config_file_is_a_valid_run_config():
  for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
    if name.endswith(".py"):
      run_config = run_config_from(run_config_lib.load_run_config(os.path.join(ROOT, "configs", name)))
      assert isinstance(run_config, RunConfig) and run_config.train.seq_len <= run_config.model.max_seq_len, name


def test_run_config_round_trips_through_its_json_and_is_hashable():
  run_config = run_config_from(run_config_lib.load_run_config(os.path.join(ROOT, "configs", "tiny_sft.py")))
  again = run_config_from(json.loads(run_config.to_json()))  # JSON has lists where the config has tuples
  assert again == run_config and hash(again) == hash(run_config)
  assert again.data.sources == ("chitchat", "chatterbot:english,chinese") and again.data.format == "chat"


def test_defaults_live_once_in_the_dataclasses():
  assert run_config_from(run_config_lib.base_run_config()) == RunConfig()


def test_replace_checks_the_new_values_again():
  run_config = RunConfig()
  assert run_config.replace(train=dict(steps=5)).train.steps == 5
  with pytest.raises(ConfigError, match="train.batch_size 8 is not divisible by train.grad_accum 3"):
    run_config.replace(train=dict(grad_accum=3))


@pytest.mark.parametrize(
  "values,message",
  [
    (dict(train=dict(steps=True)), "train.steps must be an integer, got True"),
    (dict(train=dict(async_save=1)), "train.async_save must be True or False, got 1"),
    (dict(data=dict(sources=("a", ""))), "data.sources must name at least one source, none empty"),
    (dict(logical_axis_rules=(("embed", "pipeline"),)), "maps 'embed' to unknown mesh axis 'pipeline'"),
    (dict(mesh=dict(dcn_data=0)), "mesh.dcn_data must be ≥ 1, got 0"),
    (dict(train=[1]), "train must be a section of keys, got [1]"),
  ],
)
def test_library_callers_get_the_same_checks(values, message):
  with pytest.raises(ConfigError) as excinfo:
    RunConfig.from_dict(values)
  assert message in str(excinfo.value)
