"""The continuous-batching engine against the offline Sampler: greedy outputs equal each prompt decoded alone, for
more requests than slots with mixed lengths; per-row sampling filters equal ``filter_logits``; a seeded request
draws the same tokens alone and in a crowd; cancelled slots are reused; prompt scores equal the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llama_jax.core.model_config import ModelConfig
from llama_jax.inference.engine import Engine
from llama_jax.inference.requests import Collector, EngineBusy, EngineError, Request
from llama_jax.inference.sampler import Sampler
from llama_jax.inference.sampling import SamplingConfig, filter_logits, filter_rows, sample_rows
from llama_jax.model.llama import Llama

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=128)
EOS = 2


@pytest.fixture(scope="module")
def params():
  return nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(0))))


@pytest.fixture(scope="module")
def sampler(params):
  return Sampler(CFG, params, eos_id=EOS, pad_id=0)


@pytest.fixture(scope="module")
def engine(sampler):
  """4 slots of 96 columns, 3 steps per call (not a divisor of most lengths: requests end mid-call), shared by the
  tests so its programs compile once; each test leaves it idle."""
  engine = Engine(sampler, slots=4, max_len=96, steps_per_call=3)
  assert engine.warmup() > 0 and engine.pending() == 0  # the tests then run on an engine the warm-up wrote into
  yield engine
  assert engine.pending() == 0


def random_prompts(n, seed=0, longest=40):
  rs = np.random.RandomState(seed)
  return [rs.randint(3, CFG.vocab_size, rs.randint(1, longest)).tolist() for _ in range(n)]


def run(engine, prompts, max_tokens, **settings):
  collectors = [Collector() for _ in prompts]
  engine.generate([Request(p, m, c, **settings) for p, m, c in zip(prompts, max_tokens, collectors)])
  return collectors


def test_greedy_outputs_equal_each_prompt_decoded_alone_with_more_requests_than_slots(sampler, engine):
  """13 requests of 1–39 prompt tokens and 1–60 new ones through 4 slots of 96 columns: the ring wraps, slots are
  refilled mid-flight, and every output equals the Sampler's for that prompt alone (including stops at eos)."""
  prompts = random_prompts(13)
  rs = np.random.RandomState(1)
  # Every third request fills its slot's row (prompt + max_tokens = 96, up to the Sampler's 88-token budget).
  max_tokens = [int(rs.randint(1, 96 - len(p) + 1)) if i % 3 else min(96 - len(p), 88) for i, p in enumerate(prompts)]
  # Greedy decoding is prefix-consistent: one 88-token Sampler run per prompt (one compiled program per bucket)
  # gives the expected tokens of every shorter max_tokens.
  expected = [sampler.generate([p], 88)[0][:m] for p, m in zip(prompts, max_tokens)]
  before = engine.stats["requests"]
  got = run(engine, prompts, max_tokens)
  for want, c, m in zip(expected, got, max_tokens):
    assert c.tokens == want
    assert c.finish_reason == ("stop" if len(want) < m else "length")
  assert engine.stats["requests"] - before == 13
  assert engine.pending() == 0


def nucleus_reference(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
  """The kept tokens of one row by the definition, in float64 numpy: the top_k largest (all if 0), then the smallest
  prefix of them, by probability renormalised over them, whose mass reaches top_p."""
  order = np.argsort(-scaled, kind="stable")
  kept = order[: top_k or len(order)]
  probs = np.exp(scaled[kept] - scaled[kept].max())
  probs /= probs.sum()
  mass_before = np.cumsum(probs) - probs
  keep = np.zeros(len(scaled), bool)
  keep[kept[(mass_before < top_p) | (top_p >= 1.0)]] = True
  return keep


def test_per_row_filters_keep_the_top_k_then_the_nucleus_and_the_sampler_filters_alike():
  """The one filter (inference/sampling.py) against the definition, row by row with each row's own settings; the
  Sampler's batch-wide `filter_logits` is the same filter. Random logits have no ties, and no cumulative mass lands
  within float32 rounding of top_p (checked), so the kept sets are the definition's exactly."""
  rs = np.random.RandomState(0)
  logits = jnp.asarray(rs.randn(6, 300).astype(np.float32) * 3)
  settings = [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 40, 0.5), (1.0, 1, 1.0), (2.0, 300, 0.999)]
  temperature = jnp.asarray([t for t, _, _ in settings])
  scaled = logits / temperature[:, None]
  got = filter_rows(scaled, jnp.asarray([k for _, k, _ in settings]), jnp.asarray([p for _, _, p in settings]))
  for row, (t, k, p) in enumerate(settings):
    row_scaled = np.asarray(scaled[row], np.float64)
    kept = nucleus_reference(row_scaled, k, p)
    np.testing.assert_array_equal(np.isfinite(got[row]), kept)
    np.testing.assert_allclose(np.asarray(got[row])[kept], row_scaled[kept], rtol=1e-6)
    same = filter_logits(logits[row : row + 1], SamplingConfig(t, k, p))[0]
    np.testing.assert_array_equal(np.isfinite(same), kept)


