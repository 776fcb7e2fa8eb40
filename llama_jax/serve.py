"""An OpenAI-compatible HTTP server over the continuous-batching engine, with a web chat page at `/`.

    python -m llama_jax.serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--slots 8] [--max_len L]
        [--api_key KEY] [--mesh data=1,tensor=-1] [--dtype bfloat16] [--quantize int8]

Endpoints: GET /v1/models, GET /health, POST /v1/completions, POST /v1/chat/completions (both stream as
server-sent events with `"stream": true`), GET / (the chat page). Errors come in OpenAI's shape with 400 (a bad
value, named with its allowed range; a prompt + max_tokens beyond the context), 401 (missing or wrong key when
--api_key is set), 404 (unknown model or route) and 413 (a body over --max_body_mb). The engine runs in its own
thread; each request waits on an asyncio queue that the engine fills.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator

try:
  from fastapi import FastAPI
  from fastapi import Request as HttpRequest
  from fastapi.exceptions import RequestValidationError
  from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
  from starlette.exceptions import HTTPException
except ImportError as error:  # pragma: no cover - the message is the point
  raise ImportError(f"{error}: the server needs its extra: pip install -e '.[serve]'") from error

from llama_jax import inference
from llama_jax.cli import ArgumentParser
from llama_jax.engine import PREFILL_TOKENS, STEPS_PER_CALL, Engine, EngineBusy, EngineError, Output, Request
from llama_jax.errors import run_or_exit
from llama_jax.serve_protocol import (
  MAX_CHOICES,
  ApiError,
  Choice,
  parse_logprobs,
  parse_messages,
  parse_prompts,
  parse_sampling,
  prompt_logprobs,
)

DEFAULT_MAX_BODY_MB = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def error_response(error: ApiError) -> JSONResponse:
  headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
  return JSONResponse(error.body(), status_code=error.status, headers=headers)


class _Guard:
  """The key (when one is set) and the body size, checked before any handler reads the body. Plain ASGI, not
  Starlette's BaseHTTPMiddleware, under which a handler never sees its client disconnect."""

  def __init__(self, app, api_key: str | None, max_body_bytes: int):
    self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
      error = None
      if self.api_key and scope["path"].startswith("/v1/"):
        if headers.get("authorization", "") != f"Bearer {self.api_key}":
          error = ApiError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")
      length = headers.get("content-length")
      if error is None and length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
        message = f"request body of {length} bytes exceeds the limit of {self.max_body_bytes} bytes"
        error = ApiError(413, message, code="too_large")
      if error is not None:
        return await error_response(error)(scope, receive, send)
    return await self.app(scope, receive, send)


