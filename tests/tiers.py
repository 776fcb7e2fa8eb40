"""The suite's two tiers, and the marks that put each test in one, derived from what the test uses.

The fast tier (`python -m pytest -q`) is every test that runs inside the pytest process; the full tier
(`python -m pytest -q --tier full`, then tests/multidevice on 8 simulated devices) adds the tests that start
processes, serve on a socket, talk to the GCS emulator, drive Chromium, run Beam or the TPU compiler. A test's marks
come from the code it can reach: its own body, the fixtures it requests, and every helper of the `tests` package (and
of `bench/`, whose scripts some tests drive) they call, followed transitively. A new test that calls `runs.run_train`
or opens `live_server.serving` is marked without anyone writing a mark.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import sys
import types

# What a test can use, by the module that provides it (a prefix of the module's name), and the mark it earns.
RESOURCE_MODULES = {
  "subprocess": "process",
  "multiprocessing": "process",
  "concurrent.futures.process": "process",
  "uvicorn": "server",
  "selenium": "browser",
  "apache_beam": "beam",
  "jax.experimental.topologies": "tpu_compiler",
  "libtpu": "tpu_compiler",
}
# The tests package's own doors to a resource, by module and name (their other helpers, such as
# live_server.tiny_checkpoint, are followed like any code), and the guards that declare a need by name.
RESOURCE_FUNCTIONS = {
  "tests.live_server.running": "server",
  "tests.gcs_emulator.running": "emulator",
  "tests.conftest.require_beam": "beam",
}
# Where a test's path alone says what it needs (8 simulated devices are set before jax starts).
RESOURCE_PATHS = {"tests/multidevice/": "multidevice", "tests/analysis/test_tpu_compile.py": "tpu_compiler"}

MARKS = {
  "process": "starts another process (a CLI run, a server, a nested interpreter)",
  "server": "serves on a loopback socket (uvicorn in a thread or a process)",
  "emulator": "talks to the GCS emulator (fake-gcs-server)",
  "browser": "drives headless Chromium through selenium",
  "beam": "runs an Apache Beam pipeline",
  "tpu_compiler": "compiles TPU programs with libtpu",
  "multidevice": "needs 8 simulated CPU devices (its own pytest process)",
  "slow": "in-process but slow (measured), kept out of the fast tier",
}
FULL = "full"  # the umbrella mark: any of MARKS
# Autouse fixtures that watch for a resource rather than use it (tests/conftest.py's process guard).
GUARDS = {"_processes_only_where_marked"}


def _resource(name: str) -> str | None:
  for prefix, mark in RESOURCE_MODULES.items():
    if name == prefix or name.startswith(prefix + "."):
      return mark
  return None


# The project's own code that tests call and that may start processes itself: followed like the tests' helpers.
FOLLOWED = ("tests", "bench")


def _in_tests(name: str | None) -> bool:
  return bool(name) and any(name == package or name.startswith(package + ".") for package in FOLLOWED)


def _codes(code: types.CodeType):
  """A code object and those nested in it (inner functions, comprehensions, lambdas)."""
  yield code
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      yield from _codes(const)


def _imports(code: types.CodeType) -> list:
  """What a function imports where it runs (`from selenium import webdriver` inside a helper): the modules, or the
  names taken from them."""
  found = []
  for inner in _codes(code):
    module = None
    for instruction in dis.get_instructions(inner):
      if instruction.opname == "IMPORT_NAME":
        module = instruction.argval
        if _in_tests(module) and module not in sys.modules:
          importlib.import_module(module)  # the suite's own helpers: safe to import, and needed to follow them
        found.append(sys.modules.get(module) or module)
      elif instruction.opname == "IMPORT_FROM" and module:
        if _in_tests(module) and f"{module}.{instruction.argval}" not in sys.modules:
          try:
            importlib.import_module(f"{module}.{instruction.argval}")
          except ImportError:  # a name defined in the module, not a submodule
            pass
        taken = sys.modules.get(f"{module}.{instruction.argval}")
        if taken is None:
          taken = getattr(sys.modules.get(module), instruction.argval, f"{module}.{instruction.argval}")
        found.append(taken)
  return found


class _Walker:
  """Follows a test's code into the tests package's helpers, collecting the marks of the resources it reaches."""

  def __init__(self):
    self.seen: set[int] = set()
    self.marks: dict[int, frozenset[str]] = {}

  def function(self, fn) -> set[str]:
    fn = inspect.unwrap(getattr(fn, "_get_wrapped_function", lambda: fn)())
    if not isinstance(fn, types.FunctionType) or id(fn) in self.seen:
      return set(self.marks.get(id(fn), ()))
    self.seen.add(id(fn))
    found: set[str] = set()
    names = {name for code in _codes(fn.__code__) for name in code.co_names}
    for imported in _imports(fn.__code__):
      if isinstance(imported, str):  # not imported yet in this process: judged by its name alone
        found |= {mark for mark in [_resource(imported)] if mark}
      else:
        found |= self.value(imported, names)
    scope = dict(fn.__globals__)
    for cell_name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
      try:
        scope[cell_name] = cell.cell_contents
      except ValueError:  # an empty cell: assigned later in the enclosing function
        pass
    names |= set(fn.__code__.co_freevars)
    for name in names:
      if name in scope:
        found |= self.value(scope[name], names)
    self.marks[id(fn)] = frozenset(found)
    return found

  def value(self, value, names: set[str]) -> set[str]:
    if isinstance(value, types.ModuleType):
      mark = _resource(value.__name__)
      if mark:
        return {mark}
      if _in_tests(value.__name__):
        # `runs.run_train(...)`: the attributes of a tests module that this code names.
        found: set[str] = set()
        for name in names:
          attribute = getattr(value, name, None)
          if attribute is not None and not isinstance(attribute, types.ModuleType):
            found |= self.value(attribute, set())
        return found
      return set()
    module = getattr(value, "__module__", None)
    if not isinstance(module, str):
      return set()
    mark = _resource(module)
    if mark:
      return {mark}
    if not _in_tests(module):
      return set()
    door = RESOURCE_FUNCTIONS.get(f"{module}.{getattr(value, '__qualname__', '')}")
    if door:
      return {door}
    if isinstance(value, type):
      found = set()
      for attribute in vars(value).values():
        if isinstance(attribute, (staticmethod, classmethod)):
          attribute = attribute.__func__
        if callable(attribute):
          found |= self.function(attribute)
      return found
    if callable(value):
      return self.function(value)
    return set()


def marks_of(item, walker: _Walker) -> set[str]:
  """The resource marks a collected test earns: from its path, its body and the fixtures it requests."""
  found = {mark for path, mark in RESOURCE_PATHS.items() if path in item.nodeid}
  function = getattr(item, "function", None)
  if function is not None:
    found |= walker.function(function)
  info = getattr(item, "_fixtureinfo", None)
  fixtures = list(info.name2fixturedefs.values()) if info else []
  if function is not None:
    fixtures += _requested_by_name(item, function)
  for definitions in fixtures:
    for definition in definitions:
      if definition.argname in GUARDS:
        continue
      if _in_tests(getattr(definition.func, "__module__", None)):
        found |= walker.function(definition.func)
  return found


def _requested_by_name(item, function) -> list:
  """The definitions of fixtures a test asks for in its body, `request.getfixturevalue("name")` (one case only)."""
  codes = list(_codes(inspect.unwrap(function).__code__))
  if not any("getfixturevalue" in code.co_names for code in codes):
    return []
  manager = item.session._fixturemanager
  names = {const for code in codes for const in code.co_consts if isinstance(const, str) and const.isidentifier()}
  return [definitions for name in sorted(names) if (definitions := manager.getfixturedefs(name, item))]


def apply(items, slow: set[str]) -> None:
  """Marks every item with its resources (and `slow` ones by node id) and, if any, with FULL."""
  import pytest

  walker = _Walker()
  for item in items:
    found = marks_of(item, walker)
    if item.nodeid in slow or item.nodeid.split("[")[0] in slow:
      found.add("slow")
    for mark in sorted(found):
      item.add_marker(getattr(pytest.mark, mark))
    if found:
      item.add_marker(getattr(pytest.mark, FULL))
