"""One request's runs through the engine and back as OpenAI's response: each choice's engine request and the text
built from its outputs (``Run``), the non-streaming wait, and the streamed chunks as server-sent events.

The engine runs in its own thread; each run waits on an asyncio queue that the engine fills.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from llama_jax.inference.engine import Engine
from llama_jax.inference.requests import EngineError, Output, Request
from llama_jax.serving.metrics import ServerMetrics, TokenTimer
from llama_jax.serving.protocol import ApiError, Choice, prompt_logprobs


def check_context(engine: Engine, runs) -> None:
  """Refuses a request whose prompt + max_tokens (or other settings) the engine cannot run: a 400 with the field and
  the kind the engine's error names."""
  for run in runs:
    try:
      engine.validate(run.request)
    except EngineError as error:
      raise ApiError(400, str(error), error.param, error.code or "invalid_value") from None


class Run:
  """One choice: its engine request, the queue the engine thread fills, and the text built from it."""

  def __init__(self, engine, tokenizer, prompt, max_tokens, sampling, top_n, echo, seed_offset, metrics=None):
    self.engine, self.tokenizer, self.prompt, self.echo = engine, tokenizer, prompt, echo
    self.metrics: ServerMetrics | None = metrics
    self.timer: TokenTimer | None = None
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
    self.buffer: int | None = None
    self.unsent = 0  # tokens handed over by the engine and not yet taken into the response
    self.overflowed = False  # cancelled for a client that read nothing (see STREAM_BUFFER_TOKENS)
    self.writing = False  # the stream's handler is inside a write to the client (see `sse`)

  def start(self, loop, buffer: int | None = None) -> None:
    """Submits the request; with `buffer`, it is cancelled once more than that many of its tokens wait unsent."""
    self.queue, self.loop, self.buffer = asyncio.Queue(), loop, buffer
    if self.metrics is not None:
      self.timer = TokenTimer(self.metrics)
    self.engine.submit(self.request)

  def _on_output(self, output: Output) -> None:  # the engine's thread
    if self.timer is not None:
      self.timer.arrived(len(output.tokens))
    try:
      self.loop.call_soon_threadsafe(self._arrive, output)
    except RuntimeError:  # the event loop is closed (server shutting down): nobody is waiting
      self.engine.cancel(self.request)

  def _arrive(self, output: Output) -> None:
    """On the event loop, which runs while a stream's handler waits for its client to read. Outputs also pile up
    while the handler is merely slow (a busy event loop on a loaded host), so the limit is applied only to an output
    that arrives while the handler is inside a write: a write suspends only when the transport has paused for a
    client that reads nothing."""
    waiting = self.unsent  # tokens of earlier outputs still in the queue: 0 while the client keeps up
    self.queue.put_nowait(output)
    self.unsent += len(output.tokens)
    if self.buffer is not None and self.writing and waiting > self.buffer and not self.request.cancelled:
      self.engine.cancel(self.request)  # frees the slot before the next step
      self.overflowed = True
      message = f"the client read nothing while {waiting} tokens waited (the limit is {self.buffer}); cancelled"
      self.queue.put_nowait(Output([], finish_reason="error", error=message))

  def take(self, output: Output) -> bool:
    """Folds one engine output into the text; True when this choice is finished."""
    self.unsent -= len(output.tokens)
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
        self.choice.add_eos(output.eos_id, output.eos_logprob, output.eos_top_logprobs)
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
        logprobs = joined(self.prompt_listing, generated)
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


def joined(prompt_listing, generated) -> dict:
  first, second = prompt_listing.since(0), generated.since(0)
  return {name: first[name] + second[name] for name in first}


def usage(runs) -> dict:
  prompt_tokens = sum(len(run.prompt) for run in runs if run.copy == 0)  # with n > 1 a prompt counts once
  completion_tokens = sum(run.choice.n_tokens for run in runs)
  return {
    "prompt_tokens": prompt_tokens,
    "completion_tokens": completion_tokens,
    "total_tokens": prompt_tokens + completion_tokens,
  }


DISCONNECT_CHECK_S = 0.5
# Tokens of one streamed choice that may wait for a client that reads nothing, beyond what the connection's buffers
# hold (the transport's 64 KiB and the kernel's); past it the choice is cancelled and its slot freed. A client that
# reads at any pace keeps this near 0: the handler takes each output as soon as the previous chunk is written. Tokens
# that wait only because the handler is slow (the engine's thread and the event loop sharing two cores) do not count:
# a CI run saw a reading client's stream cancelled that way.
STREAM_BUFFER_TOKENS = 256


