"""The HF ``tokenizers`` back end: a checkpoint's ``tokenizer.json`` (byte-level BPE for Llama 3, SmolLM2 and most
current models; sentencepiece-style BPE for HF's Llama 2 and Mistral), behind the same interface as the sentencepiece
``Tokenizer``.

Text ↔ ids equal ``transformers.AutoTokenizer`` on the same directory (tests/data/test_hf_tokenizer.py): special
tokens come from tokenizer_config.json (or special_tokens_map.json), special-token texts in input text are read as
their ids as transformers reads them, and a document starts with bos exactly when transformers would add it
(``adds_bos``): Llama 3 adds ``<|begin_of_text|>``, SmolLM2 adds nothing.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import tokenizers

from llama_jax.core import paths
from llama_jax.core.paths import HF_TOKENIZER_FILE, SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE
from llama_jax.data.tokenization import TokenizerBase, TokenizerError, json_side_file

_SPACE = "\u2581"  # "▁": the sentencepiece-style space of Metaspace pre-tokenizers


@functools.cache
def _byte_of_char() -> dict[str, int]:
  """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode): the printable character that stands for each byte."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = {}, 0
  for byte in range(256):
    if byte in printable:
      chars[chr(byte)] = byte
    else:
      chars[chr(256 + extra)] = byte
      extra += 1
  return chars


def _decoder_kinds(decoder: dict | None) -> set[str]:
  """The types of a tokenizer.json decoder, Sequence decoders flattened."""
  if not decoder:
    return set()
  if decoder.get("type") == "Sequence":
    return set().union(*(_decoder_kinds(d) for d in decoder.get("decoders", [])))
  return {decoder.get("type")}


