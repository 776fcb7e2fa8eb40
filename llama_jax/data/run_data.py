"""The data of one training run: its tokenizer, its prepared splits, and the batches the loop reads, for pretraining
text (``data.format="text"``), conversations (``"chat"``) or preference pairs (``"preference"``), from the checked
``RunConfig``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

from llama_jax.core import distributed, paths
from llama_jax.core.run_config import RunConfig
from llama_jax.data import preference, sft, sources, streaming, text, token_shards
from llama_jax.data.prepared import PackedRows
from llama_jax.data.tokenization import Tokenizer, TokenizerBase, train_tokenizer
from llama_jax.data.tokenizer_files import load_tokenizer_dir, load_tokenizer_path


@dataclasses.dataclass
class RunData:
  """What the loop needs from the data, for either format: train batches, validation examples, summary counts."""

  dataset: Any
  val_examples: Any
  summary: str


def load_tokenizer_for_run(run_config: RunConfig, workdir: str, texts: Callable[[], Iterator[str]]) -> TokenizerBase:
  """The configured tokenizer, the workdir's (on resume), init_from's, or one trained on the training texts."""
  if run_config.data.tokenizer:
    return load_tokenizer_path(run_config.data.tokenizer)
  for directory in (workdir, run_config.init_from):
    tokenizer = load_tokenizer_dir(directory) if directory else None
    if tokenizer is not None:
      return tokenizer
  if jax.process_count() > 1:
    raise sources.DataError(
      "multi-process runs need a prepared tokenizer: set data.tokenizer to a .model file or a tokenizer directory"
    )
  corpus_dir = paths.local_dir(workdir, "tokenizer")
  os.makedirs(corpus_dir, exist_ok=True)
  corpus = os.path.join(corpus_dir, "corpus.txt")
  has_text = False
  with open(corpus, "w", encoding="utf-8") as f:
    for line in texts():
      has_text = has_text or bool(line.strip())
      f.write(line + "\n")
  if not has_text:
    os.remove(corpus)
    raise sources.DataError(f"the training sources {list(run_config.data.specs)} contain no text")
  path = train_tokenizer([corpus], run_config.data.vocab_size, corpus_dir, overwrite=True)
  os.remove(corpus)
  return Tokenizer(path)


def prepare_run_data(run_config: RunConfig, workdir: str) -> tuple[TokenizerBase, RunData]:
  """The tokenizer and the prepared data of a training run, for its data format.

  Process 0 prepares first; the others then find its cache where the disk is shared, or prepare their own copy. The
  tokenizer is ``data.tokenizer``, the workdir's on resume, init_from's, or one trained on the training texts.
  Shards from ``python -m llama_jax.prepare`` in the prepared directory are read as they are, with their own
  tokenizer unless one is named; a streamed corpus (``data.streaming``) is not prepared at all.

  Args:
    run_config: the checked run config: its data section says what to prepare, its train section the batches.
    workdir: the run's directory: the prepared data go under it unless ``data.prepared_dir`` names a place.

  Returns:
    A tuple: the tokenizer, and the `RunData` with the training batches, the validation examples and a summary line.

  Raises:
    DataError: the sources are missing, damaged or too small; a multi-process or streaming run names no tokenizer;
      or prepared shards come from other sources or another tokenizer.
  """
  data_cfg = run_config.data
  prepared_dir = data_cfg.prepared_dir or paths.local_dir(workdir, "data")
  if data_cfg.format == "text" and token_shards.is_shard_dir(prepared_dir):
    # Shards from `python -m llama_jax.prepare`: nothing to prepare; its tokenizer unless one is named.
    where = data_cfg.tokenizer or str(paths.path(prepared_dir, token_shards.TOKENIZER_DIR))
    tokenizer = load_tokenizer_path(where)
    return tokenizer, _shard_data(run_config, tokenizer, prepared_dir)
  texts, prepare = _FORMATS["streaming" if data_cfg.streaming else data_cfg.format]
  with distributed.main_process_first("data prepared by process 0"):
    tokenizer = load_tokenizer_for_run(run_config, workdir, lambda: texts(run_config))
    return tokenizer, prepare(run_config, tokenizer, prepared_dir)


# ---------------------------------------------------------------------------------------------------------------------
# Per format: the training texts a tokenizer would be trained on, and the prepared data. Each looks its library
# functions up when it runs (tests wrap them to observe a run).


def _document_texts(run_config: RunConfig) -> Iterator[str]:
  # Resolved only to train a tokenizer: missing sources are left to `prepare`, which names a damaged shard first.
  data_cfg = run_config.data
  train_docs, _ = sources.split_documents(data_cfg.specs, data_cfg.val_sources, data_cfg.val_fraction, run_config.seed)
  return (text for _, text, _ in sources.iter_documents(train_docs, data_cfg.text_field))


def _text_data(run_config: RunConfig, tokenizer: TokenizerBase, prepared_dir: str) -> RunData:
  data_cfg, train_cfg = run_config.data, run_config.train
  meta = text.prepare(
    data_cfg.specs,
    data_cfg.val_sources,
    tokenizer,
    prepared_dir,
    val_fraction=data_cfg.val_fraction,
    seed=run_config.seed,
    text_field=data_cfg.text_field,
    verify=data_cfg.verify,
    mixture=data_cfg.weights is not None,
    on_error=data_cfg.on_error,
  )
  dataset = text.train_dataset(
    prepared_dir,
    train_cfg.seq_len,
    train_cfg.batch_size,
    run_config.seed,
    jax.process_index(),
    jax.process_count(),
    data_cfg.weights,
  )
  summary = f"train {meta['train']['tokens']:,} tokens, val {meta['val']['tokens']:,} tokens"
  if data_cfg.weights is not None:
    shares = ", ".join(
      f"{c['source']} {meta[c['split']]['tokens']:,} tokens × {w:.3g}"
      for c, w in zip(meta["components"], data_cfg.weights)
    )
    summary += f" (mixture by windows: {shares})"
  if meta.get("skipped"):
    summary += f"; skipped {meta['skipped']:,} bad documents or damaged files, the first: {meta['problems'][0]}"
  return RunData(dataset, text.validation_windows(prepared_dir, train_cfg.seq_len), summary)


def _shard_data(run_config: RunConfig, tokenizer: TokenizerBase, prepared_dir: str) -> RunData:
  """Shards prepared by ``python -m llama_jax.prepare`` from this run's sources with this run's tokenizer (both
  checked: other ones are refused in one line), read as windows of the shards' token stream."""
  data_cfg, train_cfg = run_config.data, run_config.train
  index = token_shards.read_index(prepared_dir)
  rerun = f"run python -m llama_jax.prepare with this config and --out {prepared_dir}"
  if index["tokenizer_sha256"] != token_shards.tokenizer_digest(tokenizer):
    raise sources.DataError(
      f"{prepared_dir} was prepared with another tokenizer (vocabulary {index['vocab_size']:,}; this run's "
      f"{tokenizer.vocab_size:,}, {tokenizer.path}): {rerun}, or unset data.tokenizer to use its own"
    )
  prepared_from = index["sources"]
  names, components = token_shards.components(data_cfg)
  wanted = dict(components=components, val_sources=list(data_cfg.val_sources))
  if {k: prepared_from[k] for k in wanted} != wanted:
    raise sources.DataError(
      f"{prepared_dir} was prepared from data.sources {prepared_from['components']} and data.val_sources "
      f"{prepared_from['val_sources']}; this run names {components} and {list(data_cfg.val_sources)}: {rerun}"
    )
  windows = [
    (spec, token_shards.split_windows(prepared_dir, index, name, train_cfg.seq_len, data_cfg.verify))
    for spec, name in zip(data_cfg.specs if data_cfg.weights is not None else ["the training split"], names)
  ]
  dataset = text.window_batches(
    windows, train_cfg.batch_size, run_config.seed, jax.process_index(), jax.process_count(), data_cfg.weights
  )
  val = token_shards.split_windows(prepared_dir, index, "val", train_cfg.seq_len, data_cfg.verify)
  if train_cfg.eval_every and len(val) == 0:
    raise sources.DataError(
      f"{prepared_dir} holds {val.tokens:,} validation tokens, less than one window of {train_cfg.seq_len}+1: "
      f"prepare it with data.val_sources or a larger data.val_fraction, or set train.eval_every=0"
    )
  summary = (
    f"prepared shards {prepared_dir}: train {sum(w.tokens for _, w in windows):,} tokens in "
    f"{sum(index['splits'][n]['shards'] for n in names):,} shards, val {val.tokens:,} tokens"
  )
  if data_cfg.weights is not None:
    summary += (
      " (mixture by windows: "
      + ", ".join(f"{spec} {w.tokens:,} tokens × {weight:.3g}" for (spec, w), weight in zip(windows, data_cfg.weights))
      + ")"
    )
  return RunData(dataset, val, summary)


