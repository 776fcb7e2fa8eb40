"""The one error path of every ``python -m llama_jax.X``: a common base for errors a user can fix, and the wrapper
that turns them into one line on stderr and exit status 2.

Every module's user-facing error (``ConfigError``, ``DataError``, ``CheckpointError`` ...) derives from
``LlamaJaxError`` and from ``ValueError`` (what such an error is in Python terms). A command's ``main`` runs its work
through ``run_or_exit``; anything else (a bug) keeps its traceback. A bad flag value is a ``FlagError`` raised by the
command and reported the same way; the parsers' own errors (an unknown flag) go through ``llama_jax/cli.py``.

An error may say which request field it is about (``param``) and what kind of problem it is (``code``): the server
answers with them (HTTP status and OpenAI's error fields) rather than reading the message.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T")
EXIT_USER_ERROR = 2


class LlamaJaxError(Exception):
  """An error the user can fix (a bad value, a missing file, a mismatch): the message names the value and the fix.
  `param` (the field or flag at fault) and `code` (a short machine-readable kind) are optional."""

  def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.param, self.code = param, code


class FlagError(LlamaJaxError, ValueError):
  """A command-line flag's value is out of range; the message names the flag, the allowed range and the value."""


def exit_with_error(message: str) -> NoReturn:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(EXIT_USER_ERROR)


def run_or_exit(fn: Callable[..., T], *args, **kwargs) -> T:
  """fn(*args, **kwargs); a LlamaJaxError becomes ``error: <message>`` on stderr and exit status 2."""
  try:
    return fn(*args, **kwargs)
  except LlamaJaxError as e:
    exit_with_error(str(e))
