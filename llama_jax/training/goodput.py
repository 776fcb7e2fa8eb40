"""Where a run's time goes: each logged window's wall time split into phases, and goodput across restarts.

The loop is asynchronous (a step is dispatched while the previous one runs; metrics are read one step late), so the
device's time cannot be read per step without stalling it. What the host can measure exactly is where it waits for
something else: for the next batch (``data``), inside a blocking checkpoint save (``checkpoint``), inside an
evaluation (``eval``), and in JAX's compiler (``compile``: tracing, lowering and XLA's compile, from
``jax.monitoring``'s duration events, wherever they happen: the first train step, the first evaluation, a
checkpoint's restore). The rest of the window is the ``device`` step: the host dispatching steps and waiting for the
device to run them. The five phases add up to the window's wall time.

Goodput (MaxText's term) is productive time over wall time: the device-step seconds of steps that count, over the
seconds the run's processes were alive, summed over every session on the workdir (``goodput.json``). A session's wall
time runs from ``train()``'s start to its last logged window (a session killed between windows loses at most one
window's time from the record); what came before its first step (lock, data preparation, restore, initialisation)
is its ``startup``. Steps redone after a resume from an older checkpoint were not productive after all: a resume at
step S moves the device time of every earlier session's steps past S to ``lost`` (at that session's mean step time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import threading
import time
from collections.abc import Iterator

import jax

from llama_jax.core import paths

PHASES = ("device", "data", "checkpoint", "eval", "compile")
# Tracing, lowering to StableHLO, and XLA's compile: what a first call (or a new shape) costs before it runs.
COMPILE_EVENTS = frozenset(
  {
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
  }
)

_compile_lock = threading.Lock()
_compile_total = 0.0
_listening = False


def _on_duration(event: str, duration: float, **_) -> None:
  global _compile_total
  if event in COMPILE_EVENTS:
    with _compile_lock:
      _compile_total += duration


def compile_seconds() -> float:
  """Seconds JAX has spent compiling in this process since the first call of this function."""
  global _listening
  with _compile_lock:
    if not _listening:  # registered once per process: jax.monitoring keeps listeners for good
      jax.monitoring.register_event_duration_secs_listener(_on_duration)
      _listening = True
    return _compile_total


class StepClock:
  """The current window's seconds per phase. Sections run inside ``measure(phase)``; compiles inside a section are
  counted as compile, not as the section's phase; ``take_window`` closes the window (device = the rest)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.restart()

  def restart(self) -> None:
    with self._lock:
      self._start, self._compile_start = time.perf_counter(), compile_seconds()
      self._measured = dict.fromkeys(PHASES, 0.0)

  @contextlib.contextmanager
  def measure(self, phase: str) -> Iterator[None]:
    start, compile_start = time.perf_counter(), compile_seconds()
    try:
      yield
    finally:
      seconds = time.perf_counter() - start - (compile_seconds() - compile_start)
      with self._lock:
        self._measured[phase] += max(seconds, 0.0)

  def seconds(self, phase: str) -> float:
    """A measured phase's seconds in the window so far."""
    return self._measured[phase]

  def take_window(self) -> dict[str, float]:
    """This window's seconds per phase (summing to its wall time); the next window starts now."""
    with self._lock:
      now, compiled = time.perf_counter(), compile_seconds()
      window = dict(self._measured, compile=compiled - self._compile_start)
      window["device"] = max(now - self._start - sum(v for k, v in window.items() if k != "device"), 0.0)
      self._start, self._compile_start = now, compiled
      self._measured = dict.fromkeys(PHASES, 0.0)
    return window


@dataclasses.dataclass
class Session:
  """One train() call on the workdir, as goodput.json records it."""

  started: str  # UTC, ISO 8601
  start_step: int
  step: int  # the last step logged in this session
  wall_s: float = 0.0
  startup_s: float = 0.0
  lost_s: float = 0.0  # device seconds of steps redone by a later session (it resumed from an earlier checkpoint)
  device_s: float = 0.0
  data_s: float = 0.0
  checkpoint_s: float = 0.0
  eval_s: float = 0.0
  compile_s: float = 0.0


