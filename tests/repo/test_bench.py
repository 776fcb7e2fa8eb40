"""bench/gpu.py --smoke: the accelerator benchmark runs end to end on CPU with toy shapes and reports its figures."""

import json
import re
import subprocess
import sys

import pytest

from llama_jax.core.model_config import ModelConfig
from tests.conftest import ROOT, needs_shakespeare


def test_gpu_bench_smoke_runs_on_cpu_and_reports_training_and_decoding(tmp_path):
  result = subprocess.run(
    [sys.executable, "bench/gpu.py", "--smoke", "--json", str(tmp_path / "bench.json")],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert [line.split(":")[0] for line in lines] == ["device", "train", "decode batch 1", "decode batch 2"], lines
  # The smoke shapes of bench/gpu.py (SMOKE_TRAIN at seq_len 128): the parameter count it prints is the model's.
  smoke = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, max_seq_len=128)
  assert re.fullmatch(
    rf"train: {smoke.num_params():,} params, 2 × 128 tokens, remat dots_no_batch: [\d,]+ tokens/s, step \d+ ms, "
    r"MFU \d+\.\d% of [\d,]+ GFLOP/s \(compile \d+ s\)",
    lines[1],
  ), lines[1]
  for batch, line in zip((1, 2), lines[2:]):
    assert re.fullmatch(
      rf"decode batch {batch}: [\d,]+\.\d tokens/s \([\d.]+ steps/s, \d+% of the \d+ steps/s bandwidth bound; "
      r"first call [\d.]+ s\)",
      line,
    ), line
  with open(tmp_path / "bench.json") as f:
    report = json.load(f)
  training = report["train"]
  assert training["params"] == smoke.num_params() and (training["batch"], training["seq_len"]) == (2, 128)
  assert training["tokens_per_s"] > 0 and 0 < training["mfu"] < 1 and training["step_s"] > 0
  assert [row["batch"] for row in report["decode"]] == [1, 2]
  for row in report["decode"]:
    assert row["steps_per_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["batch"] * row["steps_per_s"])
    assert row["bound_steps_per_s"] > 0 and row["of_bound"] > 0 and row["weight_bytes"] > 0


def test_attention_bench_smoke_runs_every_kernel_and_device_count(tmp_path):
  """bench/attention.py at 256 tokens in bfloat16: a row per kernel and device count, each timed, each output within
  bf16 rounding of the float32 reference, and the context strategies' per-device temporaries shrinking as the
  sequence is split further."""
  out = tmp_path / "attention.json"
  result = subprocess.run(
    [sys.executable, "attention.py", "--lengths", "256", "--repeats", "1", "--dtype", "bfloat16", "--json", str(out)],
    cwd=f"{ROOT}/bench",
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [(row["kernel"], row["devices"]) for row in rows] == [
    ("xla", 1),
    ("chunked", 1),
    ("context all_gather", 2),
    ("context all_gather", 4),
    ("context ring", 2),
    ("context ring", 4),
    ("context zigzag", 2),
    ("context zigzag", 4),
  ]
  assert all(row["seconds"] > 0 and row["temp_bytes_per_device"] > 0 for row in rows)
  assert all(0 < row["max_abs_error"] < 0.03 for row in rows), rows  # bf16 outputs of order 1: 2^-8 relative steps
  by = {(row["kernel"], row["devices"]): row["temp_bytes_per_device"] for row in rows}
  assert by[("context all_gather", 4)] < by[("context all_gather", 2)] < by[("xla", 1)]


def test_prefill_bench_quick_shows_the_stream_stalled_by_a_whole_prefill_and_fed_between_chunks(tmp_path):
  """bench/prefill.py --quick (a 300-token prompt): with whole-prompt prefill the running stream gets no token
  between the long prompt's arrival and its first token; with chunks of 64 it gets a decode call's 8 tokens after
  each of the first four of the five chunks."""
  out = tmp_path / "prefill.json"
  result = subprocess.run(
    [sys.executable, "prefill.py", "--quick", "--json", str(out)],
    cwd=f"{ROOT}/bench",
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  rows = {row["prefill_chunk"]: row for row in json.loads(out.read_text())["rows"]}
  assert rows[0]["stream_tokens"] == 0 and rows[64]["stream_tokens"] == 4 * 8, rows
  assert all(row["ttft_s"] > 0 and 0 < row["max_gap_s"] <= row["ttft_s"] for row in rows.values())


@needs_shakespeare
def test_data_bench_smoke_reports_every_path_beside_the_tokenizer_ceiling(tmp_path, small_tokenizer):
  report = tmp_path / "data.json"
  result = subprocess.run(
    [sys.executable, "data.py", "--copies", "1", "--plays", "3", "--tokenizer", small_tokenizer, "--json", str(report)],
    cwd=f"{ROOT}/bench",
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads(report.read_text())["rows"]
  assert list(rows) == [
    "encode_batch (ceiling)",
    "streaming, 0 workers",
    "streaming, 1 workers",
    "streaming, 2 workers",
    "prepare (one process)",
    "prepared shards, read",
    "Beam prepare, 1 worker",
    "Beam prepare, 2 workers",
    "Beam shards (ArrayRecord), read",
  ]
  assert all(row["tokens_per_s"] > 0 for row in rows.values())
  assert all(rows[f"streaming, {w} workers"]["startup_s"] >= 0 for w in (0, 1, 2))