def create_app(engine: Engine, tokenizer, model_name: str, api_key: str | None = None, max_body_bytes: int = 0):
  """The FastAPI application (the engine must be started by the caller, or by `serve`)."""
  app = FastAPI(title="llama_jax", docs_url=None, redoc_url=None, openapi_url=None)
  created = int(time.time())
  max_body_bytes = max_body_bytes or DEFAULT_MAX_BODY_MB * 2**20

  @app.exception_handler(ApiError)
  async def _api_error(_, error: ApiError):
    return error_response(error)

  @app.exception_handler(HTTPException)
  async def _http_error(_, error: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    return error_response(ApiError(error.status_code, str(error.detail), code=code))

  @app.exception_handler(Exception)
  async def _bug(_, error: Exception):  # a bug, not bad input: still an answer a client can read
    return error_response(ApiError(500, f"internal error: {type(error).__name__}: {error}", code="internal_error"))

  @app.exception_handler(RequestValidationError)
  async def _validation_error(_, error: RequestValidationError):
    return error_response(ApiError(400, str(error), code="invalid_request"))

  async def read_json(request: HttpRequest) -> dict:
    body = b""
    async for chunk in request.stream():
      body += chunk
      if len(body) > max_body_bytes:
        raise ApiError(413, f"request body exceeds the limit of {max_body_bytes} bytes", code="too_large")
    try:
      value = json.loads(body)
    except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, integers past Python's digit limit, nesting
      raise ApiError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(value, dict):
      raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    model = value.get("model")
    if model is not None and model != model_name:
      raise ApiError(
        404, f"model {model!r} does not exist; this server serves {model_name!r}", "model", "model_not_found"
      )
    return value

  @app.get("/health")
  async def health():
    if not engine.alive():
      return JSONResponse({"status": "error", "error": engine.failure}, status_code=503)
    return {
      "status": "ok",
      "model": model_name,
      "slots": engine.slots,
      "busy_slots": engine.busy_slots(),
      "queued": engine.queued(),
    }

  @app.get("/v1/models")
  async def models():
    return {
      "object": "list",
      "data": [
        {
          "id": model_name,
          "object": "model",
          "created": created,
          "owned_by": "llama_jax",
          "max_model_len": engine.max_len,
        }
      ],
    }

  @app.get("/", response_class=HTMLResponse)
  async def page():
    return HTMLResponse(importlib.resources.files("llama_jax").joinpath("static/chat.html").read_text("utf-8"))

  @app.post("/v1/completions")
  async def completions(request: HttpRequest):
    body = await read_json(request)
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
    runs = [_Run(engine, tokenizer, prompt, max_tokens, sampling, top_n, echo, seed_offset=i) for i, prompt in jobs]
    _check_context(engine, runs)
    return await _respond(request, runs, sampling, chat_api=False, model_name=model_name)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: HttpRequest):
    body = await read_json(request)
    sampling = parse_sampling(body, engine.max_len, tokenizer.vocab_size, chat_api=True)
    prompt = parse_messages(body, tokenizer)
    top_n = parse_logprobs(body, chat_api=True)
    max_tokens = sampling.max_tokens
    if max_tokens is None:
      max_tokens = max(engine.max_len - len(prompt), 1)
    if max_tokens == 0:
      raise ApiError(400, "max_tokens: must be ≥ 1", "max_tokens", "invalid_value")
    runs = [_Run(engine, tokenizer, prompt, max_tokens, sampling, top_n, False, i) for i in range(sampling.n)]
    _check_context(engine, runs)
    return await _respond(request, runs, sampling, chat_api=True, model_name=model_name)

  async def _respond(http_request, runs, sampling, *, chat_api: bool, model_name: str):
    response_id = ("chatcmpl-" if chat_api else "cmpl-") + uuid.uuid4().hex
    kind = "chat.completion" if chat_api else "text_completion"
    loop = asyncio.get_running_loop()
    try:
      for run in runs:
        run.start(loop)
    except EngineError as error:  # the queue is full, or the engine has stopped: nothing of this request runs
      for run in runs:
        run.cancel()
      raise ApiError(503, str(error), code="overloaded" if isinstance(error, EngineBusy) else "engine_error") from None
    if sampling.stream:
      events = _stream(runs, response_id, kind, chat_api, model_name, sampling.include_usage)
      return StreamingResponse(_sse(events, runs, engine), media_type="text/event-stream")
    try:
      await _wait_all(http_request, runs)
    finally:
      for run in runs:
        run.cancel()
    errors = [run.error for run in runs if run.error]
    if errors:
      raise ApiError(500, f"the engine failed: {errors[0]}", code="engine_error")
    choices = [run.final_choice(index, chat_api) for index, run in enumerate(runs)]
    return {
      "id": response_id,
      "object": kind,
      "created": int(time.time()),
      "model": model_name,
      "choices": choices,
      "usage": _usage(runs),
    }

  app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
  return app


def _check_context(engine: Engine, runs) -> None:
  for run in runs:
    try:
      engine.validate(run.request)
    except EngineError as error:
      code = "context_length_exceeded" if "exceeds the context" in str(error) else "invalid_value"
      raise ApiError(400, str(error), "max_tokens" if code == "context_length_exceeded" else None, code) from None


