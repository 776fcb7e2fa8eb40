"""Goodput and the step-time split (training/goodput.py): a run with a deliberately slow data source shows the wait in
its data share, the phases of each window add up to its wall time, and goodput.json keeps totals across restarts,
setting aside the time of steps that a resume from an older checkpoint trained again."""

import json
import re
import time

import jax
import jax.numpy as jnp
import pytest

from llama_jax.training import goodput
from tests.conftest import needs_shakespeare
from tests.runs import read_jsonl, run_train, run_train_patched

DELAY_S = 0.25
PHASES = ("device", "data", "checkpoint", "eval", "compile")

SLOW_DATA = f"""
import dataclasses, time
from llama_jax.training import trainer

class SlowBatches:  # the run's iterator, each batch DELAY_S late; its state is the real one's
  def __init__(self, inner):
    self.inner = inner
  def __iter__(self):
    return self
  def __next__(self):
    time.sleep({DELAY_S})
    return next(self.inner)
  def get_state(self):
    return self.inner.get_state()
  def set_state(self, state):
    self.inner.set_state(state)

class SlowDataset:
  def __init__(self, dataset):
    self.dataset = dataset
  def __iter__(self):
    return SlowBatches(iter(self.dataset))

prepare = trainer.prepare_run_data
def slow_prepare(*args, **kwargs):
  tokenizer, run_data = prepare(*args, **kwargs)
  return tokenizer, dataclasses.replace(run_data, dataset=SlowDataset(run_data.dataset))
trainer.prepare_run_data = slow_prepare
"""


@needs_shakespeare
def test_a_slow_data_source_shows_as_data_wait(tmp_path, small_tokenizer):
  fast, slow = tmp_path / "fast", tmp_path / "slow"
  run_train(fast, small_tokenizer, "--config.train.log_every=4")
  result = run_train_patched(slow, small_tokenizer, SLOW_DATA, "--config.train.log_every=4")
  windows = {
    name: [r for r in read_jsonl(d / "metrics.jsonl") if "loss" in r] for name, d in (("fast", fast), ("slow", slow))
  }
  assert [w["step"] for w in windows["slow"]] == [4, 8, 12]
  # Each batch comes DELAY_S late. A window's line is written once the next step is dispatched, so the wait for
  # that step's batch is in it: steps 1-4 hold the waits for batches 1-5, steps 5-8 for 6-9, steps 9-12 for 10-12.
  # Each wait is at least the delay; on top comes the pipeline's own time, most of it in the first window (its start:
  # up to 0.34 s seen on a loaded 2-core machine).
  for window, batches, extra in zip(windows["slow"], (5, 4, 3), (0.5, 0.2, 0.2)):
    assert batches * DELAY_S - 0.05 <= window["time_data_s"] <= batches * DELAY_S + extra, window
    assert window["time_data_s"] > 0.5 * sum(window[f"time_{p}_s"] for p in PHASES if p != "compile"), window
    assert window["step_time_s"] == pytest.approx(
      sum(window[f"time_{p}_s"] for p in PHASES if p not in ("eval", "compile")) / 4
    )
  # Without the delay each window waits at least two delayed batches less (the first holds the pipeline's start,
  # up to 0.27 s on a loaded 2-core machine, against 1.25 s or more with the delay).
  for fast_window, slow_window in zip(windows["fast"], windows["slow"], strict=True):
    assert fast_window["time_data_s"] < slow_window["time_data_s"] - 2 * DELAY_S, (fast_window, slow_window)
  # The split is in the log line too, one per window (the window's wall time depends on the machine's load: a
  # clean-clone CI run on a busy 2-core machine logged windows past 2 s).
  split = re.findall(
    r"time ([0-9.]+)s: device (\d+)% data (\d+)% checkpoint \d+% eval \d+% compile \d+%", result.stdout
  )
  assert len(split) == 3, result.stdout
  assert all(int(data) > 0 for _, _, data in split), split
  slow_totals = json.loads((slow / "goodput.json").read_text())["totals"]
  fast_totals = json.loads((fast / "goodput.json").read_text())["totals"]
  assert 12 * DELAY_S - 0.1 <= slow_totals["data_s"] <= 12 * DELAY_S + 0.9
  assert fast_totals["data_s"] < slow_totals["data_s"] - 6 * DELAY_S
  # The phases of every window plus the startup fill the session's wall time (the rest: the final save's wait and
  # the end of the run, after the last window).
  for totals in (slow_totals, fast_totals):
    accounted = totals["startup_s"] + sum(totals[f"{p}_s"] for p in PHASES)
    assert accounted == pytest.approx(totals["wall_s"], rel=0.02)
  slow_goodput = json.loads((slow / "goodput.json").read_text())["goodput"]
  assert slow_goodput == pytest.approx((slow_totals["device_s"] - slow_totals["lost_s"]) / slow_totals["wall_s"])
  # Each line carries the run's goodput so far: the data waits pull the slow run's below the fast run's. (The end
  # of the run, after the last line, moves the final figure either way: down when that tail is mostly the final
  # evaluation and save, 0.0152565 → 0.0152556 in a clean-clone run.)
  for fast_window, slow_window in zip(windows["fast"], windows["slow"]):
    assert 0 < slow_window["goodput"] < fast_window["goodput"] <= 1, (fast_window, slow_window)


