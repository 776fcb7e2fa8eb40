"""Preference pairs for DPO: sources, checks, the chat template, one pair per row, and a pair set from shipped data.

Sources (``data.sources`` with ``data.format="preference"``), each one of:
  - JSONL files (``*.jsonl``, also inside directories or globs), one pair per line: ``{"prompt": "...", "chosen":
    "...", "rejected": "..."}``, or ``"messages": [...]`` (a conversation ending with a user turn) instead of
    ``"prompt"``; other fields (an id, a source) are ignored;
  - ``pairs:<chat source>`` (``pairs:chitchat``, ``pairs:chatterbot:english``, ``pairs:chats.jsonl``): pairs built
    from an SFT source (sft.py) by `build_pairs` (a conversation's real answer is chosen, another conversation's answer
    rejected), so the tiny DPO config works from a fresh clone without a file.

``prepare_preference`` renders each response as the last assistant turn after the prompt with the LLaMA 2 chat
template (``chat_template.encode_dialog``), puts weights only on that response's tokens and its eos, and stores one
pair per row of ``seq_len`` (right-padded, weight 0): chosen_inputs / chosen_targets / chosen_weights and the same for
rejected, in the prepared-data cache of prepared.py as SFT rows are. Pairs are not packed: DPO needs each
response's summed log-prob, which one row per response makes a plain row sum with the chosen and rejected sides at the
same row index; packing would need per-segment sums and a pair split across rows handled, and the responses here are
short enough that the padding costs less than that machinery is worth (meta.json records the fill).

A bad line (malformed JSON, a missing or non-string field, an empty response, chosen identical to rejected, a prompt
that leaves no room for a response in seq_len) is reported with its file and line, skipped and counted
(``data.on_error="skip"``) or fatal (``"stop"``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from llama_jax.core import paths
from llama_jax.data import chat_template, sft
from llama_jax.data.batches import train_batches
from llama_jax.data.prepared import PackedRows, cannot_prepare, prepare_rows
from llama_jax.data.sources import DataError, collect, jsonl_paths, jsonl_records

PAIRS_PREFIX = "pairs:"
SHIPPED_PAIR_SOURCES = ("pairs:chitchat", "pairs:chatterbot:english")
SIDES = ("chosen", "rejected")
PREFERENCE_KEYS = tuple(f"{side}_{key}" for side in SIDES for key in ("inputs", "targets", "weights"))
_TOKEN_KEYS = tuple(k for k in PREFERENCE_KEYS if not k.endswith("weights"))


@dataclasses.dataclass(frozen=True)
class PreferencePair:
  """One checked pair: the prompt as a conversation ending with a user turn, and two different responses."""

  location: str
  messages: tuple  # of {"role", "content"} dicts
  chosen: str
  rejected: str

  def as_json(self) -> list:
    return [self.location, list(self.messages), self.chosen, self.rejected]


# ---------------------------------------------------------------------------------------------------------------------
# Reading and checking


def check_pair(record: Any) -> tuple[list[dict], str, str]:
  """(prompt messages, chosen, rejected) of a JSONL record, or DataError saying what is wrong with it."""
  if not isinstance(record, dict):
    raise DataError('expected an object {"prompt" or "messages", "chosen", "rejected"}')
  if "prompt" in record and "messages" in record:
    raise DataError("has both 'prompt' and 'messages'; give one")
  if "prompt" in record:
    prompt = record["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
      raise DataError(f"field 'prompt' must be a non-empty string, got {prompt!r:.40}")
    messages = [{"role": "user", "content": prompt}]
  elif "messages" in record:
    messages = record["messages"]
    if not isinstance(messages, list):
      raise DataError(f"field 'messages' must be a list of messages, got {type(messages).__name__}")
    try:
      chat_template.check_conversation(messages, for_training=False)
    except chat_template.ConversationError as e:
      raise DataError(f"bad 'messages': {e}") from e
  else:
    raise DataError("missing field 'prompt' (or 'messages')")
  responses = []
  for side in SIDES:
    if side not in record:
      raise DataError(f"missing field {side!r}")
    response = record[side]
    if not isinstance(response, str):
      raise DataError(f"field {side!r} must be a string, got {type(response).__name__}")
    if not response.strip():
      raise DataError(f"empty {side!r} response")
    responses.append(response)
  if responses[0].strip() == responses[1].strip():
    raise DataError("identical 'chosen' and 'rejected' responses: the pair prefers nothing")
  return messages, responses[0], responses[1]


def iter_records(specs: Sequence[str]) -> Iterator[tuple[str, Any]]:
  """(location, record or the DataError reading it raised) for every pair of the sources."""
  for spec in specs:
    if spec.startswith(PAIRS_PREFIX):
      for record in build_pairs([spec[len(PAIRS_PREFIX) :]]):
        yield f"{PAIRS_PREFIX}{record['source']}", record
    else:
      for path in jsonl_paths(spec):
        yield from jsonl_records(path)


def load_pairs(specs: Sequence[str], on_error: str = "skip") -> tuple[list[PreferencePair], list[str]]:
  """Valid pairs and, for `on_error="skip"`, the problems skipped ("file:line: what"); with "stop", the first
  problem raises DataError naming its file and line."""
  good, problems = collect(iter_records(specs), check_pair, on_error)
  return [
    PreferencePair(location, tuple(messages), chosen, rejected) for location, (messages, chosen, rejected) in good
  ], problems


# ---------------------------------------------------------------------------------------------------------------------
# Encoding: one response per row


@dataclasses.dataclass(frozen=True)
class EncodedPair:
  """Token ids of prompt + response for each side, and a 0/1 weight per token: 1 exactly on the last response."""

  chosen_tokens: list[int]
  chosen_weights: list[int]
  rejected_tokens: list[int]
  rejected_weights: list[int]
  dropped_exchanges: int = 0


def _last_turn_weights(loss_mask: Sequence[int]) -> list[int]:
  """The loss mask of encode_dialog covers every assistant turn; DPO scores only the last: the final run of ones
  (the last answer and its eos end the sequence, so it is the suffix)."""
  n = 0
  while n < len(loss_mask) and loss_mask[len(loss_mask) - 1 - n]:
    n += 1
  return [0] * (len(loss_mask) - n) + [1] * n


def encode_pair(tokenizer, pair: PreferencePair, max_len: int) -> EncodedPair:
  """Both sides in the chat template, at most `max_len` tokens each, sharing the same prompt tokens.

  Too long: the oldest exchanges of the prompt are dropped, with the same budget on both sides (the longer response
  decides it), so both keep the same prompt. The last user turn is never cut (the responses are judged against it):
  a pair that does not fit with it whole raises DataError ("prompt too long to leave room for a response")."""
  conversations = {
    side: [*pair.messages, {"role": "assistant", "content": text}]
    for side, text in zip(SIDES, (pair.chosen, pair.rejected))
  }
  encoded = {side: chat_template.encode_dialog(tokenizer, messages) for side, messages in conversations.items()}
  if any(len(e.tokens) > max_len for e in encoded.values()):
    lengths = {side: sum(_last_turn_weights(e.loss_mask)) for side, e in encoded.items()}
    longest = max(lengths.values())
    for side, messages in conversations.items():
      try:
        encoded[side] = chat_template.encode_dialog(tokenizer, messages, max_len=max_len - (longest - lengths[side]))
      except chat_template.ConversationError as e:
        raise DataError(f"the {side} response is {lengths[side]} tokens, more than the {max_len} allowed") from e
      if encoded[side].truncated:
        raise DataError(
          f"prompt too long to leave room for a response: the last user turn and the {longest}-token response "
          f"need more than {max_len} tokens (train.seq_len + 1)"
        )
  weights = {side: _last_turn_weights(e.loss_mask) for side, e in encoded.items()}
  prompts = [e.tokens[: len(e.tokens) - sum(weights[side])] for side, e in encoded.items()]
  if prompts[0] != prompts[1]:
    raise DataError("the chosen and rejected prompts tokenize differently (the tokenizer merged across the turn)")
  return EncodedPair(
    encoded["chosen"].tokens,
    weights["chosen"],
    encoded["rejected"].tokens,
    weights["rejected"],
    encoded["chosen"].dropped_exchanges,
  )


def pair_rows(encoded: Sequence[EncodedPair], seq_len: int) -> dict[str, np.ndarray]:
  """One pair per row: inputs = tokens[:-1], targets = tokens[1:], weights = the response mask[1:], right-padded
  with token 0 and weight 0 (the model is causal, so padding after a response changes nothing before it)."""
  arrays = {
    k: np.zeros((len(encoded), seq_len), np.float32 if k.endswith("weights") else np.int32) for k in PREFERENCE_KEYS
  }
  for r, pair in enumerate(encoded):
    for side in SIDES:
      tokens, weights = np.asarray(getattr(pair, f"{side}_tokens")), np.asarray(getattr(pair, f"{side}_weights"))
      n = len(tokens) - 1
      arrays[f"{side}_inputs"][r, :n] = tokens[:-1]
      arrays[f"{side}_targets"][r, :n] = tokens[1:]
      arrays[f"{side}_weights"][r, :n] = weights[1:]
  return arrays


def prepare_preference(
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
  """Encodes preference pairs in the tokenizer's chat template, LLaMA 2's without one, one pair per row of seq_len.

  Each response is the last assistant turn after the prompt, weighted on its tokens and its eos only, right-padded
  with weight 0: chosen_inputs, chosen_targets, chosen_weights and the same for rejected. The rows are kept in the
  prepared-data cache of prepared.py as SFT rows are: each .npy file's size and sha256 in meta.json, token ids
  checked against the vocabulary. Split by pair location: a seeded `val_fraction` of the pairs is held out. meta.json
  counts the pairs skipped, bad lines and pairs too long, and keeps the first few problems.

  Args:
    sources: the preference source specs: JSONL files of {"prompt" or "messages", "chosen", "rejected"} (also
      inside directories or globs), or ``pairs:<chat source>`` for pairs built from an SFT source.
    tokenizer: the tokenizer that encodes the pairs, with its chat template, if any.
    out_dir: the directory of the rows and meta.json.
    seq_len: the positions of a row.
    val_fraction: the share of pairs held out for validation.
    seed: the seed of that split.
    on_error: "skip" to leave out a bad line or a pair too long and count it, "stop" to raise on the first.
    verify: check the sha256 of rows about to be reused.

  Returns:
    The contents of meta.json.

  Raises:
    DataError: a source is missing or, with "stop", holds a bad line or a pair that cannot be encoded, such as one
      too long, named by file and line; or no usable pair is left.
  """
  try:
    pairs, problems = load_pairs(sources, on_error)
  except DataError as e:
    raise cannot_prepare(out_dir, e, verify) from e

  def lay_out(split: list[tuple[str, PreferencePair]]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    kept, too_long = [], 0
    for location, pair in split:
      try:
        kept.append(encode_pair(tokenizer, pair, seq_len + 1))
      except DataError as e:
        if on_error == "stop":
          raise DataError(f"{location}: {e}") from e
        problems.append(f"{location}: {e}")
        too_long += 1
    arrays = pair_rows(kept, seq_len)
    used = sum(len(getattr(e, f"{s}_tokens")) - 1 for e in kept for s in SIDES)
    counts = dict(
      pairs=len(kept),
      response_tokens=int(arrays["chosen_weights"].sum() + arrays["rejected_weights"].sum()),
      dropped_exchanges=sum(e.dropped_exchanges for e in kept),
      fill=round(used / max(2 * len(kept) * seq_len, 1), 4),  # share of row positions that are not padding
      too_long=too_long,
    )
    return arrays, counts

  return prepare_rows(
    out_dir,
    kind="preference",
    items=[(pair.location, pair) for pair in pairs],
    identity=[pair.as_json() for pair in pairs],
    problems=problems,
    tokenizer=tokenizer,
    seq_len=seq_len,
    val_fraction=val_fraction,
    seed=seed,
    verify=verify,
    lay_out=lay_out,
    token_keys=_TOKEN_KEYS,
    what="preference pairs",
    sources=sources,
  )


class PreferenceRows(PackedRows):
  """Random access to the pair rows of a split (memory-mapped), size-checked against meta.json as SFT rows are."""

  def __init__(self, prepared_dir: str, split: str):
    super().__init__(prepared_dir, split, PREFERENCE_KEYS)


def preference_train_dataset(
  prepared_dir: str, global_batch: int, seed: int, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
  """Endless shuffled batches of `global_batch` pairs (this process's share), the PREFERENCE_KEYS [b, seq_len]."""
  rows = PreferenceRows(prepared_dir, "train")
  return train_batches(rows, global_batch, seed, process_index, process_count, "preference pairs", "training pairs")


# ---------------------------------------------------------------------------------------------------------------------
# A preference set from shipped conversations


def _hash(*parts: Any) -> int:
  """A seeded choice that does not depend on Python's or numpy's random streams, nor on the order of the data."""
  return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


def build_pairs(chat_sources: Sequence[str], *, seed: int = 0, context: int = 1) -> list[dict[str, Any]]:
  """Preference records from conversations (SFT sources: ``chitchat``, ``chatterbot:english``, chat JSONL).

  Each conversation gives one pair: a seeded exchange of it, the prompt being that user turn after up to `context`
  earlier exchanges; chosen = the conversation's real answer; rejected = the answer chosen for another conversation
  of the same sources, drawn by a seeded cyclic shift of a seeded order, so every answer is rejected about as often
  as it is chosen and never paired with itself (nor with an answer of the same text). What it teaches: prefer the
  answer that follows from the conversation to a fluent but off-topic one; style, length and vocabulary carry no
  signal, since both sides come from the same pool. Conversations the chat loader rejects are left out.
  """
  conversations, _ = sft.load_conversations(chat_sources, "skip")
  picked = []
  for location, messages in conversations:
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    k = _hash(seed, location, "exchange") % (len(turns) // 2)
    prompt = system + turns[max(0, 2 * (k - context)) : 2 * k + 1]
    picked.append((location, prompt, turns[2 * k + 1]["content"]))
  if len(picked) < 2:
    raise DataError(f"the chat sources {list(chat_sources)} give {len(picked)} conversation(s); pairs need two")
  order = sorted(range(len(picked)), key=lambda i: _hash(seed, picked[i][0], "order"))
  position = {i: p for p, i in enumerate(order)}
  records = []
  for i, (location, prompt, chosen) in enumerate(picked):
    for shift in range(1, min(len(order), 50)):
      rejected = picked[order[(position[i] + shift) % len(order)]][2]
      if rejected.strip().casefold() != chosen.strip().casefold():
        break
    else:
      continue  # every nearby answer is this one's text (a corpus of one reply): no pair
    records.append(dict(messages=prompt, chosen=chosen, rejected=rejected, source=location))
  return records


def write_pairs_jsonl(chat_sources: Sequence[str], out: str, *, seed: int = 0, context: int = 1) -> int:
  """Writes `build_pairs` records to a JSONL file (one pair per line); returns the number of pairs."""
  records = build_pairs(chat_sources, seed=seed, context=context)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with paths.atomic_write(out) as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
  return len(records)
