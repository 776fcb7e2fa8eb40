"""Where things are: the names of the files a workdir or checkpoint directory holds, and the one way to reach a path
that may be local or remote (``gs://bucket/run``).

Layout of a checkpoint directory (from training or from ``convert --from_hf``):

    DIR/model_config.json      the ModelConfig (everything needed to rebuild the model)
    DIR/tokenizer.model        the sentencepiece model, when there is one
    DIR/run_config.json        the run config, when the directory is a training workdir
    DIR/lora.json              a LoRA workdir: the adapter settings and the base checkpoint step they adapt
    DIR/reference.json         a full DPO workdir: the checkpoint step of its frozen reference model
    DIR/metrics.jsonl          training metrics, one JSON line per logged step (and evaluation)
    DIR/batches.jsonl          with train.record_batches: each step's batch digest
    DIR/goodput.json           where the run's time went, per session (training/goodput.py)
    DIR/trackers.json          the W&B and MLflow runs this workdir logs to, so a resume continues them
    DIR/run.lock               held while a run writes here (checkpoint/workdir_lock.py)
    DIR/checkpoints/<step>/    orbax CheckpointManager steps, each with its digests.json

Everything written to a workdir goes through ``etils.epath`` (or orbax), which reaches local and remote paths alike.
What must be local (memory-mapped token shards, a tokenizer being trained, a file read by a library that takes only
local paths) goes to ``local_dir``, a cache directory named after a remote workdir; ``local_file`` copies one remote
file there.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import IO

from etils import epath

CONFIG_FILE = "model_config.json"
RUN_CONFIG_FILE = "run_config.json"
TOKENIZER_FILE = "tokenizer.model"
# HF's generation settings; its eos_token_id (one id or a list: Llama 3 instruct ends turns with <|eot_id|>) stops
# decoding. Travels with the tokenizer: conversion, training workdirs and exports copy it.
GENERATION_CONFIG_FILE = "generation_config.json"
# An HF `tokenizers` tokenizer (byte-level BPE for Llama 3 and SmolLM2) and the files around it: special tokens and the
# chat template (in tokenizer_config.json, or in chat_template.jinja as current transformers saves it).
HF_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Copied with the tokenizer wherever it goes (conversion, training workdirs, exports), when present.
TOKENIZER_SIDE_FILES = (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, CHAT_TEMPLATE_FILE, GENERATION_CONFIG_FILE)
LORA_FILE = "lora.json"
REFERENCE_FILE = "reference.json"  # a full (not LoRA) DPO workdir's record of its reference model
METRICS_FILE = "metrics.jsonl"
BATCHES_FILE = "batches.jsonl"
GOODPUT_FILE = "goodput.json"
TRACKERS_FILE = "trackers.json"
LOCK_FILE = "run.lock"
STEPS_DIR = "checkpoints"
DIGESTS_FILE = "digests.json"


def cache_root() -> str:
  """Where local copies of remote things go: $XDG_CACHE_HOME/llama_jax, by default ~/.cache/llama_jax."""
  return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llama_jax")


def is_remote(path: str) -> bool:
  return "://" in str(path)


def path(directory: str, *names: str) -> epath.Path:
  """`directory`/`names`... as an epath.Path, which reads and writes local and remote (gs://) paths alike."""
  return epath.Path(directory).joinpath(*names)


def name(directory: str) -> str:
  """The last component of a directory's path, local or remote ("run" for "runs/run/", "gs://bucket/run")."""
  if is_remote(directory):
    return str(directory).rstrip("/").rsplit("/", 1)[-1]
  return os.path.basename(os.path.abspath(directory))


def steps_path(directory: str) -> str:
  """The orbax steps directory of a checkpoint directory: remote paths as they are, local ones made absolute (orbax
  requires it)."""
  return os.path.join(directory if is_remote(directory) else os.path.abspath(directory), STEPS_DIR)


def step_path(directory: str, step: int) -> epath.Path:
  return epath.Path(steps_path(directory)) / str(step)


def same_dir(recorded: str, given: str) -> bool:
  """Whether two spellings of a directory are the same directory (remote paths compared as written)."""
  if is_remote(recorded) or is_remote(given):
    return recorded.rstrip("/") == given.rstrip("/")
  return os.path.abspath(recorded) == os.path.abspath(given)


def absolute(directory: str) -> str:
  """A directory as a run records it: local paths absolute, remote ones as written."""
  return directory if is_remote(directory) else os.path.abspath(directory)


def local_dir(workdir: str, name: str) -> str:
  """`workdir/name` for a local workdir; for a remote one, a directory under cache_root() named after it."""
  if not is_remote(workdir):
    return os.path.join(workdir, name)
  key = hashlib.sha256(str(workdir).encode()).hexdigest()[:12]
  return os.path.join(cache_root(), f"{os.path.basename(str(workdir).rstrip('/'))}-{key}", name)


def local_file(file: str) -> str:
  """A local path holding `file` (copied into the local cache when `file` is remote)."""
  if not is_remote(file):
    return file
  local = os.path.join(local_dir(os.path.dirname(file), "files"), os.path.basename(file))
  os.makedirs(os.path.dirname(local), exist_ok=True)
  # Processes reading one gs:// run at once (sample, evaluate, viz, a server) share this cache: a copy rewritten in
  # place was read half written ("not a sentencepiece model").
  with atomic_write(local, "wb") as f:
    f.write(epath.Path(file).read_bytes())
  return local


def files_below(directory: str | epath.Path) -> Iterator[tuple[str, epath.Path]]:
  """(path relative to `directory` with "/" separators, path) of every file below it, local or remote. By listing
  each directory: epath's `walk` yields remote roots without their scheme ("bucket/run/..." for "gs://bucket/run/..."),
  and its recursive glob is refused on GCS."""
  directory = epath.Path(directory)
  for child in sorted(directory.iterdir()):
    if child.is_dir():
      yield from ((f"{child.name}/{relative}", path) for relative, path in files_below(child))
    else:
      yield child.name, child


def append_line(file: str, line: str) -> None:
  """Appends one line to a local or remote (gs://) file; object stores cannot append, so those are rewritten whole
  (metrics files are small)."""
  if is_remote(file):
    target = epath.Path(file)
    target.write_text((target.read_text() if target.exists() else "") + line + "\n")
    return
  with open(file, "a") as f:
    f.write(line + "\n")


def write_atomically(file: str | os.PathLike, content: bytes | str) -> None:
  """Writes `content` (text as UTF-8) to `file` whole, local or remote, through `atomic_write`.

  Args:
    file: the path to write.
    content: the file's whole content.
  """
  with atomic_write(file, "wb") as f:
    f.write(content.encode() if isinstance(content, str) else content)


@contextlib.contextmanager
def atomic_write(file: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
  """Opens `file` for writing so that readers see the old file or the whole new one, never part of it.

  A local file is written under a temporary name in its directory, unique to this process and call, then flushed to
  disk and renamed over `file`. A remote one (gs://) is written to a local temporary file and uploaded when the block
  ends: an object store creates an object only once its upload completes. Either way, an exception in the block
  leaves `file` as it was and removes the temporary file.

  Args:
    file: the path to write, local or remote.
    mode: "w" (text, UTF-8) or "wb".

  Yields:
    The open file to write to.

  Raises:
    ValueError: for a mode other than "w" and "wb".
    OSError: when the file cannot be written or renamed.
  """
  if mode not in ("w", "wb"):
    raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
  target = str(file)
  remote = is_remote(target)
  directory = tempfile.gettempdir() if remote else os.path.dirname(os.path.abspath(target))
  # A hidden name beside the target (the rename stays on one file system), unique to this process and call: two
  # processes or threads writing the same file never share a temporary one.
  tmp = os.path.join(directory, f".{os.path.basename(target)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
  try:
    with open(tmp, mode, encoding="utf-8" if mode == "w" else None) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    if remote:
      with open(tmp, "rb") as source, epath.Path(target).open("wb") as destination:
        shutil.copyfileobj(source, destination)
    else:
      os.replace(tmp, target)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
