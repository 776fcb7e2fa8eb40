"""Conversations for supervised fine-tuning: sources, checks, the chat template, packing with segment ids.

Sources (``data.sources`` with ``data.format="chat"``), each one of:
  - JSONL files (``*.jsonl``, also inside directories or globs): ``{"messages": [{"role": ..., "content": ...}]}``;
  - ``chitchat`` (the chitchat-dataset package) and ``chatterbot[:english,chinese]`` (the chatterbot-corpus package).

``prepare_sft`` encodes each conversation with the tokenizer's chat template, LLaMA 2's when the checkpoint has none
(``chat_template.encode_dialog``: loss mask on assistant tokens), packs them into rows of ``seq_len`` with a segment id
and positions per conversation, and caches the rows as ``.npy`` files keyed by a fingerprint of the conversations, the
tokenizer and the settings (the shared cache of prepared.py). A bad conversation is reported with its file and line,
skipped or fatal by ``data.on_error``."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from llama_jax.data import chat_template
from llama_jax.data.batches import train_batches
from llama_jax.data.prepared import PackedRows, cannot_prepare, prepare_rows
from llama_jax.data.sources import DataError, collect, jsonl_paths, jsonl_records, package_dir

CHITCHAT = "chitchat"
CHATTERBOT = "chatterbot"
SFT_KEYS = ("inputs", "targets", "weights", "segment_ids", "positions")


def _install_hint(module: str, install: str) -> str:
  return f"the {module} package is not installed; install it with `pip install {install}` (or the `demo` extra)"


def _chitchat_conversations() -> Iterator[tuple[str, Any]]:
  """chitchat-dataset: each conversation is a list of runs of one speaker; runs alternate user → assistant (the
  messages of a run joined by spaces, as the package itself does). A trailing user run has no answer and is
  dropped, so a one-speaker conversation has no messages and is skipped."""
  path = os.path.join(
    package_dir("chitchat_dataset", _install_hint("chitchat_dataset", "chitchat-dataset")), "dataset.json"
  )
  with open(path, encoding="utf-8") as f:
    conversations = json.load(f)
  for conv_id, conv in conversations.items():
    runs = [" ".join(m["text"] for m in run) for run in conv["messages"]]
    if len(runs) % 2:
      runs = runs[:-1]
    yield (
      f"{CHITCHAT}:{conv_id}",
      [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(runs)],
    )


def _chatterbot_conversations(spec: str) -> Iterator[tuple[str, Any]]:
  """chatterbot-corpus YAML files: each conversation a list of lines alternating user → assistant."""
  import yaml  # the demo extra's: only chatterbot sources read YAML

  root = os.path.join(package_dir("chatterbot_corpus", _install_hint("chatterbot_corpus", "chatterbot-corpus")), "data")
  languages = spec.split(":", 1)[1].split(",") if ":" in spec else ["english", "chinese"]
  for language in languages:
    files = sorted(glob.glob(os.path.join(root, language, "*.yml")))
    if not files:
      raise DataError(f"no chatterbot-corpus files for language {language!r} under {root}")
    for path in files:
      with open(path, encoding="utf-8") as f:
        corpus = yaml.safe_load(f) or {}
      for i, lines in enumerate(corpus.get("conversations") or []):
        lines = [str(line) for line in lines][: len(lines) - len(lines) % 2]
        yield (
          f"{path}:conversation {i}",
          [{"role": "user" if j % 2 == 0 else "assistant", "content": text} for j, text in enumerate(lines)],
        )


def _messages_of(record: Any) -> Any:
  """A JSONL record's messages, or the DataError saying why there are none (as `collect` takes it)."""
  if isinstance(record, Exception):
    return record
  if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
    return DataError('expected an object {"messages": [...]}')
  return record["messages"]


def iter_conversations(specs: Sequence[str]) -> Iterator[tuple[str, Any]]:
  """(location, messages or the DataError that reading them raised) for every conversation of the sources:
  ``*.jsonl`` files (also inside directories / globs), ``chitchat``, ``chatterbot[:english,chinese]``."""
  for spec in specs:
    if spec == CHITCHAT:
      yield from _chitchat_conversations()
    elif spec == CHATTERBOT or spec.startswith(CHATTERBOT + ":"):
      yield from _chatterbot_conversations(spec)
    else:
      for path in jsonl_paths(spec):
        for location, record in jsonl_records(path):
          yield location, _messages_of(record)


def _checked(messages: Any) -> Any:
  chat_template.check_conversation(messages)
  return messages


def load_conversations(specs: Sequence[str], on_error: str = "skip") -> tuple[list[tuple[str, list]], list[str]]:
  """Valid conversations and, for `on_error="skip"`, the problems skipped ("file:line: what"); with "stop", the
  first problem raises DataError naming its file and line."""
  return collect(iter_conversations(specs), _checked, on_error)


