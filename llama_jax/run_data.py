"""The data of one training run: its tokenizer, its prepared splits, and the batches the loop reads, for pretraining
text (``data.format="text"``), conversations (``"chat"``) or preference pairs (``"preference"``), from the checked
``RunConfig``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
from etils import epath

from llama_jax import chat_data, distributed, preference_data
from llama_jax import checkpoint as checkpoint_lib
from llama_jax import data as data_lib
from llama_jax.config import RunConfig
from llama_jax.tokenizer import TOKENIZER_FILE, Tokenizer, train_tokenizer


@dataclasses.dataclass
class RunData:
  """What the loop needs from the data, for either format: train batches, validation examples, summary counts."""

  dataset: Any
  val_examples: Any
  summary: str


def load_tokenizer_for_run(run_config: RunConfig, workdir: str, texts: Callable[[], Iterator[str]]) -> Tokenizer:
  """The configured tokenizer, the workdir's (on resume), init_from's, or one trained on the training texts."""
  if run_config.data.tokenizer:
    return Tokenizer(run_config.data.tokenizer)
  for directory in (workdir, run_config.init_from):
    if directory and (epath.Path(directory) / TOKENIZER_FILE).is_file():
      return Tokenizer(checkpoint_lib.local_file(os.path.join(directory, TOKENIZER_FILE)))
  if jax.process_count() > 1:
    raise data_lib.DataError("multi-process runs need a prepared tokenizer: set data.tokenizer to a .model file")
  corpus_dir = checkpoint_lib.local_dir(workdir, "tokenizer")
  os.makedirs(corpus_dir, exist_ok=True)
  corpus = os.path.join(corpus_dir, "corpus.txt")
  has_text = False
  with open(corpus, "w", encoding="utf-8") as f:
    for text in texts():
      has_text = has_text or bool(text.strip())
      f.write(text + "\n")
  if not has_text:
    os.remove(corpus)
    raise data_lib.DataError(f"the training sources {list(run_config.data.sources)} contain no text")
  path = train_tokenizer([corpus], run_config.data.vocab_size, corpus_dir, overwrite=True)
  os.remove(corpus)
  return Tokenizer(path)


def prepare_run_data(run_config: RunConfig, workdir: str) -> tuple[Tokenizer, RunData]:
  """Tokenizer and prepared data of a run. Process 0 prepares first; the others then find its cache where the disk
  is shared, or prepare their own copy."""
  with distributed.main_process_first("data prepared by process 0"):
    if run_config.data.format == "chat":
      return _prepare_chat(run_config, workdir)
    if run_config.data.format == "preference":
      return _prepare_preference(run_config, workdir)
    return _prepare_text(run_config, workdir)


def _prepare_text(run_config: RunConfig, workdir: str) -> tuple[Tokenizer, RunData]:
  data_cfg, train_cfg = run_config.data, run_config.train
  prepared_dir = data_cfg.prepared_dir or checkpoint_lib.local_dir(workdir, "data")

  def texts():
    # Resolved only to train a tokenizer: missing sources are left to `prepare`, which names a damaged shard first.
    train_docs, _ = data_lib.split_documents(
      data_cfg.sources, data_cfg.val_sources, data_cfg.val_fraction, run_config.seed
    )
    return (data_lib.read_document(ref, data_cfg.text_field)[0] for ref in train_docs)

  tokenizer = load_tokenizer_for_run(run_config, workdir, texts)
  meta = data_lib.prepare(
    data_cfg.sources,
    data_cfg.val_sources,
    tokenizer,
    prepared_dir,
    val_fraction=data_cfg.val_fraction,
    seed=run_config.seed,
    text_field=data_cfg.text_field,
    verify=data_cfg.verify,
  )
  dataset = data_lib.train_dataset(
    prepared_dir, train_cfg.seq_len, train_cfg.batch_size, run_config.seed, jax.process_index(), jax.process_count()
  )
  summary = f"train {meta['train']['tokens']:,} tokens, val {meta['val']['tokens']:,} tokens"
  return tokenizer, RunData(dataset, data_lib.validation_windows(prepared_dir, train_cfg.seq_len), summary)


def _prepare_chat(run_config: RunConfig, workdir: str) -> tuple[Tokenizer, RunData]:
  data_cfg, train_cfg = run_config.data, run_config.train
  prepared_dir = data_cfg.prepared_dir or checkpoint_lib.local_dir(workdir, "data")

  def texts():
    for _, messages in chat_data.load_conversations(data_cfg.sources, "skip")[0]:
      yield from (m["content"] for m in messages)

  tokenizer = load_tokenizer_for_run(run_config, workdir, texts)
  meta = chat_data.prepare_sft(
    data_cfg.sources,
    tokenizer,
    prepared_dir,
    seq_len=train_cfg.seq_len,
    val_fraction=data_cfg.val_fraction,
    seed=run_config.seed,
    on_error=data_cfg.on_error,
    verify=data_cfg.verify,
  )
  dataset = chat_data.sft_train_dataset(
    prepared_dir, train_cfg.batch_size, run_config.seed, jax.process_index(), jax.process_count()
  )
  splits = (meta["train"], meta["val"])
  summary = (
    f"conversations: train {meta['train']['conversations']:,} ({meta['train']['rows']:,} packed rows), "
    f"val {meta['val']['conversations']:,}; skipped {meta['skipped']:,} bad, "
    f"{sum(s['dropped_exchanges'] for s in splits):,} old exchanges dropped and "
    f"{sum(s['truncated_prompts'] for s in splits):,} prompts cut to fit, "
    f"{sum(s['too_long'] for s in splits):,} too long"
  )
  return tokenizer, RunData(dataset, chat_data.PackedRows(prepared_dir, "val"), summary)


def _prepare_preference(run_config: RunConfig, workdir: str) -> tuple[Tokenizer, RunData]:
  data_cfg, train_cfg = run_config.data, run_config.train
  prepared_dir = data_cfg.prepared_dir or checkpoint_lib.local_dir(workdir, "data")

  def texts():
    for pair in preference_data.load_pairs(data_cfg.sources, "skip")[0]:
      yield from (m["content"] for m in pair.messages)
      yield from (pair.chosen, pair.rejected)

  tokenizer = load_tokenizer_for_run(run_config, workdir, texts)
  meta = preference_data.prepare_preference(
    data_cfg.sources,
    tokenizer,
    prepared_dir,
    seq_len=train_cfg.seq_len,
    val_fraction=data_cfg.val_fraction,
    seed=run_config.seed,
    on_error=data_cfg.on_error,
    verify=data_cfg.verify,
  )
  dataset = preference_data.preference_train_dataset(
    prepared_dir, train_cfg.batch_size, run_config.seed, jax.process_index(), jax.process_count()
  )
  summary = (
    f"preference pairs: train {meta['train']['pairs']:,}, val {meta['val']['pairs']:,} (one pair per row, "
    f"{meta['train']['fill']:.0%} of positions used); skipped {meta['skipped']:,} bad ({meta['too_long']:,} too long "
    f"for train.seq_len), {meta['train']['dropped_exchanges'] + meta['val']['dropped_exchanges']:,} old exchanges "
    f"dropped to fit"
  )
  return tokenizer, RunData(dataset, preference_data.PreferenceRows(prepared_dir, "val"), summary)