class FakeTime:
  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


def window(device: float, data: float = 0.0) -> dict:
  return dict(device=device, data=data, checkpoint=0.0, eval=0.0, compile=0.0)


def test_goodput_across_restarts_sets_aside_steps_trained_again(tmp_path, monkeypatch):
  clock = FakeTime()
  monkeypatch.setattr(goodput.time, "perf_counter", clock)
  # Session 1: 10 s of startup, then steps 1-10 in two windows (1 s of device time per step); it dies after step 10.
  ledger = goodput.GoodputLedger(str(tmp_path), 0, clock(), True)
  clock.now += 10.0
  ledger.startup_done()
  clock.now += 6.0
  ledger.add(5, window(5.0, data=1.0))
  clock.now += 6.0
  assert ledger.add(10, window(5.0, data=1.0)) == pytest.approx(10.0 / 22.0)
  # Session 2 resumes from the checkpoint at step 8: steps 9 and 10 are trained again, so 2 s of session 1 are lost.
  ledger = goodput.GoodputLedger(str(tmp_path), 8, clock(), True)
  clock.now += 2.0
  ledger.startup_done()
  clock.now += 4.0
  ledger.add(12, window(4.0))
  record = json.loads((tmp_path / "goodput.json").read_text())
  first, second = record["sessions"]
  assert first["lost_s"] == pytest.approx(2.0) and second["lost_s"] == 0
  assert (first["start_step"], first["step"], second["start_step"], second["step"]) == (0, 10, 8, 12)
  assert record["totals"]["wall_s"] == pytest.approx(28.0) and record["totals"]["startup_s"] == pytest.approx(12.0)
  assert record["goodput"] == pytest.approx((10.0 + 4.0 - 2.0) / 28.0)
  # Session 3 resumes from step 12 (nothing redone); a resume never gives back time set aside before.
  ledger = goodput.GoodputLedger(str(tmp_path), 12, clock(), True)
  assert [s.lost_s for s in ledger.sessions[:2]] == pytest.approx([2.0, 0.0])


def test_the_clock_counts_compiles_apart_from_the_phase_they_happen_in():
  clock = goodput.StepClock()
  start = time.perf_counter()
  with clock.measure("eval"):
    jax.jit(lambda x: jnp.tanh(x) * 3.0 + x.sum())(jnp.ones((17, 5))).block_until_ready()  # a new program: compiled
  measured = time.perf_counter() - start
  window = clock.take_window()
  assert window["compile"] > 0.5 * measured  # a first call is mostly its compile
  assert window["eval"] + window["compile"] == pytest.approx(measured, abs=0.01)  # counted once, not twice
  assert set(window) == set(PHASES) and window["data"] == window["checkpoint"] == 0
