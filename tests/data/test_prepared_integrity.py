"""Prepared shards are checked before they are reused: a shard cut short, of an odd size, with changed bytes or with
ids outside the vocabulary is prepared again when its sources are there, and is one line naming the file (exit 2
from the CLI) when they are not. Sizes are checked always, digests with data.verify."""

import itertools
import json
import logging
import os
import shutil

import numpy as np
import pytest

from llama_jax.data import prepared as prepared_lib
from llama_jax.data import sft, text
from llama_jax.data import sources as sources_lib
from llama_jax.data.tokenization import Tokenizer
from tests.conftest import needs_shakespeare
from tests.data.test_text import corpus, write
from tests.runs import assert_one_line_error, train_in_process

pytestmark = needs_shakespeare


@pytest.fixture
def tok(small_tokenizer):
  return Tokenizer(small_tokenizer)


def prepare(sources, tok, out, **kwargs):
  return text.prepare([sources], [], tok, out, val_fraction=0.3, seed=1, **kwargs)


@pytest.fixture
def prepared(tmp_path, tok):
  """(sources directory, prepared directory, its meta.json) of 20 documents with both splits non-empty."""
  sources, out = corpus(tmp_path, n_docs=20, words=120), str(tmp_path / "prepared")
  meta = prepare(sources, tok, out)
  assert meta["train"]["tokens"] > 0 and meta["val"]["tokens"] > 0
  return sources, out, meta


def read_bytes(path):
  with open(path, "rb") as f:
    return f.read()


def cut(path, fraction):
  content = read_bytes(path)
  with open(path, "wb") as f:
    f.write(content[: int(len(content) * fraction)])


def append_byte(path):
  with open(path, "ab") as f:
    f.write(b"\x01")


def randomize(path):
  size = os.path.getsize(path)
  with open(path, "wb") as f:
    f.write(os.urandom(size))


def set_token(path, index, value, dtype="uint16"):
  tokens = np.fromfile(path, dtype=dtype)
  tokens[index] = value
  tokens.tofile(path)


def test_meta_records_each_shards_size_and_sha256(prepared):
  _, out, meta = prepared
  assert set(meta["files"]) == {"train.bin", "val.bin"}
  for name, record in meta["files"].items():
    path = os.path.join(out, name)
    assert record == {"bytes": os.path.getsize(path), "sha256": prepared_lib.file_sha256(path), "token_ids": True}
  assert prepared_lib.check_shards(out, meta, verify=True) is None