class GoodputLedger:
  """The workdir's record of its training sessions and their goodput, kept in ``goodput.json``.

  Read at the start (process 0), one new session appended, rewritten after every logged window. A resume at step
  `start_step` moves the device seconds of every earlier session's steps past it to that session's ``lost_s``, at
  its mean step time: those steps are trained again, so they were not productive.

  Args:
    workdir: the run's directory; the ledger is its ``goodput.json``.
    start_step: the step this session starts from, 0 or the checkpoint resumed from.
    started: the session's ``time.perf_counter()`` at ``train()``'s start.
    enabled: read and write ``goodput.json``; when False the sessions are kept in memory only, this one alone.

  Attributes:
    sessions: every session on the workdir, oldest first, this one last.
    current: this session's `Session`, updated by `add`.
  """

  def __init__(self, workdir: str, start_step: int, started: float, enabled: bool):
    self.enabled, self._file, self._started = enabled, paths.path(workdir, paths.GOODPUT_FILE), started
    self.sessions: list[Session] = []
    if enabled and self._file.exists():
      self.sessions = [Session(**s) for s in json.loads(self._file.read_text())["sessions"]]
    for earlier in self.sessions:  # steps past the checkpoint resumed from were trained again: not productive
      if earlier.step > start_step:
        kept_steps = max(start_step - earlier.start_step, 0)
        done = earlier.step - earlier.start_step
        lost = earlier.device_s * (done - kept_steps) / done if done else 0.0
        earlier.lost_s = max(earlier.lost_s, lost)  # an earlier resume may have set aside more of it
    self.current = Session(
      started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      start_step=start_step,
      step=start_step,
    )
    self.sessions.append(self.current)

  def startup_done(self) -> None:
    """Mark the end of startup: the first step is about to run.

    The seconds since `started` become this session's ``startup_s``.
    """
    self.current.startup_s = time.perf_counter() - self._started

  def add(self, step: int, window: dict[str, float]) -> float:
    """Add a logged window's phases to this session and save the ledger.

    The session's last step becomes `step` and its wall time the seconds since `started`; ``goodput.json`` is
    rewritten atomically when the ledger is enabled.

    Args:
      step: the last step of the window.
      window: seconds per phase, as ``StepClock.take_window`` returns them.

    Returns:
      The run's goodput so far, as `goodput` returns it.
    """
    session = self.current
    session.step = step
    session.wall_s = time.perf_counter() - self._started
    for phase, seconds in window.items():
      setattr(session, f"{phase}_s", getattr(session, f"{phase}_s") + seconds)
    if self.enabled:
      document = {"goodput": self.goodput(), "totals": self.totals(), "sessions": [vars(s) for s in self.sessions]}
      with paths.atomic_write(self._file) as f:
        f.write(json.dumps(document, indent=1) + "\n")
    return self.goodput()

  def totals(self) -> dict[str, float]:
    """Seconds summed over every session on the workdir.

    Returns:
      ``wall_s``, ``startup_s``, ``lost_s`` and each phase's ``<phase>_s``, each the sum over the sessions.
    """
    names = ("wall_s", "startup_s", "lost_s", *(f"{p}_s" for p in PHASES))
    return {name: sum(getattr(s, name) for s in self.sessions) for name in names}

  def goodput(self) -> float:
    """The run's goodput: productive device seconds over wall seconds, over every session.

    Returns:
      ``(device_s - lost_s) / wall_s`` of the totals, or 0.0 before any wall time is recorded.
    """
    totals = self.totals()
    return (totals["device_s"] - totals["lost_s"]) / totals["wall_s"] if totals["wall_s"] > 0 else 0.0
