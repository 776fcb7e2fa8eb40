"""``llama-jax <command> [flags]`` (or ``python -m llama_jax <command>``): the same commands as
``python -m llama_jax.<command>``, under one name."""

from __future__ import annotations

import importlib
import sys

from llama_jax.core.errors import exit_with_error

# Commands whose flags are absl's (their main takes argv with the program name first) and those that take argparse's
# (argv without it).
ABSL_COMMANDS = ("train", "prepare", "plan", "config")
ARGPARSE_COMMANDS = ("sample", "evaluate", "serve", "convert", "viz", "tokenizer", "preference_data")


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  commands = sorted(ABSL_COMMANDS + ARGPARSE_COMMANDS)
  if not argv or argv[0] in ("-h", "--help"):
    print(
      f"usage: llama-jax COMMAND [flags]   (llama-jax COMMAND --help for its flags)\ncommands: {', '.join(commands)}"
    )
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command not in commands:
    exit_with_error(f"unknown command {command!r}; the commands are {', '.join(commands)}")
  # By name: only the command asked for is imported (each stands on different parts of the library).
  module = importlib.import_module(f"llama_jax.{command}")
  result = module.main([f"llama-jax {command}", *rest] if command in ABSL_COMMANDS else rest)
  return result or 0


if __name__ == "__main__":
  sys.exit(main())
