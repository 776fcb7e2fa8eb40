"""Training metrics out of the loop without stalling it: one line to stdout, ``metrics.jsonl`` and TensorBoard events
in the workdir, from process 0 only.

Train metrics are read one step late: a step's metrics stay on the device until the *next* step has been dispatched,
so fetching them never leaves the device idle, and the line for a window of ``log_every`` steps is written one step
after the window ends (loss averaged over the window; throughput and MFU from wall time between windows).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from llama_jax.core import paths
from llama_jax.model.loss import perplexity

_log = logging.getLogger(__name__)


def format_value(value: float) -> str:
  if isinstance(value, int) or (abs(value) >= 1000 and float(value).is_integer()):
    return f"{int(value):,}"
  return f"{value:.4g}"


class MetricsWriter:
  """Writes metrics of a step (`write`), and buffers each train step's device metrics to write them a step late
  (`add_step`, `flush`). Disabled (everything a no-op) on processes other than 0."""

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
    echo: Callable[[str], None] | None = None,
  ):
    self.enabled, self.echo = enabled, echo or functools.partial(print, flush=True)
    self._jsonl = str(paths.path(workdir, paths.METRICS_FILE))
    self._tensorboard = None
    if enabled:
      try:
        from tensorboardX import SummaryWriter

        self._tensorboard = SummaryWriter(str(paths.path(workdir, "tensorboard")))
      except ImportError as e:  # tensorboardX itself, or google-cloud-storage for a gs:// workdir
        _log.warning("no TensorBoard events: %s", e)
    self._log_every, self._tokens_per_step = log_every, tokens_per_step
    self._flops_per_step, self._peak_flops = flops_per_step, peak_flops
    self._pending: list[tuple[int, dict[str, Any]]] = []  # (step, device metrics) not yet fetched
    self._due: int | None = None  # a window that ended at this step, written once the next step is dispatched
    self.last_train: dict[str, float] = {}
    self.restart_clock(start_step)

  def write(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
    if not self.enabled:
      return
    paths.append_line(self._jsonl, json.dumps({"step": step, **{f"{prefix}{k}": v for k, v in metrics.items()}}))
    if self._tensorboard is not None:
      for key, value in metrics.items():
        if math.isfinite(value):  # a skipped step's NaN stays in metrics.jsonl; TensorBoard would only warn
          self._tensorboard.add_scalar(f"{prefix}{key}", value, step)
      self._tensorboard.flush()
    self.echo(f"step {step:>6d} | " + " | ".join(f"{prefix}{k} {format_value(v)}" for k, v in metrics.items()))

  def add_step(self, step: int, device_metrics: dict[str, Any]) -> None:
    """Step `step` has been dispatched: the window due at the step before is written now."""
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
    """Throughput counts from here, step `step` (the run's start or resume)."""
    self._window_start, self._window_step = time.perf_counter(), step

  def exclude(self, seconds: float) -> None:
    """Leaves `seconds` (an evaluation's) out of the current window's time: they are not training throughput. The
    window keeps its steps; restarting the clock instead lost the steps pending since the last line, and a run whose
    last step was evaluated before its last line was written then divided by zero steps at the end."""
    self._window_start += seconds

  def _write_window(self, until: int) -> None:
    fetched = jax.device_get([m for s, m in self._pending if s <= until])
    self._pending = [(s, m) for s, m in self._pending if s > until]
    self._due = None
    now = time.perf_counter()
    elapsed, steps = now - self._window_start, until - self._window_step
    finite_losses = [m["loss"] for m in fetched if not m.get("nonfinite", 0)]
    loss = float(np.mean(finite_losses)) if finite_losses else float("nan")
    skipped = sum(int(m.get("nonfinite", 0)) for m in fetched)
    # An objective's own means (DPO: rewards, reward accuracy, margin, log-probs), averaged like the loss.
    extra = sorted(set(fetched[-1]) - {"loss", "grad_norm", "lr", "tokens", "pairs", "nonfinite"})
    finite = [m for m in fetched if not m.get("nonfinite", 0)]
    self.last_train = dict(
      loss=loss,
      **{k: float(np.mean([m[k] for m in finite])) if finite else float("nan") for k in extra},
      grad_norm=float(fetched[-1]["grad_norm"]),
      lr=float(fetched[-1]["lr"]),
      tokens_per_s=self._tokens_per_step * steps / elapsed,
      step_time_s=elapsed / steps,
      mfu=self._flops_per_step * steps / elapsed / self._peak_flops,
    )
    if "pairs" not in fetched[-1]:  # exp of a DPO loss is no perplexity
      self.last_train["perplexity"] = perplexity(loss)
    if skipped:  # steps of this window that were not applied (non-finite loss or gradients)
      self.last_train["skipped_steps"] = skipped
    self.write(until, self.last_train)
    self._window_start, self._window_step = now, until

  def close(self) -> None:
    if self._tensorboard is not None:
      self._tensorboard.close()
