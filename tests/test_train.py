"""Training end to end through the CLI: loss goes down, exact resume after SIGKILL and SIGTERM, crash-safe saves,
evaluation, and one-line errors that leave the workdir untouched."""

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.conftest import ROOT, needs_shakespeare

pytestmark = needs_shakespeare

MICRO = [
  "--config.model.vocab_size=512",
  "--config.model.dim=32",
  "--config.model.n_layers=2",
  "--config.model.n_heads=2",
  "--config.model.n_kv_heads=1",
  "--config.model.multiple_of=16",
  "--config.data.sources=('shakespeare:sonnets,comedy_of_errors',)",
  "--config.data.val_sources=('shakespeare:lovers_complaint',)",
  "--config.train.seq_len=32",
  "--config.train.batch_size=4",
  "--config.train.steps=12",
  "--config.train.warmup_steps=2",
  "--config.train.lr=1e-2",
  "--config.train.log_every=1",
  "--config.train.eval_every=6",
  "--config.train.eval_batches=2",
  "--config.train.save_every=4",
  "--config.train.record_batches=True",
]


def run_train(workdir, tokenizer, *extra, env=None, check=True, module=("llama_jax.train",)):
  args = [
    sys.executable,
    "-m",
    *module,
    "--config",
    "configs/tiny.py",
    "--workdir",
    str(workdir),
    f"--config.data.tokenizer={tokenizer}",
    *MICRO,
    *extra,
  ]
  result = subprocess.run(
    args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, **(env or {}))
  )
  if check:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def final_checkpoint(workdir, step):
  base = os.path.join(workdir, "checkpoints", str(step))
  restore = ocp.StandardCheckpointer().restore
  return jax.tree.map(
    np.asarray, {"params": restore(os.path.join(base, "params")), "train": restore(os.path.join(base, "train"))}
  )


def assert_bit_identical(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    assert x.dtype == y.dtype and np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))


def batches_by_step(workdir):
  return {r["step"]: r["inputs_sha256"] for r in read_jsonl(os.path.join(workdir, "batches.jsonl"))}


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory, small_tokenizer):
  """Uninterrupted 12-step runs, one per gradient-accumulation setting, made once and shared."""
  runs = {}

  def get(accum: int):
    if accum not in runs:
      workdir = tmp_path_factory.mktemp(f"straight{accum}")
      run_train(workdir, small_tokenizer, f"--config.train.grad_accum={accum}")
      runs[accum] = workdir
    return runs[accum]

  return get


@pytest.fixture(params=[1, 2], ids=["no_accum", "grad_accum2"])
def uninterrupted(request, straight_runs):
  return request.param, straight_runs(request.param)


def test_loss_goes_down_and_validation_metrics_are_written(uninterrupted):
  _, workdir = uninterrupted
  records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 12 and np.mean(losses[-3:]) < losses[0] - 0.5
  val = [r for r in records if "val_loss" in r]
  assert [r["step"] for r in val] == [6, 12]
  assert val[-1]["val_loss"] < val[0]["val_loss"] and 0 < val[-1]["val_bits_per_byte"] < 10
  for key in ("grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu", "perplexity"):
    assert key in records[-2]
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  for name in ("model_config.json", "run_config.json", "tokenizer.model"):
    assert os.path.isfile(os.path.join(workdir, name))


def test_sigkill_after_a_checkpoint_then_rerun_is_bit_identical(uninterrupted, tmp_path, small_tokenizer):
  accum, straight = uninterrupted
  workdir = tmp_path / "killed"
  # Dies right after the step-8 save starts; the step-4 checkpoint is complete.
  killed = run_train(
    workdir, small_tokenizer, f"--config.train.grad_accum={accum}", check=False, module=("tests.fault_injection", "8")
  )
  assert killed.returncode == -signal.SIGKILL
  complete = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
  assert complete and complete[-1] in (4, 8)
  resumed = run_train(workdir, small_tokenizer, f"--config.train.grad_accum={accum}")
  assert f"steps {complete[-1]} → 12" in resumed.stdout
  assert_bit_identical(final_checkpoint(straight, 12), final_checkpoint(workdir, 12))
  # The same batches in the same order: every step's batch digest equals the uninterrupted run's.
  assert batches_by_step(workdir) == batches_by_step(straight)


def test_sigterm_saves_a_checkpoint_and_stops_cleanly(tmp_path, small_tokenizer):
  workdir = tmp_path / "preempted"
  args = [
    sys.executable,
    "-m",
    "llama_jax.train",
    "--config",
    "configs/tiny.py",
    "--workdir",
    str(workdir),
    f"--config.data.tokenizer={small_tokenizer}",
    *MICRO,
    "--config.train.steps=100000",
    "--config.train.save_every=100000",
    "--config.train.eval_every=0",
  ]
  process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  for line in process.stdout:
    if line.startswith("step      3 "):
      process.send_signal(signal.SIGTERM)
      break
  output = process.communicate(timeout=300)[0]
  assert process.returncode == 0, output
  assert "stopped by signal" in output
  saved = [int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()]
  assert len(saved) == 1 and saved[0] >= 3
  # The same command resumes from that step (and is stopped the same way).
  process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  first = next(line for line in process.stdout if "steps" in line)
  process.send_signal(signal.SIGTERM)
  process.communicate(timeout=300)
  assert f"steps {saved[0]} → 100000" in first, first


