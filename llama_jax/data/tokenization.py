"""Sentencepiece tokenizer: a thin wrapper for encoding and decoding, and lossless BPE training (the command is
``python -m llama_jax.tokenizer``).

Any sentencepiece ``.model`` loads, Meta's LLaMA 2 file included. Trained tokenizers follow Meta's layout (BPE with
byte fallback, unk=0, bos=1, eos=2, no pad) with settings under which ``decode(encode(s)) == s`` for any text, with
one exception sentencepiece imposes on every model: a literal U+2581 "▁" in the input decodes as a space, because
sentencepiece uses that character to stand for spaces.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import glob
import io
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import sentencepiece as spm

from llama_jax.core import paths
from llama_jax.core.errors import LlamaJaxError
from llama_jax.core.paths import CHAT_TEMPLATE_FILE, GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from llama_jax.data.jinja_chat import PLAIN_MARK, JinjaChatTemplate

logger = logging.getLogger(__name__)

_SPACE = "\u2581"  # "▁": sentencepiece's stand-in for a space inside pieces


class TokenizerError(LlamaJaxError, ValueError):
  """Bad tokenizer input; the message names the file or value and, where there is one, the fix."""


class TokenizerBase:
  """What both tokenizer back ends share, and the interface the rest of llama_jax uses.

  It holds the files that came with the tokenizer (``paths.TOKENIZER_SIDE_FILES``: its generation config,
  tokenizer_config.json, chat_template.jinja, special_tokens_map.json) and the stop tokens and chat template they
  give. Stop tokens: eos, the generation config's ``eos_token_id`` entries (an id or a list) and the chat template's
  end-of-turn token. A subclass sets up its back end, then calls ``_init_side_files``.

  Attributes:
    path: the tokenizer's main file.
    main_file: the name of that file in a checkpoint directory.
    chat_template: the checkpoint's own chat template, or None: LLaMA 2's format is used then.
    end_of_turn_id: the chat template's end-of-turn token, or None.
  """

  path: str
  main_file: str
  chat_template: JinjaChatTemplate | None = None
  end_of_turn_id: int | None = None

  def _init_side_files(self, side_files: Mapping[str, bytes] | None, directory: str) -> None:
    self._side_files = {name: content for name, content in (side_files or {}).items() if content is not None}
    name = str(paths.path(directory, GENERATION_CONFIG_FILE))
    self._extra_stops = _generation_stop_ids(self._side_files.get(GENERATION_CONFIG_FILE), self.vocab_size, name)
    template = _chat_template_source(self._side_files, directory)
    if template is not None:
      self.chat_template = JinjaChatTemplate(*template, self.template_variables())
      self.end_of_turn_id = self.chat_template.end_of_turn_id(
        lambda text: self.encode_rendered(text, PLAIN_MARK)[0], self.special_ids
      )

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Every token that ends a generation: eos, the generation config's eos_token_id entries and the chat template's
    end-of-turn token, sorted."""
    stops = {self.eos_id, *self._extra_stops, -1 if self.end_of_turn_id is None else self.end_of_turn_id}
    return tuple(sorted(stops - {-1}))

  def document_ids(self, ids: Sequence[int]) -> list[int]:
    """A document's ids as pretraining and evaluation streams hold them.

    Bos comes first where this tokenizer starts documents with one (``adds_bos``: Meta's and Llama 3's do, SmolLM2's
    and GPT-2-style ones do not), eos last as the boundary the model learns to end on.

    Args:
      ids: the document's text encoded, without bos or eos.

    Returns:
      The ids with bos, where the tokenizer adds one, and eos around them.
    """
    return [self.bos_id] * self.adds_bos + list(ids) + [self.eos_id]

  def flat_document_ids(self, batch: Iterable[Sequence[int]]) -> tuple[list[int], list[int]]:
    """The `document_ids` of many documents, one after another in one list, and each one's length.

    Built in place by list.extend, in C: the streaming packer's group and the evaluation stream. Per-document lists
    joined by np.fromiter over a chain took a noticeable share of a streaming worker's time beside encode_batch
    (BENCHMARKS.md).

    Args:
      batch: the documents' texts encoded, each without bos or eos, e.g. from `encode_batch`.

    Returns:
      A tuple: the ids of every document in one list, and the length of each document's ids in it.
    """
    flat: list[int] = []
    lengths: list[int] = []
    bos = [self.bos_id] * self.adds_bos
    for ids in batch:
      start = len(flat)
      flat += bos
      flat += ids
      flat.append(self.eos_id)
      lengths.append(len(flat) - start)
    return flat, lengths

  def files(self) -> dict[str, bytes]:
    """The files that make up this tokenizer in a checkpoint directory, to copy it into one.

    Returns:
      File name → contents: the main file and the side files that came with it.
    """
    return {self.main_file: self.main_file_bytes(), **self._side_files}

  def identity_bytes(self) -> bytes:
    """What decides the ids this tokenizer gives text and conversations, for the prepared-data digests.

    Returns:
      The tokenizer's ``serialized`` bytes, followed by its chat template's source when it has one.
    """
    if self.chat_template is None:
      return self.serialized()
    return self.serialized() + b"\0chat_template\0" + self.chat_template.source.encode("utf-8")

  def template_variables(self) -> dict[str, str]:
    """The special tokens' texts a chat template reads.

    Returns:
      bos_token, eos_token, unk_token and pad_token → their texts, for the tokens this tokenizer has.
    """
    named = (
      ("bos_token", self.bos_id),
      ("eos_token", self.eos_id),
      ("unk_token", self.unk_id),
      ("pad_token", self.pad_id),
    )
    return {name: self.id_to_piece(token_id) for name, token_id in named if token_id >= 0}

  @property
  def special_texts(self) -> tuple[str, ...]:
    """The texts of the special tokens, which a rendered chat template may contain (``encode_rendered``)."""
    return tuple(self.id_to_piece(token_id) for token_id in sorted(self.special_ids))

  def _check_ids(self, ids: Iterable[int]) -> np.ndarray | None:
    """`ids` as a 1-d integer array, None when empty; TokenizerError for another shape or an id out of range."""
    ids_array = np.asarray(ids if hasattr(ids, "shape") else list(ids))
    if ids_array.size == 0:
      return None
    if ids_array.ndim != 1 or not np.issubdtype(ids_array.dtype, np.integer):
      raise TokenizerError(
        f"decode expects a 1-d sequence of integer ids, got shape {ids_array.shape} of {ids_array.dtype}"
      )
    bad = ids_array[(ids_array < 0) | (ids_array >= self.vocab_size)]
    if bad.size:
      raise TokenizerError(f"token id {int(bad[0])} is out of range [0, {self.vocab_size})")
    return ids_array

  @staticmethod
  def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
      raise TokenizerError("encode_batch expects a list of str, got one str; use encode")
    texts = list(texts)
    for i, text in enumerate(texts):
      if not isinstance(text, str):
        raise TokenizerError(f"encode_batch expects a list of str; item {i} is a {type(text).__name__}")
    return texts

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size})"