def test_sampling_draws_from_the_filtered_distribution():
  """Frequencies of 4,000 draws per row follow softmax of the filtered logits (greedy rows give the argmax)."""
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4))
  n = 4000
  temperature = jnp.asarray([1.0, 1.0, 0.0, 1.0])
  top_k = jnp.asarray([0, 2, 0, 0])
  top_p = jnp.asarray([1.0, 1.0, 1.0, 0.75])
  positions = jnp.broadcast_to(jnp.arange(n)[:, None], (n, 4))
  draw = jax.jit(jax.vmap(sample_rows, in_axes=(None, None, None, None, None, 0)))
  tokens = np.asarray(draw(logits, temperature, top_k, top_p, jnp.arange(4, dtype=jnp.uint32), positions))
  freq = np.stack([np.bincount(tokens[:, row], minlength=4) / n for row in range(4)])
  np.testing.assert_allclose(freq[0], [0.5, 0.3, 0.15, 0.05], atol=0.03)
  np.testing.assert_allclose(freq[1], [0.625, 0.375, 0, 0], atol=0.03)
  np.testing.assert_array_equal(freq[2], [1, 0, 0, 0])
  np.testing.assert_allclose(freq[3], [0.625, 0.375, 0, 0], atol=0.03)  # 0.5 + 0.3 reaches 0.75


def test_a_seeded_request_draws_the_same_tokens_alone_and_among_others(engine):
  prompt = random_prompts(1, seed=5)[0]
  settings = dict(temperature=0.9, top_p=0.95, seed=1234)
  alone = run(engine, [prompt], [30], **settings)[0].tokens
  crowd = [Collector() for _ in range(6)]
  requests = [Request(p, 30, c, temperature=1.0, seed=i) for i, (p, c) in enumerate(zip(random_prompts(6), crowd))]
  mine = Collector()
  engine.generate(requests[:3] + [Request(prompt, 30, mine, **settings)] + requests[3:])
  assert mine.tokens == alone and len(alone) > 0
  assert len({tuple(c.tokens) for c in crowd}) == 6  # different seeds and prompts, different draws


def test_cancelled_requests_free_their_slots_for_waiting_ones(sampler, engine):
  prompts = random_prompts(8, seed=3, longest=10)
  expected = [sampler.generate([p], 88)[0][:20] for p in prompts[4:]]
  collectors = [Collector() for _ in prompts]
  requests = [Request(p, 80 if i < 4 else 20, c) for i, (p, c) in enumerate(zip(prompts, collectors))]
  before = engine.stats["finished_cancelled"]
  for r in requests:
    engine.submit(r)
  engine.step()
  engine.step()
  assert engine.busy_slots() == 4 and engine.queued() == 4
  for r in requests[:4]:
    engine.cancel(r)
  while engine.pending():
    engine.step()
  assert [c.tokens for c in collectors[4:]] == expected
  assert collectors[0].finish_reason is None and not collectors[0].done.is_set()  # a cancelled request hears nothing
  assert engine.stats["finished_cancelled"] - before == 4


def test_prompt_scores_equal_the_full_forward(engine):
  """max_tokens 0 with prompt_logprobs: log p(token t | tokens < t) for t ≥ 1 and the top alternatives, from the
  model's full forward."""
  prompt = random_prompts(1, seed=7)[0] + [5, 6, 7]
  out = Collector()
  engine.generate([Request(prompt, 0, out, prompt_logprobs=True)])
  logprobs = jax.nn.log_softmax(Llama(CFG, rngs=nnx.Rngs(0))(jnp.asarray([prompt]))[0], axis=-1)
  want = np.asarray([logprobs[t - 1, prompt[t]] for t in range(1, len(prompt))])
  first = out.outputs[0]
  np.testing.assert_allclose(first.prompt_logprobs, want, atol=1e-5)
  top = np.sort(np.asarray(logprobs[:-1]), axis=-1)[:, ::-1][:, :5]
  np.testing.assert_allclose([[lp for _, lp in row] for row in first.prompt_top_logprobs], top, atol=1e-5)
  assert out.finish_reason == "length" and out.tokens == []


