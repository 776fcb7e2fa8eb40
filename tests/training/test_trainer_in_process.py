"""The trainer inside the test process (the fast tier's view of what tests/training/test_train.py checks through the
command): the micro run of tests/runs.py trains, evaluates and saves, and a resume from an earlier step after the
later ones are gone reaches the bit-identical final state with the same batches."""

import ast
import os
import shutil

from llama_jax.core import run_config as run_config_lib
from llama_jax.training.trainer import train
from tests.conftest import ROOT, needs_shakespeare
from tests.runs import MICRO, assert_bit_identical, assert_same_batches, final_checkpoint, read_jsonl

pytestmark = needs_shakespeare


def micro_config(tokenizer: str):
  """configs/tiny.py shrunk by MICRO, as the command line would set it."""
  cfg = run_config_lib.load_run_config(os.path.join(ROOT, "configs", "tiny.py"))
  for flag in (*MICRO, f"--config.data.tokenizer={tokenizer}"):
    key, value = flag[len("--config.") :].split("=", 1)
    section, name = key.split(".")
    cfg[section][name] = value if isinstance(cfg[section][name], str) else ast.literal_eval(value)
  return cfg


def test_a_micro_run_trains_saves_and_resumes_bit_identically_in_process(tmp_path, small_tokenizer):
  straight = tmp_path / "straight"
  result = train(micro_config(small_tokenizer), str(straight))
  assert result["step"] == 12 and result["val"]["loss"] > 0
  steps = [r for r in read_jsonl(straight / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in steps] == list(range(1, 13)) and steps[-1]["loss"] < steps[0]["loss"]
  assert sorted(d for d in os.listdir(straight / "checkpoints") if d.isdigit()) == ["12", "4", "8"]
  resumed = tmp_path / "resumed"
  shutil.copytree(straight, resumed)
  for step in ("8", "12"):
    shutil.rmtree(resumed / "checkpoints" / step)
  assert train(micro_config(small_tokenizer), str(resumed))["step"] == 12
  assert_bit_identical(final_checkpoint(straight, 12), final_checkpoint(resumed, 12))
  assert_same_batches(resumed, straight)
