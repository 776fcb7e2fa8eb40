"""Tokenized documents in ArrayRecord shards, as ``python -m llama_jax.prepare`` (data/pipeline.py, Apache Beam)
writes them, and the windows training reads from them.

A directory of shards holds:
  - ``<split>-<key>.array_record``: one record per document, its ids (``document_ids``: bos + tokens + eos) as
    little-endian uint16 (uint32 when the vocabulary does not fit), a document longer than RECORD_TOKENS as several
    records; written with ``group_size:1`` so each record is read alone (random access by window);
  - ``<split>-<key>.ends.npy``: each record's end in the shard's token stream (int64, cumulative), memory-mapped
    when read, so finding the records of a window is a binary search and host memory does not grow with the corpus;
  - ``unit-<key>.json``: what one input file became (its shards' documents, tokens, bytes, sha256), written after
    its shards, so a file whose record is there is done: a rerun after a kill prepares only the rest;
  - ``tokenizer/``: the tokenizer that made the ids; ``index.json``, written last: the shards of each split in order,
    the tokenizer's digest and what was prepared (sources, validation split, text field).

Splits: ``train`` (or ``train-00``, ``train-01``, ... one per source of a mixture) and ``val``. Training reads a split
as one token stream, its shards concatenated in index order, cut into windows of seq_len + 1 tokens every seq_len
tokens (the windows of text.py's ``train.bin`` when the documents are the same), shuffled globally by seed with an
iterator state of one integer, so resume is exact under any process count.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
from array_record.python import array_record_module
from etils import epath
from grain.sources import ArrayRecordDataSource

from llama_jax.core import paths
from llama_jax.data.formats import DataError
from llama_jax.data.prepared import file_record, file_sha256, size_problem
from llama_jax.data.text import checked_window

INDEX = "index.json"
FORMAT = "llama_jax token shards"
VERSION = 1
TOKENIZER_DIR = "tokenizer"
_WRITER_OPTIONS = "group_size:1"  # one record per chunk: a window reads its documents alone, not their neighbours'
# A document longer than this is stored as several records: a window then reads at most this many ids it does not
# need at each end, not a whole book (a 3M-token document made each window read all of it: 240k tokens/s).
RECORD_TOKENS = 4096


def token_dtype(vocab_size: int) -> str:
  return "uint16" if vocab_size <= 2**16 else "uint32"


def tokenizer_digest(tokenizer) -> str:
  return hashlib.sha256(tokenizer.identity_bytes()).hexdigest()


def components(data_cfg) -> tuple[list[str], list[list[str]]]:
  """(training split names, the source specs of each): one ``train`` split, or ``train-NN`` for source NN of a
  weighted mixture (data.sources with weights)."""
  if data_cfg.weights is None:
    return ["train"], [list(data_cfg.specs)]
  return [f"train-{k:02d}" for k in range(len(data_cfg.specs))], [[spec] for spec in data_cfg.specs]


def is_shard_dir(directory: str) -> bool:
  """Whether `directory` holds shards prepared by ``python -m llama_jax.prepare`` (its index.json)."""
  return bool(directory) and paths.path(directory, INDEX).is_file()


def _move(local: str, target: str) -> None:
  """A finished local file moved to `target`, local (a rename) or remote (an upload, streamed)."""
  if not paths.is_remote(target):
    os.replace(local, target)
    return
  with open(local, "rb") as src, epath.Path(target).open("wb") as dst:
    shutil.copyfileobj(src, dst, 16 * 2**20)
  os.remove(local)


class ShardWriter:
  """Writes documents' ids to `target` (``.array_record``, local or remote) and their ends beside it, under a
  temporary local name until ``close``: a shard is whole or absent, never cut short."""

  def __init__(self, target: str, dtype: str):
    self.target, self.dtype = target, np.dtype(dtype)
    self.tmp_dir = tempfile.mkdtemp(prefix="llama_jax-shard-")
    self.local = os.path.join(self.tmp_dir, "shard.array_record")
    self.writer = array_record_module.ArrayRecordWriter(self.local, _WRITER_OPTIONS)
    self.ends, self.tokens, self.documents = array.array("q"), 0, 0  # 8 bytes a record, not a Python int's 36

  def add(self, ids: Sequence[int]) -> None:
    """One document: a record, or several of at most RECORD_TOKENS ids when it is longer."""
    ids = np.asarray(ids, dtype=self.dtype)
    for start in range(0, len(ids), RECORD_TOKENS):
      piece = ids[start : start + RECORD_TOKENS]
      self.writer.write(piece.tobytes())
      self.tokens += len(piece)
      self.ends.append(self.tokens)
    self.documents += 1

  def abort(self) -> None:
    self.writer.close()
    shutil.rmtree(self.tmp_dir, ignore_errors=True)

  def close(self) -> dict[str, Any] | None:
    """Moves the shard and its ends into place; returns the shard's record for the index, or None when it holds no
    document (no file is written)."""
    try:
      self.writer.close()
      if not self.ends:
        return None
      ends_local = os.path.join(self.tmp_dir, "ends.npy")
      np.save(ends_local, np.frombuffer(self.ends, np.int64))
      record = dict(
        name=os.path.basename(self.target),
        documents=self.documents,
        records=len(self.ends),
        tokens=self.tokens,
        **file_record(self.local),
        ends=file_record(ends_local),
      )
      _move(ends_local, ends_path(self.target))
      _move(self.local, self.target)
      return record
    finally:
      shutil.rmtree(self.tmp_dir, ignore_errors=True)


def ends_path(shard: str) -> str:
  return shard[: -len(".array_record")] + ".ends.npy"


def read_index(directory: str) -> dict[str, Any]:
  try:
    index = json.loads(paths.path(directory, INDEX).read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise DataError(f"{directory}/{INDEX} cannot be read ({e}); run python -m llama_jax.prepare again") from None
  if index.get("format") != FORMAT or index.get("version") != VERSION:
    raise DataError(
      f"{directory}/{INDEX} is not a version-{VERSION} index of {FORMAT} (format {index.get('format')!r}, version "
      f"{index.get('version')!r}); run python -m llama_jax.prepare again"
    )
  return index


def check_shard(directory: str, record: dict[str, Any], verify: bool) -> str | None:
  """The first problem with a shard and its ends file ("PATH ..."), or None: sizes always, sha256 with `verify`."""
  shard = str(paths.path(directory, record["name"]))
  for path, size, digest in (
    (shard, record["bytes"], record["sha256"]),
    (ends_path(shard), record["ends"]["bytes"], record["ends"]["sha256"]),
  ):
    problem = size_problem(path, size)
    if problem is not None:
      return problem
    if verify and file_sha256(paths.local_file(path)) != digest:
      return f"{path} does not match the sha256 recorded when it was prepared (its bytes changed)"
  return None


class ShardWindows:
  """Random access to windows of seq_len + 1 tokens of a split's token stream (a grain data source): window i is
  tokens [i·seq_len, i·seq_len + seq_len + 1) of the shards concatenated in order. A window's documents are found
  by binary search in the shards' memory-mapped ends and read through grain's ``ArrayRecordDataSource`` (remote
  shards are copied to the local cache first: ArrayRecord's reader opens local files). Ids are checked against the
  vocabulary as each window is read."""

  def __init__(self, directory: str, shards: Sequence[dict[str, Any]], seq_len: int, dtype: str, vocab_size: int):
    self.seq_len, self.dtype, self.vocab_size, self.name = seq_len, np.dtype(dtype), vocab_size, directory
    names = [str(paths.path(directory, s["name"])) for s in shards]
    local = [paths.local_file(name) for name in names]
    self.ends = [np.load(paths.local_file(ends_path(name)), mmap_mode="r") for name in names]
    # Each path with its record count: grain would otherwise open every shard at start-up to count them.
    self.records = (
      ArrayRecordDataSource([f"{path}[0:{s['records']}]" for path, s in zip(local, shards)]) if shards else None
    )
    self.shard_starts = np.concatenate([[0], np.cumsum([s["tokens"] for s in shards], dtype=np.int64)])
    self.record_bases = np.concatenate([[0], np.cumsum([s["records"] for s in shards], dtype=np.int64)])

  @property
  def tokens(self) -> int:
    return int(self.shard_starts[-1])

  def __len__(self) -> int:
    return max(0, (self.tokens - 1) // self.seq_len)

  def _read(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the stream, across documents and shards."""
    pieces, position = [], start
    shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
    while position < stop:
      ends, base = self.ends[shard], int(self.shard_starts[shard])
      local_start, local_stop = position - base, min(stop, int(self.shard_starts[shard + 1])) - base
      first = int(np.searchsorted(ends, local_start, side="right"))
      last = int(np.searchsorted(ends, local_stop - 1, side="right"))
      keys = range(int(self.record_bases[shard]) + first, int(self.record_bases[shard]) + last + 1)
      ids = np.concatenate([np.frombuffer(raw, self.dtype) for raw in self.records.__getitems__(keys)])
      offset = local_start - (int(ends[first - 1]) if first else 0)
      pieces.append(ids[offset : offset + local_stop - local_start])
      position, shard = base + local_stop, shard + 1
    return np.concatenate(pieces).astype(np.int32)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    start = index * self.seq_len
    return checked_window(self._read(start, start + self.seq_len + 1), self.vocab_size, self.name, index)


def split_windows(
  directory: str, index: dict[str, Any], split: str, seq_len: int, verify: bool = False
) -> ShardWindows:
  """The windows of one split of a shard directory, each shard checked first (sizes; sha256 with `verify`)."""
  shards = index["shards"].get(split, [])
  for record in shards:
    problem = check_shard(directory, record, verify)
    if problem is not None:
      raise DataError(f"{problem}; run python -m llama_jax.prepare again: it prepares only what is missing or damaged")
  return ShardWindows(directory, shards, seq_len, index["dtype"], index["vocab_size"])


def dump_index(index: dict[str, Any]) -> str:
  return json.dumps(index, indent=1)
