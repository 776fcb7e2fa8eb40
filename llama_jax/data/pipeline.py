"""The Apache Beam job of ``python -m llama_jax.prepare``: a corpus read, tokenized and written as ArrayRecord shards of
tokenized documents (token_shards.py), one input file per unit of work, on any Beam runner: DirectRunner's worker
processes on one machine (``--direct_num_workers N --direct_running_mode multi_processing``), Dataflow, Flink or Spark
for a corpus of terabytes.

The driver lists the sources' files (never opening them) and plans one unit per file: its training split (``train``,
or ``train-NN`` for source NN of a mixture) or ``val`` for a file of ``data.val_sources``; with ``data.val_fraction``
instead, the documents of each training file held out by the seeded hash of their ids go to a ``val`` shard of the
same unit. A unit's key is a digest of what decides its output (the file's path, size and modification time, the
split, the text field, the validation settings, the tokenizer), and names its files. A worker tokenizes its file a
group of 256 documents at a time on one thread (the workers are the parallelism), writes its shards, then its record
``unit-<key>.json``. A rerun skips every unit whose record is there and whose shards have the recorded sizes: after a
kill, only the missing units are prepared. The driver then writes ``index.json`` from the records, in unit order, so the
index is the same whatever order the workers finished in.

Bad input: a bad record (not JSON, no text field) or a damaged file is skipped and counted with ``data.on_error="skip"``
(the default; a damaged file keeps the documents before the damage); with ``"stop"`` the unit writes no shard, the
other units finish (a rerun reuses them), and the job ends with the first problem, naming the file and line (exit 2).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any

from llama_jax.core import paths
from llama_jax.core.run_config import RunConfig
from llama_jax.data import token_shards
from llama_jax.data.formats import TEXT, DataError, file_format, iter_records
from llama_jax.data.sources import document_id, file_identity, held_out, list_files
from llama_jax.data.tokenization import TokenizerBase
from llama_jax.data.tokenizer_files import load_tokenizer_dir


def _not_the_bigquery_warning(record: logging.LogRecord) -> bool:
  return "apitools not found" not in str(record.msg)


# Importing Beam warns through the root logger that BigQuery's client is missing (nothing here uses BigQuery), on
# every run, on stderr, where a failed command's one-line error goes: that one record is dropped.
logging.getLogger().addFilter(_not_the_bigquery_warning)
import apache_beam as beam  # noqa: E402 -- after the filter above
from apache_beam.options.pipeline_options import PipelineOptions  # noqa: E402

_log = logging.getLogger(__name__)
_GROUP = 256  # documents per encode_batch call, as the other preparations
_PROBLEMS_KEPT = 20
_OWN_FILE = re.compile(r"^(?:unit|train|train-\d+|val)-(?P<key>[0-9a-f]{20})\.(?:json|array_record|ends\.npy)$")


@dataclasses.dataclass(frozen=True)
class Unit:
  """One input file's work: its documents into shard `split` (those `held_out` by `val_fraction` into ``val``)."""

  path: str
  split: str
  key: str
  val_fraction: float


@dataclasses.dataclass(frozen=True)
class Settings:
  """What every worker needs: where to write, how to read and split the documents, the ids' dtype, the policy."""

  out_dir: str
  text_field: str
  seed: int
  dtype: str
  on_error: str


def plan_units(run_config: RunConfig, digest: str) -> list[Unit]:
  """The units of a preparation, in index order: each training file of each component, then the validation files."""
  data_cfg = run_config.data
  val_files = list_files(data_cfg.val_sources) if data_cfg.val_sources else []
  fraction = 0.0 if data_cfg.val_sources else data_cfg.val_fraction
  planned: list[tuple[str, str, float]] = []
  for split, specs in zip(*token_shards.components(data_cfg)):
    files = [f for f in list_files(specs) if f not in set(val_files)]
    if not files:
      raise DataError(f"the training sources {specs} hold no files outside data.val_sources")
    planned += [(path, split, fraction) for path in files]
  planned += [(path, "val", 0.0) for path in val_files]
  identity = [token_shards.VERSION, data_cfg.text_field, run_config.seed, digest]
  return [
    Unit(
      path, split, hashlib.sha256(json.dumps([*identity, file_identity(path), split, f]).encode()).hexdigest()[:20], f
    )
    for path, split, f in planned
  ]


