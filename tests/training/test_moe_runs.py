"""A mixture of experts trained by the training command: the balance losses and expert loads in the log line,
metrics.jsonl and TensorBoard; the checkpoint evaluated and sampled by the same commands as a dense model's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.runs import run_module, run_train, train_in_process
from tests.training.test_multiprocess import tensorboard_scalars

MOE = ["--config.model.moe.num_experts=4", "--config.model.moe.top_k=2", "--config.model.moe.z_loss_weight=0.001"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, small_tokenizer):
  workdir = tmp_path_factory.mktemp("moe") / "run"
  result = run_train(workdir, small_tokenizer, *MOE)
  return workdir, result.stdout


def test_the_log_line_metrics_and_tensorboard_carry_the_balance_losses_and_expert_loads(moe_run):
  workdir, stdout = moe_run
  lines = [line for line in stdout.splitlines() if line.startswith("step ") and "| loss " in line]
  assert lines and all(f"| {key} " in lines[-1] for key in ("moe_balance", "moe_z", "moe_imbalance"))
  assert "moe_load/" not in stdout  # per-layer detail goes to the files, not the line
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if "loss" in r]
  assert len(train) == 12
  losses = [r["loss"] for r in train]
  assert np.mean(losses[-3:]) < losses[0] - 0.5
  for record in train:
    loads = np.array([[record[f"moe_load/{layer}/{expert}"] for expert in range(4)] for layer in range(2)])
    np.testing.assert_allclose(loads.sum(axis=1), 1.0, rtol=1e-5)  # each layer's shares of its assignments
    if loads.min() > 0:  # (an idle expert counts as one assignment: the ratio stays finite)
      assert record["moe_imbalance"] == pytest.approx((loads.max(axis=1) / loads.min(axis=1)).max(), rel=1e-5)
    # top-2 of 4: the balance loss is top_k (2.0) when perfectly balanced and at least 2·top_k/num_experts = 1.
    assert 1.0 <= record["moe_balance"] < 4.0 and record["moe_z"] > 0
  tags = {tag for tag, _ in tensorboard_scalars(workdir / "tensorboard")}
  assert {"moe_balance", "moe_z", "moe_imbalance", "moe_load/1/3"} <= tags


def test_evaluate_and_sample_run_the_moe_checkpoint(moe_run):
  workdir, _ = moe_run
  result = run_module("llama_jax.evaluate", "--checkpoint", str(workdir), "--max_batches", "2")
  assert result.returncode == 0, result.stderr[-3000:]
  result = run_module("llama_jax.sample", "--checkpoint", str(workdir), "--prompt", "ROMEO:", "--max_new_tokens", "8")
  assert result.returncode == 0 and result.stdout.strip(), result.stderr[-3000:]


def test_moe_every_second_block_trains_and_a_changed_every_is_refused(tmp_path, small_tokenizer, capfd):
  """moe.every=2 over 4 layers: the loads are logged for blocks 1 and 3 (named by block, not by MoE row), the loss
  falls; resuming the workdir with moe.every=1 (a different parameter tree) is refused in one line."""
  workdir = tmp_path / "run"
  every = [*MOE, "--config.model.n_layers=4", "--config.model.moe.every=2"]
  run_train(workdir, small_tokenizer, *every)
  train = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in train if "loss" in r]
  assert np.mean([r["loss"] for r in train[-3:]]) < train[0]["loss"] - 0.5
  for record in train:
    layers = {int(key.split("/")[1]) for key in record if key.startswith("moe_load/")}
    assert layers == {1, 3}
    for layer in layers:
      assert sum(record[f"moe_load/{layer}/{e}"] for e in range(4)) == pytest.approx(1.0, rel=1e-5)
  result = train_in_process(capfd, workdir, small_tokenizer, *every[:-1], "--config.model.moe.every=1")
  assert result.returncode == 2, result.stderr[-2000:]
  assert "moe.every" in result.stderr.strip().splitlines()[-1]
