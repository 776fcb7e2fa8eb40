"""``python -m llama_jax.prepare`` (data/pipeline.py, Apache Beam on DirectRunner) and training on its ArrayRecord
shards (data/token_shards.py): 2 worker processes write the same shards as 1 and the same ids as direct tokenization;
the windows are the prepared text path's; a killed preparation is finished by a rerun that prepares only what is
missing; bad input and shards from another tokenizer or other sources end in one line; gs:// on a real GCS emulator."""

import gzip
import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from array_record.python import array_record_module

from llama_jax.data import text as text_lib
from llama_jax.data import token_shards
from llama_jax.data.sources import iter_documents, resolve_sources
from llama_jax.data.tokenization import Tokenizer
from tests import gcs_emulator
from tests.conftest import ROOT, needs_shakespeare, require_beam
from tests.runs import assert_one_line_error, run_module, run_train, train_in_process


@pytest.fixture(autouse=True)
def beam_installed():
  require_beam()


MULTI = ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]


def _corpus(directory, files: int = 4, docs: int = 300) -> str:
  """`files` JSONL files (one gzipped) of `docs` documents each, of varied lengths; returns the glob naming them."""
  directory.mkdir(exist_ok=True)
  for f in range(files):
    lines = "".join(
      json.dumps(
        {"text": f"file {f} document {d}: " + "the quick brown fox " * (d % 13) + "\u00e9\U0001f600" * (d % 3)}
      )
      + "\n"
      for d in range(docs)
    )
    name = directory / (f"part-{f}.jsonl.gz" if f == 0 else f"part-{f}.jsonl")
    if f == 0:
      name.write_bytes(gzip.compress(lines.encode()))
    else:
      name.write_text(lines)
  return str(directory / "part-*")


def prepare(out, tokenizer, *extra, sources=None, val_fraction=None, check=True):
  args = ["llama_jax.prepare", "--config", "configs/tiny.py", "--out", str(out), f"--config.data.tokenizer={tokenizer}"]
  if sources is not None:
    args += [f"--config.data.sources=('{sources}',)", "--config.data.val_sources=()"]
    args += [f"--config.data.val_fraction={val_fraction or 0.0}"]
  result = run_module(*args, *extra)
  if check:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result


def _documents(out, split: str) -> list[tuple[int, ...]]:
  """The token ids of every record of a split, shard by shard in index order (a document each: all are shorter than
  token_shards.RECORD_TOKENS)."""
  index = token_shards.read_index(str(out))
  docs = []
  for shard in index["shards"][split]:
    reader = array_record_module.ArrayRecordReader(str(out / shard["name"]))
    docs += [tuple(np.frombuffer(r, index["dtype"]).tolist()) for r in reader.read(0, reader.num_records())]
    reader.close()
  return docs


def test_two_workers_write_the_same_shards_as_one_and_the_ids_of_direct_tokenization(tmp_path, small_tokenizer):
  corpus = _corpus(tmp_path / "corpus")
  one = prepare(tmp_path / "one", small_tokenizer, sources=corpus, val_fraction=0.1)
  two = prepare(tmp_path / "two", small_tokenizer, *MULTI, sources=corpus, val_fraction=0.1)
  assert "prepared 4 of 4 files" in one.stdout and "prepared 4 of 4 files" in two.stdout, two.stdout
  index_one, index_two = (token_shards.read_index(str(tmp_path / d)) for d in ("one", "two"))
  assert index_one["shards"] == index_two["shards"]  # names, counts and sha256 of every shard
  tokenizer = Tokenizer(small_tokenizer)
  texts = [text for _, text, _ in iter_documents(resolve_sources([corpus]))]
  direct = Counter(tuple(tokenizer.document_ids(ids)) for ids in tokenizer.encode_batch(texts))
  prepared = Counter(_documents(tmp_path / "two", "train") + _documents(tmp_path / "two", "val"))
  assert prepared == direct and sum(direct.values()) == 1200
  val = index_two["splits"]["val"]["documents"]
  assert 60 <= val <= 180, val  # 10% of 1,200 by the seeded hash of each document's id
  assert index_two["tokenizer_sha256"] == token_shards.tokenizer_digest(tokenizer)


