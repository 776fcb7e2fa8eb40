"""mkdocs hooks: the reference pages written from the code at build time, so they cannot drift from it.

- ``reference/config.md``: every field of every run-config section, from the dataclasses (type and default), the
  comment beside the field (what it means) and the section's own check (the allowed values, in the words of the
  error a bad value gets).
- ``reference/commands.md``: each command's ``--help``.
- ``reference/api.md``: each layer's public names, for mkdocstrings.
- ``index.md``, ``benchmarks.md`` and ``guides/launch.md``: README.md, BENCHMARKS.md and launch/README.md, where
  they live in the repository.

``tests/repo/test_docs.py`` checks the config page against the dataclasses.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import os
import pathlib
import re
import sys
import tokenize
import typing

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the pages describe this checkout's llama_jax, whatever else is installed
PROBES = {int: -(10**9), float: -1e30, str: "?not-a-value?"}


def _field_comments(cls) -> dict[str, str]:
  """The comment on each field's line (and the comment lines right above it), read from the class's source."""
  source = inspect.getsource(cls)
  comments, above, fields = {}, [], {}
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      text = tok.string.lstrip("#").strip()
      line = tok.line.strip()
      if line.startswith("#"):
        above.append(text)
      else:
        name = line.split(":", 1)[0].strip()
        fields.setdefault(name, []).append(text)
    elif tok.type == tokenize.NAME and tok.start[1] == 2 and tok.line.strip().startswith(f"{tok.string}:"):
      if above:
        fields.setdefault(tok.string, [])[:0] = above
      above = []
    elif tok.type == tokenize.NL and not tok.line.strip():
      above = []
  for name, texts in fields.items():
    comments[name] = " ".join(texts)
  return comments


def _allowed(cls, field: dataclasses.Field, hints: dict) -> str:
  """What the section's own check says a field accepts: the message of the error a bad value gets, from "must"
  to "got"; empty when a probe value passes or the field's type has no probe."""
  probe = PROBES.get(hints.get(field.name))
  if probe is None:
    return ""
  try:
    cls(**{field.name: probe})
  except Exception as error:  # noqa: BLE001  (any check's error: only its words are used)
    match = re.search(r"must (.*?)[,;]? got ", str(error))
    return match.group(1).strip().removeprefix("be ") if match else ""
  return ""


def _default(field: dataclasses.Field) -> str:
  if field.default is not dataclasses.MISSING:
    value = field.default
  elif field.default_factory is not dataclasses.MISSING:
    value = field.default_factory()
  else:
    return "(required)"
  if dataclasses.is_dataclass(value):
    return "(section below)"
  if len(repr(value)) > 80:  # the logical-axis rules: the table stays readable; the code has them
    return f"{len(value)} entries"
  return f"`{value!r}`"


def _type_name(hint) -> str:
  return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def config_sections() -> dict[str, type]:
  """Every run-config section by its dotted name, nested sections included (``train.lora``, ``model.moe``)."""
  from llama_jax.core.model_config import ModelConfig
  from llama_jax.core.run_config import RunConfig

  sections = {"": RunConfig}
  pending = [("model", ModelConfig), *RunConfig.SECTIONS.items()]
  while pending:
    name, cls = pending.pop(0)
    sections[name] = cls
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
      if dataclasses.is_dataclass(hints.get(field.name)):
        pending.append((f"{name}.{field.name}", hints[field.name]))
  return sections


