"""The house rules of the package layout, checked rather than hoped for: the layers (import-linter's contracts), no
command line inside the library, no private name reached across modules, no llama_jax import hidden inside a
function, files of one concern, public names that resolve, and a layout page (docs/design/layout.md) that names
every folder, module and command there is."""

import ast
import importlib
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, skip_or_fail

PACKAGE = pathlib.Path(ROOT) / "llama_jax"
LAYERS = ("core", "model", "data", "checkpoint", "training", "inference", "serving", "interop", "analysis")
COMMANDS = (
  "train",
  "prepare",
  "sample",
  "evaluate",
  "serve",
  "convert",
  "plan",
  "viz",
  "tokenizer",
  "config",
  "preference_data",
)
MAX_FILE_LINES = 520  # STYLE.md: past ~600 lines a file usually holds two concerns; this counts code without docstrings


def modules():
  """(dotted name, path, syntax tree) of every module of the package."""
  for path in sorted(PACKAGE.rglob("*.py")):
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    yield name, path, ast.parse(path.read_text())


def library_modules():
  return [(name, path, tree) for name, path, tree in modules() if name.split(".")[1] in LAYERS]


def test_the_layers_hold_and_serving_does_not_know_training():
  """import-linter's contracts (pyproject.toml): each layer imports only from layers below it, the commands only sit
  on top, and serving and training stay independent. CI runs the same check beside ruff."""
  lint_imports = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
  if not os.path.exists(lint_imports):
    skip_or_fail("import-linter is not installed (pip install -e '.[test]')")
  result = subprocess.run([lint_imports], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
  assert "Contracts: 2 kept, 0 broken." in result.stdout, result.stdout[-2000:]


def test_library_modules_have_no_command_line():
  for name, _, tree in library_modules():
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "main" not in functions, f"{name} defines main(): commands live at the front door (llama_jax/<command>.py)"
    assert "__main__" not in ast.unparse(tree), f"{name} runs as a script: commands live at the front door"


def test_no_private_name_is_reached_across_modules():
  for name, _, tree in modules():
    aliases = {}
    for node in tree.body:
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llama_jax"):
        for alias in node.names:
          assert not alias.name.startswith("_"), f"{name} imports the private {node.module}.{alias.name}"
          aliases[alias.asname or alias.name] = node.module
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
        assert not node.attr.startswith("_"), f"{name} reaches the private {node.value.id}.{node.attr}"


def test_no_llama_jax_import_hides_inside_a_function():
  """A cycle is cut by moving the shared piece down, never by an import inside a function (third-party imports of
  optional extras may be local)."""
  for name, _, tree in modules():
    for function in ast.walk(tree):
      if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      for node in ast.walk(function):
        if isinstance(node, ast.ImportFrom):
          imported = [node.module or ""]
        elif isinstance(node, ast.Import):
          imported = [alias.name for alias in node.names]
        else:
          continue
        assert not any(m.startswith("llama_jax") for m in imported), f"{name}.{function.name} imports {imported}"


def lines_without_docstrings(path: pathlib.Path, tree: ast.Module) -> int:
  """A module's lines less its docstrings': the API documentation mkdocstrings renders adds no concern."""
  documented = [
    tree,
    *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))),
  ]
  docstrings = set()
  for node in documented:
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
      docstrings.update(range(first.lineno, first.end_lineno + 1))
  return len(path.read_text().splitlines()) - len(docstrings)


def test_files_hold_one_concern():
  too_long = {name: lines_without_docstrings(path, tree) for name, path, tree in modules()}
  too_long = {name: n for name, n in too_long.items() if n > MAX_FILE_LINES}
  assert not too_long, f"files over {MAX_FILE_LINES} lines besides their docstrings: {too_long}"


@pytest.mark.parametrize("package", ["llama_jax", *(f"llama_jax.{layer}" for layer in LAYERS)])
def test_every_public_name_resolves(package):
  module = importlib.import_module(package)
  assert module.__all__, f"{package} names no public API"
  for name in module.__all__:
    assert getattr(module, name) is not None, f"{package}.{name}"


def layout_page() -> str:
  return (pathlib.Path(ROOT) / "docs/design/layout.md").read_text()


def test_the_layout_page_names_every_folder_module_and_command():
  """The documentation's layout table (docs/design/layout.md) has one line per layer folder, naming every module in
  it, and one line per command module; nothing it names is missing from the tree."""
  tour = layout_page()
  rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `llama_jax/([\w/.]+)` \| (.*) \|$", tour, flags=re.M)}
  for layer in LAYERS:
    assert f"{layer}/" in rows, f"the layout page has no line for llama_jax/{layer}/"
    files = sorted(p.stem for p in (PACKAGE / layer).glob("*.py") if p.stem != "__init__")
    named = set(re.findall(r"`(\w+)\.py`", rows[f"{layer}/"]))
    assert named == set(files), f"llama_jax/{layer}/: the tour names {sorted(named)}, the folder holds {files}"
  for command in COMMANDS:
    assert f"{command}.py" in rows, f"the layout page has no line for llama_jax/{command}.py"
  front_door = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__", "cli"}
  assert front_door == set(COMMANDS), f"commands at the front door: {sorted(front_door)}"
  for row in rows:
    assert (PACKAGE / row).exists(), f"the layout page names llama_jax/{row}, which does not exist"