class _Run:
  """One choice: its engine request, the queue the engine thread fills, and the text built from it."""

  def __init__(self, engine, tokenizer, prompt, max_tokens, sampling, top_n, echo, seed_offset):
    self.engine, self.tokenizer, self.prompt, self.echo = engine, tokenizer, prompt, echo
    self.top_n, self.copy = top_n, seed_offset  # copy i of the same prompt (n > 1)
    seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
    self.request = Request(
      prompt=prompt,
      max_tokens=max_tokens,
      on_output=self._on_output,
      temperature=sampling.temperature,
      top_k=sampling.top_k,
      top_p=sampling.top_p,
      seed=(seed + seed_offset) % 2**32,
      logprobs=top_n is not None,
      prompt_logprobs=echo and top_n is not None,
    )
    self.prefix_text = ""
    self.prompt_listing = None
    if echo and top_n is None:
      self.prefix_text = tokenizer.decode(prompt)
    self.choice = Choice(tokenizer, prompt, sampling.stop, top_n, text_offset=len(self.prefix_text))
    self.finish_reason: str | None = None
    self.error: str | None = None
    self.queue: asyncio.Queue | None = None
    self.loop = None

  def start(self, loop) -> None:
    self.queue, self.loop = asyncio.Queue(), loop
    self.engine.submit(self.request)

  def _on_output(self, output: Output) -> None:  # the engine's thread
    try:
      self.loop.call_soon_threadsafe(self.queue.put_nowait, output)
    except RuntimeError:  # the event loop is closed (server shutting down): nobody is waiting
      self.engine.cancel(self.request)

  def take(self, output: Output) -> bool:
    """Folds one engine output into the text; True when this choice is finished."""
    if output.prompt_logprobs is not None:
      self.prefix_text, self.prompt_listing = prompt_logprobs(
        self.tokenizer, self.prompt, output.prompt_logprobs, output.prompt_top_logprobs, self.top_n
      )
      self.choice.text_offset = len(self.prefix_text)
    if output.tokens:
      self.choice.add(output.tokens, output.logprobs, output.top_logprobs)
    if output.finish_reason == "error":
      self.error = output.error
    if self.choice.stopped and self.finish_reason is None:
      self.finish_reason = "stop"
      self.engine.cancel(self.request)
    elif output.finish_reason is not None and self.finish_reason is None:
      self.finish_reason = "stop" if output.finish_reason == "stop" else "length"
      self.choice.finish()
      if output.eos_logprob is not None:
        self.choice.add_eos(self.engine.eos_id, output.eos_logprob, output.eos_top_logprobs)
    return self.finish_reason is not None or output.finish_reason is not None

  def cancel(self) -> None:
    if not self.request.finished:
      self.engine.cancel(self.request)

  def final_choice(self, index: int, chat_api: bool) -> dict:
    text = self.choice.text
    logprobs = None
    if self.top_n is not None:
      generated = self.choice.logprobs
      if self.prompt_listing is not None:
        logprobs = _joined(self.prompt_listing, generated)
      else:
        logprobs = generated.chat_since(0) if chat_api else generated.since(0)
    if chat_api:
      return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": self.finish_reason,
      }
    return {"index": index, "text": self.prefix_text + text, "logprobs": logprobs, "finish_reason": self.finish_reason}


def _joined(prompt_listing, generated) -> dict:
  first, second = prompt_listing.since(0), generated.since(0)
  return {name: first[name] + second[name] for name in first}


def _usage(runs) -> dict:
  prompt_tokens = sum(len(run.prompt) for run in runs if run.copy == 0)  # with n > 1 a prompt counts once
  completion_tokens = sum(run.choice.n_tokens for run in runs)
  return {
    "prompt_tokens": prompt_tokens,
    "completion_tokens": completion_tokens,
    "total_tokens": prompt_tokens + completion_tokens,
  }


