"""Damaged checkpoints and failed writes. The latest step of a trained workdir is damaged four ways (an array file
truncated, deleted, or with bytes flipped at the same size; the params metadata garbled): training falls back to the
previous step with a warning and keeps the damaged step (moved aside, never deleted); sample, evaluate, serve and
convert --to_hf refuse it in one line naming the step and the file, and read the previous one with --step. A save
that cannot be written (a full disk, a denied permission) ends the run in one line naming the path, the previous
checkpoint stays the latest and a rerun resumes from it."""

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

from llama_jax import convert, evaluate, serve
from llama_jax import sample as sample_lib
from llama_jax.checkpoint import digests, train_state
from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core import paths
from llama_jax.core.run_config import RunConfig
from llama_jax.inference import sampler as sampler_lib
from llama_jax.model import sharding
from llama_jax.training import trainer as train
from tests.conftest import ROOT, needs_shakespeare, skip_or_fail
from tests.runs import assert_one_line_error, file_digests, run_train, train_args

pytestmark = needs_shakespeare

SHORT = ("--config.train.steps=8", "--config.train.eval_every=0")  # saves steps 4 and 8


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_tokenizer):
  """A micro run of 8 steps through the CLI: checkpoints 4 and 8, each with its digests.json."""
  workdir = tmp_path_factory.mktemp("trained") / "run"
  run_train(workdir, small_tokenizer, *SHORT)
  return workdir


