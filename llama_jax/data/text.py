"""Pretraining text: documents tokenized once into on-disk token shards, then read as windows of seq_len + 1 tokens.

``prepare`` writes ``train.bin`` / ``val.bin`` (each document as bos + tokens + eos, no bos for tokenizers that start
documents without one; concatenated; uint16 when the vocabulary fits) and ``meta.json`` (the prepared-data cache of
prepared.py: counts, each shard's size and sha256, a fingerprint of sources + tokenizer), so a second run with the
same inputs reuses the files. Documents named by the validation sources are removed from training: the split is by
document.

Batches: the token stream is cut into windows of seq_len + 1 tokens (inputs = window[:-1], targets = window[1:]),
shuffled by seed (a new permutation each epoch), and split across JAX processes so each reads a disjoint part of every
global batch (batches.py). The iterator state is one integer, saved with each checkpoint for an exact resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from llama_jax.core import paths
from llama_jax.data.batches import batches_of, process_batches
from llama_jax.data.prepared import FORMAT_VERSION, cannot_prepare, load_meta, prepared_meta, size_problem, write_meta
from llama_jax.data.sources import DataError, DocumentRef, file_identity, iter_documents, split_components

_log = logging.getLogger(__name__)
_PROBLEMS_KEPT = 20  # in meta.json, of the bad documents and damaged files skipped


def _fingerprint(splits: Sequence[tuple[str, Sequence[DocumentRef]]], tokenizer, text_field: str) -> str:
  digest = hashlib.sha256()
  digest.update(json.dumps([FORMAT_VERSION, text_field]).encode())
  digest.update(hashlib.sha256(tokenizer.identity_bytes()).digest())
  for split, refs in splits:
    digest.update(split.encode())
    for path in sorted({r.path for r in refs}):
      digest.update(json.dumps(file_identity(path)).encode())
    digest.update(json.dumps([(r.doc_id, r.line) for r in refs]).encode())
  return digest.hexdigest()


def _write_split(
  refs: Sequence[DocumentRef], tokenizer, path: str, text_field: str, dtype, problems: list[str] | None
) -> tuple[dict[str, int], dict[str, Any]]:
  """(counts, the shard's record for meta.json): the digest is taken of the bytes as they are written, so preparing
  never reads a shard back. Bad records and damaged files go to `problems` when it is a list (else they raise)."""
  counts = dict(documents=0, tokens=0, bytes=0, replaced_bytes=0, empty_documents=0, skipped=0)
  problems_before = len(problems or ())
  digest, size = hashlib.sha256(), 0
  with paths.atomic_write(path, "wb") as out:
    batch: list[str] = []

    def flush():
      nonlocal size
      for ids in tokenizer.encode_batch(batch):
        document = tokenizer.document_ids(ids)
        chunk = np.asarray(document, dtype=dtype).tobytes()
        out.write(chunk)
        digest.update(chunk)
        size += len(chunk)
        counts["tokens"] += len(document)
      batch.clear()

    for _, text, replaced in iter_documents(refs, text_field, problems):
      counts["replaced_bytes"] += replaced
      if not text.strip():
        counts["empty_documents"] += 1
        continue
      counts["documents"] += 1
      counts["bytes"] += len(text.encode("utf-8"))
      batch.append(text)
      if len(batch) >= 256:
        flush()
    flush()
  counts["skipped"] = len(problems or ()) - problems_before
  return counts, dict(bytes=size, sha256=digest.hexdigest(), token_ids=True)


def prepare(
  sources: Sequence[str],
  val_sources: Sequence[str],
  tokenizer,
  out_dir: str,
  *,
  val_fraction: float = 0.0,
  seed: int = 0,
  text_field: str = "text",
  verify: bool = False,
  mixture: bool = False,
  on_error: str = "stop",
) -> dict[str, Any]:
  """Tokenizes the sources into token shards in `out_dir` once, for pretraining.

  Each document is stored as bos + tokens + eos, without bos for a tokenizer that starts documents without one, the
  documents concatenated, as uint16 when the vocabulary fits. All training documents go to train.bin, or with
  `mixture` each source's to its own shard (train-00.bin, ...: meta.json's "components"), which train_dataset mixes
  by weight; the validation documents go to val.bin. meta.json holds the counts, each shard's size and sha256 and a
  fingerprint of the sources and the tokenizer: a second call with the same inputs reuses the shards when they pass
  `check_shards`, with their digests too when `verify`. A bad record or damaged file stops preparation (`on_error`
  "stop") or is skipped ("skip"), counted in meta.json's "skipped" with the first problems in "problems".

  Args:
    sources: the training source specs (`resolve_sources`).
    val_sources: the validation source specs, whose documents are removed from training; empty for a split of
      `val_fraction`.
    tokenizer: the tokenizer that encodes the documents.
    out_dir: the directory of the shards and meta.json.
    val_fraction: the share of documents a seeded hash split holds out when there are no `val_sources`.
    seed: the seed of that split.
    text_field: the field or column holding a document's text in JSONL and Parquet files.
    verify: check the sha256 and every id of shards about to be reused.
    mixture: one training shard per source, for a mixture drawn by weight.
    on_error: "stop" to raise on a bad record or damaged file, "skip" to leave it out and count it.

  Returns:
    The contents of meta.json.

  Raises:
    DataError: a source is missing or damaged, named after a damaged shard of `out_dir` if there is one, or the
      training sources hold no text.
  """
  components = [[spec] for spec in sources] if mixture else [list(sources)]
  problems: list[str] | None = [] if on_error == "skip" else None
  try:
    trains, val = split_components(components, val_sources, val_fraction, seed, problems)
  except DataError as e:
    raise cannot_prepare(out_dir, e, verify) from e
  names = [f"train-{k:02d}" for k in range(len(trains))] if mixture else ["train"]
  splits = [*zip(names, trains), ("val", val)]
  fingerprint = _fingerprint(splits, tokenizer, text_field)
  cached = prepared_meta(out_dir, fingerprint, verify)
  if cached is not None:
    return cached
  os.makedirs(out_dir, exist_ok=True)
  dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
  meta = dict(
    format=FORMAT_VERSION,
    fingerprint=fingerprint,
    dtype=np.dtype(dtype).name,
    vocab_size=tokenizer.vocab_size,
    bos_id=tokenizer.bos_id,
    eos_id=tokenizer.eos_id,
    files={},
  )
  for (split, refs), specs in zip(splits, [*components, val_sources]):
    counts, meta["files"][f"{split}.bin"] = _write_split(
      refs, tokenizer, os.path.join(out_dir, f"{split}.bin"), text_field, dtype, problems
    )
    if split != "val" and counts["documents"] == 0:
      raise DataError(f"the training sources {list(specs)} contain no text")
    meta[split] = counts
  if problems:
    meta["skipped"], meta["problems"] = len(problems), problems[:_PROBLEMS_KEPT]
    _log.warning(
      "skipped %d bad documents or damaged files (data.on_error='skip'); the first: %s", len(problems), problems[0]
    )
  if mixture:
    meta["components"] = [dict(source=spec, split=name) for spec, name in zip(sources, names)]
    meta["train"] = {key: sum(meta[name][key] for name in names) for key in meta[names[0]]}
  if meta["train"]["replaced_bytes"] or meta["val"]["replaced_bytes"]:
    _log.warning(
      "replaced %d invalid UTF-8 bytes with U+FFFD", meta["train"]["replaced_bytes"] + meta["val"]["replaced_bytes"]
    )
  write_meta(out_dir, meta)
  return meta


class TokenWindows:
  """Random access to windows of seq_len + 1 tokens of a token stream, as a grain data source.

  Window i is tokens[i·seq_len : i·seq_len + seq_len + 1], read as {"inputs": window[:-1], "targets": window[1:]}.
  With `vocab_size`, each window's ids are checked as it is read, a max over seq_len + 1 ids: the guard for shards
  too large to scan at start-up.

  Args:
    tokens: the token stream, e.g. a memory-mapped shard (`open`).
    seq_len: the length of a window's inputs and of its targets.
    vocab_size: the vocabulary the ids must fall in, or 0 for no check.
    name: what to call the stream in errors.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int = 0, name: str = "the token stream"):
    self.tokens, self.seq_len, self.vocab_size, self.name = tokens, seq_len, vocab_size, name

  @classmethod
  def open(
    cls, path: str, seq_len: int, dtype: str, record: dict[str, Any] | None = None, vocab_size: int = 0
  ) -> TokenWindows:
    """Memory-maps a prepared shard: nothing is read until a window is.

    Its size is checked against its meta.json `record` first, a stat, so a shard cut short never trains on part of
    the data under the recorded counts.

    Args:
      path: the shard file.
      seq_len: the length of a window's inputs and of its targets.
      dtype: the dtype of the shard's tokens, meta.json's "dtype".
      record: the shard's entry in meta.json's "files", with its size in "bytes", or None to check only that the
        file holds whole tokens.
      vocab_size: the vocabulary each window's ids must fall in, or 0 for no check.

    Returns:
      The windows of the shard.

    Raises:
      DataError: the shard's size is not the recorded one, or not a whole number of tokens.
    """
    problem = size_problem(path, record["bytes"]) if record else None
    size = os.path.getsize(path) if problem is None else 0
    if size % np.dtype(dtype).itemsize:
      problem = f"{path} has {size:,} bytes, not a whole number of {dtype} tokens (cut short or overwritten)"
    if problem is not None:
      raise DataError(f"{problem}; prepare it again (rerun with its sources) or delete {os.path.dirname(path)}")
    tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    return cls(tokens, seq_len, vocab_size, path)

  def __len__(self) -> int:
    """The number of whole windows in the stream."""
    return max(0, (len(self.tokens) - 1) // self.seq_len)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    """{"inputs", "targets"} int32 [seq_len] of window `index`; DataError when an id is outside the vocabulary."""
    start = index * self.seq_len
    window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)
    return checked_window(window, self.vocab_size, self.name, index)


