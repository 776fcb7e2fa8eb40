"""Training end to end through the CLI: loss goes down, exact resume after SIGKILL and SIGTERM, crash-safe saves,
evaluation, and one-line errors that leave the workdir untouched."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from tests.conftest import ROOT, needs_shakespeare
from tests.runs import (
  MICRO,
  assert_bit_identical,
  assert_one_line_error,
  assert_same_batches,
  file_digests,
  final_checkpoint,
  main_result,
  read_jsonl,
  run_train,
  train_args,
  train_in_process,
)

pytestmark = needs_shakespeare


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


def expected_lr(count: int, peak: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
  """Linear warmup from 0 to `peak` over `warmup` steps, then cosine decay to peak·min_lr_ratio at `steps`."""
  if count < warmup:
    return peak * count / warmup
  end = peak * min_lr_ratio
  return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * (count - warmup) / (steps - warmup)))


def utf8_bytes_per_token(sp) -> np.ndarray:
  """The UTF-8 bytes of text each token id stands for: 1 for a byte-fallback piece, 0 for bos/eos/unk, otherwise the
  piece with sentencepiece's "▁" read as a space."""
  lengths = np.zeros(sp.get_piece_size(), np.int64)
  for i in range(sp.get_piece_size()):
    if sp.is_byte(i):
      lengths[i] = 1
    elif not (sp.is_control(i) or sp.is_unknown(i)):
      lengths[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
  return lengths


def validation_sums(workdir, step: int, n_windows: int) -> tuple[float, int, int]:
  """(summed loss in nats, tokens, UTF-8 bytes of the target tokens) of the checkpoint at `step` on the first
  `n_windows` validation windows, computed here from val.bin with numpy."""
  import sentencepiece
  from flax import nnx

  from llama_jax.checkpoint import params as checkpoint_params
  from llama_jax.model import sharding
  from llama_jax.model.llama import Llama

  run_config = json.loads((workdir / "run_config.json").read_text())
  seq_len = run_config["train"]["seq_len"]
  meta = json.loads((workdir / "data" / "meta.json").read_text())
  tokens = np.fromfile(workdir / "data" / "val.bin", dtype=meta["dtype"]).astype(np.int64)
  windows = np.stack([tokens[i * seq_len : (i + 1) * seq_len + 1] for i in range(n_windows)])
  inputs, targets = windows[:, :-1], windows[:, 1:]
  cfg = checkpoint_params.read_model_config(str(workdir))
  graphdef, _ = sharding.abstract_params(Llama, cfg)
  params = final_checkpoint(workdir, step)["params"]
  logits = np.asarray(nnx.merge(graphdef, params)(jax.numpy.asarray(inputs, np.int32)), np.float64)
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  loss_sum = -np.take_along_axis(log_probs, targets[..., None], axis=-1).sum()
  sp = sentencepiece.SentencePieceProcessor(model_file=str(workdir / "tokenizer.model"))
  return float(loss_sum), targets.size, int(utf8_bytes_per_token(sp)[targets].sum())


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

  # Step 12's validation (eval_batches 2 × batch_size 4 = the first 8 windows), recomputed from its checkpoint.
  loss_sum, n_tokens, n_bytes = validation_sums(workdir, 12, 8)
  assert val[-1]["val_loss"] == pytest.approx(loss_sum / n_tokens, rel=1e-5)
  assert val[-1]["val_bits_per_byte"] == pytest.approx(loss_sum / math.log(2) / n_bytes, rel=1e-5)

  # The line of step s is the step that ran at optimizer count s - 1 (0-based), so it logs the schedule there.
  train = json.loads((workdir / "run_config.json").read_text())["train"]
  logged_lr = {r["step"]: r["lr"] for r in records if "lr" in r}
  assert sorted(logged_lr) == list(range(1, 13))
  for step, lr in logged_lr.items():
    want = expected_lr(step - 1, train["lr"], train["warmup_steps"], train["steps"], train["min_lr_ratio"])
    assert lr == pytest.approx(want, rel=1e-5, abs=1e-9), step


def test_sigkill_after_a_checkpoint_then_rerun_is_bit_identical(uninterrupted, tmp_path, small_tokenizer):
  accum, straight = uninterrupted
  workdir = tmp_path / "killed"
  # SIGKILL while the step-8 save is in flight: its items are written but orbax's commit (renaming the temporary
  # directory to checkpoints/8) is held back; the step-4 checkpoint is complete.
  killed = run_train(
    workdir,
    small_tokenizer,
    f"--config.train.grad_accum={accum}",
    check=False,
    module=("tests.fault_injection", "sigkill", "8"),
  )
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  entries = os.listdir(workdir / "checkpoints")
  assert sorted(d for d in entries if d.isdigit()) == ["4"]
  partial = [d for d in entries if d.startswith("8.orbax-checkpoint-tmp")]
  assert len(partial) == 1, entries
  assert {"params", "train", "data"} <= set(os.listdir(workdir / "checkpoints" / partial[0]))
  resumed = run_train(workdir, small_tokenizer, f"--config.train.grad_accum={accum}")
  assert "steps 4 → 12" in resumed.stdout, resumed.stdout
  assert_bit_identical(final_checkpoint(straight, 12), final_checkpoint(workdir, 12))
  assert_same_batches(workdir, straight)


def test_sigterm_after_a_step_then_rerun_is_bit_identical(straight_runs, tmp_path, small_tokenizer):
  """Preemption at step 6 (between saves): the loop stops there, saves step 6, and the rerun resumes from it exactly."""
  straight = straight_runs(1)
  workdir = tmp_path / "preempted"
  stopped = run_train(workdir, small_tokenizer, module=("tests.fault_injection", "sigterm", "6"))
  assert "stopped by signal at step 6" in stopped.stdout, stopped.stdout
  assert sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()) == [4, 6]
  resumed = run_train(workdir, small_tokenizer)
  assert "steps 6 → 12" in resumed.stdout, resumed.stdout
  assert_bit_identical(final_checkpoint(straight, 12), final_checkpoint(workdir, 12))
  assert_same_batches(workdir, straight)


