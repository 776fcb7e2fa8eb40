"""Crash fuzzing: a training run SIGKILLed at N moments spread over its phases (tokenizer training, data
preparation, training steps, async checkpoint saves, evaluation) and rerun in the same workdir after each kill must
end bit-identical to an uninterrupted run (parameters, optimizer state, step, RNG), having trained on the same batches.

    python -m pytest -q -n 0 tests/stress/crash_fuzz.py -s            # N=5, one kill per phase (the full tier runs it)
    python -m pytest -q -n 0 -m stress tests/stress/crash_fuzz.py -s  # N=30; CRASH_FUZZ_N and CRASH_FUZZ_SEED change it

How a kill lands where it should: the run is ``tests.stress.fuzz_child``, which reports each phase's begin and end on
a pipe. A seeded plan names the phase of each kill (tokenizer and data kills first: those phases only run until they
are done); for each, the fuzzer starts a rerun, waits for that phase to begin (a step, save or evaluation among the
rerun's next 16 steps), lets a random part of the time the phase took in the
uninterrupted run pass (or less, if the phase is seen to end first), and SIGKILLs the process from outside. Where it
actually landed is read back from the events the process wrote before it died, and printed with the figures (-s).
"""

from __future__ import annotations

import dataclasses
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT, needs_shakespeare
from tests.runs import MICRO, assert_bit_identical, assert_same_batches, final_checkpoint
from tests.stress.fuzz_child import EVENTS_FD_ENV

pytestmark = needs_shakespeare

# Kills land within the next two save intervals of where a rerun resumes, so that reruns resume from many
# checkpoints; the run is long enough that N=30 kills (each moving the latest checkpoint ~4 steps on) never see it
# finish. Steps take milliseconds: the length costs little.
STEPS, SAVE_EVERY, EVAL_EVERY = 96, 8, 12
WINDOW = 2 * SAVE_EVERY
FLAGS = [
  *MICRO,  # configs/tiny.py shrunk to seconds: 2 layers of width 32, 4 sequences of 32 tokens per step
  "--config.data.vocab_size=512",  # no data.tokenizer: the run trains its own, a phase to kill
  f"--config.train.steps={STEPS}",
  f"--config.train.save_every={SAVE_EVERY}",
  f"--config.train.eval_every={EVAL_EVERY}",
]
PHASES = ("tokenizer", "data", "step", "save", "eval")
CHILD_TIMEOUT_S = 300
DELAY_PART = 0.6  # of the phase's duration in the uninterrupted run: a rerun's may be shorter (the load varies)


@dataclasses.dataclass(frozen=True)
class Event:
  t: float  # time.monotonic() in the process: the same clock as here
  phase: str
  what: str  # begin, end, at
  n: str  # a step, or ""


@dataclasses.dataclass(frozen=True)
class Target:
  phase: str  # what the plan asked for
  trigger: tuple[str, str, str]  # the event (phase, what, n) that starts the clock; n "" matches any
  until: tuple[str, str, str]  # the event that ends the phase: if it comes first, the kill follows it at once
  delay_s: float


@dataclasses.dataclass
class Child:
  events: list[Event]
  returncode: int
  killed: bool
  log: str
  seconds: float


def command(workdir) -> list[str]:
  return [sys.executable, "-m", "tests.stress.fuzz_child", "--config=configs/tiny.py", f"--workdir={workdir}", *FLAGS]