def checked_window(window: np.ndarray, vocab_size: int, name: str, index: int) -> dict[str, np.ndarray]:
  """{"inputs", "targets"} of a window of seq_len + 1 ids, refused (DataError naming `name` and the window) when an
  id is outside [0, vocab_size): the per-window guard of shards too large to scan at start-up."""
  low, high = (int(window.min()), int(window.max())) if vocab_size and window.size else (0, 0)
  if low < 0 or high >= max(vocab_size, 1):
    bad = low if low < 0 else high
    raise DataError(
      f"{name}: window {index} holds token id {bad}, outside the vocabulary of {vocab_size} (its bytes "
      f"changed); rerun with --config.data.verify=True to check every shard and prepare it again"
    )
  return {"inputs": window[:-1], "targets": window[1:]}


def tokenize_documents(refs: Sequence[DocumentRef], tokenizer, text_field: str = "text") -> np.ndarray:
  """The documents as one in-memory token stream (``document_ids`` each), for evaluating files not prepared."""
  texts = [text for _, text, _ in iter_documents(refs, text_field)]
  ids = tokenizer.encode_batch([t for t in texts if t.strip()])
  return np.asarray(tokenizer.flat_document_ids(ids)[0], dtype=np.int32)


def open_split(prepared_dir: str, split: str, seq_len: int) -> TokenWindows:
  """The windows of a prepared split ("train" or "val"), size-checked, with ids checked as they are read."""
  meta, name = load_meta(prepared_dir), f"{split}.bin"
  record = meta.get("files", {}).get(name)
  return TokenWindows.open(os.path.join(prepared_dir, name), seq_len, meta["dtype"], record, meta.get("vocab_size", 0))


