"""Decoding: cached decode equals the full forward pass, greedy parity with transformers' generate, batching,
samplers, stopping, and the CLI."""

import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from llama_jax import sample
from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core import paths
from llama_jax.core.model_config import ModelConfig
from llama_jax.inference.sampler import Sampler, load_sampler
from llama_jax.inference.sampling import SampleError, SamplingConfig, filter_logits, next_token
from llama_jax.interop import hf as convert
from llama_jax.model.layer_layout import unstack_layers
from llama_jax.model.llama import KVCache, Llama
from tests import hf_utils, runs
from tests.conftest import ROOT

CONFIGS = {
  "mha": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, multiple_of=32, max_seq_len=256),
  "gqa": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=256),
}


def random_params(cfg, seed=0):
  return nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(seed))))


@pytest.mark.parametrize("layout", ["stacked", "unstacked_per_layer_cache"])
@pytest.mark.parametrize("name", CONFIGS)
def test_cached_decoding_logits_equal_one_full_forward(name, layout):
  """The stacked model (layer scan, stacked cache) and the decoding layout (separate layers, per-layer cache
  buffers, as the Sampler runs it) against one full forward of the stacked model."""
  cfg = CONFIGS[name]
  stacked = Llama(cfg, rngs=nnx.Rngs(1))
  model = stacked
  if layout != "stacked":
    model = nnx.merge(
      nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), stacked_layers=False))),
      unstack_layers(nnx.to_pure_dict(nnx.state(stacked))),
    )
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 40)))
  full = np.asarray(jax.jit(lambda t: stacked(t))(tokens))
  if layout != "stacked":
    np.testing.assert_allclose(np.asarray(jax.jit(lambda t: model(t))(tokens)), full, atol=1e-5, rtol=0)
  step = jax.jit(lambda t, p, c: model.decode(t, p, c))
  cache = KVCache.empty(cfg, 2, 48, per_layer=layout == "unstacked_per_layer_cache")
  logits, cache = step(tokens[:, :9], None, cache)  # a prompt of 9, then one token at a time
  got = [np.asarray(logits)]
  for t in range(9, 40):
    logits, cache = step(tokens[:, t : t + 1], jnp.full((2, 1), t, jnp.int32), cache)
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, axis=1), full, atol=1e-5, rtol=0)


def test_stacked_model_refuses_a_per_layer_cache():
  cfg = CONFIGS["mha"]
  with pytest.raises(ValueError, match=r"a per-layer KV cache needs Llama\(stacked_layers=False\)"):
    Llama(cfg, rngs=nnx.Rngs(0)).decode(jnp.zeros((1, 1), jnp.int32), None, KVCache.empty(cfg, 1, 8, per_layer=True))


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_of_a_converted_hf_model_equals_transformers_generate(name, tmp_path):
  cfg = CONFIGS[name]
  hf_model = hf_utils.random_hf_model(cfg, seed=3)
  hf_model.save_pretrained(str(tmp_path / "hf"))
  convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
  loaded_cfg, params = checkpoint_params.load_params(str(tmp_path / "ckpt"))
  prompt = np.random.RandomState(1).randint(3, cfg.vocab_size, 12)
  hf_model.generation_config.eos_token_id = None  # random weights: compare all 64 tokens, no early stop
  with torch.no_grad():
    expected = hf_model.generate(
      torch.tensor(prompt[None]), do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0
    )[0, len(prompt) :].numpy()
  ours = Sampler(loaded_cfg, params, eos_id=-1).generate([prompt.tolist()], 64)[0]
  assert ours == expected.tolist()


def test_each_row_of_a_ragged_batch_gets_what_its_prompt_gets_alone():
  cfg = CONFIGS["gqa"]
  sampler = Sampler(cfg, random_params(cfg), eos_id=-1)
  rng = np.random.RandomState(2)
  prompts = [rng.randint(3, 256, n).tolist() for n in (3, 17, 9, 30)]
  batch = sampler.generate(prompts, 24)
  for prompt, row in zip(prompts, batch):
    assert sampler.generate([prompt], 24)[0] == row


