"""A gs:// workdir end to end against a real GCS emulator (tests/gcs_emulator.py), no cloud: the micro run on
gs://ljx/run is SIGKILLed while its step-8 save is in flight, rerun, and ends bit-identical to an uninterrupted local
run; metrics, TensorBoard events, self-describing files and the lock live in the bucket; every command that reads a
checkpoint reads the gs:// one exactly as it reads a local copy of it; a damaged step in the bucket falls back as
locally. The reference throughout is the same command on a local directory."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests import gcs_emulator, live_server
from tests.conftest import ROOT, needs_shakespeare
from tests.runs import (
  assert_bit_identical,
  assert_one_line_error,
  assert_same_batches,
  file_digests,
  final_checkpoint,
  run_train,
  train_args,
)

pytestmark = needs_shakespeare

KILLED_AT = 8  # the micro run saves every 4 steps: 4 is committed, 8 is in flight when the process dies
PROMPT = "Shall I compare thee"


@pytest.fixture(scope="module")
def emulator():
  with gcs_emulator.running() as emu:
    yield emu


@pytest.fixture(scope="module")
def env(emulator, tmp_path_factory):
  # Local copies of remote things (the prepared token shards of a gs:// run) go to this run's own cache.
  cache = str(tmp_path_factory.mktemp("xdg_cache"))
  return {**emulator.env, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": cache}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, small_tokenizer):
  """The uninterrupted micro run on a local directory named like the bucket's (commands name outputs after it)."""
  workdir = tmp_path_factory.mktemp("local") / "run"
  run_train(workdir, small_tokenizer)
  return str(workdir)


@pytest.fixture(scope="module")
def remote(emulator, env, small_tokenizer):
  """gs://ljx/run: the micro run killed while saving step 8, then rerun to the end."""
  workdir = emulator.uri("run")
  killed = run_train(workdir, small_tokenizer, env=env, check=False, module=("tests.fault_injection", "sigkill", "8"))
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  after_kill = _listing(emulator, "run")
  rerun = run_train(workdir, small_tokenizer, env=env)
  return {"uri": workdir, "after_kill": after_kill, "rerun": rerun}


def _listing(emulator, *names) -> set[str]:
  """Paths below gs://bucket/names..., relative to it."""
  root = "/".join([emulator.bucket, *names])
  return {path[len(root) + 1 :] for path in emulator.fs.find(root)}


def _download(emulator, name, target) -> str:
  """A local copy of gs://bucket/name, fetched by the test's own client."""
  emulator.fs.get(f"{emulator.bucket}/{name}/", str(target) + "/", recursive=True)
  return str(target)


def test_killed_save_is_not_a_step_and_the_rerun_resumes_bit_exact(emulator, remote, straight, tmp_path):
  # On gs:// orbax writes a step in place and commits it with a marker file; the kill came before the marker.
  assert "checkpoints/4/commit_success.txt" in remote["after_kill"]
  assert "checkpoints/8/commit_success.txt" not in remote["after_kill"]
  assert "steps 4 → 12" in remote["rerun"].stdout
  copy = _download(emulator, "run", tmp_path / "run")
  assert_bit_identical(final_checkpoint(copy, 12), final_checkpoint(straight, 12))
  assert_same_batches(copy, straight)
  # The digests written before each commit match the files in the bucket.
  digests = json.loads(emulator.fs.cat(f"{emulator.bucket}/run/checkpoints/12/digests.json"))["files"]
  local = file_digests(os.path.join(copy, "checkpoints", "12"))
  assert {rel: d["sha256"] for rel, d in digests.items()} == {rel: local[rel] for rel in digests}


def test_the_bucket_holds_a_self_describing_workdir(emulator, remote, straight):
  files = _listing(emulator, "run")
  for name in ("model_config.json", "run_config.json", "tokenizer.model", "metrics.jsonl", "batches.jsonl"):
    assert name in files, name
  assert any(f.startswith("tensorboard/events.out.tfevents.") for f in files)
  assert "run.lock" not in files  # released at the end of the rerun
  steps = {r["step"] for r in read_jsonl_remote(emulator, "run/metrics.jsonl") if "loss" in r}
  assert steps == set(range(1, 13))  # the killed run's lines up to 8, the rerun's from 5 on
  assert "taking over the lock of workdir 'gs://ljx/run'" in remote["rerun"].stderr
  # goodput.json in the bucket: the killed session, and the rerun from step 4, which trained the steps past 4 again.
  killed, rerun = json.loads(emulator.fs.cat(f"{emulator.bucket}/run/goodput.json"))["sessions"]
  assert (killed["start_step"], rerun["start_step"], rerun["step"]) == (0, 4, 12) and killed["step"] > 4
  assert killed["lost_s"] > 0 and rerun["lost_s"] == 0
  bucket_config = json.loads(emulator.fs.cat(f"{emulator.bucket}/run/model_config.json"))
  with open(os.path.join(straight, "model_config.json")) as f:
    assert bucket_config == json.load(f)


def read_jsonl_remote(emulator, name):
  return [json.loads(line) for line in emulator.fs.cat(f"{emulator.bucket}/{name}").decode().splitlines() if line]


def _command(*args):
  return [sys.executable, "-m", *args]


def _run_all(commands: dict, env) -> dict:
  """Runs the commands at once (each mostly waits on its imports and the emulator); their results by key."""

  def one(args):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **env})

  with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
    futures = {key: pool.submit(one, args) for key, args in commands.items()}
    results = {key: future.result() for key, future in futures.items()}
  for key, result in results.items():
    assert result.returncode == 0, (key, result.stdout[-2000:], result.stderr[-3000:])
  return results


