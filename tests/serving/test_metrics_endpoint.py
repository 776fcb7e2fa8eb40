"""GET /metrics (serving/metrics.py) scraped with prometheus_client's own parser after a known mix of traffic from the
openai client and raw HTTP: every count equals what was sent and answered, the token counters equal the responses'
usage, the latency histograms hold one observation per token, the engine's gauges and step counters match its own
statistics; the key guards the endpoint. Served in-process (asgi_server.py): a response read to its end is one the
app has finished with, so each count is there by the next scrape."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import asgi_server, live_server
from tests.conftest import needs_shakespeare

pytestmark = needs_shakespeare

KEY = "metrics-key-" + "z" * 20
AUTH = {"authorization": f"Bearer {KEY}"}
SLOTS = 2


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, small_tokenizer):
  return live_server.tiny_checkpoint(str(tmp_path_factory.mktemp("metrics") / "tiny"), small_tokenizer)


def scrape(http, headers=AUTH) -> dict:
  """{sample name with its labels: value} of one scrape through `http` (asgi_server's client), parsed by
  prometheus_client."""
  response = http.get("/metrics", headers=headers)
  assert response.status_code == 200, response.text
  assert response.headers["content-type"].startswith("text/plain; version=")
  samples = {}
  for family in text_string_to_metric_families(response.text):
    for sample in family.samples:
      samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
  return samples


def value(samples: dict, name: str, **labels) -> float:
  return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_a_known_traffic_mix(checkpoint_dir):
  served = asgi_server.asgi_serving(checkpoint_dir, slots=SLOTS, max_len=128, api_key=KEY, warmup=True)
  with served as (http, engine, *_):
    client = asgi_server.openai_client(http, api_key=KEY)
    choice_tokens, prompt_tokens = [], 0
    for prompt in ("To be, or not", "Friends, Romans", "Now is the winter"):
      done = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
      choice_tokens.append(done.usage.completion_tokens)
      prompt_tokens += done.usage.prompt_tokens
    # n=2: the prompt counts once in usage, each choice's tokens apart (their logprobs list them).
    twice = client.completions.create(model="tiny", prompt="O Romeo", max_tokens=4, n=2, logprobs=0, seed=3)
    choice_tokens += [len(c.logprobs.tokens) for c in twice.choices]
    prompt_tokens += twice.usage.prompt_tokens
    assert sum(choice_tokens[-2:]) == twice.usage.completion_tokens
    for text in ("Speak, friend", "What light through yonder window"):
      stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": text}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
      )
      usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
      choice_tokens.append(usage.completion_tokens)
      prompt_tokens += usage.prompt_tokens
    assert http.get("/v1/models").status_code == 401  # no key
    assert http.get("/v1/models", headers=AUTH).status_code == 200
    assert http.get("/metrics").status_code == 401  # the key guards the metrics too
    assert http.get("/health").status_code == 200
    assert http.get(f"/no/such/path/{'x' * 50}", headers=AUTH).status_code == 404

    samples = scrape(http)
    requests = lambda endpoint, status: value(samples, "llama_jax_requests_total", endpoint=endpoint, status=status)  # noqa: E731
    assert requests("/v1/completions", "200") == 4
    assert requests("/v1/chat/completions", "200") == 2
    assert requests("/v1/models", "401") == 1 and requests("/v1/models", "200") == 1
    assert requests("/metrics", "401") == 1
    assert requests("/metrics", "200") == 0  # a scrape is counted once answered: the next one sees it
    assert requests("/health", "200") == 1
    assert requests("other", "404") == 1  # an unknown path is one label value, whatever its text
    assert sum(v for (name, _), v in samples.items() if name == "llama_jax_requests_total") == 11
    count = lambda name, **labels: value(samples, f"{name}_count", **labels)  # noqa: E731
    assert count("llama_jax_request_duration_seconds", endpoint="/v1/completions") == 4
    assert count("llama_jax_request_duration_seconds", endpoint="/v1/chat/completions") == 2

    assert value(samples, "llama_jax_prompt_tokens_total") == prompt_tokens
    assert value(samples, "llama_jax_generation_tokens_total") == sum(choice_tokens)
    # One first-token latency per choice that produced a token, one gap per token after it.
    assert count("llama_jax_time_to_first_token_seconds") == sum(1 for n in choice_tokens if n) == 7
    assert count("llama_jax_time_per_output_token_seconds") == sum(n - 1 for n in choice_tokens if n)
    assert value(samples, "llama_jax_time_to_first_token_seconds_sum") > 0

    assert value(samples, "llama_jax_queued_requests") == 0
    assert value(samples, "llama_jax_busy_slots") == 0
    assert value(samples, "llama_jax_slots") == SLOTS
    assert count("llama_jax_prefill_step_seconds") == engine.stats["prefill_calls"] >= 1
    assert value(samples, "llama_jax_prefill_step_tokens_total") == engine.stats["prefill_tokens"]
    assert value(samples, "llama_jax_decode_step_tokens_total") == engine.stats["tokens"]
    assert count("llama_jax_decode_step_seconds") >= 1
    assert value(samples, "process_resident_memory_bytes") > 0

    again = scrape(http)
    assert value(again, "llama_jax_requests_total", endpoint="/metrics", status="200") == 1


def test_metrics_need_no_key_on_a_server_without_one(checkpoint_dir):
  with asgi_server.asgi_serving(checkpoint_dir, slots=SLOTS, max_len=64) as (http, *_):
    samples = scrape(http, headers={})
    assert value(samples, "llama_jax_slots") == SLOTS
    assert value(samples, "llama_jax_requests_total", endpoint="/metrics", status="200") == 0
