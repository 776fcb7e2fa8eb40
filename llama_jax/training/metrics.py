"""Training metrics out of the loop without stalling it: one line to stdout, ``metrics.jsonl`` in the workdir, and
the run's trackers (TensorBoard, W&B, MLflow: trackers.py), from process 0 only.

Train metrics are read one step late: a step's metrics stay on the device until the *next* step has been dispatched,
so fetching them never leaves the device idle, and the line for a window of ``log_every`` steps is written one step
after the window ends (loss averaged over the window; throughput and MFU from wall time between windows, less
evaluations and compiles). Each window also carries its wall time split into phases (``time_device_s``, ``time_data_s``,
``time_checkpoint_s``, ``time_eval_s``, ``time_compile_s``) and the run's ``goodput`` so far (goodput.py).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from llama_jax.core import paths
from llama_jax.model.loss import perplexity
from llama_jax.training.goodput import PHASES, GoodputLedger, StepClock
from llama_jax.training.trackers import Tracker, log_all

_log = logging.getLogger(__name__)


def format_value(value: float) -> str:
  if isinstance(value, int) or (abs(value) >= 1000 and float(value).is_integer()):
    return f"{int(value):,}"
  return f"{value:.4g}"


def format_line(metrics: dict[str, float]) -> str:
  """ "loss 3.2 | ... | goodput 0.91 | time 1.2s: device 93% data 1% ...": the window's time split as shares."""
  times = {k[len("time_") : -len("_s")]: v for k, v in metrics.items() if k.startswith("time_")}
  # Keys with a "/" are per-part detail (a mixture's moe_load/<layer>/<expert>): files and trackers, not the line.
  shown = {k: v for k, v in metrics.items() if not k.startswith("time_") and "/" not in k}
  line = " | ".join(f"{k} {format_value(v)}" for k, v in shown.items())
  total = sum(times.values())
  if total > 0:
    line += f" | time {total:.3g}s: " + " ".join(f"{phase} {seconds / total:.0%}" for phase, seconds in times.items())
  return line


def _flat_means(name: str, fetched: list[dict[str, Any]]) -> dict[str, float]:
  """The window's mean of metric `name`: one float, or for an array metric (a mixture's moe_load [L, E]) one float
  per element named name/i/j."""
  if not fetched:
    return {name: float("nan")}
  mean = np.mean([np.asarray(m[name], np.float64) for m in fetched], axis=0)
  if mean.ndim == 0:
    return {name: float(mean)}
  return {"/".join([name, *map(str, index)]): float(value) for index, value in np.ndenumerate(mean)}