def _record_path(settings: Settings, unit: Unit) -> str:
  return str(paths.path(settings.out_dir, f"unit-{unit.key}.json"))


def finished_record(settings: Settings, unit: Unit) -> dict[str, Any] | None:
  """The record of a unit already prepared whose shards are all there with their recorded sizes, else None."""
  path = paths.path(_record_path(settings, unit))
  if not path.is_file():
    return None
  try:
    record = json.loads(path.read_text())
  except (OSError, json.JSONDecodeError):
    return None
  if record.get("problem") or any(
    token_shards.check_shard(settings.out_dir, s, False) for s in record["shards"].values()
  ):
    return None
  return record


class TokenizeFile(beam.DoFn):
  """A unit's file read, tokenized and written as shards, then its record; a unit already done is passed over."""

  def __init__(self, settings: Settings):
    self.settings = settings
    self.tokenizer: TokenizerBase | None = None

  def setup(self) -> None:
    self.tokenizer = load_tokenizer_dir(str(paths.path(self.settings.out_dir, token_shards.TOKENIZER_DIR)))

  def process(self, unit: Unit) -> Iterator[str]:
    # Checked again here, not only by the driver: a runner retries a failed bundle whole, units already done included.
    if finished_record(self.settings, unit) is not None:
      yield unit.key
      return
    record = tokenize_unit(unit, self.tokenizer, self.settings)
    paths.write_atomically(paths.path(_record_path(self.settings, unit)), json.dumps(record))
    yield unit.key


def _documents(
  unit: Unit, settings: Settings, counts: dict[str, int], problems: list[str]
) -> Iterator[tuple[str, str]]:
  """(split, text) of each non-empty document of the unit's file; bad records and damage into `problems`."""
  text_file = file_format(unit.path) == TEXT
  try:
    for number, text, replaced in iter_records(unit.path, settings.text_field):
      if isinstance(text, DataError):
        problems.append(str(text))
        if settings.on_error == "stop":
          return
        continue
      counts["replaced_bytes"] += replaced
      if not text.strip():
        counts["empty_documents"] += 1
        continue
      doc_id = document_id(unit.path, None if text_file else number)
      yield ("val" if unit.val_fraction and held_out(doc_id, unit.val_fraction, settings.seed) else unit.split), text
  except DataError as e:
    problems.append(str(e))


def tokenize_unit(unit: Unit, tokenizer: TokenizerBase, settings: Settings) -> dict[str, Any]:
  """Tokenizes a unit's file into its shards; returns its record (shards by split, counts, problems)."""
  counts = dict(documents=0, tokens=0, bytes=0, replaced_bytes=0, empty_documents=0)
  problems: list[str] = []
  writers: dict[str, token_shards.ShardWriter] = {}

  def flush(group: list[tuple[str, str]]) -> None:
    for (split, text), ids in zip(group, tokenizer.encode_batch([text for _, text in group], threads=1)):
      if split not in writers:
        target = str(paths.path(settings.out_dir, f"{split}-{unit.key}.array_record"))
        writers[split] = token_shards.ShardWriter(target, settings.dtype)
      document = tokenizer.document_ids(ids)
      writers[split].add(document)
      counts["documents"] += 1
      counts["tokens"] += len(document)
      counts["bytes"] += len(text.encode("utf-8"))
    group.clear()

  group: list[tuple[str, str]] = []
  for document in _documents(unit, settings, counts, problems):
    group.append(document)
    if len(group) >= _GROUP:
      flush(group)
  if problems and settings.on_error == "stop":
    for writer in writers.values():
      writer.abort()
    return dict(path=unit.path, shards={}, counts=counts, problem=problems[0])
  flush(group)
  shards = {split: writer.close() for split, writer in writers.items()}
  return dict(path=unit.path, shards={k: v for k, v in shards.items() if v}, counts=counts, problems=problems)


