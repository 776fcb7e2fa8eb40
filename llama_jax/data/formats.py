"""Corpus file formats: how one file of a text source is read, front to back, as numbered records of one document each.

    text              *.txt and anything else: the whole file is one document (record 1)
    JSONL             *.jsonl, *.jsonl.gz, *.jsonl.zst: a JSON object per line, the text in `text_field`; the record
                      number is the line number (blank lines are no records)
    Parquet           *.parquet (what HF datasets export): a row per document, the text in the string column
                      `text_field`; the record number is the row number, from 1
    ArrayRecord       *.array_record, *.arrayrecord (with shard suffixes such as -00000-of-00010): a record per
                      document, its UTF-8 text

Every file is opened through ``etils.epath``, so local and remote (``gs://bucket/...``) paths read alike, except
ArrayRecord, whose reader (C++) opens local files only: remote ones are copied to the local cache first. Compressed
JSONL is decompressed as a stream; Parquet is read one row group at a time: memory stays one row group or one line.
Invalid UTF-8 in text is replaced by U+FFFD and counted. A damaged file (truncated or corrupt gzip/zstd, not Parquet,
an unreadable ArrayRecord), a record that is not JSON or lacks the field, and a Parquet file without the column are
DataErrors naming the file and the line or row.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib
import json
import json.scanner
import re
import zlib
from collections.abc import Container, Iterator
from typing import Any, BinaryIO

from llama_jax.core import paths
from llama_jax.core.errors import LlamaJaxError
from llama_jax.data.tokenization import decode_utf8_counting

TEXT, JSONL, JSONL_GZ, JSONL_ZST = "text", "jsonl", "jsonl.gz", "jsonl.zst"
PARQUET, ARRAY_RECORD = "parquet", "array_record"
_ARRAY_RECORD_NAME = re.compile(r"\.(array_record|arrayrecord)(-\d+-of-\d+)?$")
_BATCH_RECORDS = 1024  # rows of a Parquet file, or records of an ArrayRecord file, read at a time
_READ_BYTES = 1 << 20


class DataError(LlamaJaxError, ValueError):
  """A data source is missing, empty or too small, or a prepared shard is damaged; the message names it."""


def file_format(path: str) -> str:
  """The format of a corpus file, from its name."""
  for suffix, fmt in ((".jsonl.gz", JSONL_GZ), (".jsonl.zst", JSONL_ZST), (".jsonl", JSONL), (".parquet", PARQUET)):
    if path.endswith(suffix):
      return fmt
  return ARRAY_RECORD if _ARRAY_RECORD_NAME.search(path) else TEXT


def record_numbers(path: str) -> list[int]:
  """The numbers of the records (documents) of a file: JSONL is read once to find its non-blank lines, Parquet and
  ArrayRecord tell their counts from their metadata."""
  fmt = file_format(path)
  if fmt == TEXT:
    return [1]
  if fmt == PARQUET:
    with _parquet_file(path) as parquet:
      return list(range(1, parquet.metadata.num_rows + 1))
  if fmt == ARRAY_RECORD:
    with _array_record_reader(path) as reader:
      return list(range(1, reader.num_records() + 1))
  return [number for number, _ in jsonl_lines(path)]


def iter_records(
  path: str, text_field: str, wanted: Container[int] | None = None
) -> Iterator[tuple[int, str | DataError, int]]:
  """(record number, text, invalid UTF-8 bytes replaced) of each record of a file in order, only those in `wanted`
  when given. A bad record (not JSON, no text) comes as its DataError in place of the text, and reading goes on; a
  damaged file raises its DataError where the damage is."""
  fmt = file_format(path)
  if fmt == TEXT:
    with _opened(path) as f:
      yield 1, *decode_utf8_counting(_read_all(f, path))
  elif fmt == PARQUET:
    yield from _parquet_records(path, text_field, wanted)
  elif fmt == ARRAY_RECORD:
    with _array_record_reader(path) as reader:
      count = reader.num_records()
      for start in range(0, count, _BATCH_RECORDS):
        try:
          batch = reader.read(start, min(start + _BATCH_RECORDS, count))
        except Exception as e:  # noqa: BLE001 -- the C++ reader raises RuntimeError, ValueError or absl statuses
          raise DataError(f"{path}: records {start + 1}.. are unreadable ({e})") from None
        for number, raw in enumerate(batch, start=start + 1):
          if wanted is None or number in wanted:
            yield number, *decode_utf8_counting(raw)
  else:
    for number, raw in jsonl_lines(path):
      if wanted is None or number in wanted:
        try:
          yield number, _jsonl_text(path, number, raw, text_field), 0
        except DataError as e:
          yield number, e, 0


@contextlib.contextmanager
def _opened(path: str) -> Iterator[BinaryIO]:
  try:
    f = paths.path(path).open("rb")
  except (OSError, ValueError) as e:
    raise DataError(f"{path}: cannot be opened ({e})") from None
  with f:
    yield f


def _read_all(f: BinaryIO, path: str) -> bytes:
  try:
    return f.read()
  except OSError as e:
    raise DataError(f"{path}: cannot be read ({e})") from None


def jsonl_lines(path: str) -> Iterator[tuple[int, bytes]]:
  """(line number, line) of each non-blank line, decompressing gzip and zstd as a stream; a damaged stream is one
  DataError naming the file and the last line read whole."""
  fmt = file_format(path)
  errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
  number = 0
  with _opened(path) as raw:
    if fmt == JSONL_GZ:
      stream: Any = gzip.GzipFile(fileobj=raw, mode="rb")
    elif fmt == JSONL_ZST:
      zstandard = _optional("zstandard", path)
      stream = _lines(_zstd_chunks(raw, zstandard))
      errors += (zstandard.ZstdError,)
    else:
      stream = raw
    try:
      for number, line in enumerate(stream, start=1):  # noqa: B007 -- `number` names where a damaged stream ends
        if line.strip():
          yield number, line
    except errors as e:
      kind = {JSONL_GZ: "gzip", JSONL_ZST: "zstd"}.get(fmt, "file")
      raise DataError(f"{path}: damaged or truncated {kind} data after line {number} ({e})") from None


def _zstd_chunks(raw: BinaryIO, zstandard: Any) -> Iterator[bytes]:
  """The decompressed bytes of every zstd frame in `raw`, in chunks. A frame cut short is an error: zstandard's
  stream reader ends quietly there (measured: half of a file read as 0 lines and no error)."""
  frame, pending = zstandard.ZstdDecompressor().decompressobj(), False
  while chunk := raw.read(_READ_BYTES):
    while chunk:
      pending = True
      yield frame.decompress(chunk)
      chunk = b""
      if frame.eof:  # a file may hold several frames, one after another (appended writes)
        chunk, frame, pending = frame.unused_data, zstandard.ZstdDecompressor().decompressobj(), False
  if pending:
    raise EOFError("the last zstd frame is cut short")


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
  """Lines (each with its newline; the last may lack one) of a stream of byte chunks."""
  rest = b""
  for chunk in chunks:
    lines = (rest + chunk).split(b"\n")
    rest = lines.pop()
    yield from (line + b"\n" for line in lines)
  if rest:
    yield rest


def _optional(module: str, path: str) -> Any:
  """An optional dependency of one format (the corpus extra), or a DataError naming the file that needs it."""
  try:
    return importlib.import_module(module)
  except ImportError:
    raise DataError(f"{path}: reading it needs the {module} package (pip install 'llama_jax[corpus]')") from None


_SCAN_JSON = json.scanner.make_scanner(json.JSONDecoder())  # the C scanner that json.loads ends in
_JSON_WHITESPACE = " \t\n\r"


def json_line(raw: bytes) -> Any:
  """The value of one JSON Lines line (UTF-8, an optional byte-order mark), as json.loads gives it, or its
  JSONDecodeError / UnicodeDecodeError. Through the C scanner directly: json.loads's Python wrappers (encoding
  detection, decode, raw_decode) took a sizeable share of a streaming worker's time per document beside the
  tokenizer (BENCHMARKS.md, "Figures behind the code")."""
  text = raw.decode("utf-8-sig" if raw.startswith(b"\xef\xbb\xbf") else "utf-8").strip(_JSON_WHITESPACE)
  try:
    value, end = _SCAN_JSON(text, 0)
  except StopIteration as e:  # the scanner's "no value starts here"; json.loads says the same this way
    raise json.JSONDecodeError("Expecting value", text, e.value) from None
  if end != len(text):
    raise json.JSONDecodeError("Extra data", text, end)
  return value


def _jsonl_text(path: str, number: int, raw: bytes, text_field: str) -> str:
  try:
    record = json_line(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DataError(f"{path}:{number}: malformed JSON ({getattr(e, 'msg', e)})") from None
  if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
    raise DataError(f"{path}:{number}: no string field {text_field!r}")
  return record[text_field]


@contextlib.contextmanager
def _parquet_file(path: str, text_field: str | None = None):
  """The open Parquet file, its column `text_field` (when given) checked to hold strings."""
  pyarrow = _optional("pyarrow", path)
  _optional("pyarrow.parquet", path)
  with _opened(path) as f:
    try:
      parquet = pyarrow.parquet.ParquetFile(f)
    except (pyarrow.ArrowException, OSError) as e:
      raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    if text_field is None:
      yield parquet
      return
    schema = parquet.schema_arrow
    if text_field not in schema.names:
      raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); set data.text_field")
    column_type = schema.field(text_field).type
    if not (pyarrow.types.is_string(column_type) or pyarrow.types.is_large_string(column_type)):
      raise DataError(f"{path}: column {text_field!r} holds {column_type}, not strings")
    yield parquet


def _parquet_records(path: str, text_field: str, wanted: Container[int] | None) -> Iterator[tuple[int, str, int]]:
  pyarrow = _optional("pyarrow", path)
  with _parquet_file(path, text_field) as parquet:
    number = 0
    try:
      for batch in parquet.iter_batches(batch_size=_BATCH_RECORDS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
          number += 1
          if wanted is not None and number not in wanted:
            continue
          yield number, DataError(f"{path}: row {number} has no {text_field!r} (null)") if text is None else text, 0
    except (pyarrow.ArrowException, OSError) as e:
      raise DataError(f"{path}: damaged Parquet data after row {number} ({e})") from None


@contextlib.contextmanager
def _array_record_reader(path: str):
  from array_record.python import array_record_module  # installed with grain

  local = paths.local_file(path) if paths.is_remote(path) else path
  try:
    reader = array_record_module.ArrayRecordReader(local)
    problem = None if reader.ok() else "its header or footer is damaged, or it is cut short"
  except Exception as e:  # noqa: BLE001 -- the C++ reader raises RuntimeError or ValueError for a damaged file
    reader, problem = None, str(e)
  if problem is not None:
    if reader is not None:
      with contextlib.suppress(Exception):
        reader.close()
    raise DataError(f"{path}: not a readable ArrayRecord file ({problem})")
  try:
    yield reader
  finally:
    with contextlib.suppress(Exception):  # closing a reader raises what its reads already reported
      reader.close()