def test_the_windows_are_the_prepared_text_windows_of_the_same_documents(tmp_path, small_tokenizer):
  """No held-out documents: the shards' token stream is train.bin's, so every window is the same, in order, across
  documents, shards and the records of a document longer than one record."""
  corpus = _corpus(tmp_path / "corpus", files=3, docs=100)
  long_document = json.dumps({"text": "a long document " * 3000}) + "\n"
  with open(tmp_path / "corpus" / "part-2.jsonl", "a") as f:
    f.write(long_document)
  prepare(tmp_path / "shards", small_tokenizer, sources=corpus)
  tokenizer = Tokenizer(small_tokenizer)
  text_lib.prepare([corpus], [], tokenizer, str(tmp_path / "bin"))
  expected = text_lib.open_split(str(tmp_path / "bin"), "train", 16)
  index = token_shards.read_index(str(tmp_path / "shards"))
  windows = token_shards.split_windows(str(tmp_path / "shards"), index, "train", 16, verify=True)
  assert len(windows) == len(expected) > 300 and index["splits"]["train"]["shards"] == 3
  shard = index["shards"]["train"][2]
  assert shard["records"] >= shard["documents"] + 2  # the long document is three records or more
  for i in range(len(expected)):
    np.testing.assert_array_equal(windows[i]["inputs"], expected[i]["inputs"])
    np.testing.assert_array_equal(windows[i]["targets"], expected[i]["targets"])


KILL_AFTER_TWO = """
import os, signal, sys
from llama_jax.data import pipeline
done = []
tokenize = pipeline.tokenize_unit
def tokenize_then_die(unit, tokenizer, settings):
  if len(done) == 2:
    os.kill(os.getpid(), signal.SIGKILL)
  done.append(unit)
  return tokenize(unit, tokenizer, settings)
pipeline.tokenize_unit = tokenize_then_die
from llama_jax import prepare
prepare.main(["prepare"] + sys.argv[1:])
"""