def pack_conversations(encoded: Sequence, seq_len: int) -> dict[str, np.ndarray]:
  """Packs conversations into rows of `seq_len` positions, in order, starting a new row when the next one does not
  fit. Each conversation predicts its own next tokens (weights = its loss mask), has its own segment id (1, 2, ...
  within the row) and positions from 0, so attention never crosses conversations; padding has segment id 0."""
  rows: list[list] = []
  used = seq_len  # forces a first row
  for conv in encoded:
    n = len(conv.tokens) - 1
    if n < 1:
      continue
    if used + n > seq_len:
      rows.append([])
      used = 0
    rows[-1].append(conv)
    used += n
  arrays = {k: np.zeros((len(rows), seq_len), np.float32 if k == "weights" else np.int32) for k in SFT_KEYS}
  for r, row in enumerate(rows):
    start = 0
    for segment, conv in enumerate(row, start=1):
      tokens, mask = np.asarray(conv.tokens), np.asarray(conv.loss_mask)
      n = len(tokens) - 1
      span = slice(start, start + n)
      arrays["inputs"][r, span] = tokens[:-1]
      arrays["targets"][r, span] = tokens[1:]
      arrays["weights"][r, span] = mask[1:]
      arrays["segment_ids"][r, span] = segment
      arrays["positions"][r, span] = np.arange(n)
      start += n
  return arrays


def prepare_sft(
  sources: Sequence[str],
  tokenizer,
  out_dir: str,
  *,
  seq_len: int,
  val_fraction: float,
  seed: int,
  on_error: str = "skip",
  verify: bool = False,
) -> dict[str, Any]:
  """Encodes conversations with the tokenizer's chat template, LLaMA 2's by default, and packs them into rows.

  Each conversation gets a loss mask on its assistant tokens, its own segment id and positions from 0 within its
  row. The rows are cached as .npy files in the prepared-data cache of prepared.py: each file's size and sha256 in
  meta.json, token ids checked against the vocabulary, reused while the conversations, the tokenizer and the
  settings are unchanged.

  Split by conversation: a seeded `val_fraction` of them is held out. Conversations longer than seq_len + 1 tokens
  lose their oldest exchanges, then the left of the last prompt (see chat_template.encode_dialog); counted in
  meta.json, as are those whose last assistant turn alone does not fit, which are left out.

  Args:
    sources: the chat source specs: JSONL files of {"messages": [...]} (also inside directories or globs),
      ``chitchat`` and ``chatterbot[:english,chinese]``.
    tokenizer: the tokenizer that encodes the conversations, with its chat template, if any.
    out_dir: the directory of the rows and meta.json.
    seq_len: the positions of a row.
    val_fraction: the share of conversations held out for validation.
    seed: the seed of that split.
    on_error: "skip" to leave out a bad conversation and count it, "stop" to raise on the first.
    verify: check the sha256 of rows about to be reused.

  Returns:
    The contents of meta.json.

  Raises:
    DataError: a source is missing or, with "stop", holds a bad conversation, named by file and line; a checkpoint's
      chat template refuses a conversation; or no usable conversation is left.
  """
  try:
    conversations, problems = load_conversations(sources, on_error)
  except DataError as e:
    raise cannot_prepare(out_dir, e, verify) from e

  def lay_out(split: list[tuple[str, list]]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    encoded, too_long = [], 0
    for where, messages in split:
      try:
        encoded.append(chat_template.encode_dialog(tokenizer, messages, max_len=seq_len + 1))
      except chat_template.ConversationTooLong:
        too_long += 1  # the last assistant turn alone does not fit
      except chat_template.ConversationError as e:  # the checkpoint's chat template refuses it
        raise DataError(f"{where}: {e}") from None
    arrays = pack_conversations(encoded, seq_len)
    counts = dict(
      conversations=len(encoded),
      rows=len(arrays["inputs"]),
      assistant_tokens=int(arrays["weights"].sum()),
      dropped_exchanges=sum(c.dropped_exchanges for c in encoded),
      truncated_prompts=sum(c.truncated for c in encoded),
      too_long=too_long,
    )
    return arrays, counts

  return prepare_rows(
    out_dir,
    kind="sft",
    items=conversations,
    identity=conversations,
    problems=problems,
    tokenizer=tokenizer,
    seq_len=seq_len,
    val_fraction=val_fraction,
    seed=seed,
    verify=verify,
    lay_out=lay_out,
    token_keys=("inputs", "targets"),
    what="conversations",
    sources=sources,
  )


def sft_train_dataset(
  prepared_dir: str, global_batch: int, seed: int, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
  rows = PackedRows(prepared_dir, "train", SFT_KEYS)
  return train_batches(rows, global_batch, seed, process_index, process_count, "conversations", "packed rows")