class HFTokenizer(TokenizerBase):
  """Encodes text to token ids and back with a ``tokenizer.json``. `side_files` are the files that came with it
  (tokenizer_config.json, special_tokens_map.json, chat_template.jinja, generation_config.json); `directory` names
  where, for messages."""

  main_file = HF_TOKENIZER_FILE

  def __init__(self, tokenizer_json: bytes, side_files: Mapping[str, bytes] | None = None, directory: str = ""):
    self.path = str(paths.path(directory, HF_TOKENIZER_FILE))
    try:
      self._spec = json.loads(tokenizer_json)
      self._tok = tokenizers.Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, Exception) as e:  # tokenizers raises plain Exception on a bad file
      raise TokenizerError(f"{self.path} is not a tokenizers tokenizer.json: {str(e).splitlines()[0]}") from None
    self._json = tokenizer_json
    side_files = dict(side_files or {})
    config = json_side_file(side_files, TOKENIZER_CONFIG_FILE, directory)
    special_map = json_side_file(side_files, SPECIAL_TOKENS_MAP_FILE, directory)
    model_unk = (self._spec.get("model") or {}).get("unk_token")
    self._ids = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
      value = config.get(name, special_map.get(name, model_unk if name == "unk_token" else None))
      if isinstance(value, dict):  # an AddedToken written out: {"content": "<s>", ...}
        value = value.get("content")
      token_id = self._tok.token_to_id(value) if isinstance(value, str) else None
      if value is not None and token_id is None:
        where = str(paths.path(directory, TOKENIZER_CONFIG_FILE))
        raise TokenizerError(f"{where}: {name} {value!r} is not in the vocabulary of {self.path}")
      self._ids[name] = -1 if token_id is None else token_id
    # The post-processor decides, as in transformers 5, which ignores tokenizer_config.json's add_bos_token for a
    # tokenizer.json (measured with 5.24: no bos with add_bos_token true and a post-processor that adds none).
    with_special = self._tok.encode("a").ids
    self._adds_bos = self.bos_id >= 0 and with_special[:1] == [self.bos_id]
    self._init_side_files(side_files, directory)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def bos_id(self) -> int:
    """-1 when the tokenizer has none."""
    return self._ids["bos_token"]

  @property
  def eos_id(self) -> int:
    return self._ids["eos_token"]

  @property
  def pad_id(self) -> int:
    return self._ids["pad_token"]

  @property
  def unk_id(self) -> int:
    return self._ids["unk_token"]

  @property
  def adds_bos(self) -> bool:
    """Whether transformers starts an encoded text with bos: the tokenizer.json post-processor's choice."""
    return self._adds_bos

  @functools.cached_property
  def special_ids(self) -> frozenset[int]:
    """The added tokens marked special (what ``decode`` leaves out)."""
    return frozenset(i for i, token in self._tok.get_added_tokens_decoder().items() if token.special)

  def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
    """Ids of `text`, special-token texts in it read as their ids (as transformers does); `bos` starts it as a
    document when this tokenizer starts documents with one (``adds_bos``), `eos` ends it with eos."""
    if not isinstance(text, str):
      raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
    if eos and self.eos_id < 0:
      raise TokenizerError(f"{self.path!r} has no eos token; call encode with eos=False")
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return [self.bos_id] * (bos and self.adds_bos) + ids + [self.eos_id] * eos

  def encode_rendered(self, text: str, plain_mark: str) -> tuple[list[int], list[int]]:
    """(ids, where each token's text ends) of a rendered chat template: the text as `encode` reads it, except
    stretches between two `plain_mark`s, whose special-token texts are plain text. Ends are character offsets in
    the text without the marks."""
    ids: list[int] = []
    ends: list[int] = []
    shift = 0
    for k, stretch in enumerate(text.split(plain_mark)):
      if not stretch:
        continue
      self._tok.encode_special_tokens = bool(k % 2)
      try:
        encoding = self._tok.encode(stretch, add_special_tokens=False)
      finally:
        self._tok.encode_special_tokens = False
      ids += encoding.ids
      ends += [shift + end for _, end in encoding.offsets]
      shift += len(stretch)
    return ids, ends

  def encode_batch(self, texts: Sequence[str], threads: int = -1) -> list[list[int]]:
    """Encodes many texts on the tokenizers thread pool (threads=1: on the calling thread), without bos/eos."""
    texts = self._check_texts(texts)
    if threads == 1:
      return [self._tok.encode(text, add_special_tokens=False).ids for text in texts]
    return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of a 1-d sequence of ids; special tokens decode to nothing (``skip_special_tokens``)."""
    ids_array = self._check_ids(ids)
    return "" if ids_array is None else self._tok.decode(ids_array.tolist(), skip_special_tokens=True)

  def id_to_piece(self, token_id: int) -> str:
    """The vocabulary entry of one id ("Ġthe", "<|eot_id|>")."""
    return self._tok.id_to_token(int(token_id))

  def token_byte_lengths(self) -> np.ndarray:
    """[vocab_size] int32: UTF-8 bytes of decoded text per token, for bits per byte.

    Byte-level BPE: each character of a piece stands for one byte, so summed over ``encode(s)`` the table gives
    ``len(s.encode("utf-8"))`` exactly. Sentencepiece-style (Metaspace, byte fallback): as the sentencepiece back end,
    the prefix space counted. Special tokens count 0 bytes; other added tokens their text."""
    kinds = _decoder_kinds(self._spec.get("decoder"))
    byte_level = "ByteLevel" in kinds
    if not byte_level and not kinds & {"Metaspace", "Replace", "ByteFallback"}:
      raise TokenizerError(
        f"{self.path}: bits per byte needs a byte-level or sentencepiece-style tokenizer; its decoder is "
        f"{sorted(kinds) or 'none'}"
      )
    lengths = np.zeros(self.vocab_size, dtype=np.int32)
    added = self._tok.get_added_tokens_decoder()
    byte_of_char = _byte_of_char()
    for token_id in range(self.vocab_size):
      if token_id in added:
        lengths[token_id] = 0 if added[token_id].special else len(added[token_id].content.encode("utf-8"))
        continue
      piece = self._tok.id_to_token(token_id)
      if piece is None:
        continue
      if byte_level:
        lengths[token_id] = sum(1 if c in byte_of_char else len(c.encode("utf-8")) for c in piece)
      elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        lengths[token_id] = 1
      else:
        lengths[token_id] = len(piece.replace(_SPACE, " ").encode("utf-8"))
    return lengths

  def serialized(self) -> bytes:
    """tokenizer.json and tokenizer_config.json (its special tokens decide bos and eos)."""
    return self._json + b"\0" + self._side_files.get(TOKENIZER_CONFIG_FILE, b"")

  def main_file_bytes(self) -> bytes:
    return self._json