def test_incomplete_checkpoint_directory_is_ignored_on_resume(straight_runs, tmp_path, small_tokenizer):
  """What a kill mid-write leaves behind (orbax's temporary directory) never counts as a checkpoint."""
  straight = straight_runs(1)
  workdir = tmp_path / "partial"
  shutil.copytree(straight, workdir)
  for step in ("8", "12"):
    shutil.rmtree(workdir / "checkpoints" / step)
  # A step-8 save cut short: orbax's temporary name, with only part of what it writes.
  partial = workdir / "checkpoints" / "8.orbax-checkpoint-tmp-1234567890"
  shutil.copytree(straight / "checkpoints" / "8" / "params", partial / "params")
  resumed = run_train(workdir, small_tokenizer)
  assert "steps 4 → 12" in resumed.stdout
  assert_bit_identical(final_checkpoint(straight, 12), final_checkpoint(workdir, 12))


def test_evaluate_cli_reads_everything_from_the_checkpoint_dir(uninterrupted):
  _, workdir = uninterrupted
  result = subprocess.run(
    [sys.executable, "-m", "llama_jax.evaluate", "--checkpoint", str(workdir), "--max_batches", "2"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  val = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "val_loss" in r][-1]
  assert f"loss {val['val_loss']:.4f}" in result.stdout  # the same windows as the run's own validation
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "llama_jax.evaluate",
      "--checkpoint",
      str(workdir),
      "--data",
      "shakespeare:phoenix_and_the_turtle",
      "--seq_len",
      "16",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0 and "bits/byte" in result.stdout, result.stderr


def assert_one_line_error(result, *fragments):
  assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


def test_incompatible_workdir_is_refused_and_left_untouched(straight_runs, small_tokenizer):
  workdir = straight_runs(1)
  before = {p: os.path.getmtime(os.path.join(d, p)) for d, _, files in os.walk(workdir) for p in files}
  result = run_train(workdir, small_tokenizer, "--config.model.dim=64", check=False)
  assert_one_line_error(result, "different model", "dim 32 → 64")
  after = {p: os.path.getmtime(os.path.join(d, p)) for d, _, files in os.walk(workdir) for p in files}
  assert before == after


@pytest.mark.parametrize(
  "override,fragments",
  [
    ("--config.data.sources=('/no/such/file.txt',)", ["'/no/such/file.txt' does not exist"]),
    ("--config.train.seq_len=100000 --config.model.max_seq_len=100000", ["corpus too small for one batch"]),
    ("--config.model.vocab_size=100", ["the tokenizer has 512 tokens but model.vocab_size is 100"]),
    ("--config.train.hidden=3", ["unknown config key 'hidden'"]),
  ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, small_tokenizer, override, fragments):
  assert_one_line_error(run_train(tmp_path / "w", small_tokenizer, *override.split(), check=False), *fragments)


def test_empty_source_and_oversized_vocab(tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_text("\n\n")
  args = [
    sys.executable,
    "-m",
    "llama_jax.train",
    "--config",
    "configs/tiny.py",
    "--workdir",
    str(tmp_path / "w"),
    *[a for a in MICRO if "sources=" not in a],
  ]
  result = subprocess.run(
    args + [f"--config.data.sources=('{empty}',)", "--config.data.val_sources=()"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert_one_line_error(result, f"the training sources ['{empty}'] contain no text")
  small = tmp_path / "small.txt"
  small.write_text("a few words only, repeated. " * 20)
  result = subprocess.run(
    args + [f"--config.data.sources=('{small}',)", "--config.data.val_sources=()", "--config.data.vocab_size=5000"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert_one_line_error(result, "vocab_size 5000 is larger than this corpus supports")


def test_profile_steps_write_a_trace_for_tensorboard(tmp_path, small_tokenizer):
  workdir = tmp_path / "profiled"
  run_train(
    workdir,
    small_tokenizer,
    "--config.train.steps=4",
    "--config.train.eval_every=0",
    "--config.train.profile_steps=(2,2)",
  )
  runs = list((workdir / "profile" / "plugins" / "profile").iterdir())
  assert len(runs) == 1  # one trace: steps 2 and 3
  names = [p.name for p in runs[0].iterdir()]
  assert any(n.endswith(".xplane.pb") for n in names) and any(n.endswith(".trace.json.gz") for n in names), names


def test_train_step_carries_named_scopes_for_profiles():
  """Trainer.lower(): the compiled step's ops are named by model part (what a profile groups them by)."""
  import re

  from llama_jax import config as config_lib
  from llama_jax import sharding
  from llama_jax.train import Trainer

  run_config = config_lib.RunConfig().replace(
    model=dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, max_seq_len=32),
    train=dict(batch_size=2, seq_len=32),
  )
  trainer = Trainer(run_config.model, run_config, sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1]))
  op_names = set(re.findall(r'loc\("([^"]*)"', trainer.lower().as_text(debug_info=True)))
  for scope in ("attention", "mlp", "norm", "loss"):
    # "attention/dot_general", "jit(train_step)/jvp(loss)/reduce_max": the scope, under any transformation.
    assert any(re.search(rf"(^|/|\(){scope}(\)|/)", name) for name in op_names), (scope, sorted(op_names)[:20])