def test_every_reader_reads_the_gs_checkpoint_as_a_local_copy(emulator, env, remote, straight, tmp_path):
  """sample, evaluate, viz (attention maps and loss curves) and convert --to_hf, each on gs://ljx/run and on a local
  copy of it: the same output, byte for byte."""
  copy = _download(emulator, "run", tmp_path / "copy" / "run")
  commands = {}
  for where, checkpoint in (("gs", remote["uri"]), ("local", copy)):
    out = tmp_path / where
    out.mkdir()
    commands[("sample", where)] = _command(
      "llama_jax.sample", "--checkpoint", checkpoint, "--prompt", PROMPT, "--temperature", "0", "--max_new_tokens",
      "12", "--stream", "no",
    )  # fmt: skip
    commands[("evaluate", where)] = _command(
      "llama_jax.evaluate", "--checkpoint", checkpoint, "--data", "shakespeare:lovers_complaint", "--max_batches",
      "2", "--json", str(out / "eval.json"),
    )  # fmt: skip
    commands[("attention", where)] = _command(
      "llama_jax.viz", "attention", "--checkpoint", checkpoint, "--prompt", PROMPT, "--out", str(out / "attention")
    )
    commands[("curves", where)] = _command("llama_jax.viz", "curves", checkpoint, "--out", str(out / "curves.png"))
    commands[("to_hf", where)] = _command("llama_jax.convert", "--to_hf", checkpoint, "--out", str(out / "hf"))
  results = _run_all(commands, env)
  assert results[("sample", "gs")].stdout == results[("sample", "local")].stdout
  assert PROMPT in results[("sample", "gs")].stdout
  gs, local = tmp_path / "gs", tmp_path / "local"
  with open(gs / "eval.json") as f, open(local / "eval.json") as g:
    assert json.load(f) == json.load(g)
  for name in ("attention", "hf"):
    digests = file_digests(gs / name)
    assert digests and digests == file_digests(local / name), name
  assert "tokenizer.model" in file_digests(gs / "hf")  # copied out of the bucket
  assert (gs / "curves.png").read_bytes() == (local / "curves.png").read_bytes()


def test_serve_answers_from_the_gs_checkpoint_as_from_a_local_copy(emulator, env, remote, tmp_path):
  copy = _download(emulator, "run", tmp_path / "run")
  request = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
  with live_server.serving(copy, slots=2, max_len=64) as (local_url, *_):
    want = httpx.post(f"{local_url}/v1/completions", json=request, timeout=120).json()
  with live_server.cli_serving(remote["uri"], "--slots", "2", "--max_len", "64", env=env) as (url, server):
    assert httpx.get(f"{url}/health", timeout=10).json()["model"] == "run"
    got = httpx.post(f"{url}/v1/completions", json=request, timeout=120).json()
  assert server.returncode == 0, server.stderr_text[-3000:]
  assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["usage"] == want["usage"]


def test_init_from_a_gs_checkpoint_trains_as_from_a_local_copy(emulator, env, remote, small_tokenizer, tmp_path):
  copy = _download(emulator, "run", tmp_path / "copy" / "run")
  short = ["--config.train.steps=2", "--config.train.save_every=2", "--config.train.eval_every=0"]
  commands = {
    where: train_args(tmp_path / where, small_tokenizer, f"--config.init_from={base}", *short)
    for where, base in (("gs", remote["uri"]), ("local", copy))
  }
  _run_all(commands, env)
  assert_bit_identical(final_checkpoint(tmp_path / "gs", 2), final_checkpoint(tmp_path / "local", 2))


def test_a_live_lock_in_the_bucket_refuses_a_second_run(emulator, env, remote, small_tokenizer):
  # A lock naming this host and a live pid (this test's): another run is writing there.
  holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": "2026-12-02T00:00:00+00:00"}
  emulator.fs.pipe(f"{emulator.bucket}/run/run.lock", json.dumps(holder).encode())
  try:
    result = run_train(remote["uri"], small_tokenizer, env=env, check=False)
  finally:
    emulator.fs.rm(f"{emulator.bucket}/run/run.lock")
  assert_one_line_error(result, "workdir 'gs://ljx/run' is in use by another run", f"pid {os.getpid()}")


def test_a_missing_bucket_is_one_line(env, small_tokenizer):
  result = run_train("gs://no-such-bucket/run", small_tokenizer, env=env, check=False)
  assert_one_line_error(result, "cannot write to workdir 'gs://no-such-bucket/run'", "check that the bucket exists")


def test_a_damaged_step_in_the_bucket_falls_back_and_is_kept(emulator, env, remote, straight, small_tokenizer):
  """Last: it changes the bucket. A flipped byte in step 12: the rerun resumes from step 8, keeps the damaged step
  as checkpoints/12.damaged and trains 9..12 again to the same bits."""
  step = f"{emulator.bucket}/run/checkpoints/12"
  victim = sorted(f for f in emulator.fs.find(f"{step}/params") if "/d/" in f)[0]
  data = bytearray(emulator.fs.cat(victim))
  data[len(data) // 2] ^= 0xFF
  emulator.fs.pipe(victim, bytes(data))
  result = run_train(remote["uri"], small_tokenizer, env=env)
  assert "checkpoint step 12 is damaged" in result.stderr and "resuming from step 8" in result.stderr
  steps = {path.rsplit("/", 1)[-1] for path in emulator.fs.ls(f"{emulator.bucket}/run/checkpoints")}
  assert {"8", "12", "12.damaged"} <= steps
  assert emulator.fs.cat(f"{step}.damaged/{victim[len(step) + 1 :]}") == bytes(data)  # kept as found
  copy = _download(emulator, "run", os.path.join(straight + "-after-damage"))
  assert_bit_identical(final_checkpoint(copy, 12), final_checkpoint(straight, 12))
