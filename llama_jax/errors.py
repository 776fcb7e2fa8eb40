"""The one error path of every ``python -m llama_jax.X``: a common base for errors a user can fix, and the wrapper
that turns them into one line on stderr and exit status 2.

Every module's user-facing error (``ConfigError``, ``DataError``, ``CheckpointError`` ...) derives from
``LlamaJaxError`` and from ``ValueError`` (what such an error is in Python terms). A CLI's ``main`` runs its work
through ``run_or_exit``; anything else (a bug) keeps its traceback. Flag parsing is in ``cli.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T")
EXIT_USER_ERROR = 2


class LlamaJaxError(Exception):
  """An error the user can fix (a bad value, a missing file, a mismatch): the message names the value and the fix."""


def exit_with_error(message: str) -> NoReturn:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(EXIT_USER_ERROR)


def run_or_exit(fn: Callable[..., T], *args, **kwargs) -> T:
  """fn(*args, **kwargs); a LlamaJaxError becomes ``error: <message>`` on stderr and exit status 2."""
  try:
    return fn(*args, **kwargs)
  except LlamaJaxError as e:
    exit_with_error(str(e))
