"""What every ``python -m llama_jax.X`` shares on the command line: flag parsing that fails as one line and exit
status 2, the checked run config of a ``--config`` file, and the flags of the commands that load a model for decoding.
Not a command itself: the commands beside it import it.

Two parsers, one rule. Commands that take a run config file (``train``, ``plan``, ``prepare``, ``config``) use absl
flags with ml_collections' ``config_flags``: the only parser that applies ``--config.train.lr=1e-3`` overrides to a
Python config file; ``run_absl_command`` forgets their flags after each run, so their ``main(argv)`` can run again
in one process. The others (``sample``, ``evaluate``, ``convert``, ``tokenizer``) use ``argparse`` through
``ArgumentParser`` below, which has no global flag registry. Both report a bad flag as one line.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from absl import app, flags
from ml_collections import config_flags

from llama_jax.core.checks import ConfigError, did_you_mean
from llama_jax.core.errors import FlagError, exit_with_error
from llama_jax.core.model_config import DTYPES, QUANTIZE_MODES
from llama_jax.core.run_config import RunConfig, run_config_from


class ArgumentParser(argparse.ArgumentParser):
  """argparse with the project's error style: a bad flag is one line on stderr and exit status 2 (argparse's own
  error prints the whole usage first)."""

  def error(self, message: str) -> NoReturn:
    exit_with_error(f"{message} (see {self.prog} --help)")


def _override_hint(override: str) -> str:
  """' (did you mean train.steps?)' for an override of an unknown key such as --config.train.stpes=5."""
  path = override[len("--config.") :].split("=", 1)[0].split(".")
  if len(path) == 2 and path[0] in RunConfig.SECTIONS:
    return did_you_mean(path[0], path[1], [f.name for f in dataclasses.fields(RunConfig.SECTIONS[path[0]])])
  return did_you_mean("", path[0], [f.name for f in dataclasses.fields(RunConfig)])


def _flag_value(argv: list[str], name: str) -> str:
  for i, arg in enumerate(argv):
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
  return "?"


def parse_flags_or_exit(argv: list[str], known_only: bool = False) -> list[str]:
  """absl flag parsing (``flags_parser`` for ``app.run``) that turns a bad flag or ``--config.x=`` override into a
  one-line error and exit status 2, instead of a traceback. `known_only` leaves the flags absl does not know in the
  returned arguments (``prepare`` hands them to Beam)."""
  try:
    return flags.FLAGS(argv, known_only=known_only)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    cause = e
    while cause.__context__ is not None and isinstance(e, AttributeError):
      cause = cause.__context__  # ml_collections wraps the KeyError that holds the "did you mean" hint
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    if isinstance(cause, KeyError):
      # ml_collections' key error may carry its own multi-line "Did you mean"; keep the key, add ours.
      key = str(cause.args[0] if cause.args else cause).split("\n")[0].strip("'\" ")
      hints = "".join(_override_hint(o) for o in overrides if f".{key}" in o.split("=")[0])
      what = f"unknown config key {key!r}{hints}"
    elif "Traceback (most recent call last)" in str(cause):
      # The config file itself raised (config_flags wraps the traceback): its last line says what went wrong.
      exit_with_error(f"config file {_flag_value(argv, 'config')}: {str(cause).strip().splitlines()[-1]}")
    else:
      what = " ".join(str(cause).split())
    exit_with_error(f"bad flag or config override {overrides or argv[1:]}: {what}")


def define_config_flag(argv: list[str] | None, example: str) -> flags.FlagHolder:
  """The ``--config`` flag of a command that takes a run config file, required, with its ``--config.x.y=v``
  overrides read from `argv` (None: sys.argv) rather than always from sys.argv, so that main(argv) works in-process.

  Args:
    argv: the command line main was given, program name first, or None.
    example: a config file to name in --help.

  Returns:
    The flag's handle; its value is the config with the overrides applied.
  """
  holder = config_flags.DEFINE_config_file("config", None, f"run config file, e.g. {example}", sys_argv=argv)
  flags.mark_flags_as_required(["config"])
  return holder


def run_absl_command(
  run: Callable[[list[str]], Any], argv: list[str] | None, defined: Iterable[Any], known_only: bool = False
) -> None:
  """``app.run(run, argv)`` with parse_flags_or_exit, then the command's flags forgotten: `defined` (its DEFINE_*
  handles) and a config flag's ``--config.x.y`` overrides leave absl's global registry, which refuses a second
  definition of a name, so that the command's main(argv) can run again in the same process (tests, notebooks).

  Args:
    run: the command's body, given the arguments absl left.
    argv: the command line, program name first (None: sys.argv).
    defined: the FlagHolders the command's main defined before this call.
    known_only: leave flags absl does not know to `run` (``prepare`` hands them to Beam).

  Raises:
    SystemExit: always, as app.run does, with the command's exit status.
  """
  names = {holder.name for holder in defined}
  try:
    app.run(run, argv, flags_parser=lambda args: parse_flags_or_exit(args, known_only=known_only))
  finally:
    for name in list(flags.FLAGS):
      if name.split(".", 1)[0] in names:
        delattr(flags.FLAGS, name)


def run_config_from_flag_or_exit(config_flag) -> RunConfig:
  """The checked RunConfig of a ``DEFINE_config_file`` flag; a missing file or a bad value exits with status 2 and
  one line that names it (and the config file)."""
  try:
    return run_config_from(config_flag.value)
  except OSError as e:
    exit_with_error(f"cannot load config file {str(e).split()[-1]}")
  except ConfigError as e:
    exit_with_error(f"{flags.FLAGS['config'].config_filename}: {e}")


def add_model_flags(parser: ArgumentParser) -> None:
  """--step, --mesh, --dtype, --quantize: which step of a checkpoint is read and how it is placed for decoding
  (sample, chat, evaluate, serve)."""
  parser.add_argument(
    "--step", type=int, help="checkpoint step to read (default: the latest); an earlier one when the latest is damaged"
  )
  parser.add_argument(
    "--mesh",
    help="decode mesh, e.g. data=1,tensor=-1 (default: every device on tensor; weights split over tensor, "
    "batch rows over data)",
  )
  parser.add_argument("--dtype", choices=DTYPES, help="cast the weights (and compute) to this dtype at load")
  parser.add_argument(
    "--quantize",
    choices=QUANTIZE_MODES,
    default="none",
    help="int8: weight-only int8 with per-output-channel scales (memory; slower on CPU)",
  )


# --rope keys → ModelConfig fields (HF's rope_scaling dict names them the same way, less the prefix).
ROPE_KEYS = {
  "theta": "rope_theta",
  "scaling": "rope_scaling",
  "factor": "rope_scaling_factor",
  "original_max_len": "rope_original_max_len",
  "low_freq_factor": "rope_low_freq_factor",
  "high_freq_factor": "rope_high_freq_factor",
}


def parse_rope(text: str) -> dict:
  """`--rope theta=500000,scaling=llama3,factor=16,original_max_len=256` → ModelConfig field overrides. RoPE has no
  weights, so a checkpoint can be read at other frequencies: how a context extension is judged before (or without)
  training at the longer length. Values are checked by the model config itself once applied."""
  overrides = {}
  for item in filter(None, text.split(",")):
    key, sep, value = item.partition("=")
    if not sep or key.strip() not in ROPE_KEYS:
      raise FlagError(f"--rope takes KEY=VALUE items with KEY one of {', '.join(ROPE_KEYS)}; got {item!r}")
    field = ROPE_KEYS[key.strip()]
    value = value.strip()
    try:
      overrides[field] = value if field == "rope_scaling" else (int(value) if field.endswith("len") else float(value))
    except ValueError:
      raise FlagError(f"--rope {key.strip()} must be a number, got {value!r}") from None
  return overrides