DISCONNECT_CHECK_S = 0.5


async def _wait_all(http_request, runs) -> None:
  """Until every run has finished; a client that goes away (checked every DISCONNECT_CHECK_S, whether or not
  tokens arrive) makes this return, and the caller cancels the runs."""
  checked = time.monotonic()
  for run in runs:
    while True:
      try:
        output = await asyncio.wait_for(run.queue.get(), timeout=DISCONNECT_CHECK_S)
      except asyncio.TimeoutError:
        output = None
      if output is not None and run.take(output):
        break
      if time.monotonic() - checked >= DISCONNECT_CHECK_S:
        checked = time.monotonic()
        if await http_request.is_disconnected():
          return


async def _stream(runs, response_id, kind, chat_api, model_name, include_usage) -> AsyncIterator[dict]:
  """The chunks of a streamed response: for chat a first delta with the role, then text deltas per choice as
  tokens arrive (merged from all choices in arrival order), one chunk per choice with its finish_reason, and the
  usage chunk when asked."""
  created = int(time.time())
  chunk_kind = "chat.completion.chunk" if chat_api else "text_completion"

  def chunk(index, text, finish_reason=None, logprobs=None, role=None):
    if chat_api:
      delta = {"role": role} if role else {}
      if text or not role:
        delta["content"] = text
      if finish_reason is not None:
        delta = {}
      choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
      choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": response_id, "object": chunk_kind, "created": created, "model": model_name, "choices": [choice]}

  if chat_api:
    for index in range(len(runs)):
      yield chunk(index, "", role="assistant")
  pending = {index: asyncio.ensure_future(run.queue.get()) for index, run in enumerate(runs)}
  sent_logprobs = [0] * len(runs)
  echoed = [False] * len(runs)
  try:
    while pending:
      done, _ = await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
      for index in [i for i, task in pending.items() if task in done]:
        run = runs[index]
        finished = run.take(pending.pop(index).result())
        if run.error:
          yield {
            "error": {
              "message": f"the engine failed: {run.error}",
              "type": "server_error",
              "param": None,
              "code": "engine_error",
            }
          }
          return
        text = run.choice.new_text(final=finished)
        first = run.echo and not echoed[index]
        if first:
          text = run.prefix_text + text
        logprobs, sent = None, sent_logprobs[index]
        if run.top_n is not None:
          listing = run.choice.logprobs
          # Only the tokens whose text is out (all at the end, the eos entry included); a stop string cut the list.
          upto = len(listing.tokens) if finished else _tokens_within(listing, run.choice.text_offset + run.choice.sent)
          if upto > sent or (first and run.prompt_listing is not None):
            if chat_api:
              logprobs = {"content": listing.chat_since(sent)["content"][: upto - sent]}
            else:
              logprobs = {name: values[: upto - sent] for name, values in listing.since(sent).items()}
              if first and run.prompt_listing is not None:
                logprobs = _joined(run.prompt_listing, _Listing(logprobs))
            sent = upto
        if text or logprobs:
          yield chunk(index, text, logprobs=logprobs)
          sent_logprobs[index] = sent
          echoed[index] = echoed[index] or first
        if finished:
          yield chunk(index, "", finish_reason=run.finish_reason)
        else:
          pending[index] = asyncio.ensure_future(run.queue.get())
    if include_usage:
      yield {
        "id": response_id,
        "object": chunk_kind,
        "created": created,
        "model": model_name,
        "choices": [],
        "usage": _usage(runs),
      }
  finally:
    for task in pending.values():
      task.cancel()


class _Listing:
  """A logprobs dict viewed as a LogprobList (for joining the prompt's in front of the first streamed chunk)."""

  def __init__(self, fields: dict):
    self.fields = fields

  def since(self, start: int) -> dict:
    return {name: values[start:] for name, values in self.fields.items()}


