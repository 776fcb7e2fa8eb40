"""Streaming pretraining text (data.streaming, data/streaming.py): each process and worker reads its own documents,
every document once per pass; the iterator state goes through JSON (the checkpoint's data item) and resumes bit for
bit, in the training process and with grain worker processes; a mixture's windows come in its weights' shares; a
killed streaming run resumes bit for bit; what a streaming run cannot do is refused in one line."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from llama_jax.core.checks import ConfigError
from llama_jax.core.run_config import RunConfig
from llama_jax.data import streaming
from llama_jax.data import text as text_lib
from llama_jax.data.formats import DataError
from llama_jax.data.sources import list_files, read_document, resolve_sources
from llama_jax.data.tokenization import Tokenizer
from llama_jax.data.tokenizer_files import load_tokenizer_dir
from tests import gcs_emulator
from tests.conftest import ROOT, needs_shakespeare
from tests.runs import (
  assert_bit_identical,
  assert_one_line_error,
  assert_same_batches,
  final_checkpoint,
  run_train,
  train_in_process,
)


def _jsonl_corpus(directory, files: int, docs: int) -> list[str]:
  """`files` JSONL files of `docs` documents each; document text names its file and line."""
  paths = []
  for f in range(files):
    path = directory / f"part-{f}.jsonl"
    path.write_text(
      "".join(json.dumps({"text": f"file {f} line {d} " + "word " * (d % 7)}) + "\n" for d in range(docs))
    )
    paths.append(str(path))
  return paths


def _one_pass(shards) -> list[str]:
  """The documents of one pass over `shards` (a ShardStream's first epoch)."""
  iterator = iter(streaming.ShardStream(shards, "text", 0, "stop", "test"))
  texts = []
  while True:
    text = next(iterator)
    if iterator.epoch:
      return texts
    texts.append(text)


@pytest.mark.parametrize("files", [1, 3, 8])
def test_processes_and_workers_read_disjoint_documents_that_cover_the_corpus(tmp_path, files):
  """2 processes × 3 workers over 1, 3 or 8 files (fewer files than readers: record strides; more: whole files):
  every document is read by exactly one reader in a pass."""
  corpus = _jsonl_corpus(tmp_path, files, 10)
  everything = sorted(_one_pass([streaming.Shard(p) for p in corpus]))
  assert len(everything) == files * 10
  read = []
  for process in range(2):
    mine = streaming.split_shards([streaming.Shard(p) for p in corpus], process, 2)
    for worker in range(3):
      shards = streaming.split_shards(mine, worker, 3)
      read += _one_pass(shards) if shards else []
  assert sorted(read) == everything


def test_each_pass_visits_the_shards_in_a_new_seeded_order(tmp_path):
  corpus = _jsonl_corpus(tmp_path, 6, 2)
  iterator = iter(streaming.ShardStream([streaming.Shard(p) for p in corpus], "text", 5, "stop", "test"))
  passes = [[next(iterator).split(" line")[0] for _ in range(12)] for _ in range(2)]
  first_of_each = [p[::2] for p in passes]
  assert sorted(first_of_each[0]) == sorted(first_of_each[1]) == [f"file {f}" for f in range(6)]
  assert first_of_each[0] != first_of_each[1]
  again = iter(streaming.ShardStream([streaming.Shard(p) for p in corpus], "text", 5, "stop", "test"))
  assert [next(again).split(" line")[0] for _ in range(12)][::2] == first_of_each[0]


def _dataset(files, tokenizer, workers=0, weights=None, **kwargs):
  groups = [[f] for f in files] if weights else [files]
  settings = dict(seq_len=16, global_batch=4, seed=3, shuffle_window=8, document_mask=True)
  return streaming.StreamingDataset(groups, tokenizer, weights=weights, workers=workers, **{**settings, **kwargs})


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])


@needs_shakespeare
@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_from_the_json_state_continues_bit_for_bit(small_tokenizer, workers):
  """The state after 1 and after 7 batches, through JSON as a checkpoint keeps it, then 6 more batches; with 2 worker
  processes too. Checked in both places because a restore inside a packed window and at a fresh one take different
  paths."""
  tokenizer = Tokenizer(small_tokenizer)
  files = list_files(["shakespeare:sonnets,lovers_complaint,comedy_of_errors"])
  straight = iter(_dataset(files, tokenizer, workers))
  expected = _take(straight, 13)
  straight.close()
  for done in (1, 7):
    first = iter(_dataset(files, tokenizer, workers))
    _take(first, done)
    state = json.loads(json.dumps(first.get_state()))
    first.close()
    resumed = iter(_dataset(files, tokenizer, workers))
    resumed.set_state(state)
    _assert_same(_take(resumed, 6), expected[done : done + 6])
    resumed.close()
  batch = expected[0]
  assert batch["inputs"].shape == batch["segment_ids"].shape == batch["positions"].shape == (4, 16)
  np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
  # Positions count from 0 at each document's start within a window (segment ids change there).
  for segments, positions in zip(batch["segment_ids"], batch["positions"]):
    starts = np.flatnonzero(np.diff(segments)) + 1
    assert all(positions[s] == 0 for s in starts)


