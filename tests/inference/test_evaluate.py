"""evaluate.py's word-level perplexity and loss by position, against sums computed by hand from the model itself."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llama_jax import cli
from llama_jax import evaluate as evaluate_lib
from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core.model_config import ModelConfig
from llama_jax.data import text as data_lib
from llama_jax.data.tokenization import Tokenizer
from llama_jax.inference import evaluation
from llama_jax.model import llama as model_lib
from tests.conftest import needs_shakespeare

pytestmark = needs_shakespeare
DOCUMENTS = ("the cat sat on the mat", "dogs  bark\nloudly")  # 6 + 3 whitespace-separated words


@pytest.fixture(scope="module")
def setup(small_tokenizer, tmp_path_factory):
  root = tmp_path_factory.mktemp("evaluate")
  cfg = ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=64)
  model = model_lib.Llama(cfg, rngs=nnx.Rngs(6))
  directory = str(root / "ckpt")
  checkpoint_params.save_params_dir(
    directory, cfg, jax.device_get(nnx.to_pure_dict(nnx.state(model))), tokenizer_path=small_tokenizer
  )
  files = []
  for i, text in enumerate(DOCUMENTS):
    path = root / f"doc{i}.txt"
    path.write_text(text)
    files.append(str(path))
  return directory, files, model, Tokenizer(small_tokenizer)


def hand_nats(model, stream: np.ndarray, seq_len: int, n_windows: int) -> float:
  total = 0.0
  for w in range(n_windows):
    window = stream[w * seq_len : w * seq_len + seq_len + 1]
    logits = np.asarray(model(jnp.asarray(window[None, :-1]))[0], np.float64)
    peak = logits.max(-1, keepdims=True)
    log_z = peak + np.log(np.exp(logits - peak).sum(-1, keepdims=True))  # float64 log-sum-exp
    total -= (logits - log_z)[np.arange(seq_len), window[1:]].sum()
  return total


def test_word_perplexity_of_a_crafted_text_equals_the_hand_computation(setup):
  directory, files, model, tokenizer = setup
  ids = [tokenizer.encode(text) for text in DOCUMENTS]
  stream = np.asarray([t for doc in ids for t in (tokenizer.bos_id, *doc, tokenizer.eos_id)])
  seq_len = len(stream) - 1  # one window: every token after the first bos is scored, so all 9 words are
  metrics = evaluation.evaluate(directory, files, seq_len=seq_len, batch_size=2)
  assert metrics["words"] == 9 and metrics["tokens"] == seq_len
  nats = hand_nats(model, stream, seq_len, 1)
  assert metrics["loss"] * metrics["tokens"] == pytest.approx(nats, rel=1e-5)
  assert metrics["word_perplexity"] == pytest.approx(np.exp(nats / 9), rel=1e-5)
  assert metrics["perplexity"] == pytest.approx(np.exp(nats / seq_len), rel=1e-5)


def test_scored_words_count_exactly_the_scored_span(setup):
  _, _, _, tokenizer = setup
  ids = [tokenizer.encode(text) for text in DOCUMENTS]
  stream = np.asarray([t for doc in ids for t in (tokenizer.bos_id, *doc, tokenizer.eos_id)], np.int32)
  first = len(ids[0]) + 1  # targets of window 0: the first document and its eos
  windows = data_lib.TokenWindows(stream, first)
  assert evaluation.scored_words(windows, 1, tokenizer) == 6
  # One more token: the second document's bos, then nothing of its text yet.
  assert evaluation.scored_words(data_lib.TokenWindows(stream, first + 1), 1, tokenizer) == 6
  # The first token of "dogs" joins no word of the first document ("mat" + "dogs" decoded together would).
  assert evaluation.scored_words(data_lib.TokenWindows(stream, first + 2), 1, tokenizer) == 7
  assert evaluation.scored_words(data_lib.TokenWindows(stream, len(stream) - 1), 1, tokenizer) == 9


def test_loss_by_position_in_the_json_output(setup, tmp_path, capsys):
  directory, files, model, _ = setup
  out = tmp_path / "eval.json"
  argv = ["--checkpoint", directory, "--data", *files, "--seq_len", "4", "--batch_size", "2", "--json", str(out)]
  assert evaluate_lib.main([*argv, "--by_position"]) == 0
  assert "word perplexity" in capsys.readouterr().out
  metrics = json.loads(out.read_text())
  by_position = np.asarray(metrics["loss_by_position"])
  assert by_position.shape == (4,)
  windows = int(metrics["tokens"]) // 4
  assert np.mean(by_position) == pytest.approx(metrics["loss"], rel=1e-5)  # every position holds `windows` tokens
  assert windows >= 2
  with pytest.raises(SystemExit) as exit_info:
    evaluate_lib.main(["--checkpoint", directory, "--by_position"])
  assert exit_info.value.code == 2 and "--by_position writes a loss per position" in capsys.readouterr().err


def test_rope_override_reads_the_weights_at_other_frequencies(setup, tmp_path, small_tokenizer, capsys):
  """--rope: the loss is that of the same weights in a model built with the new rotary settings (RoPE has no
  weights), and differs from the checkpoint's own; bad keys and values are one line each, exit 2. Weights drawn
  10× wider than the default, so that positions move the loss well past the comparison's tolerance."""
  _, files, small, tokenizer = setup
  model = model_lib.Llama(small.cfg.replace(init_std=0.2), rngs=nnx.Rngs(6))
  directory = str(tmp_path / "wide")
  checkpoint_params.save_params_dir(
    directory, model.cfg, jax.device_get(nnx.to_pure_dict(nnx.state(model))), tokenizer_path=small_tokenizer
  )
  ids = [tokenizer.encode(text) for text in DOCUMENTS]
  stream = np.asarray([t for doc in ids for t in (tokenizer.bos_id, *doc, tokenizer.eos_id)])
  seq_len = len(stream) - 1
  rope = "theta=500000,scaling=llama3,factor=8,original_max_len=16,low_freq_factor=1,high_freq_factor=4"
  overrides = cli.parse_rope(rope)
  assert overrides == dict(
    rope_theta=500000.0,
    rope_scaling="llama3",
    rope_scaling_factor=8.0,
    rope_original_max_len=16,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
  )
  metrics = evaluation.evaluate(directory, files, seq_len=seq_len, batch_size=2, rope=overrides)
  scaled = model_lib.Llama(model.cfg.replace(**overrides), rngs=nnx.Rngs(6))  # the same weights (same seed)
  nats = hand_nats(scaled, stream, seq_len, 1)
  assert metrics["loss"] * metrics["tokens"] == pytest.approx(nats, rel=1e-5)
  own = evaluation.evaluate(directory, files, seq_len=seq_len, batch_size=2)
  assert abs(own["loss"] - metrics["loss"]) > 1e-2 * own["loss"], (own["loss"], metrics["loss"])
  for flag, message in (
    ("colour=1", "--rope takes KEY=VALUE items with KEY one of theta, scaling, factor"),
    ("factor=big", "--rope factor must be a number, got 'big'"),
    ("scaling=yarn", "rope_scaling must be one of none, linear, llama3"),
    ("theta=-1", "rope_theta must be a finite number > 0, got -1.0"),
  ):
    with pytest.raises(SystemExit) as exit_info:
      evaluate_lib.main(["--checkpoint", directory, "--data", *files, "--rope", flag])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