@pytest.mark.parametrize("chunk", [4, 12, 100])
def test_chunked_prefill_gives_the_same_cache_and_tokens(chunk):
  """Prompts of 3..60 tokens (buckets 16..64) prefilled `chunk` tokens at a time: 12 leaves a shorter last chunk, 100
  is past the bucket (one call). The cache it fills (keys, values, slot positions of every layer) equals the
  one-call prefill's within float32 rounding, and greedy continuations are the same tokens."""
  cfg = CONFIGS["gqa"]
  params = random_params(cfg)
  whole, chunked = Sampler(cfg, params, eos_id=-1), Sampler(cfg, params, eos_id=-1, prefill_chunk=chunk)
  rng = np.random.RandomState(5)
  prompts = [rng.randint(3, 256, n).tolist() for n in (3, 17, 33, 60)]
  assert chunked.generate(prompts, 20) == whole.generate(prompts, 20)
  for prompt in prompts[1:]:
    assert chunked.generate([prompt], 12) == whole.generate([prompt], 12)
  # The caches: one prefill each way, straight from the compiled programs.
  filled = []
  for sampler in (whole, chunked):
    prefill_fn, _ = sampler._compiled(SamplingConfig(temperature=1.0), 4, (-1,))
    padded = np.zeros((1, 64), np.int32)
    padded[0, :60] = prompts[3]
    cache = sampler.empty_cache(1, 68)
    state = prefill_fn(sampler.params, padded, np.asarray([60], np.int32), cache, np.uint32(0))
    filled.append(jax.tree.map(np.asarray, (state.cache.k, state.cache.v, state.cache.positions, state.token)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), filled[1], filled[0])


def test_chunked_prefill_temporaries_scale_with_the_chunk_not_the_prompt():
  """The compiled prefill of a 1,024-token bucket: its temporary buffers (attention scores and activations) with
  chunks of 128 are a fraction of the one-call prefill's."""
  cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=2048)
  params = random_params(cfg)
  temp = {}
  for chunk in (0, 128):
    sampler = Sampler(cfg, params, eos_id=-1, prefill_chunk=chunk)
    prefill_fn, _ = sampler._compiled(SamplingConfig(), 8, (-1,))
    args = (sampler.params, np.zeros((4, 1024), np.int32), np.full((4,), 1000, np.int32), sampler.empty_cache(4, 1032))
    compiled = prefill_fn.lower(*args, np.uint32(0)).compile()
    temp[chunk] = compiled.memory_analysis().temp_size_in_bytes
  assert temp[128] < temp[0] / 4, temp


def test_top_k_1_equals_greedy_and_seeds_behave():
  cfg = CONFIGS["mha"]
  sampler = Sampler(cfg, random_params(cfg), eos_id=-1)
  prompts = [[5, 6, 7, 8], [9, 10]]
  greedy = sampler.generate(prompts, 20)
  assert sampler.generate(prompts, 20, SamplingConfig(temperature=1.0, top_k=1), seed=4) == greedy
  hot = SamplingConfig(temperature=1.5)
  assert sampler.generate(prompts, 20, hot, seed=7) == sampler.generate(prompts, 20, hot, seed=7)
  assert sampler.generate(prompts, 20, hot, seed=7) != sampler.generate(prompts, 20, hot, seed=8)


def test_top_p_never_leaves_the_nucleus():
  probs = np.array([0.5, 0.3, 0.12, 0.05, 0.03])
  logits = jnp.asarray(np.log(np.tile(probs, (2000, 1))), jnp.float32)
  sampling = SamplingConfig(temperature=1.0, top_p=0.75)  # nucleus {0, 1}: 0.5 + 0.3 ≥ 0.75
  drawn = np.asarray(next_token(logits, jax.random.key(0), sampling))
  assert set(drawn.tolist()) == {0, 1}
  assert abs((drawn == 0).mean() - 0.5 / 0.8) < 0.05  # renormalised within the nucleus
  kept = np.isfinite(np.asarray(filter_logits(logits[:1], SamplingConfig(1.0, top_k=3, top_p=0.99))))
  assert kept.tolist() == [[True, True, True, False, False]]  # top-k then top-p combine


def test_rows_stop_at_eos_and_extra_stop_ids_and_then_stay_put():
  cfg = CONFIGS["mha"]
  params = random_params(cfg)
  prompts = [[5, 6, 7, 8], [9, 10, 11]]
  free = Sampler(cfg, params, eos_id=-1).generate(prompts, 16)
  eos = free[0][3]
  assert eos not in free[0][:3]
  stopped = Sampler(cfg, params, eos_id=eos).generate(prompts, 16)
  assert stopped[0] == free[0][:3]
  expected_row1 = free[1][: free[1].index(eos)] if eos in free[1] else free[1]
  assert stopped[1] == expected_row1
  extra = free[1][2]
  with_stop = Sampler(cfg, params, eos_id=-1).generate(prompts, 16, stop_ids=[extra])
  assert with_stop[1] == free[1][: free[1].index(extra)]


