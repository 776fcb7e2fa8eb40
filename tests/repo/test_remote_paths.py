"""Every workdir and checkpoint path goes through the one remote-aware helper (llama_jax/core/paths.py, etils.epath):
no ``os.path``, ``open`` or other local-filesystem call takes a workdir or checkpoint path as an argument, and no
module walks a directory tree by epath's ``walk``/``rglob``, which lose the ``gs://`` scheme or are refused on GCS
(paths.files_below lists instead). A gs:// workdir fails the first time one of these reaches it (the first save
did, through a walk, before tests/checkpoint/test_gcs_workdir.py existed)."""

import ast
import re

from tests.repo.test_layout import PACKAGE, modules

# Argument names that hold a workdir or checkpoint path: whole words of an identifier ("checkpoint_dir",
# "self.workdir", "base", "init_from"), not parts of others ("basename").
REMOTE_NAMES = re.compile(r"(^|_)(workdir|checkpoint|ckpt|run|init|base|steps|step|reference|directory)(_|$)")
LOCAL_CALLS = ("open", "glob.glob", "np.memmap")
LOCAL_PREFIXES = ("os.", "shutil.")
HELPER = "llama_jax.core.paths"  # the one place that decides local or remote


def _dotted(node) -> str:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    return f"{_dotted(node.value)}.{node.attr}"
  return ""


def local_calls_on_remote_paths(tree) -> list[str]:
  """'line: call(names)' for each local-filesystem call whose arguments name a workdir or checkpoint path."""
  found = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    name = _dotted(node.func)
    if not (name in LOCAL_CALLS or name.startswith(LOCAL_PREFIXES)):
      continue
    names = set()
    for argument in [*node.args, *(k.value for k in node.keywords)]:
      for sub in ast.walk(argument):
        names.add(sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else "")
    remote = sorted(n for n in names if n and REMOTE_NAMES.search(n))
    if remote:
      found.append(f"{node.lineno}: {name}({', '.join(remote)})")
  return found


def tree_walks(tree) -> list[str]:
  return [
    f"{node.lineno}: .{node.func.attr}()"
    for node in ast.walk(tree)
    if isinstance(node, ast.Call)
    and isinstance(node.func, ast.Attribute)
    and node.func.attr in ("walk", "rglob")
    and _dotted(node.func) != "os.walk"  # local directories the user names (a corpus); checked above otherwise
  ]


def test_no_local_filesystem_call_takes_a_workdir_or_checkpoint_path():
  offenders = {
    name: found for name, _, tree in modules() if name != HELPER and (found := local_calls_on_remote_paths(tree))
  }
  assert not offenders, f"use llama_jax.core.paths (paths.path, paths.local_file, ...) instead: {offenders}"


def test_no_module_walks_a_tree_but_the_helper():
  offenders = {name: found for name, _, tree in modules() if name != HELPER and (found := tree_walks(tree))}
  assert not offenders, f"list directories with paths.files_below: {offenders}"


def test_the_checks_catch_what_broke_on_gs():
  """The checks themselves: the patterns gs:// runs tripped on are found, local-only paths are not."""
  broken = ast.parse(
    "path = os.path.join(directory, TOKENIZER_FILE)\n"
    "ok = os.path.isfile(path) and os.path.exists(self.workdir)\n"
    "with open(os.path.join(checkpoint_dir, 'x')) as f: pass\n"
    "for root, _, names in step_dir.walk(): pass\n"
  )
  assert sorted({f.split(":")[0] for f in local_calls_on_remote_paths(broken)}) == ["1", "2", "3"]
  assert tree_walks(broken) == ["4: .walk()"]
  fine = ast.parse("os.path.basename(prompt_file)\nopen(os.path.join(prepared, 'val.bin'))\npaths.path(workdir, 'x')")
  assert local_calls_on_remote_paths(fine) == [] and tree_walks(fine) == []
  assert (PACKAGE / "core" / "paths.py").is_file()
