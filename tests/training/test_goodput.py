"""Goodput and the step-time split (training/goodput.py): a run with a deliberately slow data source shows the wait in
its data share, the phases of each window add up to its wall time (exactly so on a fake clock), and goodput.json
keeps totals across restarts, setting aside the time of steps that a resume from an older checkpoint trained again."""

import json
import re

import jax
import jax.numpy as jnp
import pytest

from llama_jax.training import goodput
from llama_jax.training.loop import MetricsHook, TrainLoop
from llama_jax.training.metrics import MetricsWriter
from tests.conftest import needs_shakespeare
from tests.runs import read_jsonl, run_train_patched

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
  """The real run: the injected waits are in the data share of its windows, its lines and goodput.json. How much
  else each window holds depends on the machine; the exact split is the fake-clock test below."""
  result = run_train_patched(tmp_path, small_tokenizer, SLOW_DATA, "--config.train.log_every=4")
  windows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
  assert [w["step"] for w in windows] == [4, 8, 12]
  # Each batch comes DELAY_S late. A window's line is written once the next step is dispatched, so the wait for
  # that step's batch is in it: steps 1-4 hold the waits for batches 1-5, steps 5-8 for 6-9, steps 9-12 for 10-12.
  for window, batches in zip(windows, (5, 4, 3)):
    assert window["time_data_s"] >= batches * DELAY_S - 0.05, window
    assert window["step_time_s"] == pytest.approx(
      sum(window[f"time_{p}_s"] for p in PHASES if p not in ("eval", "compile")) / 4
    )
  # The split is in the log line too, one per window: the shares of that window's seconds in metrics.jsonl.
  lines = dict(re.findall(r"^step +(\d+) \|.*(\| time .*)$", result.stdout, re.M))
  assert sorted(map(int, lines)) == [4, 8, 12], result.stdout
  for window in windows:
    total = sum(window[f"time_{p}_s"] for p in PHASES)
    shares = " ".join(f"{p} {window[f'time_{p}_s'] / total:.0%}" for p in PHASES)
    assert lines[str(window["step"])] == f"| time {total:.3g}s: {shares}", (lines, window)
  totals = json.loads((tmp_path / "goodput.json").read_text())["totals"]
  assert totals["data_s"] >= 12 * DELAY_S - 0.1, totals
  # The phases of every window plus the startup fill the session's wall time (the rest: the final save's wait and
  # the end of the run, after the last window).
  accounted = totals["startup_s"] + sum(totals[f"{p}_s"] for p in PHASES)
  assert accounted == pytest.approx(totals["wall_s"], rel=0.02)
  record = json.loads((tmp_path / "goodput.json").read_text())
  assert record["goodput"] == pytest.approx((totals["device_s"] - totals["lost_s"]) / totals["wall_s"])
  # Each line carries the run's goodput so far: device seconds over the wall time to there (the startup and the
  # windows so far; the ledger's own reading of the clock comes a few statements later, hence the tolerance). The
  # data waits are not in it: at most 1 - data / wall, exactly so.
  so_far = dict.fromkeys(PHASES, 0.0)
  for window in windows:
    for p in PHASES:
      so_far[p] += window[f"time_{p}_s"]
    wall = totals["startup_s"] + sum(so_far.values())
    assert window["goodput"] == pytest.approx(so_far["device"] / wall, rel=0.02), window
    assert 0 < window["goodput"] <= 1 - so_far["data"] / wall + 1e-9, (window, so_far)


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


