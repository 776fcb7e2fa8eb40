"""Conversations for supervised fine-tuning: sources, checks, the chat template, packing with segment ids.

Sources (``data.sources`` with ``data.format="chat"``), each one of:
  - JSONL files (``*.jsonl``, also inside directories or globs): ``{"messages": [{"role": ..., "content": ...}]}``;
  - ``chitchat`` (the chitchat-dataset package) and ``chatterbot[:english,chinese]`` (the chatterbot-corpus package).

``prepare_sft`` encodes each conversation with the LLaMA 2 chat template (``chat.encode_dialog``: loss mask on
assistant tokens), packs them into rows of ``seq_len`` with a segment id and positions per conversation, and caches the
rows as ``.npy`` files keyed by a fingerprint of the conversations, the tokenizer and the settings (like
``data.prepare``). A bad conversation is reported with its file and line, skipped or fatal by ``data.on_error``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from llama_jax import chat
from llama_jax.data import (
  FORMAT_VERSION,
  DataError,
  cannot_prepare,
  file_record,
  prepared_meta,
  process_batches,
  read_meta,
  resolve_sources,
  size_problem,
  validation_ids,
  write_meta,
)

CHITCHAT = "chitchat"
CHATTERBOT = "chatterbot"
SFT_KEYS = ("inputs", "targets", "weights", "segment_ids", "positions")


def _package_dir(module: str, install: str) -> str:
  import importlib.util

  spec = importlib.util.find_spec(module)
  if spec is None:
    raise DataError(
      f"the {module} package is not installed; install it with `pip install {install}` (or the `demo` extra)"
    )
  return list(spec.submodule_search_locations)[0]


def _chitchat_conversations() -> Iterator[tuple[str, Any]]:
  """chitchat-dataset: each conversation is a list of runs of one speaker; runs alternate user → assistant (the
  messages of a run joined by spaces, as the package itself does). A trailing user run has no answer and is
  dropped, so a one-speaker conversation has no messages and is skipped."""
  path = os.path.join(_package_dir("chitchat_dataset", "chitchat-dataset"), "dataset.json")
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
  import yaml

  root = os.path.join(_package_dir("chatterbot_corpus", "chatterbot-corpus"), "data")
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


def _jsonl_conversations(path: str) -> Iterator[tuple[str, Any]]:
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      location = f"{path}:{number}"
      try:
        record = json.loads(raw)
      except json.JSONDecodeError as e:
        yield location, DataError(f"malformed JSON ({e.msg})")
        continue
      if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        yield location, DataError('expected an object {"messages": [...]}')
        continue
      yield location, record["messages"]


def iter_conversations(specs: Sequence[str]) -> Iterator[tuple[str, Any]]:
  """(location, messages or the DataError that reading them raised) for every conversation of the sources:
  ``*.jsonl`` files (also inside directories / globs), ``chitchat``, ``chatterbot[:english,chinese]``."""
  for spec in specs:
    if spec == CHITCHAT:
      yield from _chitchat_conversations()
    elif spec == CHATTERBOT or spec.startswith(CHATTERBOT + ":"):
      yield from _chatterbot_conversations(spec)
    else:
      paths = sorted({ref.path for ref in resolve_sources([spec])})
      for path in paths:
        yield from _jsonl_conversations(path)


def load_conversations(specs: Sequence[str], on_error: str = "skip") -> tuple[list[tuple[str, list]], list[str]]:
  """Valid conversations and, for `on_error="skip"`, the problems skipped ("file:line: what"); with "stop", the
  first problem raises DataError naming its file and line."""
  good, problems = [], []
  for location, messages in iter_conversations(specs):
    try:
      if isinstance(messages, Exception):
        raise messages
      chat.check_conversation(messages)
    except (DataError, chat.ConversationError) as e:
      if on_error == "stop":
        raise DataError(f"{location}: {e}") from e
      problems.append(f"{location}: {e}")
      continue
    good.append((location, messages))
  return good, problems


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
  """Encodes conversations with the LLaMA 2 chat template and packs them into rows (cached and checked like
  `prepare`: each .npy file's size and sha256 are in meta.json, token ids are checked against the vocabulary).

  Split by conversation: a seeded `val_fraction` of them is held out. Conversations longer than seq_len + 1 tokens
  lose their oldest exchanges, then the left of the last prompt (see chat.encode_dialog); counted in meta.json.
  """
  try:
    conversations, problems = load_conversations(sources, on_error)
  except DataError as e:
    raise cannot_prepare(out_dir, e, verify) from e
  if not conversations:
    raise DataError(
      f"no usable conversations in {list(sources)}"
      + (f" ({len(problems)} skipped; first: {problems[0]})" if problems else "")
    )
  digest = hashlib.sha256(
    json.dumps([FORMAT_VERSION, "sft", seq_len, val_fraction, seed, conversations], sort_keys=True).encode()
  )
  digest.update(hashlib.sha256(tokenizer.serialized()).digest())
  fingerprint = digest.hexdigest()
  cached = prepared_meta(out_dir, fingerprint, verify)
  if cached is not None:
    return cached
  os.makedirs(out_dir, exist_ok=True)
  meta = dict(
    format=FORMAT_VERSION,
    kind="sft",
    fingerprint=fingerprint,
    seq_len=seq_len,
    vocab_size=tokenizer.vocab_size,
    skipped=len(problems),
    skipped_examples=problems[:5],
    files={},
  )
  held_out = validation_ids([loc for loc, _ in conversations], val_fraction, seed)
  for split in ("train", "val"):
    chosen = [(loc, m) for loc, m in conversations if (loc in held_out) == (split == "val")]
    encoded, too_long = [], 0
    for _, messages in chosen:
      try:
        encoded.append(chat.encode_dialog(tokenizer, messages, max_len=seq_len + 1))
      except chat.ConversationError:
        too_long += 1  # the last assistant turn alone does not fit
    arrays = pack_conversations(encoded, seq_len)
    for key, array in arrays.items():
      path = os.path.join(out_dir, f"{split}_{key}.npy")
      np.save(path, array)
      meta["files"][os.path.basename(path)] = file_record(path, token_ids=key in ("inputs", "targets"))
    meta[split] = dict(
      conversations=len(encoded),
      rows=len(arrays["inputs"]),
      assistant_tokens=int(arrays["weights"].sum()),
      dropped_exchanges=sum(c.dropped_exchanges for c in encoded),
      truncated_prompts=sum(c.truncated for c in encoded),
      too_long=too_long,
    )
  write_meta(out_dir, meta)
  return meta


class PackedRows:
  """Random access to the packed conversation rows of a split (memory-mapped; preference pairs use it with their own
  `keys`), each file size-checked against meta.json first: a .npy file cut short is a DataError naming it, not
  numpy's mmap error."""

  def __init__(self, prepared_dir: str, split: str, keys: Sequence[str] = SFT_KEYS):
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


def train_batches(
  rows: PackedRows, global_batch: int, seed: int, process_index: int, process_count: int, what: str, unit: str
) -> grain.MapDataset:
  """Endless shuffled batches of prepared rows (SFT conversations or preference pairs), refused in one line when the
  training split cannot fill one batch."""
  if len(rows) < global_batch:
    raise DataError(
      f"too few {what} for one batch: {len(rows)} {unit}, but a batch needs {global_batch}; add data or lower "
      f"train.batch_size"
    )
  return process_batches(rows, global_batch, seed, process_index, process_count)


def sft_train_dataset(
  prepared_dir: str, global_batch: int, seed: int, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
  rows = PackedRows(prepared_dir, "train")
  return train_batches(rows, global_batch, seed, process_index, process_count, "conversations", "packed rows")