def test_a_killed_preparation_is_finished_by_a_rerun_that_prepares_only_what_is_missing(tmp_path, small_tokenizer):
  corpus = _corpus(tmp_path / "corpus", files=5, docs=50)
  prepare(tmp_path / "straight", small_tokenizer, sources=corpus)
  args = [
    "--config",
    "configs/tiny.py",
    "--out",
    str(tmp_path / "killed"),
    f"--config.data.tokenizer={small_tokenizer}",
  ]
  args += [f"--config.data.sources=('{corpus}',)", "--config.data.val_sources=()"]
  killed = subprocess.run(
    [sys.executable, "-c", KILL_AFTER_TWO, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
  )
  assert killed.returncode == -9, killed.stderr[-3000:]
  assert not (tmp_path / "killed" / "index.json").exists()
  assert len(list((tmp_path / "killed").glob("unit-*.json"))) == 2
  rerun = prepare(tmp_path / "killed", small_tokenizer, sources=corpus)
  assert "prepared 3 of 5 files (2 already done)" in rerun.stdout, rerun.stdout
  straight, finished = (token_shards.read_index(str(tmp_path / d)) for d in ("straight", "killed"))
  assert finished["shards"] == straight["shards"]
  again = prepare(tmp_path / "killed", small_tokenizer, sources=corpus)
  assert "prepared 0 of 5 files (5 already done)" in again.stdout
  # A shard cut short is prepared again by the next run, and refused by training until then.
  shard = tmp_path / "killed" / finished["shards"]["train"][1]["name"]
  shard.write_bytes(shard.read_bytes()[:-10])
  index = token_shards.read_index(str(tmp_path / "killed"))
  with pytest.raises(token_shards.DataError, match=f"{shard.name} has .*cut short"):
    token_shards.split_windows(str(tmp_path / "killed"), index, "train", 16)
  repaired = prepare(tmp_path / "killed", small_tokenizer, sources=corpus)
  assert "prepared 1 of 5 files" in repaired.stdout
  assert token_shards.read_index(str(tmp_path / "killed"))["shards"] == straight["shards"]


def test_bad_input_stops_naming_the_line_or_is_skipped_and_counted(tmp_path, small_tokenizer):
  corpus = _corpus(tmp_path / "corpus", files=2, docs=20)
  bad = tmp_path / "corpus" / "part-1.jsonl"
  lines = bad.read_text().splitlines()
  lines[6] = "{not json"
  bad.write_text("\n".join(lines) + "\n")
  stopped = prepare(tmp_path / "out", small_tokenizer, "--config.data.on_error=stop", sources=corpus, check=False)
  assert_one_line_error(stopped, f"{bad}:7", "malformed JSON", "kept for the rerun")
  skipped = prepare(tmp_path / "out", small_tokenizer, sources=corpus)
  assert (
    "prepared 1 of 2 files (1 already done)" in skipped.stdout
    and f"skipped 1 bad, the first: {bad}:7" in skipped.stdout
  )
  assert token_shards.read_index(str(tmp_path / "out"))["splits"]["train"]["documents"] == 39
  nothing = prepare(tmp_path / "none", small_tokenizer, sources=str(tmp_path / "missing-*.jsonl"), check=False)
  assert_one_line_error(nothing, "missing-*.jsonl")
  no_tokenizer = run_module("llama_jax.prepare", "--config", "configs/tiny.py", "--out", str(tmp_path / "x"))
  assert_one_line_error(no_tokenizer, "prepare needs data.tokenizer")


@needs_shakespeare
def test_training_reads_the_shards_and_refuses_other_tokenizers_or_sources(
  tmp_path, small_tokenizer, smollm2_tokenizer, capfd
):
  """The micro run on Beam-prepared plays (its val_sources held out as files): trains and evaluates; the same
  shards with another tokenizer or other sources are refused in one line."""
  out = tmp_path / "shards"
  sources = "--config.data.sources=('shakespeare:sonnets,comedy_of_errors',)"
  val = "--config.data.val_sources=('shakespeare:lovers_complaint',)"
  run_module(
    "llama_jax.prepare",
    "--config",
    "configs/tiny.py",
    "--out",
    str(out),
    f"--config.data.tokenizer={small_tokenizer}",
    sources,
    val,
  )
  trained = run_train(tmp_path / "run", small_tokenizer, f"--config.data.prepared_dir={out}", "--config.train.steps=6")
  assert f"prepared shards {out}: train" in trained.stdout and "2 shards" in trained.stdout, trained.stdout
  assert "validation loss" in trained.stdout
  own = run_train(tmp_path / "own", "", f"--config.data.prepared_dir={out}", "--config.train.steps=2")
  assert "done: step 2" in own.stdout  # no data.tokenizer: the one prepare copied beside the shards
  refused = train_in_process(
    capfd, tmp_path / "r1", smollm2_tokenizer, f"--config.data.prepared_dir={out}", "--config.model.vocab_size=49152"
  )
  assert_one_line_error(refused, "prepared with another tokenizer", "vocabulary 512")
  other = train_in_process(
    capfd,
    tmp_path / "r2",
    small_tokenizer,
    f"--config.data.prepared_dir={out}",
    "--config.data.sources=('shakespeare:sonnets',)",
  )
  assert_one_line_error(other, "was prepared from data.sources", "run python -m llama_jax.prepare")
  no_val = tmp_path / "no_val"
  run_module(
    "llama_jax.prepare",
    "--config",
    "configs/tiny.py",
    "--out",
    str(no_val),
    f"--config.data.tokenizer={small_tokenizer}",
    sources,
    "--config.data.val_sources=()",
  )
  nothing_held_out = train_in_process(
    capfd, tmp_path / "r3", small_tokenizer, f"--config.data.prepared_dir={no_val}", "--config.data.val_sources=()"
  )
  assert_one_line_error(nothing_held_out, "holds 0 validation tokens", "train.eval_every=0")


def test_a_preparation_written_to_gs_trains_as_a_local_one(tmp_path, small_tokenizer):
  """prepare writes its shards and index to a real GCS emulator; they hold the bytes a local preparation writes, and
  training reads them back (through the local cache) to the same windows."""
  corpus = _corpus(tmp_path / "corpus", files=2, docs=60)
  prepare(tmp_path / "local", small_tokenizer, sources=corpus, val_fraction=0.2)
  local = token_shards.read_index(str(tmp_path / "local"))
  with gcs_emulator.running() as emulator:
    remote_dir = emulator.uri("prepared")
    args = ["llama_jax.prepare", "--config", "configs/tiny.py", "--out", remote_dir]
    args += [f"--config.data.tokenizer={small_tokenizer}", f"--config.data.sources=('{corpus}',)"]
    args += ["--config.data.val_sources=()", "--config.data.val_fraction=0.2"]
    result = subprocess.run(
      [sys.executable, "-m", *args],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu", **emulator.env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    os.environ.update(emulator.env)
    try:
      remote = token_shards.read_index(remote_dir)
      assert remote["shards"] == local["shards"]
      windows = token_shards.split_windows(remote_dir, remote, "train", 16, verify=True)
      expected = token_shards.split_windows(str(tmp_path / "local"), local, "train", 16)
      assert len(windows) == len(expected) > 0
      for i in range(0, len(expected), 7):
        np.testing.assert_array_equal(windows[i]["inputs"], expected[i]["inputs"])
    finally:
      for key in emulator.env:
        os.environ.pop(key, None)
