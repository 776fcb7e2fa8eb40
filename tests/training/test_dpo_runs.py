"""DPO runs end to end through the CLI: at step 0 the held-out loss is log 2 and the reward accuracy 0.5, a few dozen
steps raise the held-out reward accuracy (full and LoRA, whose reference is the base alone), the reference is
recorded and checked on resume, and a preference run without a model to tune is one line."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from llama_jax.checkpoint import records
from llama_jax.core import paths
from tests.conftest import needs_shakespeare
from tests.runs import assert_one_line_error, read_jsonl, run_train, train_in_process

pytestmark = needs_shakespeare
SUBJECTS = "sea moon king night love death sword crown storm rose ghost wine".split()


def write_pairs(path, n=160, seed=0):
  """Learnable pairs: a kind answer about the prompt's subject is chosen, a curt one about another subject rejected
  (a held-out pair shares the two answer styles, not its words, with the training pairs)."""
  rng = np.random.RandomState(seed)
  with open(path, "w") as f:
    for i in range(n):
      subject, other = rng.choice(SUBJECTS, 2, replace=False)
      pair = dict(
        prompt=f"Tell me of the {subject}.",
        chosen=f"Gladly: the {subject} is fair.",
        rejected=f"No. Go, {other}!",
        id=i,
      )
      f.write(json.dumps(pair) + "\n")
  return str(path)


def dpo_args(base, pairs, *extra):
  return [
    f"--config.init_from={base}",
    "--config.data.format=preference",
    f"--config.data.sources=('{pairs}',)",
    "--config.data.val_sources=()",
    "--config.data.val_fraction=0.25",
    "--config.train.seq_len=64",
    "--config.train.steps=20",
    "--config.train.lr=3e-3",
    "--config.train.warmup_steps=2",
    "--config.train.dpo_beta=0.5",
    "--config.train.eval_every=20",
    "--config.train.eval_batches=0",
    "--config.train.save_every=10",
    "--config.train.record_batches=False",
    *extra,
  ]


@pytest.fixture(scope="module")
def base_and_pairs(tmp_path_factory, small_tokenizer):
  root = tmp_path_factory.mktemp("dpo")
  base = root / "base"
  run_train(base, small_tokenizer, "--config.train.steps=12")
  return base, write_pairs(root / "pairs.jsonl")


def val_metrics(workdir):
  return [m for m in read_jsonl(workdir / "metrics.jsonl") if "val_loss" in m]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_starts_at_log_2_and_raises_held_out_reward_accuracy(base_and_pairs, tmp_path, small_tokenizer, lora):
  base, pairs = base_and_pairs
  extra = ["--config.train.lora.rank=4", "--config.train.lr=1e-2"] if lora else []
  workdir = tmp_path / "dpo"
  result = run_train(workdir, small_tokenizer, *dpo_args(base, pairs, *extra))
  held_out = int(re.search(r"preference pairs: train \d+, val (\d+)", result.stdout).group(1))
  assert "skipped 0 bad" in result.stdout and held_out >= 25, result.stdout  # every pair fits; ~40 held out
  start, end = val_metrics(workdir)[0], val_metrics(workdir)[-1]
  assert start["step"] == 0 and start["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
  assert start["val_reward_accuracy"] == 0.5 and start["val_margin"] == 0.0
  print(
    f"lora={lora}: held-out loss {start['val_loss']:.4f} → {end['val_loss']:.4f}, reward accuracy "
    f"{start['val_reward_accuracy']:.3f} → {end['val_reward_accuracy']:.3f}"
  )
  assert end["val_reward_accuracy"] > 0.8 and end["val_loss"] < start["val_loss"]
  train_lines = [m for m in read_jsonl(workdir / "metrics.jsonl") if "grad_norm" in m]
  assert {"reward_accuracy", "margin", "reward_chosen", "reward_rejected"} <= set(train_lines[0])
  assert "perplexity" not in train_lines[0]
  record = records.read_record(workdir, paths.LORA_FILE if lora else paths.REFERENCE_FILE)
  assert record["base"] == str(base) and record["base_step"] == 12, result.stdout


def test_a_preference_run_needs_a_model_to_tune(base_and_pairs, tmp_path, small_tokenizer, capfd):
  _, pairs = base_and_pairs
  args = [a for a in dpo_args("x", pairs) if not a.startswith("--config.init_from")]
  result = train_in_process(capfd, tmp_path / "no_init", small_tokenizer, *args)
  assert_one_line_error(result, "data.format='preference' (DPO) tunes a trained model", "set init_from")