def test_sigterm_saves_a_checkpoint_and_stops_cleanly(tmp_path, small_tokenizer):
  """A real SIGTERM from another process, while the run trains (towards 100,000 steps)."""
  workdir = tmp_path / "preempted"
  args = train_args(
    workdir,
    small_tokenizer,
    "--config.train.steps=100000",
    "--config.train.save_every=100000",
    "--config.train.eval_every=0",
  )
  limit_s = 300
  process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  # Whatever happens (a changed log line, a signal that does not stop the run), the process dies within the limit.
  watchdog = threading.Timer(limit_s, process.kill)
  watchdog.start()
  try:
    seen = []
    for line in process.stdout:
      seen.append(line)
      if line.startswith("step      3 "):
        process.send_signal(signal.SIGTERM)
        break
    output = "".join(seen) + process.communicate()[0]
  finally:
    watchdog.cancel()
  assert process.returncode != -signal.SIGKILL, f"killed after {limit_s} s: no 'step 3' line, or no stop\n{output}"
  assert any(line.startswith("step      3 ") for line in seen), output
  assert process.returncode == 0, output
  stopped = [line for line in output.splitlines() if line.startswith("stopped by signal at step ")]
  assert len(stopped) == 1, output
  step = int(stopped[0].split()[5].rstrip(";"))
  assert step >= 3
  # One checkpoint, of the step the run stopped at (save_every is never reached).
  assert [d for d in os.listdir(workdir / "checkpoints") if d.isdigit()] == [str(step)]


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
  # The same windows as the run's own validation, through another program (the decode placement, its own jit):
  # equal to float32 rounding, not bit for bit.
  loss = float(re.search(r"^loss ([\d.]+) \|", result.stdout, flags=re.M).group(1))
  assert loss == pytest.approx(val["val_loss"], abs=1.5e-4), (loss, val["val_loss"])
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


