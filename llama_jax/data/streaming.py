"""Streaming pretraining text (``data.streaming=True``): documents read, tokenized and packed while the run trains, in
grain worker processes, with no preparation step and host memory independent of the corpus size.

Each JAX process reads its own shards: the files of ``data.sources`` (listed, never opened, at start-up), whole files
to process p when there are at least as many files as processes (files p, p+P, ...), otherwise every P-th record of
every file (records p+1, p+1+P, ...). ``data.workers`` grain worker processes split the process's shards the same way
again. A shard stream visits its shards in a new seeded order each epoch, reads each front to back (formats.py), and
yields its documents' texts; each worker tokenizes them a group at a time (``document_ids``: bos + tokens + eos),
concatenates them and cuts windows of seq_len + 1 tokens every seq_len tokens, as prepared text is cut (``Packer``:
inputs = window[:-1], targets = window[1:], with each token's document and position), mixes the sources of a mixture
by weight (grain's ``IterDataset.mix``: shares of windows, as the prepared path), and shuffles windows in a buffer of
``data.shuffle_window`` (grain's ``WindowShuffleIterDataset``). The main process takes the workers' windows in a
fixed round robin and batches this process's rows of each global batch.

Resume: the iterator state of every process (its workers' shard positions: epoch, shard, records read, tokens of the
packer's buffer consumed, and the shuffle window, each re-read from the last such point) goes into the checkpoint's
``data`` item, gathered from all processes. A resume at the same process count and the same ``data.workers`` continues
bit-exactly; another process count is refused in one line (the shards each process reads depend on it; prepared data
resumes under any count).

Validation: ``data.val_sources`` (files never read by training), or ``data.val_fraction`` of the files held out by a
seeded hash (so at least two files are needed), tokenized once, as much as ``train.eval_batches`` needs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Container, Iterator, Sequence
from typing import Any

import grain
import numpy as np
from absl import flags

from llama_jax.core import distributed
from llama_jax.data.batches import local_batch
from llama_jax.data.formats import DataError, iter_records
from llama_jax.data.sources import list_files, validation_ids
from llama_jax.data.text import TokenWindows

_log = logging.getLogger(__name__)
STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Shard:
  """What one reader reads of one file: records offset+1, offset+1+stride, ... (all of them with stride 1)."""

  path: str
  offset: int = 0
  stride: int = 1


class _Every(Container):
  """The record numbers (from 1) of a shard."""

  def __init__(self, offset: int, stride: int):
    self.offset, self.stride = offset, stride

  def __contains__(self, number: object) -> bool:
    return isinstance(number, int) and (number - 1) % self.stride == self.offset


def split_shards(shards: Sequence[Shard], index: int, count: int) -> list[Shard]:
  """Part `index` of `count` (of processes, then of one process's workers): whole shards when there are at least
  `count`, else every count-th record of every shard. The parts are disjoint and cover every record."""
  if len(shards) >= count:
    return list(shards[index::count])
  return [Shard(s.path, s.offset + index * s.stride, s.stride * count) for s in shards]


def read_shard(shard: Shard, text_field: str) -> Iterator[tuple[int, str | DataError]]:
  """(record number, text or the record's DataError) of a shard's records, in order; a damaged file raises."""
  wanted = None if shard.stride == 1 else _Every(shard.offset, shard.stride)
  for number, text, _ in iter_records(shard.path, text_field, wanted):
    yield number, text


_reported: set[str] = set()  # problems already logged by this process: each pass meets them again


def _problem(problem: DataError, on_error: str) -> None:
  """A bad record or damaged file: raised (data.on_error="stop") or skipped with a warning ("skip"), logged once per
  process (a small corpus is read thousands of times in a run: the first version logged 3,072 lines in 2 steps)."""
  if on_error == "stop":
    raise problem
  if str(problem) not in _reported:
    _reported.add(str(problem))
    _log.warning("skipped (data.on_error='skip'; reported once, skipped on every pass): %s", problem)


class ShardStream(grain.IterDataset):
  """Endless document texts of some shards: each epoch visits them in a new order drawn from (seed, epoch). Bad
  records and damaged files raise their DataError (``on_error="stop"``) or are skipped with a warning ("skip").
  Sliceable (grain's worker split): ``set_slice`` keeps part `start` of `step` of the shards (split_shards)."""

  def __init__(self, shards: Sequence[Shard], text_field: str, seed: int, on_error: str, name: str):
    super().__init__()
    self.shards, self.text_field, self.seed, self.on_error, self.name = list(shards), text_field, seed, on_error, name

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    del sequential_slice  # shards are whole files or record strides either way
    self.shards = split_shards(self.shards, sl.start or 0, sl.step or 1)

  def __iter__(self) -> _ShardIterator:
    return _ShardIterator(self)

  def __str__(self) -> str:
    return f"ShardStream({self.name}, {len(self.shards)} shards)"


class _ShardIterator(grain.DatasetIterator):
  """State: epoch, the shard's index in that epoch's order, records of it already read (documents given or
  skipped). A restore reopens the shard and passes over that many records (compressed and remote files allow
  nothing faster)."""

  def __init__(self, stream: ShardStream):
    super().__init__()
    self.stream = stream
    self.epoch, self.index, self.records = 0, 0, 0
    self._records: Iterator | None = None
    self._documents_this_epoch = 0

  def _order(self) -> np.ndarray:
    return np.random.default_rng([self.stream.seed, self.epoch]).permutation(len(self.stream.shards))

  def __next__(self) -> str:
    stream = self.stream
    while True:
      if self.index >= len(stream.shards):
        if not self._documents_this_epoch:
          raise DataError(
            f"{stream.name}: no document in this reader's share ({len(stream.shards)} of the files or record strides) "
            f"in a whole pass; a process and each of its data.workers read their own part: split the corpus into "
            f"more files, lower data.workers, or prepare it (python -m llama_jax.prepare)"
          )
        self.epoch, self.index, self._documents_this_epoch = self.epoch + 1, 0, 0
      if self._records is None:
        shard = stream.shards[int(self._order()[self.index])]
        self._records = read_shard(shard, stream.text_field)
        for _ in range(self.records):
          next(self._records, None)
      try:
        record = next(self._records, None)
      except DataError as e:
        _problem(e, stream.on_error)
        record = None
      if record is None:
        self._records, self.index, self.records = None, self.index + 1, 0
        continue
      self.records += 1
      text = record[1]
      if isinstance(text, DataError):
        _problem(text, stream.on_error)
        continue
      if text.strip():
        self._documents_this_epoch += 1
        return text

  def get_state(self) -> dict[str, int]:
    return {"epoch": self.epoch, "index": self.index, "records": self.records}

  def set_state(self, state: dict[str, int]) -> None:
    self.epoch, self.index, self.records = state["epoch"], state["index"], state["records"]
    self._records, self._documents_this_epoch = None, 1  # a restored pass has read documents already


GROUP_DOCUMENTS, GROUP_CHARS = 256, 1 << 20  # documents tokenized in one encode_batch call, at most


class Packer(grain.IterDataset):
  """Windows of seq_len + 1 tokens of a shard stream's documents (bos + tokens + eos each, as prepared text), cut
  every seq_len tokens so that each token is a target once (the prepared path's windows), and, `with_documents`
  (data.document_mask), each token's document id and position in its document. Documents are tokenized a group at a
  time (`encode_batch` on up to GROUP_DOCUMENTS documents or GROUP_CHARS characters): grain's per-document map and
  ConcatThenSplit packer ran at 0.25 of encode_batch's speed on short documents (bench/data.py, 2-core EPYC), their
  per-element overhead.

  State: the stream's state before the oldest group still in the buffer, and how many of that group's tokens (and
  the following groups') are consumed; a restore re-reads and re-tokenizes from there (at most one window's worth of
  tokens plus one group)."""

  def __init__(self, stream: ShardStream, tokenizer, seq_len: int, with_documents: bool):
    super().__init__(stream)
    self.tokenizer, self.seq_len, self.with_documents = tokenizer, seq_len, with_documents

  def __iter__(self) -> _PackerIterator:
    return _PackerIterator(self._parent.__iter__(), self.tokenizer, self.seq_len, self.with_documents)


class _PackerIterator(grain.DatasetIterator):
  def __init__(self, parent, tokenizer, seq_len: int, with_documents: bool):
    super().__init__(parent)
    self.tokenizer, self.seq_len, self.with_documents = tokenizer, seq_len, with_documents
    self._clear(parent.get_state())

  def _clear(self, state: dict[str, int]) -> None:
    self.groups: list[tuple[dict[str, int], int]] = []  # (stream state before the group, its tokens) in the buffer
    self.first_state, self.pos, self.documents = state, 0, 0
    self.tokens = np.zeros(0, np.int32)
    self.segments = np.zeros(0, np.int64)
    self.positions = np.zeros(0, np.int32)

  def _read_group(self) -> None:
    state, texts, chars = self._parent.get_state(), [], 0
    while len(texts) < GROUP_DOCUMENTS and chars < GROUP_CHARS:
      texts.append(next(self._parent))
      chars += len(texts[-1])
    flat, lengths = self.tokenizer.flat_document_ids(self.tokenizer.encode_batch(texts, _encode_threads))
    tokens, lengths = np.array(flat, np.int32), np.array(lengths, np.int64)
    self.groups.append((state, len(tokens)))
    self.tokens = np.concatenate([self.tokens, tokens])
    if self.with_documents:  # segment ids and positions only where data.document_mask asks for them
      ends = np.cumsum(lengths)
      positions = np.arange(len(tokens), dtype=np.int32) - np.repeat(ends - lengths, lengths).astype(np.int32)
      segments = np.repeat(np.arange(self.documents, self.documents + len(texts)), lengths)
      self.segments = np.concatenate([self.segments, segments])
      self.positions = np.concatenate([self.positions, positions])
    self.documents += len(texts)

  def _drop_consumed_groups(self) -> None:
    drop = 0
    while len(self.groups) > 1 and self.pos - drop >= self.groups[0][1]:
      drop += self.groups.pop(0)[1]
    if drop:
      self.tokens, self.segments, self.positions = self.tokens[drop:], self.segments[drop:], self.positions[drop:]
      self.pos -= drop
    if self.groups:
      self.first_state = self.groups[0][0]

  def __next__(self) -> dict[str, np.ndarray]:
    length = self.seq_len + 1
    while len(self.tokens) - self.pos < length:
      self._read_group()
    end = self.pos + length
    window = {"tokens": self.tokens[self.pos : end]}
    if self.with_documents:
      window.update(segments=self.segments[self.pos : end], positions=self.positions[self.pos : end])
    self.pos += self.seq_len
    self._drop_consumed_groups()
    return window

  def get_state(self) -> dict[str, Any]:
    return {"stream": self.first_state, "consumed": self.pos}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["stream"])
    self._clear(state["stream"])
    while len(self.tokens) <= state["consumed"]:
      self._read_group()
    self.pos = state["consumed"]
    self._drop_consumed_groups()


def _example(window: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """inputs / targets of a window, with segment ids (1, 2, ... for its documents) and positions in the documents
  for the inputs: the batch keys packed SFT rows use, so attention stays inside a document."""
  tokens, segments = window["tokens"], window["segments"]
  relabelled = np.concatenate([[1], 1 + np.cumsum(segments[1:] != segments[:-1])]).astype(np.int32)
  return {
    "inputs": tokens[:-1],
    "targets": tokens[1:],
    "segment_ids": relabelled[:-1],
    "positions": window["positions"][:-1],
  }


def _plain_example(window: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """inputs / targets of a window, attending across its documents (as prepared windows)."""
  tokens = window["tokens"]
  return {"inputs": tokens[:-1], "targets": tokens[1:]}


def component_files(spec_groups: Sequence[Sequence[str]], val_files: set[str]) -> list[list[str]]:
  """The training files of each source group, validation files removed; a group left with none is an error."""
  groups = []
  for specs in spec_groups:
    files = [f for f in list_files(specs) if f not in val_files]
    if not files:
      raise DataError(f"no training files left in {list(specs)} after removing the validation files")
    groups.append(files)
  return groups


def split_files(
  specs: Sequence[str], val_sources: Sequence[str], val_fraction: float, seed: int
) -> tuple[set[str], list[str]]:
  """(validation files, in order): data.val_sources' files, or a seeded hash split of the sources' files (at least
  one file held out, so at least two are needed)."""
  if val_sources:
    val = list_files(val_sources)
    return set(val), val
  if not val_fraction:
    return set(), []
  files = list_files(specs)
  if len(files) < 2:
    raise DataError(
      f"data.val_fraction with data.streaming holds out whole files, and data.sources {list(specs)} names "
      f"{len(files)}: set data.val_sources, or split the corpus into files"
    )
  held_out = validation_ids(files, val_fraction, seed)
  return held_out, [f for f in files if f in held_out]


class StreamingDataset:
  """This process's batches of a streamed corpus (see the module docstring); `iter()` gives a grain iterator whose
  state holds every process's."""

  def __init__(
    self,
    groups: Sequence[Sequence[str]],
    tokenizer,
    *,
    seq_len: int,
    global_batch: int,
    seed: int,
    text_field: str = "text",
    weights: Sequence[float] | None = None,
    workers: int = 0,
    shuffle_window: int = 0,
    document_mask: bool = False,
    on_error: str = "stop",
    process_index: int = 0,
    process_count: int = 1,
  ):
    components = []
    for k, files in enumerate(groups):
      shards = split_shards([Shard(f) for f in files], process_index, process_count)
      name = f"data.sources {files[0]!r}" + (f" and {len(files) - 1} more files" if len(files) > 1 else "")
      stream = ShardStream(shards, text_field, seed + 1000 * k + process_index, on_error, name)
      components.append(Packer(stream, tokenizer, seq_len, document_mask))
    dataset = components[0] if len(components) == 1 else grain.IterDataset.mix(components, list(weights or ()))
    if shuffle_window > 1:
      dataset = grain.experimental.WindowShuffleIterDataset(dataset, window_size=shuffle_window, seed=seed)
    dataset = dataset.map(_example if document_mask else _plain_example)
    # Each process reads its own shards: its rows of a global batch are its next local batch of windows. Batched in
    # the workers, so that one batch, not each window, crosses to the training process: grain hands every array over
    # in a shared-memory block of its own, and per window that cost 0.37 of the rate (bench/data.py, 1 worker).
    dataset = dataset.batch(local_batch(global_batch, process_count), drop_remainder=True)
    if workers:
      if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; a library caller (tests, bench) has none
        flags.FLAGS.mark_as_parsed()
      dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers), _worker_init)
    self.dataset = dataset
    self.workers, self.process_index, self.process_count = workers, process_index, process_count

  def __iter__(self) -> ProcessStates:
    return ProcessStates(iter(self.dataset), self.workers, self.process_index, self.process_count)


_encode_threads = -1  # sentencepiece threads per encode_batch call: one per core, or 1 inside a worker process


def _worker_init(worker_index: int, worker_count: int) -> None:
  """Run in each grain worker before it reads. (1) Tokenize on one thread: the workers are the parallelism, and one
  worker's encode_batch on sentencepiece's pool already took both cores of a small machine part of the time
  (BENCHMARKS.md, "Pretraining data"); on a TPU VM host (hundreds of vCPUs) data.workers pools of a thread per core
  each would oversubscribe it. (2) Exit once the training process is gone: a SIGKILLed trainer otherwise left its
  workers running, adopted by init, holding its memory and output pipes (found by the SIGKILL test, which then never
  ended); polled twice a second."""
  del worker_index, worker_count
  global _encode_threads
  _encode_threads = 1
  parent = os.getppid()

  def watch() -> None:
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(1)

  threading.Thread(target=watch, name="llama_jax-parent-watch", daemon=True).start()


class ProcessStates:
  """A grain iterator whose state is that of every process (gathered: each process's differs, since each reads its
  own shards), so one checkpoint item resumes them all. `get_state` is a collective: every process calls it at the
  same step, as the checkpoint hook does."""

  def __init__(self, iterator, workers: int, process_index: int, process_count: int):
    self.iterator, self.workers = iterator, workers
    self.process_index, self.process_count = process_index, process_count

  def __next__(self):
    return next(self.iterator)

  def __iter__(self):
    return self

  def get_state(self) -> dict[str, Any]:
    states = distributed.gather_json(self.iterator.get_state())
    return {"streaming": STATE_VERSION, "workers": self.workers, "processes": states}

  def set_state(self, state: dict[str, Any]) -> None:
    if state.get("streaming") != STATE_VERSION:
      raise DataError(
        "the checkpoint's data state is not a streaming one (the run prepared its data): resume with "
        "data.streaming=False, or start a new workdir"
      )
    saved, workers = len(state["processes"]), state["workers"]
    if saved != self.process_count or workers != self.workers:
      raise DataError(
        f"the checkpoint's streamed data was read by {saved} processes with data.workers={workers}; this run has "
        f"{self.process_count} with data.workers={self.workers}: a streaming run resumes only with the same ones "
        f"(prepared data resumes under any process count)"
      )
    self.iterator.set_state(state["processes"][self.process_index])

  def close(self) -> None:
    close = getattr(self.iterator, "close", None)
    if close is not None:
      close()


def validation_windows(
  files: Sequence[str], tokenizer, seq_len: int, windows: int, text_field: str, on_error: str
) -> TokenWindows:
  """The validation files' documents tokenized in order, as many as `windows` windows need (0: all), in memory."""
  needed = windows * seq_len + 1 if windows else 0
  tokens: list[int] = []
  for path in files:
    try:
      for _, text in read_shard(Shard(path), text_field):
        if isinstance(text, DataError):
          _problem(text, on_error)
        elif text.strip():
          tokens.extend(tokenizer.document_ids(tokenizer.encode(text)))
        if needed and len(tokens) >= needed:
          break
    except DataError as e:
      _problem(e, on_error)
    if needed and len(tokens) >= needed:
      break
  return TokenWindows(np.asarray(tokens[:needed] if needed else tokens, np.int32), seq_len, name="validation")