def compile_cache(directory, write: bool) -> dict[str, str]:
  """JAX's persistent compilation cache, so that reruns load the train and eval steps the uninterrupted run compiled
  instead of compiling them again (most of a rerun's time on two cores). Only that run writes (a kill mid-write would
  leave a damaged entry; JAX would only warn and compile, but the reruns then have nothing to write)."""
  return {
    "JAX_COMPILATION_CACHE_DIR": str(directory),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0" if write else "1e9",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }


def run_child(workdir, target: Target | None, log_path, env: dict[str, str]) -> Child:
  """One run in `workdir` to the end, or SIGKILLed `target.delay_s` after its trigger event (or as soon as the phase
  is seen to end, if sooner: a kill never slips far past its phase, and never lets the run finish)."""
  began = time.monotonic()
  read_end, write_end = os.pipe()
  with open(log_path, "w") as log:
    process = subprocess.Popen(
      command(workdir),
      cwd=ROOT,
      env=dict(os.environ, **env, **{EVENTS_FD_ENV: str(write_end)}),
      pass_fds=(write_end,),
      stdout=log,
      stderr=subprocess.STDOUT,
    )
  os.close(write_end)
  watchdog = threading.Timer(CHILD_TIMEOUT_S, process.kill)
  watchdog.start()
  events, killed, deadline, pending = [], False, None, b""

  def kill():
    nonlocal killed, deadline
    process.send_signal(signal.SIGKILL)
    killed, deadline = True, None

  try:
    with os.fdopen(read_end, "rb", buffering=0) as reader:
      while True:  # until every copy of the write end is closed: the process has exited or died
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([reader], [], [], wait)[0]:
          kill()  # the deadline, inside the phase
          continue
        chunk = reader.read(1 << 16)
        if not chunk:
          break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
          t, phase, what, *n = line.decode().split()
          events.append(Event(float(t), phase, what, n[0] if n else ""))
          if target is None or killed:
            continue
          if deadline is None and matches(events[-1], target.trigger):
            deadline = events[-1].t + target.delay_s  # the child's clock is this one: from when it happened
          elif deadline is not None and matches(events[-1], target.until):
            kill()
    returncode = process.wait()
  finally:
    watchdog.cancel()
  with open(log_path, "a") as f:  # the events after the output, for a post-mortem
    f.writelines(f"event {e.t:.6f} {e.phase} {e.what} {e.n}\n" for e in events)
  with open(log_path) as f:
    return Child(events, returncode, killed, f.read(), time.monotonic() - began)


def matches(event: Event, trigger: tuple[str, str, str]) -> bool:
  phase, what, n = trigger
  return (event.phase, event.what) == (phase, what) and n in ("", event.n)


def durations(events: list[Event]) -> dict[str, float]:
  """Seconds each phase took in an uninterrupted run: the median over its occurrences (of a step: the gaps between
  steps; of a save: to its commit). Not the first save's or evaluation's: the reruns load the compiled programs from
  the cache, so theirs take what the later ones took here."""
  began: dict[tuple[str, str], float] = {}
  took: dict[str, list[float]] = {}
  for e in events:
    if e.what == "begin":
      began[(e.phase, e.n)] = e.t
    elif e.what == "end" and (e.phase, e.n) in began:
      took.setdefault(e.phase, []).append(e.t - began.pop((e.phase, e.n)))
  steps = [e.t for e in events if e.phase == "step"]
  took["step"] = [b - a for a, b in zip(steps, steps[1:])]
  return {phase: sorted(times)[len(times) // 2] for phase, times in took.items()}


def plan(n: int, seed: int) -> list[str]:
  """The phase of each of `n` kills: every phase once (when n allows), the rest drawn at random; tokenizer and data
  kills first, in that order, the training ones shuffled."""
  rng = random.Random(seed)
  phases = list(PHASES) if n >= len(PHASES) else rng.sample(PHASES, n)
  phases += [rng.choice(PHASES) for _ in range(n - len(phases))]
  early = sorted((p for p in phases if p in ("tokenizer", "data")), key=PHASES.index)
  late = [p for p in phases if p not in early]
  rng.shuffle(late)
  return early + late


def latest_checkpoint(workdir) -> int:
  directory = workdir / "checkpoints"
  steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if directory.is_dir() else []
  return max(steps, default=0)


def target_for(phase: str, resume: int, took: dict[str, float], rng: random.Random) -> Target:
  """Where to kill a rerun that resumes from step `resume`: one of the steps, saves or evaluations of its next WINDOW
  steps (at least the first one it reaches); a random moment inside (up to DELAY_PART of the uninterrupted run's time
  for that phase)."""
  delay = rng.uniform(0, DELAY_PART * took[phase])
  if phase in ("tokenizer", "data"):
    return Target(phase, (phase, "begin", ""), (phase, "end", ""), delay)
  if phase == "step":
    step = rng.randint(resume + 1, min(resume + WINDOW, STEPS - 1))
    return Target(phase, ("step", "at", str(step)), ("step", "at", str(step + 1)), delay)
  every = SAVE_EVERY if phase == "save" else EVAL_EVERY
  first = (resume // every + 1) * every
  step = str(min(STEPS, rng.choice(range(first, max(first, resume + WINDOW) + 1, every))))
  return Target(phase, (phase, "begin", step), (phase, "end", step), delay)


def landed(events: list[Event]) -> str:
  """Where a process was when it died, from the events it wrote: the innermost open phase (an evaluation, a save in
  flight, tokenizer, data, restore), else the step the loop was in, else start-up or shutdown."""
  open_phases, saving, last_step, loop, evaluating = set(), set(), None, "before", ""
  for e in events:
    if e.phase in ("tokenizer", "data", "restore", "eval"):
      (open_phases.add if e.what == "begin" else open_phases.discard)(e.phase)
      evaluating = e.n
    elif e.phase == "save":
      (saving.add if e.what == "begin" else saving.discard)(e.n)
    elif e.phase == "train":
      loop, last_step = ("running", int(e.n)) if e.what == "begin" else ("after", last_step)
    elif e.phase == "step":
      last_step = int(e.n)
  if "eval" in open_phases:
    return f"eval (at step {evaluating})"
  for phase in ("tokenizer", "data", "restore"):
    if phase in open_phases:
      return phase
  # Hooks (evaluation, saves) run after a step is dispatched and before its `step at` event: inside the loop, the
  # step under way is the one after the last reported.
  if saving:
    return f"save (of step {', '.join(sorted(saving, key=int))}, in flight" + (
      f"; during step {last_step + 1})" if loop == "running" else "; after the loop)"
    )
  if loop == "running":
    return f"step (step {last_step + 1})"
  return "shutdown (after the loop)" if loop == "after" else "start-up (between phases: imports, compilation, init)"


def phases_hit(where: str) -> set[str]:
  """The phases a `landed` description names: a save in flight during a step hits both."""
  if where.startswith("missed"):
    return set()
  return {where.split()[0]} | ({"step"} if "during step" in where else set())


def fuzz(tmp_path, n: int, seed: int) -> dict:
  """The uninterrupted run, then `n` kills and reruns in one workdir, then the last rerun; checks the outcome and
  returns the figures."""
  began = time.monotonic()
  straight, fuzzed = tmp_path / "straight", tmp_path / "fuzzed"
  cache = tmp_path / "compile_cache"
  reference = run_child(straight, None, tmp_path / "straight.log", compile_cache(cache, write=True))
  assert reference.returncode == 0, reference.log[-3000:]
  took = durations(reference.events)
  rng = random.Random(seed)
  kills = []
  for i, phase in enumerate(plan(n, seed)):
    resume = latest_checkpoint(fuzzed)
    assert resume < STEPS, f"the run reached step {STEPS} after {i} of {n} kills: raise STEPS"
    target = target_for(phase, resume, took, rng)
    child = run_child(fuzzed, target, tmp_path / f"kill{i}.log", compile_cache(cache, write=False))
    if not child.killed or child.returncode != -signal.SIGKILL:
      assert child.returncode == 0, f"kill {i} ({target}): exit {child.returncode}\n{child.log[-3000:]}"
    kills.append(
      dict(
        planned=phase,
        resumed_from=resume,
        trigger=" ".join(target.trigger).strip(),
        delay_s=round(target.delay_s, 3),
        landed=landed(child.events) if child.killed else "missed: the run ended first",
        seconds=round(child.seconds, 1),
      )
    )
  final = run_child(fuzzed, None, tmp_path / "final.log", compile_cache(cache, write=False))
  assert final.returncode == 0, final.log[-3000:]
  report = dict(
    n=n,
    seed=seed,
    kills=kills,
    hit=sorted({phase for k in kills for phase in phases_hit(k["landed"])}),
    phase_seconds={k: round(v, 3) for k, v in took.items()},
    final_resumed_from=next(int(e.n) for e in final.events if e.phase == "train"),
    straight_seconds=round(reference.seconds, 1),
    final_seconds=round(final.seconds, 1),
  )
  print_report(report, time.monotonic() - began)

  assert_bit_identical(final_checkpoint(straight, STEPS), final_checkpoint(fuzzed, STEPS))
  assert_same_batches(fuzzed, straight)
  assert (fuzzed / "tokenizer.model").read_bytes() == (straight / "tokenizer.model").read_bytes()
  report["seconds"] = round(time.monotonic() - began, 1)
  return report


def print_report(report: dict, seconds: float) -> None:
  print(f"\ncrash fuzz: N={report['n']} seed={report['seed']}, {seconds:.0f} s; phases hit: {', '.join(report['hit'])}")
  print(f"  uninterrupted run: {report['straight_seconds']} s; its phases (s): {report['phase_seconds']}")
  for i, k in enumerate(report["kills"]):
    print(
      f"  kill {i:2d}: planned {k['planned']:9s} resumed from {k['resumed_from']:2d}, {k['delay_s']:.3f} s after "
      f"'{k['trigger']}' -> {k['landed']} ({k['seconds']} s)"
    )
  print(f"  final rerun: resumed from step {report['final_resumed_from']}, {report['final_seconds']} s")


def test_sigkill_in_every_phase_then_rerun_is_bit_identical(tmp_path):
  """The default suite's fuzz: five kills, one planned per phase."""
  report = fuzz(tmp_path, 5, seed=0)
  assert len(report["kills"]) == 5


@pytest.mark.stress
def test_sigkill_at_many_moments_then_rerun_is_bit_identical(tmp_path):
  """The long fuzz (-m stress): CRASH_FUZZ_N kills (30), CRASH_FUZZ_SEED (1)."""
  n = int(os.environ.get("CRASH_FUZZ_N", "30"))
  report = fuzz(tmp_path, n, seed=int(os.environ.get("CRASH_FUZZ_SEED", "1")))
  assert len(report["kills"]) == n
