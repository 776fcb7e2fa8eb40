"""Metrics sinks beside ``metrics.jsonl``: TensorBoard, Weights & Biases and MLflow (``train.trackers``).

Every metric the run writes (train windows, evaluations, the time split and goodput; DPO's rewards; whatever an
objective adds) reaches every sink through ``MetricsWriter.write``, from process 0 only, under the names
``metrics.jsonl`` uses, with the train step as the x-axis. The run config is the run's config (W&B ``config``, MLflow
params, flattened as ``train.lr``).

A resumed run continues the same tracker runs: their ids are kept in the workdir (``trackers.json``). W&B is told
that ``step`` is its x-axis (``define_metric``) and each row carries it, so steps trained again after a resume from
an older checkpoint are logged again, as ``metrics.jsonl`` holds them, instead of being dropped by W&B as steps
that went backwards. MLflow params cannot change once logged: a resume keeps the first session's.

A tracker that fails to start (no credentials, a server that does not answer) is one warning and the run goes on
without it; a tracker whose package is not installed is refused before the run starts (``check_available``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from llama_jax.core import paths
from llama_jax.core.errors import LlamaJaxError

_log = logging.getLogger(__name__)

# tracker → (the module it imports, the extra that installs it)
_PACKAGES = {"tensorboard": ("tensorboardX", None), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
_MLFLOW_BATCH = 100  # MLflow takes at most 100 params (and 1,000 metrics) in one log_batch call
_MLFLOW_PARAM_CHARS = 6000  # its longest param value


class TrackerError(LlamaJaxError, ValueError):
  """A tracker the run asks for is not installed."""


def check_available(names: tuple[str, ...]) -> None:
  """Refuses, in one line, a tracker whose package is missing (before anything runs)."""
  for name in names:
    module, extra = _PACKAGES[name]
    if extra is not None and importlib.util.find_spec(module) is None:
      raise TrackerError(
        f'train.trackers names {name!r}, but {module} is not installed: pip install -e ".[{extra}]" (or drop '
        f"{name!r} from train.trackers)"
      )


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"train": {"lr": 1e-3}} → {"train.lr": 1e-3}."""
  flat = {}
  for key, value in config.items():
    if isinstance(value, Mapping):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


class Tracker:
  name = ""

  def log(self, step: int, metrics: dict[str, float]) -> None:
    raise NotImplementedError

  def close(self, failed: bool = False) -> None:
    pass


