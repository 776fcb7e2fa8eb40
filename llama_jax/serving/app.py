"""The OpenAI-compatible HTTP application over the continuous-batching engine, with a web chat page at `/`.

Endpoints: GET /v1/models, GET /health, POST /v1/completions, POST /v1/chat/completions (both stream as server-sent
events with `"stream": true`), GET / (the chat page), GET /metrics (Prometheus' text format: metrics.py). Errors come
in OpenAI's shape with 400 (a bad value, named with its allowed range; a prompt + max_tokens beyond the context), 401
(missing or wrong key when an API key is set), 403 (a foreign Host or Origin), 404 (unknown model or route), 413 (a
body over the limit) and 415 (a body not sent as JSON); access.py checks who may call before any handler runs. The
request fields are checked by protocol.py; the runs through the engine and the responses are streaming.py's.
"""

from __future__ import annotations

import importlib.resources
import json
import time

try:
  from fastapi import FastAPI
  from fastapi import Request as HttpRequest
  from fastapi.exceptions import RequestValidationError
  from fastapi.responses import HTMLResponse, JSONResponse, Response
  from starlette.exceptions import HTTPException
  from starlette.requests import ClientDisconnect
except ImportError as error:  # pragma: no cover - the message is the point
  raise ImportError(f"{error}: the server needs its extra: pip install -e '.[serve]'") from error

from llama_jax.inference.engine import Engine
from llama_jax.serving.access import Access, Guard
from llama_jax.serving.metrics import Instrument, ServerMetrics
from llama_jax.serving.protocol import (
  MAX_CHOICES,
  ApiError,
  parse_logprobs,
  parse_messages,
  parse_prompts,
  parse_sampling,
)
from llama_jax.serving.streaming import STREAM_BUFFER_TOKENS, Run, check_context, respond

DEFAULT_MAX_BODY_MB = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def error_response(error: ApiError) -> JSONResponse:
  headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
  return JSONResponse(error.body(), status_code=error.status, headers=headers)


class _Endpoints:
  """The handlers of one application: what they share is the engine, the tokenizer and the model's name."""

  def __init__(self, engine: Engine, tokenizer, model_name: str, max_body_bytes: int, stream_buffer_tokens: int):
    self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
    self.max_body_bytes, self.created = max_body_bytes, int(time.time())
    self.stream_buffer_tokens = stream_buffer_tokens
    self.metrics = ServerMetrics(engine)

  async def respond(self, request: HttpRequest, runs, sampling, chat_api: bool):
    check_context(self.engine, runs)
    return await respond(
      self.engine,
      request,
      runs,
      sampling,
      chat_api=chat_api,
      model_name=self.model_name,
      buffer=self.stream_buffer_tokens,
      metrics=self.metrics,
    )

  async def prometheus(self):
    body, content_type = self.metrics.exposition()
    return Response(body, media_type=content_type)

  async def read_json(self, request: HttpRequest) -> dict:
    body = bytearray()
    try:
      async for chunk in request.stream():
        body += chunk
        if len(body) > self.max_body_bytes:
          raise ApiError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes", code="too_large")
    except ClientDisconnect:  # gone, or dropped for trickling its body (connections.py): nobody reads this answer
      raise ApiError(408, "the client went away before its body arrived", code="timeout") from None
    try:
      value = json.loads(body)
    except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, integers past Python's digit limit, nesting
      raise ApiError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(value, dict):
      raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    model = value.get("model")
    if model is not None and model != self.model_name:
      raise ApiError(
        404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model", "model_not_found"
      )
    return value

  async def health(self):
    engine = self.engine
    if not engine.alive():
      return JSONResponse({"status": "error", "error": engine.failure}, status_code=503)
    return {
      "status": "ok",
      "model": self.model_name,
      "slots": engine.slots,
      "busy_slots": engine.busy_slots(),
      "queued": engine.queued(),
    }

  async def models(self):
    model = dict(
      id=self.model_name, object="model", created=self.created, owned_by="llama_jax", max_model_len=self.engine.max_len
    )
    return {"object": "list", "data": [model]}

  async def page(self):
    return HTMLResponse(importlib.resources.files("llama_jax.serving").joinpath("static/chat.html").read_text("utf-8"))

  async def completions(self, request: HttpRequest):
    body = await self.read_json(request)
    engine, tokenizer = self.engine, self.tokenizer
    sampling = parse_sampling(body, engine.max_len, tokenizer.vocab_size, chat_api=False)
    prompts = parse_prompts(body, tokenizer)
    top_n = parse_logprobs(body, chat_api=False)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
      raise ApiError(400, f"echo: must be true or false, got {echo!r}", "echo", "invalid_value")
    if body.get("suffix") is not None:
      raise ApiError(400, "suffix: is not supported by this server", "suffix", "invalid_value")
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if sampling.max_tokens is None else sampling.max_tokens
    if max_tokens == 0 and not echo:
      raise ApiError(
        400, "max_tokens: must be ≥ 1 unless echo is true (0 scores the prompt)", "max_tokens", "invalid_value"
      )
    if len(prompts) * sampling.n > MAX_CHOICES:
      message = f"n: {len(prompts)} prompts × n {sampling.n} is more than the {MAX_CHOICES} choices of one request"
      raise ApiError(400, message, "n", "invalid_value")
    jobs = [(i, prompt) for prompt in prompts for i in range(sampling.n)]
    runs = [Run(engine, tokenizer, prompt, max_tokens, sampling, top_n, echo, i, self.metrics) for i, prompt in jobs]
    return await self.respond(request, runs, sampling, chat_api=False)

  async def chat_completions(self, request: HttpRequest):
    body = await self.read_json(request)
    engine, tokenizer = self.engine, self.tokenizer
    sampling = parse_sampling(body, engine.max_len, tokenizer.vocab_size, chat_api=True)
    prompt = parse_messages(body, tokenizer)
    top_n = parse_logprobs(body, chat_api=True)
    max_tokens = sampling.max_tokens
    if max_tokens is None:
      max_tokens = max(engine.max_len - len(prompt), 1)
    if max_tokens == 0:
      raise ApiError(400, "max_tokens: must be ≥ 1", "max_tokens", "invalid_value")
    runs = [
      Run(engine, tokenizer, prompt, max_tokens, sampling, top_n, False, i, self.metrics) for i in range(sampling.n)
    ]
    return await self.respond(request, runs, sampling, chat_api=True)


