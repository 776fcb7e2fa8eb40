"""The prepared-data cache every format shares: a directory of token shards (text) or row arrays (``.npy``: SFT
conversations, preference pairs) with ``meta.json``, which records counts, each file's size and sha256, and a
fingerprint of the inputs (sources, tokenizer, settings), so a second run with the same inputs reuses the files.

Reused files are checked first (``check_shards``), because a shard cut short or overwritten would otherwise train on
part of the data, or on garbage, while the log reports the recorded counts. Always: every file's size (a stat); token
ids below the vocabulary (a max over the memory-mapped file: a full read, so only for files up to
``RANGE_SCAN_BYTES`` — larger ones are checked window by window as batches read them); with ``verify`` (the run
config's ``data.verify``), every file's sha256 and the id range whatever the size. A damaged file is prepared again
when the sources are there; otherwise the run stops with a ``DataError`` naming the file. ``meta.json`` is written
last: a crash before it means "not prepared".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from llama_jax.core import paths
from llama_jax.data.sources import DataError, validation_ids

_log = logging.getLogger(__name__)
FORMAT_VERSION = 2  # 2: meta.json records each shard's size and sha256
SPLITS = ("train", "val")

# The id scan reads the whole shard: a fraction of a second at this size, from the page cache or a disk
# (BENCHMARKS.md, "Figures behind the code"). Past this size ids are checked per window as they are read, and over
# the whole shard only with data.verify (its sha256 is slower than the scan).
RANGE_SCAN_BYTES = 256 * 2**20
_READ_CHUNK = 16 * 2**20


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
  with paths.atomic_write(path) as f:  # written last: a crash before it ends means "not prepared"
    json.dump(meta, f, indent=2)


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
  """ "PATH is missing" or "PATH has N bytes but was prepared with M ...", or None; `path` local or remote."""
  if paths.is_remote(path):
    target = paths.path(path)
    if not target.is_file():
      return f"{path} is missing"
    size = target.stat().length
  elif not os.path.isfile(path):
    return f"{path} is missing"
  else:
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


def load_meta(prepared_dir: str) -> dict[str, Any]:
  meta = read_meta(prepared_dir)
  if meta is None:
    raise DataError(f"{prepared_dir!r} holds no prepared data (meta.json missing or unreadable)")
  return meta


def inputs_fingerprint(kind: str, identity: list, tokenizer) -> str:
  """The key of a preparation: the format version, the kind, what the output depends on (JSON-able), the tokenizer."""
  digest = hashlib.sha256(json.dumps([FORMAT_VERSION, kind, *identity], sort_keys=True).encode())
  digest.update(hashlib.sha256(tokenizer.identity_bytes()).digest())
  return digest.hexdigest()


def prepare_rows(
  out_dir: str,
  *,
  kind: str,
  items: Sequence[tuple[str, Any]],
  identity: list,
  problems: list[str],
  tokenizer,
  seq_len: int,
  val_fraction: float,
  seed: int,
  verify: bool,
  lay_out: Callable[[list[tuple[str, Any]]], tuple[dict[str, np.ndarray], dict[str, Any]]],
  token_keys: Sequence[str],
  what: str,
  sources: Sequence[str],
) -> dict[str, Any]:
  """Rows of `seq_len` of checked `items` (location, item), split by location (a seeded `val_fraction` held out),
  cached in `out_dir` under the fingerprint of `kind`, the settings, `identity` (the items as JSON) and the tokenizer;
  returns meta.json's contents.

  `lay_out(items of one split)` encodes them into row arrays (saved as ``<split>_<key>.npy``; the `token_keys` ones
  range-checked when reused) and that split's counts, which must include "too_long" (items that do not fit); it may
  append to `problems` (the bad items skipped), which meta.json counts and quotes."""
  if not items:
    raise DataError(
      f"no usable {what} in {list(sources)}" + (f" ({len(problems)} skipped; first: {problems[0]})" if problems else "")
    )
  key = inputs_fingerprint(kind, [seq_len, val_fraction, seed, identity], tokenizer)
  cached = prepared_meta(out_dir, key, verify)
  if cached is not None:
    return cached
  os.makedirs(out_dir, exist_ok=True)
  meta: dict[str, Any] = dict(
    format=FORMAT_VERSION, kind=kind, fingerprint=key, seq_len=seq_len, vocab_size=tokenizer.vocab_size, files={}
  )
  held_out = validation_ids([location for location, _ in items], val_fraction, seed)
  for split in SPLITS:
    arrays, meta[split] = lay_out([(loc, item) for loc, item in items if (loc in held_out) == (split == "val")])
    for name, array in arrays.items():
      path = os.path.join(out_dir, f"{split}_{name}.npy")
      np.save(path, array)
      meta["files"][os.path.basename(path)] = file_record(path, token_ids=name in token_keys)
  meta.update(
    too_long=sum(meta[split]["too_long"] for split in SPLITS), skipped=len(problems), skipped_examples=problems[:5]
  )
  write_meta(out_dir, meta)
  return meta


class PackedRows:
  """Random access to the rows of a split of `prepare_rows` (memory-mapped arrays `keys`: SFT's packed conversations,
  preference pairs), each file size-checked against meta.json first: a .npy file cut short is a DataError naming it,
  not numpy's mmap error."""

  def __init__(self, prepared_dir: str, split: str, keys: Sequence[str]):
    files = (read_meta(prepared_dir) or {}).get("files", {})
    paths = {k: os.path.join(prepared_dir, f"{split}_{k}.npy") for k in keys}
    for path in paths.values():
      record = files.get(os.path.basename(path))
      problem = size_problem(path, record["bytes"]) if record else None
      if problem is not None:
        raise DataError(f"{problem}; prepare it again (rerun with its sources) or delete {prepared_dir}")
    self.arrays = {k: np.load(path, mmap_mode="r") for k, path in paths.items()}

  def __len__(self) -> int:
    return len(next(iter(self.arrays.values())))

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {k: np.asarray(v[index]) for k, v in self.arrays.items()}