def test_generated_logprobs_are_the_models_for_the_emitted_tokens(engine):
  prompt = random_prompts(1, seed=8)[0]
  out = run(engine, [prompt], [12], logprobs=True)[0]
  full = prompt + out.tokens
  logprobs = jax.nn.log_softmax(Llama(CFG, rngs=nnx.Rngs(0))(jnp.asarray([full]))[0], axis=-1)
  want = [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(out.tokens)]
  np.testing.assert_allclose(out.logprobs, want, atol=1e-4)
  assert all(row[0][0] == token for row, token in zip(out.top_logprobs, out.tokens))  # greedy: the top one


@pytest.mark.parametrize(
  ("request_kwargs", "fragment"),
  [
    (dict(prompt=[], max_tokens=4), "the prompt is empty"),
    (dict(prompt=[1, 300], max_tokens=4), r"token id 300 is outside the vocabulary \[0, 256\)"),
    (dict(prompt=[1] * 90, max_tokens=10), r"90 tokens \+ max_tokens 10 = 100 exceeds the context length 96"),
    (dict(prompt=[1], max_tokens=-1), "max_tokens must be ≥ 0, got -1"),
    (dict(prompt=[1], max_tokens=4, top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(prompt=[1], max_tokens=4, temperature=-1.0), "temperature must be ≥ 0"),
  ],
)
def test_bad_requests_are_refused_before_they_queue(engine, request_kwargs, fragment):
  with pytest.raises(EngineError, match=fragment):
    engine.submit(Request(on_output=Collector(), **request_kwargs))
  assert engine.queued() == 0


@pytest.mark.parametrize(
  ("kwargs", "fragment"),
  [
    (dict(slots=0), "slots must be a positive multiple"),
    (dict(max_len=1000), r"max_len must be in \[2, 128\]"),
    (dict(steps_per_call=0), "steps_per_call must be ≥ 1"),
    (dict(prefill_chunk=24), r"prefill_chunk must be 0 \(whole prompts\) or a power of two ≤ max_len 128, got 24"),
    (dict(prefill_chunk=256), "prefill_chunk must be 0 .* got 256"),
  ],
)
def test_bad_engine_settings_are_one_line_errors(sampler, kwargs, fragment):
  with pytest.raises(EngineError, match=fragment):
    Engine(sampler, **kwargs)


def test_the_engine_thread_serves_submissions_from_other_threads(sampler, engine):
  engine.start()
  try:
    prompts = random_prompts(3, seed=11)
    collectors = [Collector() for _ in prompts]
    for p, c in zip(prompts, collectors):
      engine.submit(Request(p, 10, c))
    assert all(c.done.wait(60) for c in collectors)
    assert [c.tokens for c in collectors] == [sampler.generate([p], 88)[0][:10] for p in prompts]
  finally:
    engine.stop()


def test_a_full_queue_refuses_more_requests(sampler):
  engine = Engine(sampler, slots=2, max_len=96, max_queue=1)
  engine.submit(Request([5, 6], 4, Collector()))
  with pytest.raises(EngineBusy, match=r"1 requests are already waiting \(the limit is 1\)"):
    engine.submit(Request([5, 6], 4, Collector()))


def test_waiting_requests_are_prefilled_together_and_decode_as_they_would_alone(sampler, engine):
  """Four requests queued at once (1–39 prompt tokens, one seeded sampling request among greedy ones) enter the four
  slots in one prefill call of 4 rows × the longest prompt's bucket; each output equals its request run alone."""
  prompts = random_prompts(4, seed=7)
  settings = [{}, dict(temperature=0.9, top_k=20, seed=11), {}, {}]
  alone = []
  for prompt, extra in zip(prompts, settings):
    before = engine.stats["prefill_calls"]
    alone.append(run(engine, [prompt], [30], **extra)[0].tokens)
    assert engine.stats["prefill_calls"] - before == 1
  assert alone[0] == sampler.generate([prompts[0]], 30)[0]
  collectors = [Collector() for _ in prompts]
  before = engine.stats["prefill_calls"]
  engine.generate([Request(p, 30, c, **extra) for p, c, extra in zip(prompts, collectors, settings)])
  assert engine.stats["prefill_calls"] - before == 1
  assert [c.tokens for c in collectors] == alone


def test_admission_batches_respect_free_slots_the_prefill_budget_and_scoring_requests(sampler):
  engine = Engine(sampler, slots=4, max_len=96, max_prefill_tokens=64)
  lengths = [10, 10, 40, 5, 5, 5, 5, 5]
  requests = [Request([5] * n, 4, Collector()) for n in lengths]
  requests[3].prompt_logprobs = True
  engine._queue.extend(requests)
  # 2 rows × bucket 16 fit in 64 tokens, a third row (4 × bucket 64) does not; the long prompt goes alone; a scoring
  # request alone; then as many as the 4 free slots.
  assert [len(engine._next_admissions()) for _ in range(4)] == [2, 1, 1, 4]
  engine._slot_requests = [None, requests[0], requests[1], requests[2]]  # one slot free
  engine._queue.extend([Request([5] * 3, 4, Collector()) for _ in range(2)])
  assert len(engine._next_admissions()) == 1


def test_a_partial_admission_pads_rows_that_write_nowhere(sampler, engine):
  """One request runs in slot 0 while three more arrive: they are prefilled in one call of 4 rows (the padding row
  aimed past the last slot) into slots 1–3, and every output, the running request's included, equals its own."""
  prompts = random_prompts(4, seed=9)
  alone = [sampler.generate([p], 40)[0] for p in prompts]
  collectors = [Collector() for _ in prompts]
  engine.submit(Request(prompts[0], 40, collectors[0]))
  engine.step()  # admitted alone, then one chunk of steps
  before = engine.stats["prefill_calls"]
  engine.generate([Request(p, 40, c) for p, c in zip(prompts[1:], collectors[1:])])
  assert engine.stats["prefill_calls"] - before == 1
  assert [c.tokens for c in collectors] == alone


def test_requests_cancelled_while_waiting_make_room_in_a_full_queue(sampler):
  engine = Engine(sampler, slots=2, max_len=96, max_queue=1)
  engine.cancel(engine.submit(Request([5, 6], 4, Collector())))
  engine.submit(Request([5, 6], 4, Collector()))
  assert engine.queued() == 1


def test_an_engine_that_cannot_rebuild_its_slots_fails_every_request_and_refuses_new_ones(sampler):
  """A step fails (its running request ends with the error), then so does making empty slots again: the waiting
  request hears of it too, the thread stops, and a later submission is refused instead of waiting for ever."""
  engine = Engine(sampler, slots=1, max_len=64)

  def device_lost(*_):
    raise RuntimeError("device lost")

  def out_of_memory():
    raise RuntimeError("out of memory")

  engine._run_rows, engine._empty_state = device_lost, out_of_memory
  running, waiting = Collector(), Collector()
  engine.submit(Request([5, 6], 8, running))
  engine.submit(Request([5, 7], 8, waiting))
  engine.start()
  try:
    assert running.done.wait(120) and waiting.done.wait(120)
    assert running.finish_reason == waiting.finish_reason == "error"
    assert "device lost" in running.outputs[-1].error and "out of memory" in waiting.outputs[-1].error
    engine._thread.join(60)
    assert not engine.alive()
    with pytest.raises(EngineError, match="the engine stopped after an error: RuntimeError: out of memory"):
      engine.submit(Request([5], 2, Collector()))
  finally:
    engine.stop()


def test_the_engine_stops_at_every_stop_id_of_its_sampler(params, sampler):
  """A Sampler with a second stop id (a generation config's end-of-turn token): the engine ends a request there
  with finish_reason "stop", keeps the token out of the text and hands back its log-probability with its id. The
  stop id is the 6th greedy token of random weights (first seen there), so the request must stop early to pass."""
  prompt = random_prompts(1, seed=2)[0]
  free = sampler.generate([prompt], 20)[0]
  assert len(free) == 20
  stop = next(t for i, t in enumerate(free) if i >= 5 and t not in free[:i])
  cut = free.index(stop)
  engine = Engine(Sampler(CFG, params, eos_id=EOS, pad_id=0, stop_ids=(stop,)), slots=2, max_len=96, steps_per_call=3)
  assert engine.stop_ids == tuple(sorted({EOS, stop}))
  (got,) = run(engine, [prompt], [20], logprobs=True)
  assert got.tokens == free[:cut] and got.finish_reason == "stop"
  assert len(got.logprobs) == cut and got.outputs[-1].eos_id == stop
  assert got.outputs[-1].eos_logprob is not None
