"""The timer and machine name the benchmark scripts share (run as `python bench/<name>.py`, which puts bench/ on
the path)."""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any


def step_times(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> list[float]:
  """Wall times of `repeats` calls of `fn` after `warmup` untimed ones; `fn` must return once its work is done
  (block on JAX results inside it)."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> float:
  return statistics.median(step_times(fn, repeats, warmup))


def cpu_name() -> str:
  """The CPU's model name as `lscpu` gives it (BENCHMARKS.md quotes it beside every table)."""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
  except (OSError, StopIteration):
    return platform.processor()