def config_reference() -> str:
  """The run-config reference page: one table per section, a row per field."""
  lines = [
    "# Run-config reference",
    "",
    "Every field of a run config, written from the dataclasses in `llama_jax/core/model_config.py` and",
    "`llama_jax/core/run_config.py` when this site is built. *Allowed* is what the section's own check says when a",
    "value is out of range (the one-line error a bad value gets, exit status 2); set a field in a config file or with",
    "`--config.SECTION.FIELD=VALUE` on the command line. See the [run configs guide](../guides/run-configs.md).",
  ]
  for section, cls in config_sections().items():
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    title = f"`{section}`" if section else "The top level"
    doc = inspect.getdoc(cls) or ""
    lines += ["", f"## {title}", "", doc.split("\n\n")[0].replace("\n", " "), ""]
    lines += ["| field | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    for field in dataclasses.fields(cls):
      if field.name.startswith("_"):
        continue
      name = f"{section}.{field.name}" if section else field.name
      cells = [
        f"`{name}`",
        _type_name(hints.get(field.name)).replace("|", "\\|"),
        _default(field).replace("|", "\\|"),
        _allowed(cls, field, hints).replace("|", "\\|"),
        comments.get(field.name, "").replace("|", "\\|"),
      ]
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def commands_reference() -> str:
  """Each command's ``--help``, run in this process (the commands' main takes its arguments)."""
  from llama_jax.__main__ import ABSL_COMMANDS, ARGPARSE_COMMANDS

  lines = [
    "# Command reference",
    "",
    "Each command's `--help`, as the command prints it when this site is built. Every command also runs as",
    "`llama-jax COMMAND` (a console script) or `python -m llama_jax COMMAND`. Commands that take a run config file",
    "(`train`, `prepare`, `plan`, `config`) parse their flags with absl, whose `--config.SECTION.FIELD=VALUE`",
    "overrides change any field of the [run-config reference](config.md); the others with argparse. A bad flag is one",
    "line on stderr and exit status 2 in both.",
  ]
  for command in sorted(ABSL_COMMANDS + ARGPARSE_COMMANDS):
    module = importlib.import_module(f"llama_jax.{command}")
    argv = [f"python -m llama_jax.{command}", "--helpshort"] if command in ABSL_COMMANDS else ["--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
      module.main(argv)
    text = out.getvalue().replace(f"{ROOT}{os.sep}", "").rstrip()
    lines += ["", f"## {command}", "", "```text", text, "```"]
  return "\n".join(lines) + "\n"


LAYERS = ("core", "model", "data", "checkpoint", "training", "inference", "serving", "interop", "analysis")


def public_names(package: str) -> tuple[str, dict[str, str]]:
  """A package's docstring and its ``_PUBLIC`` map (name → defining module), read from this checkout's source."""
  tree = ast.parse((ROOT / package.replace(".", "/") / "__init__.py").read_text())
  public = next(
    node.value for node in tree.body if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_PUBLIC"
  )
  return ast.get_docstring(tree) or "", ast.literal_eval(public)


def api_reference() -> str:
  """The Python API page: each layer's public names (its ``__init__``'s ``_PUBLIC``), rendered by mkdocstrings."""
  lines = [
    "# Python API",
    "",
    "What a user imports: the names `llama_jax` and each layer's `__init__` export (imported when first used), with",
    "their docstrings. The [Python API guide](../guides/python-api.md) shows them in use.",
  ]
  for layer in ("", *LAYERS):
    package = f"llama_jax.{layer}" if layer else "llama_jax"
    doc, public = public_names(package)
    lines += ["", f"## `{package}`", "", doc.split("\n\n")[0].replace("\n", " "), ""]
    for name, module in sorted(public.items()):
      if not layer:  # the top level re-exports layers' names: a link to where its layer renders each
        rendered = public_names(f"llama_jax.{module.split('.')[1]}")[1][name]
        lines.append(f"- [`llama_jax.{name}`](#{rendered}.{name})")
      elif module.split(".")[1] == layer:
        lines += ["", f"::: {module}.{name}", "    options:", "      heading_level: 3"]
  return "\n".join(lines) + "\n"


def on_files(files, config):
  """mkdocs hook: add the generated pages to the site's files."""
  from mkdocs.structure.files import File

  pages = {
    "reference/config.md": config_reference(),
    "reference/commands.md": commands_reference(),
    "reference/api.md": api_reference(),
    # README.md is the home page; its links into docs/ become the site's own.
    "index.md": (ROOT / "README.md").read_text().replace("](docs/", "](").replace("BENCHMARKS.md)", "benchmarks.md)"),
    # Where they live in the repository, as they are (neither links to another file).
    "benchmarks.md": (ROOT / "BENCHMARKS.md").read_text(),
    "guides/launch.md": (ROOT / "launch/README.md").read_text(),
  }
  for path, content in pages.items():
    files.append(File.generated(config, path, content=content))
  return files