def copy_of(trained, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  return workdir


def array_file(step_dir) -> str:
  """The largest array data file of the step's params, relative to the step: a chunk file of orbax's OCDBT store
  (params/ocdbt.process_0/d/<hash>), the bytes of the arrays themselves."""
  found = []
  for root, _, names in os.walk(step_dir / "params"):
    if os.path.basename(root) == "d":
      found += [os.path.join(root, name) for name in names]
  assert found, sorted(os.listdir(step_dir / "params"))
  path = max(found, key=lambda p: (os.path.getsize(p), p))
  return os.path.relpath(path, step_dir)


def truncate(step_dir) -> str:
  rel = array_file(step_dir)
  os.truncate(step_dir / rel, os.path.getsize(step_dir / rel) // 2)
  return rel


def delete(step_dir) -> str:
  rel = array_file(step_dir)
  os.remove(step_dir / rel)
  return rel


def flip_bytes(step_dir) -> str:
  """64 bytes in the middle of the file inverted: the same size, different content (what bit rot does)."""
  rel = array_file(step_dir)
  data = bytearray((step_dir / rel).read_bytes())
  middle = len(data) // 2
  data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
  (step_dir / rel).write_bytes(bytes(data))
  return rel


def garble_metadata(step_dir) -> str:
  rel = os.path.join("params", "_METADATA")
  assert (step_dir / rel).is_file(), sorted(os.listdir(step_dir / "params"))
  (step_dir / rel).write_bytes(b'{"tree_metadata": garbled')
  return rel


DAMAGE = {"truncated": truncate, "deleted": delete, "flipped_bytes": flip_bytes, "garbled_metadata": garble_metadata}


def saved_steps(workdir) -> list[str]:
  return sorted(os.listdir(workdir / "checkpoints"), key=lambda name: (len(name), name))


def one_error_line(capsys) -> str:
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  return lines[0]


def refused(capsys, main, args) -> str:
  with pytest.raises(SystemExit) as exited:
    main(args)
  assert exited.value.code == 2
  return one_error_line(capsys)


def run_config_of(workdir) -> RunConfig:
  return RunConfig.from_dict(json.loads((workdir / "run_config.json").read_text()))


def restore_latest(workdir):
  """What a rerun of training restores (train._restore_or_init calls this): (step, state, data state) or None."""
  run_config = run_config_of(workdir)
  trainer = train.Trainer(run_config.model, run_config, sharding.make_mesh(run_config.mesh))
  checkpointer = train_state.TrainCheckpointer(str(workdir))
  try:
    return checkpointer.restore_latest(trainer.abstract_state())
  finally:
    checkpointer.close()


def damage_warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "is damaged" in r.getMessage()]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_latest_step_is_refused_named_and_skipped(trained, tmp_path, capsys, caplog, damage):
  workdir = copy_of(trained, tmp_path)
  rel = DAMAGE[damage](workdir / "checkpoints" / "8")
  damaged_files = file_digests(workdir / "checkpoints" / "8")
  ckpt = ["--checkpoint", str(workdir)]

  # Readers refuse step 8, naming it and the file, and say which --step reads the previous one.
  for name, main, args in (
    ("sample", sample_lib.main, [*ckpt, "--prompt", "ROMEO:", "--max_new_tokens", "4"]),
    ("evaluate", evaluate.main, [*ckpt, "--max_batches", "1"]),
    ("serve", serve.main, ckpt),
    ("convert", convert.main, ["--to_hf", str(workdir), "--out", str(tmp_path / "hf")]),
  ):
    line = refused(capsys, main, args)
    assert f"step 8 is damaged: {rel}" in line and "pass --step 4" in line, (name, line)
  assert not (tmp_path / "hf").exists()
  # The step they would read instead (the CLIs' --step reaches these; test_cli_* runs it through evaluate).
  assert checkpoint_params.load_params(str(workdir), step=4)[0].dim == 32
  assert sampler_lib.load_sampler(str(workdir), step=4)[0].cfg.dim == 32
  assert convert.main(["--to_hf", str(workdir), "--out", str(tmp_path / "hf"), "--step", "4"]) == 0
  assert (tmp_path / "hf" / "config.json").is_file()

  # A training rerun restores step 4 with one warning; step 8 is moved aside exactly as it was, never deleted.
  step, state, _ = restore_latest(workdir)
  assert step == 4 and int(state["step"]) == 4
  warnings = damage_warnings(caplog)
  assert len(warnings) == 1, warnings
  assert f"step 8 is damaged: {rel}" in warnings[0] and "resuming from step 4" in warnings[0], warnings[0]
  assert str(workdir / "checkpoints" / "8.damaged") in warnings[0], warnings[0]
  assert saved_steps(workdir) == ["4", "8.damaged"]
  assert file_digests(workdir / "checkpoints" / "8.damaged") == damaged_files


def test_cli_refuses_in_one_line_and_training_goes_on_from_step_4(trained, tmp_path, capsys, caplog):
  """sample and evaluate as commands exit 2 with one line, evaluate --step 4 reads step 4; training (train.train, what
  the CLI runs) warns, resumes from step 4 and saves on (8 again, then 12), the damaged step kept through rotation."""
  workdir = copy_of(trained, tmp_path)
  rel = flip_bytes(workdir / "checkpoints" / "8")
  for command in (
    ["llama_jax.sample", "--prompt", "ROMEO:", "--max_new_tokens", "4"],
    ["llama_jax.evaluate", "--max_batches", "1"],
  ):
    result = subprocess.run(
      [sys.executable, "-m", *command, "--checkpoint", str(workdir)], cwd=ROOT, capture_output=True, text=True
    )
    assert_one_line_error(result, f"step 8 is damaged: {rel}", "pass --step 4")
  assert evaluate.main(["--checkpoint", str(workdir), "--max_batches", "1", "--step", "4"]) == 0
  assert "loss " in capsys.readouterr().out

  result = train.train(run_config_of(workdir).replace(train=dict(steps=12, keep=2)), str(workdir))
  assert result["step"] == 12 and "steps 4 → 12" in capsys.readouterr().out
  warnings = damage_warnings(caplog)
  assert len(warnings) == 1 and f"step 8 is damaged: {rel}" in warnings[0], warnings
  # keep=2 rotated step 4 out once 8 and 12 were saved; the damaged step is no step to orbax, so it stays.
  assert saved_steps(workdir) == ["8", "12", "8.damaged"]
  for step in ("8", "12"):
    assert (workdir / "checkpoints" / step / paths.DIGESTS_FILE).is_file()
    assert digests.step_damage(workdir / "checkpoints" / step) is None


def test_every_step_damaged_is_refused_and_nothing_moves(trained, tmp_path, capsys):
  workdir = copy_of(trained, tmp_path)
  for step in ("4", "8"):
    truncate(workdir / "checkpoints" / step)
  with pytest.raises(digests.CheckpointError, match=r"every checkpoint step of workdir .* is damaged \(step 8: "):
    restore_latest(workdir)
  assert saved_steps(workdir) == ["4", "8"]
  line = refused(capsys, evaluate.main, ["--checkpoint", str(workdir), "--step", "4"])
  assert "step 4 is damaged" in line and "there is no earlier step" in line


def test_a_step_without_digests_is_read_unchecked(trained, tmp_path):
  """Checkpoints written before there were digests load as before."""
  workdir = copy_of(trained, tmp_path)
  os.remove(workdir / "checkpoints" / "8" / paths.DIGESTS_FILE)
  assert digests.step_damage(workdir / "checkpoints" / "8") is None
  assert restore_latest(workdir)[0] == 8


def file_size_limited(args: list[str]) -> list[str]:
  """`args` under ``ulimit -f 32``: files may grow to 32 KiB, enough for the logs but not for a checkpoint's array
  data. Python ignores SIGXFSZ, so writes past it fail with EFBIG ("File too large") instead of killing the process.
  (A shell rather than preexec_fn: forking this multithreaded JAX process to run Python in the child can deadlock.)"""
  return ["bash", "-c", 'ulimit -f 32 && exec "$@"', "bash", *args]


def error_lines(stderr: str) -> list[str]:
  """stderr without absl's INFO records (``I1201 19:42:21.868784 … data.py:247] reusing prepared data``)."""
  return [line for line in stderr.strip().splitlines() if not re.match(r"I\d{4} \d\d:\d\d:\d\d", line)]


def test_disk_full_ends_the_run_in_one_line_and_a_rerun_resumes(trained, tmp_path, small_tokenizer):
  workdir = copy_of(trained, tmp_path)
  args = train_args(workdir, small_tokenizer, "--config.train.steps=12", SHORT[1])
  failed = subprocess.run(file_size_limited(args), cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert failed.returncode == 2, failed.stderr[-3000:]
  lines = error_lines(failed.stderr)
  # One line. The failed save's orphaned write tasks log their tracebacks through asyncio as they are collected,
  # a timing-dependent 0 to 115 lines after the error in runs measured by hand (1 CI run of 2 had some here);
  # they are silenced once the failure is reported.
  assert len(lines) == 1 and lines[0].startswith("error: could not write checkpoint step 12 to "), lines
  assert str(workdir / "checkpoints" / "12.orbax-checkpoint-tmp") in lines[0] and "(File too large)" in lines[0]
  assert "the latest checkpoint is still step 8" in lines[0]
  assert [s for s in saved_steps(workdir) if s.isdigit()] == ["4", "8"]
  # A rerun resumes from step 8 and saves step 12, over what the failed save left.
  step, state, data_state = restore_latest(workdir)
  assert step == 8
  resave(workdir, 12, state, data_state)
  assert saved_steps(workdir) == ["4", "8", "12"]
  assert digests.step_damage(workdir / "checkpoints" / "12") is None


def resave(workdir, step, state, data_state):
  checkpointer = train_state.TrainCheckpointer(str(workdir))
  try:
    checkpointer.save(step, state, data_state)
  finally:
    checkpointer.close()


def deny_writes(directory) -> Callable[[], None]:
  """Makes `directory` unwritable and returns the undo: mode 555, or for root (whom modes do not stop) the immutable
  attribute (chattr +i)."""
  if os.geteuid() != 0:
    os.chmod(directory, 0o555)
    return lambda: os.chmod(directory, 0o755)
  if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(directory)]).returncode != 0:
    skip_or_fail("running as root where chattr +i is not available: nothing denies root a write")
  return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_permission_denied_names_the_path_and_keeps_the_latest_step(trained, tmp_path, async_save):
  workdir = copy_of(trained, tmp_path)
  step, state, data_state = restore_latest(workdir)
  checkpointer = train_state.TrainCheckpointer(str(workdir), async_save=async_save)
  undo = deny_writes(workdir / "checkpoints")
  try:
    with pytest.raises(digests.CheckpointError) as failed:
      checkpointer.save(12, state, data_state)
      checkpointer.close()
  finally:
    undo()
  checkpointer.close()  # reported once: closing again raises nothing
  message = str(failed.value)
  assert message.startswith(f"could not write checkpoint step 12 to {workdir / 'checkpoints'}"), message
  assert "PermissionError" in message and "the latest checkpoint is still step 8" in message, message
  assert "\n" not in message
  assert saved_steps(workdir) == ["4", "8"]
  assert restore_latest(workdir)[0] == 8


def test_a_step_that_matches_its_digests_but_does_not_restore_stops_and_moves_nothing(trained, tmp_path):
  """Not damage (the files are as saved) but a train state this run does not have: falling back would roll the run
  back and set a good step aside, so the run stops instead, naming the step."""
  import jax
  import jax.numpy as jnp

  workdir = copy_of(trained, tmp_path)
  run_config = run_config_of(workdir)
  trainer = train.Trainer(run_config.model, run_config, sharding.make_mesh(run_config.mesh))
  abstract = dict(trainer.abstract_state(), extra=jax.ShapeDtypeStruct((3,), jnp.float32))
  checkpointer = train_state.TrainCheckpointer(str(workdir))
  try:
    with pytest.raises(digests.CheckpointError, match=r"step 8 of workdir .* matches its digests but does not"):
      checkpointer.restore_latest(abstract)
  finally:
    checkpointer.close()
  assert saved_steps(workdir) == ["4", "8"]