def test_the_loop_counts_the_wait_for_each_batch_as_data_and_nothing_else(tmp_path, monkeypatch):
  """The slow data source above on a fake clock: each batch is exactly DELAY_S late and each step takes exactly STEP_S,
  so every window's phases, its step time and the goodput so far are known to the last bit."""
  clock, step_s, startup_s = FakeTime(), 0.125, 2.0
  monkeypatch.setattr(goodput.time, "perf_counter", clock)
  monkeypatch.setattr(goodput, "compile_seconds", lambda: 0.0)

  def slow_batches():
    while True:
      clock.now += DELAY_S
      yield {}

  def train_step(state, batch):
    clock.now += step_s
    return state, dict(loss=1.0, grad_norm=1.0, lr=1e-3)

  ledger = goodput.GoodputLedger(str(tmp_path), 0, clock(), True)
  clock.now += startup_s
  ledger.startup_done()
  step_clock = goodput.StepClock()
  writer = MetricsWriter(
    str(tmp_path),
    True,
    log_every=4,
    tokens_per_step=1,
    flops_per_step=1.0,
    peak_flops=1.0,
    start_step=0,
    clock=step_clock,
    ledger=ledger,
    echo=lambda line: None,
  )
  loop = TrainLoop(train_step, slow_batches(), {}, 0, 12, step_clock)
  loop.add_hook(MetricsHook(writer))
  loop.run()
  writer.end_session(loop.step)
  windows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
  assert [w["step"] for w in windows] == [4, 8, 12]
  # The windows hold the waits for batches 1-5, 6-9 and 10-12 (as in the run above) and the steps that ran in them.
  device_so_far = 0.0
  for window, batches, steps_so_far in zip(windows, (5, 4, 3), (5, 9, 12)):
    want = dict.fromkeys(PHASES, 0.0) | dict(device=batches * step_s, data=batches * DELAY_S)
    assert {p: window[f"time_{p}_s"] for p in PHASES} == pytest.approx(want), window
    assert window["step_time_s"] == pytest.approx(batches * (step_s + DELAY_S) / 4)
    device_so_far += batches * step_s
    wall = startup_s + steps_so_far * (step_s + DELAY_S)
    assert window["goodput"] == pytest.approx(device_so_far / wall)
  record = json.loads((tmp_path / "goodput.json").read_text())
  totals = record["totals"]
  assert (totals["data_s"], totals["device_s"]) == pytest.approx((12 * DELAY_S, 12 * step_s))
  assert totals["wall_s"] == pytest.approx(startup_s + 12 * (step_s + DELAY_S)) and totals["startup_s"] == startup_s
  assert record["goodput"] == pytest.approx(12 * step_s / totals["wall_s"])


def test_the_clock_counts_compiles_apart_from_the_phase_they_happen_in(monkeypatch):
  # JAX's compile events reach the clock: the first call of a new program inside a section counts as compile.
  clock = goodput.StepClock()
  with clock.measure("eval"):
    jax.jit(lambda x: jnp.tanh(x) * 3.0 + x.sum())(jnp.ones((17, 5))).block_until_ready()  # a new program: compiled
  window = clock.take_window()
  assert window["compile"] > 0, window
  assert set(window) == set(PHASES) and window["data"] == window["checkpoint"] == 0
  # The split, on a fake clock with compiles of known length (told to the clock's listener as JAX tells it): 1 s of
  # steps, a 0.25 s compile outside any section, 2 s of evaluation of which 0.5 s compiling, 3 s of steps.
  fake = FakeTime()
  monkeypatch.setattr(goodput.time, "perf_counter", fake)
  monkeypatch.setattr(goodput, "_compile_total", 0.0)  # only the compiles told below
  clock = goodput.StepClock()
  fake.now += 1.0
  goodput._on_duration("/jax/core/compile/backend_compile_duration", 0.25)
  fake.now += 0.25
  with clock.measure("eval"):
    fake.now += 1.5
    goodput._on_duration("/jax/core/compile/jaxpr_trace_duration", 0.5)
    goodput._on_duration("/jax/some/other_duration", 9.0)  # not a compile: not counted
    fake.now += 0.5
  fake.now += 3.0
  window = clock.take_window()
  assert window == pytest.approx(dict(device=4.0, data=0.0, checkpoint=0.0, eval=1.5, compile=0.75))
  assert set(window) == set(PHASES) and sum(window.values()) == pytest.approx(6.25)  # the window's wall time
