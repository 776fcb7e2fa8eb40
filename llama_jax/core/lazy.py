"""A package's public names, imported when first used: the ``__init__.py`` of llama_jax and of each layer names
what a user imports from it (``llama_jax.Llama``, ``llama_jax.training.train``) without importing it.

Why lazily: the layers stand on jax, flax, orbax and grain (seconds to import), and every ``python -m llama_jax.X``
imports its package's ``__init__`` first. Eager exports would make ``python -m llama_jax.tokenizer`` (sentencepiece
only) import all of them: 0.3 s became several seconds. A name is resolved once, then kept on the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def exports(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
  """(``__getattr__``, ``__dir__``) for `package`'s ``__init__``: `table` maps each public name to the module that
  defines it."""

  def __getattr__(name: str) -> object:
    if name not in table:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(table[name]), name)
    setattr(sys.modules[package], name, value)
    return value

  def __dir__() -> list[str]:
    return sorted(set(vars(sys.modules[package])) | set(table))

  return __getattr__, __dir__