def _no_texts(run_config: RunConfig) -> Iterator[str]:
  raise sources.DataError(
    f"data.streaming needs a tokenizer (training one would read the whole corpus first): set data.tokenizer to a "
    f".model file, a tokenizer.json or a tokenizer directory; data.sources {list(run_config.data.specs)}"
  )


def _streamed_data(run_config: RunConfig, tokenizer: TokenizerBase, prepared_dir: str) -> RunData:
  """A streamed corpus (data.streaming): nothing prepared; validation files tokenized once, as far as evaluation
  reads them."""
  del prepared_dir
  data_cfg, train_cfg = run_config.data, run_config.train
  val_set, val_files = streaming.split_files(
    data_cfg.specs, data_cfg.val_sources, data_cfg.val_fraction, run_config.seed
  )
  _, groups = token_shards.components(data_cfg)
  files = streaming.component_files(groups, val_set)
  dataset = streaming.StreamingDataset(
    files,
    tokenizer,
    seq_len=train_cfg.seq_len,
    global_batch=train_cfg.batch_size,
    seed=run_config.seed,
    text_field=data_cfg.text_field,
    weights=data_cfg.weights,
    workers=data_cfg.workers,
    shuffle_window=data_cfg.shuffle_window,
    document_mask=data_cfg.document_mask,
    on_error=data_cfg.on_error,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
  )
  windows = train_cfg.eval_batches * train_cfg.batch_size if train_cfg.eval_every else 1
  val = streaming.validation_windows(
    val_files, tokenizer, train_cfg.seq_len, windows, data_cfg.text_field, data_cfg.on_error
  )
  summary = (
    f"streaming {sum(map(len, files)):,} files with {data_cfg.workers} workers per process "
    f"(shuffle window {data_cfg.shuffle_window:,}), validation {len(val_files):,} files ({len(val):,} windows read)"
  )
  if data_cfg.weights is not None:
    summary += (
      " (mixture by windows: "
      + ", ".join(f"{spec} {len(f):,} files × {w:.3g}" for spec, f, w in zip(data_cfg.specs, files, data_cfg.weights))
      + ")"
    )
  return RunData(dataset, val, summary)


