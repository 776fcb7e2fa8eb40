"""The engine's interleaved (chunked) prefill: long prompts prefilled a chunk per scheduler round give the greedy
tokens of the offline Sampler, running requests get a decode call between every two chunks, and a request cancelled
while its prompt is being prefilled frees the slot held for it."""

import numpy as np
import pytest
from flax import nnx

from llama_jax.core.model_config import ModelConfig
from llama_jax.inference.engine import Engine
from llama_jax.inference.requests import Collector, Request
from llama_jax.inference.sampler import Sampler
from llama_jax.model.llama import Llama

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=256)
EOS = 2
CHUNK = 16


@pytest.fixture(scope="module")
def sampler():
  return Sampler(CFG, nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(0)))), eos_id=EOS, pad_id=0)


@pytest.fixture(scope="module")
def engine(sampler):
  """3 slots of 128 columns, chunks of 16, 2 decode steps per call; programs compile as the tests need them."""
  engine = Engine(sampler, slots=3, max_len=128, steps_per_call=2, prefill_chunk=CHUNK)
  yield engine
  assert engine.pending() == 0


def prompt(n, seed):
  return np.random.RandomState(seed).randint(3, CFG.vocab_size, n).tolist()


def test_long_prompts_prefilled_by_chunks_decode_the_samplers_greedy_tokens(sampler, engine):
  """Prompts of 5 to 100 tokens (one chunk, several, a partial last chunk) among short ones, more than the slots:
  every output equals the Sampler's for that prompt alone."""
  lengths = [5, 17, 40, 100, 12, 33]
  prompts = [prompt(n, seed) for seed, n in enumerate(lengths)]
  expected = [sampler.generate([p], 8)[0] for p in prompts]
  chunks_before = engine.stats["prefill_chunks"]
  collectors = [Collector() for _ in prompts]
  engine.generate([Request(p, 8, c) for p, c in zip(prompts, collectors)])
  for want, got in zip(expected, collectors):
    assert got.tokens == want and got.finish_reason == ("stop" if len(want) < 8 else "length")
  assert engine.stats["prefill_chunks"] - chunks_before == 2 + 3 + 7 + 3  # ⌈n / 16⌉ for 17, 40, 100, 33


def test_a_prompt_whose_chunks_overrun_its_bucket_is_prefilled_whole(sampler):
  """max_len 200 is no power of two: a 195-token prompt's bucket is 200 and 13 chunks of 16 would need 208."""
  engine = Engine(sampler, slots=1, max_len=200, prefill_chunk=CHUNK)
  got = Collector()
  engine.generate([Request(prompt(195, 7), 1, got)])
  assert engine.stats["prefill_chunks"] == 0 and engine.stats["prefill_calls"] == 1 and len(got.tokens) == 1


def test_running_requests_get_a_decode_call_between_every_two_chunks(sampler, engine):
  """A request decoding while a 100-token prompt arrives: the engine's calls alternate prefill chunk, decode call,
  until the long prompt starts; the running request's tokens are still the Sampler's."""
  calls = []
  engine.step_observers.append(lambda kind, seconds, tokens: calls.append((kind, tokens)))
  try:
    running, long = Collector(), Collector()
    short_prompt, long_prompt = prompt(8, 10), prompt(100, 11)
    engine.submit(Request(short_prompt, 60, running))
    engine.step()  # admitted (a whole prefill: 8 tokens) and decoding
    engine.submit(Request(long_prompt, 4, long))
    while engine.pending():
      engine.step()
  finally:
    engine.step_observers.pop()
  kinds = [kind for kind, _ in calls]
  first = kinds.index("prefill", 1)  # the first chunk of the long prompt
  chunks = [i for i, (kind, tokens) in enumerate(calls) if kind == "prefill" and i >= first]
  assert [calls[i][1] for i in chunks] == [16] * 6 + [4]  # 100 tokens in chunks of 16
  assert all(kinds[i + 1] == "decode" for i in chunks)  # every chunk is followed by the running slots' decode call
  assert running.tokens == sampler.generate([short_prompt], 60)[0]
  assert long.tokens == sampler.generate([long_prompt], 4)[0]


def test_a_request_cancelled_during_its_chunked_prefill_frees_its_slot(sampler, engine):
  """Cancelled after two chunks: no output, the held slot is free again, and the next request runs as alone."""
  cancelled, after = Collector(), Collector()
  request = Request(prompt(120, 20), 5, cancelled)
  engine.submit(request)
  engine.step()
  engine.step()
  assert engine.pending() == 1 and engine.busy_slots() == 0  # staged, not yet in a slot
  engine.cancel(request)
  engine.step()
  assert engine.pending() == 0 and engine.busy_slots() == 0 and cancelled.outputs == []
  follow = prompt(50, 21)
  engine.generate([Request(follow, 6, after)])
  assert after.tokens == sampler.generate([follow], 6)[0]
