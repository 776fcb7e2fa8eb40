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
  """An error the user can fix: a bad value, a missing file, a mismatch; the message names the value and the fix.

  Every module's user-facing error (`ConfigError`, `CheckpointError` ...) derives from it and from `ValueError`. A
  command's `main` runs its work through `run_or_exit`, which reports it as one line on stderr and exit status 2; the
  server answers with `param` and `code` as the HTTP status and OpenAI's error fields, rather than reading the message.

  Args:
    message: what is wrong, naming the value, and how to fix it.
    param: the request field or flag at fault, or None.
    code: a short machine-readable kind of problem, or None.
  """

  def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.param, self.code = param, code


class FlagError(LlamaJaxError, ValueError):
  """A command-line flag's value is out of range; the message names the flag, the allowed range and the value.

  Raised by a command's own checks of its flags' values and reported like every `LlamaJaxError`: one line on stderr and
  exit status 2. The parsers' own errors, such as an unknown flag, go through ``llama_jax/cli.py`` instead.

  Args:
    message: the flag, the allowed range and the value given.
    param: the flag at fault, or None.
    code: a short machine-readable kind of problem, or None.
  """


def exit_with_error(message: str) -> NoReturn:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(EXIT_USER_ERROR)


def run_or_exit(fn: Callable[..., T], *args, **kwargs) -> T:
  """Calls ``fn(*args, **kwargs)``; a `LlamaJaxError` becomes ``error: <message>`` on stderr and exit status 2.

  The one error path of every command's `main`: an error the user can fix is reported as one line, while anything
  else, a bug, keeps its traceback.

  Args:
    fn: the command's work, called with the positional `args` and keyword `kwargs` that follow it.

  Returns:
    What `fn` returns.

  Raises:
    SystemExit: with status 2, when `fn` raises a `LlamaJaxError`.
  """
  try:
    return fn(*args, **kwargs)
  except LlamaJaxError as e:
    exit_with_error(str(e))
