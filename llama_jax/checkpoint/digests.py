"""Digests of checkpoint steps: what each file of a step held when it was saved, and the checks that read them.

Each step carries ``checkpoints/<step>/digests.json``: the size and sha256 of every file of its items, written once
they are all written (for async saves before the rename that makes the step visible). Reading a step checks them
first, so a truncated, deleted or overwritten file is named instead of read; a step without the file (written by an
older version) is read unchecked.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable

from etils import epath

from llama_jax.core import paths
from llama_jax.core.errors import LlamaJaxError

_HASH_CHUNK = 1 << 22


class CheckpointError(LlamaJaxError, ValueError):
  """A checkpoint directory is missing, incomplete or does not match; the message names the path.

  Raised where checkpoints are read or written: a directory with no model config or no complete step, a step whose
  files differ from its digests (naming the file and the ``--step`` of an earlier one), files orbax cannot read,
  parameters holding NaN or infinity, a model that does not match the run's, or a save that cannot be written. Like
  every `LlamaJaxError`, a command reports it as one line on stderr and exit status 2.

  Args:
    message: what is wrong, naming the directory or file, and what to do.
  """


def _item_files(step_dir: epath.Path) -> Iterable[tuple[str, epath.Path]]:
  """(path relative to the step, path) of every file inside the step's items, sorted. Files at the step's top level
  (orbax's _CHECKPOINT_METADATA and commit_success.txt, digests.json itself) are left out: orbax rewrites the first
  two while committing, after the digests are taken."""
  return sorted(
    (relative, path)
    for relative, path in paths.files_below(step_dir)
    if "/" in relative  # inside an item
  )


def _sha256(path: epath.Path) -> str:
  digest = hashlib.sha256()
  with path.open("rb") as f:
    while chunk := f.read(_HASH_CHUNK):
      digest.update(chunk)
  return digest.hexdigest()


def write_digests(step_dir: epath.Path) -> None:
  """Writes `step_dir`/digests.json (size and sha256 of every item file), whole then renamed: never half a list."""
  step_dir = epath.Path(step_dir)
  files = {rel: {"bytes": path.stat().length, "sha256": _sha256(path)} for rel, path in _item_files(step_dir)}
  paths.write_atomically(step_dir / paths.DIGESTS_FILE, json.dumps({"algorithm": "sha256", "files": files}, indent=1))


def step_damage(step_dir: epath.Path, items: Iterable[str] | None = None) -> str | None:
  """Why the files of a step (of `items`, default all) differ from its digests.json, naming the first such file; None
  when they match, or when the step has no digests.json (steps written before there were digests are not checked)."""
  step_dir = epath.Path(step_dir)
  manifest = step_dir / paths.DIGESTS_FILE
  if not manifest.exists():
    return None
  try:
    files = json.loads(manifest.read_text())["files"]
    expected = {rel: (int(want["bytes"]), str(want["sha256"])) for rel, want in files.items()}
  except (ValueError, KeyError, TypeError, AttributeError):
    return f"{paths.DIGESTS_FILE} is unreadable"
  wanted = None if items is None else set(items)
  for rel, (size, sha256) in sorted(expected.items()):
    if wanted is not None and rel.split("/")[0] not in wanted:
      continue
    path = step_dir / rel
    if not path.is_file():
      return f"{rel} is missing"
    actual = path.stat().length
    if actual != size:
      return f"{rel} is {actual} bytes, {size} when saved"
    if _sha256(path) != sha256:
      return f"{rel} does not match its sha256 digest (its content changed after the save)"
  return None


def checked_step(directory: str, steps: Iterable[int], step: int | None, items: Iterable[str]) -> int:
  """The latest (or given) step of `steps` after checking its digests: a damaged step is refused with the file that
  differs and the --step that would read an earlier one."""
  steps = sorted(steps)
  if not steps:
    raise CheckpointError(f"checkpoint directory {directory!r} holds no complete checkpoint step")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise CheckpointError(f"checkpoint directory {directory!r} has no step {step}; it has {steps}")
  reason = step_damage(paths.step_path(directory, step), items)
  if reason is not None:
    raise CheckpointError(
      f"checkpoint directory {directory!r} step {step} is damaged: {reason}; {_earlier(steps, step)}"
    )
  return step


def _earlier(steps: list[int], step: int) -> str:
  older = [s for s in steps if s < step]
  return f"pass --step {older[-1]} to read an earlier step" if older else "there is no earlier step to read"


@contextlib.contextmanager
def restore_errors(directory: str, step: int):
  """Turns what orbax raises on files it cannot read (a step written before there were digests, or damage the
  digests do not cover) into a CheckpointError naming the step: one line, not a tensorstore traceback."""
  try:
    yield
  except (ValueError, OSError, KeyError) as e:
    if isinstance(e, CheckpointError):
      raise
    raise CheckpointError(
      f"checkpoint directory {directory!r} step {step} could not be read ({first_line(e)}); pass --step N "
      f"for an earlier step"
    ) from None


def first_line(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0] if text else ''}"[:500]
