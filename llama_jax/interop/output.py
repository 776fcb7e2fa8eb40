"""What every conversion shares: its one-line error, and a new output directory that is written beside its final
name and renamed into place, so a failed conversion leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator

from llama_jax.core import paths
from llama_jax.core.errors import LlamaJaxError
from llama_jax.data.tokenizer_files import load_tokenizer_dir, tokenizer_files_in


class ConvertError(LlamaJaxError, ValueError):
  """The input cannot be converted; the message names the file, tensor or value."""


def check_new_output(out_dir: str) -> None:
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise ConvertError(f"output directory {out_dir!r} exists and is not empty; choose a new one")


@contextlib.contextmanager
def new_output_dir(out_dir: str) -> Iterator[str]:
  """A scratch directory beside `out_dir`, renamed to it on success and removed on any error: a failed conversion
  leaves nothing behind."""
  check_new_output(out_dir)
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  # mkdir, not mkdtemp: mkdtemp's mode 0700 would become the output's; this one gets the umask's, as any new directory.
  scratch = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.partial-{uuid.uuid4().hex[:12]}")
  os.mkdir(scratch)
  try:
    yield scratch
    if os.path.isdir(out_dir):
      os.rmdir(out_dir)  # empty, checked above
    os.rename(scratch, out_dir)
  except BaseException:
    shutil.rmtree(scratch, ignore_errors=True)
    raise


def tokenizer_in(directory: str) -> str | None:
  """The tokenizer file of a directory being converted (local or remote; a local copy of a remote one), or None: it
  is copied along when there is one."""
  path = paths.path(directory, paths.TOKENIZER_FILE)
  return paths.local_file(str(path)) if path.is_file() else None


def check_tokenizer(directory: str, vocab_rows: int) -> None:
  """Loads the tokenizer a directory being converted holds, if any, so that a broken one (bad JSON, a chat template
  that does not compile, a special token outside its vocabulary) or one with more tokens than the model has
  embedding rows fails the conversion before anything is written."""
  tokenizer = load_tokenizer_dir(directory)
  if tokenizer is not None and tokenizer.vocab_size > vocab_rows:
    raise ConvertError(
      f"{tokenizer.path} has {tokenizer.vocab_size} tokens but the model's embedding has {vocab_rows} rows: "
      "they are not the same model's"
    )


def tokenizer_extras_in(directory: str) -> dict[str, bytes]:
  """The tokenizer files of a directory being converted other than tokenizer.model, by name: tokenizer.json and the
  side files (tokenizer_config.json with the chat template, chat_template.jinja, special_tokens_map.json,
  generation_config.json), copied along as they are."""
  return {name: data for name, data in tokenizer_files_in(directory).items() if name != paths.TOKENIZER_FILE}
