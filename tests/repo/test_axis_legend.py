"""One axis legend for the whole package, written once (llama_jax/model/llama.py's module docstring) and used the same
everywhere: the shape suffix of an array name (`q_BTNH`) and the upper-case letters of an einsum take only its
letters, so a letter means one dimension wherever it is read. Every other dimension is spelled out; an einsum writes
it in lower case, explained in a comment of its function (`# r: LoRA rank`)."""

import ast
import io
import itertools
import re
import tokenize

from tests.repo.test_layout import PACKAGE, modules

MAX_LETTERS = 12  # past a dozen letters nobody holds the legend in their head, and letters start to mean two things


def legend() -> list[str]:
  """The legend's letters, in order: each `X meaning` of the indented block under "Axis legend" in llama.py's module
  docstring, one a line (a meaning's continuation lines indented further), or several on a line after a comma."""
  lines = ast.get_docstring(ast.parse((PACKAGE / "model" / "llama.py").read_text())).splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith("Axis legend")), len(lines))
  block = itertools.dropwhile(lambda line: not line.startswith("  "), lines[start:])
  block = "\n".join(itertools.takewhile(lambda line: line.startswith("  "), block))
  return re.findall(r"(?:^ +|[,;] )([A-Z]) (?=[^\s=])", block, flags=re.M)


def identifiers(tree: ast.AST):
  """(line, name) of every name the code binds or reads: variables, arguments, attributes, keywords, functions."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Name):
      yield node.lineno, node.id
    elif isinstance(node, ast.arg):
      yield node.lineno, node.arg
    elif isinstance(node, ast.Attribute):
      yield node.lineno, node.attr
    elif isinstance(node, ast.keyword) and node.arg:
      yield node.lineno, node.arg
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield node.lineno, node.name


def shape_letters(name: str) -> str:
  """The capitals of a lower-case name's shape suffixes: every `_` part after the first that holds one (`x_BTD`,
  `last_B1V`, and `received_PA_D` or `g_nBC` too). Constants and classes (`MAX_CHUNKS`, `KVCache`) have none."""
  if not name[:1].islower():
    return ""
  return "".join(c for part in name.split("_")[1:] if re.search("[A-Z]", part) for c in part if c.isupper())


def einsums(tree: ast.AST):
  """(call, its enclosing function or None, subscripts) of every einsum(...) whose subscripts are a string literal."""
  functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call) or not node.args:
      continue
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    spec = node.args[0]
    if name == "einsum" and isinstance(spec, ast.Constant) and isinstance(spec.value, str):
      around = [f for f in functions if f.lineno <= node.lineno and node.end_lineno <= f.end_lineno]
      yield node, max(around, key=lambda f: f.lineno, default=None), spec.value


def comments(source: str) -> dict[int, str]:
  return {
    tok.start[0]: tok.string
    for tok in tokenize.generate_tokens(io.StringIO(source).readline)
    if tok.type == tokenize.COMMENT
  }


def test_the_legend_is_short_says_each_letter_once_and_lives_in_llama_py():
  letters = legend()
  assert letters, "llama_jax/model/llama.py's docstring has no 'Axis legend' block of `  X meaning` lines"
  assert len(letters) == len(set(letters)), f"a letter defined twice: {letters}"
  assert len(letters) <= MAX_LETTERS, f"the legend has {len(letters)} letters, at most {MAX_LETTERS}: {letters}"
  elsewhere = [
    name for name, path, _ in modules() if "Axis legend" in path.read_text() and name != "llama_jax.model.llama"
  ]
  assert not elsewhere, f"modules with a legend of their own (point to llama.py's instead): {elsewhere}"


def test_shape_suffixes_use_only_the_legend():
  letters = set(legend())
  offenders = sorted(
    {
      f"{module}:{line}:{name}"
      for module, _, tree in modules()
      for line, name in identifiers(tree)
      if set(shape_letters(name)) - letters
    }
  )
  assert not offenders, (
    f"shape suffixes with letters outside the legend {''.join(sorted(letters))} (llama.py): name the array for "
    f"what it is and spell its other dimensions out in a comment:\n" + "\n".join(offenders)
  )


def test_einsums_use_the_legend_and_explain_their_other_letters():
  letters = set(legend())
  offenders = []
  for module, path, tree in modules():
    notes = comments(path.read_text())
    for call, function, spec in einsums(tree):
      where = f"{module}:{call.lineno}: {spec!r}"
      if outside := sorted(set(re.findall("[A-Z]", spec)) - letters):
        offenders.append(f"{where} has upper-case {outside} outside the legend")
      # A lower-case letter is a dimension the legend does not name: a comment of its function says which ("m: ...").
      first = function.lineno if function else 1
      said = " ".join(text for line, text in notes.items() if first <= line <= call.end_lineno)
      for letter in sorted(set(re.findall("[a-z]", spec))):
        if not re.search(rf"(?<![\w·]){letter}(, [a-z])*:", said):
          offenders.append(f"{where} uses {letter!r} with no comment saying what it is ('# {letter}: ...')")
  assert not offenders, "\n".join(offenders)