def train_dataset(
  prepared_dir: str,
  seq_len: int,
  global_batch: int,
  seed: int,
  process_index: int = 0,
  process_count: int = 1,
  weights: Sequence[float] | None = None,
) -> grain.MapDataset:
  """Endless shuffled batches of this process's share of each global batch: {"inputs", "targets"} [b, seq_len]. A
  mixture (prepared with `mixture`) draws its components' windows by `weights`."""
  meta = load_meta(prepared_dir)
  if "components" in meta:
    if weights is None or len(weights) != len(meta["components"]):
      raise DataError(
        f"{prepared_dir} holds a mixture of {len(meta['components'])} sources; give data.sources their weights"
      )
    components = [(c["source"], open_split(prepared_dir, c["split"], seq_len)) for c in meta["components"]]
  else:
    components = [("the training split", open_split(prepared_dir, "train", seq_len))]
  return window_batches(components, global_batch, seed, process_index, process_count, weights)


def window_batches(
  components: Sequence[tuple[str, Any]],
  global_batch: int,
  seed: int,
  process_index: int,
  process_count: int,
  weights: Sequence[float] | None,
) -> grain.MapDataset:
  """Batches of the windows of one token stream (`components` [(name, windows)]), shuffled by seed, or of a mixture's
  components drawn by `weights`; refused in one line when there are too few windows.

  A mixture: each component's windows shuffled by seed (its own stream: component k by seed + k) and repeated, mixed
  by grain's MapDataset.mix: window i of the mixture comes from the component a fixed weighted pattern picks, so every
  span of windows holds each component in its share (measured: exactly, over 10,000 windows), and the mixture is a
  pure function of (seed, weights): the iterator state stays one batch count, exact under any process count."""
  if weights is None:
    ((name, windows),) = components
    if len(windows) < global_batch:
      raise DataError(
        f"corpus too small for one batch: {name} has {len(windows)} windows of {windows.seq_len}+1 tokens, but a "
        f"batch needs {global_batch}; add data or lower train.batch_size / train.seq_len"
      )
    return process_batches(windows, global_batch, seed, process_index, process_count)
  datasets = []
  for k, (name, windows) in enumerate(components):
    if len(windows) == 0:
      raise DataError(
        f"mixture source {name!r} has less than one window of {windows.seq_len}+1 tokens; add data or lower "
        f"train.seq_len"
      )
    datasets.append(grain.MapDataset.source(windows).shuffle(seed=seed + k).repeat(None))
  return batches_of(grain.MapDataset.mix(datasets, list(weights)), global_batch, process_index, process_count)


def validation_windows(prepared_dir: str, seq_len: int) -> TokenWindows:
  return open_split(prepared_dir, "val", seq_len)