def prepare(
  run_config: RunConfig, out_dir: str, tokenizer: TokenizerBase, pipeline_args: Sequence[str] = ()
) -> tuple[dict[str, Any], int]:
  """Prepares the run config's sources into `out_dir` with a Beam pipeline of `pipeline_args` (runner options);
  returns (index.json's contents, units prepared now: 0 when everything was already there)."""
  data_cfg = run_config.data
  digest = token_shards.tokenizer_digest(tokenizer)
  units = plan_units(run_config, digest)
  tokenizer_dir = paths.path(out_dir, token_shards.TOKENIZER_DIR)
  tokenizer_dir.mkdir(parents=True, exist_ok=True)
  for name, content in tokenizer.files().items():
    paths.write_atomically(tokenizer_dir / name, content)
  settings = Settings(
    str(out_dir),
    data_cfg.text_field,
    run_config.seed,
    token_shards.token_dtype(tokenizer.vocab_size),
    data_cfg.on_error,
  )
  # One small read per unit; a remote read waits on the store's latency rather than on this machine: 32 at a time.
  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    todo = [u for u, done in zip(units, pool.map(lambda u: finished_record(settings, u), units)) if done is None]
  if todo:
    _log.info("preparing %d of %d files (the others are done)", len(todo), len(units))
    args = list(pipeline_args)
    if not any(a.startswith("--default_sdk_harness_log_level") for a in args):
      args.append("--default_sdk_harness_log_level=ERROR")  # each worker logs a dozen lines at INFO, a few WARNINGs
    with beam.Pipeline(options=PipelineOptions(args)) as pipeline:
      _ = pipeline | beam.Create(todo) | beam.Reshuffle() | beam.ParDo(TokenizeFile(settings))
  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    records = list(pool.map(lambda u: json.loads(paths.path(_record_path(settings, u)).read_text()), units))
  stopped = next((r["problem"] for r in records if r.get("problem")), None)
  if stopped is not None:
    raise DataError(f"{stopped} (data.on_error='stop'; the files prepared so far are kept for the rerun)")
  index = _index(run_config, tokenizer, digest, units, records)
  paths.write_atomically(paths.path(out_dir, token_shards.INDEX), token_shards.dump_index(index))
  _remove_stale(out_dir, units)
  return index, len(todo)


def _index(
  run_config: RunConfig, tokenizer: TokenizerBase, digest: str, units: Sequence[Unit], records: Sequence[dict]
) -> dict[str, Any]:
  data_cfg = run_config.data
  names, specs = token_shards.components(data_cfg)
  shards: dict[str, list[dict[str, Any]]] = {split: [] for split in [*names, "val"]}
  for record in records:
    for split, shard in record["shards"].items():
      shards[split].append(shard)
  totals = {key: sum(r["counts"][key] for r in records) for key in records[0]["counts"]}
  problems = [p for r in records for p in r["problems"]]
  for split, component in zip(names, specs):
    if not shards[split]:
      raise DataError(f"the training sources {component} contain no text")
  index = dict(
    format=token_shards.FORMAT,
    version=token_shards.VERSION,
    dtype=token_shards.token_dtype(tokenizer.vocab_size),
    vocab_size=tokenizer.vocab_size,
    bos_id=tokenizer.bos_id,
    eos_id=tokenizer.eos_id,
    tokenizer_sha256=digest,
    sources=dict(
      components=specs,
      val_sources=list(data_cfg.val_sources),
      val_fraction=0.0 if data_cfg.val_sources else data_cfg.val_fraction,
      seed=run_config.seed,
      text_field=data_cfg.text_field,
    ),
    files=len(units),
    splits={
      split: dict(shards=len(s), documents=sum(x["documents"] for x in s), tokens=sum(x["tokens"] for x in s))
      for split, s in shards.items()
    },
    totals=totals,
    skipped=len(problems),
    problems=problems[:_PROBLEMS_KEPT],
    shards=shards,
  )
  if problems:
    _log.warning(
      "skipped %d bad documents or damaged files (data.on_error='skip'); the first: %s", len(problems), problems[0]
    )
  return index


def _remove_stale(out_dir: str, units: Sequence[Unit]) -> None:
  """Removes this tool's files of units no longer planned (an earlier preparation of other inputs or settings)."""
  keys = {unit.key for unit in units}
  for child in paths.path(out_dir).iterdir():
    match = _OWN_FILE.match(child.name)
    if match and match.group("key") not in keys:
      child.unlink()