def _summary_writer() -> type:
  """tensorboardX's SummaryWriter, imported without torch. tensorboardX imports torch whenever it is installed, only
  to accept torch tensors; we log Python floats, and the import cost every training run 3.2 s of its start (4.0 s
  against 0.6 s for tensorboardX, measured on a 2-core EPYC). A process that already holds torch keeps it."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
  else:
    sys.modules["torch"] = None  # `import torch` raises ImportError while this entry is in place
    try:
      from tensorboardX import SummaryWriter
    finally:
      del sys.modules["torch"]
  return SummaryWriter


class TensorBoardTracker(Tracker):
  """Scalars in workdir/tensorboard (tensorboardX writes local and gs:// directories)."""

  name = "tensorboard"

  def __init__(self, workdir: str):
    self._writer = _summary_writer()(str(paths.path(workdir, "tensorboard")))

  def log(self, step: int, metrics: dict[str, float]) -> None:
    for key, value in metrics.items():
      if math.isfinite(value):  # a skipped step's NaN stays in metrics.jsonl; TensorBoard would only warn
        self._writer.add_scalar(key, value, step)
    self._writer.flush()

  def close(self, failed: bool = False) -> None:
    self._writer.close()


class WandbTracker(Tracker):
  """A W&B run in `project`, its files where WANDB_DIR says when it is set, else under the workdir (W&B needs a local
  directory: a gs:// workdir's go to its local cache). WANDB_MODE, WANDB_ENTITY and the API key come from W&B's own
  environment variables."""

  name = "wandb"

  def __init__(self, workdir: str, config: dict, project: str, run_name: str, record: dict | None):
    import wandb

    self._run = wandb.init(
      project=(record or {}).get("project", project),
      name=run_name,
      id=record["id"] if record else None,
      resume="allow",
      dir=None if os.environ.get("WANDB_DIR") else paths.local_dir(workdir, ""),  # None: W&B reads WANDB_DIR
      config=config if record is None else None,
    )
    if record is not None:  # a resume: the config as this session runs it (steps raised, say)
      self._run.config.update(config, allow_val_change=True)
    self._run.define_metric("step")
    self._run.define_metric("*", step_metric="step")
    self.record = {"id": self._run.id, "project": self._run.project}

  def log(self, step: int, metrics: dict[str, float]) -> None:
    self._run.log({"step": step, **metrics})

  def close(self, failed: bool = False) -> None:
    self._run.finish(exit_code=1 if failed else 0)


class MlflowTracker(Tracker):
  """An MLflow run in experiment `project` at `tracking_uri` (empty: MLflow's own, e.g. MLFLOW_TRACKING_URI).
  Metrics are logged asynchronously (MLflow's queue), so a remote server's latency stays out of the loop."""

  name = "mlflow"

  def __init__(self, workdir: str, config: dict, project: str, run_name: str, record: dict | None, tracking_uri: str):
    import mlflow
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    self._metric = Metric
    uri = tracking_uri or mlflow.get_tracking_uri()
    self._client = MlflowClient(uri)
    if record is not None and record.get("tracking_uri") == uri:
      self._run_id = record["run_id"]
      self._client.update_run(self._run_id, status="RUNNING")
    else:
      experiment = self._client.get_experiment_by_name(project)
      experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
      self._run_id = self._client.create_run(
        experiment_id, run_name=run_name, tags={"llama_jax.workdir": paths.absolute(workdir)}
      ).info.run_id
      params = [Param(k, _param_text(v)) for k, v in sorted(flatten(config).items())]
      for i in range(0, len(params), _MLFLOW_BATCH):
        self._client.log_batch(self._run_id, params=params[i : i + _MLFLOW_BATCH])
    self._pending: list[Any] = []
    self.record = {"run_id": self._run_id, "tracking_uri": uri}

  def log(self, step: int, metrics: dict[str, float]) -> None:
    now = int(time.time() * 1000)
    batch = [self._metric(key, float(value), now, step) for key, value in metrics.items()]
    operation = self._client.log_batch(self._run_id, metrics=batch, synchronous=False)
    if operation is not None:
      self._pending.append(operation)

  def close(self, failed: bool = False) -> None:
    for operation in self._pending:
      operation.wait()
    self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")


def _param_text(value: Any) -> str:
  """An MLflow param: strings as they are, other values as JSON (a tuple as [..]), cut to MLflow's longest."""
  return (value if isinstance(value, str) else json.dumps(value))[:_MLFLOW_PARAM_CHARS]


def open_trackers(
  names: tuple[str, ...], workdir: str, config: dict, *, project: str, run_name: str, mlflow_tracking_uri: str
) -> list[Tracker]:
  """Starts the named trackers (process 0); one that fails is one warning. The W&B and MLflow run ids go to the
  workdir's trackers.json, where a resume finds them."""
  records_file = paths.path(workdir, paths.TRACKERS_FILE)
  records = json.loads(records_file.read_text()) if records_file.exists() else {}
  run_name = run_name or paths.name(workdir)
  trackers: list[Tracker] = []
  for name in names:
    try:
      if name == "tensorboard":
        trackers.append(TensorBoardTracker(workdir))
      elif name == "wandb":
        trackers.append(WandbTracker(workdir, config, project, run_name, records.get(name)))
      else:
        tracker = MlflowTracker(workdir, config, project, run_name, records.get(name), mlflow_tracking_uri)
        trackers.append(tracker)
    except Exception as error:  # noqa: BLE001 (tracking must never cost the run: no credentials, no server, ...)
      first_line = (str(error).splitlines() or [""])[0]
      _log.warning("%s: not tracking this run (%s: %s)", name, type(error).__name__, first_line)
  kept = {t.name: t.record for t in trackers if hasattr(t, "record")}
  if kept and kept != {k: records.get(k) for k in kept}:
    with paths.atomic_write(records_file) as f:
      f.write(json.dumps({**records, **kept}, indent=1) + "\n")
  return trackers


def log_all(trackers: list[Tracker], step: int, metrics: dict[str, float]) -> None:
  """Hands metrics to every tracker; one that fails is dropped with one warning (the run goes on)."""
  for tracker in list(trackers):
    try:
      tracker.log(step, metrics)
    except Exception as error:  # noqa: BLE001
      _log.warning("%s: stopped tracking at step %d (%s: %s)", tracker.name, step, type(error).__name__, error)
      trackers.remove(tracker)
