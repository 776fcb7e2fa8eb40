"""Two real JAX processes on one machine (loopback coordinator, 4 simulated CPU devices each) train like one process
with 8 devices, write one checkpoint together, and a one-process rerun resumes from it."""

import json
import os
import socket
import struct
import subprocess
import sys

import pytest

from tests.conftest import ROOT, needs_shakespeare
from tests.test_train import read_jsonl, train_args

pytestmark = needs_shakespeare
STEPS = ["--config.train.eval_every=0", "--config.train.save_every=100", "--config.train.record_batches=False"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def train_command(workdir, tokenizer, steps, *extra):
  return train_args(workdir, tokenizer, *STEPS, f"--config.train.steps={steps}", "--config.train.batch_size=8", *extra)


def env_with_devices(n: int) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
  return dict(env, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")


def run_one_process(workdir, tokenizer, steps):
  result = subprocess.run(
    train_command(workdir, tokenizer, steps),
    cwd=ROOT,
    env=env_with_devices(8),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result


def run_two_processes(workdir, tokenizer, steps):
  address = f"localhost:{free_port()}"
  procs = [
    subprocess.Popen(
      train_command(
        workdir, tokenizer, steps, f"--coordinator_address={address}", "--num_processes=2", f"--process_id={i}"
      ),
      cwd=ROOT,
      env=env_with_devices(4),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outputs = []
  for proc in procs:
    try:
      outputs.append(proc.communicate(timeout=600))
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise
  for proc, (out, err) in zip(procs, outputs):
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
  return outputs


def tensorboard_scalars(directory) -> list[tuple[str, int]]:
  """(tag, step) of every scalar in the event files under `directory`, read as TFRecords: 8-byte length, 4-byte CRC,
  the Event proto, 4-byte CRC."""
  from tensorboardX.proto import event_pb2

  scalars = []
  for name in sorted(os.listdir(directory)):
    data = (directory / name).read_bytes()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset : offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
      scalars.extend((value.tag, event.step) for value in event.summary.value)
      offset += 12 + length + 4
  return scalars


def losses(workdir):
  return {r["step"]: r["loss"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r}


def test_two_processes_train_like_one_and_a_single_process_resumes(tmp_path, small_tokenizer):
  one, two = tmp_path / "one", tmp_path / "two"
  run_one_process(one, small_tokenizer, 5)
  (out0, _), (out1, _) = run_two_processes(two, small_tokenizer, 5)

  # Same losses as one process with 8 devices; logs come from process 0 only.
  assert sorted(losses(two)) == [1, 2, 3, 4, 5]
  for step, loss in losses(one).items():
    assert losses(two)[step] == pytest.approx(loss, rel=1e-5), step
  assert "step      5" in out0 and "step" not in out1
  # Process 0 alone writes metrics.jsonl and TensorBoard events: one line and one scalar per metric and step. (Event
  # files are named by second and host, so a second writer could share process 0's file name: count the scalars.)
  lines = (two / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == len(set(lines)) and [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5], lines
  assert len(os.listdir(two / "tensorboard")) == 1, os.listdir(two / "tensorboard")
  scalars = tensorboard_scalars(two / "tensorboard")
  assert sorted(step for tag, step in scalars if tag == "loss") == [1, 2, 3, 4, 5], scalars
  assert len(scalars) == len(set(scalars)), scalars
  # Both processes wrote one checkpoint, at the end.
  assert sorted(os.listdir(two / "checkpoints")) == ["5"]

  # One process with 8 devices picks up the two-process checkpoint, and continues as the one-process run does.
  resumed = run_one_process(two, small_tokenizer, 8)
  assert "steps 5 → 8" in resumed.stdout
  run_one_process(one, small_tokenizer, 8)
  for step in (6, 7, 8):
    assert losses(two)[step] == pytest.approx(losses(one)[step], rel=1e-5), step


def test_two_processes_decode_one_mesh_like_one_process(tmp_path, small_tokenizer):
  """`sample` run as the same command in two processes (4 devices each) decodes on one tensor=8 mesh across both,
  and prints what one process with 8 devices prints; only process 0 prints."""
  import jax
  import numpy as np
  from flax import nnx

  from llama_jax import checkpoint
  from llama_jax.config import ModelConfig
  from llama_jax.model import Llama

  cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, multiple_of=32, max_seq_len=128)
  params = nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(5))))
  directory = str(tmp_path / "model")
  checkpoint.save_params_dir(directory, cfg, jax.tree.map(np.asarray, params), tokenizer_path=small_tokenizer)
  command = [
    sys.executable,
    "-m",
    "llama_jax.sample",
    "--checkpoint",
    directory,
    "--prompt",
    "Shall I",
    "--prompt",
    "To",
  ]
  command += ["--temperature", "0", "--max_new_tokens", "10", "--mesh", "tensor=8"]
  single = subprocess.run(command, cwd=ROOT, env=env_with_devices(8), capture_output=True, text=True, timeout=600)
  assert single.returncode == 0, single.stderr[-3000:]
  address = f"localhost:{free_port()}"
  procs = [
    subprocess.Popen(
      command,
      cwd=ROOT,
      env=dict(env_with_devices(4), JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outputs = [proc.communicate(timeout=600) for proc in procs]
  for proc, (out, err) in zip(procs, outputs):
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
  # Gloo (the CPU collectives library) prints its connection lines on stdout itself; the rest is the sampler's.
  printed = [
    "".join(line for line in out.splitlines(keepends=True) if not line.startswith("[Gloo]")) for out, _ in outputs
  ]
  assert printed[0] == single.stdout and single.stdout.count("-" * 40) == 2
  assert printed[1] == ""
  assert "of 8 cpu device(s)" in outputs[0][1]
