"""No comment or docstring in llama_jax/ carries a measured figure: measurements go stale in code and belong to
BENCHMARKS.md ("Figures behind the code") or the docs, to which a comment may point. A measured figure here is a size
(GiB, MiB, GB, MB), a duration (ms, µs), a rate (tokens/s, GB/s), a decimal ratio (1.38×) or a change (0.32 → 0.21);
shapes and arithmetic (8 × data, 3 × forward) and device names ("80GB") are not."""

import ast
import io
import re
import tokenize

from tests.repo.test_layout import modules

MEASURED = re.compile(
  r"\d[\d,.]*\s+(GiB|MiB|GB|MB|ms|µs)\b"  # 4 GiB, 13 ms
  r"|\d[\d,.]*\s*(tok(en)?s?/s|GB/s|MB/s)"  # 1,168 tokens/s, 17 GB/s
  r"|\d+\.\d+\s?×"  # 2.05×, 3.41 ×
  r"|\d+\s?×\s+(faster|slower)"  # 3× faster
  r"|\d+\.\d+\s*→\s*\d+\.\d+"  # 0.32 → 0.21
)


def measured_figures(source: str) -> list[str]:
  """'line: text' of each comment and docstring of `source` that carries a measured figure."""
  found = []
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT and MEASURED.search(token.string):
      found.append(f"{token.start[0]}: {token.string.strip()}")
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      docstring = ast.get_docstring(node, clean=False) or ""
      for match in MEASURED.finditer(docstring):
        line = getattr(node, "lineno", 1)
        found.append(f"{line}: docstring ...{docstring[max(0, match.start() - 40) : match.end() + 20]!r}")
  return found


def test_the_pattern_finds_the_figures_it_is_for_and_passes_shapes_and_arithmetic():
  flagged = [
    "# they are 4 GiB per sequence",
    "# batch-1 decode step 13 → 5 ms",
    "# 8 steps against 4 gave 3.41× against 2.93×",
    "# ~17 GB/s from the page cache",
    "# 3× faster than ragged_dot",
    "# 1,168 tokens/s",
    "# temporaries 0.32 → 0.21 of one chip's",
  ]
  passed = ["# rows + 8 × data", "# forward + backward = 3 × forward", "# NVIDIA H100 80GB HBM3", "# 4×4×4 chips"]
  assert all(measured_figures(line + "\n") for line in flagged)
  assert not any(measured_figures(line + "\n") for line in passed)


def test_no_comment_or_docstring_in_the_library_carries_a_measured_figure():
  offenders = {name: found for name, path, _ in modules() if (found := measured_figures(path.read_text()))}
  assert not offenders, offenders