@needs_shakespeare
def test_a_state_from_another_process_count_or_worker_count_is_refused_in_one_line(small_tokenizer):
  tokenizer = Tokenizer(small_tokenizer)
  files = list_files(["shakespeare:sonnets,lovers_complaint"])
  iterator = iter(_dataset(files, tokenizer))
  next(iterator)
  state = iterator.get_state()
  other = iter(_dataset(files, tokenizer, workers=1))
  with pytest.raises(DataError, match=r"read by 1 processes with data.workers=0; this run has 1 with data.workers=1"):
    other.set_state(state)
  other.close()
  with pytest.raises(DataError, match="not a streaming one"):
    iter(_dataset(files, tokenizer)).set_state({"next_index": 3})


@needs_shakespeare
def test_a_streamed_mixture_draws_windows_in_the_weights_shares(tmp_path, small_tokenizer):
  """Over 10,000 windows of 8 tokens from two sources weighted 0.7 / 0.3 (shares of windows, as prepared mixtures):
  within 1%. The sources share no word, and each window is packed from one source, so its ids tell which."""
  tokenizer = Tokenizer(small_tokenizer)
  words = {"a": "apple pear plum ", "b": "zebra yak gnu "}
  for name, text in words.items():
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": text * (1 + d % 5)}) + "\n" for d in range(50)))
  ids = {name: set(tokenizer.encode(text)) for name, text in words.items()}
  only_a = ids["a"] - ids["b"]
  files = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
  data = _dataset(files, tokenizer, weights=(0.7, 0.3), seq_len=8, global_batch=100, shuffle_window=0)
  rows = [set(row.tolist()) for batch in _take(iter(data), 100) for row in batch["inputs"]]
  assert len(rows) == 10_000
  share = sum(bool(row & only_a) for row in rows) / len(rows)
  assert abs(share - 0.7) < 0.01, share


def test_validation_by_fraction_holds_out_whole_files(tmp_path):
  corpus = _jsonl_corpus(tmp_path, 10, 3)
  held_out, val = streaming.split_files(corpus, (), 0.3, seed=1)
  assert 1 <= len(val) < 10 and set(val) == held_out
  train = streaming.component_files([corpus], held_out)
  assert sorted(train[0] + val) == sorted(corpus)
  with pytest.raises(DataError, match="holds out whole files"):
    streaming.split_files(corpus[:1], (), 0.3, seed=1)


@pytest.mark.parametrize(
  "override, fragment",
  [
    (dict(streaming=True, format="chat"), "data.streaming is for data.format='text'"),
    (dict(streaming=True, prepared_dir="/tmp/x"), "unset data.prepared_dir"),
    (dict(document_mask=True), "data.document_mask needs data.streaming=True"),
    (dict(streaming=True, workers=-1), "data.workers"),
  ],
)
def test_streaming_settings_that_cannot_work_are_refused(override, fragment):
  with pytest.raises(ConfigError) as excinfo:
    RunConfig.from_dict(dict(data=override))
  assert fragment in str(excinfo.value)


STREAMING = [
  "--config.data.streaming=True",
  "--config.data.workers=2",
  "--config.data.shuffle_window=16",
  "--config.data.document_mask=True",
]


@needs_shakespeare
def test_a_killed_streaming_run_resumes_bit_for_bit(tmp_path, small_tokenizer, capfd):
  """SIGKILL while step 8's checkpoint is being saved, rerun: the same batches (batches.jsonl) and the same final
  checkpoint, bit for bit, as the run that was never stopped; both read through 2 grain worker processes."""
  straight = tmp_path / "straight"
  run_train(straight, small_tokenizer, *STREAMING)
  killed = tmp_path / "killed"
  result = run_train(killed, small_tokenizer, *STREAMING, check=False, module=("tests.fault_injection", "sigkill", "8"))
  assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
  resumed = run_train(killed, small_tokenizer, *STREAMING)
  assert "steps 4 → 12" in resumed.stdout and "streaming 2 files with 2 workers" in resumed.stdout, resumed.stdout
  assert_same_batches(killed, straight)
  assert_bit_identical(final_checkpoint(straight, 12), final_checkpoint(killed, 12))
  other = train_in_process(
    capfd, killed, small_tokenizer, *STREAMING, "--config.data.workers=1", "--config.train.steps=16"
  )
  assert_one_line_error(other, "data.workers=2", "data.workers=1")
  no_tokenizer = train_in_process(capfd, tmp_path / "new", "", *STREAMING)
  assert_one_line_error(no_tokenizer, "data.streaming needs a tokenizer")


