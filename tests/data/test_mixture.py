"""Weighted mixtures of text sources: each source prepared to its own shard, windows drawn by weight (shares of
windows, so of tokens) within 1% over 10,000 windows, the same global batches for any process count, a micro run
from a mixture given on the command line, and bad weights refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from llama_jax.core.checks import ConfigError
from llama_jax.core.run_config import DataConfig
from llama_jax.data import text
from llama_jax.data.sources import DataError
from llama_jax.data.tokenization import Tokenizer
from tests.conftest import META_TOKENIZER, needs_shakespeare
from tests.runs import assert_one_line_error, run_train, train_in_process

WORDS = ("apple banana cherry", "river stone valley", "cloud thunder storm")
WEIGHTS = (0.5, 0.3, 0.2)
SEQ_LEN, BATCH = 16, 8


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
  """(prepared dir, tokenizer, the token ids of each component's words) of three sources of distinct words, in three
  formats, of very different sizes."""
  root = tmp_path_factory.mktemp("mixture")
  sizes = (40, 400, 9)  # documents per source: the smallest one is repeated most
  specs = []
  for k, (words, n) in enumerate(zip(WORDS, sizes)):
    folder = root / f"source{k}"
    folder.mkdir()
    for i in range(n):
      (folder / f"{i:04d}.txt").write_text(" ".join([words] * (3 + i % 5)))
    specs.append(str(folder))
  tokenizer = Tokenizer(META_TOKENIZER)
  prepared = str(root / "prepared")
  meta = text.prepare(specs, (), tokenizer, prepared, mixture=True)
  assert [c["split"] for c in meta["components"]] == ["train-00", "train-01", "train-02"]
  assert meta["train"]["documents"] == sum(sizes)
  vocab = [set(tokenizer.encode(w)) for w in WORDS]
  return prepared, tokenizer, vocab


def component_of(window: np.ndarray, tokenizer, vocab) -> int:
  ids = set(window.tolist()) - {tokenizer.bos_id, tokenizer.eos_id}
  (k,) = [k for k, v in enumerate(vocab) if ids <= v]
  return k


def test_windows_are_drawn_in_the_weights_shares(mixture):
  prepared, tokenizer, vocab = mixture
  dataset = text.train_dataset(prepared, SEQ_LEN, BATCH, seed=3, weights=WEIGHTS)
  windows = np.concatenate([dataset[i]["inputs"] for i in range(10_000 // BATCH)])
  counts = np.bincount([component_of(w, tokenizer, vocab) for w in windows], minlength=3)
  shares = counts / counts.sum()
  np.testing.assert_allclose(shares, WEIGHTS, atol=0.01)


def test_the_same_global_batches_for_any_process_count_and_seed_decides(mixture):
  prepared, _, _ = mixture
  one = text.train_dataset(prepared, SEQ_LEN, BATCH, seed=3, weights=WEIGHTS)
  two = [text.train_dataset(prepared, SEQ_LEN, BATCH, 3, p, 2, WEIGHTS) for p in range(2)]
  for i in (0, 1, 57, 10**6):
    joined = np.concatenate([two[0][i]["inputs"], two[1][i]["inputs"]])
    np.testing.assert_array_equal(joined, one[i]["inputs"])
  other_seed = text.train_dataset(prepared, SEQ_LEN, BATCH, seed=4, weights=WEIGHTS)
  assert not np.array_equal(other_seed[0]["inputs"], one[0]["inputs"])


def test_a_mixture_needs_its_weights(mixture):
  prepared, _, _ = mixture
  with pytest.raises(DataError, match="holds a mixture of 3 sources; give data.sources their weights"):
    text.train_dataset(prepared, SEQ_LEN, BATCH, seed=3)


@pytest.mark.parametrize(
  "sources, message",
  [
    ((("a", 0.5), "b"), "give every source a weight"),
    ((("a", 0.0), ("b", 1.0)), "a weighted source is (spec, weight > 0)"),
    ((("a", -1), ("b", 1.0)), "a weighted source is (spec, weight > 0)"),
    ((("a", 1.0, 2), ("b", 1.0)), "a weighted source is (spec, weight > 0)"),
    ((("a", 1.0), ("a", 2.0)), "a mixture names a source twice"),
    ((), "data.sources must name at least one source"),
  ],
)
def test_bad_weights_are_refused(sources, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    DataConfig(sources=sources)


def test_weights_normalise_and_json_lists_read_as_tuples():
  cfg = DataConfig(sources=[["a", 3], ["b", 1]])
  assert cfg.sources == (("a", 3.0), ("b", 1.0)) and cfg.specs == ("a", "b") and cfg.weights == (0.75, 0.25)
  assert DataConfig(sources=("a", "b")).weights is None
  with pytest.raises(ConfigError, match="data.sources with weights .* are for data.format='text'"):
    DataConfig(sources=(("a", 1.0),), format="chat")


@needs_shakespeare
def test_a_micro_run_trains_on_a_mixture_given_on_the_command_line(tmp_path, small_tokenizer, capfd):
  mixture = "--config.data.sources=(('shakespeare:sonnets', 0.8), ('shakespeare:tempest', 0.2))"
  result = run_train(tmp_path / "run", small_tokenizer, mixture)
  assert "(mixture by windows: shakespeare:sonnets" in result.stdout and "× 0.8" in result.stdout, result.stdout
  assert_one_line_error(
    train_in_process(capfd, tmp_path / "bad", small_tokenizer, "--config.data.sources=(('shakespeare', 0),)"),
    "a weighted source is (spec, weight > 0)",
  )