async def _api_error(_, error: ApiError):
  return error_response(error)


async def _http_error(_, error: HTTPException):
  code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
  return error_response(ApiError(error.status_code, str(error.detail), code=code))


async def _bug(_, error: Exception):  # a bug, not bad input: still an answer a client can read
  return error_response(ApiError(500, f"internal error: {type(error).__name__}: {error}", code="internal_error"))


async def _validation_error(_, error: RequestValidationError):
  return error_response(ApiError(400, str(error), code="invalid_request"))


def create_app(
  engine: Engine,
  tokenizer,
  model_name: str,
  api_key: str | None = None,
  max_body_bytes: int = 0,
  *,
  allowed_origins: tuple[str, ...] = (),
  loopback_only: bool = True,
  stream_buffer_tokens: int = STREAM_BUFFER_TOKENS,
):
  """The OpenAI-compatible FastAPI application over a continuous-batching engine.

  Its routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET / (the chat page) and
  GET /metrics. Every error is answered in OpenAI's shape, a bug included. Who may call is checked before any handler
  runs (access.py), and every request, refusals included, is counted in the metrics. The engine must be started by
  the caller, or by ``python -m llama_jax.serve``.

  Args:
    engine: the engine that runs the requests.
    tokenizer: the model's tokenizer, for prompts, chat messages and the outputs.
    model_name: the one model the server serves: what /v1/models lists and a request's "model" must name.
    api_key: the key the /v1/ routes and /metrics require, or None for no key.
    max_body_bytes: the largest request body, or 0 for `DEFAULT_MAX_BODY_MB` mebibytes.
    allowed_origins: origins other than the server's own whose web pages may call it.
    loopback_only: the server is bound to a loopback address, so a Host naming anything else is refused.
    stream_buffer_tokens: the tokens of one streamed choice that may wait for a client that reads nothing before
      its request is cancelled.

  Returns:
    The FastAPI application.
  """
  app = FastAPI(title="llama_jax", docs_url=None, redoc_url=None, openapi_url=None)
  max_body_bytes = max_body_bytes or DEFAULT_MAX_BODY_MB * 2**20
  access = Access(api_key, tuple(allowed_origins), loopback_only, max_body_bytes)
  endpoints = _Endpoints(engine, tokenizer, model_name, max_body_bytes, stream_buffer_tokens)
  for error_class, handler in (
    (ApiError, _api_error),
    (HTTPException, _http_error),
    (Exception, _bug),
    (RequestValidationError, _validation_error),
  ):
    app.add_exception_handler(error_class, handler)
  app.add_api_route("/health", endpoints.health, methods=["GET"])
  app.add_api_route("/v1/models", endpoints.models, methods=["GET"])
  app.add_api_route("/", endpoints.page, methods=["GET"], response_class=HTMLResponse)
  app.add_api_route("/v1/completions", endpoints.completions, methods=["POST"])
  app.add_api_route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"])
  app.add_api_route("/metrics", endpoints.prometheus, methods=["GET"])
  app.add_middleware(Guard, access=access, error_response=error_response)
  app.add_middleware(Instrument, metrics=endpoints.metrics)  # added last: outermost, so refusals are counted too
  return app
