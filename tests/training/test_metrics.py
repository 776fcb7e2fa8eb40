"""The metrics writer's windows: an evaluation's time is left out of throughput without losing the steps of the
window it interrupts (a run whose last step was evaluated before its last line crashed at the end, unsaved); the
window's time split into phases adds up to its wall time."""

import json

import jax.numpy as jnp
import pytest

from llama_jax.training import goodput
from llama_jax.training import metrics as metrics_lib


class Clock:
  """time.perf_counter as the test sets it."""

  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now


def step_metrics(loss: float) -> dict:
  return dict(loss=jnp.float32(loss), grad_norm=jnp.float32(1.0), lr=jnp.float32(1e-3), tokens=jnp.float32(64))


def test_an_evaluation_before_the_last_line_keeps_the_windows_steps_and_leaves_out_its_time(tmp_path, monkeypatch):
  clock = Clock()
  monkeypatch.setattr(goodput.time, "perf_counter", clock)
  monkeypatch.setattr(goodput, "compile_seconds", lambda: 0.0)  # jnp's own small compiles would blur the sums
  writer = metrics_lib.MetricsWriter(
    str(tmp_path), True, log_every=50, tokens_per_step=64, flops_per_step=1e6, peak_flops=1e9, start_step=0, echo=print
  )
  for step in (1, 2, 3):
    with writer.clock.measure("data"):
      clock.now += 0.5  # waiting for the batch
    clock.now += 1.5  # the step
    writer.add_step(step, step_metrics(4.0 - step))
  with writer.clock.measure("eval"):
    writer.flush()  # what an evaluation at the run's last step does first: no line is due at step 3 (log_every 50)
    clock.now += 30.0  # the evaluation
  writer.finish()
  writer.close()
  record = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
  assert record["step"] == 3 and record["loss"] == pytest.approx(2.0)
  assert record["step_time_s"] == pytest.approx(2.0)  # three steps in 6 s of training, not 36 s
  assert record["tokens_per_s"] == pytest.approx(32.0)
  assert record["time_eval_s"] == pytest.approx(30.0) and record["time_data_s"] == pytest.approx(1.5)
  assert record["time_device_s"] == pytest.approx(4.5) and record["time_checkpoint_s"] == 0
  assert "goodput" not in record  # no ledger given
