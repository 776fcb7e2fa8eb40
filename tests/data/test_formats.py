"""Corpus files in every format (data/formats.py): the same documents written as JSONL, gzip and zstd JSONL, Parquet
(several row groups) and ArrayRecord read back equal, in order, and tokenize to the same stream; globs (``**``) pick
files at any depth; sources on gs:// (a real GCS emulator) read as local ones, through `evaluate --data`; every
damaged file or bad record is one error naming the file and line or row (exit 2 from a command)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from llama_jax.data import formats, sources, text
from llama_jax.data.sources import DataError
from llama_jax.data.tokenization import Tokenizer
from tests import gcs_emulator
from tests.conftest import META_TOKENIZER, ROOT, needs_shakespeare
from tests.runs import assert_one_line_error, run_train, train_in_process

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

DOCS = [
  f"Document {i}: {'ünïcode 🙂 水' if i % 3 == 0 else 'plain text'}\n{'  spaced  ' * (i % 4)}line two of {i}."
  for i in range(2500)
]


def jsonl_bytes(docs, field="text") -> bytes:
  return b"".join(json.dumps({field: t, "id": i}).encode() + b"\n" for i, t in enumerate(docs))


def write_array_record(path, records) -> None:
  from array_record.python import array_record_module

  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for record in records:
    writer.write(record)
  writer.close()


def write_corpus(directory, docs=DOCS) -> dict[str, str]:
  """The documents in each format, by format name."""
  directory.mkdir(parents=True, exist_ok=True)
  files = {
    formats.JSONL: directory / "c.jsonl",
    formats.JSONL_GZ: directory / "c.jsonl.gz",
    formats.JSONL_ZST: directory / "c.jsonl.zst",
    formats.PARQUET: directory / "c.parquet",
    formats.ARRAY_RECORD: directory / "c.array_record-00000-of-00001",
  }
  lines = jsonl_bytes(docs)
  files[formats.JSONL].write_bytes(lines)
  files[formats.JSONL_GZ].write_bytes(gzip.compress(lines))
  # Two zstd frames, as a file appended to by two writers: both are read.
  half = lines.index(b"\n", len(lines) // 2) + 1
  compressor = zstandard.ZstdCompressor()
  files[formats.JSONL_ZST].write_bytes(compressor.compress(lines[:half]) + compressor.compress(lines[half:]))
  pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), files[formats.PARQUET], row_group_size=700)
  write_array_record(files[formats.ARRAY_RECORD], [t.encode() for t in docs])
  return {fmt: str(path) for fmt, path in files.items()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("corpus"))


def texts_of(specs, text_field="text") -> list[str]:
  return [t for _, t, _ in sources.iter_documents(sources.resolve_sources(specs), text_field)]


def test_every_format_reads_the_same_documents_in_order(corpus):
  for fmt, path in corpus.items():
    assert formats.file_format(path) == fmt
    refs = sources.resolve_sources([path])
    assert [r.line for r in refs] == list(range(1, len(DOCS) + 1)), fmt
    assert texts_of([path]) == DOCS, fmt
    # A subset of the records (as the validation split leaves) reads exactly those, in order.
    picked = refs[5::97]
    assert [t for _, t, _ in sources.iter_documents(picked)] == DOCS[5::97], fmt
    assert sources.read_document(refs[1234]) == (DOCS[1234], 0), fmt


def test_every_format_tokenizes_to_the_same_stream(corpus):
  tokenizer = Tokenizer(META_TOKENIZER)
  streams = {fmt: text.tokenize_documents(sources.resolve_sources([p]), tokenizer) for fmt, p in corpus.items()}
  expected = np.asarray([t for d in tokenizer.encode_batch(DOCS) for t in tokenizer.document_ids(d)])
  for fmt, stream in streams.items():
    np.testing.assert_array_equal(stream, expected, err_msg=fmt)


def test_globs_match_at_any_depth_and_a_glob_matching_nothing_is_an_error(tmp_path):
  write_corpus(tmp_path / "web" / "2024", DOCS[:10])
  write_corpus(tmp_path / "web" / "2025" / "q1", DOCS[10:30])
  assert texts_of([str(tmp_path / "web" / "**" / "*.parquet")]) == DOCS[:30]
  assert texts_of([str(tmp_path / "web" / "*" / "*.jsonl.zst")]) == DOCS[:10]
  assert len(texts_of([str(tmp_path / "web")])) == 5 * 30  # a directory: every file below it
  with pytest.raises(DataError, match=r"data source '.*/web/\*\*/\*\.jsonl\.xz' does not exist"):
    sources.resolve_sources([str(tmp_path / "web" / "**" / "*.jsonl.xz")])


def test_the_text_field_of_jsonl_and_parquet(tmp_path):
  (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS[:5], field="content")))
  pq.write_table(pa.table({"content": DOCS[:5]}), tmp_path / "c.parquet")
  for name in ("c.jsonl.gz", "c.parquet"):
    assert texts_of([str(tmp_path / name)], "content") == DOCS[:5]


def damaged_files(directory) -> list[tuple[str, str]]:
  """(path, what the error must say) for each kind of damage."""
  directory.mkdir(parents=True, exist_ok=True)
  lines = jsonl_bytes(DOCS[:400])
  cases = []

  def case(name, content, message):
    path = directory / name
    path.write_bytes(content)
    cases.append((str(path), message.format(path=path)))

  gz = gzip.compress(lines)
  case("truncated.jsonl.gz", gz[: len(gz) // 2], "{path}: damaged or truncated gzip data after line")
  case("not_gzip.jsonl.gz", b"this is not gzip at all\n" * 10, "{path}: damaged or truncated gzip data after line 0")
  zst = zstandard.ZstdCompressor().compress(lines)
  case("truncated.jsonl.zst", zst[: len(zst) // 2], "{path}: damaged or truncated zstd data after line")
  checked = zstandard.ZstdCompressor(write_checksum=True).compress(lines)
  corrupt = checked[:100] + bytes(50) + checked[150:]
  case("corrupt.jsonl.zst", corrupt, "{path}: damaged or truncated zstd data after line")
  case("bad_line.jsonl.gz", gzip.compress(lines + b"{not json\n"), "{path}:401: malformed JSON")
  case(
    "no_field.jsonl.zst", zstandard.ZstdCompressor().compress(b'{"body": "x"}\n'), "{path}:1: no string field 'text'"
  )
  case("not.parquet", b"PAR1 this is not parquet", "{path}: not a readable Parquet file")
  table = pa.table({"body": DOCS[:3]})
  pq.write_table(table, directory / "no_column.parquet")
  cases.append(
    (str(directory / "no_column.parquet"), f"{directory / 'no_column.parquet'}: no column 'text' (columns: body)")
  )
  pq.write_table(pa.table({"text": [1, 2, 3]}), directory / "ints.parquet")
  cases.append(
    (str(directory / "ints.parquet"), f"{directory / 'ints.parquet'}: column 'text' holds int64, not strings")
  )
  case("bad.array_record", b"not an array record file" * 4, "{path}: not a readable ArrayRecord file")
  write_array_record(directory / "whole.array_record", [t.encode() for t in DOCS[:400]])
  whole = (directory / "whole.array_record").read_bytes()
  case("cut.array_record", whole[: len(whole) // 2], "{path}: not a readable ArrayRecord file")
  return cases


JSON_LINES = [
  b'{"text": "plain"}',
  b'  {"text": "spaces round it"}\t\r',
  b'\xef\xbb\xbf{"text": "after a byte-order mark"}',
  '{"text": "caf\u00e9 \\u00e9 \\ud83d\\ude00 \u4e2d"}'.encode(),
  b'{"text": "x", "n": NaN, "m": -Infinity, "deep": [1, {"a": [null, true, 2.5e-3]}]}',
  b'["not", "an object"]',
  b'"a string"',
  b"17",
  b"{not json",
  b'{"text": "a"} {"text": "b"}',
  b'{"text": "a"}, {"text": "b"}',
  b'{"text": "cut',
  b'{"text": "a"}\x00',
  b"\xff\xfe{}",
  b'{"text": "\xc3"}',
  b"",
  b"   ",
  b"]",
  '{"text": "a"}\u3000'.encode(),
]


@pytest.mark.parametrize("raw", JSON_LINES)
def test_a_json_line_reads_as_json_loads_reads_it(raw):
  """formats.json_line (the C scanner, called directly) against json.loads, the reference: the same value, or an
  error where json.loads raises one."""
  try:
    expected = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError):
    with pytest.raises((json.JSONDecodeError, UnicodeDecodeError)):
      formats.json_line(raw)
    return
  got = formats.json_line(raw)
  assert json.dumps(got) == json.dumps(expected)  # NaN compares unequal to itself; its dump does not


def test_damaged_files_and_bad_records_name_the_file_and_line(tmp_path):
  for path, message in damaged_files(tmp_path):
    with pytest.raises(DataError) as error:
      texts_of([path])
    assert str(error.value).startswith(message), (path, str(error.value))
    assert "\n" not in str(error.value)


def test_with_on_error_skip_bad_records_and_damaged_files_are_skipped_and_counted(tmp_path):
  tokenizer = Tokenizer(META_TOKENIZER)
  good = write_corpus(tmp_path / "good", DOCS[:50])[formats.PARQUET]
  damaged = damaged_files(tmp_path / "bad")
  specs = [good] + [path for path, _ in damaged]
  with pytest.raises(DataError, match="damaged or truncated gzip data"):
    text.prepare(specs, (), tokenizer, str(tmp_path / "stop"))
  meta = text.prepare(specs, (), tokenizer, str(tmp_path / "skip"), on_error="skip")
  # The file with one bad line keeps its other 400 documents (the line is skipped as it is read, as are the record
  # without the field and the two Parquet files with a wrong column); the others are left out whole when their
  # records are counted.
  assert meta["train"]["documents"] == 50 + 400 and meta["train"]["skipped"] == 4
  assert meta["skipped"] == len(damaged)
  expected = dict(damaged)
  assert sorted(p.split(":")[0] for p in meta["problems"]) == sorted(expected)
  for problem in meta["problems"]:
    assert problem.startswith(expected[problem.split(":")[0]]), problem


@needs_shakespeare
def test_a_training_run_skips_a_damaged_file_by_default_and_says_so(tmp_path, small_tokenizer, capfd):
  damaged, message = damaged_files(tmp_path / "bad")[0]
  sources = f"--config.data.sources=('shakespeare:sonnets', '{damaged}')"
  result = run_train(tmp_path / "run", small_tokenizer, sources, "--config.train.steps=2")
  first = result.stdout.splitlines()[0]
  assert f"skipped 1 bad documents or damaged files, the first: {message}" in first, first
  stopped = train_in_process(capfd, tmp_path / "stop", small_tokenizer, sources, "--config.data.on_error=stop")
  assert_one_line_error(stopped, message)


def test_a_damaged_file_is_one_line_and_exit_2_from_evaluate(tmp_path, small_tokenizer):
  from tests.live_server import tiny_checkpoint

  checkpoint = tiny_checkpoint(str(tmp_path / "ckpt"), small_tokenizer)
  path, message = damaged_files(tmp_path / "bad")[0]
  result = subprocess.run(
    [sys.executable, "-m", "llama_jax.evaluate", "--checkpoint", checkpoint, "--data", path, "--seq_len", "16"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    timeout=300,
  )
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].startswith(f"error: {message}")


REMOTE_READ = """
import json, sys
from llama_jax.data import sources
refs = sources.resolve_sources(sys.argv[1:])
print(json.dumps([[r.doc_id, t] for r, t, _ in sources.iter_documents(refs)]))
"""


def test_gs_sources_read_as_local_ones_and_evaluate_reads_them(corpus, tmp_path, small_tokenizer):
  from tests.live_server import tiny_checkpoint

  checkpoint = tiny_checkpoint(str(tmp_path / "ckpt"), small_tokenizer)
  with gcs_emulator.running() as emulator:
    for fmt, path in corpus.items():
      folder = "deep/er" if fmt == formats.PARQUET else "top"
      emulator.fs.put_file(path, f"{emulator.bucket}/corpus/{folder}/{os.path.basename(path)}")
    env = {**os.environ, **emulator.env, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def run(*args):
      result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
      assert result.returncode == 0, result.stderr[-3000:]
      return result.stdout

    read = json.loads(run("-c", REMOTE_READ, emulator.uri("corpus", "**", "*.parquet"), emulator.uri("corpus", "top")))
    assert [t for _, t in read] == DOCS * 5  # the parquet file, then the four files of top/ in name order
    assert read[0][0] == emulator.uri("corpus", "deep", "er", "c.parquet") + ":1"
    metrics = {}
    for where, spec in (("local", corpus[formats.JSONL_ZST]), ("gs", emulator.uri("corpus", "top", "c.jsonl.zst"))):
      out = tmp_path / f"{where}.json"
      run(
        "-m",
        "llama_jax.evaluate",
        "--checkpoint",
        checkpoint,
        "--data",
        spec,
        "--seq_len",
        "32",
        "--batch_size",
        "4",
        "--max_batches",
        "3",
        "--json",
        str(out),
      )
      metrics[where] = json.loads(out.read_text())
  assert metrics["gs"] == metrics["local"]
