"""Value checks shared by every checked config (the run config's sections, the model config) and by other values a
user passes (sampling settings): one message style, naming the field, the allowed range and the value.

``check_type`` checks a dataclass field against its annotation; ``check_range`` and ``check_choice`` a value;
``did_you_mean`` finds the closest valid key for an unknown one.
"""

from __future__ import annotations

import difflib
import math
import typing
from typing import Any

from llama_jax.core.errors import LlamaJaxError


class ConfigError(LlamaJaxError, ValueError):
  """A configuration value is out of range; the message names the field and the value.

  Raised by the checks of every checked config, the run config's sections and the model config, and of other values a
  user passes, such as sampling settings: an unknown key, with the closest valid one, a value of the wrong type or
  outside its range or choices, or fields that contradict each other. Like every `LlamaJaxError`, a command reports it
  as one line on stderr and exit status 2.

  Args:
    message: the field at fault, the allowed values and the value given.
  """


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def did_you_mean(section: str, key: str, known) -> str:
  close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
  prefix = f"{section}." if section else ""
  return f" (did you mean {prefix}{close[0]}?)" if close else ""


def type_name(annotation: Any) -> str:
  return {int: "an integer", float: "a number", bool: "True or False", str: "a string"}[annotation]


def check_type(config: Any, section: str, name: str) -> None:
  """Checks one field against its annotation (int, float, bool, str, tuple[str|int, ...]); normalises ints given
  for floats and lists given for tuples (JSON has no tuples), so equal configs compare and hash equal."""
  annotation = typing.get_type_hints(type(config))[name]
  value = getattr(config, name)
  where = f"{section}.{name}" if section else name
  if typing.get_origin(annotation) is tuple:
    item = typing.get_args(annotation)[0]
    ok = isinstance(value, (tuple, list)) and all(
      isinstance(v, item) and not (item is int and isinstance(v, bool)) for v in value
    )
    if not ok:
      example = "('x',)" if item is str else "(1, 2)"
      raise ConfigError(
        f"{where} must be a tuple of {type_name(item).split()[-1]}s, e.g. {where}={example}, got {value!r}"
      )
    object.__setattr__(config, name, tuple(value))
    return
  ok = isinstance(value, annotation) and not (annotation is not bool and isinstance(value, bool))
  if annotation is float and isinstance(value, int) and not isinstance(value, bool):
    object.__setattr__(config, name, float(value))
    ok = True
  if not ok:
    raise ConfigError(f"{where} must be {type_name(annotation)}, got {value!r}")
  if annotation is float and not math.isfinite(value):
    raise ConfigError(f"{where} must be finite, got {value!r}")


def check_range(
  where: str,
  value: float,
  low: float | None = None,
  high: float | None = None,
  *,
  low_open: bool = False,
  high_open: bool = False,
) -> None:
  too_low = low is not None and (value <= low if low_open else value < low)
  too_high = high is not None and (value >= high if high_open else value > high)
  if too_low or too_high:
    if low is not None and high is not None:
      allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
      allowed = f"{'>' if low_open else '≥'} {low:g}"
    else:
      allowed = f"{'<' if high_open else '≤'} {high:g}"
    raise ConfigError(f"{where} must be {allowed}, got {value!r}")
