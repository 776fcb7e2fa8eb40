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


def generation_config_in(directory: str) -> dict[str, bytes]:
  """{generation_config.json: its bytes} when the directory being converted has one (its eos_token_id stops
  decoding), else {}: copied along as it is."""
  path = paths.path(directory, paths.GENERATION_CONFIG_FILE)
  return {paths.GENERATION_CONFIG_FILE: path.read_bytes()} if path.is_file() else {}
