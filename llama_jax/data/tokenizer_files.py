"""Which tokenizer a directory holds, and loading it with the files that come with it.

A directory may hold a sentencepiece ``tokenizer.model`` (Meta's LLaMA 2, llama_jax's own trained tokenizers), an HF
``tokenizer.json``, or both (HF's Llama 2 exports): the sentencepiece model is the reference where there is one (the
two give the same ids for LLaMA 2; tests/data/test_hf_tokenizer.py), the ``tokenizer.json`` otherwise. Either back
end takes the side files (``paths.TOKENIZER_SIDE_FILES``): stop tokens and the chat template.
"""

from __future__ import annotations

import os

from llama_jax.core import paths
from llama_jax.data.hf_tokenizer import HFTokenizer
from llama_jax.data.tokenization import Tokenizer, TokenizerBase, TokenizerError


def side_files_in(directory: str) -> dict[str, bytes]:
  """The tokenizer's side files a directory (local or remote) holds, by name."""
  found = {}
  for name in paths.TOKENIZER_SIDE_FILES:
    path = paths.path(directory, name)
    if path.is_file():
      found[name] = path.read_bytes()
  return found


def tokenizer_files_in(directory: str) -> dict[str, bytes]:
  """Every tokenizer file a directory holds (tokenizer.model, tokenizer.json and the side files), by name: what a
  conversion or an export copies along."""
  found = {}
  for name in (paths.TOKENIZER_FILE, paths.HF_TOKENIZER_FILE):
    path = paths.path(directory, name)
    if path.is_file():
      found[name] = path.read_bytes()
  return {**found, **side_files_in(directory)}


def load_tokenizer_dir(directory: str) -> TokenizerBase | None:
  """The tokenizer of a checkpoint or model directory (local or remote) with its side files, or None when it holds
  neither tokenizer.model nor tokenizer.json."""
  model = paths.path(directory, paths.TOKENIZER_FILE)
  if model.is_file():
    return Tokenizer(paths.local_file(str(model)), side_files_in(directory), str(directory))
  hf_json = paths.path(directory, paths.HF_TOKENIZER_FILE)
  if hf_json.is_file():
    return HFTokenizer(hf_json.read_bytes(), side_files_in(directory), str(directory))
  return None


def load_tokenizer_path(path: str) -> TokenizerBase:
  """A tokenizer named by a path: a directory holding one, a tokenizer.json (with its directory's side files), or a
  sentencepiece model file."""
  where = paths.path(path)
  if where.is_dir():
    tokenizer = load_tokenizer_dir(path)
    if tokenizer is None:
      raise TokenizerError(f"{path!r} holds neither {paths.TOKENIZER_FILE} nor {paths.HF_TOKENIZER_FILE}")
    return tokenizer
  if not where.is_file():
    raise TokenizerError(f"tokenizer {path!r} does not exist")
  if str(path).endswith(".json"):
    directory = os.path.dirname(str(path))
    return HFTokenizer(where.read_bytes(), side_files_in(directory) if directory else {}, directory)
  return Tokenizer(paths.local_file(str(path)))