class Tokenizer(TokenizerBase):
  """Encodes text to token ids and back with a sentencepiece model (``tokenizer.model``).

  Any sentencepiece model loads, Meta's LLaMA 2 file included. Special-token texts such as "<s>" in the text are
  encoded as ordinary characters, so text cannot forge a bos or eos: those are ids, added by `encode`'s `bos` and
  `eos` or by the chat template.

  Args:
    model_path: the sentencepiece ``.model`` file.
    side_files: the files that came with it, name → bytes (see TokenizerBase), or None.
    directory: where they came from, named in messages; the model's directory when empty.

  Raises:
    TokenizerError: the model file does not exist or is not a sentencepiece model, or a side file is malformed.
    ChatTemplateError: the side files' chat template does not compile.
  """

  main_file = TOKENIZER_FILE

  def __init__(self, model_path: str, side_files: Mapping[str, bytes] | None = None, directory: str = ""):
    if not os.path.isfile(model_path):
      raise TokenizerError(f"tokenizer model {model_path!r} does not exist")
    try:
      self._sp = spm.SentencePieceProcessor(model_file=model_path)
    except (RuntimeError, OSError) as e:
      raise TokenizerError(f"{model_path!r} is not a sentencepiece model: {e}") from e
    self.path = model_path
    self._init_side_files(side_files, directory or os.path.dirname(model_path))

  @property
  def vocab_size(self) -> int:
    """The number of pieces in the vocabulary: every id is below it."""
    return self._sp.vocab_size()

  @property
  def bos_id(self) -> int:
    """The beginning-of-sequence id, -1 when the model has none."""
    return self._sp.bos_id()

  @property
  def eos_id(self) -> int:
    """The end-of-sequence id, -1 when the model has none."""
    return self._sp.eos_id()

  @property
  def pad_id(self) -> int:
    """The padding id, -1 when the model has no pad token (LLaMA 2 has none)."""
    return self._sp.pad_id()

  @property
  def unk_id(self) -> int:
    """The id of unknown text, -1 when the model has none."""
    return self._sp.unk_id()

  @property
  def adds_bos(self) -> bool:
    """Whether a document starts with bos (``encode(..., bos=True)``): always, when there is one (Meta's way)."""
    return self.bos_id >= 0

  @functools.cached_property
  def special_ids(self) -> frozenset[int]:
    """Control pieces (bos, eos, pad) and unk: what HF's conversion of a sentencepiece model makes special."""
    ids = range(self.vocab_size)
    return frozenset(i for i in ids if self._sp.is_control(i) or self._sp.is_unknown(i))

  def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
    """The token ids of `text`; special-token texts in it, such as "<s>", are ordinary characters.

    Args:
      text: the text to encode.
      bos: put the bos id first.
      eos: put the eos id last.

    Returns:
      The ids.

    Raises:
      TokenizerError: `text` is not a str, or bos or eos is asked for and the model has no such token.
    """
    if not isinstance(text, str):
      raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
    for wanted, name, token_id in ((bos, "bos", self.bos_id), (eos, "eos", self.eos_id)):
      if wanted and token_id < 0:
        raise TokenizerError(f"{self.path!r} has no {name} token; call encode with {name}=False")
    return self._sp.encode(text, add_bos=bos, add_eos=eos)

  def encode_rendered(self, text: str, plain_mark: str) -> tuple[list[int], list[int]]:
    """The ids of a rendered chat template, and where each token's text ends.

    Special-token texts become their ids, each stretch between them is encoded on its own, as HF's conversion of the
    model encodes it, dummy prefix included, and stretches between two `plain_mark`s are plain text.

    Args:
      text: the rendered template.
      plain_mark: the mark a chat template puts around special-token texts inside message contents, so that they
        are encoded as plain text.

    Returns:
      A tuple: the ids, and the end of each token's text as a character offset in `text` without the marks.
    """
    ids: list[int] = []
    ends: list[int] = []
    shift = 0
    by_text, pattern = self._special_splitter
    for k, stretch in enumerate(text.split(plain_mark)):
      for part in [stretch] if k % 2 else pattern.split(stretch):
        if not k % 2 and part in by_text:
          ids.append(by_text[part])
          ends.append(shift + len(part))
        elif part:
          end = shift
          for piece in self._sp.encode(part, return_type="proto").pieces:
            end += len(piece.surface)  # a byte-fallback character's last byte piece carries it
            ids.append(piece.id)
            ends.append(end)
        shift += len(part)
    return ids, ends

  @functools.cached_property
  def _special_splitter(self) -> tuple[dict[str, int], re.Pattern]:
    """Special-token texts → ids, and the pattern that splits text at them (longest first), built once: a
    conversation is encoded once per assistant turn and once whole."""
    by_text = {self.id_to_piece(i): i for i in self.special_ids}
    return by_text, re.compile("(" + "|".join(map(re.escape, sorted(by_text, key=len, reverse=True))) + ")")

  def encode_batch(self, texts: Sequence[str], threads: int = -1) -> list[list[int]]:
    """Encodes many texts on sentencepiece's thread pool, without bos or eos.

    Args:
      texts: the texts, a list of str.
      threads: the threads to encode on, -1 for one per core.

    Returns:
      The ids of each text, in order.

    Raises:
      TokenizerError: `texts` is one str, or holds something other than str.
    """
    return self._sp.encode(self._check_texts(texts), add_bos=False, add_eos=False, num_threads=threads)

  def decode(self, ids: Iterable[int]) -> str:
    """The text of a 1-d sequence of ids; control ids (bos, eos, pad) decode to nothing.

    Args:
      ids: the ids, a list or an array.

    Returns:
      The text, "" for no ids.

    Raises:
      TokenizerError: `ids` is not a 1-d sequence of integers, or holds an id outside the vocabulary.
    """
    ids_array = self._check_ids(ids)
    return "" if ids_array is None else self._sp.decode(ids_array.tolist())

  def id_to_piece(self, token_id: int) -> str:
    """The vocabulary entry of one id, such as "▁the", "<0x0A>" or "</s>".

    Args:
      token_id: the id.

    Returns:
      Its piece.
    """
    return self._sp.id_to_piece(int(token_id))

  def token_byte_lengths(self) -> np.ndarray:
    """[vocab_size] int32: how many UTF-8 bytes of decoded text each token stands for, to turn a loss per token
    into bits per byte exactly.

    Byte-fallback pieces ``<0xNN>`` stand for 1 byte; control and unknown pieces (bos, eos, pad, unk) for 0; any other
    piece for its text with "▁" read as a space. The dummy-prefix space that sentencepiece puts before every
    non-empty text counts as a byte: decode drops it, so summed over ``encode(s)`` the table gives
    ``len(s.encode("utf-8")) + 1`` for every non-empty ``s`` (a literal "▁" in ``s`` counts 1 byte, not 3).
    """
    lengths = np.zeros(self.vocab_size, dtype=np.int32)
    for token_id in range(self.vocab_size):
      if self._sp.is_control(token_id) or self._sp.is_unknown(token_id):
        continue
      if self._sp.is_byte(token_id):
        lengths[token_id] = 1
      else:
        lengths[token_id] = len(self._sp.id_to_piece(token_id).replace(_SPACE, " ").encode("utf-8"))
    return lengths

  def serialized(self) -> bytes:
    """The model proto, byte for byte what a ``.model`` file holds (to copy into checkpoint directories)."""
    return self._sp.serialized_model_proto()

  def main_file_bytes(self) -> bytes:
    """The contents of the main file, ``tokenizer.model``: the `serialized` model proto."""
    return self.serialized()