async def wait_all(http_request, runs) -> None:
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


async def stream_chunks(runs, response_id, kind, chat_api, model_name, include_usage) -> AsyncIterator[dict]:
  """The chunks of a streamed response: for chat a first delta with the role, then text deltas per choice as
  tokens arrive (merged from all choices in arrival order), one chunk per choice with its finish_reason, and the
  usage chunk when asked. One async generator over the runs' queues, read top to bottom as the chunks go out."""
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
          if run.overflowed:
            code, message = "client_too_slow", run.error
          else:
            code, message = "engine_error", f"the engine failed: {run.error}"
          yield {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
          return
        text = run.choice.new_text(final=finished)
        first = run.echo and not echoed[index]
        if first:
          text = run.prefix_text + text
        logprobs, sent = _new_logprobs(run, sent_logprobs[index], finished, first, chat_api)
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
        "usage": usage(runs),
      }
  finally:
    for task in pending.values():
      task.cancel()


def _new_logprobs(run: Run, sent: int, finished: bool, first: bool, chat_api: bool) -> tuple[dict | None, int]:
  """(the logprobs of a streamed chunk, how many tokens have been sent with it): the tokens whose text is out (all at
  the end, the eos entry included; a stop string cut the list), and with echo the prompt's before the first."""
  if run.top_n is None:
    return None, sent
  listing = run.choice.logprobs
  upto = len(listing.tokens) if finished else tokens_within(listing, run.choice.text_offset + run.choice.sent)
  if not (upto > sent or (first and run.prompt_listing is not None)):
    return None, sent
  if chat_api:
    return {"content": listing.chat_since(sent)["content"][: upto - sent]}, upto
  logprobs = {name: values[: upto - sent] for name, values in listing.since(sent).items()}
  if first and run.prompt_listing is not None:
    logprobs = joined(run.prompt_listing, Listing(logprobs))
  return logprobs, upto


class Listing:
  """A logprobs dict viewed as a LogprobList (for joining the prompt's in front of the first streamed chunk)."""

  def __init__(self, fields: dict):
    self.fields = fields

  def since(self, start: int) -> dict:
    return {name: values[start:] for name, values in self.fields.items()}


def tokens_within(listing, end_offset: int) -> int:
  return sum(1 for offset in listing.text_offset if offset < end_offset)


async def sse(events: AsyncIterator[dict], runs, metrics: ServerMetrics | None) -> AsyncIterator[bytes]:
  """Server-sent events ending with `data: [DONE]`; when the client goes away (the generator is closed), every
  run still going is cancelled and its slot freed."""
  try:
    async for event in events:
      for run in runs:  # the write of this chunk runs while the generator is suspended here
        run.writing = True
      yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
      for run in runs:
        run.writing = False
    yield b"data: [DONE]\n\n"
  finally:
    for run in runs:
      run.cancel()
    if metrics is not None:
      metrics.count_usage(usage(runs))


async def respond(
  engine: Engine,
  http_request,
  runs,
  sampling,
  *,
  chat_api: bool,
  model_name: str,
  buffer: int = STREAM_BUFFER_TOKENS,
  metrics: ServerMetrics | None = None,
):
  """Starts every run of a request and answers it: a JSON response once all are done, or with `stream` a stream of
  server-sent events as tokens arrive. A client that goes away cancels its runs; so does a streaming client that
  leaves more than `buffer` tokens of a choice unread."""
  response_id = ("chatcmpl-" if chat_api else "cmpl-") + uuid.uuid4().hex
  kind = "chat.completion" if chat_api else "text_completion"
  loop = asyncio.get_running_loop()
  try:
    for run in runs:
      run.start(loop, buffer if sampling.stream else None)
  except EngineError as error:  # the queue is full, or the engine has stopped: nothing of this request runs
    for run in runs:
      run.cancel()
    raise ApiError(503, str(error), code=error.code or "engine_error") from None
  if sampling.stream:
    events = stream_chunks(runs, response_id, kind, chat_api, model_name, sampling.include_usage)
    return StreamingResponse(sse(events, runs, metrics), media_type="text/event-stream")
  try:
    await wait_all(http_request, runs)
  finally:
    for run in runs:
      run.cancel()
    if metrics is not None:
      metrics.count_usage(usage(runs))
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
    "usage": usage(runs),
  }