def test_bad_requests_are_refused_with_the_allowed_range():
  cfg = CONFIGS["mha"]
  sampler = Sampler(cfg, random_params(cfg), eos_id=2)
  with pytest.raises(SampleError, match=r"temperature must be ≥ 0"):
    SamplingConfig(temperature=-0.1)
  with pytest.raises(SampleError, match=r"top_p must be in \(0, 1\], got 0"):
    SamplingConfig(top_p=0.0)
  with pytest.raises(SampleError, match="top_k must be an integer ≥ 0"):
    SamplingConfig(top_k=-1)
  with pytest.raises(SampleError, match="prompt 1 is empty"):
    sampler.generate([[1, 2], []], 4)
  with pytest.raises(
    SampleError, match="prompt length 250 \\+ max_new_tokens 10 = 260 exceeds the model's max_seq_len 256"
  ):
    sampler.generate([[1] * 250], 10)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, small_tokenizer):
  cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=128)
  out = str(tmp_path_factory.mktemp("sample") / "ckpt")
  checkpoint_params.save_params_dir(out, cfg, random_params(cfg), tokenizer_path=small_tokenizer)
  return out


def run_sample(*args):
  return subprocess.run(
    [sys.executable, "-m", "llama_jax.sample", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
  )


CLI_PROMPTS = ["Shall I compare thee", "O"]


@pytest.fixture(scope="module")
def greedy_completions(checkpoint_dir):
  """Each CLI prompt + its greedy continuation, computed in-process by the library the CLI calls."""
  sampler, tokenizer = load_sampler(checkpoint_dir)
  encoded = [tokenizer.encode(p, bos=True) for p in CLI_PROMPTS]
  outputs = sampler.generate(encoded, 12, SamplingConfig(temperature=0.0))
  # Random weights: no row may stop at once, or a CLI that printed only its prompts would pass.
  assert all(len(output) >= 4 for output in outputs), outputs
  return [tokenizer.decode(ids + output) for ids, output in zip(encoded, outputs)]


def batch_output(texts):
  """What the CLI prints for several prompts: a rule line, then each prompt with its continuation."""
  return "".join(f"{'-' * 40}\n{text}\n" for text in texts)


GREEDY_12 = ["--max_new_tokens", "12", "--temperature", "0"]


def test_cli_prints_each_completion_without_special_tokens(checkpoint_dir, greedy_completions, capsys):
  """The command's output, its `main` run in this process (its exit codes and error lines: the tests below)."""
  prompt_args = ["--checkpoint", checkpoint_dir, *[arg for prompt in CLI_PROMPTS for arg in ("--prompt", prompt)]]
  printed = runs.main_output(sample.main, [*prompt_args, *GREEDY_12], capsys)
  assert printed == batch_output(greedy_completions)
  assert "<s>" not in printed and "</s>" not in printed and "<unk>" not in printed
  one = ["--checkpoint", checkpoint_dir, "--prompt", CLI_PROMPTS[0], *GREEDY_12, "--stream", "yes"]
  assert runs.main_output(sample.main, one, capsys) == greedy_completions[0] + "\n"
  chunked = [*prompt_args, *GREEDY_12, "--prefill_chunk", "2"]
  assert runs.main_output(sample.main, chunked, capsys) == printed


def test_cli_prompt_file_gives_one_completion_per_non_blank_line(checkpoint_dir, greedy_completions, tmp_path, capsys):
  prompt_file = tmp_path / "prompts.txt"
  prompt_file.write_text(f"{CLI_PROMPTS[0]}\n\n   \n{CLI_PROMPTS[1]}\n\n", encoding="utf-8")
  args = ["--checkpoint", checkpoint_dir, "--prompt_file", str(prompt_file), *GREEDY_12]
  assert runs.main_output(sample.main, args, capsys) == batch_output(greedy_completions)


def test_prompt_lengths_inside_one_bucket_share_one_compiled_prefill_and_decode():
  cfg = CONFIGS["mha"]
  sampler = Sampler(cfg, random_params(cfg), eos_id=-1)
  # The Sampler's own jitted functions for these settings (stop ids: eos alone); _cache_size() counts their programs.
  prefill_fn, decode_fn = sampler._compiled(SamplingConfig(), 4, (-1,))
  compiled = []
  for length in (3, 16, 17):  # buckets 16, 16, 32
    sampler.generate([list(range(3, 3 + length))], 4)
    compiled.append((prefill_fn._cache_size(), decode_fn._cache_size()))
  assert compiled == [(1, 1), (1, 1), (2, 2)]


@pytest.mark.parametrize(
  "args,fragment",
  [
    (["--prompt", ""], "prompt 0 is empty"),
    (["--prompt", "word " * 120, "--max_new_tokens", "100"], "exceeds the model's max_seq_len 128"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be ≥ 0"),
    (["--prompt", "x", "--top_p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--prompt", "x", "--top_k", "-2"], "top_k must be an integer ≥ 0"),
    (
      ["--prompt", "x", "--prefill_chunk", "-1"],
      "--prefill_chunk must be ≥ 0 (0: the whole prompt in one call), got -1",
    ),
  ],
)
def test_cli_bad_input_is_one_line_exit_2(checkpoint_dir, args, fragment, capfd):
  """In this process (`main`; the exit status a process would get); the next test runs the command as one."""
  status, _, err = runs.run_main(sample.main, ["--checkpoint", checkpoint_dir, *args], capfd)
  lines = err.strip().splitlines()
  assert status == 2 and len(lines) == 1 and fragment in lines[0], err


def test_cli_missing_or_incomplete_checkpoint(tmp_path):
  result = run_sample("--checkpoint", str(tmp_path / "nope"), "--prompt", "x")
  assert result.returncode == 2 and "does not exist" in result.stderr
  (tmp_path / "ckpt").mkdir()
  (tmp_path / "ckpt" / paths.CONFIG_FILE).write_text(CONFIGS["mha"].to_json())
  (tmp_path / "ckpt" / paths.TOKENIZER_FILE).write_bytes(b"")
  result = run_sample("--checkpoint", str(tmp_path / "ckpt"), "--prompt", "x")
  assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
  "change,message",
  [
    (dict(dim=32), "parameter embed has shape (256, 64), which does not fit the model config (expected (256, 32))"),
    (dict(tie_embeddings=True), "parameter lm_head is not part of a model with this config"),
    (dict(n_layers=3), "does not fit the model config (expected (64, 4, 16) for each of 3 layers)"),
  ],
)
def test_sampler_refuses_params_that_do_not_fit_the_config(change, message):
  """A dynamic layer index would clamp silently (3 layers from 2 stacked ones): shapes are checked first."""
  from llama_jax.inference.placement import InferenceError

  cfg = CONFIGS["mha"]
  with pytest.raises(InferenceError) as error:
    Sampler(cfg.replace(**change), random_params(cfg), eos_id=-1)
  assert message in str(error.value)


def test_slot_major_cache_layout_gives_the_same_tokens():
  """The TPU's cache order ([S, K, B, H] physically, SLOT_MAJOR) forced on CPU: the empty cache, prefill and every
  loop call keep it, and the tokens do not change."""
  from llama_jax.inference.sampler import SLOT_MAJOR

  cfg = CONFIGS["gqa"]
  params = random_params(cfg)
  prompts = [[1, 5, 9, 3], [1, *range(20, 40)]]
  row_major = Sampler(cfg, params, eos_id=-1)
  assert row_major.cache_layout is None  # CPU: the default order
  slot_major = Sampler(cfg, params, eos_id=-1, cache_layout=SLOT_MAJOR)
  cache = slot_major.empty_cache(2, 32)
  assert cache.k[0].format.layout.major_to_minor == (2, 1, 0, 3)
  for chunk in (0, 5):
    assert slot_major.generate(prompts, 12, chunk=chunk) == row_major.generate(prompts, 12, chunk=chunk)


def test_a_generation_config_s_eos_token_ids_stop_load_sampler_and_the_cli(checkpoint_dir, tmp_path):
  """generation_config.json beside the tokenizer (HF's, as Llama 3 instruct ships it: eos_token_id a list): every
  id in it stops `load_sampler`'s Sampler, and the `sample` command, batched and streamed, prints the text up to
  the first of them. The stop id is the first greedy token of random weights after the first that differs from
  those before it, so the run must stop early to pass."""
  copy = str(tmp_path / "ckpt")
  shutil.copytree(checkpoint_dir, copy)
  sampler, tokenizer = load_sampler(copy)
  prompt = tokenizer.encode(CLI_PROMPTS[0], bos=True)
  free = sampler.generate([prompt], 12)[0]
  cut = next(i for i, t in enumerate(free) if i >= 1 and t not in free[:i])
  stop = free[cut]
  assert stop != tokenizer.eos_id and len(free) == 12, free
  (tmp_path / "ckpt" / paths.GENERATION_CONFIG_FILE).write_text(
    json.dumps({"bos_token_id": tokenizer.bos_id, "eos_token_id": [tokenizer.eos_id, stop]})
  )
  sampler, tokenizer = load_sampler(copy)
  assert sampler.stop_ids == tuple(sorted({tokenizer.eos_id, stop}))
  assert sampler.generate([prompt], 12)[0] == free[:cut]
  expected = tokenizer.decode(prompt + free[:cut])
  result = run_sample("--checkpoint", copy, "--prompt", CLI_PROMPTS[0], "--prompt", "O", *GREEDY_12)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith(f"{'-' * 40}\n{expected}\n")
  streamed = run_sample("--checkpoint", copy, "--prompt", CLI_PROMPTS[0], *GREEDY_12, "--stream", "yes")
  assert streamed.returncode == 0, streamed.stderr
  assert streamed.stdout == expected + "\n"