def _chat_template_source(side_files: Mapping[str, bytes], directory: str) -> tuple[str, str] | None:
  """(template, where it came from) of a checkpoint: chat_template.jinja, else tokenizer_config.json's
  ``chat_template`` (a string, or named templates of which "default" is the chat one), else None."""
  if CHAT_TEMPLATE_FILE in side_files:
    name = str(paths.path(directory, CHAT_TEMPLATE_FILE))
    try:
      return side_files[CHAT_TEMPLATE_FILE].decode("utf-8"), name
    except UnicodeDecodeError as e:
      raise TokenizerError(f"{name} is not UTF-8 text: {e}") from None
  config = json_side_file(side_files, TOKENIZER_CONFIG_FILE, directory)
  template = config.get("chat_template")
  name = f"{paths.path(directory, TOKENIZER_CONFIG_FILE)} chat_template"
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  if template is None:
    return None
  if not isinstance(template, str):
    raise TokenizerError(f"{name} must be a string (or a list of named templates with a 'default')")
  return template, name


def json_side_file(side_files: Mapping[str, bytes], file_name: str, directory: str) -> dict:
  """The JSON object of one side file, {} when absent; TokenizerError naming the file when it is not one."""
  raw = side_files.get(file_name)
  if raw is None:
    return {}
  name = str(paths.path(directory, file_name))
  try:
    value = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TokenizerError(f"{name} is not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise TokenizerError(f"{name} must hold a JSON object, not {type(value).__name__}")
  return value


def _generation_stop_ids(raw: bytes | None, vocab_size: int, name: str) -> tuple[int, ...]:
  """eos_token_id of a generation_config.json (absent, null, an id or a list of ids), each checked against the
  vocabulary: a stop id the model cannot emit would be a silent no-op, one out of range a wrong file."""
  if raw is None:
    return ()
  try:
    config = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TokenizerError(f"{name} is not valid JSON: {e}") from e
  value = config.get("eos_token_id") if isinstance(config, dict) else None
  ids = [] if value is None else value if isinstance(value, list) else [value]
  for token_id in ids:
    if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
      raise TokenizerError(
        f"{name}: eos_token_id {value!r} must be an id or a list of ids in [0, {vocab_size}) (the vocabulary)"
      )
  return tuple(ids)


def decode_utf8_counting(data: bytes) -> tuple[str, int]:
  """``data.decode("utf-8", errors="replace")`` and the number of bytes that were replaced with U+FFFD.

  The count is of bytes, not of U+FFFD characters: a truncated 3-byte sequence is 2 bytes but one U+FFFD, and the text
  may hold U+FFFD of its own.
  """
  parts, replaced, start = [], 0, 0
  view = memoryview(data)  # slices without copying, so many bad bytes in one long line stay linear
  while start < len(data):
    try:
      parts.append(codecs.utf_8_decode(view[start:], "strict", True)[0])
      break
    except UnicodeDecodeError as e:
      # The strict error carries the same span the "replace" handler would replace.
      parts.append(codecs.utf_8_decode(view[start : start + e.start], "strict", True)[0])
      parts.append("\ufffd")
      replaced += e.end - e.start
      start += e.end
  return "".join(parts), replaced


class CorpusReader:
  """Iterates the non-empty lines of text files (line endings dropped), read as UTF-8 with undecodable bytes replaced
  by U+FFFD and counted, so that a stray binary or Latin-1 file shows up in the counts instead of failing a run."""

  def __init__(self, paths: Sequence[str]):
    self.paths = _check_input_files(paths)
    self.lines = 0
    self.text_bytes = 0  # UTF-8 bytes of the lines as yielded (after replacement)
    self.replaced_bytes = 0
    self.replaced_by_file: dict[str, int] = {}

  def __iter__(self) -> Iterator[str]:
    for path in self.paths:
      replaced_here = 0
      try:
        with open(path, "rb") as f:
          for raw in f:
            line, replaced = decode_utf8_counting(raw.rstrip(b"\n").rstrip(b"\r"))
            replaced_here += replaced
            if line:
              self.lines += 1
              self.text_bytes += len(line.encode("utf-8"))
              yield line
      except OSError as e:
        raise TokenizerError(f"cannot read input file {path!r}: {e.strerror or e}") from e
      if replaced_here:
        self.replaced_by_file[path] = replaced_here
        self.replaced_bytes += replaced_here


def _check_input_files(paths: Sequence[str]) -> list[str]:
  if isinstance(paths, str):
    paths = [paths]
  if not paths:
    raise TokenizerError("no input files given")
  for path in paths:
    if not os.path.exists(path):
      raise TokenizerError(f"input file {path!r} does not exist")
    if not os.path.isfile(path):
      raise TokenizerError(f"input {path!r} is not a file")
  return list(paths)


def expand_inputs(patterns: Sequence[str]) -> list[str]:
  """Files named by paths, directories (every file below, sorted, hidden names skipped) and glob patterns."""
  files: list[str] = []
  for pattern in patterns:
    if os.path.exists(pattern):
      matches = [pattern]
    elif glob.has_magic(pattern):
      matches = sorted(glob.glob(pattern, recursive=True))
      if not matches:
        raise TokenizerError(f"input pattern {pattern!r} matches no files")
    else:
      raise TokenizerError(f"input path {pattern!r} does not exist")
    for match in matches:
      if os.path.isdir(match):
        for root, dirs, names in os.walk(match):
          dirs[:] = sorted(d for d in dirs if not d.startswith("."))
          files.extend(os.path.join(root, n) for n in sorted(names) if not n.startswith("."))
      else:
        files.append(match)
  files = list(dict.fromkeys(files))  # a file named twice is read once
  if not files:
    raise TokenizerError(f"inputs {list(patterns)} hold no files")
  return files


def _sentences(lines: Iterable[str], max_bytes: int) -> Iterator[str]:
  """Lines cut into pieces of at most ``max_bytes`` UTF-8 bytes, after a space where there is one, because
  sentencepiece silently skips longer sentences."""
  for line in lines:
    data = line.encode("utf-8")
    while len(data) > max_bytes:
      cut = data.rfind(b" ", 0, max_bytes) + 1
      if cut == 0:
        cut = max_bytes
        while data[cut] & 0xC0 == 0x80:  # back off to a character boundary
          cut -= 1
      yield data[:cut].decode("utf-8")
      data = data[cut:]
    if data:
      yield data.decode("utf-8")


_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def train_tokenizer(
  inputs: Sequence[str],
  vocab_size: int,
  out_dir: str,
  *,
  model_prefix: str = "tokenizer",
  num_threads: int = 2,
  max_sentence_length: int = 16384,
  character_coverage: float = 0.9995,
  overwrite: bool = False,
  verbose: bool = False,
) -> str:
  """Trains a lossless BPE tokenizer in Meta's layout on text files.

  Meta's layout: BPE with byte fallback, unk=0, bos=1, eos=2, no pad, with settings under which
  ``decode(encode(s)) == s`` for any text. Each non-empty line is a sentence, cut at spaces when longer than
  ``max_sentence_length`` bytes; sentencepiece holds them all in memory. Undecodable bytes are read as U+FFFD; their
  count is logged as a warning per file (``corpus_stats`` recounts them). The model is written under a temporary
  name and renamed into place, so a failure never leaves a partial file, and an existing model is kept unless
  ``overwrite``.

  Long for one reason: the trainer call names every sentencepiece setting that makes the model lossless, each with why.

  Args:
    inputs: the text files to train on.
    vocab_size: the pieces of the vocabulary, special and byte tokens included.
    out_dir: the directory to write the model into, created if needed.
    model_prefix: the model's file name, without ``.model``.
    num_threads: sentencepiece's training threads.
    max_sentence_length: the most UTF-8 bytes of one sentence, at least 4.
    character_coverage: the share of characters that get a piece of their own; with byte fallback the others cost a
      few byte tokens, and no text is lost.
    overwrite: replace an existing model.
    verbose: let sentencepiece log its training.

  Returns:
    The path of ``out_dir/<model_prefix>.model``.

  Raises:
    TokenizerError: a bad argument, a missing or unreadable input file, a model already there without `overwrite`,
      no text to train on, a `vocab_size` the corpus cannot support, or a failure to write the model.
  """
  if not isinstance(vocab_size, int) or vocab_size <= 0:
    raise TokenizerError(f"vocab_size must be a positive integer, got {vocab_size!r}")
  if max_sentence_length < 4:  # the longest UTF-8 character must fit in a sentence
    raise TokenizerError(f"max_sentence_length must be at least 4 bytes, got {max_sentence_length!r}")
  model_path = os.path.join(out_dir, f"{model_prefix}.model")
  if os.path.exists(model_path) and not overwrite:
    raise TokenizerError(f"{model_path!r} already exists; pass overwrite=True (--overwrite) to replace it")
  reader = CorpusReader(inputs)
  read_errors: list[TokenizerError] = []

  def sentences() -> Iterator[str]:
    # sentencepiece turns an exception in the iterator into a bare RuntimeError; keep ours to raise it as it is.
    try:
      yield from _sentences(reader, max_sentence_length)
    except TokenizerError as e:
      read_errors.append(e)

  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=sentences(),
      model_writer=model,
      model_type="bpe",
      vocab_size=vocab_size,
      # Lossless: bytes of characters without a piece fall back to <0xNN> pieces, and the text is left as it is
      # (no NFKC, no whitespace squeezing), so decode(encode(s)) == s.
      byte_fallback=True,
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      # As Meta does. The dummy prefix keeps the round trip: encode adds one "▁" before the text and decode drops
      # exactly one, so leading spaces survive (tests check it); it makes "hello" at the start and mid-text share
      # the piece "▁hello".
      add_dummy_prefix=True,
      split_digits=True,
      allow_whitespace_only_pieces=True,
      # With byte fallback, coverage never loses text; it decides which rare characters get a piece of their own.
      # sentencepiece's CJK-safe default 0.9995 (Meta: 0.99995 on far more text) keeps stray symbols, rare hanzi
      # and emoji from taking slots of a small vocabulary; they cost a few byte tokens instead.
      character_coverage=character_coverage,
      max_sentence_length=max_sentence_length,
      unk_id=0,
      bos_id=1,
      eos_id=2,
      pad_id=-1,
      num_threads=num_threads,
      minloglevel=0 if verbose else 2,
    )
  except RuntimeError as e:
    if read_errors:
      raise read_errors[0] from None
    raise _training_error(e, reader, vocab_size) from e
  if read_errors:  # training may succeed on the text read before the error; that model is not the one asked for
    raise read_errors[0]
  for path, count in reader.replaced_by_file.items():
    logger.warning("%s: %d bytes are not valid UTF-8 and were read as U+FFFD", path, count)
  try:
    os.makedirs(out_dir, exist_ok=True)
  except OSError as e:
    raise TokenizerError(f"cannot create output directory {out_dir!r}: {e.strerror or e}") from e
  try:
    with paths.atomic_write(model_path, "wb") as f:
      f.write(model.getvalue())
      if os.path.exists(model_path) and not overwrite:  # appeared while training
        raise TokenizerError(f"{model_path!r} already exists; pass overwrite=True (--overwrite) to replace it")
  except OSError as e:
    raise TokenizerError(f"cannot write {model_path!r}: {e.strerror or e}") from e
  return model_path


