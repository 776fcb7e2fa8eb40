"""Trackers as metrics sinks (training/trackers.py), against the real packages offline: W&B in offline mode (its run
files parsed back and compared with metrics.jsonl row for row), MLflow with a local file: tracking URI (read back
through MLflow's client). A run stopped at step 8 and resumed to 12 continues the same W&B run and the same MLflow
run. A tracker that fails to start is one warning; a missing one is one line and exit 2, before anything is written."""

import json
import math

import mlflow.tracking as mlflow_tracking  # the references (the test extra installs them)

from tests import wandb_offline
from tests.conftest import needs_shakespeare
from tests.runs import assert_one_line_error, read_jsonl, run_train, run_train_patched, train_in_process

pytestmark = needs_shakespeare


TRACKERS = "--config.train.trackers=('tensorboard','wandb','mlflow')"


def tracker_env(tmp_path) -> dict:
  uri = (tmp_path / "mlruns").as_uri()
  # MLflow 3 keeps the file store for those who opt in; a database or a server needs the full mlflow package.
  return {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}


def same(a, b) -> bool:
  return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_wandb_and_mlflow_receive_what_metrics_jsonl_holds_and_a_resume_continues_their_runs(
  tmp_path, small_tokenizer, monkeypatch
):
  workdir, env = tmp_path / "run", tracker_env(tmp_path)
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the client that reads the runs back here
  first = run_train(
    workdir, small_tokenizer, TRACKERS, "--config.train.steps=8", "--config.train.run_name=micro", env=env
  )
  run_train(workdir, small_tokenizer, TRACKERS, "--config.train.steps=12", "--config.train.run_name=micro", env=env)
  assert "not tracking this run" not in first.stderr, first.stderr[-2000:]
  kept = json.loads((workdir / "trackers.json").read_text())
  rows = read_jsonl(workdir / "metrics.jsonl")
  assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))
  assert {"goodput", "time_device_s", "time_data_s", "time_checkpoint_s", "time_eval_s", "time_compile_s"} <= set(
    rows[0]
  )

  # W&B: two offline sessions of one run (the id kept in trackers.json); together they hold metrics.jsonl, row for row.
  runs = wandb_offline.offline_runs(str(workdir / "wandb"))
  assert len(runs) == 2 and {r["id"] for r in runs} == {kept["wandb"]["id"]}
  assert {r["project"] for r in runs} == {"llama_jax"}
  history = runs[0]["history"] + runs[1]["history"]
  assert len(history) == len(rows)
  for logged, written in zip(history, rows):
    assert logged.keys() == written.keys() and all(same(logged[k], written[k]) for k in written), (logged, written)
  assert runs[0]["config"]["train"]["steps"] == 8 and runs[1]["config"]["train"]["steps"] == 12  # the config, resumed
  assert runs[0]["config"]["model"]["dim"] == 32

  # MLflow: one run in the experiment, every metric's history equal to metrics.jsonl's, the config as params.
  client = mlflow_tracking.MlflowClient(env["MLFLOW_TRACKING_URI"])
  experiment = client.get_experiment_by_name("llama_jax")
  (run,) = client.search_runs([experiment.experiment_id])
  assert run.info.run_id == kept["mlflow"]["run_id"] and run.info.run_name == "micro"
  assert run.info.status == "FINISHED"
  for name in ("loss", "lr", "goodput", "time_data_s", "val_loss", "val_bits_per_byte"):
    expected = [(r["step"], r[name]) for r in rows if name in r]
    got = [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)]
    assert got == expected, name  # the same float64s: MLflow keeps a value as written
  assert run.data.params["train.lr"] == "0.01" and run.data.params["model.dim"] == "32"
  assert run.data.params["train.trackers"] == '["tensorboard", "wandb", "mlflow"]'
  assert run.data.params["train.run_name"] == "micro"  # a string as it is, not quoted
  assert run.data.params["train.steps"] == "8"  # MLflow params are immutable: the first session's
  assert run.data.tags["llama_jax.workdir"] == str(workdir)

  goodput = json.loads((workdir / "goodput.json").read_text())
  assert [(s["start_step"], s["step"]) for s in goodput["sessions"]] == [(0, 8), (8, 12)]


def test_a_tracker_that_fails_to_start_is_one_warning_and_the_run_goes_on(tmp_path, small_tokenizer):
  env = {"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "false"}
  result = run_train(tmp_path / "run", small_tokenizer, "--config.train.trackers=('mlflow',)", env=env)
  warnings = [line for line in result.stderr.splitlines() if "not tracking this run" in line]
  assert len(warnings) == 1 and "mlflow" in warnings[0] and "MlflowException" in warnings[0], result.stderr[-3000:]
  assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r] == list(range(1, 13))
  assert not (tmp_path / "run" / "trackers.json").exists()


def test_a_tracker_that_is_not_installed_is_one_line_before_anything_is_written(tmp_path, small_tokenizer):
  workdir = tmp_path / "run"
  hide_wandb = (  # the interpreter as it is, except that wandb cannot be found (as where the extra is not installed)
    "import importlib.util; find = importlib.util.find_spec\n"
    "importlib.util.find_spec = lambda name, *a: None if name == 'wandb' else find(name, *a)"
  )
  trackers = "--config.train.trackers=('tensorboard','wandb')"
  result = run_train_patched(workdir, small_tokenizer, hide_wandb, trackers, check=False)
  assert_one_line_error(result, "train.trackers names 'wandb'", 'pip install -e ".[wandb]"')
  assert not workdir.exists()


def test_unknown_and_repeated_trackers_are_refused_by_name(tmp_path, small_tokenizer, capfd):
  result = train_in_process(capfd, tmp_path / "a", small_tokenizer, "--config.train.trackers=('tensorbord',)")
  assert_one_line_error(result, "train.trackers", "tensorbord", "tensorboard, wandb, mlflow")
  result = train_in_process(capfd, tmp_path / "b", small_tokenizer, "--config.train.trackers=('wandb','wandb')")
  assert_one_line_error(result, "train.trackers names a tracker twice")


def test_a_run_that_stops_on_an_error_ends_its_tracker_runs_as_failed(tmp_path, small_tokenizer, monkeypatch):
  env = tracker_env(tmp_path)
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  # lr=1e30 (a typo for 1e-3): the loss is no longer finite within a few steps, and the run stops (exit 2).
  # WANDB_DIR set: W&B's files go there, as W&B users expect, and not under the workdir.
  env["WANDB_DIR"] = str(tmp_path / "wandb_dir")
  result = run_train(
    tmp_path / "run",
    small_tokenizer,
    "--config.train.trackers=('mlflow','wandb')",
    "--config.train.lr=1e30",
    env=env,
    check=False,
  )
  assert result.returncode == 2, result.stderr[-2000:]
  client = mlflow_tracking.MlflowClient(env["MLFLOW_TRACKING_URI"])
  (run,) = client.search_runs([client.get_experiment_by_name("llama_jax").experiment_id])
  assert run.info.status == "FAILED"
  assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")]  # what was logged before the stop
  (wandb_run,) = wandb_offline.offline_runs(str(tmp_path / "wandb_dir" / "wandb"))
  assert wandb_run["history"] and not (tmp_path / "run" / "wandb").exists()
