"""The tiers' marks come from what a test's code reaches (tests/tiers.py): examples of each way to reach a resource,
and the suite's own tests on either side of the line."""

import contextlib
import subprocess
import types

from tests import gcs_emulator, live_server, runs, tiers


def marks(name: str, module=None) -> set[str]:
  """The marks of the function `name` (of this module, or `module`): looked up by name so that this test's own code
  does not reach the examples and take on their marks."""
  return tiers._Walker().function(vars(module)[name] if module else globals()[name])


def starts_a_process():
  subprocess.run(["true"], check=True)


def trains_through_a_helper(workdir, tokenizer):
  runs.run_train(workdir, tokenizer)


def calls_the_helper_that_trains():
  trains_through_a_helper("w", "t")


def makes_a_checkpoint_only(out):
  live_server.tiny_checkpoint(out, "tokenizer.model")


def serves_on_a_socket(app):
  with live_server.running(app):
    pass


def serves_through_the_helper(directory):
  with live_server.serving(directory):
    pass


def reaches_the_emulator():
  with gcs_emulator.running():
    pass


def starts_a_process_in_a_closure():
  def inner():
    return subprocess.Popen(["true"])

  return inner


class Runner:
  def go(self):
    return subprocess.check_output(["true"])


def uses_a_class_of_the_tests_package():
  Runner().go()


def computes_only():
  with contextlib.suppress(ValueError):
    return sum(range(3))


def test_each_way_of_reaching_a_resource_earns_its_mark():
  assert marks("starts_a_process") == {"process"}
  assert marks("calls_the_helper_that_trains") == {"process"}  # through two helpers into tests/runs.py
  assert marks("starts_a_process_in_a_closure") == {"process"}
  assert marks("uses_a_class_of_the_tests_package") == {"process"}
  assert marks("serves_on_a_socket") == {"server"}
  assert marks("serves_through_the_helper") == {"server"}
  assert "emulator" in marks("reaches_the_emulator")


def test_in_process_code_earns_no_mark_even_beside_a_resource_helper():
  assert marks("makes_a_checkpoint_only") == set()  # live_server's checkpoint helper serves nothing
  assert marks("computes_only") == set()


def asks_for_a_fixture_by_name(request):
  return request.getfixturevalue("a_fixture_that_starts_a_process")


def test_a_fixture_asked_for_by_name_in_the_body_gives_its_marks():
  """`request.getfixturevalue("name")`: the fixture is looked up for the test as pytest would, and followed."""
  definition = types.SimpleNamespace(argname="a_fixture_that_starts_a_process", func=starts_a_process)
  manager = types.SimpleNamespace(getfixturedefs=lambda name, item: [definition] if name == definition.argname else [])
  item = types.SimpleNamespace(
    nodeid="tests/x.py::t",
    function=asks_for_a_fixture_by_name,
    _fixtureinfo=None,
    session=types.SimpleNamespace(_fixturemanager=manager),
  )
  assert tiers.marks_of(item, tiers._Walker()) == {"process"}
  item.function = computes_only
  assert tiers.marks_of(item, tiers._Walker()) == set()


def test_the_suite_s_own_tests_fall_on_the_expected_side():
  from tests.model import test_llama
  from tests.serving import test_chat_page
  from tests.training import test_train

  assert marks("test_sigkill_after_a_checkpoint_then_rerun_is_bit_identical", test_train) == {"process"}
  assert marks("test_train_step_carries_named_scopes_for_profiles", test_train) == set()
  browser = tiers._Walker().function(vars(test_chat_page)["browser"])
  assert browser == {"browser"}  # selenium is imported inside the fixture's helper
  in_process = [name for name in vars(test_llama) if name.startswith("test_")]
  assert in_process and all(marks(name, test_llama) == set() for name in in_process)