def _conversation_texts(run_config: RunConfig) -> Iterator[str]:
  for _, messages in sft.load_conversations(run_config.data.specs, "skip")[0]:
    yield from (m["content"] for m in messages)


def _pair_texts(run_config: RunConfig) -> Iterator[str]:
  for pair in preference.load_pairs(run_config.data.specs, "skip")[0]:
    yield from (m["content"] for m in pair.messages)
    yield from (pair.chosen, pair.rejected)


def _row_data(run_config: RunConfig, tokenizer: TokenizerBase, prepared_dir: str) -> RunData:
  """Chat (SFT) or preference rows: prepared the same way, batched the same way, summarised each its own way."""
  data_cfg, train_cfg, is_chat = run_config.data, run_config.train, run_config.data.format == "chat"
  prepare, dataset_of = (
    (sft.prepare_sft, sft.sft_train_dataset)
    if is_chat
    else (preference.prepare_preference, preference.preference_train_dataset)
  )
  meta = prepare(
    data_cfg.specs,
    tokenizer,
    prepared_dir,
    seq_len=train_cfg.seq_len,
    val_fraction=data_cfg.val_fraction,
    seed=run_config.seed,
    on_error=data_cfg.on_error,
    verify=data_cfg.verify,
  )
  dataset = dataset_of(prepared_dir, train_cfg.batch_size, run_config.seed, jax.process_index(), jax.process_count())
  splits = (meta["train"], meta["val"])
  if is_chat:
    summary = (
      f"conversations: train {meta['train']['conversations']:,} ({meta['train']['rows']:,} packed rows), "
      f"val {meta['val']['conversations']:,}; skipped {meta['skipped']:,} bad, "
      f"{sum(s['dropped_exchanges'] for s in splits):,} old exchanges dropped and "
      f"{sum(s['truncated_prompts'] for s in splits):,} prompts cut to fit, "
      f"{sum(s['too_long'] for s in splits):,} too long"
    )
  else:
    summary = (
      f"preference pairs: train {meta['train']['pairs']:,}, val {meta['val']['pairs']:,} (one pair per row, "
      f"{meta['train']['fill']:.0%} of positions used); skipped {meta['skipped']:,} bad ({meta['too_long']:,} too long "
      f"for train.seq_len), {sum(s['dropped_exchanges'] for s in splits):,} old exchanges dropped to fit"
    )
  keys = sft.SFT_KEYS if is_chat else preference.PREFERENCE_KEYS
  return RunData(dataset, PackedRows(prepared_dir, "val", keys), summary)


_FORMATS = {
  "text": (_document_texts, _text_data),
  "chat": (_conversation_texts, _row_data),
  "preference": (_pair_texts, _row_data),
  "streaming": (_no_texts, _streamed_data),
}