class MetricsWriter:
  """Writes a run's metrics to stdout, ``metrics.jsonl`` and its trackers without stalling the loop.

  Writes the metrics of a step (`write`), and buffers each train step's device metrics to write them a step late
  (`add_step`, `flush`): a window of `log_every` steps is fetched and written once the step after it is dispatched,
  with the loss averaged over the window's finite steps, throughput and MFU over its training time, its wall time
  split into phases and, with a ledger, the run's goodput. Disabled on processes other than 0: nothing is written,
  logged or tracked there.

  Args:
    workdir: the run's directory; metrics are appended to its ``metrics.jsonl``.
    enabled: whether this process writes, True on process 0 only.
    log_every: the steps in a logged window.
    tokens_per_step: tokens in one global batch, for ``tokens_per_s``.
    flops_per_step: model FLOPs of one step, for ``mfu``.
    peak_flops: the peak FLOPs per second of all the run's devices together, for ``mfu``.
    start_step: the step the run starts or resumes from, where the first window's throughput starts.
    clock: the phase clock of the windows; None makes a new `StepClock`.
    ledger: the goodput ledger each window is added to; None: no goodput.
    trackers: the run's trackers: TensorBoard, W&B, MLflow; dropped when not `enabled`.
    echo: where each line goes; None prints it to stdout.

  Attributes:
    last_train: the metrics of the last train window written.
  """

  def __init__(
    self,
    workdir: str,
    enabled: bool,
    *,
    log_every: int,
    tokens_per_step: int,
    flops_per_step: float,
    peak_flops: float,
    start_step: int,
    clock: StepClock | None = None,
    ledger: GoodputLedger | None = None,
    trackers: list[Tracker] = (),
    echo: Callable[[str], None] | None = None,
  ):
    self.enabled, self.echo = enabled, echo or functools.partial(print, flush=True)
    self._jsonl = str(paths.path(workdir, paths.METRICS_FILE))
    self.trackers = list(trackers) if enabled else []
    self.clock, self.ledger = clock or StepClock(), ledger  # no ledger: no goodput (tests of the windows alone)
    self._log_every, self._tokens_per_step = log_every, tokens_per_step
    self._flops_per_step, self._peak_flops = flops_per_step, peak_flops
    self._pending: list[tuple[int, dict[str, Any]]] = []  # (step, device metrics) not yet fetched
    self._due: int | None = None  # a window that ended at this step, written once the next step is dispatched
    self.last_train: dict[str, float] = {}
    self.restart_clock(start_step)

  def write(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
    """Write one step's metrics: a ``metrics.jsonl`` line, the trackers, and a line through `echo`.

    Args:
      step: the step the metrics belong to.
      metrics: host values by name.
      prefix: put before each name, e.g. ``val_`` for validation metrics.
    """
    if not self.enabled:
      return
    named = {f"{prefix}{k}": v for k, v in metrics.items()}
    paths.append_line(self._jsonl, json.dumps({"step": step, **named}))
    log_all(self.trackers, step, named)
    self.echo(f"step {step:>6d} | " + format_line(named))

  def add_step(self, step: int, device_metrics: dict[str, Any]) -> None:
    """Record that step `step` has been dispatched: the window due at the step before is written now.

    Args:
      step: the step just dispatched; a window ends at each multiple of `log_every`.
      device_metrics: the step's metrics, still on the device; they are fetched when their window is written.
    """
    self._pending.append((step, device_metrics))
    if self._due is not None:
      self._write_window(self._due)
    if step % self._log_every == 0:
      self._due = step

  def flush(self) -> None:
    """Writes the window that is due (before an evaluation, so lines stay in step order)."""
    if self._due is not None:
      self._write_window(self._due)

  def finish(self) -> None:
    """Writes whatever is left at the end of the run, a partial window included."""
    if self._pending:
      self._write_window(self._pending[-1][0])

  def restart_clock(self, step: int) -> None:
    """Start the next window's clock and throughput count here.

    Args:
      step: the step counted from: the run's start or resume.
    """
    self.clock.restart()
    self._window_step = step

  def end_session(self, step: int) -> None:
    """Close the session: the time since the last line goes into ``goodput.json``.

    Called once the run is over and its last save is done.

    Args:
      step: the run's last step.
    """
    if self.enabled and self.ledger is not None:
      self.ledger.add(step, self.clock.take_window())

  def _write_window(self, until: int) -> None:
    fetched = jax.device_get([m for s, m in self._pending if s <= until])
    self._pending = [(s, m) for s, m in self._pending if s > until]
    self._due = None
    window = self.clock.take_window()  # seconds per phase, summing to the window's wall time
    elapsed, steps = sum(window.values()), until - self._window_step
    # Throughput is training's: evaluations and compiles are not (each has its own share in the time split).
    training = max(elapsed - window["eval"] - window["compile"], 1e-9)
    finite_losses = [m["loss"] for m in fetched if not m.get("nonfinite", 0)]
    loss = float(np.mean(finite_losses)) if finite_losses else float("nan")
    skipped = sum(int(m.get("nonfinite", 0)) for m in fetched)
    # An objective's own means (DPO: rewards, reward accuracy, margin, log-probs), averaged like the loss.
    extra = sorted(set(fetched[-1]) - {"loss", "grad_norm", "lr", "tokens", "pairs", "nonfinite"})
    finite = [m for m in fetched if not m.get("nonfinite", 0)]
    self.last_train = dict(
      loss=loss,
      **{k: v for name in extra for k, v in _flat_means(name, finite).items()},
      grad_norm=float(fetched[-1]["grad_norm"]),
      lr=float(fetched[-1]["lr"]),
      tokens_per_s=self._tokens_per_step * steps / training,
      step_time_s=training / steps,
      mfu=self._flops_per_step * steps / training / self._peak_flops,
    )
    if "pairs" not in fetched[-1]:  # exp of a DPO loss is no perplexity
      self.last_train["perplexity"] = perplexity(loss)
    if skipped:  # steps of this window that were not applied (non-finite loss or gradients)
      self.last_train["skipped_steps"] = skipped
    if self.enabled and self.ledger is not None:
      self.last_train["goodput"] = self.ledger.add(until, window)
    self.last_train.update({f"time_{phase}_s": window[phase] for phase in PHASES})
    self.write(until, self.last_train)
    self._window_step = until

  def close(self, failed: bool = False) -> None:
    """End the trackers' runs; a tracker that fails to close is logged as a warning, not raised.

    Args:
      failed: the run stopped on an error, which W&B and MLflow then show.
    """
    for tracker in self.trackers:
      try:
        tracker.close(failed)
      except Exception as error:  # noqa: BLE001 (a tracker's last flush must not hide the run's own outcome)
        _log.warning("%s: could not end its run (%s: %s)", tracker.name, type(error).__name__, error)