DAMAGE = {
  "train.bin cut to half": ("train.bin", lambda path: cut(path, 0.5)),
  "train.bin of an odd size": ("train.bin", append_byte),
  "val.bin cut to a third": ("val.bin", lambda path: cut(path, 1 / 3)),
  "train.bin overwritten by random bytes": ("train.bin", randomize),
  "train.bin with an out-of-vocabulary id": ("train.bin", lambda path: set_token(path, 5, 600)),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_shard_is_prepared_again_when_its_sources_are_there(prepared, tok, caplog, damage):
  sources, out, meta = prepared
  name, spoil = DAMAGE[damage]
  path = os.path.join(out, name)
  before = read_bytes(path)
  spoil(path)
  with caplog.at_level(logging.WARNING, logger="llama_jax.data"):
    again = prepare(sources, tok, out)
  assert again == meta and read_bytes(path) == before
  assert any("preparing the data again" in r.getMessage() and path in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_shard_without_its_sources_is_an_error_naming_the_file(prepared, tok, damage):
  sources, out, _ = prepared
  name, spoil = DAMAGE[damage]
  spoil(os.path.join(out, name))
  shutil.rmtree(sources)
  with pytest.raises(sources_lib.DataError) as error:
    prepare(sources, tok, out)
  message = str(error.value)
  assert os.path.join(out, name) in message and "cannot be prepared again" in message, message
  assert f"data source {sources!r} does not exist" in message


def test_changed_bytes_within_the_vocabulary_are_found_by_verify_only(prepared, tok):
  """The cheap checks (size, id range) cannot see a changed id that is still a valid one: only the digest can."""
  sources, out, meta = prepared
  path = os.path.join(out, "train.bin")
  before = read_bytes(path)
  tokens = np.frombuffer(before, dtype=meta["dtype"])
  set_token(path, 7, (int(tokens[7]) + 1) % tok.vocab_size)
  flipped = read_bytes(path)
  assert prepare(sources, tok, out) == meta and read_bytes(path) == flipped  # reused: size and ids look fine
  assert "sha256" in prepared_lib.check_shards(out, meta, verify=True)
  assert prepare(sources, tok, out, verify=True) == meta and read_bytes(path) == before


def test_ids_of_a_shard_too_large_to_scan_are_checked_as_windows_are_read(prepared, tok, monkeypatch):
  _, out, meta = prepared
  monkeypatch.setattr(prepared_lib, "RANGE_SCAN_BYTES", 0)
  path = os.path.join(out, "train.bin")
  set_token(path, 3, 600)
  assert prepared_lib.check_shards(out, meta) is None  # size only: no full read at start-up
  assert "outside the vocabulary of 512" in prepared_lib.check_shards(out, meta, verify=True)
  windows = text.open_split(out, "train", 16)
  windows[1]  # window 0 holds token 3: the others read fine
  with pytest.raises(
    sources_lib.DataError, match=r"train.bin: window 0 holds token id 600, outside the vocabulary of 512"
  ):
    windows[0]
  # Through grain too (the training loop's path): the DataError arrives as it is, for the one-line exit.
  with pytest.raises(sources_lib.DataError, match=r"train.bin: window 0 holds token id 600"):
    for _ in itertools.islice(text.train_dataset(out, 16, 2, seed=0), len(windows)):  # two epochs
      pass


def test_opening_a_cut_shard_is_an_error_naming_it(prepared):
  """What evaluate and the batches read (without preparing first): a DataError, not a short epoch or numpy's."""
  _, out, _ = prepared
  cut(os.path.join(out, "val.bin"), 1 / 3)
  with pytest.raises(sources_lib.DataError, match=r"val.bin has [\d,]+ bytes but was prepared with [\d,]+"):
    text.validation_windows(out, 16)
  append_byte(os.path.join(out, "train.bin"))
  with pytest.raises(sources_lib.DataError, match=r"train.bin has [\d,]+ bytes but was prepared with"):
    text.train_dataset(out, 16, 2, seed=0)


def conversations(tmp_path, n=30):
  lines = [
    {
      "messages": [
        {"role": "user", "content": f"question {i} about the fox"},
        {"role": "assistant", "content": f"answer {i}"},
      ]
    }
    for i in range(n)
  ]
  return write(tmp_path / "chat" / "conversations.jsonl", "".join(json.dumps(line) + "\n" for line in lines))


def test_chat_rows_are_checked_like_text_shards(tmp_path, tok):
  source, out = conversations(tmp_path), str(tmp_path / "sft")
  settings = dict(seq_len=64, val_fraction=0.2, seed=0)
  meta = sft.prepare_sft([source], tok, out, **settings)
  assert meta["vocab_size"] == tok.vocab_size and len(meta["files"]) == 10
  path = os.path.join(out, "train_inputs.npy")
  before = read_bytes(path)
  cut(path, 0.5)
  with pytest.raises(sources_lib.DataError, match=r"train_inputs.npy has [\d,]+ bytes but was prepared with"):
    prepared_lib.PackedRows(out, "train", sft.SFT_KEYS)
  assert sft.prepare_sft([source], tok, out, **settings) == meta and read_bytes(path) == before
  rows = np.load(path)
  rows[0, 0] = 600
  np.save(path, rows)
  os.remove(source)
  with pytest.raises(
    sources_lib.DataError,
    match=r"train_inputs.npy holds token id 600, outside the vocabulary of 512 .*cannot be prepared again",
  ):
    sft.prepare_sft([source], tok, out, **settings)


@pytest.mark.parametrize(
  "spoil,verify,hint",
  [(lambda path: cut(path, 0.5), False, "bytes but was prepared with"), (None, True, "does not match the sha256")],
  ids=["cut", "changed_bytes_with_verify"],
)
def test_train_cli_stops_with_one_line_naming_the_damaged_shard(
  prepared, small_tokenizer, tmp_path, spoil, verify, hint, capfd
):
  sources, out, meta = prepared
  path = os.path.join(out, "train.bin")
  if spoil is None:
    tokens = np.fromfile(path, dtype=meta["dtype"])
    set_token(path, 7, (int(tokens[7]) + 1) % 512)
  else:
    spoil(path)
  shutil.rmtree(sources)
  result = train_in_process(
    capfd,
    tmp_path / "run",
    small_tokenizer,
    f"--config.data.sources=('{sources}',)",
    f"--config.data.prepared_dir={out}",
    f"--config.data.verify={verify}",
  )
  assert_one_line_error(result, path, hint, "cannot be prepared again")
