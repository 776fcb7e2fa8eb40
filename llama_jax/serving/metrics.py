"""The server's Prometheus metrics, served at ``GET /metrics`` in Prometheus' text format (vLLM's shape, ``llama_jax_``
names). Each application has its own registry (two servers in one process count apart).

- ``llama_jax_requests_total{endpoint,status}``: every HTTP request answered, refusals by access.py included; an
  unknown path counts as endpoint "other" (a caller probing random URLs cannot grow the label set).
- ``llama_jax_request_duration_seconds{endpoint}``: from the request's arrival to its last byte (a stream's end).
- ``llama_jax_prompt_tokens_total``, ``llama_jax_generation_tokens_total``: what the responses' ``usage`` reports
  (a prompt sampled n times counts once), counted when a response ends, a client that left included.
- ``llama_jax_time_to_first_token_seconds``: from a choice's submission to the engine until its first token.
- ``llama_jax_time_per_output_token_seconds``: between a choice's later tokens (a chunk of k tokens arriving t after
  the previous one is k observations of t / k).
- ``llama_jax_queued_requests``, ``llama_jax_busy_slots``, ``llama_jax_slots``: read from the engine at each scrape.
- ``llama_jax_prefill_step_seconds``, ``llama_jax_decode_step_seconds``: each device call of the engine; the
  ``..._step_tokens_total`` counters beside them say how many tokens those calls computed.
- ``process_*``: the server process's CPU seconds, resident memory and open file descriptors.
"""

from __future__ import annotations

import time

from prometheus_client import (
  CONTENT_TYPE_LATEST,
  CollectorRegistry,
  Counter,
  Gauge,
  Histogram,
  ProcessCollector,
  disable_created_metrics,
  generate_latest,
)

ENDPOINTS = frozenset({"/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})
# Seconds: token latencies of a small model on a CPU (milliseconds) up to a 7B's long prefill on a busy chip.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
  """The metrics of one application over `engine` (whose step observers it joins)."""

  def __init__(self, engine):
    # No `_created` series beside every counter and histogram: a scrape half their size (vLLM does the same). The
    # switch is prometheus_client's, for the whole process.
    disable_created_metrics()
    self.registry = registry = CollectorRegistry()
    self.requests = Counter(
      "llama_jax_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=registry
    )
    self.request_seconds = Histogram(
      "llama_jax_request_duration_seconds",
      "Seconds from a request's arrival to its last byte",
      ["endpoint"],
      buckets=_REQUEST_BUCKETS,
      registry=registry,
    )
    self.prompt_tokens = Counter("llama_jax_prompt_tokens", "Prompt tokens of answered requests", registry=registry)
    self.generation_tokens = Counter(
      "llama_jax_generation_tokens", "Tokens generated for answered requests", registry=registry
    )
    self.first_token = Histogram(
      "llama_jax_time_to_first_token_seconds",
      "Seconds from a choice's submission to its first token",
      buckets=_LATENCY_BUCKETS,
      registry=registry,
    )
    self.per_token = Histogram(
      "llama_jax_time_per_output_token_seconds",
      "Seconds between a choice's tokens after the first",
      buckets=_LATENCY_BUCKETS,
      registry=registry,
    )
    self.step_seconds = {
      kind: Histogram(
        f"llama_jax_{kind}_step_seconds",
        f"Seconds of each {kind} call of the engine on the device",
        buckets=_LATENCY_BUCKETS,
        registry=registry,
      )
      for kind in ("prefill", "decode")
    }
    self.step_tokens = {
      kind: Counter(f"llama_jax_{kind}_step_tokens", f"Tokens computed by {kind} calls", registry=registry)
      for kind in ("prefill", "decode")
    }
    Gauge("llama_jax_queued_requests", "Choices waiting for a slot", registry=registry).set_function(engine.queued)
    Gauge("llama_jax_busy_slots", "Decode slots in use", registry=registry).set_function(engine.busy_slots)
    Gauge("llama_jax_slots", "Decode slots", registry=registry).set(engine.slots)
    ProcessCollector(registry=registry)
    engine.step_observers.append(self._observe_step)

  def _observe_step(self, kind: str, seconds: float, tokens: int) -> None:
    self.step_seconds[kind].observe(seconds)
    self.step_tokens[kind].inc(tokens)

  def count_usage(self, usage: dict) -> None:
    self.prompt_tokens.inc(usage["prompt_tokens"])
    self.generation_tokens.inc(usage["completion_tokens"])

  def exposition(self) -> tuple[bytes, str]:
    """(the text a scrape receives, its content type)."""
    return generate_latest(self.registry), CONTENT_TYPE_LATEST


class TokenTimer:
  """One choice's token arrival times (fed from the engine's thread): the first token's latency, then the gaps."""

  def __init__(self, metrics: ServerMetrics):
    self.metrics, self.submitted, self.last = metrics, time.perf_counter(), None

  def arrived(self, tokens: int) -> None:
    if not tokens:
      return
    now = time.perf_counter()
    if self.last is None:
      self.metrics.first_token.observe(now - self.submitted)
      tokens -= 1  # the first token's time is the latency above; any others came with it
      gap = 0.0
    else:
      gap = (now - self.last) / tokens
    for _ in range(tokens):
      self.metrics.per_token.observe(gap)
    self.last = now


class Instrument:
  """The ASGI middleware that counts every HTTP request by endpoint and status and times it to its last byte;
  outermost, so requests refused before any handler (access.py) count too."""

  def __init__(self, app, metrics: ServerMetrics):
    self.app, self.metrics = app, metrics

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
    status = 500  # a handler that raised past every error handler: the server answers 500
    start = time.perf_counter()

    async def recording_send(message):
      nonlocal status
      if message["type"] == "http.response.start":
        status = message["status"]
      await send(message)

    try:
      await self.app(scope, receive, recording_send)
    finally:
      self.metrics.requests.labels(endpoint, str(status)).inc()
      self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - start)
