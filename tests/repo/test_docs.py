"""The front door and the documentation site: README stays short and its links land, and the site's generated
reference pages (docs/hooks.py, run by mkdocs at build time) cover every run-config field and every command.
`mkdocs build --strict` itself runs in CI (.ci/run) before the tests."""

import ast
import dataclasses
import importlib.util
import pathlib
import re
import typing

import pytest

from llama_jax.__main__ import ABSL_COMMANDS, ARGPARSE_COMMANDS
from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import RunConfig
from tests.conftest import ROOT

DOCS = pathlib.Path(ROOT) / "docs"


def load_hooks():
  """docs/hooks.py, the site's generator, as a module (it is not a package's)."""
  spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def hooks():
  return load_hooks()


def all_fields() -> list[str]:
  """Every field of the run config by its dotted name, walked here independently of the page's generator."""
  names = []

  def walk(prefix: str, cls) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
      name = f"{prefix}.{field.name}" if prefix else field.name
      names.append(name)
      if dataclasses.is_dataclass(hints[field.name]):
        walk(name, hints[field.name])

  walk("", RunConfig)
  assert "model.moe.top_k" in names and "train.lora.rank" in names
  return names


def test_the_config_reference_has_a_row_for_every_field_with_its_default(hooks):
  page = hooks.config_reference()
  rows = dict(re.findall(r"^\| `([\w.]+)` \| [^|]*(?:\\\|[^|]*)* \| (.*?) \|", page, flags=re.M))
  missing = [name for name in all_fields() if name not in rows]
  assert not missing, f"fields without a row in the config reference: {missing}"
  assert rows["train.lr"] == f"`{RunConfig().train.lr!r}`"
  assert rows["model.dim"] == f"`{ModelConfig().dim!r}`"


def test_the_config_reference_states_what_each_checked_field_allows_in_the_check_s_words(hooks):
  page = hooks.config_reference()
  row = next(line for line in page.splitlines() if line.startswith("| `model.attention` |"))
  assert "one of auto, xla, chunked, cudnn, splash" in row
  row = next(line for line in page.splitlines() if line.startswith("| `train.b2` |"))
  assert "in [0, 1)" in row


def test_the_commands_reference_holds_every_command_s_help(hooks):
  page = hooks.commands_reference()
  for command in ABSL_COMMANDS + ARGPARSE_COMMANDS:
    section = page.split(f"\n## {command}\n", 1)
    assert len(section) == 2, f"no section for {command}"
    body = section[1].split("\n## ", 1)[0]
    assert "--" in body and len(body.splitlines()) > 4, f"{command}'s --help is missing: {body[:200]}"
  assert str(ROOT) not in page


def test_the_readme_is_short_and_its_links_land():
  readme = (pathlib.Path(ROOT) / "README.md").read_text()
  assert len(readme.splitlines()) <= 200
  for link in re.findall(r"\]\(([^)#]+)\)", readme):
    assert (pathlib.Path(ROOT) / link).exists(), f"README links to {link}, which does not exist"


def test_every_page_in_the_site_s_navigation_is_written_or_generated(hooks):
  nav = re.findall(r": ([\w/.-]+\.md)$", (pathlib.Path(ROOT) / "mkdocs.yml").read_text(), flags=re.M)
  generated = {
    "index.md",
    "benchmarks.md",
    "guides/launch.md",
    *(f"reference/{p}.md" for p in ("config", "commands", "api")),
  }
  for page in nav:
    assert (DOCS / page).exists() or page in generated, f"mkdocs.yml names {page}, which nothing writes"
  written = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
  assert written <= set(nav), f"pages outside the navigation: {sorted(written - set(nav))}"


def public_definitions():
  """(qualified name, ast node) of every function and class a layer's ``__init__`` exports."""
  hooks_module = load_hooks()
  for layer in hooks_module.LAYERS:
    for name, module in hooks_module.public_names(f"llama_jax.{layer}")[1].items():
      tree = ast.parse((pathlib.Path(ROOT) / (module.replace(".", "/") + ".py")).read_text())
      node = next((n for n in tree.body if getattr(n, "name", None) == name), None)
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        yield f"{module}.{name}", node


def test_public_functions_and_classes_have_google_style_docstrings():
  """What the API reference renders: a function taking arguments documents them under Args: (and what it returns
  under Returns:); a class its constructor's arguments (Args:) or fields (Attributes:), a config section by pointing
  to the run-config reference that lists its fields, an error type by its docstring alone."""
  lacking = []
  for name, node in public_definitions():
    doc = ast.get_docstring(node) or ""
    if isinstance(node, ast.FunctionDef):
      params = [a.arg for a in node.args.args + node.args.kwonlyargs]
      returns = not (isinstance(node.returns, ast.Constant) and node.returns.value is None)
      if not doc or (params and "Args:" not in doc) or (returns and "Returns:" not in doc):
        lacking.append(name)
    elif not doc or not any(s in doc for s in ("Args:", "Attributes:", "run-config reference")) and "Error" not in name:
      lacking.append(name)
  assert not lacking, f"public names without Google-style docstrings: {lacking}"
