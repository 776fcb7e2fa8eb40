"""Non-finite losses and weights: a step with a NaN loss is never applied; train.on_nonfinite="stop" ends the run with
one line naming the step and saves nothing after it, "skip" leaves the state bit-identical across the step and stops
after train.max_skipped_steps in a row; sample, evaluate and convert refuse checkpoints holding NaN."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from llama_jax.checkpoint import digests
from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core.model_config import ModelConfig
from llama_jax.model.llama import Llama
from tests.conftest import ROOT, needs_shakespeare
from tests.runs import assert_bit_identical, assert_one_line_error, final_checkpoint, read_jsonl, run_train

NAN_AT = ("tests.fault_injection", "nan")


def saved_steps(workdir):
  return sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())


def all_finite(tree):
  return all(np.isfinite(np.asarray(a, np.float64)).all() for a in jax.tree.leaves(tree))


@needs_shakespeare
def test_stop_names_the_step_and_saves_nothing_after_it(tmp_path, small_tokenizer):
  workdir = tmp_path / "stop"
  result = run_train(workdir, small_tokenizer, "--config.train.save_every=2", module=(*NAN_AT, "6"), check=False)
  assert_one_line_error(result, "step 6: the loss or the gradients are not finite", "the latest checkpoint is step 4")
  # Steps 2 and 4 were saved and kept; step 6 (and anything after it) never was.
  assert saved_steps(workdir) == [2, 4]
  assert all_finite(final_checkpoint(workdir, 4))
  assert max(r["step"] for r in read_jsonl(workdir / "metrics.jsonl")) <= 6


@needs_shakespeare
def test_a_learning_rate_typo_stops_before_the_first_save_and_says_nothing_is_saved(tmp_path, small_tokenizer):
  # lr=1e30 (a typo for 1e-3): the loss is no longer finite by step 3, before the first save at step 4.
  workdir = tmp_path / "typo"
  result = run_train(workdir, small_tokenizer, "--config.train.lr=1e30", check=False)
  assert_one_line_error(result, "the loss or the gradients are not finite", "no checkpoint is saved yet")
  assert not os.path.isdir(workdir / "checkpoints") or saved_steps(workdir) == []


@needs_shakespeare
def test_skip_leaves_the_state_bit_identical_across_the_step(tmp_path, small_tokenizer):
  workdir = tmp_path / "skip"
  run_train(
    workdir,
    small_tokenizer,
    "--config.train.on_nonfinite=skip",
    "--config.train.save_every=1",
    "--config.train.keep=20",
    "--config.train.eval_every=0",
    module=(*NAN_AT, "6"),
  )
  assert saved_steps(workdir) == list(range(1, 13))
  before, skipped, after = (final_checkpoint(workdir, s) for s in (5, 6, 7))
  # The skipped step changed neither the parameters nor AdamW's moments and count; the next one trains again.
  assert_bit_identical(before["params"], skipped["params"])
  assert_bit_identical(before["train"]["opt_state"], skipped["train"]["opt_state"])
  assert not np.array_equal(skipped["params"]["embed"], after["params"]["embed"])
  records = {r["step"]: r for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r}
  assert records[6].get("skipped_steps") == 1 and "skipped_steps" not in records[7]
  assert all(np.isfinite(r["loss"]) for s, r in records.items() if s != 6)


@needs_shakespeare
def test_skip_stops_after_max_skipped_steps_in_a_row(tmp_path, small_tokenizer):
  workdir = tmp_path / "skip_many"
  result = run_train(
    workdir,
    small_tokenizer,
    "--config.train.on_nonfinite=skip",
    "--config.train.max_skipped_steps=3",
    module=(*NAN_AT, "6:5"),
    check=False,
  )
  assert_one_line_error(
    result, "steps 6–8: 3 steps in a row with non-finite loss or gradients", "train.max_skipped_steps is 3"
  )
  assert saved_steps(workdir) == [4]  # step 8 is a save step: checked before saving, so never saved


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory, small_tokenizer):
  """A checkpoint directory whose weights hold a NaN (what an unguarded diverged run or a damaged file leaves)."""
  cfg = ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, multiple_of=16, max_seq_len=64)
  params = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0)))))  # writable copies
  params["layers"]["mlp"]["w_up"][1, 3, 5] = np.nan
  directory = str(tmp_path_factory.mktemp("nan") / "ckpt")
  checkpoint_params.save_params_dir(directory, cfg, params, tokenizer_path=small_tokenizer)
  return directory


def test_loading_refuses_non_finite_weights(nan_checkpoint):
  with pytest.raises(
    digests.CheckpointError,
    match=r"step 0 holds non-finite values \(NaN or infinity\) in "
    r"layers/mlp/w_up",
  ):
    checkpoint_params.load_params(nan_checkpoint)


@pytest.mark.parametrize(
  "command",
  [
    ["llama_jax.sample", "--prompt", "ROMEO:", "--max_new_tokens", "4"],
    ["llama_jax.evaluate", "--data", "shakespeare:sonnets", "--seq_len", "32"],
    ["llama_jax.convert", "--to_hf", "CKPT", "--out", "OUT"],
  ],
)
def test_sample_evaluate_and_convert_refuse_non_finite_weights(nan_checkpoint, tmp_path, command):
  args = [a.replace("CKPT", nan_checkpoint).replace("OUT", str(tmp_path / "hf")) for a in command]
  if "--to_hf" not in args:
    args += ["--checkpoint", nan_checkpoint]
  result = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert_one_line_error(result, "holds non-finite values (NaN or infinity) in layers/mlp/w_up")
  assert not (tmp_path / "hf").exists()


def test_bad_policy_is_refused():
  from llama_jax.core.checks import ConfigError
  from llama_jax.core.run_config import RunConfig

  with pytest.raises(ConfigError, match="train.on_nonfinite must be one of stop, skip; got 'ignore'"):
    RunConfig().replace(train=dict(on_nonfinite="ignore"))
  with pytest.raises(ConfigError, match="train.max_skipped_steps must be ≥ 1, got 0"):
    RunConfig().replace(train=dict(max_skipped_steps=0))


def test_metrics_json_stays_parsable_with_a_nan_loss(tmp_path):
  from llama_jax.training.metrics import MetricsWriter

  writer = MetricsWriter(
    str(tmp_path),
    True,
    log_every=1,
    tokens_per_step=1,
    flops_per_step=1.0,
    peak_flops=1.0,
    start_step=0,
    echo=lambda line: None,
  )
  writer.add_step(
    1,
    dict(
      loss=np.float32(np.nan),
      grad_norm=np.float32(np.nan),
      lr=np.float32(0.1),
      tokens=np.float32(4),
      nonfinite=np.int32(1),
    ),
  )
  writer.finish()
  record = json.loads((tmp_path / "metrics.jsonl").read_text())
  assert record["skipped_steps"] == 1