def _training_error(error: RuntimeError, reader: CorpusReader, vocab_size: int) -> TokenizerError:
  message = str(error)
  if reader.lines == 0:
    return TokenizerError(f"no text to train on: every line of {', '.join(map(repr, reader.paths))} is empty")
  if match := _TOO_HIGH.search(message):
    return TokenizerError(
      f"vocab_size {vocab_size} is larger than this corpus supports (at most {match[2]}); "
      "lower --vocab_size or add text"
    )
  if match := _TOO_SMALL.search(message):
    return TokenizerError(
      f"vocab_size {vocab_size} is too small for this corpus: 3 special tokens, 256 byte tokens "
      f"and its common characters need at least {match[2]}; raise --vocab_size"
    )
  return TokenizerError(f"sentencepiece training failed: {message}")


@dataclasses.dataclass(frozen=True)
class CorpusStats:
  lines: int
  bytes: int  # UTF-8 bytes of the lines, line endings excluded
  tokens: int  # each line encoded on its own, without bos/eos
  replaced_bytes: int  # bytes that were not valid UTF-8, read as U+FFFD

  @property
  def bytes_per_token(self) -> float:
    return self.bytes / max(self.tokens, 1)


def corpus_stats(tokenizer: Tokenizer, inputs: Sequence[str], batch_lines: int = 4096) -> CorpusStats:
  """How well ``tokenizer`` compresses text files, read the way ``train_tokenizer`` reads them."""
  reader = CorpusReader(inputs)
  tokens, batch = 0, []
  for line in reader:
    batch.append(line)
    if len(batch) == batch_lines:
      tokens += sum(map(len, tokenizer.encode_batch(batch)))
      batch = []
  tokens += sum(map(len, tokenizer.encode_batch(batch)))
  return CorpusStats(reader.lines, reader.text_bytes, tokens, reader.replaced_bytes)