@needs_shakespeare
def test_streamed_windows_are_the_prepared_windows_of_the_same_documents(tmp_path, small_tokenizer):
  """One file, no shuffle: the streamed windows are exactly the prepared path's windows (text.prepare → train.bin →
  TokenWindows), in order, over more than one document group and across documents."""
  tokenizer = Tokenizer(small_tokenizer)
  corpus = _jsonl_corpus(tmp_path, 1, 600)
  text_lib.prepare(corpus, [], tokenizer, str(tmp_path / "prepared"))
  prepared = text_lib.open_split(str(tmp_path / "prepared"), "train", 16)
  data = _dataset(corpus, tokenizer, shuffle_window=0, global_batch=1)
  streamed = [batch for batch in _take(iter(data), len(prepared))]
  assert len(prepared) > streaming.GROUP_DOCUMENTS * 2  # several groups of documents
  for i, batch in enumerate(streamed):
    np.testing.assert_array_equal(batch["inputs"][0], prepared[i]["inputs"])
    np.testing.assert_array_equal(batch["targets"][0], prepared[i]["targets"])


STREAM_READ = """
import json, sys
from llama_jax.data import streaming
from llama_jax.data.sources import list_files
from llama_jax.data.tokenization import Tokenizer
files = list_files([sys.argv[1]])
data = streaming.StreamingDataset(
  [files], Tokenizer(sys.argv[2]), seq_len=16, global_batch=4, seed=3, workers=int(sys.argv[3]), shuffle_window=8
)
iterator = iter(data)
print(json.dumps([len(files)] + [next(iterator)["inputs"].tolist() for _ in range(6)]))
iterator.close()
"""


def test_a_corpus_on_gs_streams_as_the_same_files_local_do(tmp_path, small_tokenizer):
  """Three JSONL files on a real GCS emulator, streamed through 2 grain worker processes (which inherit the
  emulator's settings): the same batches as the local copies give."""
  local = tmp_path / "corpus"
  local.mkdir()
  paths = _jsonl_corpus(local, 3, 40)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}

  def read(spec, extra_env):
    result = subprocess.run(
      [sys.executable, "-c", STREAM_READ, spec, small_tokenizer, "2"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      env={**env, **extra_env},
      timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])

  expected = read(str(local), {})
  with gcs_emulator.running() as emulator:
    for path in paths:
      emulator.fs.put_file(path, f"{emulator.bucket}/corpus/{os.path.basename(path)}")
    remote = read(emulator.uri("corpus", "*.jsonl"), emulator.env)
  assert remote[0] == expected[0] == 3
  assert remote == expected


def test_a_bad_record_stops_the_stream_naming_it_or_is_skipped_and_reported_once(tmp_path, caplog):
  (tmp_path / "a.jsonl").write_text('{"text": "one"}\nnot json\n{"body": "no text field"}\n{"text": "two"}\n')
  shards = [streaming.Shard(str(tmp_path / "a.jsonl"))]
  with pytest.raises(DataError, match=r"a\.jsonl:2: malformed JSON"):
    _take(iter(streaming.ShardStream(shards, "text", 0, "stop", "test")), 2)
  with caplog.at_level("WARNING", logger="llama_jax.data.streaming"):
    texts = _take(iter(streaming.ShardStream(shards, "text", 0, "skip", "test")), 6)  # three passes
  assert texts == ["one", "two"] * 3
  warnings = [r.getMessage() for r in caplog.records]
  assert len(warnings) == 2 and "a.jsonl:2" in warnings[0] and "a.jsonl:3" in warnings[1], warnings


@needs_shakespeare
def test_a_worker_tokenizes_on_one_thread_to_the_same_ids(small_tokenizer, llama2_hf_tokenizer):
  """Workers call encode_batch(texts, 1) (one thread each); sentencepiece's and HF tokenizers' one-thread paths give
  the ids their thread pools give."""
  texts = [read_document(ref)[0][:5000] for ref in resolve_sources(["shakespeare:sonnets,lovers_complaint"])] * 3
  for tokenizer in (Tokenizer(small_tokenizer), load_tokenizer_dir(llama2_hf_tokenizer)):
    assert tokenizer.encode_batch(texts, 1) == tokenizer.encode_batch(texts)


def test_a_reader_with_no_documents_in_its_share_says_how_to_give_it_some(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(DataError, match=r"no document in this reader's share \(1 of .* split the corpus into more files"):
    next(iter(streaming.ShardStream([streaming.Shard(str(empty))], "text", 0, "stop", "test")))