def test_evaluate_data_takes_files_directories_globs_and_jsonl(straight_runs, tmp_path, capsys):
  """`--data` in each form reads the same two documents: the same token count (what tokenizing them gives: bos +
  tokens + eos each, cut into windows of seq_len + 1) and the same loss. Run in process: the CLI's own main()."""
  import sentencepiece

  from llama_jax import evaluate

  workdir, seq_len = straight_runs(1), 8
  documents = [
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate.\n" * 3,
    "Rough winds do shake the darling buds of May — café, 夏日, naïve.\n" * 2,
  ]
  docs = tmp_path / "docs"
  docs.mkdir()
  for name, text in zip(("a.txt", "b.txt"), documents):
    (docs / name).write_text(text, encoding="utf-8")
  jsonl = tmp_path / "docs.jsonl"
  # "text" holds a decoy: only --text_field body gives the same documents.
  jsonl.write_text("".join(json.dumps({"text": "decoy", "body": text}) + "\n" for text in documents), encoding="utf-8")

  sp = sentencepiece.SentencePieceProcessor(model_file=str(workdir / "tokenizer.model"))
  n_tokens = sum(len(sp.encode(text)) + 2 for text in documents)
  expected = f"tokens {(n_tokens - 1) // seq_len * seq_len:,}"

  lines = {}
  for form, data in (
    ("files", [str(docs / "a.txt"), str(docs / "b.txt")]),
    ("directory", [str(docs)]),
    ("glob", [str(docs / "*.txt")]),
    ("jsonl", [str(jsonl), "--text_field", "body"]),
  ):
    assert evaluate.main(["--checkpoint", str(workdir), "--seq_len", str(seq_len), "--data", *data]) == 0
    lines[form] = capsys.readouterr().out.strip()
    assert f"| {expected} |" in lines[form], (form, lines[form], expected)
  assert len(set(lines.values())) == 1, lines


def test_incompatible_workdir_is_refused_and_left_untouched(straight_runs, small_tokenizer, capfd):
  workdir = straight_runs(1)
  before = file_digests(workdir)
  result = train_in_process(capfd, workdir, small_tokenizer, "--config.model.dim=64")
  assert_one_line_error(result, "different model", "dim 32 → 64")
  assert file_digests(workdir) == before


def test_keep_and_keep_every_decide_which_checkpoints_stay(tmp_path, small_tokenizer):
  """Saves at 2, 4, 6, 8 and 10 (the end); the last `keep` = 2 (8, 10) stay, plus every `keep_every` = 4th (4, 8)."""
  workdir = tmp_path / "kept"
  run_train(
    workdir,
    small_tokenizer,
    "--config.train.steps=10",
    "--config.train.save_every=2",
    "--config.train.keep=2",
    "--config.train.keep_every=4",
    "--config.train.eval_every=0",
  )
  assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "4", "8"]


@pytest.mark.parametrize(
  "override,fragments",
  [
    ("--config.data.sources=('/no/such/file.txt',)", ["'/no/such/file.txt' does not exist"]),
    ("--config.train.seq_len=100000 --config.model.max_seq_len=100000", ["corpus too small for one batch"]),
    ("--config.model.vocab_size=100", ["the tokenizer has 512 tokens but model.vocab_size is 100"]),
    ("--config.train.hidden=3", ["unknown config key 'hidden'"]),
  ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, small_tokenizer, override, fragments, capfd):
  assert_one_line_error(train_in_process(capfd, tmp_path / "w", small_tokenizer, *override.split()), *fragments)


def test_empty_source_and_oversized_vocab(tmp_path, capfd):
  from llama_jax import train

  empty = tmp_path / "empty.txt"
  empty.write_text("\n\n")
  args = ["train", "--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(tmp_path / "w")]
  args += [a for a in MICRO if "sources=" not in a]
  empty_sources = [f"--config.data.sources=('{empty}',)", "--config.data.val_sources=()"]
  result = main_result(train.main, args + empty_sources, capfd)
  assert_one_line_error(result, f"the training sources ['{empty}'] contain no text")
  small = tmp_path / "small.txt"
  small.write_text("a few words only, repeated. " * 20)
  oversized = [f"--config.data.sources=('{small}',)", "--config.data.val_sources=()", "--config.data.vocab_size=5000"]
  result = main_result(train.main, args + oversized, capfd)
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

  from llama_jax.core import run_config as run_config_lib
  from llama_jax.model import sharding
  from llama_jax.training.trainer import Trainer

  run_config = run_config_lib.RunConfig().replace(
    model=dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, max_seq_len=32),
    train=dict(batch_size=2, seq_len=32),
  )
  trainer = Trainer(run_config.model, run_config, sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1]))
  op_names = set(re.findall(r'loc\("([^"]*)"', trainer.lower().as_text(debug_info=True)))
  for scope in ("attention", "mlp", "norm", "loss"):
    # "attention/dot_general", "jit(train_step)/jvp(loss)/reduce_max": the scope, under any transformation.
    assert any(re.search(rf"(^|/|\(){scope}(\)|/)", name) for name in op_names), (scope, sorted(op_names)[:20])