def _tokens_within(listing, end_offset: int) -> int:
  return sum(1 for offset in listing.text_offset if offset < end_offset)


async def _sse(events: AsyncIterator[dict], runs, engine) -> AsyncIterator[bytes]:
  """Server-sent events ending with `data: [DONE]`; when the client goes away (the generator is closed), every
  run still going is cancelled and its slot freed."""
  try:
    async for event in events:
      yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
    yield b"data: [DONE]\n\n"
  finally:
    for run in runs:
      run.cancel()


def serve(args) -> None:
  """Loads the checkpoint, starts the engine and serves until interrupted."""
  import uvicorn

  from llama_jax.sample import load_sampler, report_placement

  if args.slots < 1:
    raise EngineError(f"--slots must be ≥ 1, got {args.slots}")
  if args.max_queue < 1:
    raise EngineError(f"--max_queue must be ≥ 1, got {args.max_queue}")
  if args.max_prefill_tokens is not None and args.max_prefill_tokens < 1:
    raise EngineError(f"--max_prefill_tokens must be ≥ 1, got {args.max_prefill_tokens}")
  if not 0 < args.port < 65536:
    raise EngineError(f"--port must be in [1, 65535], got {args.port}")
  mesh = inference.decode_mesh(args.mesh)
  sampler, tokenizer = load_sampler(args.checkpoint, mesh, args.dtype, args.quantize, args.step)
  report_placement(sampler)
  engine = Engine(
    sampler,
    slots=args.slots,
    max_len=args.max_len,
    steps_per_call=args.steps_per_call,
    max_queue=args.max_queue,
    max_prefill_tokens=args.max_prefill_tokens,
  )
  name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
  api_key = args.api_key or os.environ.get("LLAMA_JAX_API_KEY")
  app = create_app(engine, tokenizer, name, api_key=api_key, max_body_bytes=int(args.max_body_mb * 2**20))
  seconds = engine.warmup()
  engine.start()
  print(
    f"serving {name!r} on http://{args.host}:{args.port} ({engine.slots} slots × {engine.max_len} tokens"
    f"{', API key required' if api_key else ''}; programs compiled in {seconds:.1f} s)",
    file=sys.stderr,
    flush=True,
  )
  try:
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
  finally:
    engine.stop()


def add_serve_flags(parser) -> None:
  parser.add_argument(
    "--checkpoint", required=True, help="llama_jax checkpoint directory (a workdir or convert output)"
  )
  parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
  parser.add_argument("--port", type=int, default=8000)
  parser.add_argument("--slots", type=int, default=8, help="requests decoded together (one KV cache row each)")
  parser.add_argument("--max_len", type=int, help="tokens per slot, prompt + completion (default: max_seq_len)")
  parser.add_argument("--steps_per_call", type=int, default=STEPS_PER_CALL, help="decode steps per compiled call")
  parser.add_argument(
    "--max_prefill_tokens",
    type=int,
    help=f"rows × prompt bucket prefilled in one call (default: max_len or {PREFILL_TOKENS}, the larger)",
  )
  parser.add_argument(
    "--max_queue", type=int, default=1024, help="requests waiting for a slot before new ones get 503 (overloaded)"
  )
  parser.add_argument("--api_key", help="require 'Authorization: Bearer KEY' (or set LLAMA_JAX_API_KEY)")
  parser.add_argument("--model_name", help="the model id clients use (default: the checkpoint's directory name)")
  parser.add_argument("--max_body_mb", type=float, default=DEFAULT_MAX_BODY_MB, help="largest request body accepted")
  parser.add_argument("--log_level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
  inference.add_model_flags(parser)


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog="python -m llama_jax.serve", description=__doc__.split("\n\n")[0])
  add_serve_flags(parser)
  args = parser.parse_args(argv)
  with contextlib.suppress(KeyboardInterrupt):
    run_or_exit(serve, args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
